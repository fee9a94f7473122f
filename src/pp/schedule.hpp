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

#include <cstdint>
#include <string>
#include <vector>

#include "model/cost_model.hpp"

namespace wlb::pp {

using model::Phase;

enum class ScheduleKind { GPipe, OneFOneB, Interleaved };

/// "gpipe" | "1f1b" | "interleaved" -> kind. Throws InputError naming `pipeline.schedule`.
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

/// A pipeline schedule: `order[stage]` is the sequence of tasks that stage executes.
struct Schedule {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int stages = 1;         ///< p
  int micro_batches = 1;  ///< M
  int chunks = 1;         ///< v (virtual stages per stage; 1 unless interleaved)
  std::vector<std::vector<Task>> order;

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

/// Dispatch on kind (`chunks` is used only by Interleaved; chunks == 1 with Interleaved
/// falls back to 1F1B).
Schedule makeSchedule(ScheduleKind kind, int stages, int micro_batches, int chunks = 1);

/// Structural validity: each (phase, mb, chunk) task appears exactly once on its stage,
/// and on every stage a micro-batch's backward of a chunk comes after its forward.
/// Throws std::logic_error describing the first violation. (Deadlock-freedom across
/// stages is checked by the DAG builder, which rejects cyclic schedules.)
void validateSchedule(const Schedule& s);

/// Human-readable one-line-per-stage rendering ("F0 F1 B0 ..."; chunk as F0.1).
std::string renderSchedule(const Schedule& s);

}  // namespace wlb::pp
