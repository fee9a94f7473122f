// wlb-timeout: 600
// 4D step simulator: pipeline formula through the cost model, CP groups at their slowest
// member, DP replicas meeting at the gradient reduction, memory with recomputation,
// real shard plans, predicted trace events, and a 4096-rank mesh step (plan + simulate).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <numeric>
#include <set>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "cp/shard_plan.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"
#include "packing/simulate_deck.hpp"
#include "pp/simulator.hpp"
#include "trace/recorder.hpp"

using namespace wlb;
using namespace wlb::pp;

namespace {
model::ModelDims dims(std::int64_t vocab = 0) {
  model::ModelDims d;
  d.hidden = 1024;
  d.heads = 16;
  d.kv_heads = 16;
  d.head_dim = 64;
  d.ffn = 2816;
  d.layers = 8;
  d.vocab = vocab;
  d.dtype_bytes = 2;
  return d;
}
SimConfig fastNet(int tp, int cp, int pp, int dp, ScheduleKind k = ScheduleKind::OneFOneB) {
  SimConfig c;
  c.tp = tp;
  c.cp = cp;
  c.pp = pp;
  c.dp = dp;
  c.schedule = k;
  c.net.tp_bps = c.net.cp_bps = c.net.pp_bps = c.net.dp_bps = 1e30;
  c.net.latency_s = 0;
  return c;
}
}  // namespace

TEST(SimStep, EqualMicroBatchesGiveTheBubbleFormula) {
  const model::CostModel cost(dims(), model::HardwareProfile::analytic(), 1);
  for (auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    const int p = 4, m = 8;
    StepSimulator sim(fastNet(1, 1, p, 1, kind), cost);
    std::vector<std::vector<MicroBatchWork>> w(1);
    for (int i = 0; i < m; ++i) w[0].push_back(balancedMicroBatchWork({4096}, 1, cost));
    const StepResult r = sim.simulate(w);
    EXPECT_NEAR(r.bubble_fraction, double(p - 1) / (m + p - 1), 1e-9);
    const PipelineCosts c = sim.pipelineCosts(w[0]);
    EXPECT_NEAR(r.step_seconds, (m + p - 1) * (c.fwd[0] + c.bwd[0]), 1e-12 * r.step_seconds + 1e-15);
    // Stage cost = layers/pp x (attention + linear) of the cost model.
    const double per_layer = cost.attnSeconds(0, 4096, Phase::Fwd) + cost.linearSeconds(4096, Phase::Fwd);
    EXPECT_NEAR(c.fwd[0], 2 * per_layer, 1e-12);
    EXPECT_EQ(r.rank_busy.size(), 4u);
    EXPECT_GT(r.idle_fraction, 0.0);
  }
}

TEST(SimStep, CpGroupRunsAtItsSlowestMember) {
  const model::CostModel cost(dims(), model::HardwareProfile::analytic(), 1);
  StepSimulator sim(fastNet(1, 2, 1, 1), cost);
  MicroBatchWork w = balancedMicroBatchWork({8192}, 2, cost);
  const double base = sim.pipelineCosts({w}).fwd[0];
  w.attn_fwd[1] += 1.0;  // rank 1 gets one extra second of attention per layer
  const PipelineCosts c = sim.pipelineCosts({w});
  EXPECT_NEAR(c.fwd[0], base + 8 * 1.0, 1e-9);
  const StepResult r = sim.simulate({{w}});
  // Rank 0 is idle while rank 1 finishes: its own busy time is shorter than the step.
  EXPECT_LT(r.rank_busy[0], r.rank_busy[1]);
  EXPECT_NEAR(r.rank_busy[1], r.step_seconds, 1e-9);
}

TEST(SimStep, ReplicasMeetAtGradientReduction) {
  const model::CostModel cost(dims(32000), model::HardwareProfile::analytic(), 1);
  SimConfig cfg = fastNet(1, 1, 2, 2);
  cfg.net.dp_bps = cfg.net.cp_bps = 10e9;
  cfg.net.latency_s = 1e-6;
  StepSimulator sim(cfg, cost);
  std::vector<std::vector<MicroBatchWork>> w(2);
  for (int i = 0; i < 2; ++i) {
    w[0].push_back(balancedMicroBatchWork({2048}, 1, cost));
    w[1].push_back(balancedMicroBatchWork({2048, 6144}, 1, cost));
  }
  const StepResult r = sim.simulate(w);
  EXPECT_GT(r.replica_seconds[1], r.replica_seconds[0]);
  EXPECT_GT(r.grad_sync_seconds, 0);
  // Ring all-reduce over 2 replicas: 2(n-1)/n * bytes / bw + 2(n-1) latency.
  const double bytes = sim.stageParams(0) * 2;
  const double g0 = bytes / 10e9 + 2e-6;
  EXPECT_LE(r.step_seconds, r.pipeline_seconds + std::max(g0, r.grad_sync_seconds) + 1e-12);
  EXPECT_GE(r.step_seconds, r.pipeline_seconds);
  EXPECT_NEAR(r.grad_sync_seconds, std::max(sim.stageParams(0), sim.stageParams(1)) * 2 / 10e9 + 2e-6, 1e-12);
}

TEST(SimStep, MemoryPeaksAndRecomputation) {
  const model::CostModel cost(dims(32000), model::HardwareProfile::analytic(), 1);
  const int p = 4, m = 8;
  std::vector<std::vector<MicroBatchWork>> w(1);
  for (int i = 0; i < m; ++i) w[0].push_back(balancedMicroBatchWork({8192}, 1, cost));
  double prev_peak = 1e300, prev_time = 0;
  for (auto rc : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    SimConfig cfg = fastNet(1, 1, p, 1);
    cfg.recompute = rc;
    StepSimulator sim(cfg, cost);
    const StepResult r = sim.simulate(w);
    EXPECT_LT(r.peak_bytes[1], prev_peak);  // less activation memory held
    EXPECT_GE(r.step_seconds, prev_time);   // never faster
    prev_peak = r.peak_bytes[1];
    prev_time = r.step_seconds;
    // Stage 1 (no embedding or head) holds min(p - 1, m) = 3 micro-batches under 1F1B.
    const double act = sim.activationBytesPerToken() * 8192 * 2;  // 2 layers per stage
    EXPECT_NEAR(r.peak_bytes[1], r.static_bytes[1] + 3 * act, 1e-6 * r.peak_bytes[1]);
  }
  SimConfig g = fastNet(1, 1, p, 1, ScheduleKind::GPipe);
  StepSimulator gs(g, cost);
  const StepResult gr = gs.simulate(w);
  EXPECT_NEAR(gr.peak_bytes[1], gr.static_bytes[1] + m * gs.activationBytesPerToken() * 8192 * 2,
              1e-6 * gr.peak_bytes[1]);
  SimConfig tiny = fastNet(1, 1, p, 1, ScheduleKind::GPipe);
  tiny.memory_bytes = 1e6;
  EXPECT_FALSE(StepSimulator(tiny, cost).simulate(w).fits_memory);
}

// pipeline.recompute = "selective" prices the backward's recomputation from the profile's
// table: every layer's backward is longer by recomputeSeconds of its tokens, and a predicted
// trace shows that time as `recompute` events.
TEST(SimStep, SelectiveRecomputationCostsWhatTheProfileMeasured) {
  model::HardwareProfile hw = model::HardwareProfile::analytic();
  auto& t = hw.linear_ops;
  const auto d = dims(32000);
  t.hidden = d.hidden;
  t.heads = d.heads;
  t.kv_heads = d.kv_heads;
  t.head_dim = d.head_dim;
  t.ffn = d.ffn;
  t.tp = 1;
  t.tokens = {1024, 16384};
  for (auto& op : t.gflops) op = {std::vector<double>{500, 500}, std::vector<double>{500, 500}};
  t.elementwise_ns = t.fill_ns = {std::vector<double>{10, 10}, std::vector<double>{20, 20}};
  t.recompute_ns = {40, 40};
  model::CostModel cost(d, hw, 1);
  cost.setLinearReferenceTokens(8192);
  ASSERT_TRUE(cost.linearTableUsed());
  std::vector<std::vector<MicroBatchWork>> w(1);
  for (int i = 0; i < 3; ++i) w[0].push_back(balancedMicroBatchWork({8192}, 1, cost));
  double step[2] = {0, 0}, recorded = 0;
  for (int sel = 0; sel < 2; ++sel) {
    SimConfig cfg = fastNet(1, 1, 1, 1);
    cfg.recompute = sel ? Recompute::Selective : Recompute::None;
    trace::Recorder rec;
    step[sel] = StepSimulator(cfg, cost).simulate(w, &rec, 0, 0.0).step_seconds;
    for (const auto& e : rec.events())
      if (rec.regions()[static_cast<std::size_t>(e.region)] == trace::labels::kRecompute) {
        EXPECT_EQ(e.phase, trace::Phase::Bwd);
        recorded += static_cast<double>(e.end_ns - e.start_ns) * 1e-9;
      }
    if (!sel) {
      EXPECT_EQ(recorded, 0.0);
    }
  }
  const double expect = 3.0 * static_cast<double>(d.layers) * cost.recomputeSeconds(8192);
  EXPECT_NEAR(expect, 3.0 * 8 * 40e-9 * 8192, 1e-12);
  EXPECT_NEAR(step[1] - step[0], expect, 1e-9);
  EXPECT_NEAR(recorded, expect, 1e-6);  // events are whole nanoseconds
}

TEST(SimStep, RealShardPlansOrderStrategies) {
  // One micro-batch packing a long document with many short ones: per-sequence sharding
  // is unbalanced under CP, per-document is balanced, so it predicts a shorter step.
  const model::CostModel cost(dims(), model::HardwareProfile::analytic(), 1);
  StepSimulator sim(fastNet(1, 4, 2, 1), cost);
  StepPlan plan;
  plan.replicas.resize(1);
  for (int m = 0; m < 2; ++m) {
    MicroBatch mb;
    std::int64_t id = m * 100;
    mb.segments.push_back({id++, 0, 12288, 0});
    for (int i = 0; i < 16; ++i) mb.segments.push_back({id++, 0, 256, 0});
    plan.replicas[0].push_back(mb);
  }
  CpConfig cfg;
  const StepResult seq = sim.simulatePlan(plan, "per_sequence", cfg);
  const StepResult doc = sim.simulatePlan(plan, "per_document", cfg);
  EXPECT_LT(doc.step_seconds, seq.step_seconds);
  // Work extracted from the plan conserves tokens.
  const MicroBatchWork w = planMicroBatchWork(plan.replicas[0][0], "per_document", 4, cost, cfg);
  std::int64_t t = 0;
  for (auto x : w.rank_tokens) t += x;
  EXPECT_EQ(t, plan.replicas[0][0].tokens());
  // Sharding-aware exchange: a rank that only sends pays its messages' latency as the CP
  // cost model (cp::planComm) charges it, max(received, sent) per direction.
  CpConfig aware;
  aware.comm = "sharding_aware";
  MicroBatch two;
  two.segments = {{0, 0, 6, 0}, {1, 0, 2, 0}};
  const auto plans = cp::planReplicaShards({two}, "per_sequence", 2, cost, aware);
  const MicroBatchWork wa = microBatchWork(two, plans.front(), "per_sequence", 2, cost);
  for (int r = 0; r < 2; ++r) {
    const cp::RankComm& rc = plans.front().comm.ranks[static_cast<std::size_t>(r)];
    EXPECT_EQ(wa.kv_peers[static_cast<std::size_t>(r)], std::max(rc.peers, rc.out_peers)) << r;
    if (rc.fwd_bytes_sent > 0) {
      EXPECT_GT(wa.kv_peers[static_cast<std::size_t>(r)], 0) << r;
    }
  }
}

TEST(SimStep, PredictedEventsForEveryRank) {
  const model::CostModel cost(dims(32000), model::HardwareProfile::analytic(), 2);
  SimConfig cfg = fastNet(2, 2, 2, 2);
  cfg.net.tp_bps = cfg.net.cp_bps = cfg.net.pp_bps = cfg.net.dp_bps = 50e9;
  cfg.net.latency_s = 5e-6;
  StepSimulator sim(cfg, cost);
  std::vector<std::vector<MicroBatchWork>> w(2);
  for (int d = 0; d < 2; ++d)
    for (int i = 0; i < 2; ++i) w[d].push_back(balancedMicroBatchWork({4096 * (1 + d + i)}, 2, cost));
  trace::Recorder rec;
  rec.setStrategy("wlb");
  const StepResult r = sim.simulate(w, &rec, 0, 0.0);
  ASSERT_EQ(rec.virtualRanks().size(), 16u);
  std::set<int> ranks;
  for (const auto& e : rec.events()) {
    ranks.insert(e.rank);
    EXPECT_LE(e.start_ns, e.end_ns);
    EXPECT_GE(e.start_ns, 0);
    EXPECT_LE(e.end_ns, static_cast<std::int64_t>(r.step_seconds * 1e9) + 2);
  }
  EXPECT_EQ(ranks.size(), 16u);
  // Rank coordinates: TP innermost, then CP, PP, DP.
  EXPECT_EQ(rec.virtualRanks()[5].cp, 0);
  EXPECT_EQ(rec.virtualRanks()[5].pp, 1);
  EXPECT_EQ(rec.virtualRanks()[5].tp, 1);
}

// With a rank-speed spread each member runs its pieces at its own speed and noise draw, as
// the task's length has them: a rank's events never overlap and end within the step (they
// were laid at the mean speed into tasks the slowest member's draw had lengthened or
// shortened, so the analysis' step times differed from the simulator's).
TEST(SimStep, PredictedEventsFollowEachRanksSpeed) {
  const model::CostModel cost(dims(32000), model::HardwareProfile::analytic(), 2);
  SimConfig cfg = fastNet(2, 2, 2, 2);
  cfg.rank_spread = 0.15;
  cfg.step_spread = 0.2;
  cfg.task_spread = 0.3;
  const StepSimulator sim(cfg, cost);
  std::vector<std::vector<MicroBatchWork>> w(2);
  for (int d = 0; d < 2; ++d)
    for (int i = 0; i < 4; ++i) w[d].push_back(balancedMicroBatchWork({2048 * (1 + d + i), 1024}, 2, cost));
  for (int step = 0; step < 3; ++step) {
    trace::Recorder rec;
    rec.setStrategy("wlb");
    const StepResult r = sim.simulate(w, &rec, step, 0.0);
    EXPECT_EQ(r.step_seconds, sim.simulate(w, nullptr, step, 0.0).step_seconds);
    std::map<int, std::vector<std::pair<std::int64_t, std::int64_t>>> by_rank;
    for (const auto& e : rec.events()) by_rank[e.rank].emplace_back(e.start_ns, e.end_ns);
    ASSERT_EQ(by_rank.size(), 16u);
    std::int64_t last_end = 0;
    for (auto& [rank, spans] : by_rank) {
      std::sort(spans.begin(), spans.end());
      for (std::size_t i = 1; i < spans.size(); ++i)
        EXPECT_GE(spans[i].first + 1, spans[i - 1].second) << "rank " << rank << ": events overlap at " << i;
      last_end = std::max(last_end, spans.back().second);
    }
    EXPECT_NEAR(static_cast<double>(last_end), r.step_seconds * 1e9, 2.0);  // the step ends with its last event
  }
}

TEST(SimStep, PredictedEventsCarryTheirFlopsAndBytes) {
  const model::CostModel cost(dims(32000), model::HardwareProfile::analytic(), 2);
  const auto run = [&](int tp, int cp, int elem_bytes) {
    SimConfig cfg = fastNet(tp, cp, 2, 1);
    cfg.net.tp_bps = cfg.net.cp_bps = cfg.net.pp_bps = cfg.net.dp_bps = 50e9;
    cfg.comm_element_bytes = elem_bytes;
    const model::CostModel c(dims(32000), model::HardwareProfile::analytic(), tp);
    StepSimulator sim(cfg, c);
    std::vector<std::vector<MicroBatchWork>> w(1);
    for (int i = 0; i < 2; ++i) w[0].push_back(balancedMicroBatchWork({4096, 2048 * (1 + i)}, cp, c));
    auto rec = std::make_unique<trace::Recorder>();
    rec->setStrategy("wlb");
    (void)sim.simulate(w, rec.get(), 0, 0.0);
    return rec;
  };
  const auto rec = run(2, 2, 0);
  std::map<std::string, std::pair<double, double>> sums;  // region -> (flops, bytes)
  for (const auto& e : rec->events()) {
    auto& x = sums[rec->regions()[static_cast<std::size_t>(e.region)]];
    x.first += e.flops;
    x.second += e.bytes;
  }
  for (const char* r : {"attn", "mlp"}) EXPECT_GT(sums[r].first, 0) << r;
  for (const char* r : {"tp_allreduce", "kv_allgather", "pp_send", "grad_allreduce"}) EXPECT_GT(sums[r].second, 0) << r;
  // No TP or CP: no events for them (their latencies used to show as tp_allreduce).
  const auto one = run(1, 1, 0);
  for (const auto& e : one->events()) {
    const std::string& r = one->regions()[static_cast<std::size_t>(e.region)];
    EXPECT_NE(r, "tp_allreduce");
    EXPECT_NE(r, "kv_allgather");
  }
  // --as-run sends fp32 (comm_element_bytes 4): the TP all-reduces' bytes double with model.dtype_bytes 2.
  const auto tpBytes = [](const trace::Recorder& r) {
    double b = 0;
    for (const auto& e : r.events())
      if (r.regions()[static_cast<std::size_t>(e.region)] == "tp_allreduce") b += e.bytes;
    return b;
  };
  EXPECT_DOUBLE_EQ(tpBytes(*run(2, 1, 4)), 2.0 * tpBytes(*run(2, 1, 0)));
}

TEST(SimStep, Mesh4096RanksPlansAndSimulates) {
  // 7B-like model on tp=8 x cp=4 x pp=16 x dp=8 = 4096 ranks, 128K window, real length
  // stream, wlb packing and adaptive CP sharding. Asserts sanity only (timing in docs).
  Deck deck;
  deck.model.hidden = 4096;
  deck.model.heads = 32;
  deck.model.kv_heads = 8;
  deck.model.head_dim = 128;
  deck.model.ffn = 11008;
  deck.model.layers = 32;
  deck.model.vocab = 32000;
  deck.mesh.tp = 8;
  deck.mesh.cp = 4;
  deck.mesh.pp = 16;
  deck.mesh.dp = 8;
  deck.data.context_window = 131072;
  deck.data.s_max = 131072;
  deck.packing.micro_batches = 16;
  ASSERT_EQ(deck.mesh.size(), 4096);
  const auto t0 = std::chrono::steady_clock::now();
  const model::CostModel cost(model::ModelDims::fromDeck(deck.model), model::HardwareProfile::analytic(), 8);
  auto src = data::makeLengthSource(deck);
  auto packer = packing::makePacker("wlb", deck, cost);
  StepSimulator sim(deck, cost);
  const StepPlan plan = packer->pack(0, src->next(0));
  ASSERT_EQ(plan.replicas.size(), 8u);
  const StepResult r = sim.simulatePlan(plan, "adaptive", deck.cp);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("4096-rank step: planned + simulated in %.2f s; predicted step %.3f s, bubble %.3f\n", secs,
              r.step_seconds, r.bubble_fraction);
  EXPECT_GT(r.step_seconds, 0);
  EXPECT_GE(r.step_seconds, r.pipeline_seconds);
  EXPECT_GT(r.bubble_fraction, 0);
  EXPECT_LT(r.bubble_fraction, 1);
  EXPECT_EQ(r.rank_busy.size(), static_cast<std::size_t>(8 * 16 * 4));
  for (std::size_t s = 0; s < r.peak_bytes.size(); ++s) EXPECT_GT(r.peak_bytes[s], r.static_bytes[s]);
}

// The strategy loop behind `wlb simulate` (packing/simulate_deck.hpp): every strategy trains
// the same documents over its window (measured steps + drain), the baseline's speedup is
// 1, and --as-run predicts the executor's activation memory per stage.
TEST(SimulateDeck, EveryStrategyTrainsTheSameDocuments) {
  const Deck deck = parseDeck(R"(
[model]
hidden = 256
heads = 4
kv_heads = 2
ffn = 704
layers = 4
[mesh]
pp = 2
[data]
preset = "long_context_128k"
seed = 3
context_window = 4096
length_scale = 0.03125
[packing]
micro_batches = 4
[run]
steps = 6
warmup = 0
)",
                              "simulate-deck-test");
  packing::SimulateOptions opt;
  opt.strategies = {{"plain", "plain"}, {"fixed", "fixed"}, {"wlb", "wlb"}};
  opt.as_run = true;
  int steps_seen = 0;
  opt.on_step = [&](const std::string&) { ++steps_seen; };
  const auto rows = packing::simulateDeck(deck, opt);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(steps_seen, 18);
  EXPECT_DOUBLE_EQ(rows[0].speedup, 1.0);
  EXPECT_EQ(rows[1].baseline, "plain");
  for (const auto& r : rows) {
    EXPECT_EQ(r.steps, 6) << r.strategy;
    EXPECT_DOUBLE_EQ(r.tokens, rows[0].tokens) << r.strategy;  // drained: nothing left out
    EXPECT_LE(r.speedup_lo, r.speedup);
    EXPECT_GE(r.speedup_hi, r.speedup);
    ASSERT_EQ(r.peak_act_bytes.size(), 2u);
    // 1F1B on 2 stages: stage 0 holds two micro-batches' activations, stage 1 one
    EXPECT_GT(r.peak_act_bytes[0], r.peak_act_bytes[1]) << r.strategy;
    EXPECT_GT(r.bubble, 0.0);
  }
  EXPECT_GT(rows[2].drain_steps, 0);  // wlb deferred outliers and drained them
}

// A replay of the plans a simulation made predicts exactly what that simulation did (same
// profile), step accounting and drain included; plans that do not fit the deck are refused
// naming the file and line.
TEST(SimulateDeck, ReplayOfItsOwnPlansPredictsTheSame) {
  const Deck deck = parseDeck(R"(
[model]
hidden = 256
heads = 4
kv_heads = 2
ffn = 704
layers = 4
[mesh]
pp = 2
dp = 2
[data]
preset = "long_context_128k"
seed = 5
context_window = 4096
length_scale = 0.03125
[packing]
micro_batches = 4
[run]
steps = 4
warmup = 1
)",
                              "replay-test");
  packing::SimulateOptions opt;
  opt.strategies = {{"plain", "plain"}, {"wlb", "wlb"}};
  opt.as_run = true;
  std::vector<packing::RunPlans::Strategy> replay(2);
  opt.on_plan = [&](const std::string& strategy, const StepPlan& plan, std::int64_t /*incoming*/) {
    auto& r = replay[strategy == "plain" ? 0 : 1];
    r.file.steps.push_back(plan);
    r.file.step_lines.push_back(static_cast<std::int64_t>(r.file.steps.size()) + 1);
  };
  const auto planned = packing::simulateDeck(deck, opt);
  const std::string shardings[] = {"per_sequence", "adaptive"};
  for (int i = 0; i < 2; ++i) {
    auto& r = replay[static_cast<std::size_t>(i)];
    r.path = "plan." + planned[static_cast<std::size_t>(i)].strategy + ".jsonl";
    r.strategy = planned[static_cast<std::size_t>(i)].strategy;
    r.sharding = shardings[i];
    r.file.header.packer = planned[static_cast<std::size_t>(i)].packer;
    r.file.header.dp = 2;
    r.file.header.micro_batches = 4;
    r.file.header.context_window = 4096;
    r.file.header.s_max = 4096;
  }
  packing::SimulateOptions ro;
  ro.as_run = true;
  ro.replay = replay;
  const auto replayed = packing::simulateDeck(deck, ro);
  ASSERT_EQ(replayed.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(replayed[i].strategy, planned[i].strategy);
    EXPECT_EQ(replayed[i].steps, planned[i].steps);
    EXPECT_EQ(replayed[i].drain_steps, planned[i].drain_steps);
    EXPECT_DOUBLE_EQ(replayed[i].tokens, planned[i].tokens);
    EXPECT_DOUBLE_EQ(replayed[i].tokens_per_s, planned[i].tokens_per_s);
    EXPECT_DOUBLE_EQ(replayed[i].speedup, planned[i].speedup);
  }
  EXPECT_GT(replayed[1].drain_steps, 0);
  // plans of another mesh, or fewer steps than warm-up + measured: refused, naming the file
  packing::SimulateOptions bad = ro;
  bad.replay[1].file.header.dp = 4;
  try {
    (void)packing::simulateDeck(deck, bad);
    ADD_FAILURE() << "dp mismatch accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("plan.wlb.jsonl:1:"), std::string::npos) << e.what();
  }
  bad = ro;
  bad.steps = 100;
  EXPECT_THROW((void)packing::simulateDeck(deck, bad), InputError);
  bad = ro;
  bad.replay[0].file.steps[2].step = 7;
  try {
    (void)packing::simulateDeck(deck, bad);
    ADD_FAILURE() << "steps out of order accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("plan.plain.jsonl:4: step 7 where step 2"), std::string::npos) << e.what();
  }
}

// Rank-speed spread (the profile's rank_speed): ranks given equal work run at fixed factors
// around 1 (mean 1, deterministic), a CP group waits for its slowest member, each member's
// task noise costs a group of n the expected maximum of n draws, a rank's step wander costs
// the gradient reduction the slowest replica, noise travels down a pipeline, and one rank or
// a spread of 0 simulates as before.
TEST(SimStep, RankSpeedSpreadMakesGroupsWaitForTheirSlowest) {
  const model::CostModel cost(dims(), model::HardwareProfile::analytic(), 1);
  std::vector<std::vector<MicroBatchWork>> w(2);
  for (auto& replica : w)
    for (int i = 0; i < 4; ++i) replica.push_back(balancedMicroBatchWork({8192, 4096}, 4, cost));
  const StepSimulator plain(fastNet(1, 4, 1, 2), cost);
  SimConfig cfg = fastNet(1, 4, 1, 2);
  cfg.rank_spread = 0.1;
  const StepSimulator spread(cfg, cost), again(cfg, cost);
  double mean = 0, top = 0;
  for (int r = 0; r < cfg.ranks(); ++r) {
    mean += spread.rankFactor(r) / cfg.ranks();
    top = std::max(top, spread.rankFactor(r));
    EXPECT_EQ(spread.rankFactor(r), again.rankFactor(r));
  }
  EXPECT_NEAR(mean, 1.0, 1e-9);
  EXPECT_NEAR(top, 1.0 + 0.1 * 1.5341, 1e-3);  // the normal quantile of 7.5 / 8
  const StepResult a = plain.simulate(w), b = spread.simulate(w);
  EXPECT_GT(b.step_seconds, a.step_seconds * 1.05);
  EXPECT_LE(b.step_seconds, a.step_seconds * top + 1e-9);  // nobody slower than the slowest rank
  EXPECT_EQ(b.step_seconds, again.simulate(w).step_seconds);

  // task noise on equal work: a group of 8 takes the expected maximum of 8 log-normal draws
  // of mean 1 (1.313 for a log sd of 0.2), averaged over 400 tasks; fixed draws
  SimConfig noisy = fastNet(1, 8, 1, 1);
  noisy.task_spread = 0.2;
  const std::vector<MicroBatchWork> eights(400, balancedMicroBatchWork({16384}, 8, cost));
  const double quiet = StepSimulator(fastNet(1, 8, 1, 1), cost).pipelineCosts({eights[0]}).fwd[0];
  const PipelineCosts loud = StepSimulator(noisy, cost).pipelineCosts(eights);
  EXPECT_NEAR(std::accumulate(loud.fwd.begin(), loud.fwd.end(), 0.0) / 400 / quiet, 1.313, 0.02);
  EXPECT_EQ(loud.fwd, StepSimulator(noisy, cost).pipelineCosts(eights).fwd);
  EXPECT_NE(loud.fwd, StepSimulator(noisy, cost).pipelineCosts(eights, 0, 1).fwd);  // another scatter

  // step wander: two replicas of one rank each; the reduction waits for the slower, about
  // E[max of 2 draws] = 1.112 of the quiet step over many steps, and steps differ
  SimConfig wander = fastNet(1, 1, 1, 2);
  wander.step_spread = 0.2;
  const std::vector<std::vector<MicroBatchWork>> two(2, {balancedMicroBatchWork({8192}, 1, cost)});
  const double still = StepSimulator(fastNet(1, 1, 1, 2), cost).simulate(two).step_seconds;
  const StepSimulator wandering(wander, cost);
  double sum = 0;
  for (int step = 0; step < 200; ++step) sum += wandering.simulate(two, nullptr, step).step_seconds / still;
  EXPECT_NEAR(sum / 200, 1.112, 0.03);
  EXPECT_NE(wandering.simulate(two, nullptr, 0).step_seconds, wandering.simulate(two, nullptr, 1).step_seconds);

  // a pipeline: a slow task delays the stages after it, so noise of mean 1 lengthens the step
  SimConfig pipe = fastNet(1, 1, 4, 1);
  pipe.task_spread = 0.2;
  const std::vector<std::vector<MicroBatchWork>> eight_mbs(
      1, std::vector<MicroBatchWork>(8, balancedMicroBatchWork({8192}, 1, cost)));
  EXPECT_GT(StepSimulator(pipe, cost).simulate(eight_mbs).step_seconds,
            StepSimulator(fastNet(1, 1, 4, 1), cost).simulate(eight_mbs).step_seconds * 1.03);

  // one rank, or a group of one: nothing to wait for
  SimConfig one = fastNet(1, 1, 1, 1);
  one.rank_spread = 0.3;
  one.step_spread = 0.3;
  one.task_spread = 0.3;
  const MicroBatchWork solo = balancedMicroBatchWork({8192}, 1, cost);
  EXPECT_EQ(StepSimulator(one, cost).simulate({{solo}}).step_seconds,
            StepSimulator(fastNet(1, 1, 1, 1), cost).simulate({{solo}}).step_seconds);
}
