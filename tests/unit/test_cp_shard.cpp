// wlb-timeout: 120
// CP shard planners and KV communication plans: token ownership, balance, key ranges,
// KV-buffer layout (executor emulation in both comm modes), bytes, strategy selection.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"

using namespace wlb;
using namespace wlb::cp;

namespace {

model::CostModel testCost() {
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

MicroBatch makeMb(const std::vector<std::int64_t>& lens) {
  MicroBatch mb;
  DocId id = 100;
  for (auto l : lens) mb.segments.push_back(Segment{id++, 0, l, 0});
  return mb;
}

const std::vector<int> kCps = {1, 2, 3, 4, 8};

std::vector<std::vector<std::int64_t>> testMixes(int cp) {
  std::vector<std::vector<std::int64_t>> mixes;
  // Every single-document length 1..4cp+3, and all of them packed together.
  std::vector<std::int64_t> all;
  for (std::int64_t d = 1; d <= 4 * cp + 3; ++d) {
    mixes.push_back({d});
    all.push_back(d);
  }
  mixes.push_back(all);
  std::reverse(all.begin(), all.end());
  mixes.push_back(all);
  std::mt19937_64 rng(42 + static_cast<unsigned>(cp));
  for (int k = 0; k < 12; ++k) {
    std::uniform_int_distribution<int> n(1, 20);
    std::uniform_int_distribution<std::int64_t> len(1, k % 2 ? 40 : 900);
    std::vector<std::int64_t> v(static_cast<std::size_t>(n(rng)));
    for (auto& x : v) x = len(rng);
    mixes.push_back(v);
  }
  mixes.push_back({2000, 3, 5, 7, 300, 1});  // one long outlier plus short ones
  return mixes;
}

CpConfig cfgFor(const std::string& comm = "sharding_aware") {
  CpConfig c;
  c.comm = comm;
  c.capacity_factor = 1.25;
  return c;
}

}  // namespace

TEST(CpShard, NamesRoundTripAndRejectUnknown) {
  for (Strategy s : allStrategies()) EXPECT_EQ(parseStrategy(strategyName(s)), s);
  EXPECT_EQ(parseCommMode("allgather"), CommMode::AllGather);
  EXPECT_EQ(parseCommMode("sharding_aware"), CommMode::ShardingAware);
  EXPECT_THROW(parseStrategy("ring"), InputError);
  EXPECT_THROW(parseCommMode("p2p"), InputError);
  const auto cost = testCost();
  EXPECT_THROW(planShards(makeMb({4}), Strategy::PerDocument, 0, cost, cfgFor()), InputError);
}

TEST(CpShard, EveryStrategyValidOnAllMixes) {
  const auto cost = testCost();
  for (int cp : kCps)
    for (const auto& lens : testMixes(cp))
      for (Strategy s : allStrategies()) {
        const MicroBatch mb = makeMb(lens);
        const ShardPlan plan = planShards(mb, s, cp, cost, cfgFor());
        SCOPED_TRACE(std::string(strategyName(s)) + " cp=" + std::to_string(cp) +
                     " segs=" + std::to_string(lens.size()));
        ASSERT_NO_THROW(validatePlan(plan, mb));
        EXPECT_EQ(plan.requested, strategyName(s));
        // Each piece's key range is exactly its segment prefix.
        for (int r = 0; r < cp; ++r)
          for (const Piece& p : plan.ranks[r].pieces) {
            EXPECT_EQ(p.kv_len, p.q_offset + p.q_len);
            EXPECT_EQ(p.doc, mb.segments[p.segment].doc);
          }
      }
}

TEST(CpShard, TokenCountsEqualWithinOneForPerSequenceAndPerDocument) {
  const auto cost = testCost();
  for (int cp : kCps)
    for (const auto& lens : testMixes(cp))
      for (Strategy s : {Strategy::PerSequence, Strategy::PerDocument}) {
        const MicroBatch mb = makeMb(lens);
        const ShardPlan plan = planShards(mb, s, cp, cost, cfgFor());
        std::int64_t mn = plan.ranks[0].tokens, mx = mn, sum = 0;
        for (const auto& rs : plan.ranks) {
          mn = std::min(mn, rs.tokens);
          mx = std::max(mx, rs.tokens);
          sum += rs.tokens;
        }
        EXPECT_EQ(sum, mb.tokens());
        EXPECT_LE(mx - mn, 1) << strategyName(s) << " cp=" << cp;
        if (mb.tokens() % (2 * cp) == 0) { EXPECT_EQ(mx, mn) << strategyName(s) << " cp=" << cp; }
      }
}

TEST(CpShard, PerDocumentWorkEqualUpToRemainders) {
  const auto cost = testCost();
  for (int cp : kCps)
    for (const auto& lens : testMixes(cp)) {
      const MicroBatch mb = makeMb(lens);
      const ShardPlan plan = planShards(mb, Strategy::PerDocument, cp, cost, cfgFor());
      // Per segment: every rank holds 2e floor tokens plus 0..2 remainder tokens; the
      // query-key pairs agree exactly when the segment has no remainder, and differ by at
      // most the remainder tokens' keys otherwise.
      std::vector<std::int64_t> rem_total(cp, 0);
      for (std::size_t s = 0; s < lens.size(); ++s) {
        const std::int64_t d = lens[s], e = d / (2 * cp), R = d - 2 * cp * e;
        std::vector<double> pairs(cp, 0.0);
        std::vector<std::int64_t> toks(cp, 0);
        for (int r = 0; r < cp; ++r)
          for (const Piece& p : plan.ranks[r].pieces)
            if (p.segment == static_cast<std::int32_t>(s)) {
              pairs[r] += model::attnPairs(p.q_offset, p.q_len);
              toks[r] += p.q_len;
            }
        std::int64_t rsum = 0;
        for (int r = 0; r < cp; ++r) {
          const std::int64_t rem = toks[r] - 2 * e;
          EXPECT_TRUE(rem >= 0 && rem <= 2) << "d=" << d << " cp=" << cp;
          rem_total[r] += rem;
          rsum += rem;
        }
        EXPECT_EQ(rsum, R);
        const auto mm = std::minmax_element(pairs.begin(), pairs.end());
        if (R == 0) {
          EXPECT_DOUBLE_EQ(*mm.first, *mm.second) << "d=" << d << " cp=" << cp;
        } else {
          EXPECT_LE(*mm.second - *mm.first, 2.0 * static_cast<double>(d) * (1.0 + 2.0 * e) + 1e-9);
        }
      }
      const auto mm = std::minmax_element(rem_total.begin(), rem_total.end());
      EXPECT_LE(*mm.second - *mm.first, 1);  // one counter across segments
    }
}

TEST(CpShard, PerDocumentBalancedOnLargeMix) {
  const auto cost = testCost();
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> ln(6.0, 1.5);
  std::vector<std::int64_t> lens;
  std::int64_t total = 0;
  while (total < 60000) {
    const auto d = std::max<std::int64_t>(1, std::min<std::int64_t>(30000, static_cast<std::int64_t>(ln(rng))));
    lens.push_back(d);
    total += d;
  }
  for (int cp : {2, 4, 8}) {
    const MicroBatch mb = makeMb(lens);
    const ShardPlan pd = planShards(mb, Strategy::PerDocument, cp, cost, cfgFor());
    const ShardPlan ps = planShards(mb, Strategy::PerSequence, cp, cost, cfgFor());
    const auto mpd = computeMetrics(pd, planComm(pd, CommMode::AllGather, cost), cost);
    const auto mps = computeMetrics(ps, planComm(ps, CommMode::AllGather, cost), cost);
    EXPECT_LE(mpd.imbalance_attn, 1.01) << "cp=" << cp;
    EXPECT_GT(mps.imbalance_attn, mpd.imbalance_attn) << "cp=" << cp;
  }
}

TEST(CpShard, PerDocumentKeepsTwoContiguousPiecesPerRank) {
  const auto cost = testCost();
  for (int cp : {2, 3, 4, 8})
    for (std::int64_t d = 2 * cp; d <= 6 * cp + 5; ++d) {
      const MicroBatch mb = makeMb({d, d + 1, d + 3});
      const ShardPlan plan = planShards(mb, Strategy::PerDocument, cp, cost, cfgFor());
      for (int r = 0; r < cp; ++r) {
        std::map<std::int32_t, int> per_seg;
        for (const Piece& p : plan.ranks[r].pieces) ++per_seg[p.segment];
        for (const auto& kv : per_seg) EXPECT_LE(kv.second, 2) << "cp=" << cp << " d=" << d;
      }
      // Single document, R < C remainder tokens: rank r's first piece is r*e (+ earlier extras).
      const ShardPlan one = planShards(makeMb({d}), Strategy::PerDocument, cp, cost, cfgFor());
      const std::int64_t e = d / (2 * cp), R = d - 2 * cp * e;
      std::int64_t off = 0;
      for (int r = 0; r < cp; ++r) {
        EXPECT_EQ(one.ranks[r].pieces[0].q_offset, off);
        off += e + (r < R ? 1 : 0);
      }
    }
}

TEST(CpShard, PerSequenceBalancedForOneDocument) {
  const auto cost = testCost();
  for (int cp : kCps) {
    const MicroBatch mb = makeMb({64 * cp});
    const ShardPlan plan = planShards(mb, Strategy::PerSequence, cp, cost, cfgFor());
    const auto m = computeMetrics(plan, planComm(plan, CommMode::AllGather, cost), cost);
    EXPECT_NEAR(m.imbalance_attn, 1.0, 1e-12);
    // Rank r holds chunks r and 2C-1-r (rank C-1's two chunks are adjacent: one piece).
    for (int r = 0; r < cp; ++r) {
      ASSERT_EQ(plan.ranks[r].pieces.size(), r == cp - 1 ? 1u : 2u);
      EXPECT_EQ(plan.ranks[r].pieces[0].q_offset, 32 * r);
      if (r != cp - 1) { EXPECT_EQ(plan.ranks[r].pieces[1].q_offset, 32 * (2 * cp - 1 - r)); }
      EXPECT_EQ(plan.ranks[r].tokens, 64);
    }
  }
}

TEST(CpShard, LocalOrderAndInverseMapRoundTrip) {
  const auto cost = testCost();
  for (int cp : {2, 3, 8})
    for (Strategy s : allStrategies()) {
      const MicroBatch mb = makeMb({17, 5, 300, 1, 64, 2});
      const ShardPlan plan = planShards(mb, s, cp, cost, cfgFor());
      for (int r = 0; r < cp; ++r) {
        const auto pos = packedPositions(plan, r);
        ASSERT_EQ(static_cast<std::int64_t>(pos.size()), plan.ranks[r].tokens);
        for (std::size_t i = 0; i < pos.size(); ++i) {
          EXPECT_EQ(plan.owner[pos[i]], r);
          EXPECT_EQ(plan.local_index[pos[i]], static_cast<std::int64_t>(i));
          if (i > 0) {
            EXPECT_LT(pos[i - 1], pos[i]);  // local order = packed order
          }
        }
      }
    }
}

/// Emulate the executor: tokens carry their packed position; build every rank's KV buffer
/// in both modes with the header helpers and check every key a piece needs; then run the
/// backward with unit gradients and check each owner receives one contribution per rank
/// whose KV buffer holds the token.
TEST(CpShard, KvBufferLayoutBuildsAndReturnsGradients) {
  const auto cost = testCost();
  const std::int64_t W = 2;  // elements per token
  for (int cp : kCps)
    for (const auto& lens : testMixes(cp))
      for (Strategy s : allStrategies()) {
        const MicroBatch mb = makeMb(lens);
        const ShardPlan plan = planShards(mb, s, cp, cost, cfgFor());
        std::vector<std::vector<double>> local(cp);
        for (int r = 0; r < cp; ++r)
          for (auto p : packedPositions(plan, r)) {
            local[r].push_back(static_cast<double>(p));
            local[r].push_back(-static_cast<double>(p) - 0.5);
          }
        // Expected gradient count per packed token.
        std::vector<double> holders(static_cast<std::size_t>(plan.total_tokens), 0.0);
        for (int r = 0; r < cp; ++r)
          for (auto p : kvPackedPositions(plan, r)) holders[p] += 1.0;

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
              std::vector<double> msg(t.tokens * W);
              packRunsFromLocal(t, local[t.src].data(), msg.data(), W);
              unpackRunsToKv(t, msg.data(), kv[t.dst].data(), W);
            }
          }
          for (int r = 0; r < cp; ++r)
            for (const Piece& p : plan.ranks[r].pieces)
              for (std::int64_t i = 0; i < p.kv_len; ++i) {
                ASSERT_EQ(kv[r][(p.kv_begin + i) * W], static_cast<double>(p.seg_begin + i));
                ASSERT_EQ(kv[r][(p.kv_begin + i) * W + 1], -static_cast<double>(p.seg_begin + i) - 0.5);
              }
          // Backward with dkv = 1 everywhere.
          if (mode == CommMode::AllGather) {
            std::vector<double> sum(gathered.size(), 0.0);
            for (int r = 0; r < cp; ++r) {
              std::vector<double> dkv(kv[r].size(), 1.0), g(gathered.size(), 0.0);
              scatterKvGradToAllGather(plan, comm, r, dkv.data(), g.data(), W);
              for (std::size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
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
            for (std::size_t i = 0; i < pos.size(); ++i)
              ASSERT_EQ(dlocal[r][i * W], holders[pos[i]]) << commModeName(mode);
          }
          // allGatherKvIndex agrees with the run-based copy.
          for (int r = 0; r < cp; ++r) {
            const auto idx = allGatherKvIndex(plan, comm, r);
            const auto kvpos = kvPackedPositions(plan, r);
            for (std::size_t i = 0; i < idx.size(); ++i)
              ASSERT_EQ(gathered[idx[i] * W], static_cast<double>(kvpos[i]));
          }
          // The row maps the device kernels use (own runs, transfer messages) build the
          // same KV buffers: every slot once, with the token the plan puts there.
          for (int r = 0; r < cp; ++r) {
            const auto kvpos = kvPackedPositions(plan, r);
            std::vector<std::int64_t> filled(kvpos.size(), -1);
            const RowMap own = ownRunRows(plan, r);
            ASSERT_EQ(own.dst.size(), own.src.size());
            const auto pos = packedPositions(plan, r);
            for (std::size_t i = 0; i < own.dst.size(); ++i) {
              ASSERT_EQ(filled[own.dst[i]], -1);
              filled[own.dst[i]] = pos[own.src[i]];
            }
            if (mode == CommMode::ShardingAware)
              for (const Transfer& t : comm.transfers) {
                if (t.dst != r) continue;
                const auto rows = transferLocalRows(t), slots = transferKvSlots(t);
                ASSERT_EQ(rows.size(), static_cast<std::size_t>(t.tokens));
                ASSERT_EQ(slots.size(), rows.size());
                const auto src_pos = packedPositions(plan, t.src);
                for (std::size_t i = 0; i < rows.size(); ++i) {
                  ASSERT_EQ(filled[slots[i]], -1);
                  filled[slots[i]] = src_pos[rows[i]];
                }
              }
            if (mode == CommMode::ShardingAware || cp == 1) {
              for (std::size_t i = 0; i < kvpos.size(); ++i) {
                ASSERT_EQ(filled[i], kvpos[i]) << "slot " << i;
              }
            }
          }
        }
      }
}

TEST(CpShard, ShardingAwareBytesNeverExceedAllGather) {
  const auto cost = testCost();
  for (int cp : kCps)
    for (const auto& lens : testMixes(cp))
      for (Strategy s : allStrategies()) {
        const MicroBatch mb = makeMb(lens);
        const ShardPlan plan = planShards(mb, s, cp, cost, cfgFor());
        const CommPlan ag = planComm(plan, CommMode::AllGather, cost);
        const CommPlan sa = planComm(plan, CommMode::ShardingAware, cost);
        for (int r = 0; r < cp; ++r) {
          EXPECT_LE(sa.ranks[r].fwd_bytes_recv, ag.ranks[r].fwd_bytes_recv);
          EXPECT_LE(sa.ranks[r].fwd_bytes_sent, ag.ranks[r].fwd_bytes_sent);
          EXPECT_LE(sa.ranks[r].bwd_bytes_recv, ag.ranks[r].bwd_bytes_recv);
          EXPECT_LE(sa.ranks[r].bwd_bytes_sent, ag.ranks[r].bwd_bytes_sent);
          // A rank whose pieces are all whole segments receives nothing.
          const auto& ps = plan.ranks[r].pieces;
          if (std::all_of(ps.begin(), ps.end(), [](const Piece& p) { return p.whole; })) {
            EXPECT_EQ(sa.ranks[r].fwd_bytes_recv, 0.0);
          }
          for (const Piece& p : ps)
            if (p.whole) { EXPECT_TRUE(p.q_offset == 0 && p.q_len == p.seg_len); }
        }
        EXPECT_LE(sa.totalBytes(), ag.totalBytes());
        // Conservation: everything sent is received.
        double sent = 0, recv = 0;
        for (const auto& rc : sa.ranks) {
          sent += rc.fwd_bytes_sent;
          recv += rc.fwd_bytes_recv;
        }
        EXPECT_DOUBLE_EQ(sent, recv);
      }
}

TEST(CpShard, WholeDocumentMovesNoKvWhenEverythingFits) {
  const auto cost = testCost();
  CpConfig cfg = cfgFor();
  cfg.capacity_factor = 4.0;
  const MicroBatch mb = makeMb({100, 90, 80, 70, 60, 50, 40, 30, 20, 10});
  for (int cp : {2, 4}) {
    const ShardPlan plan = planShards(mb, Strategy::WholeDocument, cp, cost, cfg);
    EXPECT_EQ(plan.sharded_segments, 0);
    for (const auto& rs : plan.ranks)
      for (const Piece& p : rs.pieces) EXPECT_TRUE(p.whole);
    EXPECT_EQ(planComm(plan, CommMode::ShardingAware, cost).totalBytes(), 0.0);
    EXPECT_TRUE(planComm(plan, CommMode::ShardingAware, cost).transfers.empty());
  }
}

TEST(CpShard, KvRunsAreMaximal) {
  // Whole documents laid back to back on a rank are one run of its own tokens, not one per
  // document; no two consecutive runs of any plan continue each other.
  const auto cost = testCost();
  const ShardPlan whole = planShards(makeMb({5, 5, 5, 5}), Strategy::WholeDocument, 2, cost, cfgFor());
  for (const auto& rs : whole.ranks) EXPECT_EQ(rs.kv_runs.size(), 1u);
  for (auto st : allStrategies())
    for (int cp : {2, 3, 4}) {
      const ShardPlan plan = planShards(makeMb({700, 33, 5, 5, 1200, 9, 64}), st, cp, cost, cfgFor());
      for (const auto& rs : plan.ranks)
        for (std::size_t i = 1; i < rs.kv_runs.size(); ++i) {
          const KvRun& a = rs.kv_runs[i - 1];
          const KvRun& b = rs.kv_runs[i];
          EXPECT_FALSE(a.src == b.src && a.src_local_begin + a.len == b.src_local_begin &&
                       a.kv_begin + a.len == b.kv_begin)
              << strategyName(st) << " cp " << cp;
        }
    }
}

TEST(CpShard, WholeDocumentFallsBackForOversizedSegment) {
  const auto cost = testCost();
  const MicroBatch mb = makeMb({1000, 10, 10, 10});
  const ShardPlan plan = planShards(mb, Strategy::WholeDocument, 4, cost, cfgFor());
  ASSERT_NO_THROW(validatePlan(plan, mb));
  EXPECT_EQ(plan.sharded_segments, 1);
  // The long segment is spread over all ranks; the short ones stay whole.
  int holders = 0;
  for (const auto& rs : plan.ranks)
    for (const Piece& p : rs.pieces) {
      if (p.segment == 0) ++holders;
      else EXPECT_TRUE(p.whole);
    }
  EXPECT_GE(holders, 4);
}

TEST(CpShard, AdaptivePicksLowerAttentionLatency) {
  const auto cost = testCost();
  for (const auto& lens : std::vector<std::vector<std::int64_t>>{{8192}, {3000, 20, 20, 5000, 7}, {1, 2, 3}}) {
    const MicroBatch mb = makeMb(lens);
    for (int cp : {2, 4}) {
      const ShardPlan a = planShards(mb, Strategy::Adaptive, cp, cost, cfgFor());
      const ShardPlan ps = planShards(mb, Strategy::PerSequence, cp, cost, cfgFor());
      const ShardPlan pd = planShards(mb, Strategy::PerDocument, cp, cost, cfgFor());
      auto attn = [&](const ShardPlan& p) {
        return computeMetrics(p, planComm(p, CommMode::AllGather, cost), cost).max_attn_seconds;
      };
      EXPECT_EQ(a.requested, "adaptive");
      EXPECT_TRUE(a.strategy == "per_sequence" || a.strategy == "per_document");
      EXPECT_DOUBLE_EQ(attn(a), std::min(attn(ps), attn(pd)));
    }
  }
}

TEST(CpShard, HybridNoWorseThanWholeDocument) {
  const auto cost = testCost();
  for (int cp : {2, 4, 8})
    for (const auto& lens : testMixes(cp))
      for (const std::string comm : {"allgather", "sharding_aware"}) {
        const MicroBatch mb = makeMb(lens);
        const CpConfig cfg = cfgFor(comm);
        const CommMode mode = parseCommMode(comm);
        const ShardPlan h = planShards(mb, Strategy::Hybrid, cp, cost, cfg);
        const ShardPlan w = planShards(mb, Strategy::WholeDocument, cp, cost, cfg);
        const double lh = computeMetrics(h, planComm(h, mode, cost), cost).max_latency;
        const double lw = computeMetrics(w, planComm(w, mode, cost), cost).max_latency;
        EXPECT_LE(lh, lw * (1 + 1e-9)) << "cp=" << cp << " " << comm;
      }
}

TEST(CpShard, CpOneIsTrivial) {
  const auto cost = testCost();
  const MicroBatch mb = makeMb({5, 7, 9});
  for (Strategy s : allStrategies()) {
    const ShardPlan plan = planShards(mb, s, 1, cost, cfgFor());
    ASSERT_EQ(plan.ranks.size(), 1u);
    EXPECT_EQ(plan.ranks[0].tokens, 21);
    EXPECT_EQ(plan.ranks[0].kv_tokens, 21);
    EXPECT_EQ(planComm(plan, CommMode::AllGather, cost).totalBytes(), 0.0);
    EXPECT_EQ(planComm(plan, CommMode::ShardingAware, cost).totalBytes(), 0.0);
  }
}

TEST(CpShard, EmptyAndZeroLengthSegments) {
  const auto cost = testCost();
  for (Strategy s : allStrategies()) {
    const MicroBatch empty;
    const ShardPlan p0 = planShards(empty, s, 4, cost, cfgFor());
    EXPECT_NO_THROW(validatePlan(p0, empty));
    // nothing to exchange, nothing to wait for, in either mode
    for (CommMode c : {CommMode::AllGather, CommMode::ShardingAware})
      for (const RankComm& rc : planComm(p0, c, cost).ranks) EXPECT_EQ(rc.fwd_seconds + rc.bwd_seconds, 0.0);
    const MicroBatch mb = makeMb({0, 9, 0, 3});
    const ShardPlan p1 = planShards(mb, s, 4, cost, cfgFor());
    EXPECT_NO_THROW(validatePlan(p1, mb));
  }
}

TEST(CpShard, JsonHasExecutorFields) {
  const auto cost = testCost();
  const MicroBatch mb = makeMb({33, 4});
  const ShardPlan plan = planShards(mb, Strategy::PerDocument, 2, cost, cfgFor());
  const CommPlan comm = planComm(plan, CommMode::ShardingAware, cost);
  const auto j = toJson(plan);
  EXPECT_EQ(j["strategy"], "per_document");
  EXPECT_EQ(j["ranks"].size(), 2u);
  EXPECT_EQ(j["ranks"][0]["pieces"][0]["kv_len"],
            plan.ranks[0].pieces[0].kv_len);
  const auto jc = toJson(comm);
  EXPECT_EQ(jc["mode"], "sharding_aware");
  EXPECT_EQ(jc["transfers"].size(), comm.transfers.size());
  const auto jm = toJson(computeMetrics(plan, comm, cost));
  EXPECT_EQ(jm["ranks"].size(), 2u);
  EXPECT_GE(jm["imbalance_attn"].get<double>(), 1.0);
}
