// `wlb profile --out profile.json`: measure the attention kernels' achieved throughput
// (GFLOP/s on tile-padded FLOPs) over a grid of query x key lengths, forward and backward,
// plus GEMM and FMA peak throughput, and write the hardware profile JSON read by the cost
// model (docs/profile-format.md). Single process; run it on an otherwise idle core.
#include <dlfcn.h>
#include <time.h>

#include <unistd.h>
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "app/command.hpp"
#include "attention/attention.hpp"
#include "attention/attention_host.hpp"
#include "core/error.hpp"
#include "core/kokkos_compat.hpp"

extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                       const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

namespace att = wlb::attention;
using ES = Kokkos::DefaultExecutionSpace;
using V3 = Kokkos::View<float***, Kokkos::LayoutRight, ES::memory_space>;
using V2 = Kokkos::View<float**, Kokkos::LayoutRight, ES::memory_space>;

struct Opts {
  std::string out, name = "cpu-1core";
  int head_dim = 64, heads = 2, kv_heads = 1, tile_q = 64, tile_k = 64, reps = 3;
  double min_seconds = 0.05, peak = 0.0;
  bool quick = false, wall_clock = false;
  std::vector<std::int64_t> q_lens, k_lens;
};

// On a single-threaded backend (Serial) time with process CPU time: the build machines are
// shared, and CPU time is what the kernel costs when it owns a core. Multi-threaded
// backends use wall time.
bool g_cpu_clock = false;
double now() {
  if (g_cpu_clock) {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// One BLAS thread (OpenBLAS exports openblas_set_num_threads; other BLAS: no-op).
void singleThreadBlas() {
  using Fn = void (*)(int);
  if (auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(1);
}

/// Best-of-reps seconds of f(), each rep repeating f until min_seconds elapsed.
template <class F>
double bestSeconds(F&& f, int reps, double min_seconds) {
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

struct Cell {
  double fwd = 0.0, bwd = 0.0;
};

/// Throughput of a batch of `copies` identical pieces (nq queries, nk keys each).
Cell measure(const Opts& o, std::int64_t nq, std::int64_t nk, const att::KernelConfig& cfg) {
  const double padded1 = att::paddedPairs(nq, nk, cfg);
  const std::int64_t copies = std::max<std::int64_t>(1, static_cast<std::int64_t>(4.0e6 / padded1));
  std::vector<att::PieceRange> pieces;
  for (std::int64_t i = 0; i < copies; ++i) pieces.push_back({i * nq, (i + 1) * nq, i * nk, (i + 1) * nk});
  const auto batch = att::VarlenBatch::fromRanges(pieces);
  const std::size_t Tq = batch.q_tokens, Tk = batch.k_tokens, H = o.heads, Hk = o.kv_heads, D = o.head_dim;
  V3 q("wlb::profile::q", Tq, H, D), k("wlb::profile::k", Tk, Hk, D), v("wlb::profile::v", Tk, Hk, D),
      out("wlb::profile::o", Tq, H, D), dO("wlb::profile::dO", Tq, H, D), dq("wlb::profile::dq", Tq, H, D),
      dk("wlb::profile::dk", Tk, Hk, D), dv("wlb::profile::dv", Tk, Hk, D);
  V2 lse("wlb::profile::lse", Tq, H);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (V3* x : {&q, &k, &v, &dO}) {
    auto h = Kokkos::create_mirror_view(*x);
    for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = nd(rng);
    Kokkos::deep_copy(*x, h);
  }
  ES space;
  const double flops = att::forwardFlops(batch.paddedPairs(cfg), o.heads, o.head_dim);
  Cell c;
  const double tf = bestSeconds([&] { att::forward(space, q, k, v, batch, out, lse, cfg); }, o.reps, o.min_seconds);
  const double tb =
      bestSeconds([&] { att::backward(space, q, k, v, out, lse, dO, batch, dq, dk, dv, cfg); }, o.reps, o.min_seconds);
  c.fwd = flops / tf * 1e-9;
  c.bwd = 2.5 * flops / tb * 1e-9;
  return c;
}

double gemmGflops(const Opts& o) {
  const int n = o.quick ? 512 : 1024;
  std::vector<float> a(static_cast<std::size_t>(n) * n, 0.5f), b(a), c(a.size());
  const float one = 1.0f, zero = 0.0f;
  const double t =
      bestSeconds([&] { sgemm_("N", "N", &n, &n, &n, &one, a.data(), &n, b.data(), &n, &zero, c.data(), &n); }, o.reps,
                  o.min_seconds);
  return 2.0 * n * static_cast<double>(n) * n / t * 1e-9;
}

/// Register-only FMA loop at the kernels' vector width: what one core delivers right now.
double fmaPeak() {
#if WLB_ATTN_HOST_SIMD
  double flops = 0.0;
  const double t = bestSeconds([&] { flops = att::host::fmaLoop(10000000); }, 5, 0.02);
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

int run(Opts o) {
  if (wlb::app::worldRank() != 0) return 0;
  g_cpu_clock = ES().concurrency() == 1 && !o.wall_clock;
  singleThreadBlas();
  att::KernelConfig cfg;
  cfg.tile_q = o.tile_q;
  cfg.tile_k = o.tile_k;
  try {
    att::validateConfig(cfg);
  } catch (const std::invalid_argument& e) {
    throw wlb::InputError(std::string("wlb profile: --tile-q/--tile-k: ") + e.what());
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
  }
  if (o.quick) {
    o.reps = std::min(o.reps, 2);
    o.min_seconds = std::min(o.min_seconds, 0.01);
  }
  nlohmann::json fwd = nlohmann::json::array(), bwd = nlohmann::json::array();
  const auto t_cells = std::chrono::steady_clock::now();
  const auto cells = static_cast<long long>(o.q_lens.size() * o.k_lens.size());
  long long done = 0;
  for (auto nq : o.q_lens) {
    nlohmann::json rf = nlohmann::json::array(), rb = nlohmann::json::array();
    Cell diag;
    bool have_diag = false;
    for (auto nk : o.k_lens) {
      Cell c;
      if (nk < nq) {  // ignored by the cost model: write the value at k = q
        if (!have_diag) {
          diag = measure(o, nq, nq, cfg);
          have_diag = true;
        }
        c = diag;
      } else if (nk == nq && have_diag) {
        c = diag;
      } else {
        c = measure(o, nq, nk, cfg);
      }
      // cells cost ~ q*k and come small first: the mean-so-far ETA runs low early
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_cells).count();
      ++done;
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
  const double peak = o.peak > 0.0 ? o.peak : fmaPeak();
  const double linear = gemmGflops(o);
  nlohmann::json j;
  j["format"] = "wlb-hardware-profile";
  j["version"] = 1;
  j["name"] = o.name;
  j["backend"] = wlb::kk::backendName();
  j["created"] = isoNow();
  j["sources"] = {"measured by `wlb profile` (attention: wlb::attention kernels, best of " + std::to_string(o.reps) +
                      " repetitions; linear: BLAS sgemm " + std::string(o.quick ? "512" : "1024") +
                      "^3, one thread; peak: register-only FMA loop at the kernels' vector width; timed with " +
                      (g_cpu_clock ? "process CPU time" : "wall time") + ")",
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
  if (pages > 0 && psize > 0) j["memory_gb"] = std::round(static_cast<double>(pages) * psize / 1e9 * 10.0) / 10.0;
  const std::string tmp = o.out + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp);
    if (!f) throw wlb::InputError("wlb profile: cannot write --out " + o.out);
    f << j.dump(2) << "\n";
    if (!f) {
      std::remove(tmp.c_str());
      throw std::runtime_error("wlb profile: writing " + tmp + " failed");
    }
  }
  if (std::rename(tmp.c_str(), o.out.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("wlb profile: cannot rename " + tmp + " to " + o.out);
  }
  std::printf("wlb profile: wrote %s (tiles %dx%d, head_dim %d, peak %.1f, linear %.1f GFLOP/s)\n", o.out.c_str(),
              cfg.tile_q, cfg.tile_k, o.head_dim, peak, linear);
  return 0;
}

const bool registered = wlb::app::registerCommand(
    "profile", "Measure attention/GEMM throughput and write the hardware profile JSON for the cost model",
    [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      sub.add_option("--out", o->out, "Output profile JSON")->required();
      sub.add_option("--name", o->name, "Profile name");
      sub.add_option("--head-dim", o->head_dim, "Head dimension to profile");
      sub.add_option("--heads", o->heads, "Query heads");
      sub.add_option("--kv-heads", o->kv_heads, "KV heads");
      sub.add_option("--tile-q", o->tile_q, "Query tile of the kernel");
      sub.add_option("--tile-k", o->tile_k, "Key tile of the kernel");
      sub.add_option("--q-lens", o->q_lens, "Query lengths of the grid")->delimiter(',');
      sub.add_option("--k-lens", o->k_lens, "Key lengths of the grid")->delimiter(',');
      sub.add_option("--reps", o->reps, "Repetitions per cell (best is kept)");
      sub.add_option("--min-seconds", o->min_seconds, "Minimum time per repetition");
      sub.add_option("--peak-gflops", o->peak, "FP32 peak to record (default: measured FMA loop)");
      sub.add_flag("--quick", o->quick, "Small grid, short timings (tests)");
      sub.add_flag("--wall-clock", o->wall_clock, "Time with wall clock even on a single-threaded backend");
      return [o]() -> int { return run(*o); };
    });

}  // namespace
