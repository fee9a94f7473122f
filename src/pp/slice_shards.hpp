#pragma once
/// \file slice_shards.hpp
/// \brief SlimPack slices under context parallelism (docs/runtime.md § Sliced execution):
/// where each segment of a replica's slices lives on the CP group. Pure C++ (no MPI): the
/// executor (runtime/sliced.hpp) and the simulator (pp::packFlowWork) use the same layout.
///
/// Contract:
/// * Forward MicroPack k is sharded by the CP planners (cp::planShards) as a micro-batch whose
///   slices carry the keys before them (cp::Piece::seg_prefix weighs in their cost). A
///   segment's queries stay on the ranks that plan gave them for the whole step.
/// * The rows of a unit (forward or backward MicroPack) on rank r are r's pieces of the
///   unit's segments, in segment order and, within a segment, in query order. A forward
///   MicroPack's rows on r are therefore r's local buffer of its shard plan.
/// * The unit's *packed* rows are its segments' tokens back to back; its *gathered* rows are
///   every rank's rows of the unit, rank after rank (an all-gather over the CP group).
///   gatherIndex maps the first onto the second: the one place this index math lives.
/// * cp = 1: every segment whole on rank 0 (no planner runs); packed = local = gathered.

#include <cstdint>
#include <string>
#include <vector>

#include "core/deck.hpp"
#include "cp/shard_plan.hpp"
#include "pp/schedule.hpp"

namespace wlb::model {
class CostModel;
}

namespace wlb::pp {

/// Per segment, its first row in its unit (cut points `cuts`) when unit rows are the
/// segments' `seg_rows` back to back: a rank's rows (SliceShards::rows) or, with the
/// segments' lengths, the packed rows.
std::vector<std::int64_t> unitOffsets(const std::vector<std::int64_t>& cuts, const std::vector<std::int64_t>& seg_rows);

struct SliceShards {
  /// A query range of one segment on one rank.
  struct Part {
    int rank = 0;
    std::int64_t q_offset = 0, q_len = 0;
  };
  int cp = 1;
  std::string strategy;                         ///< the strategy applied ("whole" at cp = 1)
  std::vector<std::vector<Part>> parts;         ///< [segment] by rank, then by q_offset
  std::vector<std::vector<std::int64_t>> rows;  ///< [rank][segment] the segment's rows on the rank

  /// Rows of unit k (cut points `cuts`: ReplicaSlices::fwd_cuts or bwd_cuts) on `rank`.
  std::int64_t unitRows(const std::vector<std::int64_t>& cuts, int k, int rank) const;
  /// First row of segment i in its unit (cut points `cuts`) on `rank`; [segment].
  std::vector<std::int64_t> firstRows(const std::vector<std::int64_t>& cuts, int rank) const {
    return unitOffsets(cuts, rows[static_cast<std::size_t>(rank)]);
  }
  /// For each packed row of unit k, its index among the unit's gathered rows; `counts` and
  /// `displs` (if given) receive unitRows of every rank and where each rank's rows start.
  std::vector<std::int64_t> gatherIndex(const std::vector<std::int64_t>& cuts, int k,
                                        std::vector<std::int64_t>* counts = nullptr,
                                        std::vector<std::int64_t>* displs = nullptr) const;
};

/// The CP layout of replica `r`'s segments over `cp` ranks, each forward MicroPack planned
/// by `strategy` (cp::planShards). InputError from the planners (bad names, cp < 1).
SliceShards sliceShards(const ReplicaSlices& r, const std::string& strategy, int cp, const model::CostModel& cost,
                        const CpConfig& cfg);

}  // namespace wlb::pp
