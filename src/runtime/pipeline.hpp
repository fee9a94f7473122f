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

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cp/shard_plan.hpp"
#include "pp/schedule.hpp"
#include "runtime/layer.hpp"

namespace wlb::runtime {

/// One replica's micro-batches as this rank sees them.
struct StageStepInput {
  std::int64_t step = 0;
  std::uint64_t seed = 0;               ///< data.seed: inputs and loss projection
  std::vector<std::int64_t> mb_tokens;  ///< [m] tokens of the whole micro-batch (0 = empty)
  std::vector<cp::ShardPlan> shards;    ///< [m] CP shard plan (unused when empty)
  std::vector<cp::CommPlan> comms;      ///< [m] KV communication plan
};

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
