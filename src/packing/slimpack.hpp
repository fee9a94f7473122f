#pragma once
/// \file slimpack.hpp
/// \brief The `slimpack` planner's pure pieces (docs/packing.md, docs/algorithms.md):
/// causal-slice boundaries solved under the cost model, the per-replica MicroPack fill, the
/// backward (asymmetric) partition and the MicroPack-count candidates. The packer itself
/// is created by makePacker("slimpack", ...).

#include <cstdint>
#include <vector>

#include "core/types.hpp"
#include "model/cost_model.hpp"

namespace wlb::packing::slimpack {

/// Forward / backward FLOPs of one layer for queries [q0, q0+q) of a document with its
/// key prefix: attention (as a CP piece) plus the linear ops of q tokens.
double sliceFlops(const model::CostModel& cost, std::int64_t q0, std::int64_t q, model::Phase p);

/// Slice length q in [0, max_q] whose forward FLOPs from q0 are nearest to `budget`
/// (the root of the causal quadratic, rounded to the nearest token).
std::int64_t solveSliceLength(const model::CostModel& cost, std::int64_t q0, double budget, std::int64_t max_q);

/// Phase 2 for one replica: `m` MicroPacks of forward budget tau = sum f_fwd / m, none over
/// s_max tokens. Long documents (f_fwd > tau or longer than s_max) are cut into
/// consecutive causal slices that fill MicroPacks to tau, short ones are packed whole
/// (best fit on the remaining budget, at most 0.1% of tau overshoot per replica instead of
/// sliver slices), what fits nowhere whole is mixed in as slices up to a common level.
/// `balanced` is false when the token limit kept some MicroPack from its budget; then the
/// MicroPacks are filled by tokens alone (still every token, still within s_max).
/// `ok` is false only when sum tokens > m * s_max.
struct ReplicaPacks {
  std::vector<MicroBatch> packs;
  bool balanced = true, ok = true;
  double tau = 0;
};
/// `fwd_flops`: the documents' whole forward FLOPs (sliceFlops(0, length)) when the caller
/// has them (the packer's candidate counts share them), else computed here.
ReplicaPacks packReplica(const std::vector<Document>& docs, std::int64_t m, std::int64_t s_max,
                         const model::CostModel& cost, const std::vector<double>* fwd_flops = nullptr);

/// Fewer slices (the memory fallback): `m` MicroPacks of at most s_max tokens holding every
/// sample whole, largest forward FLOPs first into the MicroPack with the least so far that
/// has the room; only samples longer than s_max are cut, into consecutive slices that fill
/// MicroPacks by tokens from the first one on. `ok` is false when some sample fits nowhere
/// whole.
ReplicaPacks packReplicaWhole(const std::vector<Document>& docs, std::int64_t m, std::int64_t s_max,
                              const model::CostModel& cost);

/// Asymmetric partition: m+1 cut points into items (in forward order) minimising the
/// largest group's backward FLOPs, each group within s_max tokens; groups keep the order
/// (trailing groups may be empty when fewer suffice). With `chain` (per item: the sliced
/// sample it belongs to, or -1 for a whole one) no group holds slices of two sliced samples:
/// the cuts move to sample ends, so each sample's last-in-first-out backward stays a chain
/// of its own instead of linking the next sample's (and holding both samples' activations).
/// Empty when no m groups meet the limits.
std::vector<std::int64_t> backwardPartition(const std::vector<double>& bwd_flops,
                                            const std::vector<std::int64_t>& tokens, std::int64_t m, std::int64_t s_max,
                                            const std::vector<std::int64_t>* chain = nullptr);

/// MicroPack-count candidates i (m = i * pp): i_min + 2^k - 1 for k < n — dense next to the
/// smallest count that holds the tokens, sparser beyond — up to i_max (a MicroPack holds a
/// token at least: more would be empty units, and 2^k of them exhaust memory); i_min always.
std::vector<std::int64_t> candidateCounts(std::int64_t i_min, std::int64_t n, std::int64_t i_max);

}  // namespace wlb::packing::slimpack
