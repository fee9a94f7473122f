#pragma once
/// \file simulator.hpp
/// \brief 4D step simulator (docs/simulator.md): predicts the time,
/// bubbles, per-rank busy/idle and per-stage peak memory of one training step from a
/// StepPlan, the CP shard/comm plans of its micro-batches and the cost model.
///
/// Symmetry: TP ranks of a group do identical work, and a CP group advances at the pace
/// of its slowest member every layer, so each (dp, pp) pipeline is simulated once with
/// per-task costs = slowest CP rank; DP replicas meet at the gradient reduction. The DAG
/// therefore has 2 * M * v * pp vertices per replica whatever tp and cp are, which makes
/// a 4096-rank step a matter of milliseconds after planning.

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/deck.hpp"
#include "core/mesh_shape.hpp"
#include "core/types.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"
#include "pp/dag.hpp"
#include "pp/schedule.hpp"
#include "pp/slice_shards.hpp"

namespace wlb::trace {
class Recorder;
}

namespace wlb::data {
class Rng;
}  // namespace wlb::data

namespace wlb::pp {

enum class Recompute { None, Selective, Full };
/// "none" | "selective" | "full"; InputError naming `pipeline.recompute` otherwise.
Recompute parseRecompute(const std::string& name);
/// pipeline.recompute as the executor runs it (wlb run, wlb train, and simulate --as-run,
/// which models them): true for "selective", false for "none"; "full" (the simulator's alone:
/// the executor does not keep only the layer inputs) is an InputError naming the key.
bool executorRecomputesSelective(const std::string& name);

/// One micro-batch's work on one TP rank of each CP rank, per transformer layer.
struct MicroBatchWork {
  std::int64_t tokens = 0;                         ///< whole micro-batch
  std::vector<std::int64_t> rank_tokens;           ///< [cp rank] query tokens held
  std::vector<std::int64_t> rank_kv_tokens;        ///< [cp rank] KV buffer tokens (keys its pieces read)
  std::vector<double> attn_fwd, attn_bwd;          ///< [cp rank] attention seconds per layer
  std::vector<double> attn_flops_fwd, attn_flops_bwd;  ///< [cp rank] their useful FLOPs (traces; may be empty)
  std::vector<double> kv_fwd_bytes, kv_bwd_bytes;  ///< [cp rank] KV bytes moved per layer
  std::vector<int> kv_peers;                       ///< [cp rank] messages per layer (latency count)
  /// [cp rank] K/V bytes received per layer (traces; empty: kv_*_bytes, an all-gather's).
  std::vector<double> kv_fwd_recv_bytes, kv_bwd_recv_bytes;
  bool kv_exchange = false;  ///< sharding-aware point-to-point exchange (trace label), else all-gather
  bool kv_across_dp = false;  ///< a DP-Merge unit: its group spans DP replicas, so K/V cross DP links too
  std::string sharding;                            ///< sharding actually applied
  /// [cp rank] tokens whose backward this task runs when the backward grouping differs from
  /// the forward one (SlimPack's asymmetric partition); empty = rank_tokens.
  std::vector<std::int64_t> rank_tokens_bwd;
  /// SlimPack: [cp rank] tokens of the backward unit's slices that a later slice continues
  /// (their dK/dV accumulators); rank_kv_tokens then counts the forward unit's.
  std::vector<std::int64_t> rank_kv_tokens_bwd;
  int cp() const { return static_cast<int>(rank_tokens.size()); }
};

/// Plan the micro-batch's CP sharding and KV communication with the CP planners
/// (cp::planShards / cp::planComm, the same plans the executor runs) and extract its work.
MicroBatchWork planMicroBatchWork(const MicroBatch& mb, const std::string& sharding, int cp,
                                  const model::CostModel& cost, const CpConfig& cfg);

/// The work of a micro-batch from its CP plans (cp::planReplicaShards).
MicroBatchWork microBatchWork(const MicroBatch& mb, const cp::MicroBatchShards& plans, const std::string& sharding,
                              int cp, const model::CostModel& cost);

/// Rank r's share of `tokens` split as evenly as possible over `cp` ranks.
inline std::int64_t evenShare(std::int64_t tokens, int cp, std::size_t r) {
  return tokens / cp + (static_cast<std::int64_t>(r) < tokens % cp ? 1 : 0);
}
/// Idealised work: tokens split evenly over CP ranks with perfectly balanced attention and
/// the KV bytes and peers of an all-gather (for tests and quick what-ifs; `doc_lengths` are
/// the micro-batch's documents).
MicroBatchWork balancedMicroBatchWork(const std::vector<std::int64_t>& doc_lengths, int cp,
                                      const model::CostModel& cost);

/// attnSeconds of a piece (a tile walk, O(length / tile)), memoised: whole samples and
/// slices recur across a packer's candidates and a step's MicroPacks. Whole spans (q0 = 0)
/// shorter than kDirect sit in a table indexed by length; the rest in a hash map, cleared
/// when large.
class AttnSecondsMemo {
 public:
  explicit AttnSecondsMemo(const model::CostModel& c) : cost_(&c) {}
  double operator()(std::int64_t q0, std::int64_t q, Phase p);
  static constexpr std::int64_t kDirect = std::int64_t{1} << 18;

 private:
  const model::CostModel* cost_;
  std::vector<double> whole_[2];  ///< [phase][q], NaN = not yet computed
  std::unordered_map<std::uint64_t, double> map_;
};

/// A SlimPack plan: it holds slices (q_offset > 0) or a backward grouping of its own, so it
/// is simulated under PackFlow with packFlowWork.
bool isSlimPackPlan(const StepPlan& plan);

/// Work of unit k of a SlimPack replica: forward MicroPack k's forward and backward
/// MicroPack k's backward (the asymmetric partition), on the CP ranks of the replica's
/// layout `sh` (pp::sliceShards, as `wlb run` shards it; null: cp = 1, segments whole). Every piece costs as what it
/// is: queries [q_offset + p.q_offset, + p.q_len) of its document against the key prefix; `rank_tokens_bwd` holds the
/// backward MicroPack's rows, the KV tokens those of continued segments (whole on every rank), the KV bytes the
/// MicroPack's all-gather (forward) and gather + gradient reduce-scatter (backward).
MicroBatchWork packFlowWork(const ReplicaSlices& r, const SliceShards* sh, int k, const model::CostModel& cost,
                            AttnSecondsMemo& attn);
/// The same into `w`, whose vectors keep their capacity (a packer's candidates reuse them).
void packFlowWork(const ReplicaSlices& r, const SliceShards* sh, int k, const model::CostModel& cost,
                  AttnSecondsMemo& attn, MicroBatchWork& w);
/// packFlowWork of every unit of the replica (into `out`: its elements reused).
std::vector<MicroBatchWork> packFlowReplicaWork(const ReplicaSlices& r, const SliceShards* sh,
                                                const model::CostModel& cost, AttnSecondsMemo& attn);
void packFlowReplicaWork(const ReplicaSlices& r, const SliceShards* sh, const model::CostModel& cost,
                         AttnSecondsMemo& attn, std::vector<MicroBatchWork>& out);

/// Work of member j (0 = the owner) of a DP-Merge group of g replicas running `mb`
/// together: the CP planners shard it over g * cp ranks (`sharding`, as `wlb run` plans
/// it) and member j takes ranks [j * cp, (j + 1) * cp). The KV exchange is costed on the
/// CP links (the group spans DP replicas; docs/simulator.md).
MicroBatchWork mergedShareWork(const MicroBatch& mb, int g, int j, int cp, const std::string& sharding,
                               const model::CostModel& cost, const CpConfig& cfg);

/// Every replica's unit work and PackFlow dependencies of a SlimPack plan: packFlowWork per
/// unit, with each DP-Merge slot replaced by every member's mergedShareWork. The one
/// function behind `wlb simulate` and the slimpack packer's count search.
std::vector<std::vector<MicroBatchWork>> packFlowPlanWork(const StepPlan& plan, const std::string& sharding, int cp,
                                                          const model::CostModel& cost, const CpConfig& cfg,
                                                          AttnSecondsMemo& attn, std::vector<PackFlowDeps>& flow);
/// The same into `works` (its elements reused: no allocation once the shapes repeat).
void packFlowPlanWork(const StepPlan& plan, const std::string& sharding, int cp, const model::CostModel& cost,
                      const CpConfig& cfg, AttnSecondsMemo& attn, std::vector<PackFlowDeps>& flow,
                      std::vector<std::vector<MicroBatchWork>>& works);

/// Link bandwidths (bytes/s) and latency (s) per mesh axis after topology resolution.
struct Network {
  double tp_bps = 0, cp_bps = 0, pp_bps = 0, dp_bps = 0, latency_s = 0;
  /// From the profile's links, with the deck's non-zero overrides. If the profile file
  /// carries an optional "topology" block {gpus_per_node, intra_node_gbps,
  /// inter_node_gbps}, each axis uses intra-node bandwidth when its group fits on one
  /// node (ranks are laid out TP innermost, then CP, PP, DP) and inter-node otherwise.
  static Network resolve(const Deck& deck, const model::HardwareProfile& hw);
};

/// Simulation parameters resolved from a deck.
struct SimConfig {
  int tp = 1, cp = 1, pp = 1, dp = 1, chunks = 1;
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  Recompute recompute = Recompute::None;
  Network net;
  double memory_bytes = 0;                ///< device memory (0 = unknown)
  double optimizer_bytes_per_param = 12;  ///< fp32 master + Adam m, v (sharded over dp*cp)
  double grad_bytes_per_param = 4;        ///< fp32 main gradients held per rank
  /// Embedding + LM head: head compute on the last virtual stage, embedding/head weights
  /// in the gradient reduction and memory, fp32 logits. `--as-run` sets false: the
  /// executor's embedding and fused head + loss are timed through the deck-shaped
  /// profile's per-micro-batch part (linear_ops fill_ns, measured by `wlb profile --deck`
  /// around the same layer) and their memory through executor_memory; their weights are
  /// left out of the gradient reduction (hidden * vocab per end, small beside the layers
  /// on the decks `wlb run` measures).
  bool lm_head = true;
  /// Bytes per element moved by KV exchange and the gradient reduction (0 = the model's
  /// dtype_bytes). `wlb run` computes in fp32, so `--as-run` sets 4. Only communication
  /// is scaled; the cost model (and so every planner decision) is unchanged.
  double comm_element_bytes = 0;
  /// Activation memory and pipeline messages as the measured executor has them (fp32,
  /// model::executorLayerActivationBytes per layer, model::executorHeadBytes on the last
  /// stage, whole activations between stages); `--as-run` sets it. The recompute setting
  /// does not apply.
  bool executor_memory = false;
  /// With executor_memory: bytes per element of the activations the executor stores in
  /// run.precision's type (4, or 2 for bf16; model::executorLayerActivationBytes).
  int executor_storage_bytes = 4;
  /// Rank-speed spread (the profile's `rank_speed`; 0 = every rank at the profile's speed).
  /// Rank r runs every task at 1 + rank_spread x its normal quantile in a fixed scatter of
  /// the quantiles over the mesh, times a log-normal factor of mean 1 and log standard
  /// deviation `step_spread` drawn per rank and step; each member of each task draws another
  /// of `task_spread`. So a CP x TP group's task lasts its slowest member's time, a slow
  /// task delays the stages after it, and the slowest replica paces the gradient reduction.
  /// The step is the median over kPlacements scatters and draws (fixed seeds), so no one
  /// placement of the slow ranks decides it.
  double rank_spread = 0, step_spread = 0, task_spread = 0;
  static SimConfig fromDeck(const Deck& deck, const model::HardwareProfile& hw);
  int ranks() const { return tp * cp * pp * dp; }
  /// The mesh's shape (rank <-> coordinate math, core/mesh_shape.hpp).
  MeshShape mesh() const { return MeshShape(tp, cp, pp, dp); }
};

/// Outcome of one simulated step.
struct StepResult {
  double step_seconds = 0;                    ///< max over stages of (pipeline finish + grad reduction)
  double pipeline_seconds = 0;                ///< max over replicas of the pipeline makespan
  double grad_sync_seconds = 0;               ///< largest per-stage gradient reduction
  double bubble_fraction = 0;                 ///< mean over replicas of the DAG's pipeline bubble
  double idle_fraction = 0;                   ///< 1 - sum of every rank's own busy time / (ranks * step)
  std::vector<double> replica_seconds;        ///< [dp] pipeline makespan
  std::vector<double> peak_bytes;             ///< [pp] max over replicas of static + activations
  std::vector<double> static_bytes;           ///< [pp] weights + grads + optimizer state
  std::vector<double> peak_activation_bytes;  ///< [pp] peak_bytes - static_bytes
  std::vector<double> rank_busy;              ///< [((dp*pp + s)*cp + c)] own busy seconds (at the mean speed)
  bool fits_memory = true;                    ///< every stage's peak <= memory_bytes (if known)
};

/// Simulates steps of one deck's model on one mesh.
class StepSimulator {
 public:
  StepSimulator(SimConfig cfg, const model::CostModel& cost);
  StepSimulator(const Deck& deck, const model::CostModel& cost);

  const SimConfig& config() const { return cfg_; }
  const Schedule& schedule(int micro_batches) const;
  /// Layers held by virtual stage vs.
  int layersOf(int vstage) const;

  /// Per-task costs of one replica (exposed for tests and the executor's comparisons);
  /// `replica` and `placement` (< kPlacements) place its ranks for the rank-speed spread;
  /// `placement` and `step` select the task noise's draws.
  PipelineCosts pipelineCosts(const std::vector<MicroBatchWork>& mbs, int replica = 0, int placement = 0,
                              int step = 0) const;
  /// The time multiplier of world rank r in scatter `placement` (1 without rank_spread).
  double rankFactor(int rank, int placement = 0) const;
  /// Scatters of the slow ranks (and draws of the task noise) a step is simulated with when
  /// the profile has a rank-speed spread.
  static constexpr int kPlacements = 7;

  /// Simulate one step: works[dp][m]. If `rec` is given, predicted events of every rank
  /// are recorded (times offset by t0_seconds, context step = `step`, current strategy).
  /// `flow`: each replica's slice dependencies (packFlowDeps); a replica with non-trivial
  /// ones runs PackFlow over them, the others the configured schedule (PackFlow's is then
  /// 1F1B's order). Non-trivial dependencies under another schedule throw InputError naming
  /// `pipeline.schedule`.
  StepResult simulate(const std::vector<std::vector<MicroBatchWork>>& works, trace::Recorder* rec = nullptr,
                      int step = 0, double t0_seconds = 0, const std::vector<PackFlowDeps>* flow = nullptr) const;

  /// Plan every micro-batch of a StepPlan (sharding per micro-batch) and simulate it. A
  /// SlimPack plan (isSlimPackPlan) is costed by packFlowWork and ordered by PackFlow with
  /// its slice dependencies (InputError naming `pipeline.schedule` under another schedule).
  StepResult simulatePlan(const StepPlan& plan, const std::string& sharding, const CpConfig& cfg,
                          trace::Recorder* rec = nullptr, int step = 0, double t0_seconds = 0) const;

  /// Parameters held by one rank of stage s (weights / tp, embeddings on the ends).
  double stageParams(int stage) const;
  /// Activation bytes one layer holds per query token on one rank (given recompute).
  double activationBytesPerToken() const;
  /// The most tokens one micro-batch (MicroPack) may hold so that every stage fits
  /// `memory_bytes` with 1F1B's in-flight count (stage s keeps pp - s forwards): (memory -
  /// static bytes) / (pp - s) / the stage's activation bytes per token (its layers, the
  /// logits on the last stage, tokens split over CP). INT64_MAX when the memory is unknown
  /// or the static bytes alone do not fit (then nothing a packer does helps).
  std::int64_t microBatchTokenBudget() const;
  /// Bytes stage s leaves for activations: memory_bytes minus its static bytes (weights,
  /// gradients, optimizer state); infinity when the memory is unknown.
  double stageFreeBytes(int stage) const;
  /// Activation bytes one query token of a unit holds on stage s: its layers (given
  /// recompute), the logits on the last stage, the token split over CP. The per-token rate
  /// behind microBatchTokenBudget and the slimpack packer's memory bound.
  double stageBytesPerToken(int stage) const;

 private:
  /// A task's time per layer split as its trace events show it; `tp` and `kv` include
  /// their messages' latencies. Bytes: the buffers the TP all-reduces sum, the K/V received.
  struct LayerParts {
    double attn = 0, recompute = 0, linear = 0, tp = 0, kv = 0;
    double tp_bytes = 0, kv_bytes = 0;
  };
  struct RankLayerCost {
    double fwd = 0, bwd = 0;  // seconds per layer incl. TP and CP communication
    LayerParts f, b;          // the same split into events (full recompute: b includes f)
  };
  RankLayerCost layerCost(const MicroBatchWork& w, int r) const;
  double headFlops(std::int64_t tokens, Phase p) const;  ///< the LM head's, per TP rank (0 without it)
  double headSeconds(std::int64_t tokens, Phase p) const;
  double commScale() const;  ///< comm_element_bytes / dtype_bytes (1 when unset)
  /// One stage-to-stage transfer of a unit's activations (or their gradients).
  double p2pSeconds(std::int64_t tokens, const std::vector<std::int64_t>& rank_tokens) const;
  double p2pBytes(const std::vector<std::int64_t>& rank_tokens) const;  ///< its message, per TP rank
  double gradSyncSeconds(int stage) const;
  /// A CP group's task: CP rank r alone would take x[r] at the mean speed; the group takes
  /// its slowest member's time over the TP x CP ranks of (stage, replica), each at its rank's
  /// `speed` (rankSpeeds) and, with `noise`, its own draw of the task noise. `factors`
  /// (cp * tp, optional) receives each member's multiplier (PipelineCosts::member_factor).
  double groupSeconds(const std::vector<double>& x, int stage, int replica, const std::vector<double>& speed,
                      data::Rng* noise, double* factors = nullptr) const;
  /// Every world rank's speed factor in scatter `placement` of step `step` (rank and step
  /// spread); empty when both are 0.
  std::vector<double> rankSpeeds(int placement, int step) const;
  /// Whether tasks draw noise: a task_spread and more than one rank to wait for.
  bool noisy() const;
  /// Whether ranks draw a step factor: a step_spread and more than one rank.
  bool wanders() const;
  StepResult simulateOnce(const std::vector<std::vector<MicroBatchWork>>& works, trace::Recorder* rec, int step,
                          double t0_seconds, const std::vector<PackFlowDeps>* flow, int placement) const;

  SimConfig cfg_;
  std::vector<std::vector<double>> rank_factor_;  ///< [placement][world rank], empty without rank_spread
  const model::CostModel* cost_;
  mutable std::deque<std::pair<int, Schedule>> schedules_;  // deque: references stay valid
};

}  // namespace wlb::pp
