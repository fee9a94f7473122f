#pragma once
/// \file types.hpp
/// \brief The vocabulary of the planners (docs/architecture.md): documents, segments, micro-batches and the
/// per-step packing plan shared by packers, shard planners, executor, simulator and trace.

#include <cstdint>
#include <string>
#include <vector>

namespace wlb {

using DocId = std::int64_t;

/// One training sample as the length source produced it.
struct Document {
  DocId id = 0;                   ///< stream position (unique, increasing)
  std::int64_t length = 0;        ///< tokens
  std::int64_t arrival_step = 0;  ///< step at which the dataloader produced it
};

/// Longest document (tokens) a length file, plan or state may hold: the kernels index
/// tokens with 32-bit offsets, and a longer document would only be split into millions of
/// window chunks.
constexpr std::int64_t kMaxDocTokens = (std::int64_t{1} << 31) - 1;

/// A contiguous token range [offset, offset+length) of one document. Inside a packed
/// micro-batch a segment is the attention unit: its tokens attend causally to earlier
/// tokens of the same segment only (a document cut by the `original` packer starts a
/// fresh attention span in each sequence, as Megatron-style packing does).
///
/// A SlimPack *slice* (q_offset > 0) also attends to the q_offset document tokens before
/// it, which earlier slices of the same document (in earlier MicroPacks) computed: its
/// keys are the document tokens [offset - q_offset, offset + length), exactly a CP piece
/// with that q_offset (cp/shard_plan.hpp). Every packer but `slimpack` leaves it 0.
struct Segment {
  DocId doc = 0;
  std::int64_t offset = 0;
  std::int64_t length = 0;
  std::int64_t arrival_step = 0;  ///< copied from the document, for delay metrics
  std::int64_t q_offset = 0;      ///< keys before the first query (slice: = offset)
};

/// An ordered list of segments packed into one input sequence.
struct MicroBatch {
  std::vector<Segment> segments;
  std::int64_t tokens() const {
    std::int64_t t = 0;
    for (const auto& s : segments) t += s.length;
    return t;
  }
};

/// What one training step consumes: replicas[dp][m] micro-batches.
struct StepPlan {
  std::int64_t step = 0;
  std::vector<std::vector<MicroBatch>> replicas;
  /// Documents that arrived by this step but are held back (outlier queues, carry-over).
  std::vector<DocId> delayed;
  /// SlimPack's asymmetric partition: backward[r] holds M+1 increasing cut points into
  /// replica r's segments in forward order (micro-batch 0's, then 1's, ...); backward
  /// MicroPack k is the run [backward[r][k], backward[r][k+1]). Empty = each micro-batch
  /// is its own backward unit (every other packer).
  std::vector<std::vector<std::int64_t>> backward;
  /// SlimPack's DP-Merge: micro-batch `slot` of replica `group.front()` holds one sample
  /// that the replicas of `group` (ascending DP indices, the owner first) run together,
  /// sharded over them as a CP group; every other replica holds an empty micro-batch at
  /// that slot, and the slot is its own backward unit. Empty for every other packer.
  struct Merged {
    std::int64_t slot = 0;
    std::vector<std::int64_t> group;
    /// Position of replica r in the group (its CP rank there), or -1.
    int member(std::int64_t r) const {
      for (std::size_t i = 0; i < group.size(); ++i)
        if (group[i] == r) return static_cast<int>(i);
      return -1;
    }
  };
  std::vector<Merged> merged;
  /// SlimPack: how the step was fitted into the per-stage memory budget (docs/packing.md
  /// § slimpack). `partition`: "flops" (the FLOP-balanced backward cuts fit), "sample_ends"
  /// (backward cuts moved to sample ends), "whole_samples" (fewer slices: samples whole
  /// unless longer than a MicroPack holds, one grouping), "over" (nothing fits: the fastest
  /// plan), empty for every other packer. `held`: samples held back to the next step so
  /// that the step fits (they are in `delayed` too).
  struct MemoryFit {
    std::string partition;
    std::vector<DocId> held;
    std::vector<double> peak_bytes;  ///< [pp] predicted peak per stage: static + activations
    double budget_bytes = 0;         ///< the device memory the peaks are held to (0 = unknown)
  };
  MemoryFit memory;
  /// The merged unit at `slot`, or null.
  const Merged* mergedAt(std::int64_t slot) const {
    for (const auto& m : merged)
      if (m.slot == slot) return &m;
    return nullptr;
  }
};

}  // namespace wlb
