#pragma once
/// \file schedule.hpp
/// \brief Pipeline schedules as data (docs/simulator.md): for every pipeline stage an
/// ordered list of tasks (phase, micro-batch, virtual model chunk). The DAG simulator
/// (pp/dag.hpp) and the pipeline executor both consume a Schedule; neither re-derives
/// the order.
///
/// Virtual stages: with `chunks = v` model chunks per stage (interleaved 1F1B), chunk `c`
/// of stage `s` holds virtual stage `c * stages + s` (Megatron's layout): a micro-batch's
/// forward visits virtual stages 0, 1, ..., stages*v-1, i.e. stage 0..p-1 with chunk 0,
/// then stage 0..p-1 with chunk 1, and so on; backward visits them in reverse.
///
/// PackFlow (SlimPack plans): a task's micro-batch index names a forward MicroPack in the
/// forward and a backward MicroPack (the asymmetric partition) in the backward; the
/// schedule carries the slice dependencies (`Schedule::deps`) that tie the two together.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/types.hpp"
#include "model/cost_model.hpp"

namespace wlb::pp {

using model::Phase;

enum class ScheduleKind { GPipe, OneFOneB, Interleaved, PackFlow };

/// "gpipe" | "1f1b" | "interleaved" | "packflow" -> kind. Throws InputError naming
/// `pipeline.schedule`.
ScheduleKind parseScheduleKind(const std::string& name);
const char* scheduleKindName(ScheduleKind k);

/// One unit of work on one stage: the forward or backward of micro-batch `mb` through the
/// stage's model chunk `chunk`.
struct Task {
  Phase phase = Phase::Fwd;
  std::int32_t mb = 0;
  std::int32_t chunk = 0;
  bool operator==(const Task& o) const { return phase == o.phase && mb == o.mb && chunk == o.chunk; }
};

/// Dependency between two tasks of the same virtual stage, holding on every virtual stage:
/// (from_mb, from_phase) finishes before (to_mb, to_phase) starts.
struct TaskDep {
  int from_mb = 0;
  Phase from_phase = Phase::Fwd;
  int to_mb = 0;
  Phase to_phase = Phase::Fwd;
  bool operator==(const TaskDep& o) const {
    return from_mb == o.from_mb && from_phase == o.from_phase && to_mb == o.to_mb && to_phase == o.to_phase;
  }
};

/// A pipeline schedule: `order[stage]` is the sequence of tasks that stage executes.
struct Schedule {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int stages = 1;         ///< p
  int micro_batches = 1;  ///< M
  int chunks = 1;         ///< v (virtual stages per stage; 1 unless interleaved)
  std::vector<std::vector<Task>> order;
  /// true: the backward of micro-batch m consumes the activations of forward m (every
  /// schedule but PackFlow). false: forward and backward units are different groupings of
  /// the same slices (PackFlow), and `deps` say which forward a backward waits for.
  bool paired = true;
  /// Dependencies beside stage order and the inter-stage transfers, on every virtual stage
  /// (PackFlow: a backward MicroPack after the forward of every slice it holds; a slice's
  /// backward after the backward of its sample's later slices). Empty for the others.
  std::vector<TaskDep> deps;

  int virtualStages() const { return stages * chunks; }
  /// Virtual stage index of (stage, chunk).
  int virtualStage(int stage, int chunk) const { return chunk * stages + stage; }
  int stageOf(int vstage) const { return vstage % stages; }
  int chunkOf(int vstage) const { return vstage / stages; }
  std::size_t taskCount() const {
    std::size_t n = 0;
    for (const auto& s : order) n += s.size();
    return n;
  }
};

/// The pipeline a deck asks for: schedule kind, stages (mesh.pp) and model chunks per
/// stage (mesh.virtual_stages, used only by the interleaved schedule). The simulator and
/// the executor both take their schedule from this.
struct PipelineLayout {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int stages = 1;
  int chunks = 1;
  Schedule schedule(int micro_batches) const;
};
/// InputError naming `pipeline.schedule` for an unknown kind.
PipelineLayout pipelineLayout(const Deck& deck);

/// Layers [first, first + count) of one virtual stage. `layers` transformer layers are
/// split over `vstages` virtual stages in order; when they do not divide evenly the first
/// `layers % vstages` virtual stages hold one layer more (the extra layers go early: the
/// last stage also computes the loss).
struct LayerBlock {
  int first = 0, count = 0;
};
/// Throws InputError naming `model.layers` when a virtual stage would get no layer.
LayerBlock layerBlock(int layers, int vstages, int vstage);

/// GPipe: every stage runs all M forwards, then all M backwards (in reverse order, the
/// order activations are freed most recently first — GPipe's usual flush order; backward
/// in increasing order gives the same makespan for equal micro-batches).
Schedule makeGPipe(int stages, int micro_batches);

/// 1F1B (PipeDream-Flush / Megatron non-interleaved): stage s runs min(p-s-1, M) warm-up
/// forwards, then alternates one forward and one backward, then drains the backwards.
Schedule makeOneFOneB(int stages, int micro_batches);

/// Interleaved 1F1B (Megatron, Narayanan et al. SC'21) with `chunks` model chunks per stage.
/// Like Megatron, requires M % stages == 0 (InputError otherwise). Forwards go in groups
/// of `stages` micro-batches per chunk; stage s runs (p-s-1)*2 + (v-1)*p warm-up forwards
/// (all forwards when M == p, as Megatron does), then 1F1B, then the cool-down backwards.
Schedule makeInterleaved(int stages, int micro_batches, int chunks);

// ---- PackFlow (SlimPack) -----------------------------------------------------------------

/// One replica of a SlimPack plan seen slice by slice: its segments in forward order
/// (MicroPack 0's, then 1's, ...), the forward and backward MicroPack of each, and both
/// groupings as cut points into that order. The one place that maps a plan's
/// `replicas[r]` and `backward[r]` (core/types.hpp) to slices.
struct ReplicaSlices {
  std::vector<Segment> segments;
  std::vector<std::int64_t> fwd_cuts, bwd_cuts;  ///< M+1 each
  std::vector<int> fwd_pack, bwd_pack;           ///< per segment
  /// Per segment: the segment of its document that ends where it starts, or -1.
  std::vector<std::int64_t> prev;
  /// Per segment: a slice of its document starts where it ends (its K/V are that slice's
  /// keys, and it receives their gradient).
  std::vector<char> continued;
  int microPacks() const { return static_cast<int>(fwd_cuts.size()) - 1; }
};
/// `bwd_cuts` empty: the backward grouping is the forward one. Throws InputError naming the
/// plan's `backward` when the cut points are not M+1 non-decreasing points from 0 to the
/// segment count.
ReplicaSlices replicaSlices(const std::vector<MicroBatch>& fwd, const std::vector<std::int64_t>& bwd_cuts = {});

/// What PackFlow orders in one replica's step. Backward MicroPack k may start once forward
/// MicroPack `needs[k]` has run (the forward of its last slice; -1 when it holds nothing),
/// and for each pair (b, a) in `before`, backward b runs before backward a (b holds the next
/// slice of a sample whose earlier slice a holds: slices of a sample run last-in-first-out
/// in the backward). Empty: every backward needs its own forward only (no slices).
struct PackFlowDeps {
  std::vector<int> needs;
  std::vector<std::pair<int, int>> before;
  bool trivial() const;  ///< no slices and the backward grouping is the forward one
};
/// The dependencies of a replica's slices: a slice (q_offset > 0) depends on the segment of
/// its document that ends where it starts. InputError when a sample's later slice is in an
/// earlier forward MicroPack than the slice before it (forwards run FIFO).
PackFlowDeps packFlowDeps(const ReplicaSlices& r);

/// PackFlow's dependencies of replica `d` of a plan (`r` = its slices): packFlowDeps, and
/// every DP-Merge slot the replica is a member of needs its own forward, so every member
/// orders the merged units by slot alike and their collectives match.
PackFlowDeps planFlowDeps(const StepPlan& plan, std::size_t d, const ReplicaSlices& r);

/// The backward MicroPack order of PackFlow: a topological order of `before` that takes,
/// of the backwards free to go, the one whose forward need comes first (empty backward
/// MicroPacks last). Trivial deps give 0, 1, ..., M-1. InputError on a cycle.
std::vector<int> packFlowBackwardOrder(int micro_batches, const PackFlowDeps& deps);

/// PackFlow: MicroPacks enter the pipeline FIFO (forward 0, 1, ..., M-1 on every stage);
/// after each forward, stage s runs the next backward k of packFlowBackwardOrder once
/// p-s-1 forwards beyond `needs[k]` have run (1F1B's warm-up, counted from what the
/// backward needs), and the remaining backwards after the last forward. With trivial deps
/// (no slices, one grouping) this is exactly 1F1B. The schedule holds the dependencies
/// (`paired = false`).
Schedule makePackFlow(int stages, int micro_batches, const PackFlowDeps& deps = {});

/// Dispatch on kind (`chunks` is used only by Interleaved; chunks == 1 with Interleaved
/// falls back to 1F1B; PackFlow without a plan's slices is its trivial form, 1F1B's order).
Schedule makeSchedule(ScheduleKind kind, int stages, int micro_batches, int chunks = 1);

/// Structural validity: each (phase, mb, chunk) task appears exactly once on its stage,
/// on every stage a micro-batch's backward of a chunk comes after its forward (when
/// `paired`), and every dependency in `deps` holds in each stage's order.
/// Throws std::logic_error describing the first violation. (Deadlock-freedom across
/// stages is checked by the DAG builder, which rejects cyclic schedules.)
void validateSchedule(const Schedule& s);

/// Human-readable one-line-per-stage rendering ("F0 F1 B0 ..."; chunk as F0.1).
std::string renderSchedule(const Schedule& s);

}  // namespace wlb::pp
