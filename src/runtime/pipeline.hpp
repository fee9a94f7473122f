#pragma once
/// \file pipeline.hpp
/// \brief One rank's part of a training step under a pipeline Schedule (docs/runtime.md):
/// the rank walks `Schedule::order[stage]` — the object `wlb simulate` times, built by the
/// same pp::makeSchedule — running the forward or backward of its layer block for one
/// micro-batch per task, with activations and their gradients moving between
/// neighbouring stages by non-blocking point-to-point.
///
/// Contract:
/// * Stage s holds, for each model chunk c, the layers of virtual stage c*p + s
///   (pp::layerBlock); virtual stage 0 also makes the input (embedding), the last one the
///   loss: L = sum over tokens of <y, R> with R fixed pseudo-random, so dL/dy = R.
/// * Messages go over the pipeline communicator (its rank = stage) between ranks with the
///   same TP, CP and DP coordinates; each carries the rank's CP shard of one micro-batch
///   ([local tokens][hidden] fp32). Both sides know every micro-batch's token count from
///   the plan, so there is no size handshake. Every receive of the step is posted before
///   the first task, so a send never waits on the receiver's compute; sends complete
///   before the gradient reduction.
/// * Empty micro-batches (no tokens in the replica) are skipped by every stage alike.
/// * The rank accounts the bytes its LayerSteps keep from forward to backward
///   (LayerStep::savedBytes) and reports the peak.
/// * Inputs and the loss projection R are pseudo-random per (document, position) token
///   (tokenKey): the same documents give the same loss and gradients however they are
///   packed, sliced, pipelined or sharded.
/// * SlimPack plans (StageStepInput::slices): forward tasks name forward MicroPacks and
///   backward tasks backward MicroPacks; messages carry that MicroPack's tokens, and the
///   stage's layers run through a SlicedStage.

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/types.hpp"
#include "cp/shard_plan.hpp"
#include "pp/schedule.hpp"
#include "runtime/layer.hpp"

namespace wlb::runtime {

/// One replica's micro-batches as this rank sees them.
struct StageStepInput {
  std::int64_t step = 0;
  std::uint64_t seed = 0;               ///< data.seed: inputs and loss projection
  std::vector<MicroBatch> mbs;          ///< [m] the micro-batches (input and loss rows are keyed by token)
  std::vector<std::int64_t> mb_tokens;  ///< [m] tokens of the whole micro-batch (0 = empty)
  std::vector<cp::ShardPlan> shards;    ///< [m] CP shard plan (unused when empty)
  std::vector<cp::CommPlan> comms;      ///< [m] KV communication plan
  /// SlimPack plans (cp = 1, runtime/sliced.hpp): the replica's slices and the step's
  /// PackFlow schedule, which replaces the stage's own; mbs/mb_tokens are the forward
  /// MicroPacks, shards/comms are unused.
  std::shared_ptr<const pp::ReplicaSlices> slices;
  std::shared_ptr<const pp::Schedule> schedule;
  /// SlimPack's DP-Merge units this replica takes part in: micro-batch `slot` is the
  /// owner's sample (mbs[slot]), sharded by shards[slot] / comms[slot] over the group's
  /// replicas, run by LayerSteps whose CP communicator is `comm` (this rank's index in it =
  /// its replica's position in the group). The caller creates `comm` and `group`.
  struct Merged {
    int slot = 0;
    int rank = 0;
    MPI_Comm comm = MPI_COMM_NULL;
    parallel::GroupComm* group = nullptr;  ///< null -> host-staged MPI over comm
  };
  std::vector<Merged> merged;
  const Merged* mergedAt(std::size_t slot) const {
    for (const auto& m : merged)
      if (m.slot == static_cast<int>(slot)) return &m;
    return nullptr;
  }
};

/// The step input of replica `d` of a SlimPack plan: its slices and backward partition,
/// the PackFlow schedule over `stages` from its slice dependencies (the one `wlb simulate`
/// builds), and the CP plans of the DP-Merge units it is a member of (`strategy` / `mode`
/// over the group; every member orders its merged units by slot, so their collectives
/// match). InputError for slices PackFlow cannot order.
StageStepInput slicedStepInput(std::int64_t step, std::uint64_t seed, const StepPlan& plan, std::size_t d, int stages,
                               const model::CostModel& cost, cp::Strategy strategy, cp::CommMode mode,
                               const CpConfig& cfg);

/// What one rank measured in one step.
struct StageStepResult {
  double task_seconds = 0;      ///< wall time inside tasks, excluding waits for pipeline messages
  double pipeline_seconds = 0;  ///< from the step start to the end of the rank's last task
  double p2p_wait_seconds = 0;  ///< waiting for activations / gradients from other stages
  double loss = 0;              ///< sum of this rank's last-stage micro-batch losses
  std::int64_t peak_activation_bytes = 0;
  std::vector<double> mb_attn;     ///< [m] attention kernel seconds on this rank
  std::vector<double> mb_seconds;  ///< [m] task seconds of the micro-batch on this rank
  std::vector<double> mb_tokens;   ///< [m] local query tokens
};

/// A rank's pipeline stage: its layer blocks and the schedule it walks.
class PipelineStage {
 public:
  /// `env.cp_comm`/`tp_comm` as for LayerStep; `pp_comm` the pipeline group (rank =
  /// stage). `model` must hold the layers of this stage's blocks.
  PipelineStage(const LayerEnv& env, Model& model, const pp::Schedule& schedule, int stage, int layers,
                MPI_Comm pp_comm);

  /// Global layer ids of this stage's blocks (chunk order, ascending within a chunk).
  static std::vector<int> stageLayers(int layers, int stages, int chunks, int stage);

  /// Run every task of the step in schedule order. Weight gradients accumulate into the
  /// model (zero them before). `t0_ns` is the recorder time of the step start.
  StageStepResult run(const StageStepInput& in, std::int64_t t0_ns);

 private:
  LayerEnv env_;
  Model* model_;
  const pp::Schedule* sched_;
  int stage_, layers_;
  MPI_Comm pp_comm_;
};

}  // namespace wlb::runtime
