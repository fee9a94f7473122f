// Attention kernels on the default execution space (built for CUDA: the H100 figures of
// docs/performance.md): precision checks of every mode against a float64 reference, then
// useful TFLOP/s of forward and backward on the three cases, next to an FP32 FMA
// peak measured in the same run.
//
//   bench_attention_gpu [--check-only] [--bench-only] [--quick] [--repeats N]
//                       [--modes fp32,tf32,bf16] [--cases a,b,c,d]
//                       [--paths auto,sm80,sync,split,ws,...] [--json FILE]
//
// Useful FLOPs: forward 4*D*heads*pairs (pairs = unmasked query-key pairs), backward 2.5x
// forward. Case a: one 8192-token document, 32 heads / 8 KV heads, D = 128. Case b: 65536
// packed tokens, document lengths from bench/attention_case_b.txt (lognormal, median 1024,
// sigma 1.2, seed 0, capped at 32768). Case c: case a with D = 64. Case d: the CP-piece
// grid, one piece of q queries at the end of a k-key prefix (what per-document CP and
// SlimPack slices make), q in {64, 256, 1024} x k in {16K, 64K, 128K}, 32 / 8 heads, D 128;
// rows "d:q64k16K" etc. Paths: sm80 (the sm_80 kernels even on a Hopper GPU) and the
// Hopper variants of attention::setHopperVariant (docs/attention.md): auto (the default:
// the warp-specialised BF16 forward, the synchronous backward), sync (the synchronous
// kernels), split / sync-split (split-KV for pieces of <= 256 queries over >= 16K keys),
// ws / ws-split (the warp-specialised backward too), ws-r64 (ws with the backward's
// 64-row step at D = 64 instead of 128); BF16 only, other modes run the
// synchronous kernels. Timing: fence, steady
// clock around a loop of calls, median and range over repeats. Precision: documents of
// 1, 17, 300, 1000 and 4097 tokens packed together plus CP-style pieces (queries shorter
// than their key prefix), GQA 8/2, D 64 and 128, fresh random inputs, outputs poisoned with
// NaN before every forward call; error = max|x - ref| / max|ref| per tensor. Each kernel is
// checked on its own inputs (the backward on the float64 forward outputs); the gradient
// error of backward-after-forward is printed too ("chained").
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "attention/attention.hpp"
#include "attention/attention_host.hpp"

namespace att = wlb::attention;
using ES = Kokkos::DefaultExecutionSpace;
using Mem = ES::memory_space;
using V3 = Kokkos::View<float***, Kokkos::LayoutRight, Mem>;
using V3b = Kokkos::View<att::bf16***, Kokkos::LayoutRight, Mem>;
using V2 = Kokkos::View<float**, Kokkos::LayoutRight, Mem>;
using Prec = att::KernelConfig::Precision;

namespace {

struct Opts {
  bool check = true, bench = true, quick = false;
  int repeats = 7;
  std::vector<std::string> modes{"fp32", "tf32", "bf16"};
  std::vector<std::string> cases{"a", "b", "c"};
  /// kernel families: sm80 and the Hopper variants (auto, sync, split, ws, ...)
  std::vector<std::string> paths{"auto"};
  std::string json;
};

/// The kernel configuration of a path name (precision set by the caller).
att::KernelConfig pathOf(const std::string& p) {
  att::KernelConfig cfg;
  if (p == "auto") return cfg;
  if (p == "sm80") {
    cfg.path = att::KernelConfig::Path::Sm80;
    return cfg;
  }
  if (p == "ws-r64") {  // ws with the previous 64-row backward step at D = 64
    att::setHopperVariant(cfg, "ws");
    cfg.ws_bwd_rows = 64;
    return cfg;
  }
  if (att::setHopperVariant(cfg, p)) return cfg;
  std::fprintf(stderr, "bench_attention_gpu: unknown path '%s' (sm80, ws-r64, %s)\n", p.c_str(),
               att::hopperVariantList().c_str());
  std::exit(2);
}

/// The path name of a kernel configuration (pathOf's inverse).
const char* pathName(const att::KernelConfig& cfg) {
  if (cfg.path == att::KernelConfig::Path::Sm80) return "sm80";
  return cfg.ws_bwd_rows == 64 ? "ws-r64" : att::hopperVariant(cfg);
}

std::vector<std::string> splitList(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ','))
    if (!x.empty()) out.push_back(x);
  return out;
}

Prec precisionOf(const std::string& m) {
  if (m == "fp32") return Prec::Fp32;
  if (m == "tf32") return Prec::Tf32;
  if (m == "bf16") return Prec::Bf16;
  std::fprintf(stderr, "bench_attention_gpu: unknown mode '%s' (fp32, tf32, bf16)\n", m.c_str());
  std::exit(2);
}

// ---------------- problem data -----------------------------------------------------------

struct Problem {
  att::VarlenBatch batch;
  int heads = 32, kv_heads = 8, D = 128;
  std::vector<float> q, k, v, dO;  // host copies (bf16 mode rounds them)
};

void fillRandom(std::vector<float>& x, std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  x.resize(n);
  for (auto& e : x) e = nd(rng);
}

Problem makeProblem(att::VarlenBatch batch, int heads, int kv, int D, std::uint64_t seed) {
  Problem p;
  p.batch = std::move(batch);
  p.heads = heads;
  p.kv_heads = kv;
  p.D = D;
  std::mt19937_64 rng(seed);
  fillRandom(p.q, static_cast<std::size_t>(p.batch.q_tokens) * heads * D, rng);
  fillRandom(p.k, static_cast<std::size_t>(p.batch.k_tokens) * kv * D, rng);
  fillRandom(p.v, static_cast<std::size_t>(p.batch.k_tokens) * kv * D, rng);
  fillRandom(p.dO, static_cast<std::size_t>(p.batch.q_tokens) * heads * D, rng);
  return p;
}

template <class View, class T>
View upload(const std::vector<float>& x, std::int64_t t, int h, int d, const char* name) {
  View v(std::string(name), static_cast<std::size_t>(t), static_cast<std::size_t>(h), static_cast<std::size_t>(d));
  auto hv = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < x.size(); ++i) hv.data()[i] = att::fromFloat<T>(x[i]);
  Kokkos::deep_copy(v, hv);
  return v;
}

template <class V>
std::vector<double> download(const V& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<double> out(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) out[i] = static_cast<double>(att::toFloat(h.data()[i]));
  return out;
}

/// Device buffers of one problem in one storage type.
template <class T>
struct Buffers {
  using VT = Kokkos::View<T***, Kokkos::LayoutRight, Mem>;
  VT q, k, v, o, dO;
  V3 dq, dk, dv;
  V2 lse;
  explicit Buffers(const Problem& p) {
    const std::int64_t tq = p.batch.q_tokens, tk = p.batch.k_tokens;
    q = upload<VT, T>(p.q, tq, p.heads, p.D, "q");
    k = upload<VT, T>(p.k, tk, p.kv_heads, p.D, "k");
    v = upload<VT, T>(p.v, tk, p.kv_heads, p.D, "v");
    dO = upload<VT, T>(p.dO, tq, p.heads, p.D, "dO");
    o = VT("o", tq, p.heads, p.D);
    lse = V2("lse", tq, p.heads);
    dq = V3("dq", tq, p.heads, p.D);
    dk = V3("dk", tk, p.kv_heads, p.D);
    dv = V3("dv", tk, p.kv_heads, p.D);
  }
  void poison() {
    Kokkos::deep_copy(o, att::fromFloat<T>(std::numeric_limits<float>::quiet_NaN()));
    Kokkos::deep_copy(lse, std::numeric_limits<float>::quiet_NaN());
  }
  void zeroGrads() {
    Kokkos::deep_copy(dq, 0.0f);
    Kokkos::deep_copy(dk, 0.0f);
    Kokkos::deep_copy(dv, 0.0f);
  }
  void forward(const ES& space, const att::VarlenBatch& b, const att::KernelConfig& cfg) {
    att::forward(space, q, k, v, b, o, lse, cfg);
  }
  void backward(const ES& space, const att::VarlenBatch& b, const att::KernelConfig& cfg) {
    att::backward(space, q, k, v, o, lse, dO, b, dq, dk, dv, cfg);
  }
};

// ---------------- float64 reference (threaded: it checks 5.4K-token batches) ------------

struct Ref {
  std::vector<double> o, lse, dq, dk, dv;
};

/// Inputs as the kernel sees them (bf16 storage rounds them).
std::vector<double> asSeen(const std::vector<float>& x, bool bf) {
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = bf ? att::roundBf16(x[i]) : x[i];
  return y;
}

Ref reference(const Problem& p, bool bf) {
  const auto q = asSeen(p.q, bf), k = asSeen(p.k, bf), v = asSeen(p.v, bf), dO = asSeen(p.dO, bf);
  const int H = p.heads, Hk = p.kv_heads, D = p.D, G = H / Hk;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Ref r;
  r.o.assign(q.size(), 0.0);
  r.lse.assign(static_cast<std::size_t>(p.batch.q_tokens) * H, 0.0);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(k.size(), 0.0);
  // tasks: (piece, head); dk/dv partials per task, summed afterwards per kv head
  struct Task {
    std::size_t piece;
    int h;
    std::vector<double> dk, dv;
  };
  std::vector<Task> tasks;
  for (std::size_t pi = 0; pi < p.batch.pieces.size(); ++pi)
    for (int h = 0; h < H; ++h) tasks.push_back({pi, h, {}, {}});
  auto work = [&](Task& tk) {
    const auto& pc = p.batch.pieces[tk.piece];
    const std::int64_t nq = pc.nq(), nk = pc.nk(), off = nk - nq;
    const int h = tk.h, hk = h / G;
    tk.dk.assign(static_cast<std::size_t>(nk) * D, 0.0);
    tk.dv.assign(static_cast<std::size_t>(nk) * D, 0.0);
    std::vector<double> s(static_cast<std::size_t>(nk)), dp(static_cast<std::size_t>(nk));
    for (std::int64_t i = 0; i < nq; ++i) {
      const std::int64_t t = pc.q_begin + i, L = off + i;
      const double* qi = &q[(static_cast<std::size_t>(t) * H + h) * D];
      const double* doi = &dO[(static_cast<std::size_t>(t) * H + h) * D];
      double m = -1e300;
      for (std::int64_t j = 0; j <= L; ++j) {
        const double* kj = &k[(static_cast<std::size_t>(pc.k_begin + j) * Hk + hk) * D];
        double d = 0;
        for (int e = 0; e < D; ++e) d += qi[e] * kj[e];
        s[j] = d * scale;
        m = std::max(m, s[j]);
      }
      double l = 0;
      for (std::int64_t j = 0; j <= L; ++j) l += std::exp(s[j] - m);
      const double lse = m + std::log(l);
      r.lse[static_cast<std::size_t>(t) * H + h] = lse;
      double* oi = &r.o[(static_cast<std::size_t>(t) * H + h) * D];
      for (std::int64_t j = 0; j <= L; ++j) {
        s[j] = std::exp(s[j] - lse);  // P
        const double* vj = &v[(static_cast<std::size_t>(pc.k_begin + j) * Hk + hk) * D];
        for (int e = 0; e < D; ++e) oi[e] += s[j] * vj[e];
      }
      double delta = 0;
      for (int e = 0; e < D; ++e) delta += doi[e] * oi[e];
      double* dqi = &r.dq[(static_cast<std::size_t>(t) * H + h) * D];
      for (std::int64_t j = 0; j <= L; ++j) {
        const double* vj = &v[(static_cast<std::size_t>(pc.k_begin + j) * Hk + hk) * D];
        const double* kj = &k[(static_cast<std::size_t>(pc.k_begin + j) * Hk + hk) * D];
        double d = 0;
        for (int e = 0; e < D; ++e) d += doi[e] * vj[e];
        const double ds = s[j] * (d - delta) * scale;
        double* dkj = &tk.dk[static_cast<std::size_t>(j) * D];
        double* dvj = &tk.dv[static_cast<std::size_t>(j) * D];
        for (int e = 0; e < D; ++e) {
          dqi[e] += ds * kj[e];
          dkj[e] += ds * qi[e];
          dvj[e] += s[j] * doi[e];
        }
      }
    }
  };
  // big tasks first across the threads
  std::vector<std::size_t> order(tasks.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return p.batch.pieces[tasks[a].piece].nk() > p.batch.pieces[tasks[b].piece].nk();
  });
  std::atomic<std::size_t> next{0};
  const unsigned nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < nt; ++i)
    pool.emplace_back([&] {
      for (std::size_t n; (n = next.fetch_add(1)) < order.size();) work(tasks[order[n]]);
    });
  for (auto& th : pool) th.join();
  for (auto& tk : tasks) {
    const auto& pc = p.batch.pieces[tk.piece];
    const int hk = tk.h / G;
    for (std::int64_t j = 0; j < pc.nk(); ++j)
      for (int e = 0; e < D; ++e) {
        const std::size_t gi = (static_cast<std::size_t>(pc.k_begin + j) * Hk + hk) * D + e;
        r.dk[gi] += tk.dk[static_cast<std::size_t>(j) * D + e];
        r.dv[gi] += tk.dv[static_cast<std::size_t>(j) * D + e];
      }
  }
  return r;
}

/// max|x - ref| / max|ref|; NaN anywhere -> +inf.
double relErr(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::fabs(x[i] - ref[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return den > 0 ? num / den : num;
}

double tolerance(Prec m) {
  return m == Prec::Fp32 ? 1e-5 : m == Prec::Tf32 ? 2e-3 : 1e-2;
}

template <class T>
bool checkOne(const Problem& p, const Ref& ref, Prec mode, const std::string& what, att::KernelConfig cfg) {
  ES space;
  cfg.precision = mode;
  Buffers<T> b(p);
  // forward, outputs poisoned first
  b.poison();
  b.forward(space, p.batch, cfg);
  Kokkos::fence();
  const double eo = relErr(download(b.o), ref.o), el = relErr(download(b.lse), ref.lse);
  // chained: backward on this forward's O and LSE (what training does; informational)
  b.zeroGrads();
  b.backward(space, p.batch, cfg);
  Kokkos::fence();
  const double chained =
      std::max({relErr(download(b.dq), ref.dq), relErr(download(b.dk), ref.dk), relErr(download(b.dv), ref.dv)});
  // per call: backward on the float64 forward outputs (stored in the storage type), so the
  // figure is the backward kernel's own error
  {
    auto ho = Kokkos::create_mirror_view(b.o);
    auto hl = Kokkos::create_mirror_view(b.lse);
    for (std::size_t i = 0; i < ho.size(); ++i) ho.data()[i] = att::fromFloat<T>(static_cast<float>(ref.o[i]));
    for (std::size_t i = 0; i < hl.size(); ++i) hl.data()[i] = static_cast<float>(ref.lse[i]);
    Kokkos::deep_copy(b.o, ho);
    Kokkos::deep_copy(b.lse, hl);
  }
  b.zeroGrads();
  b.backward(space, p.batch, cfg);
  Kokkos::fence();
  const double eq = relErr(download(b.dq), ref.dq), ek = relErr(download(b.dk), ref.dk),
               ev = relErr(download(b.dv), ref.dv);
  const double worst = std::max({eo, el, eq, ek, ev});
  const bool ok = worst <= tolerance(mode);
  std::printf(
      "  check %-4s %-22s %-18s %-8s o %.2e lse %.2e dq %.2e dk %.2e dv %.2e  (tol %.0e) %s  "
      "[chained grads %.2e]\n",
      std::is_same<T, att::bf16>::value ? "bf16" : (mode == Prec::Tf32 ? "tf32" : "fp32"), what.c_str(),
      att::kernelName<ES>(p.D, cfg, std::is_same<T, att::bf16>::value), pathName(cfg), eo, el, eq, ek, ev,
      tolerance(mode), ok ? "ok" : "FAILED", chained);
  return ok;
}

bool runChecks(const Opts& o, std::uint64_t seed) {
  bool all = true;
  for (int D : {64, 128}) {
    // documents of the issue, then a CP-style batch: two pieces of one document (queries
    // shorter than their key prefix) and a piece whose keys are another's prefix
    const std::vector<std::int64_t> docs =
        o.quick ? std::vector<std::int64_t>{1, 17, 300} : std::vector<std::int64_t>{1, 17, 300, 1000, 4097};
    std::vector<att::PieceRange> cp = {{0, 700, 0, 1500}, {700, 1500, 1500, 3800}, {1500, 1501, 0, 1}};
    if (o.quick) cp = {{0, 70, 0, 150}, {70, 150, 150, 380}, {150, 151, 0, 1}};
    // pieces of few queries over long prefixes (split-KV's case: <= 256 queries, >= 16K keys)
    std::vector<att::PieceRange> lng = {{0, 64, 0, 20000}, {64, 320, 20000, 37000}, {320, 832, 37000, 50000}};
    if (o.quick) lng = {{0, 64, 0, 16400}, {64, 100, 16400, 17000}};
    for (int which = 0; which < 3; ++which) {
      auto batch = which == 0   ? att::VarlenBatch::fromDocLengths(docs)
                   : which == 1 ? att::VarlenBatch::fromRanges(cp)
                                : att::VarlenBatch::fromRanges(lng);
      const std::string what = (which == 0   ? "docs "
                                : which == 1 ? "cp-pieces "
                                             : "cp-long ") +
                               std::string("D=") + std::to_string(D);
      const Problem p = makeProblem(batch, 8, 2, D, seed + static_cast<std::uint64_t>(D * 2 + which));
      const Ref r32 = reference(p, false);
      const Ref r16 = reference(p, true);
      for (const auto& pa : o.paths)
        for (const auto& m : o.modes) {
          const Prec mode = precisionOf(m);
          all &= mode == Prec::Bf16 ? checkOne<att::bf16>(p, r16, mode, what, pathOf(pa))
                                    : checkOne<float>(p, r32, mode, what, pathOf(pa));
        }
    }
  }
  return all;
}

// ---------------- timing ---------------------------------------------------------------

struct Timing {
  double median = 0, lo = 0, hi = 0;  // seconds per call
};

template <class F>
Timing timeIt(F&& f, int repeats, double min_seconds) {
  f();  // warm-up (module load, first-touch allocations)
  Kokkos::fence();
  auto t0 = std::chrono::steady_clock::now();
  f();
  Kokkos::fence();
  const double one = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int iters = std::max(1, static_cast<int>(min_seconds / std::max(one, 1e-6)));
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    Kokkos::fence();
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) f();
    Kokkos::fence();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back()};
}

std::vector<std::int64_t> caseBLengths() {
  // from the repository root when run there (the build may have moved), else the source tree
  std::ifstream in("bench/attention_case_b.txt");
  if (!in) in.open(std::string(WLB_BENCH_DIR) + "/attention_case_b.txt");
  std::vector<std::int64_t> lens;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && line[0] != '#') lens.push_back(std::stoll(line));
  if (lens.empty()) {
    std::fprintf(stderr, "bench_attention_gpu: cannot read %s/attention_case_b.txt\n", WLB_BENCH_DIR);
    std::exit(2);
  }
  return lens;
}

struct Row {
  std::string cas, mode, kernel, path;
  double fwd_tf = 0, bwd_tf = 0, both_tf = 0, fwd_lo = 0, fwd_hi = 0, bwd_lo = 0, bwd_hi = 0, fwd_ms = 0, bwd_ms = 0;
};

template <class T>
Row benchOne(const Problem& p, Prec mode, const std::string& cas, const Opts& o, att::KernelConfig cfg) {
  ES space;
  cfg.precision = mode;
  Buffers<T> b(p);
  b.zeroGrads();
  const double min_s = o.quick ? 0.02 : 0.2;
  const Timing tf = timeIt([&] { b.forward(space, p.batch, cfg); }, o.repeats, min_s);
  const Timing tb = timeIt([&] { b.backward(space, p.batch, cfg); }, o.repeats, min_s);
  const double ff = att::forwardFlops(p.batch.usefulPairs(), p.heads, p.D), fb = 2.5 * ff;
  Row r;
  r.cas = cas;
  r.mode = std::is_same<T, att::bf16>::value ? "bf16" : (mode == Prec::Tf32 ? "tf32" : "fp32");
  r.kernel = att::kernelName<ES>(p.D, cfg, std::is_same<T, att::bf16>::value);
  r.path = pathName(cfg);
  r.fwd_tf = ff / tf.median * 1e-12;
  r.fwd_lo = ff / tf.hi * 1e-12;
  r.fwd_hi = ff / tf.lo * 1e-12;
  r.bwd_tf = fb / tb.median * 1e-12;
  r.bwd_lo = fb / tb.hi * 1e-12;
  r.bwd_hi = fb / tb.lo * 1e-12;
  r.both_tf = (ff + fb) / (tf.median + tb.median) * 1e-12;
  r.fwd_ms = tf.median * 1e3;
  r.bwd_ms = tb.median * 1e3;
  return r;
}

/// FP32 FMA peak of the device: 8 independent chains per thread, all threads busy. On a
/// host space: the host kernels' own FMA loop (one core).
double fmaPeakTflops(bool quick) {
#if WLB_ATTN_HOST_SIMD
  if constexpr (Kokkos::SpaceAccessibility<ES, Kokkos::HostSpace>::accessible) {
    const auto t0 = std::chrono::steady_clock::now();
    const double flops = att::host::fmaLoop(quick ? 2000000 : 20000000);
    return flops / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e-12;
  }
#endif
  const int n = quick ? 1 << 12 : 1 << 20;
  const int iters = quick ? 64 : 4096;
  Kokkos::View<float*, Mem> out("fma", n);
  auto run = [&] {
    Kokkos::parallel_for(
        "bench::fma_peak", Kokkos::RangePolicy<ES>(0, n), KOKKOS_LAMBDA(const int i) {
          float a0 = i * 1e-9f, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, a4 = a0 + 4, a5 = a0 + 5, a6 = a0 + 6,
                a7 = a0 + 7;
          const float m = 0.9999f, c = 1e-7f;
          // 4 x 8 FMAs per trip: the loop counter must not cost FMA issue slots
          for (int k = 0; k < iters; k += 4) {
            for (int u = 0; u < 4; ++u) {
              a0 = a0 * m + c;
              a1 = a1 * m + c;
              a2 = a2 * m + c;
              a3 = a3 * m + c;
              a4 = a4 * m + c;
              a5 = a5 * m + c;
              a6 = a6 * m + c;
              a7 = a7 * m + c;
            }
          }
          out(i) = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
        });
  };
  const Timing t = timeIt(run, 5, quick ? 0.01 : 0.1);
  return 2.0 * 8.0 * iters * static_cast<double>(n) / t.median * 1e-12;
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard guard(argc, argv);
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_attention_gpu: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--check-only")
      o.bench = false;
    else if (a == "--bench-only")
      o.check = false;
    else if (a == "--quick")
      o.quick = true, o.repeats = 3;
    else if (a == "--repeats")
      o.repeats = std::max(1, std::atoi(val().c_str()));
    else if (a == "--modes")
      o.modes = splitList(val());
    else if (a == "--cases")
      o.cases = splitList(val());
    else if (a == "--paths")
      o.paths = splitList(val());
    else if (a == "--json")
      o.json = val();
    else if (a == "--help" || a == "-h") {
      std::printf(
          "usage: bench_attention_gpu [--check-only] [--bench-only] [--quick] [--repeats N] "
          "[--modes fp32,tf32,bf16] [--cases a,b,c,d] [--paths auto,sm80,split,ws,ws-split,ws-r64] [--json FILE]\n");
      return 0;
    } else if (a.rfind("--kokkos", 0) != 0) {
      std::fprintf(stderr, "bench_attention_gpu: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  for (const auto& m : o.modes) precisionOf(m);
  for (const auto& pa : o.paths) pathOf(pa);
  std::printf("bench_attention_gpu: execution space %s\n", ES::name());
  bool ok = true;
  if (o.check) {
    const std::uint64_t seed = static_cast<std::uint64_t>(std::random_device{}()) ^
                               static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("precision checks (seed %llu):\n", static_cast<unsigned long long>(seed));
    ok = runChecks(o, seed);
    std::printf("precision checks: %s\n", ok ? "all passed" : "FAILED");
  }
  std::vector<Row> rows;
  double peak = 0;
  if (o.bench) {
    peak = fmaPeakTflops(o.quick);
    std::printf("FP32 FMA peak measured: %.1f TFLOP/s\n", peak);
    // case d expands into its grid cells
    std::vector<std::string> cases;
    for (const auto& c : o.cases) {
      if (c != "d") {
        cases.push_back(c);
        continue;
      }
      for (int q : {64, 256, 1024})
        for (int k : {16, 64, 128}) cases.push_back("d:q" + std::to_string(q) + "k" + std::to_string(k) + "K");
    }
    for (const auto& c : cases) {
      std::vector<std::int64_t> lens;
      int D = 128;
      att::VarlenBatch cell;
      if (c.rfind("d:", 0) == 0) {
        std::int64_t nq = std::stoll(c.substr(3, c.find('k') - 3));
        std::int64_t nk = std::stoll(c.substr(c.find('k') + 1)) * 1024;
        if (o.quick) nk = std::min<std::int64_t>(nk, 16384), nq = std::min<std::int64_t>(nq, 256);
        cell = att::VarlenBatch::fromRanges({{0, nq, 0, nk}});
      } else if (c == "a")
        lens = {8192};
      else if (c == "b")
        lens = caseBLengths();
      else if (c == "c")
        lens = {8192}, D = 64;
      else {
        std::fprintf(stderr, "bench_attention_gpu: unknown case '%s' (a, b, c, d)\n", c.c_str());
        return 2;
      }
      if (o.quick && cell.pieces.empty()) {
        std::int64_t budget = 2048;
        std::vector<std::int64_t> cut;
        for (auto l : lens) {
          if (budget <= 0) break;
          cut.push_back(std::min(l, budget));
          budget -= cut.back();
        }
        lens = cut;
      }
      const Problem p = makeProblem(cell.pieces.empty() ? att::VarlenBatch::fromDocLengths(lens) : std::move(cell),
                                    o.quick ? 4 : 32, o.quick ? 1 : 8, D, 7);
      for (const auto& pa : o.paths)
        for (const auto& m : o.modes) {
          const Prec mode = precisionOf(m);
          rows.push_back(mode == Prec::Bf16 ? benchOne<att::bf16>(p, mode, c, o, pathOf(pa))
                                            : benchOne<float>(p, mode, c, o, pathOf(pa)));
          const Row& r = rows.back();
          std::printf(
              "  case %s %-4s %-18s %-8s fwd %8.2f TFLOP/s [%.2f, %.2f] (%.3f ms)  bwd %8.2f [%.2f, %.2f] (%.3f ms)  "
              "fwd+bwd %8.2f\n",
              r.cas.c_str(), r.mode.c_str(), r.kernel.c_str(), r.path.c_str(), r.fwd_tf, r.fwd_lo, r.fwd_hi, r.fwd_ms,
              r.bwd_tf, r.bwd_lo, r.bwd_hi, r.bwd_ms, r.both_tf);
          std::fflush(stdout);
        }
    }
    std::printf("\n%-12s %-4s %-18s %-8s %10s %10s %10s %12s\n", "case", "mode", "kernel", "path", "fwd", "bwd",
                "fwd+bwd", "fwd/FMA peak");
    for (const auto& r : rows)
      std::printf("%-12s %-4s %-18s %-8s %10.2f %10.2f %10.2f %11.1f%%\n", r.cas.c_str(), r.mode.c_str(),
                  r.kernel.c_str(), r.path.c_str(), r.fwd_tf, r.bwd_tf, r.both_tf, 100.0 * r.fwd_tf / peak);
  }
  if (!o.json.empty()) {
    const std::string tmp = o.json + ".tmp";
    {
      std::ofstream js(tmp);
      js << "{\n  \"execution_space\": \"" << ES::name() << "\",\n  \"fp32_fma_peak_tflops\": " << peak
         << ",\n  \"checks_passed\": " << (ok ? "true" : "false") << ",\n  \"rows\": [";
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        js << (i ? "," : "") << "\n    {\"case\": \"" << r.cas << "\", \"mode\": \"" << r.mode << "\", \"kernel\": \""
           << r.kernel << "\", \"path\": \"" << r.path << "\", \"fwd_tflops\": " << r.fwd_tf << ", \"fwd_range\": ["
           << r.fwd_lo << ", " << r.fwd_hi << "], \"bwd_tflops\": " << r.bwd_tf << ", \"bwd_range\": [" << r.bwd_lo
           << ", " << r.bwd_hi << "], \"fwd_bwd_tflops\": " << r.both_tf << ", \"fwd_ms\": " << r.fwd_ms
           << ", \"bwd_ms\": " << r.bwd_ms << "}";
      }
      js << "\n  ]\n}\n";
    }
    std::rename(tmp.c_str(), o.json.c_str());
  }
  return ok ? 0 : 1;
}
