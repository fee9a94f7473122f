#pragma once
/// \file run.hpp
/// \brief The measured step executor behind `wlb run` (docs/runtime.md): for each strategy
/// of a deck, the same length stream -> packer -> CP shard planner -> real transformer
/// layers on every rank of the TP x CP x PP x DP mesh — each pipeline stage walking the
/// deck's pp::Schedule (runtime/pipeline.hpp) — one DP/CP gradient all-reduce per stage
/// and step, per-op trace events, and a measured summary (throughput, step time, bubble
/// fraction, CP and micro-batch imbalance, activation memory per stage).

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <mpi.h>

#include <nlohmann/json.hpp>

#include "core/deck.hpp"
#include "core/mesh_shape.hpp"
#include "model/throughput.hpp"
#include "parallel/group_comm.hpp"
#include "runtime/gemm.hpp"
#include "runtime/op_timer.hpp"
#include "trace/writer.hpp"

namespace wlb::runtime {

struct RunOptions {
  std::int64_t steps = -1;    ///< measured steps; < 0 -> deck run.steps
  std::int64_t warmup = -1;   ///< warm-up steps before them; < 0 -> deck run.warmup
  bool progress = true;       ///< rank 0 prints a line per step to `out`
  bool write_outputs = true;  ///< trace file and plan JSONL into deck.output.dir
  std::string command;        ///< command line stored in the trace metadata
  std::FILE* out = stdout;
  MPI_Comm comm = MPI_COMM_WORLD;  ///< the ranks of the mesh
  /// Tests: rank 0 keeps every strategy's weight gradients after its last step
  /// (StrategyResult::gradients).
  bool keep_gradients = false;
  /// `--gradients DIR` of the driver: its losses.json is checked with the run's outputs (a
  /// trace of that name would overwrite it). Empty: none.
  std::string gradients_dir;
  /// The driver's hook for temporaries (core/output_file.hpp): the trace's and the plan
  /// files' temporaries are removed if the process is interrupted.
  TemporaryTracker track_temporary;
  /// Tests of failure handling: world rank `fail_rank` throws at the start of step
  /// `fail_step`'s schedule walk (after its receives are posted). -1 = never.
  int fail_rank = -1;
  std::int64_t fail_step = -1;
  /// ... and instead of throwing, kills itself (SIGKILL): a rank that dies without a word.
  bool fail_kill = false;
  /// Time every GEMM of the measured steps on its own (op_timer.hpp; RunReport::gemms).
  bool gemm_timing = false;
  /// Time every Kokkos kernel and deep copy of the measured steps on its own
  /// (op_timer.hpp's KernelHooks; RunReport::kernels).
  bool kernel_timing = false;
};

/// Measured numbers of one step (rank 0's view after gathering every rank).
struct StepRecord {
  std::int64_t step = 0;
  bool warmup = false;
  bool drain = false;              ///< after the measured steps: no new documents (throughput.hpp)
  double seconds = 0;              ///< max over ranks of the step's wall time
  std::int64_t tokens = 0;         ///< tokens trained in the step (all replicas)
  double flops = 0;                ///< useful FLOPs of the layers run (model::usefulFlops)
  double mb_imbalance = 1;         ///< max/mean micro-batch latency over dp*M micro-batches
  double cp_imbalance = 1;         ///< mean over micro-batches of max/mean attention time over CP ranks
  double predicted_imbalance = 1;  ///< packing metrics (cost model), W_a + W_l
  std::vector<double> rank_busy;   ///< per world rank: compute seconds (GEMMs, attention, fills)
  std::vector<double> rank_comm;   ///< per world rank: KV, TP and gradient communication incl. waits
  /// Mean over ranks of the step's time outside every recorded region (allocation, host
  /// work between kernels, fences), as a fraction of the rank's step time.
  double unrecorded = 0;
  std::int64_t allocations = 0;          ///< buffers the ranks' activation pools allocated in the step
  std::vector<double> rank_attn;         ///< per world rank: attention kernel seconds
  double loss = 0;                       ///< mean cross-entropy over the step's predicted rows (tokens.hpp); NaN: none
  double bubble = 0;                     ///< mean over replicas of 1 - stage task time / pipeline span
  std::vector<double> stage_peak_bytes;  ///< [pp] max over the stage's ranks of saved activations
  std::vector<double> stage_pool_bytes;  ///< [pp] max over the stage's ranks of the pool's bytes at the end
  std::vector<double> stage_live_bytes;  ///< [pp] max over the stage's ranks of the pool's blocks in use at once
  std::vector<double> stage_asked_bytes;  ///< [pp] the same, counting only the rows the live buffers asked for
};

struct StrategyResult {
  std::string name, packer, sharding, comm;
  std::vector<StepRecord> steps;
  // Over the measured (non-warm-up, non-drain) steps:
  double step_mean = 0, step_min = 0, step_median = 0;
  double tokens_per_step = 0;
  // Over the measured steps and the drain: the comparison metric (model/throughput.hpp).
  std::int64_t drain_steps = 0;
  double tokens = 0, tokens_per_second = 0, flops_per_second = 0;
  double speedup = 1, speedup_lo = 1, speedup_hi = 1;  ///< tokens/s vs the first strategy, 95% interval
  double step_ratio = 1;                               ///< first strategy's step_mean / step_mean
  std::vector<model::StepWork> work;                   ///< per measured step, drain folded into the last
  double cp_imbalance = 1, mb_imbalance = 1, predicted_imbalance = 1;
  double bubble = 0;                                    ///< mean over the measured steps
  double unrecorded = 0;                                ///< StepRecord::unrecorded, mean over the measured steps
  double allocations = 0;                               ///< StepRecord::allocations, mean over the measured steps
  std::vector<double> stage_peak_bytes;                 ///< [pp] max over every step
  std::vector<double> stage_pool_bytes;                 ///< [pp] max over every step
  std::vector<double> stage_live_bytes;                 ///< [pp] max over every step
  std::vector<double> stage_asked_bytes;                ///< [pp] max over every step
  std::vector<double> rank_busy, rank_comm, rank_attn;  ///< per world rank, mean per step
  std::string plan_file;         ///< its plan file relative to output.dir (summary.json's "plan"); "" without outputs
  std::vector<float> gradients;  ///< RunOptions::keep_gradients: last step, tensor by tensor in model order
                                 ///< (runtime::Llama::layout), each whole: the same layout on every mesh
};

struct RunReport {
  std::string mesh;      ///< MeshShape::describe()
  std::string pipeline;  ///< "1f1b, 2 stage(s), 1 chunk(s), 4 micro-batch(es)"
  std::int64_t steps = 0, warmup = 0, layers = 0;
  std::vector<StrategyResult> strategies;  ///< complete on rank 0 only
  std::string trace_path;                  ///< "" when outputs are off
  std::vector<std::string> plan_paths;
  std::string summary_path;  ///< output.dir/summary.json (toJson), "" when outputs are off
  /// RunOptions::gemm_timing: every product's calls, seconds and FLOPs over the measured
  /// steps, summed over ranks, per strategy (rank 0).
  std::vector<OpTimer::Row> gemms;
  /// RunOptions::kernel_timing: every Kokkos kernel's and deep copy's calls and seconds over
  /// the measured steps, summed over ranks, per strategy (rank 0).
  std::vector<OpTimer::Row> kernels;
};

/// Run every strategy of the deck (resolveStrategies). Collective over `opt.comm`; Kokkos
/// must be initialised. InputError (collective) for a mesh that does not match the world
/// size, dimensions the layer cannot split, or a pipeline the schedule cannot build.
/// The /meta of a measured run's trace, `wlb run`'s and `wlb train`'s alike
/// (docs/trace-schema.md): the resolved deck, the command, the mesh and what the step ran on
/// (GEMM backend, precision, communication backend, execution space); each adds its own.
trace::RunMeta measuredMeta(const Deck& deck, const MeshShape& shape, const std::string& command, const char* executor,
                            Precision precision, parallel::CommBackend backend);

RunReport runDeck(const Deck& deck, const RunOptions& opt = {});

/// The comparison as JSON (`wlb-run-summary` version 1, docs/runtime.md): per strategy the
/// throughput, speedup with its interval, step times and imbalances. `wlb run` writes it to
/// output.dir/summary.json after the trace.
nlohmann::json toJson(const RunReport& report);

/// The final table printed by `wlb run` (rank 0).
std::string formatReport(const RunReport& report);

}  // namespace wlb::runtime
