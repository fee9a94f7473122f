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
///   (pp::layerBlock, runtime::stageLayers); virtual stage 0 embeds the unit's tokens, the
///   last one computes the cross-entropy of its rows (head.hpp) and, with gradients, the
///   gradient of its input at once, which it keeps for the unit's backward task.
/// * A unit's rows (tokens.hpp) are the micro-batch's tokens on this CP rank in local order
///   (cp/shard_plan.hpp), or a SlimPack MicroPack's segments in order; token ids come from
///   the step input's TokenSource, so the same documents give the same loss and gradients
///   however they are packed, sliced, pipelined or sharded.
/// * Messages go over the pipeline communicator (its rank = stage) between ranks with the
///   same TP, CP and DP coordinates; each carries the rank's rows of one unit
///   ([rows][hidden] fp32). Both sides know every unit's rows from the plan, so there is no
///   size handshake. Every receive of the step is posted before the first task, so a send
///   never waits on the receiver's compute; sends complete before the step ends.
/// * Empty micro-batches (no tokens in the replica) are skipped by every stage alike.
/// * The rank accounts the bytes kept from forward to backward (LayerStep::savedBytes, the
///   sliced runs, the head's input gradient: model/memory.hpp) and reports the peak.
/// * SlimPack plans (StageStepInput::slices): forward tasks name forward MicroPacks and
///   backward tasks backward MicroPacks; messages carry that MicroPack's rows, and the
///   stage's layers run through a SlicedStage.
/// * Evaluation (forward_only): the forward tasks alone, nothing kept, the loss summed.

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/types.hpp"
#include "cp/shard_plan.hpp"
#include "parallel/comm.hpp"
#include "parallel/mesh.hpp"
#include "pp/schedule.hpp"
#include "pp/slice_shards.hpp"
#include "runtime/layer.hpp"
#include "runtime/tokens.hpp"

namespace wlb::runtime {

/// One replica's micro-batches as this rank sees them.
struct StageStepInput {
  std::int64_t step = 0;
  const TokenSource* tokens = nullptr;  ///< the ids of every document token (required)
  float loss_scale = 1.0f;              ///< gradients are those of loss_scale * (sum of the CE)
  bool forward_only = false;            ///< evaluation: forward tasks only, no gradients
  std::vector<MicroBatch> mbs;          ///< [m] the micro-batches
  std::vector<std::int64_t> mb_tokens;  ///< [m] tokens of the whole micro-batch (0 = empty)
  std::vector<cp::ShardPlan> shards;    ///< [m] CP shard plan (unused when empty)
  std::vector<cp::CommPlan> comms;      ///< [m] KV communication plan
  /// SlimPack plans (runtime/sliced.hpp): the replica's slices, their CP layout and the
  /// step's PackFlow schedule, which replaces the stage's own; mbs/mb_tokens are the forward
  /// MicroPacks, shards/comms are unused but for DP-Merge units.
  std::shared_ptr<const pp::ReplicaSlices> slices;
  std::shared_ptr<const pp::SliceShards> slice_shards;
  std::shared_ptr<const pp::Schedule> schedule;
  /// SlimPack's DP-Merge units this replica takes part in: micro-batch `slot` is the
  /// owner's sample (mbs[slot]), sharded by shards[slot] / comms[slot] over the group's
  /// replicas' CP ranks (group size x cp), run by LayerSteps whose CP communicator is `comm`
  /// (this rank's index in it = its replica's position in the group x cp + its CP rank).
  /// The caller creates `comm` and `group`.
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
/// their layout over `cp` ranks (pp::sliceShards with `strategy`), the PackFlow schedule
/// over `stages` from its slice dependencies (the one `wlb simulate` builds), and the CP
/// plans of the DP-Merge units it is a member of (`strategy` / `mode` over the group's
/// replicas' CP ranks; every member orders its merged units by slot, so their collectives
/// match). InputError for slices PackFlow cannot order.
StageStepInput slicedStepInput(std::int64_t step, const StepPlan& plan, std::size_t d, int stages, int cp,
                               const model::CostModel& cost, cp::Strategy strategy, cp::CommMode mode,
                               const CpConfig& cfg);

/// The step input of replica `d` of any plan: its micro-batches padded to `slots` (empty
/// ones are skipped by every stage) with their CP shard plans over `cp` ranks, or, for a
/// SlimPack plan, slicedStepInput. The caller sets tokens and loss_scale.
StageStepInput replicaStepInput(std::int64_t step, const StepPlan& plan, std::size_t d, int stages, std::int64_t slots,
                                int cp, const model::CostModel& cost, cp::Strategy strategy, cp::CommMode mode,
                                const CpConfig& cfg);

/// Every replica's CP shard plans of a step, as the trace's /plan/shard_json: per
/// non-empty micro-batch its `dp`, `micro_batch`, `shard` and `metrics` (`[]` for a SlimPack
/// plan, which runs sliced). What `wlb calibrate` fits the KV links to; `wlb run` and
/// `wlb train` write it with each step's plan.
std::string shardPlansJson(const StepPlan& plan, int stages, std::int64_t slots, int cp, const model::CostModel& cost,
                           cp::Strategy strategy, cp::CommMode mode, const CpConfig& cfg);

/// The communicators of a step's DP-Merge units: for each unit, the ranks of its group's
/// replicas with the same (tp, pp) coordinates, by (replica, CP rank), set into `in.merged` (collective over
/// the mesh's world: every rank walks plan.merged alike). They live until the step ends.
struct MergedComms {
  std::vector<parallel::Comm> comms;
  std::vector<std::unique_ptr<parallel::GroupComm>> groups;
};
MergedComms connectMerged(const parallel::Mesh& mesh, const StepPlan& plan, StageStepInput& in,
                          parallel::CommBackend backend);

/// Forward tasks only (evaluation): on every stage, for each micro-batch, each chunk.
pp::Schedule forwardSchedule(int stages, int micro_batches, int chunks);

/// One rank, no mesh (tests, tools): the units `mbs` through a one-stage `model` in 1F1B
/// order (forward only without `backward`); returns the sum of the CE of their rows, and
/// accumulates the gradients of loss_scale * that sum. Collective over nothing. A model with
/// a BF16 working copy runs with BF16 storage, else FP32.
double runLocal(Llama& model, const TokenSource& tokens, const std::vector<MicroBatch>& mbs, bool backward,
                float loss_scale = 1.0f);

/// What one rank measured in one step.
struct StageStepResult {
  double task_seconds = 0;      ///< wall time inside tasks, excluding waits for pipeline messages
  double pipeline_seconds = 0;  ///< from the step start to the end of the rank's last task
  double p2p_wait_seconds = 0;  ///< waiting for activations / gradients from other stages
  double loss = 0;              ///< sum of the CE of this rank's last-stage rows (TP rank 0; else 0)
  std::int64_t predicted = 0;   ///< rows with a target counted in `loss`
  std::int64_t peak_activation_bytes = 0;
  std::vector<double> mb_attn;     ///< [m] attention kernel seconds on this rank
  std::vector<double> mb_seconds;  ///< [m] task seconds of the micro-batch on this rank
  std::vector<double> mb_tokens;   ///< [m] local query tokens
  std::vector<double> mb_loss;     ///< [m] the micro-batch's share of `loss`
  /// Buffers the step had to allocate (the pool's misses): 0 once the pool holds a step's
  /// working set and the shapes repeat (pool.hpp).
  std::int64_t allocations = 0;
  /// Bytes the stage's pool holds at the step's end, its free blocks included (the pool is
  /// the stage's, shared by every strategy of a run).
  std::int64_t pool_bytes = 0;
  /// Over the step: the most bytes of the pool's blocks in use at once, and the most bytes
  /// the buffers alive at once asked for (pool.hpp; 0 without a pool).
  std::int64_t pool_live_bytes = 0;
  std::int64_t pool_requested_bytes = 0;
};

/// A rank's pipeline stage: its layer blocks and the schedule it walks.
class PipelineStage {
 public:
  /// `env.cp_comm`/`tp_comm` as for LayerStep (env.rope and env.pool are the stage's own); `pp_comm` the
  /// pipeline group (rank = stage). `model` holds this stage (its config's stage, chunks =
  /// the schedule's).
  PipelineStage(const LayerEnv& env, Llama& model, const pp::Schedule& schedule, MPI_Comm pp_comm);

  /// Run every task of the step in schedule order. Weight gradients accumulate into the
  /// model (zero them before). `t0_ns` is the recorder time of the step start.
  StageStepResult run(const StageStepInput& in, std::int64_t t0_ns);

 private:
  LayerEnv env_;
  Llama* model_;
  const pp::Schedule* sched_;
  int stage_;
  MPI_Comm pp_comm_;
  RopeTable rope_;
  BufferPool pool_;  ///< every step's activations, temporaries and messages
};

}  // namespace wlb::runtime
