// Attention kernel benchmark: useful GFLOP/s (unmasked work only: forward 4*heads*D*pairs,
// backward 2.5x forward; rates use process CPU time because the build machine is shared)
// for one 8K document and a skewed packed 8K sequence, head_dim 64
// and 128, forward and forward+backward, single rank. See docs/performance.md.
//
//   bench_attention [--benchmark_filter=...] [--benchmark_repetitions=N]
#include <benchmark/benchmark.h>

#include <Kokkos_Core.hpp>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "attention/attention.hpp"
#include "attention/attention_host.hpp"

namespace att = wlb::attention;
using ES = Kokkos::DefaultExecutionSpace;
using V3 = Kokkos::View<float***, Kokkos::LayoutRight, ES::memory_space>;
using V2 = Kokkos::View<float**, Kokkos::LayoutRight, ES::memory_space>;

namespace {

constexpr int kHeads = 2, kKvHeads = 1;

std::vector<std::int64_t> lengths(int which) {
  if (which == 0) return {8192};  // one long document
  // skewed packed 8K: one 4K document, a tail of ever shorter ones (sum 8192)
  return {4096, 1536, 1024, 512, 384, 256, 128, 96, 64, 48, 32, 10, 5, 1};
}

struct Data {
  att::VarlenBatch batch;
  V3 q, k, v, o, dO, dq, dk, dv;
  V2 lse;
  Data(const std::vector<std::int64_t>& lens, int D) : batch(att::VarlenBatch::fromDocLengths(lens)) {
    const std::size_t T = batch.q_tokens;
    q = V3("bench::q", T, kHeads, D);
    k = V3("bench::k", T, kKvHeads, D);
    v = V3("bench::v", T, kKvHeads, D);
    o = V3("bench::o", T, kHeads, D);
    dO = V3("bench::dO", T, kHeads, D);
    dq = V3("bench::dq", T, kHeads, D);
    dk = V3("bench::dk", T, kKvHeads, D);
    dv = V3("bench::dv", T, kKvHeads, D);
    lse = V2("bench::lse", T, kHeads);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (V3* x : {&q, &k, &v, &dO}) {
      auto h = Kokkos::create_mirror_view(*x);
      for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = nd(rng);
      Kokkos::deep_copy(*x, h);
    }
  }
};

// args: 0 = which sequence (0 one doc, 1 skewed pack), 1 = head_dim, 2 = with backward
void BM_Attention(benchmark::State& state) {
  const int which = static_cast<int>(state.range(0)), D = static_cast<int>(state.range(1));
  const bool bwd = state.range(2) != 0;
  Data d(lengths(which), D);
  att::KernelConfig cfg;  // WLB_BENCH_TILE_Q / WLB_BENCH_TILE_K override the default tiles
  if (const char* e = std::getenv("WLB_BENCH_TILE_Q")) cfg.tile_q = std::atoi(e);
  if (const char* e = std::getenv("WLB_BENCH_TILE_K")) cfg.tile_k = std::atoi(e);
  ES space;
  att::forward(space, d.q, d.k, d.v, d.batch, d.o, d.lse, cfg);  // warm-up
  for (auto _ : state) {
    att::forward(space, d.q, d.k, d.v, d.batch, d.o, d.lse, cfg);
    if (bwd) att::backward(space, d.q, d.k, d.v, d.o, d.lse, d.dO, d.batch, d.dq, d.dk, d.dv, cfg);
  }
  const double pairs = d.batch.usefulPairs();
  const double flops = att::forwardFlops(pairs, kHeads, D) * (bwd ? 3.5 : 1.0);
  state.counters["useful_GFLOPs"] =
      benchmark::Counter(flops * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  const double padded = att::forwardFlops(d.batch.paddedPairs(cfg), kHeads, D) * (bwd ? 3.5 : 1.0);
  state.counters["padded_GFLOPs"] =
      benchmark::Counter(padded * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.SetLabel(std::string(which == 0 ? "one-8K-doc" : "skewed-8K-pack") + " D=" + std::to_string(D) +
                 (bwd ? " fwd+bwd" : " fwd") + " tiles " + std::to_string(cfg.tile_q) + "x" +
                 std::to_string(cfg.tile_k) + " " + ES::name());
}

// Calibration: a register-only FMA loop (12 independent accumulators at the kernels'
// vector width), to read the kernel figures against what the (shared) core delivers at the
// same moment.
void BM_FmaPeak(benchmark::State& state) {
#if WLB_ATTN_HOST_SIMD
  double flops = 0;
  for (auto _ : state) flops += att::host::fmaLoop(20000000);
  state.counters["GFLOPs"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsRate);
  state.SetLabel(std::to_string(att::host::vectorWidth()) + "-float vectors");
#else
  state.SkipWithError("needs the host SIMD path (GCC/Clang host build)");
#endif
}

}  // namespace

BENCHMARK(BM_FmaPeak)->Unit(benchmark::kMillisecond);

BENCHMARK(BM_Attention)
    ->ArgNames({"seq", "D", "bwd"})
    ->ArgsProduct({{0, 1}, {64, 128}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);

int main(int argc, char** argv) {
  Kokkos::ScopeGuard guard(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
