// wlb-timeout: 180
// Hybrid CP sharding with subgroups (docs/cp.md "hybrid"): a long segment may be
// per-document sharded over a subgroup of g <= C ranks. Every invariant of the other
// strategies must hold for such plans (every token once, key ranges = segment prefixes,
// KV buffer built and gradients returned by an emulated executor in both comm modes,
// sharding_aware bytes <= allgather bytes), the subgroup split must be the per-document
// split over g ranks, and hybrid must never predict worse than whole_document or
// per_document.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "core/error.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"

using namespace wlb;
using namespace wlb::cp;

namespace {

/// Small analytic model (as in test_cp_shard.cpp).
model::CostModel smallCost() {
  model::ModelDims d;
  d.hidden = 512;
  d.heads = 8;
  d.kv_heads = 8;
  d.head_dim = 64;
  d.ffn = 1408;
  d.layers = 1;
  d.vocab = 32000;
  d.dtype_bytes = 2;
  return model::CostModel(d, model::HardwareProfile::analytic(), 1);
}

/// Llama-3-8B-like layer at TP 8 (the long-context preset's model) on the analytic curve
/// scaled to H100-like throughput, CP links of `gbps`: communication is a visible share of
/// the latency.
model::CostModel llamaCost(double gbps) {
  model::ModelDims d;
  d.hidden = 4096;
  d.heads = 32;
  d.kv_heads = 8;
  d.head_dim = 128;
  d.ffn = 14336;
  d.layers = 1;
  d.vocab = 128256;
  d.dtype_bytes = 2;
  model::HardwareProfile hw = model::HardwareProfile::analytic();
  hw.peak_gflops = 900e3;
  hw.linear_gflops = 600e3;
  hw.cp_bandwidth_gbps = gbps;
  return model::CostModel(d, hw, 8);
}

MicroBatch makeMb(const std::vector<std::int64_t>& lens) {
  MicroBatch mb;
  DocId id = 500;
  for (auto l : lens) mb.segments.push_back(Segment{id++, 0, l, 0});
  return mb;
}

CpConfig cfgFor(const std::string& comm) {
  CpConfig c;
  c.strategy = "hybrid";
  c.comm = comm;
  c.capacity_factor = 1.25;
  return c;
}

/// Mixes where subgroups matter: a few long documents plus many short ones, the shapes of
/// the long-context preset (scaled down), plus the small mixes of test_cp_shard.cpp.
std::vector<std::vector<std::int64_t>> hybridMixes(int cp, std::int64_t scale) {
  std::vector<std::vector<std::int64_t>> mixes;
  std::mt19937_64 rng(1000 + static_cast<unsigned>(cp));
  for (int k = 0; k < 10; ++k) {
    std::vector<std::int64_t> v;
    std::uniform_int_distribution<int> nlong(1, 4);
    std::uniform_int_distribution<std::int64_t> llong(scale / 4, 2 * scale);
    std::lognormal_distribution<double> ln(std::log(static_cast<double>(scale) / 40), 1.0);
    for (int i = nlong(rng); i > 0; --i) v.push_back(llong(rng));
    std::int64_t total = 0;
    for (auto x : v) total += x;
    while (total < 3 * scale) {
      const auto d = std::max<std::int64_t>(1, static_cast<std::int64_t>(ln(rng)));
      v.push_back(d);
      total += d;
    }
    std::shuffle(v.begin(), v.end(), rng);
    mixes.push_back(v);
  }
  mixes.push_back({2 * scale, scale, scale / 2, 7, 3, 1});
  mixes.push_back({scale, scale, scale, scale});  // equal long documents
  mixes.push_back({scale + 1, scale / 3 + 5, scale / 7 + 11, 2 * cp + 1, 2 * cp - 1});
  // Every length 1..4cp+3 (whole or remainder-only subgroup splits).
  std::vector<std::int64_t> all;
  for (std::int64_t d = 1; d <= 4 * cp + 3; ++d) all.push_back(d);
  mixes.push_back(all);
  mixes.push_back({0, scale, 0, 5});
  return mixes;
}

/// Ranks holding queries of each segment.
std::vector<std::set<int>> holders(const ShardPlan& plan) {
  std::vector<std::set<int>> h(plan.seg_len.size());
  for (int r = 0; r < plan.cp; ++r)
    for (const Piece& p : plan.ranks[r].pieces) h[p.segment].insert(r);
  return h;
}

/// Emulated executor (both comm modes, header helpers only): every KV slot of every piece
/// holds its packed token, and the backward returns one unit gradient per KV buffer that
/// holds the token.
void checkExecutorLayout(const ShardPlan& plan, const model::CostModel& cost) {
  const int cp = plan.cp;
  const std::int64_t W = 2;
  std::vector<std::vector<double>> local(cp);
  for (int r = 0; r < cp; ++r)
    for (auto p : packedPositions(plan, r)) {
      local[r].push_back(static_cast<double>(p));
      local[r].push_back(-static_cast<double>(p) - 0.25);
    }
  std::vector<double> held(static_cast<std::size_t>(plan.total_tokens), 0.0);
  for (int r = 0; r < cp; ++r)
    for (auto p : kvPackedPositions(plan, r)) held[p] += 1.0;
  for (CommMode mode : {CommMode::AllGather, CommMode::ShardingAware}) {
    const CommPlan comm = planComm(plan, mode, cost);
    std::vector<double> gathered;
    for (int r = 0; r < cp; ++r) gathered.insert(gathered.end(), local[r].begin(), local[r].end());
    std::vector<std::vector<double>> kv(cp), dlocal(cp);
    for (int r = 0; r < cp; ++r) {
      kv[r].assign(plan.ranks[r].kv_tokens * W, 1e30);
      dlocal[r].assign(plan.ranks[r].tokens * W, 0.0);
    }
    if (mode == CommMode::AllGather) {
      for (int r = 0; r < cp; ++r)
        gatherKvFromAllGather(plan, comm, r, gathered.data(), kv[r].data(), W);
    } else {
      for (int r = 0; r < cp; ++r) copyLocalRuns(plan, r, local[r].data(), kv[r].data(), W);
      for (const Transfer& t : comm.transfers) {
        ASSERT_NE(t.src, t.dst);
        std::vector<double> msg(t.tokens * W);
        packRunsFromLocal(t, local[t.src].data(), msg.data(), W);
        unpackRunsToKv(t, msg.data(), kv[t.dst].data(), W);
      }
    }
    for (int r = 0; r < cp; ++r)
      for (const Piece& p : plan.ranks[r].pieces)
        for (std::int64_t i = 0; i < p.kv_len; ++i) {
          ASSERT_EQ(kv[r][(p.kv_begin + i) * W], static_cast<double>(p.seg_begin + i));
          ASSERT_EQ(kv[r][(p.kv_begin + i) * W + 1], -static_cast<double>(p.seg_begin + i) - 0.25);
        }
    if (mode == CommMode::AllGather) {
      std::vector<double> sum(gathered.size(), 0.0);
      for (int r = 0; r < cp; ++r) {
        std::vector<double> dkv(kv[r].size(), 1.0);
        scatterKvGradToAllGather(plan, comm, r, dkv.data(), sum.data(), W);
      }
      for (int r = 0; r < cp; ++r)
        for (std::int64_t i = 0; i < comm.gather_counts[r] * W; ++i)
          dlocal[r][i] = sum[comm.gather_displs[r] * W + i];
    } else {
      for (int r = 0; r < cp; ++r) {
        std::vector<double> dkv(kv[r].size(), 1.0);
        accumulateLocalRuns(plan, r, dkv.data(), dlocal[r].data(), W);
      }
      for (const Transfer& t : comm.transfers) {
        std::vector<double> dkv(kv[t.dst].size(), 1.0), msg(t.tokens * W);
        packRunsFromKv(t, dkv.data(), msg.data(), W);
        accumulateRunsToLocal(t, msg.data(), dlocal[t.src].data(), W);
      }
    }
    for (int r = 0; r < cp; ++r) {
      const auto pos = packedPositions(plan, r);
      for (std::size_t i = 0; i < pos.size(); ++i) {
        ASSERT_EQ(dlocal[r][i * W], held[pos[i]]) << commModeName(mode);
        ASSERT_EQ(dlocal[r][i * W + 1], held[pos[i]]) << commModeName(mode);
      }
    }
  }
}

double latencyOf(const ShardPlan& p, CommMode mode, const model::CostModel& cost) {
  return computeMetrics(p, planComm(p, mode, cost), cost).max_latency;
}

}  // namespace

TEST(CpHybrid, SubgroupPlansKeepEveryInvariant) {
  const std::vector<std::pair<const char*, model::CostModel>> costs = {
      {"small", smallCost()}, {"llama-45GBps", llamaCost(45)}, {"llama-2GBps", llamaCost(2)}};
  int subgroup_segments = 0;
  for (const auto& [name, cost] : costs)
    for (int cp : {2, 3, 4, 8})
      for (const auto& lens : hybridMixes(cp, 4096))
        for (const std::string comm : {"allgather", "sharding_aware"}) {
          const MicroBatch mb = makeMb(lens);
          const ShardPlan plan = planShards(mb, Strategy::Hybrid, cp, cost, cfgFor(comm));
          SCOPED_TRACE(std::string(name) + " cp=" + std::to_string(cp) + " " + comm +
                       " segs=" + std::to_string(lens.size()));
          ASSERT_NO_THROW(validatePlan(plan, mb));  // every token once, prefixes, runs
          EXPECT_EQ(plan.strategy, "hybrid");
          std::int64_t sum = 0;
          for (const RankShard& rs : plan.ranks) {
            sum += rs.tokens;
            for (const Piece& p : rs.pieces) EXPECT_EQ(p.kv_len, p.q_offset + p.q_len);
          }
          EXPECT_EQ(sum, mb.tokens());
          const auto h = holders(plan);
          for (const auto& s : h) subgroup_segments += (s.size() > 1 && static_cast<int>(s.size()) < cp);
          checkExecutorLayout(plan, cost);
          const CommPlan ag = planComm(plan, CommMode::AllGather, cost);
          const CommPlan sa = planComm(plan, CommMode::ShardingAware, cost);
          double sent = 0, recv = 0;
          for (int r = 0; r < cp; ++r) {
            EXPECT_LE(sa.ranks[r].fwd_bytes_recv, ag.ranks[r].fwd_bytes_recv);
            EXPECT_LE(sa.ranks[r].fwd_bytes_sent, ag.ranks[r].fwd_bytes_sent);
            EXPECT_LE(sa.ranks[r].bwd_bytes_recv, ag.ranks[r].bwd_bytes_recv);
            EXPECT_LE(sa.ranks[r].bwd_bytes_sent, ag.ranks[r].bwd_bytes_sent);
            sent += sa.ranks[r].fwd_bytes_sent;
            recv += sa.ranks[r].fwd_bytes_recv;
          }
          EXPECT_DOUBLE_EQ(sent, recv);
          EXPECT_LE(sa.totalBytes(), ag.totalBytes());
          // Allgather moves all KV to all ranks: (C-1)·T tokens each way.
          EXPECT_NEAR(ag.totalBytes(), 2.0 * cost.kvBytes((cp - 1) * mb.tokens()),
                      1e-9 * (1.0 + ag.totalBytes()));
        }
  // The mixes are built so that subgroups are chosen somewhere.
  EXPECT_GT(subgroup_segments, 0);
}

/// A segment held by g ranks is the per-document split over those g ranks: holders in
/// ascending rank order h_0 < ... < h_{g-1} hold, in segment order, pieces of
/// h_0, h_1, ..., h_{g-1} (pieces g-1 and g merged), h_{g-2}, ..., h_0; each holder has
/// 2e + {0, 1, 2} tokens (e = floor(d / 2g)); ranks outside the group have no KV of it;
/// its sharding-aware forward bytes are exactly the prefixes the holders need.
TEST(CpHybrid, SubgroupSplitIsPerDocumentOverTheGroup) {
  const auto cost = llamaCost(45);
  int checked = 0;
  for (int cp : {3, 4, 8})
    for (const auto& lens : hybridMixes(cp, 4096)) {
      const MicroBatch mb = makeMb(lens);
      const ShardPlan plan = planShards(mb, Strategy::Hybrid, cp, cost, cfgFor("sharding_aware"));
      const auto h = holders(plan);
      for (std::size_t s = 0; s < h.size(); ++s) {
        const int g = static_cast<int>(h[s].size());
        if (g < 2) continue;
        const std::int64_t d = plan.seg_len[s], e = d / (2 * g);
        std::vector<std::pair<std::int64_t, int>> order;  // (q_offset, rank)
        std::map<int, std::int64_t> toks;
        std::map<int, int> npieces;
        for (int r = 0; r < cp; ++r) {
          bool has_block = false;
          for (const KvBlock& b : plan.ranks[r].kv_blocks) has_block |= b.segment == static_cast<std::int32_t>(s);
          EXPECT_EQ(has_block, h[s].count(r) == 1) << "KV block only on holders";
          for (const Piece& p : plan.ranks[r].pieces)
            if (p.segment == static_cast<std::int32_t>(s)) {
              order.push_back({p.q_offset, r});
              toks[r] += p.q_len;
              ++npieces[r];
              EXPECT_FALSE(p.whole);
            }
        }
        std::int64_t rem = 0;
        for (const auto& [r, t] : toks) {
          EXPECT_GE(t, 2 * e);
          EXPECT_LE(t, 2 * e + 2);
          EXPECT_LE(npieces[r], 2);
          rem += t - 2 * e;
        }
        EXPECT_EQ(rem, d - 2 * g * e);
        if (e > 0) {
          std::sort(order.begin(), order.end());
          const std::vector<int> hs(h[s].begin(), h[s].end());
          std::vector<int> expect;
          for (int i = 0; i < g; ++i) expect.push_back(hs[i]);
          for (int i = g - 2; i >= 0; --i) expect.push_back(hs[i]);
          ASSERT_EQ(order.size(), expect.size());
          for (std::size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i].second, expect[i]);
          ++checked;
        }
      }
    }
  EXPECT_GT(checked, 0);
}

TEST(CpHybrid, NeverPredictsWorseThanWholeDocumentOrPerDocument) {
  const std::vector<std::pair<const char*, model::CostModel>> costs = {
      {"small", smallCost()}, {"llama-45GBps", llamaCost(45)}, {"llama-2GBps", llamaCost(2)}};
  for (const auto& [name, cost] : costs)
    for (int cp : {2, 3, 4, 8})
      for (const auto& lens : hybridMixes(cp, 4096))
        for (const std::string comm : {"allgather", "sharding_aware"}) {
          const MicroBatch mb = makeMb(lens);
          const CpConfig cfg = cfgFor(comm);
          const CommMode mode = parseCommMode(comm);
          const ShardPlan h = planShards(mb, Strategy::Hybrid, cp, cost, cfg);
          const ShardPlan w = planShards(mb, Strategy::WholeDocument, cp, cost, cfg);
          const ShardPlan d = planShards(mb, Strategy::PerDocument, cp, cost, cfg);
          const double lh = latencyOf(h, mode, cost), lw = latencyOf(w, mode, cost),
                       ld = latencyOf(d, mode, cost);
          EXPECT_LE(lh, lw * (1 + 1e-12)) << name << " cp=" << cp << " " << comm;
          EXPECT_LE(lh, ld * (1 + 1e-12)) << name << " cp=" << cp << " " << comm;
          // Tie rule: any of these two at or below hybrid's latency is inside hybrid's
          // tolerance window, so hybrid moves at most its bytes.
          const double bh = planComm(h, mode, cost).totalBytes();
          for (const ShardPlan* o : {&w, &d})
            if (latencyOf(*o, mode, cost) <= lh) {
              EXPECT_LE(bh, planComm(*o, mode, cost).totalBytes() * (1 + 1e-9))
                  << name << " cp=" << cp << " " << comm;
            }
        }
}

/// Long documents that whole-document assignment cannot place: subgroups move far less KV
/// than sharding them over all C ranks (which moves 3/4 of all-gather's bytes), at no
/// worse predicted latency than per_document.
TEST(CpHybrid, SubgroupsCutBytesOnLongDocuments) {
  const auto cost = llamaCost(45);
  const int cp = 8;
  // Two long documents of ~3 and ~2.5 ranks' worth of tokens plus short ones.
  std::vector<std::int64_t> lens = {24000, 20000};
  for (int i = 0; i < 40; ++i) lens.push_back(500 + 37 * i);
  const MicroBatch mb = makeMb(lens);
  const ShardPlan h = planShards(mb, Strategy::Hybrid, cp, cost, cfgFor("sharding_aware"));
  const ShardPlan d = planShards(mb, Strategy::PerDocument, cp, cost, cfgFor("sharding_aware"));
  ASSERT_NO_THROW(validatePlan(h, mb));
  const auto hh = holders(h);
  EXPECT_GT(hh[0].size(), 1u);
  EXPECT_LT(hh[0].size(), static_cast<std::size_t>(cp));
  const double ag = planComm(h, CommMode::AllGather, cost).totalBytes();
  const double sa = planComm(h, CommMode::ShardingAware, cost).totalBytes();
  EXPECT_LE(sa, 0.5 * ag);
  EXPECT_LE(latencyOf(h, CommMode::ShardingAware, cost),
            latencyOf(d, CommMode::AllGather, cost));
}

/// The search's costing (planCost) agrees exactly with the full plan's metrics:
/// computeMetrics(planFromRanges, planComm) on random tilings — pieces of one segment on
/// one rank apart or adjacent (merged), slices with keys before them, empty segments,
/// C above 64 (a second word of sender bits) — and on every strategy's plans.
TEST(CpHybrid, PlanCostEqualsTheMetricsOfTheFullPlan) {
  std::mt19937_64 rng(77);
  for (const model::CostModel& cost : {smallCost(), llamaCost(45), llamaCost(2)}) {
    for (int cp : {1, 2, 3, 5, 8, 64, 70}) {
      for (int trial = 0; trial < 12; ++trial) {
        MicroBatch mb;
        std::uniform_int_distribution<int> nseg(1, 12);
        std::uniform_int_distribution<std::int64_t> len(0, 3000), prefix(0, 4000);
        const int n = nseg(rng);
        for (int s = 0; s < n; ++s) {
          Segment seg;
          seg.doc = static_cast<DocId>(900 + s);
          seg.offset = seg.q_offset = trial % 3 == 0 ? prefix(rng) : 0;  // a slice: keys before it
          seg.length = len(rng);
          mb.segments.push_back(seg);
        }
        std::vector<QueryRange> ranges;
        std::uniform_int_distribution<int> rank(0, cp - 1);
        for (int s = 0; s < n; ++s) {
          const std::int64_t d = mb.segments[s].length;
          std::uniform_int_distribution<int> cuts(0, static_cast<int>(std::min<std::int64_t>(d, 3 * cp)));
          std::set<std::int64_t> at = {0, d};
          for (int c = cuts(rng); c > 0; --c) at.insert(std::uniform_int_distribution<std::int64_t>(0, d)(rng));
          for (auto it = at.begin(); std::next(it) != at.end(); ++it)
            if (*std::next(it) > *it) ranges.push_back({rank(rng), s, *it, *std::next(it) - *it});
        }
        for (CommMode mode : {CommMode::AllGather, CommMode::ShardingAware}) {
          const ShardPlan plan = planFromRanges(mb, ranges, cp, "random");
          const ShardMetrics m = computeMetrics(plan, planComm(plan, mode, cost), cost);
          const PlanCost pc = planCost(mb, ranges, cp, mode, cost);
          EXPECT_EQ(pc.max_latency, m.max_latency) << "cp " << cp << " trial " << trial;
          EXPECT_EQ(pc.kv_bytes_total, m.kv_bytes_total) << "cp " << cp << " trial " << trial;
          for (Strategy s : allStrategies()) {
            const ShardPlan sp = planShards(mb, s, cp, cost, cfgFor(commModeName(mode)));
            std::vector<QueryRange> pieces;
            for (int r = 0; r < cp; ++r)
              for (const Piece& p : sp.ranks[r].pieces) pieces.push_back({r, p.segment, p.q_offset, p.q_len});
            const ShardMetrics sm = computeMetrics(sp, planComm(sp, mode, cost), cost);
            const PlanCost spc = planCost(mb, pieces, cp, mode, cost);
            EXPECT_EQ(spc.max_latency, sm.max_latency) << strategyName(s) << " cp " << cp;
            EXPECT_EQ(spc.kv_bytes_total, sm.kv_bytes_total) << strategyName(s) << " cp " << cp;
          }
        }
      }
    }
  }
}

/// planCost checks its ranges as planFromRanges does: a rank outside [0, C) or a token on
/// no rank is an InputError, not a write out of bounds.
TEST(CpHybrid, PlanCostRefusesRangesThatDoNotTile) {
  const auto cost = smallCost();
  const MicroBatch mb = makeMb({100, 50});
  const std::vector<QueryRange> ok = {{0, 0, 0, 60}, {1, 0, 60, 40}, {1, 1, 0, 50}};
  EXPECT_NO_THROW(planCost(mb, ok, 2, CommMode::ShardingAware, cost));
  std::vector<QueryRange> bad_rank = ok;
  bad_rank[1].rank = 2;
  EXPECT_THROW(planCost(mb, bad_rank, 2, CommMode::ShardingAware, cost), InputError);
  std::vector<QueryRange> gap = ok;
  gap[1].q_offset = 61;
  gap[1].q_len = 39;
  EXPECT_THROW(planCost(mb, gap, 2, CommMode::AllGather, cost), InputError);
}
