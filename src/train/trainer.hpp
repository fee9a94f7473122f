#pragma once
/// \file trainer.hpp
/// \brief `wlb train DECK` (docs/training.md): the deck's packer chooses which documents of
/// a `wlb data prepare` dataset train together each step; the one model (runtime/llama.hpp,
/// the one `wlb run` measures) trains on their tokens with AdamW (optimizer.hpp); validation loss on the held-out
/// split; atomic checkpoints (weights, AdamW moments, step, packer and data-source state) that a resumed run continues
/// from with bit-identical losses; training metrics in the HDF5 trace. Runs on a TP x CP x PP x DP mesh: rank 0 packs
/// every step and broadcasts the plan, DP rank d trains replica d, the CP ranks of a replica share each micro-batch
/// through runtime::DistributedAttention, the TP ranks split heads and MLP columns, the PP
/// stages hold their layer blocks and walk pipeline.schedule (gpipe, 1f1b, interleaved, or
/// packflow for SlimPack plans) through runtime::PipelineStage, and the gradients of each
/// (TP slice, stage) are summed over DP x CP.

#include <mpi.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/deck.hpp"
#include "core/output_file.hpp"

namespace wlb::train {

struct TrainOptions {
  bool resume = false;   ///< continue from the checkpoint in the checkpoint directory
  bool progress = true;  ///< progress lines on stderr
  /// Test hook: after step k is complete (logged, checkpointed), the process kills itself
  /// with SIGKILL (-1: never).
  std::int64_t kill_after_step = -1;
  /// Test hook: return after step k is complete as a killed run would stop there (no
  /// further checkpoint, no trace; -1: never).
  std::int64_t stop_after_step = -1;
  /// Stop cleanly once this many steps are done (the run's count, resumed steps included):
  /// a checkpoint of that step, the trace and the log, as at the run's end; `--resume`
  /// continues. -1: never.
  std::int64_t exit_after_steps = -1;
  /// Set asynchronously (the driver's SIGUSR1 handler) to stop the same way after the step in
  /// progress. Read once per step and combined over the ranks, so one rank's signal stops all.
  const volatile std::sig_atomic_t* exit_request = nullptr;
  TemporaryTracker track_temporary;  ///< the driver's hook for temporaries (core/output_file.hpp)
  MPI_Comm comm = MPI_COMM_WORLD;  ///< the ranks of the mesh (mesh.tp x mesh.cp x mesh.pp x mesh.dp of them)
  bool write_trace = true;         ///< output.dir/output.trace with the training metrics
  std::string command;             ///< command line stored in the trace metadata
};

struct TrainSummary {
  std::int64_t first_step = 0, steps = 0;  ///< steps run by this invocation: [first_step, steps)
  std::int64_t total_steps = 0;            ///< the run's length (train.steps resolved)
  std::string exit_reason;                 ///< why it stopped before total_steps ("" when it did not)
  std::int64_t tokens = 0;                 ///< trained tokens (whole run, resumed part included)
  double first_loss = 0, last_loss = 0;    ///< training loss of this invocation's first / last step with tokens
  double eval_loss = -1;                   ///< last evaluation (-1: none)
  double unigram_entropy = 0;              ///< of the evaluation tokens, nats/token
  double tokens_per_second = 0;            ///< this invocation
  std::int64_t params = 0;
  std::string mesh;  ///< MeshShape::describe()
  std::string log_path, checkpoint_path, trace_path;
  /// Every step of this invocation (every rank has them): training loss (0 for a step
  /// without tokens) and evaluation loss (NaN where not evaluated).
  std::vector<double> losses, eval_losses;
  /// Rank 0 only: the activation pools (runtime/pool.hpp), max over ranks and steps of the
  /// bytes held, in use at once and asked for; their allocations summed over ranks, per
  /// step after this invocation's first.
  std::int64_t pool_bytes = 0, pool_live_bytes = 0, pool_requested_bytes = 0;
  double allocations_per_step = 0;
  std::uint64_t weights_hash = 0;  ///< FNV-1a of this rank's final weights (its TP slice of its stage; replicas agree)
};

/// Train as the deck says. Collective over opt.comm. InputError naming the key or file on
/// bad input, raised on every rank alike (mesh.tp must divide the heads, KV heads and ffn;
/// a layer per virtual stage; slimpack plans need pipeline.schedule = "packflow" and cp = 1).
TrainSummary train(const Deck& deck, const TrainOptions& opt);

/// Human-readable summary table (stdout).
std::string formatSummary(const TrainSummary& s);

}  // namespace wlb::train
