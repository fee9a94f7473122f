// wlb-timeout: 120
// slimpack planner (docs/packing.md § slimpack): conservation over many steps and across a
// checkpoint, slices consecutive and covering their document, S_max per MicroPack,
// forward MicroPacks at tau, the backward partition, bad keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"
#include "packing/plan_io.hpp"
#include "packing/runner.hpp"
#include "packing/slimpack.hpp"
#include "pp/simulator.hpp"

using namespace wlb;
using model::Phase;
namespace sp = wlb::packing::slimpack;

namespace {
Deck slimDeck(const std::string& preset, std::uint64_t seed, std::int64_t pp = 2) {
  Deck d;
  d.data.source = "generator";
  d.data.preset = preset;
  d.data.seed = seed;
  d.data.context_window = 8192;
  d.data.s_max = 10240;
  d.data.length_scale = preset == "long_context_128k" ? 1.0 / 16 : 1.0;
  d.mesh.dp = 2;
  d.mesh.pp = pp;
  d.model.layers = 4;
  d.packing.micro_batches = 4;
  d.packing.strategy = "slimpack";
  return d;
}

std::vector<StepPlan> plans(const Deck& d, std::int64_t steps) {
  const auto cost = model::CostModel::fromDeck(d);
  auto src = data::makeLengthSource(d);
  auto p = packing::makePacker("slimpack", d, cost);
  std::vector<StepPlan> out;
  for (std::int64_t t = 0; t < steps; ++t) out.push_back(p->pack(t, src->next(t)));
  return out;
}

double fwd(const model::CostModel& c, const MicroBatch& mb) {
  double f = 0;
  for (const auto& s : mb.segments) f += sp::sliceFlops(c, s.q_offset, s.length, Phase::Fwd);
  return f;
}
// A small model (hidden 1024, 8 layers) whose activations, not its weights, fill a device
// sized by the tests below.
void smallModel(Deck& d) {
  d.model.hidden = 1024;
  d.model.heads = 8;
  d.model.kv_heads = 8;
  d.model.ffn = 2816;
  d.model.layers = 8;
}
}  // namespace

TEST(SlimPack, TokensConservedOverManyStepsAndAcrossRestore) {
  for (const auto& preset : {"long_context_128k", "pile", "sft_chat"}) {
    const Deck d = slimDeck(preset, 3);
    const auto cost = model::CostModel::fromDeck(d);
    {
      auto src = data::makeLengthSource(d);
      auto p = packing::makePacker("slimpack", d, cost);
      packing::RunOptions ro;
      ro.steps = 300;
      ro.check = true;
      const auto r = packing::runPacker(*src, *p, cost, ro);
      EXPECT_TRUE(r.check_ok) << preset << ": " << r.check_report;
      EXPECT_EQ(r.lost_tokens, 0);
      EXPECT_EQ(r.duplicated, 0);
    }
    // Save after 40 steps, restore into a fresh packer: the same plan stream, still conserved.
    auto src_a = data::makeLengthSource(d);
    auto pa = packing::makePacker("slimpack", d, cost);
    std::vector<std::string> ref;
    for (std::int64_t t = 0; t < 80; ++t) ref.push_back(packing::stepToJson(pa->pack(t, src_a->next(t)), {}, 0).dump());
    auto src_b = data::makeLengthSource(d);
    auto pb = packing::makePacker("slimpack", d, cost);
    for (std::int64_t t = 0; t < 40; ++t) pb->pack(t, src_b->next(t));
    const auto ck = packing::saveCheckpoint(*src_b, *pb);
    auto src_c = data::makeLengthSource(d);
    auto pc = packing::makePacker("slimpack", d, cost);
    packing::loadCheckpoint(ck, *src_c, *pc, "ck");
    packing::RunOptions ro;
    ro.steps = 40;
    ro.check = true;
    std::int64_t t = 40;
    ro.on_step = [&](const StepPlan& plan, const packing::StepMetrics&, std::int64_t) {
      EXPECT_EQ(packing::stepToJson(plan, {}, 0).dump(), ref[static_cast<std::size_t>(t)]) << preset << " " << t;
      ++t;
    };
    const auto r = packing::runPacker(*src_c, *pc, cost, ro);
    EXPECT_TRUE(r.check_ok) << preset << " resumed: " << r.check_report;
  }
}

TEST(SlimPack, SlicesOfADocumentAreConsecutiveAndCoverIt) {
  const Deck d = slimDeck("long_context_128k", 5);
  auto src = data::makeLengthSource(d);
  std::map<DocId, std::int64_t> length;
  const auto cost = model::CostModel::fromDeck(d);
  auto p = packing::makePacker("slimpack", d, cost);
  std::int64_t sliced = 0;
  for (std::int64_t t = 0; t < 60; ++t) {
    const auto docs = src->next(t);
    for (const auto& x : docs) length[x.id] = x.length;
    const auto plan = p->pack(t, docs);
    // doc -> (replica, pack, offset, length, q_offset) in pack order
    std::map<DocId, std::vector<std::array<std::int64_t, 5>>> seen;
    for (std::size_t r = 0; r < plan.replicas.size(); ++r)
      for (std::size_t k = 0; k < plan.replicas[r].size(); ++k)
        for (const auto& s : plan.replicas[r][k].segments)
          seen[s.doc].push_back(
              {static_cast<std::int64_t>(r), static_cast<std::int64_t>(k), s.offset, s.length, s.q_offset});
    EXPECT_EQ(seen.size(), docs.size()) << "step " << t;
    for (const auto& [doc, v] : seen) {
      std::int64_t end = 0;
      for (std::size_t i = 0; i < v.size(); ++i) {
        EXPECT_EQ(v[i][0], v[0][0]) << "doc " << doc << ": slices on one replica";
        if (i > 0) {
          EXPECT_GT(v[i][1], v[i - 1][1]) << "doc " << doc << ": one slice per MicroPack, in order";
        }
        EXPECT_EQ(v[i][2], end) << "doc " << doc << ": consecutive";
        EXPECT_EQ(v[i][4], v[i][2]) << "doc " << doc << ": a slice keys its whole prefix";
        end += v[i][3];
      }
      EXPECT_EQ(end, length[doc]) << "doc " << doc << ": covered exactly";
      if (v.size() > 1) ++sliced;
    }
  }
  EXPECT_GT(sliced, 0);  // the long-context stream does slim samples
}

TEST(SlimPack, EveryMicroPackWithinSMaxAndBackwardPartitionValid) {
  for (const auto& preset : {"long_context_128k", "pile"}) {
    const Deck d = slimDeck(preset, 7);
    const auto cost = model::CostModel::fromDeck(d);
    for (const auto& plan : plans(d, 80)) {
      ASSERT_EQ(plan.backward.size(), plan.replicas.size());
      const auto m = plan.replicas.front().size();
      EXPECT_EQ(m % 2, 0u) << "m = i * pp";
      for (std::size_t r = 0; r < plan.replicas.size(); ++r) {
        ASSERT_EQ(plan.replicas[r].size(), m);
        std::vector<Segment> flat;
        double fwd_group_max = 0;
        for (const auto& mb : plan.replicas[r]) {
          EXPECT_LE(mb.tokens(), d.data.s_max);
          double b = 0;
          for (const auto& s : mb.segments) {
            flat.push_back(s);
            b += sp::sliceFlops(cost, s.q_offset, s.length, Phase::Bwd);
          }
          fwd_group_max = std::max(fwd_group_max, b);
        }
        const auto& cuts = plan.backward[r];
        ASSERT_EQ(cuts.size(), m + 1);
        EXPECT_EQ(cuts.front(), 0);
        EXPECT_EQ(cuts.back(), static_cast<std::int64_t>(flat.size()));
        double bwd_max = 0;
        for (std::size_t k = 0; k < m; ++k) {
          ASSERT_LE(cuts[k], cuts[k + 1]);
          double b = 0;
          std::int64_t tok = 0;
          for (auto i = cuts[k]; i < cuts[k + 1]; ++i) {
            b += sp::sliceFlops(cost, flat[i].q_offset, flat[i].length, Phase::Bwd);
            tok += flat[i].length;
          }
          EXPECT_LE(tok, d.data.s_max);
          bwd_max = std::max(bwd_max, b);
        }
        // Regrouping for the backward never makes its slowest MicroPack worse.
        EXPECT_LE(bwd_max, fwd_group_max * (1 + 1e-9)) << preset << " step " << plan.step;
      }
    }
  }
}

TEST(SlimPack, SliceBoundarySolvesTheCostModel) {
  const Deck d = slimDeck("pile", 1);
  const auto cost = model::CostModel::fromDeck(d);
  for (std::int64_t q0 : {0, 1, 100, 5000, 70000}) {
    for (double budget : {1e9, 3e11, 5e12}) {
      const auto q = sp::solveSliceLength(cost, q0, budget, 1 << 20);
      const double e = std::abs(sp::sliceFlops(cost, q0, q, Phase::Fwd) - budget);
      EXPECT_LE(e, std::abs(sp::sliceFlops(cost, q0, q + 1, Phase::Fwd) - budget));
      if (q > 0) {
        EXPECT_LE(e, std::abs(sp::sliceFlops(cost, q0, q - 1, Phase::Fwd) - budget));
      }
    }
  }
  EXPECT_EQ(sp::solveSliceLength(cost, 0, 1e30, 77), 77);  // clamped to the token room
  EXPECT_EQ(sp::solveSliceLength(cost, 0, 0, 77), 0);
}

TEST(SlimPack, ForwardMicroPacksMeetTau) {
  const Deck d = slimDeck("pile", 1);
  const auto cost = model::CostModel::fromDeck(d);
  // One long sample and short ones: 4 MicroPacks of equal forward FLOPs exist.
  std::vector<Document> docs{{1, 30000, 0}, {2, 2000, 0}, {3, 1500, 0}, {4, 900, 0}, {5, 700, 0}, {6, 300, 0}};
  const auto rp = sp::packReplica(docs, 4, 1 << 20, cost);
  ASSERT_TRUE(rp.ok);
  EXPECT_TRUE(rp.balanced);
  for (const auto& mb : rp.packs) EXPECT_NEAR(fwd(cost, mb) / rp.tau, 1.0, 1e-3);
  // The short samples stay whole.
  for (const auto& mb : rp.packs)
    for (const auto& s : mb.segments)
      if (s.doc != 1) {
        EXPECT_EQ(s.offset, 0);
      }
  // Too many tokens for m * s_max: not ok; a tight token limit: balanced only if it can be.
  EXPECT_FALSE(sp::packReplica(docs, 1, 1000, cost).ok);
  const auto tight = sp::packReplica(docs, 8, 4500, cost);
  ASSERT_TRUE(tight.ok);
  std::int64_t total = 0;
  for (const auto& mb : tight.packs) {
    EXPECT_LE(mb.tokens(), 4500);
    total += mb.tokens();
  }
  EXPECT_EQ(total, 35400);
  // Through the packer, on a stream: every balanced plan's MicroPacks sit at tau.
  const Deck ld = slimDeck("long_context_128k", 9);
  const auto lcost = model::CostModel::fromDeck(ld);
  auto src = data::makeLengthSource(ld);
  auto p = packing::makePacker("slimpack", ld, lcost);
  int balanced_steps = 0;
  for (std::int64_t t = 0; t < 40; ++t) {
    const auto plan = p->pack(t, src->next(t));
    const auto info = p->lastSolverInfo();
    bool balanced = false;
    for (const auto& c : info.at("candidates"))
      if (c.at("micropacks") == info.at("micropacks")) balanced = c.at("balanced").get<bool>();
    if (!balanced) continue;
    ++balanced_steps;
    for (const auto& rep : plan.replicas) {
      double tau = 0;
      for (const auto& mb : rep) tau += fwd(lcost, mb) / static_cast<double>(rep.size());
      // cut to the nearest token: at this 8K scale a token is up to ~0.1% of a MicroPack
      for (const auto& mb : rep) EXPECT_NEAR(fwd(lcost, mb) / tau, 1.0, 5e-3) << "step " << t;
    }
  }
  EXPECT_GT(balanced_steps, 30);
}

TEST(SlimPack, BackwardPartitionEqualWhenPossibleAndOrdered) {
  const std::vector<double> bwd{1, 1, 2, 2, 1, 1};
  const std::vector<std::int64_t> tok{10, 10, 10, 10, 10, 10};
  EXPECT_EQ(sp::backwardPartition(bwd, tok, 2, 100), (std::vector<std::int64_t>{0, 3, 6}));
  // No 3-way cut beats 4, so the greedy runs at that cap leave the last group empty.
  EXPECT_EQ(sp::backwardPartition(bwd, tok, 3, 100), (std::vector<std::int64_t>{0, 3, 6, 6}));
  // The token limit wins over FLOPs balance.
  EXPECT_EQ(sp::backwardPartition(bwd, tok, 3, 20), (std::vector<std::int64_t>{0, 2, 4, 6}));
  EXPECT_TRUE(sp::backwardPartition(bwd, tok, 2, 20).empty());  // cannot fit at all
  // Forward MicroPacks at tau, regrouped: equal backward FLOPs where cut points allow.
  const Deck d = slimDeck("pile", 1);
  const auto cost = model::CostModel::fromDeck(d);
  std::vector<Document> docs{{1, 4000, 0}, {2, 4000, 0}, {3, 4000, 0}, {4, 4000, 0}};
  const auto rp = sp::packReplica(docs, 4, 1 << 20, cost);
  std::vector<double> b;
  std::vector<std::int64_t> t;
  for (const auto& mb : rp.packs)
    for (const auto& s : mb.segments) {
      b.push_back(sp::sliceFlops(cost, s.q_offset, s.length, Phase::Bwd));
      t.push_back(s.length);
    }
  const auto cuts = sp::backwardPartition(b, t, 4, 1 << 20);
  ASSERT_EQ(cuts.size(), 5u);
  for (std::size_t k = 0; k < 4; ++k) {
    const double g = std::accumulate(b.begin() + cuts[k], b.begin() + cuts[k + 1], 0.0);
    EXPECT_NEAR(g / b[0], 1.0, 1e-12);
  }
}

TEST(SlimPack, CandidatesAndBadKeys) {
  EXPECT_EQ(sp::candidateCounts(3, 4, 100), (std::vector<std::int64_t>{3, 4, 6, 10}));
  // at most i_max (a MicroPack holds a token at least); i_min always; 64 candidates do not
  // overflow or allocate 2^63 MicroPacks
  EXPECT_EQ(sp::candidateCounts(3, 64, 9), (std::vector<std::int64_t>{3, 4, 6}));
  EXPECT_EQ(sp::candidateCounts(5, 64, 2), (std::vector<std::int64_t>{5}));
  EXPECT_EQ(sp::candidateCounts(1, 64, std::int64_t{1} << 62).size(), 62u);
  auto err = [](const std::string& set) {
    try {
      (void)parseDeck("[packing]\nstrategy = \"slimpack\"\n", "s.toml", {set});
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err("packing.slimpack_candidates=0").find("packing.slimpack_candidates"), std::string::npos);
  EXPECT_NE(err("packing.slimpack_candidates=x").find("packing.slimpack_candidates"), std::string::npos);
  EXPECT_NE(err("packing.slimpak_candidates=2").find("slimpack_candidates"), std::string::npos);  // typo hint
  EXPECT_EQ(err("packing.slimpack_candidates=3"), "");
  // Hand-made options: a bad candidate count is an InputError naming the key.
  const auto cost = model::CostModel::fromDeck(slimDeck("pile", 1));
  auto opt = packing::PackerOptions::fromDeck(slimDeck("pile", 1));
  opt.slimpack_candidates = 0;
  try {
    (void)packing::makePacker("slimpack", opt, cost);
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("packing.slimpack_candidates"), std::string::npos);
  }
}

TEST(SlimPack, PlanFileKeepsSlicesAndBackwardAndReadsOldFiles) {
  const Deck d = slimDeck("long_context_128k", 2);
  const auto cost = model::CostModel::fromDeck(d);
  const auto ps = plans(d, 5);
  for (const auto& p : ps) {
    const auto j = packing::stepToJson(p, packing::computeMetrics(p, cost), 0);
    const auto back = packing::stepFromJson(nlohmann::json::parse(j.dump()));
    EXPECT_EQ(packing::stepToJson(back, packing::computeMetrics(back, cost), 0).dump(), j.dump());
    EXPECT_EQ(back.backward, p.backward);
  }
  // A version-1 step line of 4-field segments still loads (q_offset 0, no backward).
  const auto old = packing::stepFromJson(
      nlohmann::json::parse(R"({"type":"step","step":0,"replicas":[[[[1,0,5,0]]]],"delayed":[]})"));
  EXPECT_EQ(old.replicas[0][0].segments[0].q_offset, 0);
  EXPECT_TRUE(old.backward.empty());
  EXPECT_THROW(packing::stepFromJson(
                   nlohmann::json::parse(R"({"type":"step","step":0,"replicas":[[[[1,3,5,0,4]]]],"delayed":[]})")),
               InputError);  // q_offset > offset
}

// Edge cases through the packer directly: empty steps, fewer samples than replicas,
// one-token samples, samples many times s_max; every mesh shape conserves tokens.
TEST(SlimPack, EdgeCasesConserveTokens) {
  std::mt19937_64 rng(17);
  for (std::int64_t dp : {1, 3}) {
    for (std::int64_t pp : {1, 2, 4}) {
      Deck d = slimDeck("pile", 1, pp);
      d.mesh.dp = dp;
      const auto cost = model::CostModel::fromDeck(d);
      auto p = packing::makePacker("slimpack", d, cost);
      packing::ConservationChecker check(d.data.s_max);
      DocId id = 0;
      for (std::int64_t t = 0; t < 12; ++t) {
        std::vector<Document> docs;
        const auto n = t % 4 == 0 ? 0 : static_cast<int>(rng() % 5);  // empty steps included
        for (int i = 0; i < n; ++i) {
          const std::int64_t len =
              i == 0 ? 1 : (i == 1 ? 3 * d.data.s_max + 17 : 1 + static_cast<std::int64_t>(rng() % 9000));
          docs.push_back({id++, len, t});
        }
        check.addIncoming(docs);
        const auto plan = p->pack(t, docs);
        check.addPlan(plan);
        ASSERT_EQ(plan.replicas.size(), static_cast<std::size_t>(dp));
        // m = i * pp MicroPacks after the DP-Merge slots
        EXPECT_EQ((plan.replicas.front().size() - plan.merged.size()) % static_cast<std::size_t>(pp), 0u);
        for (const auto& rep : plan.replicas)
          for (std::size_t k = 0; k < rep.size(); ++k) {
            const auto* mg = plan.mergedAt(static_cast<std::int64_t>(k));
            const auto g = mg ? static_cast<std::int64_t>(mg->group.size()) : 1;
            EXPECT_LE((rep[k].tokens() + g - 1) / g, d.data.s_max);
          }
      }
      EXPECT_TRUE(check.ok(p->pendingTokens()))
          << "dp " << dp << " pp " << pp << ": " << check.report(p->pendingTokens());
    }
  }
}

TEST(SlimPack, MicroPacksRespectThePerStageMemoryBudget) {
  // A device so small that the per-stage budget, not s_max, limits a MicroPack's tokens.
  Deck d = slimDeck("long_context_128k", 5);
  smallModel(d);
  const auto cost0 = model::CostModel::fromDeck(d);
  pp::StepSimulator probe(pp::SimConfig::fromDeck(d, cost0.hardware()), cost0);
  const double act = probe.activationBytesPerToken() * 4 + 32000.0 * 4;  // last stage: 4 layers + logits
  const double fixed =
      (probe.stageParams(0) > probe.stageParams(1) ? probe.stageParams(0) : probe.stageParams(1)) * (2 + 4 + 12.0 / 2);
  d.hardware.memory_gb = (fixed + 2 * act * 3000) / 1e9;  // ~3000 tokens per in-flight MicroPack on stage 0
  const auto cost = model::CostModel::fromDeck(d);
  pp::StepSimulator sim(pp::SimConfig::fromDeck(d, cost.hardware()), cost);
  const std::int64_t cap = sim.microBatchTokenBudget();
  ASSERT_LT(cap, d.data.s_max);
  ASSERT_GT(cap, 1000);
  auto src = data::makeLengthSource(d);
  auto p = packing::makePacker("slimpack", d, cost);
  for (std::int64_t t = 0; t < 20; ++t) {
    const auto docs = src->next(t);
    std::int64_t in = 0, out = 0;
    for (const auto& doc : docs) in += doc.length;
    const auto plan = p->pack(t, docs);
    EXPECT_EQ(p->lastSolverInfo().at("token_cap").get<std::int64_t>(), cap);
    for (const auto& rep : plan.replicas)
      for (std::size_t k = 0; k < rep.size(); ++k) {
        // a DP-Merge unit: each member holds its share
        const auto* mg = plan.mergedAt(static_cast<std::int64_t>(k));
        const auto g = mg ? static_cast<std::int64_t>(mg->group.size()) : 1;
        EXPECT_LE((rep[k].tokens() + g - 1) / g, cap) << "step " << t;
        out += rep[k].tokens();
      }
    EXPECT_EQ(in, out);
  }
}

// DP-Merge is a placement the simulator weighs, not a rule: the packer simulates the plans
// with and without it and keeps the faster. A sample of 9000 tokens among small ones on 4
// replicas gains less from a group of replicas than its empty slots on the others cost; one
// of 20000 (below) gains.
TEST(SlimPack, DpMergeOnlyWhereItIsFaster) {
  Deck d = slimDeck("pile", 3);
  d.mesh.dp = 4;
  const auto cost = model::CostModel::fromDeck(d);
  std::vector<Document> docs{{0, 9000, 0}};
  for (DocId i = 1; i < 40; ++i) docs.push_back({i, 300 + 37 * i, 0});
  auto p = packing::makePacker("slimpack", d, cost);
  const StepPlan plan = p->pack(0, docs);
  EXPECT_TRUE(plan.merged.empty());
  const auto info = p->lastSolverInfo();
  double merged = 1e300, plain = 1e300;
  for (const auto& c : info.at("candidates"))
    (c.at("dp_merge").get<bool>() ? merged : plain) =
        std::min(c.at("dp_merge").get<bool>() ? merged : plain, c.at("step_seconds").get<double>());
  ASSERT_LT(merged, 1e300);  // the merged placement was simulated too
  EXPECT_LT(plain, merged);
  EXPECT_EQ(info.at("step_seconds").get<double>(), plain);
}

TEST(SlimPack, DpMergeRunsAnOversizedSampleOnAGroupOfReplicas) {
  Deck d = slimDeck("pile", 3);
  d.mesh.dp = 4;
  const auto cost = model::CostModel::fromDeck(d);
  // One sample with most of the step's forward FLOPs, and small ones.
  std::vector<Document> docs{{0, 20000, 0}};
  for (DocId i = 1; i < 40; ++i) docs.push_back({i, 300 + 37 * i, 0});
  auto p = packing::makePacker("slimpack", d, cost);
  const StepPlan plan = p->pack(0, docs);
  ASSERT_EQ(plan.merged.size(), 1u);
  const auto& mg = plan.merged.front();
  EXPECT_EQ(mg.slot, 0);
  ASSERT_GE(mg.group.size(), 2u);
  EXPECT_TRUE(std::is_sorted(mg.group.begin(), mg.group.end()));
  std::int64_t tokens = 0;
  for (std::size_t r = 0; r < plan.replicas.size(); ++r) {
    const auto& slot = plan.replicas[r][0];
    if (static_cast<std::int64_t>(r) == mg.group.front()) {
      ASSERT_EQ(slot.segments.size(), 1u);
      EXPECT_EQ(slot.segments[0].doc, 0);
      EXPECT_EQ(slot.segments[0].length, 20000);
    } else {
      EXPECT_TRUE(slot.segments.empty());
    }
    // the slot is its own backward unit
    EXPECT_EQ(plan.backward[r][1], static_cast<std::int64_t>(slot.segments.size()));
    for (const auto& mb : plan.replicas[r]) tokens += mb.tokens();
  }
  EXPECT_EQ(tokens, std::accumulate(docs.begin(), docs.end(), std::int64_t{0},
                                    [](std::int64_t a, const Document& x) { return a + x.length; }));
  // The plan file keeps the group; the simulator gives every member its share.
  const StepPlan back = packing::stepFromJson(packing::stepToJson(plan, packing::computeMetrics(plan, cost), 40));
  ASSERT_EQ(back.merged.size(), 1u);
  EXPECT_EQ(back.merged[0].group, mg.group);
  pp::AttnSecondsMemo attn(cost);
  std::vector<pp::PackFlowDeps> flow;
  const auto works = pp::packFlowPlanWork(plan, "per_document", 1, cost, CpConfig{}, attn, flow);
  std::int64_t share = 0;
  for (std::size_t r = 0; r < works.size(); ++r) {
    const bool member = std::find(mg.group.begin(), mg.group.end(), static_cast<std::int64_t>(r)) != mg.group.end();
    EXPECT_EQ(works[r][0].rank_tokens.front() > 0, member) << r;
    share += works[r][0].rank_tokens.front();
  }
  EXPECT_EQ(share, 20000);
  // The members exchange the sample's K/V over the group at cp = 1 too (the executor does):
  // the simulator charges it on the CP link.
  for (const auto r : mg.group) EXPECT_GT(works[static_cast<std::size_t>(r)][0].kv_fwd_bytes.front(), 0) << r;
  Deck slow = d;
  slow.pipeline.schedule = "packflow";
  slow.hardware.cp_bandwidth_gbps = 0.01;
  Deck fast = slow;
  fast.hardware.cp_bandwidth_gbps = 1e6;
  const auto cost_slow = model::CostModel::fromDeck(slow), cost_fast = model::CostModel::fromDeck(fast);
  const double t_slow =
      pp::StepSimulator(slow, cost_slow).simulatePlan(plan, "per_document", CpConfig{}).pipeline_seconds;
  const double t_fast =
      pp::StepSimulator(fast, cost_fast).simulatePlan(plan, "per_document", CpConfig{}).pipeline_seconds;
  EXPECT_GT(t_slow, t_fast * 1.01);
  // The group spans replicas: a slow DP link paces its exchange too.
  Deck slow_dp = fast;
  slow_dp.hardware.dp_bandwidth_gbps = 0.01;
  const double t_slow_dp = pp::StepSimulator(slow_dp, model::CostModel::fromDeck(slow_dp))
                               .simulatePlan(plan, "per_document", CpConfig{})
                               .pipeline_seconds;
  EXPECT_GT(t_slow_dp, t_fast * 1.01);
  // A bad group is a plan error naming the key.
  auto j = packing::stepToJson(plan, packing::computeMetrics(plan, cost), 40);
  j["merged"][0]["group"] = {mg.group.back(), mg.group.front()};
  EXPECT_THROW((void)packing::stepFromJson(j), InputError);
  // Off: no merged units, the sample is slimmed on one replica.
  d.packing.slimpack_dp_merge = 0;
  auto q = packing::makePacker("slimpack", d, cost);
  EXPECT_TRUE(q->pack(0, docs).merged.empty());
}

namespace {
// A small model on a device whose memory, not s_max, binds (docs/packing.md § slimpack,
// memory): `tokens` in-flight tokens of activations fit on stage 0 after its static bytes.
Deck tightDeck(const std::string& preset, std::uint64_t seed, double tokens) {
  Deck d = slimDeck(preset, seed);
  d.pipeline.schedule = "packflow";
  smallModel(d);
  const auto cost0 = model::CostModel::fromDeck(d);
  pp::StepSimulator probe(pp::SimConfig::fromDeck(d, cost0.hardware()), cost0);
  d.hardware.memory_gb =
      (cost0.hardware().memory_gb * 1e9 - probe.stageFreeBytes(0) + tokens * probe.stageBytesPerToken(0)) / 1e9;
  return d;
}

// Every step's plan, simulated as `wlb simulate` does, with the plan's own memory record.
struct MemStep {
  StepPlan plan;
  pp::StepResult res;
  nlohmann::json info;
};
std::vector<MemStep> memSteps(const Deck& d, std::int64_t steps, packing::ConservationChecker* check = nullptr) {
  const auto cost = model::CostModel::fromDeck(d);
  pp::StepSimulator sim(pp::SimConfig::fromDeck(d, cost.hardware()), cost);
  auto src = data::makeLengthSource(d);
  auto p = packing::makePacker("slimpack", d, cost);
  std::vector<MemStep> out;
  for (std::int64_t t = 0; t < steps || p->pendingTokens() > 0; ++t) {
    const auto docs = t < steps ? src->next(t) : std::vector<Document>{};
    if (check) check->addIncoming(docs);
    auto plan = p->pack(t, docs);
    if (check) check->addPlan(plan);
    auto res = sim.simulatePlan(plan, "per_document", d.cp);
    out.push_back({std::move(plan), res, p->lastSolverInfo()});
    if (t > steps + 4) break;  // a held sample waits one step at most
  }
  if (check) {
    EXPECT_TRUE(check->ok(p->pendingTokens())) << check->report(p->pendingTokens());
  }
  return out;
}
}  // namespace

TEST(SlimPackMemory, BackwardCutsAtSampleEndsKeepSlicedSamplesApart) {
  // Two sliced samples, 7 then 9.
  const std::vector<double> bwd{4, 4, 2, 2, 4, 4};
  const std::vector<std::int64_t> tok(6, 10);
  const std::vector<std::int64_t> chain{7, 7, 7, 9, 9, 9};
  // FLOP-balanced: the middle group links the end of 7 to the start of 9.
  EXPECT_EQ(sp::backwardPartition(bwd, tok, 3, 100), (std::vector<std::int64_t>{0, 2, 5, 6}));
  const auto cuts = sp::backwardPartition(bwd, tok, 3, 100, &chain);
  EXPECT_EQ(cuts, (std::vector<std::int64_t>{0, 3, 6, 6}));
  ASSERT_EQ(cuts.size(), 4u);
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
    std::set<std::int64_t> sliced;
    for (auto i = cuts[k]; i < cuts[k + 1]; ++i)
      if (chain[static_cast<std::size_t>(i)] >= 0) sliced.insert(chain[static_cast<std::size_t>(i)]);
    EXPECT_LE(sliced.size(), 1u) << "group " << k;
  }
  // Three sliced samples cannot share two groups.
  const std::vector<std::int64_t> three{1, 2, 3};
  EXPECT_TRUE(sp::backwardPartition({1, 1, 1}, {1, 1, 1}, 2, 100, &three).empty());
}

TEST(SlimPackMemory, WholeSampleFillCutsOnlySamplesLongerThanAMicroPack) {
  const Deck d = slimDeck("pile", 1);
  const auto cost = model::CostModel::fromDeck(d);
  std::vector<Document> docs{{1, 2500, 0}, {2, 900, 0}, {3, 800, 0}, {4, 700, 0}, {5, 300, 0}};
  const auto rp = sp::packReplicaWhole(docs, 6, 1000, cost);
  ASSERT_TRUE(rp.ok);
  std::map<DocId, std::int64_t> seen;
  for (const auto& mb : rp.packs) {
    EXPECT_LE(mb.tokens(), 1000);
    for (const auto& s : mb.segments) {
      EXPECT_EQ(s.offset, seen[s.doc]) << "consecutive slices";
      EXPECT_EQ(s.q_offset, s.offset);
      if (s.doc != 1) {
        EXPECT_EQ(s.length, docs[static_cast<std::size_t>(s.doc - 1)].length) << "whole";
      }
      seen[s.doc] += s.length;
    }
  }
  for (const auto& doc : docs) EXPECT_EQ(seen[doc.id], doc.length);
  EXPECT_FALSE(sp::packReplicaWhole(docs, 2, 1000, cost).ok);  // 5200 tokens in 2000
}

TEST(SlimPackMemory, EveryPlanWithinTheStageBudgetAndDocumentsConserved) {
  // Memory for 20000 in-flight tokens on stage 0 (the last stage, with the logits, binds
  // first): the FLOP-balanced cuts exceed it; the plans move cuts to sample ends or keep
  // samples whole (on these mixes every step needs one of them).
  for (const auto& preset : {"long_context_128k", "code"}) {
    const Deck d = tightDeck(preset, 11, 20000);
    const auto cost = model::CostModel::fromDeck(d);
    packing::ConservationChecker check(d.data.s_max);
    std::map<std::string, int> parts;
    for (const auto& st : memSteps(d, 40, &check)) {
      const auto& mem = st.plan.memory;
      ++parts[mem.partition];
      EXPECT_TRUE(st.res.fits_memory) << preset << " step " << st.plan.step << " " << mem.partition;
      EXPECT_NE(mem.partition, "over");
      EXPECT_DOUBLE_EQ(mem.budget_bytes, d.hardware.memory_gb * 1e9);
      ASSERT_EQ(mem.peak_bytes.size(), st.res.peak_bytes.size());
      for (std::size_t s = 0; s < mem.peak_bytes.size(); ++s) {
        EXPECT_LE(st.res.peak_bytes[s], mem.budget_bytes);
        EXPECT_DOUBLE_EQ(mem.peak_bytes[s], st.res.peak_bytes[s]) << "the plan records the simulated peak";
      }
      // A remedy only where the FLOP-balanced plan of that MicroPack count exceeded the budget.
      if (mem.partition == "sample_ends") {
        const auto m = static_cast<std::int64_t>(st.plan.replicas.front().size() - st.plan.merged.size());
        for (const auto& c : st.info.at("candidates"))
          if (c.at("partition") == "flops" && c.at("micropacks") == m) {
            EXPECT_FALSE(c.at("fits_memory").get<bool>());
          }
      }
      if (mem.partition == "whole_samples") {
        for (const auto& c : st.info.at("candidates"))
          if (c.at("partition") != "whole_samples") {
            EXPECT_FALSE(c.at("fits_memory").get<bool>());
          }
      }
      // The plan file keeps the record.
      const auto back = packing::stepFromJson(packing::stepToJson(st.plan, {}, 0));
      EXPECT_EQ(back.memory.partition, mem.partition);
      EXPECT_EQ(back.memory.held, mem.held);
    }
    EXPECT_GT(parts["sample_ends"] + parts["whole_samples"], 0) << preset << ": the budget never bound";
  }
}

TEST(SlimPackMemory, HoldsSamplesBackWhenOnlyThatFits) {
  // One count per step and one replica: a sample longer than a MicroPack holds (so it is
  // sliced in every partition, and all its activations wait for its last slice's backward)
  // fits a stage alone but not with the step's other samples in flight.
  Deck d = tightDeck("pile", 1, 20000);
  d.model.vocab = 512;  // stage 0's two in-flight MicroPacks bind, not the last stage's logits
  d.mesh.dp = 1;
  d.packing.slimpack_candidates = 1;
  const auto cost = model::CostModel::fromDeck(d);
  pp::StepSimulator sim(pp::SimConfig::fromDeck(d, cost.hardware()), cost);
  const std::int64_t cap = sim.microBatchTokenBudget();
  double alone = 1e18;
  for (int s = 0; s < d.mesh.pp; ++s) alone = std::min(alone, sim.stageFreeBytes(s) / sim.stageBytesPerToken(s));
  const auto T = static_cast<std::int64_t>(0.85 * alone);
  ASSERT_GT(T, cap);
  std::vector<Document> docs{{0, T, 0}};
  for (DocId i = 1; i <= 24; ++i) docs.push_back({i, 300 + 13 * i, 0});
  auto p = packing::makePacker("slimpack", d, cost);
  packing::ConservationChecker check(d.data.s_max);
  check.addIncoming(docs);
  const StepPlan first = p->pack(0, docs);
  check.addPlan(first);
  ASSERT_FALSE(first.memory.held.empty());
  EXPECT_NE(first.memory.partition, "over");
  EXPECT_EQ(first.delayed, first.memory.held);
  EXPECT_TRUE(std::find(first.memory.held.begin(), first.memory.held.end(), 0) == first.memory.held.end())
      << "the longest sample stays";
  EXPECT_TRUE(sim.simulatePlan(first, "per_document", d.cp).fits_memory);
  EXPECT_EQ(p->pendingTokens(), std::accumulate(first.memory.held.begin(), first.memory.held.end(), std::int64_t{0},
                                                [&](std::int64_t a, DocId id) { return a + docs[id].length; }));
  // The checkpoint carries them; the next step trains them first.
  auto q = packing::makePacker("slimpack", d, cost);
  q->loadState(p->saveState());
  const StepPlan second = q->pack(1, {});
  check.addPlan(second);
  EXPECT_TRUE(second.memory.held.empty());
  EXPECT_TRUE(second.delayed.empty());
  EXPECT_EQ(q->pendingTokens(), 0);
  EXPECT_TRUE(check.ok(0)) << check.report(0);
}

TEST(SlimPack, DpMergeFiresOnTheLongTailedDeck) {
  // inputs/run_slimpack_dpmerge.toml: 4 replicas, one window per replica and step, so a long
  // sample holds more than a replica's share of the step's forward FLOPs.
  Deck d = loadDeck(std::string(WLB_SOURCE_DIR) + "/inputs/run_slimpack_dpmerge.toml");
  const auto cost = model::CostModel::fromDeck(d);
  const pp::StepSimulator sim(d, cost);
  const auto run = [&](bool merge) {
    d.packing.slimpack_dp_merge = merge;
    auto src = data::makeLengthSource(d);
    auto p = packing::makePacker("slimpack", d, cost);
    std::vector<std::pair<StepPlan, pp::StepResult>> out;
    for (std::int64_t t = 0; t < 5; ++t) {
      auto plan = p->pack(t, src->next(t));
      const auto res = sim.simulatePlan(plan, "per_document", d.cp);
      out.emplace_back(std::move(plan), res);
    }
    return out;
  };
  const auto on = run(true), off = run(false);
  int merged_steps = 0;
  double t_on = 0, t_off = 0;
  for (std::size_t t = 0; t < on.size(); ++t) {
    const auto& plan = on[t].first;
    EXPECT_TRUE(off[t].first.merged.empty());
    t_on += on[t].second.step_seconds;
    t_off += off[t].second.step_seconds;
    if (plan.merged.empty()) continue;
    ++merged_steps;
    // Each merged sample is whole in its owner's slot and exceeds a replica's share.
    double total = 0;
    for (const auto& rep : plan.replicas)
      for (const auto& mb : rep)
        for (const auto& s : mb.segments) total += sp::sliceFlops(cost, s.q_offset, s.length, Phase::Fwd);
    for (const auto& mg : plan.merged) {
      const auto& mb = plan.replicas[static_cast<std::size_t>(mg.group.front())][static_cast<std::size_t>(mg.slot)];
      ASSERT_EQ(mb.segments.size(), 1u);
      EXPECT_EQ(mb.segments[0].offset, 0);
      EXPECT_GT(sp::sliceFlops(cost, 0, mb.segments[0].length, Phase::Fwd), total / 4);
    }
  }
  EXPECT_GE(merged_steps, 2);
  // Its effect: the sample no longer holds one replica back (the simulator's step).
  EXPECT_LT(t_on, t_off);
}
