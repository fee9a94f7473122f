// The kernel profiler behind `wlb profile` (profile/profiler.hpp, docs/profile-format.md).
#include "profile/profiler.hpp"

#include <dlfcn.h>
#include <fmt/format.h>
#include <time.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/attention.hpp"
#include "attention/attention_host.hpp"
#include "core/deck.hpp"
#include "core/error.hpp"
#include "core/input_file.hpp"
#include "core/kokkos_compat.hpp"
#include "core/output_file.hpp"
#include "core/types.hpp"
#include "cp/shard_plan.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "model/throughput.hpp"
#include "packing/packer.hpp"
#include "runtime/gemm.hpp"
#include "runtime/head.hpp"
#include "runtime/layer.hpp"
#include "runtime/llama.hpp"
#include "runtime/tokens.hpp"
#include "trace/recorder.hpp"

extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                       const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace wlb::profile {
namespace {

namespace att = wlb::attention;
using ES = Kokkos::DefaultExecutionSpace;
using V3 = Kokkos::View<float***, Kokkos::LayoutRight, ES::memory_space>;
using V2 = Kokkos::View<float**, Kokkos::LayoutRight, ES::memory_space>;

double cpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// On a single-threaded backend (Serial) time with process CPU time: the build machines are
// shared, and CPU time is what the kernel costs when it owns a core. Multi-threaded
// backends use wall time.
struct Clock {
  bool cpu = false;
  double now() const {
    if (cpu) return cpuSeconds();
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  /// Best-of-reps seconds of f(), each rep repeating f until min_seconds elapsed.
  template <class F>
  double best(F&& f, int reps, double min_seconds) const {
    double best = 1e300;
    for (int r = 0; r < reps; ++r) {
      int n = 0;
      const double t0 = now();
      double t = 0.0;
      do {
        f();
        ++n;
        t = now() - t0;
      } while (t < min_seconds);
      best = std::min(best, t / n);
    }
    return best;
  }
};

/// One BLAS thread (OpenBLAS exports openblas_set_num_threads; other BLAS: no-op).
void singleThreadBlas() {
  using Fn = void (*)(int);
  if (auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(1);
}

/// One profile run: the options resolved (decks' heads, default grids, --quick limits),
/// the kernel configuration and the clock.
struct Ctx {
  ProfileOptions o;
  att::KernelConfig cfg;
  Clock clock;
};

struct Cell {
  double fwd = 0.0, bwd = 0.0;
};

constexpr bool kHostMem = Kokkos::SpaceAccessibility<Kokkos::HostSpace, ES::memory_space>::accessible;

/// Best-of-reps seconds of one forward and one backward call on `batch` (random inputs).
Cell timeBatch(const Ctx& ctx, const att::VarlenBatch& batch) {
  const ProfileOptions& o = ctx.o;
  const att::KernelConfig& cfg = ctx.cfg;
  const std::size_t Tq = batch.q_tokens, Tk = batch.k_tokens, H = o.heads, Hk = o.kv_heads, D = o.head_dim;
  V3 q("wlb::profile::q", Tq, H, D), k("wlb::profile::k", Tk, Hk, D), v("wlb::profile::v", Tk, Hk, D),
      out("wlb::profile::o", Tq, H, D), dO("wlb::profile::dO", Tq, H, D), dq("wlb::profile::dq", Tq, H, D),
      dk("wlb::profile::dk", Tk, Hk, D), dv("wlb::profile::dv", Tk, Hk, D);
  V2 lse("wlb::profile::lse", Tq, H);
  ES space;
  if constexpr (kHostMem) {
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (V3* x : {&q, &k, &v, &dO}) {
      auto h = Kokkos::create_mirror_view(*x);
      for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = nd(rng);
      Kokkos::deep_copy(*x, h);
    }
  } else {
    // Device: fill in place (a host generator for GPU-sized batches takes longer than the
    // timing); uniform in +-sqrt(3) has the normal's variance.
    std::uint64_t stream = 0;
    for (V3* x : {&q, &k, &v, &dO})
      wlb::runtime::fillRandom(space, wlb::runtime::Mat(x->data(), x->extent(0), x->extent(1) * x->extent(2)), 3,
                               ++stream, 1.7320508f);
    space.fence();
  }
  Cell c;
  c.fwd = ctx.clock.best([&] { att::forward(space, q, k, v, batch, out, lse, cfg); }, o.reps, o.min_seconds);
  c.bwd = ctx.clock.best([&] { att::backward(space, q, k, v, out, lse, dO, batch, dq, dk, dv, cfg); }, o.reps,
                         o.min_seconds);
  return c;
}

/// Throughput of a batch of `copies` identical pieces (nq queries, nk keys each): 4e6
/// padded pairs per call on a core, 16384 query tokens per call on a device.
Cell measure(const Ctx& ctx, std::int64_t nq, std::int64_t nk) {
  const ProfileOptions& o = ctx.o;
  const att::KernelConfig& cfg = ctx.cfg;
  const double padded1 = att::paddedPairs(nq, nk, cfg);
  std::int64_t copies = std::max<std::int64_t>(1, static_cast<std::int64_t>(4.0e6 / padded1));
  if constexpr (!kHostMem) {
    // Device: 16384 query tokens per call (as bench/profile_torch.py), at most 32 GB of
    // q, k, v, o, dO and gradient buffers.
    const double bytes1 =
        16.0 * o.head_dim * (static_cast<double>(nq) * o.heads + static_cast<double>(nk) * o.kv_heads);
    copies = std::clamp<std::int64_t>((16384 + nq - 1) / nq, 1,
                                      std::max<std::int64_t>(1, static_cast<std::int64_t>(32e9 / bytes1)));
  }
  std::vector<att::PieceRange> pieces;
  for (std::int64_t i = 0; i < copies; ++i) pieces.push_back({i * nq, (i + 1) * nq, i * nk, (i + 1) * nk});
  const auto batch = att::VarlenBatch::fromRanges(pieces);
  const double flops = att::forwardFlops(batch.paddedPairs(cfg), o.heads, o.head_dim);
  const Cell t = timeBatch(ctx, batch);
  Cell c;
  c.fwd = flops / t.fwd * 1e-9;
  c.bwd = 2.5 * flops / t.bwd * 1e-9;
  return c;
}

double gemmGflops(const Ctx& ctx) {
  const ProfileOptions& o = ctx.o;
  if constexpr (!kHostMem) {
    // Device: the executor's own GEMM (Kokkos-Kernels / cuBLAS) as a step at the profile's
    // precision runs it: bf16 keeps activations and working weights in BF16 storage, so the
    // anchor is the BF16-storage product (on FP32 storage cuBLAS converts the operands on
    // every call: 405 against 641 TFLOP/s in-step on an H200)
    namespace rt = wlb::runtime;
    const std::int64_t n = o.quick ? 1024 : 8192;
    rt::Mat a("wlb::profile::ga", n, n), b("wlb::profile::gb", n, n), c("wlb::profile::gc", n, n);
    ES space;
    rt::fillRandom(space, a, 1, 1, 1.0f);
    rt::fillRandom(space, b, 1, 2, 1.0f);
    const auto p = rt::parsePrecision(o.precision, "--precision");
    const auto best = [&](const auto& x, const auto& y, const auto& z) {
      return ctx.clock.best(
          [&] {
            rt::gemm(space, rt::Trans::N, rt::Trans::N, 1.0f, x, y, 0.0f, z, p);
            space.fence();
          },
          o.reps, o.min_seconds);
    };
    double t = 0.0;
    if (p == rt::Precision::Bf16) {
      rt::BMat ab("wlb::profile::gab", n, n), bb("wlb::profile::gbb", n, n), cb("wlb::profile::gcb", n, n);
      rt::convert<rt::bf16>(space, a, ab);
      rt::convert<rt::bf16>(space, b, bb);
      t = best(ab, bb, cb);
    } else {
      t = best(a, b, c);
    }
    return 2.0 * static_cast<double>(n) * n * n / t * 1e-9;
  }
  const int n = o.quick ? 512 : 1024;
  std::vector<float> a(static_cast<std::size_t>(n) * n, 0.5f), b(a), c(a.size());
  const float one = 1.0f, zero = 0.0f;
  const double t =
      ctx.clock.best([&] { sgemm_("N", "N", &n, &n, &n, &one, a.data(), &n, b.data(), &n, &zero, c.data(), &n); },
                     o.reps, o.min_seconds);
  return 2.0 * n * static_cast<double>(n) * n / t * 1e-9;
}

/// Register-only FMA loop at the kernels' vector width: what one core delivers right now.
/// Device: 8 independent FMA chains per thread over every thread of the device.
double fmaPeak(const Clock& clock) {
  if constexpr (!kHostMem) {
    const int n = 1 << 20, iters = 2048;
    Kokkos::View<float*, ES::memory_space> out("wlb::profile::fma", n);
    ES space;
    const double t = clock.best(
        [&] {
          Kokkos::parallel_for(
              "wlb::profile::fma_peak", Kokkos::RangePolicy<ES>(space, 0, n), KOKKOS_LAMBDA(const int i) {
                float a[8];
                for (int u = 0; u < 8; ++u) a[u] = static_cast<float>(i) * 1e-9f + static_cast<float>(u);
                for (int k = 0; k < iters; ++k)
                  for (int u = 0; u < 8; ++u) a[u] = a[u] * 0.9999f + 1e-7f;
                float s = 0.0f;
                for (int u = 0; u < 8; ++u) s += a[u];
                out(i) = s;
              });
          space.fence();
        },
        3, 0.05);
    return 2.0 * 8.0 * iters * static_cast<double>(n) / t * 1e-9;
  }
#if WLB_ATTN_HOST_SIMD
  double flops = 0.0;
  const double t = clock.best([&] { flops = att::host::fmaLoop(10000000); }, 5, 0.02);
  return flops / t * 1e-9;
#else
  return 0.0;
#endif
}

std::string isoNow() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

// ---- deck-shaped profile (--deck) -------------------------------------------------------

/// One CP rank's share of one planned micro-batch: tokens and attention pieces.
struct RankBatch {
  std::int64_t tokens = 0;
  struct Piece {
    std::int64_t segment = 0, q0 = 0, q = 0;  ///< queries [q0, q0+q) of the segment; keys from its start
  };
  std::vector<Piece> pieces;
};

struct DeckPlans {
  wlb::model::ModelDims dims;
  std::int64_t tp = 1;
  std::vector<std::string> decks, strategies;
  std::vector<std::int64_t> ref_tokens;  ///< per deck: context_window / cp (CostModel::linearReferenceTokens)
  std::vector<RankBatch> batches;        ///< every (strategy, step, replica, micro-batch, CP rank) with tokens
  std::int64_t steps = 0;
  std::size_t pieces = 0;
};

/// Plan every strategy of every deck as `wlb run` does (warm-up + steps + drain; the deck's
/// own profile for the packers and shard planners) and keep what each rank computes.
DeckPlans planDecks(const ProfileOptions& o) {
  DeckPlans out;
  for (std::size_t di = 0; di < o.decks.size(); ++di) {
    const std::string& path = o.decks[di];
    const wlb::Deck deck = wlb::loadDeck(path, o.overrides);
    wlb::requireOneCase(deck, path, "wlb profile --deck");
    const auto dims = wlb::model::ModelDims::fromDeck(deck.model);
    (void)wlb::runtime::LayerShape::fromDims(dims, static_cast<int>(deck.mesh.tp));  // divisibility, names the key
    if (di == 0) {
      out.dims = dims;
      out.tp = deck.mesh.tp;
    } else {
      const auto& d0 = out.dims;
      const std::pair<const char*, std::pair<std::int64_t, std::int64_t>> keys[] = {
          {"model.hidden", {d0.hidden, dims.hidden}},       {"model.heads", {d0.heads, dims.heads}},
          {"model.kv_heads", {d0.kv_heads, dims.kv_heads}}, {"model.ffn", {d0.ffn, dims.ffn}},
          {"model.vocab", {d0.vocab, dims.vocab}},          {"mesh.tp", {out.tp, deck.mesh.tp}}};
      for (const auto& [key, v] : keys)
        if (v.first != v.second)
          throw wlb::InputError(path + ": " + key + " = " + std::to_string(v.second) + " differs from " +
                                o.decks.front() + "'s " + std::to_string(v.first) +
                                "; a profile holds one layer shape (profile each shape separately)");
    }
    out.decks.push_back(std::filesystem::path(path).filename().string());
    out.ref_tokens.push_back(
        std::max<std::int64_t>(1, deck.data.context_window / std::max<std::int64_t>(1, deck.mesh.cp)));
    const auto cost = wlb::model::CostModel::fromDeck(deck);
    const std::int64_t total = std::max<std::int64_t>(0, deck.run.warmup) + deck.run.steps;
    for (const auto& pr : wlb::resolveStrategies(deck)) {
      if (std::find(out.strategies.begin(), out.strategies.end(), pr.name) == out.strategies.end())
        out.strategies.push_back(pr.name);
      auto src = wlb::data::makeLengthSource(deck);
      auto packer = wlb::packing::makePacker(pr.packer, deck, cost);
      wlb::model::DrainWatch drain_watch;
      for (std::int64_t step = 0;; ++step) {
        const bool drain = step >= total;
        if (drain && packer->pendingTokens() == 0) break;
        if (drain && drain_watch.stalled(packer->pendingTokens()))
          throw std::logic_error("wlb profile: " + pr.packer + " still holds documents after the drain limit");
        const auto docs = drain ? std::vector<wlb::Document>{} : src->next(step);
        const wlb::StepPlan plan = packer->pack(step, docs);
        ++out.steps;
        for (const auto& rep : plan.replicas)
          for (std::size_t m = 0; m < rep.size(); ++m) {
            const auto& mb = rep[m];
            if (mb.tokens() == 0) continue;
            const auto* merged = plan.mergedAt(static_cast<std::int64_t>(m));
            if (pr.packer == "slimpack" && !merged) {
              // run sliced on one rank (runtime/sliced.hpp): a piece per slice, its queries
              // after the keys of the document's earlier slices
              RankBatch b;
              b.tokens = mb.tokens();
              for (std::size_t i = 0; i < mb.segments.size(); ++i)
                b.pieces.push_back({static_cast<std::int64_t>(i), mb.segments[i].q_offset, mb.segments[i].length});
              out.pieces += b.pieces.size();
              out.batches.push_back(std::move(b));
              continue;
            }
            // a DP-Merge unit is sharded over its group of replicas as a CP group
            const int ranks = merged ? static_cast<int>(merged->group.size()) : static_cast<int>(deck.mesh.cp);
            const auto sp = wlb::cp::planShards(mb, pr.sharding, ranks, cost, deck.cp);
            for (const auto& r : sp.ranks) {
              if (r.tokens == 0) continue;
              RankBatch b;
              b.tokens = r.tokens;
              for (const auto& p : r.pieces) b.pieces.push_back({p.segment, p.q_offset, p.q_len});
              out.pieces += b.pieces.size();
              out.batches.push_back(std::move(b));
            }
          }
      }
    }
  }
  if (out.batches.empty()) throw wlb::InputError("wlb profile: the decks' plans hold no tokens");
  return out;
}

/// `points` values from lo to hi, evenly spaced in log, rounded, distinct.
std::vector<std::int64_t> geomGrid(std::int64_t lo, std::int64_t hi, int points) {
  lo = std::max<std::int64_t>(1, lo);
  if (hi <= lo || points < 2) return {lo};
  std::vector<std::int64_t> v;
  v.reserve(static_cast<std::size_t>(points));
  for (int i = 0; i < points; ++i)
    v.push_back(std::llround(static_cast<double>(lo) *
                             std::pow(static_cast<double>(hi) / static_cast<double>(lo), i / (points - 1.0))));
  v.front() = lo;
  v.back() = hi;
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

/// Seconds of one layer's work for `n` tokens on one rank, as `wlb run` executes it.
struct LinearCell {
  double op[wlb::model::kLinearOpCount][2];  ///< qkv_proj, out_proj, mlp events [phase]
  double elementwise[2];                     ///< construct + forward / backward + teardown minus op events
  double fill[2];                            ///< embedding + fused loss (fwd), embedding backward (bwd)
  double recompute;                          ///< the backward's `recompute` events (selective)
};

/// Recorder clock (ns) at the steps of one layer pass, and the process CPU time it took.
struct LayerPassTimes {
  /// Ends of: the embedding, the layer's forward, the loss (head forward + backward), the
  /// layer's backward, the embedding's backward.
  std::int64_t start = 0, embedded = 0, forward = 0, loss = 0, backward = 0, embed_bwd = 0;
  double cpu_seconds = 0;
};

// ---- The one place this file runs the model (runtime/layer.hpp, head.hpp) ----------------
// The linear ops are timed as `wlb run` executes them: a real runtime::LayerStep of the
// one model, the recorder giving each op's time.
/// `passes` forward + backward passes of a one-layer model (embedding, layer, fused loss)
/// on one rank (MPI_COMM_SELF, cp = 1, tp = 1 of a `tp`-way split) over a micro-batch of
/// `n` synthetic tokens in 64-token documents (attention negligible, and timed separately
/// anyway), as a micro-batch of `wlb run`. The ops record into `rec` (cleared before each pass);
/// `on_pass(pass, times)` reads it after each pass.
void runLayerPasses(const model::ModelDims& dims, std::int64_t tp, std::int64_t n, const att::KernelConfig& kcfg,
                    int passes, trace::Recorder& rec, const std::function<void(int, const LayerPassTimes&)>& on_pass) {
  namespace rt = wlb::runtime;
  rt::LlamaConfig mc = rt::LlamaConfig::of(dims, static_cast<int>(tp));  // this rank's TP slice of
  mc.vocab = std::max(1, mc.vocab);                                      // one layer with the model's ends
  mc.layers = 1;
  rt::Llama model(mc, 1234, kcfg.precision);
  const model::CostModel cost(dims, model::HardwareProfile::analytic(), tp);  // FLOPs of the events
  MicroBatch mb;
  std::vector<rt::TokenRef> refs;
  for (std::int64_t t = 0, d = 0; t < n; t += 64, ++d) {
    mb.segments.push_back({d, 0, std::min<std::int64_t>(64, n - t), 0});
    rt::appendSegmentRows(mb.segments.back(), false, refs);
  }
  CpConfig cpc;
  cpc.comm = "sharding_aware";
  const cp::ShardPlan sp = cp::planShards(mb, "per_sequence", 1, cost, cpc);
  const cp::CommPlan cpl = cp::planComm(sp, cp::CommMode::ShardingAware, cost);
  rt::Space space;
  rt::RopeTable rope(mc.headDim(), 10000.0);
  rope.ensure(space, 64);
  const rt::TokenRows rows = rt::TokenRows::make(space, rt::SyntheticTokens(1, mc.vocab), refs, mc.vocab);
  rt::LayerEnv env;
  env.space = &space;
  env.cp_comm = MPI_COMM_SELF;
  env.tp_comm = MPI_COMM_NULL;
  env.tp = 1;
  env.cost = &cost;
  env.recorder = &rec;
  env.rope = &rope;
  rt::BufferPool pool(space);  // as a run's stage walker: the passes repeat its shapes
  env.pool = &pool;
  env.kernel = kcfg;
  env.precision = kcfg.precision;  // GEMMs at the attention's precision (run.precision)
  // The backward's recomputation is an event of its own, outside the ops: with it on, one
  // table prices pipeline.recompute "none" and "selective" alike.
  env.recompute_selective = true;
  rec.reserve(64);
  for (int it = 0; it < passes; ++it) {
    model.zeroGrads(space);
    rec.clear();
    LayerPassTimes t;
    const double cpu0 = cpuSeconds();
    t.start = rec.now();
    rec.setContext({0, 0, trace::Phase::Fwd, -1});
    rt::Mat x = rt::embedForward(env, model, rows);
    kk::fence(space, "wlb::profile::embed");
    t.embedded = rec.now();
    rec.setContext({0, 0, trace::Phase::Fwd, 0});
    auto ls = std::make_unique<rt::LayerStep>(env, model, 0, sp, cpl);
    rt::Mat y = ls->forward(x, rows.positions);
    kk::fence(space, "wlb::profile::fwd");
    t.forward = rec.now();
    rec.setContext({0, 0, trace::Phase::Fwd, -1});
    rt::Mat dy = rt::lossForward(env, model, rows, y, true, 1.0f / static_cast<float>(n)).dx;
    kk::fence(space, "wlb::profile::loss");
    t.loss = rec.now();
    rec.setContext({0, 0, trace::Phase::Bwd, 0});
    rt::Mat dx = ls->backward(dy, rows.positions);
    ls.reset();
    kk::fence(space, "wlb::profile::bwd");
    t.backward = rec.now();
    rec.setContext({0, 0, trace::Phase::Bwd, -1});
    rt::embedBackward(env, model, rows, dx);
    kk::fence(space, "wlb::profile::embed_bwd");
    t.embed_bwd = rec.now();
    t.cpu_seconds = cpuSeconds() - cpu0;
    x = y = dy = dx = rt::Mat();
    on_pass(it, t);
  }
}
// ---- end of the model runs --------------------------------------------

/// One pass's op, elementwise and fill seconds from its recorder events. On a serial
/// backend (`cpu_clock`) the share of the core this process got (page faults included, as
/// system time) scales the wall-clock times, so other jobs on the core do not count.
LinearCell linearCell(const trace::Recorder& rec, const LayerPassTimes& t, bool cpu_clock) {
  const double wall = static_cast<double>(t.embed_bwd - t.start) * 1e-9;
  const double share = cpu_clock && wall > 0 ? std::min(1.0, t.cpu_seconds / wall) : 1.0;
  LinearCell c{};
  double inside[2] = {0, 0};
  for (const auto& e : rec.events()) {
    const std::string& l = rec.regions()[static_cast<std::size_t>(e.region)];
    const double d = static_cast<double>(e.end_ns - e.start_ns) * 1e-9;
    const int ph = e.phase == trace::Phase::Bwd ? 1 : 0;
    bool counted = l == trace::labels::kAttn;
    if (l == trace::labels::kRecompute) {
      c.recompute += d;
      counted = true;
    }
    for (int k = 0; k < model::kLinearOpCount; ++k)
      if (l == model::linearOpName(static_cast<model::LinearOp>(k))) {
        c.op[k][ph] += d;
        counted = true;
      }
    // KV events that move bytes are communication; a rank's own-run copies (0 bytes) are
    // elementwise work, as `wlb calibrate` counts them
    if ((l == trace::labels::kKvExchange || l == trace::labels::kKvAllgather) && e.bytes > 0) counted = true;
    if (counted) inside[ph] += d;
  }
  c.elementwise[0] = std::max(0.0, static_cast<double>(t.forward - t.embedded) * 1e-9 - inside[0]);
  c.elementwise[1] = std::max(0.0, static_cast<double>(t.backward - t.loss) * 1e-9 - inside[1]);
  // the model's ends: the embedding and the fused loss run in the forward tasks, the
  // embedding's backward in the backward ones
  c.fill[0] = static_cast<double>(t.embedded - t.start + t.loss - t.forward) * 1e-9;
  c.fill[1] = static_cast<double>(t.embed_bwd - t.backward) * 1e-9;
  for (int ph = 0; ph < 2; ++ph) {
    for (auto& op : c.op) op[ph] *= share;
    c.elementwise[ph] *= share;
    c.fill[ph] *= share;
  }
  c.recompute *= share;
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t k = v.size();
  return k == 0 ? 0.0 : k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}

/// The layer's ops at every token count of `grid`: per size, warm-up repetitions until the
/// allocator has settled (a run's steps repeat its micro-batch sizes, so its large outputs
/// come back from the heap instead of first-touch page faults), then the median of `rounds`
/// repetitions per quantity.
std::vector<LinearCell> measureLinear(const Ctx& ctx, const model::ModelDims& dims, std::int64_t tp,
                                      const std::vector<std::int64_t>& grid, int rounds) {
  constexpr int kWarmup = 3;
  std::vector<std::vector<LinearCell>> cells(grid.size());
  const auto t0 = std::chrono::steady_clock::now();
  double done = 0, total = 0;
  for (auto n : grid) total += static_cast<double>(n);
  trace::Recorder rec;
  for (std::size_t i = 0; i < grid.size(); ++i) {
    runLayerPasses(dims, tp, grid[i], ctx.cfg, kWarmup + rounds, rec, [&](int r, const LayerPassTimes& t) {
      if (r >= kWarmup) cells[i].push_back(linearCell(rec, t, ctx.clock.cpu));
    });
    done += static_cast<double>(grid[i]);
    const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (ctx.o.progress)
      std::fprintf(stderr,
                   "wlb profile: layer ops at %lld tokens, %d warm-up + %d repetitions  [%zu/%zu, ETA %.0f s]\n",
                   static_cast<long long>(grid[i]), kWarmup, rounds, i + 1, grid.size(), el / done * (total - done));
  }
  std::vector<LinearCell> out(grid.size());
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const auto med = [&](auto get) {
      std::vector<double> v;
      for (const auto& c : cells[i]) v.push_back(get(c));
      return median(v);
    };
    for (int k = 0; k < model::kLinearOpCount; ++k)
      for (int ph = 0; ph < 2; ++ph) out[i].op[k][ph] = med([&](const LinearCell& c) { return c.op[k][ph]; });
    for (int ph = 0; ph < 2; ++ph) {
      out[i].elementwise[ph] = med([&](const LinearCell& c) { return c.elementwise[ph]; });
      out[i].fill[ph] = med([&](const LinearCell& c) { return c.fill[ph]; });
    }
    out[i].recompute = med([&](const LinearCell& c) { return c.recompute; });
  }
  return out;
}

/// A rank's batch as the executor lays it out: queries back to back, one KV block per
/// segment (its longest prefix) shared by the segment's pieces.
att::VarlenBatch layoutBatch(const RankBatch& b) {
  std::map<std::int64_t, std::int64_t> block_len, block_begin;
  for (const auto& p : b.pieces) block_len[p.segment] = std::max(block_len[p.segment], p.q0 + p.q);
  std::int64_t kv = 0;
  for (const auto& [seg, len] : block_len) {
    block_begin[seg] = kv;
    kv += len;
  }
  std::vector<att::PieceRange> ranges;
  std::int64_t q = 0;
  for (const auto& p : b.pieces) {
    const std::int64_t k0 = block_begin[p.segment];
    ranges.push_back({q, q + p.q, k0, k0 + p.q0 + p.q});
    q += p.q;
  }
  return att::VarlenBatch::fromRanges(ranges);
}

double round4(double x) {
  return std::round(x * 1e4) / 1e4;
}

/// The version-2 parts of a deck-shaped profile: `linear_ops` measured at the plans' token
/// counts, `factors` attn.* from whole rank batches of the plans against the table in `j`.
void addDeckShaped(const Ctx& ctx, const DeckPlans& plans, nlohmann::json& j) {
  const ProfileOptions& o = ctx.o;
  const att::KernelConfig& cfg = ctx.cfg;
  namespace m = model;
  std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = 0;
  for (const auto& b : plans.batches) {
    lo = std::min(lo, b.tokens);
    hi = std::max(hi, b.tokens);
  }
  // the cost model reads the table at each deck's context_window / cp: measure there exactly
  auto grid = geomGrid(lo, hi, o.quick ? 2 : 4);
  grid.insert(grid.end(), plans.ref_tokens.begin(), plans.ref_tokens.end());
  std::sort(grid.begin(), grid.end());
  grid.erase(std::unique(grid.begin(), grid.end()), grid.end());
  const m::CostModel flops_model(plans.dims, m::HardwareProfile::analytic(), plans.tp);
  nlohmann::json gf = nlohmann::json::object(),
                 el = {{"fwd", nlohmann::json::array()}, {"bwd", nlohmann::json::array()}}, fill = el,
                 recompute = nlohmann::json::array();
  for (int k = 0; k < m::kLinearOpCount; ++k)
    gf[m::linearOpName(static_cast<m::LinearOp>(k))] = {{"fwd", nlohmann::json::array()},
                                                        {"bwd", nlohmann::json::array()}};
  double total_flops = 0, total_s = 0;
  const auto measured = measureLinear(ctx, plans.dims, plans.tp, grid, o.quick ? 2 : std::max(o.reps, 7));
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const std::int64_t n = grid[i];
    const LinearCell& c = measured[i];
    std::string line;
    for (int k = 0; k < m::kLinearOpCount; ++k) {
      const auto op = static_cast<m::LinearOp>(k);
      for (int ph = 0; ph < 2; ++ph) {
        const double f = flops_model.linearOpFlops(op, n, ph == 0 ? m::Phase::Fwd : m::Phase::Bwd);
        const double g = f / std::max(c.op[k][ph], 1e-12) * 1e-9;
        total_flops += f;
        total_s += c.op[k][ph];
        gf[m::linearOpName(op)][ph == 0 ? "fwd" : "bwd"].push_back(std::round(g * 100.0) / 100.0);
        line += fmt::format(" {} {:.1f}", ph == 0 ? m::linearOpName(op) : "/", g);
      }
    }
    for (int ph = 0; ph < 2; ++ph) {
      const char* p = ph == 0 ? "fwd" : "bwd";
      el[p].push_back(std::round(c.elementwise[ph] / static_cast<double>(n) * 1e9 * 100.0) / 100.0);
      fill[p].push_back(std::round(c.fill[ph] / static_cast<double>(n) * 1e9 * 100.0) / 100.0);
    }
    recompute.push_back(std::round(c.recompute / static_cast<double>(n) * 1e9 * 100.0) / 100.0);
    if (o.progress)
      std::fprintf(stderr,
                   "wlb profile: layer ops at %lld tokens:%s GFLOP/s (fwd / bwd); elementwise %.1f / %.1f ns/token, "
                   "fills %.1f / %.1f ns/token; recompute %.1f ns/token  [%zu/%zu]\n",
                   static_cast<long long>(n), line.c_str(), c.elementwise[0] / static_cast<double>(n) * 1e9,
                   c.elementwise[1] / static_cast<double>(n) * 1e9, c.fill[0] / static_cast<double>(n) * 1e9,
                   c.fill[1] / static_cast<double>(n) * 1e9, c.recompute / static_cast<double>(n) * 1e9, i + 1,
                   grid.size());
  }
  j["version"] = 2;
  j["linear_ops"] = {{"shape",
                      {{"hidden", plans.dims.hidden},
                       {"heads", plans.dims.heads},
                       {"kv_heads", plans.dims.kv_heads},
                       {"head_dim", plans.dims.head_dim},
                       {"ffn", plans.dims.ffn},
                       {"tp", plans.tp},
                       {"vocab", plans.dims.vocab}}},
                     {"tokens", grid},
                     {"gflops", gf},
                     {"elementwise_ns_per_token", el},
                     {"fill_ns_per_token", fill},
                     {"recompute_ns_per_token", recompute},
                     {"note",
                      "one rank of the layer as `wlb run` executes it (runtime::LayerStep), per token count 3 "
                      "warm-up repetitions, then the median of " +
                          std::to_string(o.quick ? 2 : std::max(o.reps, 7)) + " repetitions; wall time" +
                          (ctx.clock.cpu ? " x the process's CPU share of it" : "")}};

  // Attention factors: whole rank batches of the plans against the table just measured.
  m::HardwareProfile table = m::HardwareProfile::analytic();
  table.tile_q = cfg.tile_q;
  table.tile_k = cfg.tile_k;
  for (int ph = 0; ph < 2; ++ph) {
    const auto& t = j["attention"][ph == 0 ? "fwd" : "bwd"];
    m::ThroughputTable& tt = ph == 0 ? table.fwd : table.bwd;
    tt.q_lens = t["q_lens"].get<std::vector<double>>();
    tt.k_lens = t["k_lens"].get<std::vector<double>>();
    tt.gflops = t["gflops"].get<std::vector<std::vector<double>>>();
  }
  const m::CostModel tcost(plans.dims, table, plans.tp);
  std::vector<std::pair<double, std::size_t>> order;
  for (std::size_t i = 0; i < plans.batches.size(); ++i) {
    double p = 0;
    for (const auto& pc : plans.batches[i].pieces) p += tcost.attnSeconds(pc.q0, pc.q, m::Phase::Fwd);
    order.push_back({p, i});
  }
  std::sort(order.begin(), order.end());
  const std::size_t nb = std::min<std::size_t>(order.size(), o.quick ? 2 : 6);
  std::vector<std::size_t> pick;
  for (std::size_t i = 0; i < nb; ++i) {
    const std::size_t at = static_cast<std::size_t>(
        std::llround(static_cast<double>(i + 1) / static_cast<double>(nb) * static_cast<double>(order.size() - 1)));
    if (std::find(pick.begin(), pick.end(), order[at].second) == pick.end()) pick.push_back(order[at].second);
  }
  double pred[2] = {0, 0}, meas[2] = {0, 0};
  nlohmann::json bj = nlohmann::json::array();
  for (std::size_t i = 0; i < pick.size(); ++i) {
    const RankBatch& b = plans.batches[pick[i]];
    const Cell t = timeBatch(ctx, layoutBatch(b));
    double p[2] = {0, 0};
    for (const auto& pc : b.pieces) {
      p[0] += tcost.attnSeconds(pc.q0, pc.q, m::Phase::Fwd);
      p[1] += tcost.attnSeconds(pc.q0, pc.q, m::Phase::Bwd);
    }
    pred[0] += p[0];
    pred[1] += p[1];
    meas[0] += t.fwd;
    meas[1] += t.bwd;
    bj.push_back({{"tokens", b.tokens},
                  {"pieces", b.pieces.size()},
                  {"fwd_s", {{"table", p[0]}, {"measured", t.fwd}}},
                  {"bwd_s", {{"table", p[1]}, {"measured", t.bwd}}}});
    if (o.progress)
      std::fprintf(stderr,
                   "wlb profile: rank batch of %lld tokens, %zu pieces: fwd %.4f s (table %.4f), bwd %.4f s (table "
                   "%.4f)  [%zu/%zu]\n",
                   static_cast<long long>(b.tokens), b.pieces.size(), t.fwd, p[0], t.bwd, p[1], i + 1, pick.size());
  }
  nlohmann::json factors = nlohmann::json::object();
  for (const auto& key : m::Factors::keys()) factors[key] = 1.0;
  for (int ph = 0; ph < 2; ++ph)
    if (meas[ph] > 0 && pred[ph] > 0)
      factors[ph == 0 ? "attn.fwd" : "attn.bwd"] = round4(std::clamp(pred[ph] / meas[ph], 1e-3, 1e3));
  j["factors"] = factors;
  j["deck_profile"] = {
      {"decks", plans.decks},
      {"strategies", plans.strategies},
      {"planned_steps", plans.steps},
      {"rank_batches", plans.batches.size()},
      {"pieces", plans.pieces},
      {"tokens_per_rank", {lo, hi}},
      {"piece_q", {j["attention"]["fwd"]["q_lens"].front(), j["attention"]["fwd"]["q_lens"].back()}},
      {"piece_k", {j["attention"]["fwd"]["k_lens"].front(), j["attention"]["fwd"]["k_lens"].back()}},
      {"timed_batches", bj},
      {"linear_gflops_deck", total_s > 0 ? std::round(total_flops / total_s * 1e-9 * 10.0) / 10.0 : 0.0}};
  std::string decks;
  for (const auto& d : plans.decks) decks += (decks.empty() ? "" : ", ") + d;
  j["sources"].push_back("deck-shaped (`wlb profile --deck`: " + decks +
                         "): attention grid over the plans' piece shapes, linear_ops = the layer's ops at the plans' "
                         "per-rank token counts, factors attn.* = table / measured time of " +
                         std::to_string(pick.size()) + " whole rank batches of the plans");
}

}  // namespace

ProfileResult measureProfile(ProfileOptions o) {
  if (!(o.peak_gflops >= 0.0) || !std::isfinite(o.peak_gflops))  // NaN fails the first test
    throw wlb::InputError("wlb profile: --peak-gflops must be a finite number >= 0 (0: measure the FMA loop)");
  Clock clock;
  clock.cpu = ES().concurrency() == 1 && !o.wall_clock;
  singleThreadBlas();
  att::KernelConfig cfg;
  cfg.tile_q = o.tile_q;
  cfg.tile_k = o.tile_k;
  cfg.precision = wlb::runtime::parsePrecision(o.precision, "--precision");
  if (!att::setHopperVariant(cfg, o.attention))
    throw wlb::InputError("wlb profile: --attention: unknown variant '" + o.attention + "' (" +
                          att::hopperVariantList() + ")");
  try {
    att::validateConfig(cfg);
  } catch (const std::invalid_argument& e) {
    throw wlb::InputError(std::string("wlb profile: --tile-q/--tile-k: ") + e.what());
  }
  if (o.reps < 1) throw wlb::InputError("wlb profile: --reps must be >= 1");
  if (!(o.min_seconds >= 0 && o.min_seconds <= 3600))
    throw wlb::InputError("wlb profile: --min-seconds must be in [0, 3600]");
  const bool deck_mode = !o.decks.empty();
  DeckPlans plans;
  std::int64_t piece_q[2] = {0, 0}, piece_k[2] = {0, 0}, rank_tok[2] = {0, 0};
  if (deck_mode) {
    if (o.head_opts_given)
      throw wlb::InputError(
          "wlb profile: --head-dim/--heads/--kv-heads come from the deck with --deck (model.*, "
          "mesh.tp); change them with --set");
    plans = planDecks(o);
    o.heads = static_cast<int>(plans.dims.heads / plans.tp);
    o.kv_heads = static_cast<int>(plans.dims.kv_heads / plans.tp);
    o.head_dim = static_cast<int>(plans.dims.head_dim);
    piece_q[0] = piece_k[0] = rank_tok[0] = std::numeric_limits<std::int64_t>::max();
    for (const auto& b : plans.batches) {
      rank_tok[0] = std::min(rank_tok[0], b.tokens);
      rank_tok[1] = std::max(rank_tok[1], b.tokens);
      for (const auto& p : b.pieces) {
        piece_q[0] = std::min(piece_q[0], p.q);
        piece_q[1] = std::max(piece_q[1], p.q);
        piece_k[0] = std::min(piece_k[0], p.q0 + p.q);
        piece_k[1] = std::max(piece_k[1], p.q0 + p.q);
      }
    }
    if (o.q_lens.empty()) o.q_lens = geomGrid(piece_q[0], piece_q[1], o.quick ? 3 : 5);
    if (o.k_lens.empty()) o.k_lens = geomGrid(piece_k[0], piece_k[1], o.quick ? 3 : 6);
    if (o.progress)
      std::fprintf(
          stderr,
          "wlb profile: planned %lld step(s) of %zu strateg%s over %zu deck(s): %zu rank batches, %zu pieces "
          "(q %lld..%lld, k %lld..%lld), %lld..%lld tokens per rank; heads %d, kv_heads %d, head_dim %d\n",
          static_cast<long long>(plans.steps), plans.strategies.size(), plans.strategies.size() == 1 ? "y" : "ies",
          plans.decks.size(), plans.batches.size(), plans.pieces, static_cast<long long>(piece_q[0]),
          static_cast<long long>(piece_q[1]), static_cast<long long>(piece_k[0]), static_cast<long long>(piece_k[1]),
          static_cast<long long>(rank_tok[0]), static_cast<long long>(rank_tok[1]), o.heads, o.kv_heads, o.head_dim);
  }
  if (o.head_dim <= 0 || o.head_dim > 256) throw wlb::InputError("wlb profile: --head-dim must be in 1..256");
  if (o.heads <= 0 || o.kv_heads <= 0 || o.heads % o.kv_heads != 0)
    throw wlb::InputError("wlb profile: --heads must be a positive multiple of --kv-heads");
  if (o.q_lens.empty())
    o.q_lens = o.quick ? std::vector<std::int64_t>{16, 128, 1024} : std::vector<std::int64_t>{16, 64, 256, 1024, 4096};
  if (o.k_lens.empty())
    o.k_lens = o.quick ? std::vector<std::int64_t>{16, 128, 1024, 4096}
                       : std::vector<std::int64_t>{16, 64, 256, 1024, 4096, 16384};
  for (auto* lens : {&o.q_lens, &o.k_lens}) {
    std::sort(lens->begin(), lens->end());
    lens->erase(std::unique(lens->begin(), lens->end()), lens->end());
    if (lens->front() <= 0) throw wlb::InputError("wlb profile: --q-lens/--k-lens must be positive");
    // a cell's Q, K, V, O and gradients are allocated whole: past 2^20 rows they outgrow a GPU
    if (lens->back() > (std::int64_t{1} << 20))
      throw wlb::InputError("wlb profile: --q-lens/--k-lens must be at most 1048576 (got " +
                            std::to_string(lens->back()) + ")");
  }
  if (o.quick) {
    o.reps = std::min(o.reps, 2);
    o.min_seconds = std::min(o.min_seconds, 0.01);
  }
  // read the base now: a bad one fails before the measurement, not after it
  nlohmann::json base;
  if (!o.base.empty()) {
    auto bf = wlb::openInput(o.base, "wlb profile: --base");
    try {
      bf >> base;
    } catch (const std::exception& e) {
      throw wlb::InputError("wlb profile: --base " + o.base + " is not JSON: " + e.what());
    }
    // the fields of a profile (a whole one, or only the ones to carry over)
    if (!base.is_object()) throw wlb::InputError("wlb profile: --base " + o.base + " is not a JSON object");
    for (const char* k : {"links", "rank_speed", "attention"})  // carried over whole: objects, as a profile has them
      if (base.contains(k) && !base[k].is_object())
        throw wlb::InputError("wlb profile: --base " + o.base + ": '" + k + "' must be an object");
    // A whole profile is checked as one now, naming the base, not after the measurement; a
    // partial one by the keys it carries over.
    if (base.contains("format")) {
      (void)model::HardwareProfile::load(o.base);
    } else {
      nlohmann::json probe = {{"format", "wlb-hardware-profile"}, {"version", 1}};
      for (const char* k : {"links", "memory_gb", "peak_gflops"})
        if (base.contains(k)) probe[k] = base[k];
      (void)model::HardwareProfile::fromJson(probe, "wlb profile: --base " + o.base);
    }
  }
  const Ctx ctx{o, cfg, clock};
  nlohmann::json fwd = nlohmann::json::array(), bwd = nlohmann::json::array();
  const auto t_cells = std::chrono::steady_clock::now();
  const auto cells = static_cast<long long>(o.q_lens.size()) * static_cast<long long>(o.k_lens.size());
  long long done = 0;
  for (auto nq : o.q_lens) {
    nlohmann::json rf = nlohmann::json::array(), rb = nlohmann::json::array();
    Cell diag;
    bool have_diag = false;
    for (auto nk : o.k_lens) {
      Cell c;
      if (nk < nq) {  // ignored by the cost model: write the value at k = q
        if (!have_diag) {
          diag = measure(ctx, nq, nq);
          have_diag = true;
        }
        c = diag;
      } else if (nk == nq && have_diag) {
        c = diag;
      } else {
        c = measure(ctx, nq, nk);
      }
      // cells cost ~ q*k and come small first: the mean-so-far ETA runs low early
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_cells).count();
      ++done;
      if (o.progress)
        std::fprintf(stderr,
                     "wlb profile: q=%-6lld k=%-6lld fwd %7.1f  bwd %7.1f GFLOP/s (padded)  [%lld/%lld, ETA %.0f s]\n",
                     static_cast<long long>(nq), static_cast<long long>(nk), c.fwd, c.bwd, done, cells,
                     el / static_cast<double>(done) * static_cast<double>(cells - done));
      rf.push_back(std::round(c.fwd * 100.0) / 100.0);
      rb.push_back(std::round(c.bwd * 100.0) / 100.0);
    }
    fwd.push_back(rf);
    bwd.push_back(rb);
  }
  const double peak = o.peak_gflops > 0.0 ? o.peak_gflops : fmaPeak(clock);
  const double linear = gemmGflops(ctx);
  nlohmann::json j;
  j["format"] = "wlb-hardware-profile";
  j["version"] = 1;
  j["name"] = o.name;
  j["backend"] = wlb::kk::backendName();
  j["created"] = isoNow();
  const std::string linear_src = kHostMem
                                     ? "BLAS sgemm " + std::string(o.quick ? "512" : "1024") + "^3, one thread"
                                     : wlb::runtime::gemmBackend() + " " + std::string(o.quick ? "1024" : "8192") +
                                           "^3" + (o.precision == "bf16" ? " on BF16 storage" : " on FP32 storage");
  j["sources"] = {"measured by `wlb profile` (attention: wlb::attention kernels, " + o.precision +
                      (o.attention == "auto" ? std::string() : ", kernel variant " + o.attention) + ", best of " +
                      std::to_string(o.reps) + " repetitions; linear: " + linear_src +
                      (o.peak_gflops > 0.0 ? "; peak: --peak-gflops" : "; peak: register-only FP32 FMA loop") +
                      "; timed with " + (clock.cpu ? "process CPU time" : "wall time") + ")",
                  "heads " + std::to_string(o.heads) + ", kv_heads " + std::to_string(o.kv_heads) + ", Kokkos " +
                      wlb::kk::versionString()};
  j["peak_gflops"] = std::round((peak > 0.0 ? peak : 220.0) * 10.0) / 10.0;
  j["linear_gflops"] = std::round(linear * 10.0) / 10.0;
  j["tile_q"] = cfg.tile_q;
  j["tile_k"] = cfg.tile_k;
  j["head_dim"] = o.head_dim;
  j["attention"] = {{"fwd", {{"q_lens", o.q_lens}, {"k_lens", o.k_lens}, {"gflops", fwd}}},
                    {"bwd", {{"q_lens", o.q_lens}, {"k_lens", o.k_lens}, {"gflops", bwd}}}};
  const long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGE_SIZE);
  if (kHostMem && pages > 0 && psize > 0)
    j["memory_gb"] = std::round(static_cast<double>(pages) * psize / 1e9 * 10.0) / 10.0;
  if (!o.base.empty()) {
    // Keep what this command does not measure (links, topology, memory, the tensor-core
    // peak) from the base profile; say so in the file. Nothing else: the base's calibration
    // (factors, rank_speed, its history) and deck-shaped timings describe its own tables,
    // and would scale the new ones.
    std::vector<std::string> kept;
    for (const char* k : {"links", "topology", "memory_gb", "peak_gflops"}) {
      if (!base.contains(k)) continue;
      if (std::string(k) == "peak_gflops") {
        if (o.peak_gflops > 0.0) continue;  // given on the command line: that one stands
        j["measured_fma_gflops"] = j[k];
      } else if (j.contains(k)) {
        continue;  // measured here (the host's memory)
      }
      j[k] = base[k];
      kept.emplace_back(k);
    }
    std::string list;
    for (const auto& k : kept) list += (list.empty() ? "" : ", ") + k;
    if (list.empty()) list = "nothing";
    j["sources"].push_back("carried over from base profile " + o.base + ", not measured: " + list);
    j["description"] = "wlb::attention kernels (" + o.precision + ") and " + linear_src +
                       " measured by `wlb profile` on " + wlb::kk::backendName() + "; " + list + " from " + o.base;
  }
  if (deck_mode) addDeckShaped(ctx, plans, j);
  ProfileResult r;
  r.profile = std::move(j);
  r.peak_gflops = peak;
  r.linear_gflops = linear;
  r.tile_q = cfg.tile_q;
  r.tile_k = cfg.tile_k;
  r.head_dim = o.head_dim;
  return r;
}

void writeProfile(const nlohmann::json& profile, const std::string& path, const TemporaryTracker& track_temporary) {
  // the file must load as a profile before it takes the name (a base's field could spoil it)
  wlb::writeFileAtomically(path, "wlb profile: --out", profile.dump(2) + "\n", track_temporary,
                           [](const std::string& tmp) { (void)model::HardwareProfile::load(tmp); });
}

}  // namespace wlb::profile
