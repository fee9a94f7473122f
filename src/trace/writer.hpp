#pragma once
/// \file writer.hpp
/// \brief Writes one run's trace (every rank's events, the rank table, label table, plans
/// and run metadata) into one HDF5 file. Layout: docs/trace-schema.md.
///
/// The file is created under `NAME.tmp-<pid of rank 0>`; the `complete=1` root attribute
/// is written last, the file closed, and only then renamed to NAME by rank 0. A crash at
/// any point therefore never leaves a file under the final name.
///
/// Parallel path (measured runs): `Writer(path, meta, comm)` then `commit(recorder)` on
/// every rank of `comm` (collective). `/events` is written with parallel HDF5 (MPI-IO):
/// each rank writes its slice collectively at the offset given by an MPI_Exscan of the
/// event counts. The small tables and attributes are then written by rank 0 alone.
///
/// Serial path (the simulator, tools, tests): `Writer(path, meta)` (no communicator) and
/// `commit(recorder)` from one process; the recorder may hold events of any number of
/// virtual ranks (`Recorder::setVirtualRanks`). No MPI call is made on this path.

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/output_file.hpp"
#include "core/types.hpp"
#include "trace/recorder.hpp"

namespace wlb::trace {

/// Schema version written to `/meta/schema_version` (bump on incompatible changes).
inline constexpr int kSchemaVersion = 1;

/// Run metadata stored as attributes of `/meta`. Empty strings are filled with defaults
/// (git hash, versions from core/version_info.hpp, start time from the recorder).
struct RunMeta {
  std::string source = "measured";     ///< "measured" (executor) or "simulated" (simulator)
  std::string deck_toml;               ///< the resolved deck (Deck::toToml())
  std::string git_hash;                ///< default: wlb::gitHash()
  std::string wlb_version;             ///< default: wlb::versionString()
  std::string kokkos_version;          ///< default: wlb::kokkosVersion()
  std::string kokkos_backend;          ///< default: wlb::kokkosBackend()
  std::string start_time;              ///< ISO-8601; default: Recorder::startTimeIso()
  std::string command;                 ///< e.g. "wlb run deck.toml" (optional)
  int tp = 0, cp = 0, pp = 0, dp = 0;  ///< mesh; 0 -> derived from the rank table
  int warmup = 0;                      ///< steps [0, warmup) are excluded from summaries
  /// Additional string attributes of /meta (keys must not clash with the above).
  std::vector<std::pair<std::string, std::string>> extra;
};

/// One row of `/plan/segments`.
struct SegmentRow {
  std::int32_t strategy = 0;
  std::int32_t dp = 0;
  std::int32_t micro_batch = 0;
  std::int32_t index = 0;  ///< position of the segment inside its micro-batch
  std::int64_t step = 0;
  std::int64_t doc = 0;
  std::int64_t offset = 0;
  std::int64_t length = 0;
  std::int64_t arrival_step = 0;
};

/// One row of `/plan/steps` (+ the JSON texts at the same index).
struct PlanStepRow {
  std::int32_t strategy = 0;
  std::int64_t step = 0;
  std::string packing_json;  ///< the step's packing plan, one JSON object (JSONL line)
  std::string shard_json;    ///< the step's CP shard plan as JSON ("" if none)
};

/// One row of `/train/steps` (`wlb train`): one optimizer step of the whole mesh.
struct TrainStepRow {
  std::int64_t step = 0;
  std::int64_t tokens = 0;     ///< tokens trained in the step (every DP replica)
  std::int64_t predicted = 0;  ///< of them, tokens with a target (the loss's denominator)
  std::int64_t documents = 0;  ///< documents that arrived at the packer in the step
  double loss = 0;             ///< mean cross-entropy over the predicted tokens (nats)
  double eval_loss = 0;        ///< evaluation loss after the step; NaN when not evaluated
  double lr = 0;
  double grad_norm = 0;          ///< before clipping
  double seconds = 0;            ///< max over ranks of the step's wall time (evaluation excluded)
  double tokens_per_second = 0;  ///< tokens / seconds
};

/// One row of `/train/ranks`: one rank's timings of one step (seconds).
struct TrainRankRow {
  std::int64_t step = 0;
  std::int32_t rank = 0;
  std::int64_t tokens = 0;       ///< tokens this rank trained (its CP share of its replica)
  double step_seconds = 0;       ///< the whole step on this rank (plan broadcast to optimizer)
  double data_seconds = 0;       ///< waiting for the plan, reading tokens, CP shard plans
  double compute_seconds = 0;    ///< forward + backward of the rank's micro-batches (CP KV exchange, TP sums included)
  double attn_seconds = 0;       ///< attention kernels
  double cp_comm_seconds = 0;    ///< CP KV exchange and dK/dV return
  double tp_comm_seconds = 0;    ///< TP sums of partial activations and input gradients
  double allreduce_seconds = 0;  ///< DP x CP gradient all-reduce and loss sum
  double optimizer_seconds = 0;  ///< AdamW
  double eval_seconds = 0;       ///< evaluation after the step (0 when none)
  /// The rank's activation pool in the step (runtime/pool.hpp): blocks it allocated, bytes
  /// it held at the end, the most bytes of its blocks in use at once, and what the buffers
  /// alive then asked for.
  std::int64_t allocations = 0;
  std::int64_t pool_bytes = 0;
  std::int64_t pool_live_bytes = 0;
  std::int64_t pool_requested_bytes = 0;
};

/// Options mostly useful for tests.
struct WriterOptions {
  /// Called on the writing process just before the `complete` attribute is written,
  /// with the temporary path (tests kill the process here).
  std::function<void(const std::string& tmpPath)> before_complete;
  /// The driver's hook for temporaries (core/output_file.hpp): the trace's temporary file is
  /// removed if the process is interrupted (SIGINT/SIGTERM) while it exists.
  TemporaryTracker track_temporary;
};

class Writer {
 public:
  /// Serial writer (no MPI).
  Writer(std::string path, RunMeta meta, WriterOptions opts = {});
  /// Parallel writer over `comm` (duplicated; commit() is collective over it).
  Writer(std::string path, RunMeta meta, MPI_Comm comm, WriterOptions opts = {});
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  /// Add the plan of one step of `strategy`. `packing_json` is the step's JSONL line
  /// (generated from `plan` when empty); `shard_json` the CP shard plan (optional).
  /// Only rank 0's plans are written; other ranks may call it or not.
  void addPlan(const std::string& strategy, const StepPlan& plan, std::string packing_json = "",
               std::string shard_json = "");

  /// Add a string attribute of /meta known only at the end of the run (rank 0's value is
  /// written). Keys must not clash with RunMeta's.
  void addMeta(std::string key, std::string value) { meta_.extra.emplace_back(std::move(key), std::move(value)); }

  /// Training metrics (`wlb train`), written as `/train/steps` and `/train/ranks` (rank
  /// 0's rows). A file without them has no `/train` group.
  void setTraining(std::vector<TrainStepRow> steps, std::vector<TrainRankRow> ranks) {
    train_steps_ = std::move(steps);
    train_ranks_ = std::move(ranks);
    have_training_ = true;
  }

  /// Write everything and rename to the final name. Collective on the parallel path.
  /// Returns the final path. Throws WriteError (core/error.hpp: the file could not be written)
  /// on every rank, with the first failing rank's reason (collective on the parallel path).
  std::string commit(const Recorder& rec);

  /// JSON text used for a step when no packing JSON is given: the plan's JSON
  /// (core/plan_json.hpp, a plan file's step line without its metrics) plus "strategy".
  static std::string planToJson(const std::string& strategy, const StepPlan& plan);

 private:
  void checkSharedFolder(const std::string& marker, int rank, int size) const;
  std::string path_;
  RunMeta meta_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  WriterOptions opts_;
  std::vector<std::string> plan_strategies_;
  std::vector<PlanStepRow> plan_steps_;  ///< strategy = index into plan_strategies_
  std::vector<SegmentRow> segments_;     ///< strategy = index into plan_strategies_
  bool have_training_ = false;
  std::vector<TrainStepRow> train_steps_;
  std::vector<TrainRankRow> train_ranks_;
};

}  // namespace wlb::trace
