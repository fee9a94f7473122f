// wlb-timeout: 300
// PackFlow (docs/simulator.md § PackFlow): the schedule of SlimPack plans. Forwards FIFO,
// a sample's slices last-in-first-out in the backward, backward MicroPacks from the
// asymmetric partition only after the forward of every slice they hold; every slice's
// forward and backward exactly once; no deadlock; the trivial form is 1F1B; the step
// simulator costs slices as CP pieces and agrees with 1F1B where the two coincide.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "model/throughput.hpp"
#include "packing/packer.hpp"
#include "packing/simulate_deck.hpp"
#include "pp/dag.hpp"
#include "pp/schedule.hpp"
#include "pp/simulator.hpp"
#include "pp/slice_shards.hpp"

using namespace wlb;
using namespace wlb::pp;
using model::Phase;
using packing::checkPackerSchedule;
using packing::simulateDeck;
using packing::SimulateOptions;

namespace {

Deck slimDeck(const std::string& preset, std::uint64_t seed, std::int64_t pp, std::int64_t dp = 2) {
  Deck d;
  d.data.source = "generator";
  d.data.preset = preset;
  d.data.seed = seed;
  d.data.context_window = 8192;
  d.data.s_max = 10240;
  d.data.length_scale = preset == "long_context_128k" ? 1.0 / 16 : 1.0;
  d.mesh.dp = dp;
  d.mesh.pp = pp;
  d.model.layers = 8;
  d.packing.micro_batches = 4;
  d.packing.strategy = "slimpack";
  d.pipeline.schedule = "packflow";
  return d;
}

std::vector<StepPlan> slimPlans(const Deck& d, std::int64_t steps) {
  const auto cost = model::CostModel::fromDeck(d);
  auto src = data::makeLengthSource(d);
  auto p = packing::makePacker("slimpack", d, cost);
  std::vector<StepPlan> out;
  for (std::int64_t t = 0; t < steps; ++t) out.push_back(p->pack(t, src->next(t)));
  return out;
}

Segment seg(DocId doc, std::int64_t offset, std::int64_t length, bool slice) {
  return Segment{doc, offset, length, 0, slice ? offset : 0};
}

// Position of every task in one stage's order.
std::map<std::pair<int, int>, std::size_t> positions(const std::vector<Task>& o) {
  std::map<std::pair<int, int>, std::size_t> pos;
  for (std::size_t i = 0; i < o.size(); ++i) pos[{static_cast<int>(o[i].phase), o[i].mb}] = i;
  return pos;
}
std::size_t posOf(const std::map<std::pair<int, int>, std::size_t>& pos, Phase ph, int mb) {
  return pos.at({static_cast<int>(ph), mb});
}

// Every property of a PackFlow schedule over one replica's slices.
void checkPackFlow(const ReplicaSlices& r, int stages, const std::string& what) {
  SCOPED_TRACE(what);
  const int M = r.microPacks();
  const PackFlowDeps deps = packFlowDeps(r);
  const Schedule s = makePackFlow(stages, M, deps);
  ASSERT_NO_THROW(validateSchedule(s));
  EXPECT_EQ(s.kind, ScheduleKind::PackFlow);
  EXPECT_FALSE(s.paired);
  // Segments of a document by offset: slice i continues slice j when it starts where j ends.
  std::map<std::pair<DocId, std::int64_t>, std::size_t> ends;
  for (std::size_t i = 0; i < r.segments.size(); ++i)
    ends[{r.segments[i].doc, r.segments[i].offset + r.segments[i].length}] = i;
  for (int st = 0; st < stages; ++st) {
    const auto& o = s.order[static_cast<std::size_t>(st)];
    ASSERT_EQ(o.size(), static_cast<std::size_t>(2 * M));
    // FIFO: forwards in MicroPack order.
    int next = 0;
    for (const Task& t : o)
      if (t.phase == Phase::Fwd) {
        EXPECT_EQ(t.mb, next++) << "stage " << st;
      }
    const auto pos = positions(o);
    ASSERT_EQ(pos.size(), static_cast<std::size_t>(2 * M));  // every task once
    // Every slice: forward once (its forward MicroPack), backward once (its backward
    // MicroPack) after the forward of every slice that backward MicroPack holds.
    std::vector<int> fwd_seen(r.segments.size(), 0), bwd_seen(r.segments.size(), 0);
    for (const Task& t : o) {
      const auto k = static_cast<std::size_t>(t.mb);
      const auto& cuts = t.phase == Phase::Fwd ? r.fwd_cuts : r.bwd_cuts;
      for (auto i = cuts[k]; i < cuts[k + 1]; ++i) {
        const auto iu = static_cast<std::size_t>(i);
        if (t.phase == Phase::Fwd) {
          ++fwd_seen[iu];
        } else {
          ++bwd_seen[iu];
          EXPECT_EQ(fwd_seen[iu], 1) << "stage " << st << ": backward of slice " << i << " before its forward";
        }
      }
    }
    for (std::size_t i = 0; i < r.segments.size(); ++i) {
      EXPECT_EQ(fwd_seen[i], 1);
      EXPECT_EQ(bwd_seen[i], 1);
    }
    // FILO: a slice's backward after the backward of the slice that continues it.
    for (std::size_t i = 0; i < r.segments.size(); ++i) {
      const Segment& x = r.segments[i];
      if (x.q_offset == 0) continue;
      const auto it = ends.find({x.doc, x.offset});
      ASSERT_NE(it, ends.end());
      const std::size_t j = it->second;  // the earlier slice
      EXPECT_LE(r.fwd_pack[j], r.fwd_pack[i]);
      if (r.bwd_pack[i] != r.bwd_pack[j]) {
        EXPECT_LT(posOf(pos, Phase::Bwd, r.bwd_pack[i]), posOf(pos, Phase::Bwd, r.bwd_pack[j]))
            << "stage " << st << ": slices of document " << x.doc << " not last-in-first-out";
      }
    }
  }
  // The DAG takes it (no cycle), and its times respect the dependencies on every stage.
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.5, 2.0);
  std::vector<double> f(static_cast<std::size_t>(M)), b(static_cast<std::size_t>(M));
  for (int k = 0; k < M; ++k) {
    f[static_cast<std::size_t>(k)] = u(rng);
    b[static_cast<std::size_t>(k)] = 2 * u(rng);
  }
  DagResult g;
  ASSERT_NO_THROW(g = simulateDag(s, PipelineCosts::uniformStages(stages, 1, f, b, 0.1)));
  for (int st = 0; st < stages; ++st) {
    std::map<std::pair<int, int>, std::size_t> v;
    for (std::size_t p = 0; p < s.order[static_cast<std::size_t>(st)].size(); ++p) {
      const Task& t = s.order[static_cast<std::size_t>(st)][p];
      v[{static_cast<int>(t.phase), t.mb}] = g.vertexOf(st, p);
    }
    for (const TaskDep& d : s.deps) {
      const double done = g.finish[v[{static_cast<int>(d.from_phase), d.from_mb}]];
      const double start = g.start[v[{static_cast<int>(d.to_phase), d.to_mb}]];
      EXPECT_LE(done, start + 1e-12);
    }
  }
}

}  // namespace

TEST(PackFlow, ParseAndNames) {
  EXPECT_EQ(parseScheduleKind("packflow"), ScheduleKind::PackFlow);
  EXPECT_STREQ(scheduleKindName(ScheduleKind::PackFlow), "packflow");
  try {
    parseScheduleKind("packflo");
    FAIL() << "no InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline.schedule"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("packflow"), std::string::npos);
  }
}

TEST(PackFlow, WithoutSlicesIsOneFOneB) {
  for (int p : {1, 2, 3, 4, 8})
    for (int m = 1; m <= 24; ++m) {
      const Schedule a = makePackFlow(p, m), b = makeOneFOneB(p, m);
      EXPECT_EQ(a.order, b.order) << "p " << p << " M " << m;
      EXPECT_EQ(makeSchedule(ScheduleKind::PackFlow, p, m).order, b.order);
      validateSchedule(a);
      // The same DAG times as 1F1B's (its deps are 1F1B's F(m) -> B(m)).
      std::vector<double> f, bw;
      for (int k = 0; k < m; ++k) {
        f.push_back(1.0 + 0.1 * (k % 3));
        bw.push_back(2.0 + 0.3 * (k % 5));
      }
      const auto c = PipelineCosts::uniformStages(p, 1, f, bw, 0.05);
      EXPECT_DOUBLE_EQ(simulateDag(a, c).makespan, simulateDag(b, c).makespan);
    }
  // Plain micro-batches: trivial dependencies.
  std::vector<MicroBatch> mbs(3);
  mbs[0].segments = {seg(1, 0, 100, false)};
  mbs[1].segments = {seg(2, 0, 50, false), seg(1, 100, 70, false)};  // an `original` cut: no slice
  mbs[2].segments = {seg(3, 0, 10, false)};
  EXPECT_TRUE(packFlowDeps(replicaSlices(mbs)).trivial());
}

TEST(PackFlow, HandBuiltSlicesOrderAndDependencies) {
  // Document 1 in four slices over forward MicroPacks 0-3, document 2 whole in 1, document 3
  // sliced over 3-5; the backward grouping moves cut points both ways.
  std::vector<MicroBatch> f(6);
  f[0].segments = {seg(1, 0, 400, false)};
  f[1].segments = {seg(1, 400, 200, true), seg(2, 0, 300, false)};
  f[2].segments = {seg(1, 600, 150, true)};
  f[3].segments = {seg(1, 750, 120, true), seg(3, 0, 300, false)};
  f[4].segments = {seg(3, 300, 200, true), seg(4, 0, 90, false)};
  f[5].segments = {seg(3, 500, 100, true)};
  // Flattened: 0:(1,0) 1:(1,400) 2:(2,0) 3:(1,600) 4:(1,750) 5:(3,0) 6:(3,300) 7:(4,0) 8:(3,500)
  const std::vector<std::int64_t> bcuts = {0, 2, 3, 4, 6, 8, 9};
  const ReplicaSlices r = replicaSlices(f, bcuts);
  ASSERT_EQ(r.microPacks(), 6);
  EXPECT_EQ(r.bwd_pack, (std::vector<int>{0, 0, 1, 2, 3, 3, 4, 4, 5}));
  const PackFlowDeps d = packFlowDeps(r);
  EXPECT_EQ(d.needs, (std::vector<int>{1, 1, 2, 3, 4, 5}));
  // Document 1: slices in backward 0 (two), 2, 3; document 3: 3, 4, 5.
  EXPECT_EQ(d.before, (std::vector<std::pair<int, int>>{{2, 0}, {3, 2}, {4, 3}, {5, 4}}));
  EXPECT_EQ(packFlowBackwardOrder(6, d), (std::vector<int>{1, 5, 4, 3, 2, 0}));
  for (int p : {1, 2, 3, 4, 6, 8}) checkPackFlow(r, p, "hand-built, p " + std::to_string(p));
  // Each backward MicroPack of a sample spanning the whole replica: GPipe-like drain.
  std::vector<MicroBatch> g(4);
  for (int k = 0; k < 4; ++k) g[static_cast<std::size_t>(k)].segments = {seg(9, 100 * k, 100, k > 0)};
  const Schedule s = makePackFlow(2, 4, packFlowDeps(replicaSlices(g)));
  EXPECT_EQ(renderSchedule(s), "stage 0: F0 F1 F2 F3 B3 B2 B1 B0\nstage 1: F0 F1 F2 F3 B3 B2 B1 B0\n");
  // An empty backward MicroPack goes last.
  const ReplicaSlices e = replicaSlices(g, {0, 2, 3, 4, 4});
  EXPECT_EQ(packFlowDeps(e).needs, (std::vector<int>{1, 2, 3, -1}));
  checkPackFlow(e, 3, "empty backward MicroPack");
}

TEST(PackFlow, ValidateScheduleChecksTheDependencies) {
  std::vector<MicroBatch> g(3);
  for (int k = 0; k < 3; ++k) g[static_cast<std::size_t>(k)].segments = {seg(9, 100 * k, 100, k > 0)};
  Schedule s = makePackFlow(2, 3, packFlowDeps(replicaSlices(g)));
  ASSERT_NO_THROW(validateSchedule(s));
  // The backwards in forward order break last-in-first-out: rejected, and the DAG deadlocks.
  Schedule bad = s;
  for (auto& o : bad.order) {
    std::vector<Task> f, b;
    for (const Task& t : o) (t.phase == Phase::Fwd ? f : b).push_back(t);
    std::reverse(b.begin(), b.end());
    o = f;
    o.insert(o.end(), b.begin(), b.end());
  }
  EXPECT_THROW(validateSchedule(bad), std::logic_error);
  EXPECT_THROW(simulateDag(bad, PipelineCosts::uniformStages(2, 1, {1, 1, 1}, {2, 2, 2})), std::logic_error);
}

TEST(PackFlow, BadPlansAreInputErrors) {
  std::vector<MicroBatch> f(2);
  f[0].segments = {seg(1, 0, 10, false)};
  f[1].segments = {seg(1, 10, 10, true)};
  EXPECT_THROW(replicaSlices(f, {0, 1}), InputError);     // too few cut points
  EXPECT_THROW(replicaSlices(f, {0, 2, 1}), InputError);  // decreasing
  EXPECT_THROW(replicaSlices(f, {0, 1, 3}), InputError);  // past the segments
  std::vector<MicroBatch> back(2);                        // a later slice forwarded first
  back[0].segments = {seg(1, 10, 10, true)};
  back[1].segments = {seg(1, 0, 10, false)};
  EXPECT_THROW(packFlowDeps(replicaSlices(back)), InputError);
}

TEST(PackFlow, SlimPackPlansObeyEveryDependency) {
  for (const auto& preset : {"long_context_128k", "pile"})
    for (std::int64_t pp : {1, 2, 4}) {
      const Deck d = slimDeck(preset, 5, pp);
      int sliced = 0;
      for (const auto& plan : slimPlans(d, 12)) {
        ASSERT_EQ(plan.backward.size(), plan.replicas.size());
        for (std::size_t r = 0; r < plan.replicas.size(); ++r) {
          const ReplicaSlices rs = replicaSlices(plan.replicas[r], plan.backward[r]);
          for (const auto& s : rs.segments) sliced += s.q_offset > 0;
          checkPackFlow(rs, static_cast<int>(pp),
                        std::string(preset) + " pp " + std::to_string(pp) + " step " + std::to_string(plan.step));
        }
      }
      if (std::string(preset) == "long_context_128k") {
        EXPECT_GT(sliced, 0) << "the test needs slices";
      }
    }
}

TEST(PackFlow, SlicesUnderCpAreShardedPieces) {
  // cp = 2: each forward MicroPack sharded by the planner; a slice's pieces cost as queries
  // of their document against its whole key prefix; every token on one rank; the gather map
  // is a permutation; continued segments' KV tokens are whole on every rank.
  const Deck d = slimDeck("long_context_128k", 5, 2, 1);
  const auto cost = model::CostModel::fromDeck(d);
  std::vector<MicroBatch> f(2);
  f[0].segments = {seg(1, 0, 3000, false), seg(2, 0, 500, false)};
  f[1].segments = {seg(1, 3000, 2000, true), seg(3, 0, 7, false)};
  const ReplicaSlices r = replicaSlices(f, {0, 1, 4});
  for (const char* st : {"per_sequence", "per_document", "whole_document", "hybrid", "adaptive"}) {
    SCOPED_TRACE(st);
    const SliceShards sh = sliceShards(r, st, 2, cost, CpConfig{});
    ASSERT_EQ(sh.parts.size(), 4u);
    for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(sh.rows[0][i] + sh.rows[1][i], r.segments[i].length);
    for (const auto* cuts : {&r.fwd_cuts, &r.bwd_cuts})
      for (int k = 0; k < 2; ++k) {
        std::vector<std::int64_t> counts;
        auto idx = sh.gatherIndex(*cuts, k, &counts);
        std::int64_t total = 0;
        for (auto i = (*cuts)[static_cast<std::size_t>(k)]; i < (*cuts)[static_cast<std::size_t>(k) + 1]; ++i)
          total += r.segments[static_cast<std::size_t>(i)].length;
        ASSERT_EQ(static_cast<std::int64_t>(idx.size()), total);
        EXPECT_EQ(counts[0] + counts[1], total);
        std::sort(idx.begin(), idx.end());
        for (std::int64_t j = 0; j < total; ++j) ASSERT_EQ(idx[static_cast<std::size_t>(j)], j);
      }
    AttnSecondsMemo memo(cost);
    const auto w = packFlowReplicaWork(r, &sh, cost, memo);
    double want = 0;
    for (const auto& p : sh.parts[2]) want += cost.attnSeconds(3000 + p.q_offset, p.q_len, Phase::Fwd);
    for (const auto& p : sh.parts[3]) want += cost.attnSeconds(p.q_offset, p.q_len, Phase::Fwd);
    EXPECT_NEAR(w[1].attn_fwd[0] + w[1].attn_fwd[1], want, 1e-12 * want);
    EXPECT_EQ(w[0].rank_tokens[0] + w[0].rank_tokens[1], 3500);
    EXPECT_EQ(w[1].rank_tokens_bwd[0] + w[1].rank_tokens_bwd[1], 2507);
    EXPECT_EQ(w[0].rank_kv_tokens, (std::vector<std::int64_t>{3000, 3000}));
    EXPECT_GT(w[0].kv_fwd_bytes[0], 0);
  }
}

TEST(PackFlow, SliceCostIsTheCostModelsPiece) {
  const Deck d = slimDeck("long_context_128k", 5, 2, 1);
  const auto cost = model::CostModel::fromDeck(d);
  std::vector<MicroBatch> f(2);
  f[0].segments = {seg(1, 0, 3000, false), seg(2, 0, 500, false)};
  f[1].segments = {seg(1, 3000, 2000, true)};
  const ReplicaSlices r = replicaSlices(f, {0, 1, 3});
  AttnSecondsMemo memo(cost);
  const auto w = packFlowReplicaWork(r, nullptr, cost, memo);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_DOUBLE_EQ(w[0].attn_fwd[0], cost.attnSeconds(0, 3000, Phase::Fwd) + cost.attnSeconds(0, 500, Phase::Fwd));
  EXPECT_DOUBLE_EQ(w[1].attn_fwd[0], cost.attnSeconds(3000, 2000, Phase::Fwd));
  // Backward MicroPack 0 = document 1's first slice; 1 = document 2 and the second slice.
  EXPECT_DOUBLE_EQ(w[0].attn_bwd[0], cost.attnSeconds(0, 3000, Phase::Bwd));
  EXPECT_DOUBLE_EQ(w[1].attn_bwd[0], cost.attnSeconds(0, 500, Phase::Bwd) + cost.attnSeconds(3000, 2000, Phase::Bwd));
  EXPECT_EQ(w[0].rank_tokens[0], 3500);
  EXPECT_EQ(w[0].rank_tokens_bwd[0], 3000);
  EXPECT_EQ(w[1].rank_tokens_bwd[0], 2500);
  // Useful FLOPs of the sliced step equal the unsliced document's.
  StepPlan sliced, whole;
  sliced.replicas = {f};
  sliced.backward = {r.bwd_cuts};
  whole.replicas = {std::vector<MicroBatch>(1)};
  whole.replicas[0][0].segments = {seg(1, 0, 5000, false), seg(2, 0, 500, false)};
  EXPECT_NEAR(model::usefulFlops(sliced, cost, 8), model::usefulFlops(whole, cost, 8),
              1e-12 * model::usefulFlops(whole, cost, 8));
}

TEST(PackFlow, StepSimulatorAgreesWithOneFOneBWithoutSlices) {
  for (std::int64_t pp : {1, 2, 4}) {
    Deck d = slimDeck("pile", 3, pp);
    d.mesh.cp = 2;
    d.packing.micro_batches = 2 * pp + 1;
    const auto cost = model::CostModel::fromDeck(d);
    auto src = data::makeLengthSource(d);
    auto wlb = packing::makePacker("wlb", d, cost);
    Deck dp = d, d1 = d;
    d1.pipeline.schedule = "1f1b";
    const StepSimulator a(dp, cost), b(d1, cost);
    for (std::int64_t t = 0; t < 6; ++t) {
      const StepPlan plan = wlb->pack(t, src->next(t));
      ASSERT_FALSE(isSlimPackPlan(plan));
      const auto ra = a.simulatePlan(plan, "adaptive", d.cp), rb = b.simulatePlan(plan, "adaptive", d.cp);
      EXPECT_DOUBLE_EQ(ra.step_seconds, rb.step_seconds);
      EXPECT_EQ(ra.peak_bytes, rb.peak_bytes);
      EXPECT_DOUBLE_EQ(ra.bubble_fraction, rb.bubble_fraction);
      // A SlimPack-shaped plan without slices and one grouping: the same under both.
      StepPlan same = plan;
      for (const auto& rep : plan.replicas) {
        std::vector<std::int64_t> cuts{0};
        for (const auto& mb : rep) cuts.push_back(cuts.back() + static_cast<std::int64_t>(mb.segments.size()));
        same.backward.push_back(cuts);
      }
      ASSERT_TRUE(isSlimPackPlan(same));
      EXPECT_DOUBLE_EQ(a.simulatePlan(same, "adaptive", d.cp).step_seconds,
                       b.simulatePlan(same, "adaptive", d.cp).step_seconds);
    }
  }
}

TEST(PackFlow, StepSimulatorRunsSlimPackPlans) {
  const Deck d = slimDeck("long_context_128k", 5, 2);
  const auto cost = model::CostModel::fromDeck(d);
  const StepSimulator sim(d, cost);
  Deck d1 = d;
  d1.pipeline.schedule = "1f1b";
  const StepSimulator one(d1, cost);
  bool rejected = false;
  for (const auto& plan : slimPlans(d, 6)) {
    ASSERT_TRUE(isSlimPackPlan(plan));
    const auto r = sim.simulatePlan(plan, "per_document", d.cp);
    EXPECT_GT(r.step_seconds, 0);
    EXPECT_GE(r.bubble_fraction, 0);
    EXPECT_LT(r.bubble_fraction, 1);
    for (std::size_t s = 0; s < r.peak_activation_bytes.size(); ++s) EXPECT_GT(r.peak_activation_bytes[s], 0);
    // A forward MicroPack allocates its slices' activations, a backward MicroPack frees its
    // own: every stage ends at its static bytes (cp = 1: bytes are linear in tokens).
    for (std::size_t k = 0; k < plan.replicas.size(); ++k) {
      const ReplicaSlices rs = replicaSlices(plan.replicas[k], plan.backward[k]);
      AttnSecondsMemo memo(cost);
      const PipelineCosts c =
          sim.pipelineCosts(packFlowReplicaWork(rs, nullptr, cost, memo));
      ASSERT_FALSE(c.free_bytes.empty());
      const DagResult g = simulateDag(makePackFlow(2, rs.microPacks(), packFlowDeps(rs)), c);
      for (std::size_t s = 0; s < 2; ++s)
        EXPECT_NEAR(g.memory_timeline[s].back().second, c.static_bytes[s], 1e-9 * c.static_bytes[s]);
    }
    // The step is at least its busiest stage's work.
    bool has_dep = false;
    for (std::size_t k = 0; k < plan.replicas.size(); ++k)
      has_dep = has_dep || !packFlowDeps(replicaSlices(plan.replicas[k], plan.backward[k])).trivial();
    if (has_dep) {
      try {
        (void)one.simulatePlan(plan, "per_document", d.cp);
        ADD_FAILURE() << "1f1b took a sliced plan";
      } catch (const InputError& e) {
        rejected = true;
        EXPECT_NE(std::string(e.what()).find("pipeline.schedule"), std::string::npos);
        EXPECT_NE(std::string(e.what()).find("packflow"), std::string::npos);
      }
    }
  }
  EXPECT_TRUE(rejected) << "the test needs a plan with slice dependencies";
  // The deck-level check names the key before anything runs.
  try {
    checkPackerSchedule(d1, "slimpack");
    FAIL() << "no InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline.schedule"), std::string::npos);
  }
  EXPECT_NO_THROW(checkPackerSchedule(d, "slimpack"));
  EXPECT_NO_THROW(checkPackerSchedule(d, "wlb"));  // PackFlow runs other plans as 1F1B
}

TEST(PackFlow, SimulateDeckComparesSlimPackWithOthers) {
  Deck d = slimDeck("long_context_128k", 5, 2);
  d.run.steps = 3;
  d.run.warmup = 0;
  SimulateOptions o;
  o.strategies = {{"plain", "plain"}, {"slimpack", "slimpack+per_document"}};
  const auto rows = simulateDeck(d, o);
  ASSERT_EQ(rows.size(), 2u);
  // Same documents (no warm-up, nothing held back by either packer after the drain).
  EXPECT_NEAR(rows[0].tokens, rows[1].tokens, 0.5);
  EXPECT_GT(rows[1].tokens_per_s, 0);
  EXPECT_GT(rows[1].flops_per_s, 0);
  d.pipeline.schedule = "1f1b";
  EXPECT_THROW(simulateDeck(d, o), InputError);
}
