// Planning time per global batch for every packer at 64K/128K windows with 16 and 64
// micro-batches (long_context_128k preset, Llama-3-8B-like cost model), and the growth of
// the fixed_optimal MILP with the window. Figures: docs/performance.md (## Packing).
#include <benchmark/benchmark.h>

#include <map>
#include <memory>

#include "core/heap.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"

using namespace wlb;

namespace {

Deck benchDeck(std::int64_t window, std::int64_t mbs, const std::string& preset = "long_context_128k") {
  Deck d;
  d.model.hidden = 4096;
  d.model.heads = 32;
  d.model.kv_heads = 8;
  d.model.head_dim = 128;
  d.model.ffn = 14336;
  d.model.layers = 32;
  d.data.preset = preset;
  d.data.context_window = window;
  d.data.s_max = window + window / 4;
  d.data.length_scale = preset == "long_context_128k" ? static_cast<double>(window) / 131072.0 : 1.0;
  d.mesh.dp = 1;
  d.packing.micro_batches = mbs;
  d.packing.outlier_thresholds = {window / 4, window / 2, window * 3 / 4};
  d.packing.milp_time_limit = 2.0;
  return d;
}

/// Pre-generated global batches (outside the timed region).
const std::vector<std::vector<Document>>& batches(const Deck& d, std::int64_t n) {
  static std::map<std::tuple<std::string, std::int64_t, std::int64_t, std::int64_t>, std::vector<std::vector<Document>>> cache;
  auto& v = cache[{d.data.preset, d.data.context_window, d.packing.micro_batches, n}];
  if (v.empty()) {
    auto src = data::makeLengthSource(d);
    for (std::int64_t t = 0; t < n; ++t) v.push_back(src->next(t));
  }
  return v;
}

void BM_Pack(benchmark::State& state, const std::string& name) {
  const std::int64_t window = state.range(0), mbs = state.range(1);
  // The MILP on the long-context preset is closed by the trivial bound (the longest
  // document) at every window; the pile preset (no document near the window) is not.
  Deck d = benchDeck(window, mbs, state.range(2) == 1 ? "pile" : "long_context_128k");
  // slimpack picks its own MicroPack count (multiples of pp) for the same global batch and
  // simulates every candidate: time it with a 4-stage pipeline.
  if (name == "slimpack") d.mesh.pp = 4;
  const auto cost = model::CostModel::fromDeck(d);
  const std::int64_t n = name == "fixed_optimal" ? 8 : 256;
  const auto& b = batches(d, n);
  auto packer = packing::makePacker(name, d, cost);
  std::int64_t step = 0;
  double docs = 0, gap = 0;
  for (auto _ : state) {
    if (step == n) {  // start the stream over with a fresh packer
      state.PauseTiming();
      packer = packing::makePacker(name, d, cost);
      step = 0;
      state.ResumeTiming();
    }
    auto plan = packer->pack(step, b[static_cast<std::size_t>(step)]);
    docs += static_cast<double>(b[static_cast<std::size_t>(step)].size());
    if (name == "fixed_optimal") gap = std::max(gap, packer->lastSolverInfo().value("gap", 0.0));
    benchmark::DoNotOptimize(plan);
    ++step;
  }
  state.counters["docs_per_step"] = docs / static_cast<double>(state.iterations());
  if (name == "fixed_optimal") state.counters["max_gap"] = gap;
}

void heuristicArgs(benchmark::internal::Benchmark* b) {
  for (std::int64_t w : {65536, 131072})
    for (std::int64_t m : {16, 64}) b->Args({w, m, 0});
  b->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK_CAPTURE(BM_Pack, original, std::string("original"))->Apply(heuristicArgs);
BENCHMARK_CAPTURE(BM_Pack, best_fit, std::string("best_fit"))->Apply(heuristicArgs);
BENCHMARK_CAPTURE(BM_Pack, fixed_greedy, std::string("fixed_greedy"))->Apply(heuristicArgs);
BENCHMARK_CAPTURE(BM_Pack, wlb, std::string("wlb"))->Apply(heuristicArgs);
BENCHMARK_CAPTURE(BM_Pack, slimpack, std::string("slimpack"))->Apply(heuristicArgs);
// The grid on the long-context preset, then MILP growth with the window on the
// pile preset (range(2) == 1); each solve is capped at 2 s: larger instances report the
// time limit and their optimality gap (max_gap).
BENCHMARK_CAPTURE(BM_Pack, fixed_optimal, std::string("fixed_optimal"))
    ->Args({65536, 16, 0})->Args({131072, 16, 0})->Args({65536, 64, 0})->Args({131072, 64, 0})
    ->Args({2048, 4, 1})->Args({4096, 4, 1})->Args({8192, 4, 1})->Args({16384, 4, 1})
    ->Args({4096, 16, 1})->Args({16384, 16, 1})->Args({65536, 16, 1})
    ->Iterations(8)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  wlb::keepFreedHeap();  // as `wlb` plans (core/heap.hpp)
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
