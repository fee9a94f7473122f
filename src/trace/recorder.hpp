#pragma once
/// \file recorder.hpp
/// \brief Per-rank, in-memory timing trace (docs/trace-schema.md).
///
/// A Recorder buffers `Event`s: one timed region of one rank (a kernel, a collective, a
/// P2P transfer) tagged with strategy, step, micro-batch, phase, layer and an op label.
/// Times are nanoseconds on a steady clock, aligned across ranks at construction (each
/// rank's offset to rank 0 is measured by ping-pong) and counted from a common epoch (rank
/// 0's clock at construction), so events of different ranks are directly comparable.
///
/// Measured use (executor):
/// \code
///   auto rec = wlb::trace::alignedRecorder(comm, {tp, cp, pp, dp});   // collective, trace/clock_sync.hpp
///   rec.setStrategy("wlb");
///   rec.setContext({step, mb, wlb::trace::Phase::Fwd, layer});
///   { wlb::trace::Recorder::Scope s(rec, wlb::trace::labels::kAttn, space, flops); run(); }
/// \endcode
/// Predicted use (simulator, no MPI, any number of virtual ranks):
/// \code
///   wlb::trace::Recorder rec;                 // serial
///   rec.setVirtualRanks(coords);              // one RankCoord per simulated rank
///   rec.record(ev);                           // ev.rank = simulated rank, explicit times
/// \endcode

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/mesh_shape.hpp"

namespace wlb::trace {

/// Phase of an event (stored as the HDF5 enum `phase_t`).
enum class Phase : std::int8_t { None = 0, Fwd = 1, Bwd = 2 };

/// Name of a phase: "none", "fwd", "bwd".
const char* phaseName(Phase p);

/// 4D mesh coordinates of one rank (the mesh's own type, core/mesh_shape.hpp).
using RankCoord = MeshCoord;

/// Op labels with a fixed meaning for analysis (docs/trace-schema.md, "Event labels").
/// Recorders pre-register them in this order, so their ids are the same everywhere.
namespace labels {
inline constexpr const char* kStep = "step";                     ///< whole step on a rank (container)
inline constexpr const char* kEmbed = "embed";                   ///< embedding / input
inline constexpr const char* kNorm = "norm";                     ///< layer norms
inline constexpr const char* kQkvProj = "qkv_proj";              ///< QKV projection GEMM
inline constexpr const char* kAttn = "attn";                     ///< attention kernel (core of CP imbalance)
inline constexpr const char* kOutProj = "out_proj";              ///< attention output projection
inline constexpr const char* kMlp = "mlp";                       ///< MLP GEMMs + activation
inline constexpr const char* kLoss = "loss";                     ///< head + loss
inline constexpr const char* kTpAllreduce = "tp_allreduce";      ///< TP all-reduce / reduce-scatter / all-gather
inline constexpr const char* kKvAllgather = "kv_allgather";      ///< CP: KV all-gather (fwd) / dKV reduce-scatter (bwd)
inline constexpr const char* kKvExchange = "kv_exchange";        ///< CP: sharding-aware KV point-to-point exchange
inline constexpr const char* kPpSend = "pp_send";                ///< PP: send activations (fwd) / gradients (bwd)
inline constexpr const char* kPpRecv = "pp_recv";                ///< PP: receive activations / gradients
inline constexpr const char* kGradAllreduce = "grad_allreduce";  ///< DP gradient reduction
inline constexpr const char* kOptimizer = "optimizer";           ///< optimizer update
inline constexpr const char* kIdle = "idle";                     ///< explicit wait (bubble) if recorded
inline constexpr const char* kRecompute = "recompute";           ///< backward's selective recomputation
/// All standard labels in id order.
const std::vector<std::string>& standard();
}  // namespace labels

/// Where an event belongs. -1 means "not specific" (e.g. grad_allreduce has no micro-batch).
struct Context {
  int step = -1;         ///< training step index (as in /plan/steps.step)
  int micro_batch = -1;  ///< micro-batch index within the rank's DP replica (0..M-1)
  Phase phase = Phase::None;
  int layer = -1;  ///< transformer layer index, -1 if not layer-specific
  int chunk = 0;   ///< virtual pipeline stage (interleaved 1F1B model chunk)
};

/// One recorded region. Layout is the in-memory (native) form of the `/events` compound.
struct Event {
  std::int32_t rank = 0;      ///< world rank (or simulated rank)
  std::int32_t strategy = 0;  ///< index into the recorder's / file's strategy list
  std::int32_t step = -1;
  std::int32_t micro_batch = -1;
  std::int32_t region = 0;  ///< index into the label table
  std::int32_t layer = -1;
  std::int32_t chunk = 0;
  Phase phase = Phase::None;
  std::int64_t start_ns = 0;  ///< aligned ns since the run epoch
  std::int64_t end_ns = 0;
  double flops = 0;  ///< floating-point operations done (0 if unknown)
  double bytes = 0;  ///< bytes moved (communication) or touched (0 if unknown)
};

/// Cheap per-rank event buffer with aligned clocks.
class Recorder {
 public:
  /// Serial recorder (no MPI): rank `rank`, clock offset 0, epoch = now.
  explicit Recorder(int rank = 0, RankCoord coord = {});
  /// A recorder with a measured clock alignment (trace::alignedRecorder, which keeps MPI
  /// out of this header): `offset_ns` = this rank's steady clock minus rank 0's,
  /// `epoch_ns` = rank 0's clock at the common epoch.
  Recorder(int rank, RankCoord coord, std::int64_t offset_ns, std::int64_t epoch_ns, std::string start_iso);
  /// Steady clock (ns) and wall-clock ISO-8601 UTC now: the clocks every recorder uses.
  static std::int64_t steadyNowNs();
  static std::string isoNowUtc();

  /// Reserve room for `n` events (avoid growth during timed loops).
  void reserve(std::size_t n) { events_.reserve(n); }

  /// Id of `label` (added if new). Standard labels have fixed ids (labels::standard()).
  int region(std::string_view label);
  const std::vector<std::string>& regions() const { return regions_; }

  /// Select the strategy subsequent events belong to (added if new); returns its index.
  int setStrategy(const std::string& name);
  int strategy() const { return strategy_; }
  const std::vector<std::string>& strategies() const { return strategies_; }

  /// Current context stamped on events recorded through Scope / record(region, ...).
  void setContext(const Context& c) { ctx_ = c; }
  Context& context() { return ctx_; }
  const Context& context() const { return ctx_; }

  /// Aligned now: ns since the run epoch, comparable across ranks.
  std::int64_t now() const;

  /// Record a region of this rank with explicit times (current context/strategy).
  void record(int region, std::int64_t start_ns, std::int64_t end_ns, double flops = 0, double bytes = 0);
  /// Record a fully specified event (any rank: the simulator's virtual ranks). The
  /// region and strategy indices must be valid for this recorder.
  void record(const Event& e);

  const std::vector<Event>& events() const { return events_; }
  void clear() { events_.clear(); }

  int rank() const { return rank_; }
  const RankCoord& coord() const { return coord_; }
  /// This rank's clock offset to rank 0 in ns (local − rank 0), as measured.
  std::int64_t clockOffsetNs() const { return offset_ns_; }
  /// Wall-clock time at the epoch, ISO-8601 UTC ("2025-01-31T12:00:00.123Z").
  const std::string& startTimeIso() const { return start_iso_; }

  /// Simulated ranks: coordinates of every virtual rank 0..N-1 (serial writer path).
  void setVirtualRanks(std::vector<RankCoord> coords) { virtual_ranks_ = std::move(coords); }
  const std::vector<RankCoord>& virtualRanks() const { return virtual_ranks_; }

  /// RAII timed region: stamps start on construction, end on destruction (after fencing
  /// the given execution-space instance, if any), and records it with the context at
  /// construction time.
  class Scope {
   public:
    Scope(Recorder& rec, int region, double flops = 0, double bytes = 0)
        : rec_(&rec), region_(region), flops_(flops), bytes_(bytes), ctx_(rec.context()), start_(rec.now()) {}
    Scope(Recorder& rec, std::string_view label, double flops = 0, double bytes = 0)
        : Scope(rec, rec.region(label), flops, bytes) {}
    /// Fence `space` (any Kokkos execution space instance) before the start and the end
    /// stamps, so the region measures the device work enqueued inside it (on a GPU,
    /// kernels queued earlier would otherwise run into it). The instance must outlive
    /// the scope. Host backends: fences are no-ops.
    template <class ExecSpace>
    Scope(Recorder& rec, int region, const ExecSpace& space, double flops = 0, double bytes = 0)
        : Scope(rec, region, flops, bytes) {
      space.fence();
      start_ = rec.now();
      space_ = &space;
      fence_ = [](const void* s) { static_cast<const ExecSpace*>(s)->fence(); };
    }
    template <class ExecSpace>
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): the constructor it delegates to does
    Scope(Recorder& rec, std::string_view label, const ExecSpace& space, double flops = 0, double bytes = 0)
        : Scope(rec, rec.region(label), space, flops, bytes) {}
    ~Scope() { stop(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

    void setFlops(double f) { flops_ = f; }
    void setBytes(double b) { bytes_ = b; }
    /// Context override (e.g. phase) for this region only.
    Context& context() { return ctx_; }
    /// End now (fence, stamp, record); the destructor then does nothing.
    void stop();
    /// Drop the region without recording it.
    void cancel() { rec_ = nullptr; }

   private:
    Recorder* rec_;
    int region_;
    double flops_, bytes_;
    Context ctx_;
    std::int64_t start_;
    const void* space_ = nullptr;
    void (*fence_)(const void*) = nullptr;
  };

 private:
  void init();
  std::int64_t localNs() const;

  int rank_ = 0;
  RankCoord coord_{};
  std::int64_t offset_ns_ = 0;  ///< local − rank 0
  std::int64_t epoch_ns_ = 0;   ///< rank-0 clock at the epoch
  std::string start_iso_;
  std::vector<std::string> regions_;
  std::unordered_map<std::string, int> region_ids_;
  std::vector<std::string> strategies_;
  int strategy_ = 0;
  Context ctx_{};
  std::vector<Event> events_;
  std::vector<RankCoord> virtual_ranks_;
};

/// A fenced Recorder::Scope with its own phase when `rec` is given; nothing otherwise (the
/// layers, the distributed attention and the sliced executor run with or without one).
struct PhaseScope {
  std::optional<Recorder::Scope> scope;
  template <class ExecSpace>
  PhaseScope(Recorder* rec, std::string_view label, const ExecSpace& space, Phase phase, double flops = 0,
             double bytes = 0) {
    if (!rec) return;
    scope.emplace(*rec, label, space, flops, bytes);
    scope->context().phase = phase;
  }
};

}  // namespace wlb::trace
