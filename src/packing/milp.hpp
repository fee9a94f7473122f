#pragma once
/// \file milp.hpp
/// \brief The fixed-length optimal packing ILP of docs/packing.md (fixed_optimal), solved with CBC:
///   minimise z  s.t.  sum_j x_ij = 1 (each item in one bin),
///                     sum_i d_i x_ij <= capacity (every bin),
///                     sum_i (d_i/capacity)^2 x_ij <= z (every bin),  x_ij binary.
/// Symmetry breaking: items sorted by decreasing length, item i may only use bins 0..i.
/// Also a brute-force reference for tiny instances (tests).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace wlb::packing {

struct MinMaxResult {
  std::vector<int> bin_of;  ///< bin of each item (input order); empty if infeasible
  double objective = 0;     ///< max_j sum_{i in j} d_i^2 (in tokens^2)
  double bound = 0;         ///< proven lower bound on the objective (tokens^2)
  double gap = 0;           ///< (objective - bound) / objective, 0 when proven optimal
  std::string status;       ///< "optimal" | "time_limit" | "infeasible" | "heuristic"
  std::string note;         ///< why the result is "heuristic" (reduced model, build over time)
  /// "optimal" from CBC: no assignment beats the objective by more than this (tokens^2; CBC's
  /// cutoff increment: it takes no incumbent that improves by less). 0: exact (trivial bound).
  double tolerance = 0;
  double seconds = 0;
  std::int64_t nodes = 0;
};

/// max_j sum d^2 of an assignment (tokens^2); +inf if it breaks capacity.
double minMaxObjective(const std::vector<std::int64_t>& lengths, const std::vector<int>& bin_of, int bins,
                       std::int64_t capacity);

/// Largest model CBC is given (binaries x_ij). Past it, only the longest items are free
/// and the rest keep the warm start (status "heuristic", bound = the trivial bound).
inline constexpr std::size_t kMaxBinaries = 4096;

/// Solve with CBC. `warm` (optional, same size as lengths, a feasible assignment) seeds
/// the incumbent; the result is never worse than it. time_limit in seconds (> 0) covers building the
/// model as well as solving it (CBC may overrun by its root processing of <= kMaxBinaries).
MinMaxResult solveMinMaxSquares(const std::vector<std::int64_t>& lengths, int bins, std::int64_t capacity,
                                double time_limit, const std::vector<int>* warm = nullptr);

/// Exhaustive search (bins^items assignments, with symmetry pruning); for <= ~10 items.
MinMaxResult bruteForceMinMaxSquares(const std::vector<std::int64_t>& lengths, int bins, std::int64_t capacity);

}  // namespace wlb::packing
