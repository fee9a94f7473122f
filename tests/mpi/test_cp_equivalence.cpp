// wlb-mpi-ranks: 1 2 3 4
// wlb-timeout: 180
// Distributed CP attention equals single-rank attention: for every sharding strategy and
// both KV communication modes, on random document mixes (documents shorter than 2*CP,
// lengths not divisible by 2*CP, ranks without tokens), O, dQ, dK and dV of all CP ranks
// gathered back to packed order match the single-rank kernels (FP32, max abs err <= 1e-4).
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attention/attention.hpp"
#include "core/deck.hpp"
#include "core/types.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"
#include "mpi_world.hpp"
#include "runtime/distributed_attention.hpp"
#include "runtime/pool.hpp"
#include "trace/clock_sync.hpp"
#include "trace/recorder.hpp"

using namespace wlb;
using namespace wlb::cp;
using wlb::runtime::DistAttentionOptions;
using wlb::runtime::DistributedAttention;
using wlb::runtime::DistViews;
using wlb::runtime::gatherToPacked;
using ES = Kokkos::DefaultExecutionSpace;
using V3 = DistViews::View3;
using V2 = DistViews::View2;

namespace {

constexpr int kHeads = 4, kKvHeads = 2, kHeadDim = 32;

using wlb::test::worldRank;
using wlb::test::worldSize;

model::CostModel testCost() {
  model::ModelDims d;
  d.hidden = kHeads * kHeadDim;
  d.heads = kHeads;
  d.kv_heads = kKvHeads;
  d.head_dim = kHeadDim;
  d.ffn = 4 * d.hidden;
  d.layers = 1;
  d.vocab = 1000;
  d.dtype_bytes = 4;
  return model::CostModel(d, model::HardwareProfile::analytic(), 1);
}

MicroBatch makeMb(const std::vector<std::int64_t>& lens) {
  MicroBatch mb;
  DocId id = 10;
  for (auto l : lens) {
    const std::int64_t offset = (id % 3 == 0) ? 7 : 0;  // some segments are document tails
    mb.segments.push_back(Segment{id++, offset, l, 0});
  }
  return mb;
}

// Document mixes; identical on every rank (fixed seeds).
std::vector<std::vector<std::int64_t>> mixes(int cp) {
  std::vector<std::vector<std::int64_t>> out;
  out.push_back({1});        // fewer tokens than ranks
  out.push_back({3, 1, 2});  // every document shorter than 2*CP
  out.push_back({2 * cp + 1, 1, 4 * cp - 1, 5});
  out.push_back({257});  // one long document, odd length
  std::mt19937_64 rng(20260 + static_cast<unsigned>(cp));
  for (int k = 0; k < 4; ++k) {
    std::uniform_int_distribution<int> n(2, 9);
    std::uniform_int_distribution<std::int64_t> len(1, k % 2 ? 2 * cp + 3 : 180);
    std::vector<std::int64_t> v(static_cast<std::size_t>(n(rng)));
    for (auto& x : v) x = len(rng);
    if (k == 2) v.push_back(301);  // a long outlier among short ones
    out.push_back(v);
  }
  return out;
}

std::vector<float> randomVec(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

V3 toView3(const std::vector<float>& x, std::int64_t t, int h, int d, const char* name) {
  V3 v(std::string(name), t, h, d);
  auto hv = Kokkos::create_mirror_view(v);
  std::copy(x.begin(), x.end(), hv.data());
  Kokkos::deep_copy(v, hv);
  return v;
}
template <class V>
std::vector<float> toVec(const V& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.size());
}

// Rows of `packed` ([T][width]) held by `rank`, in local order.
std::vector<float> localRows(const ShardPlan& plan, int rank, const std::vector<float>& packed, std::int64_t width) {
  std::vector<float> out;
  for (std::int64_t p : packedPositions(plan, rank))
    out.insert(out.end(), packed.begin() + p * width, packed.begin() + (p + 1) * width);
  return out;
}

double maxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max(m, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return m;
}

struct Reference {
  std::vector<float> o, dq, dk, dv;
};

Reference singleRank(const MicroBatch& mb, const std::vector<float>& q, const std::vector<float>& k,
                     const std::vector<float>& v, const std::vector<float>& dO) {
  const std::int64_t T = mb.tokens();
  std::vector<std::int64_t> lens;
  for (const auto& s : mb.segments) lens.push_back(s.length);
  const auto batch = attention::VarlenBatch::fromDocLengths(lens);
  ES space;
  V3 vq = toView3(q, T, kHeads, kHeadDim, "q"), vk = toView3(k, T, kKvHeads, kHeadDim, "k"),
     vv = toView3(v, T, kKvHeads, kHeadDim, "v"), vdo = toView3(dO, T, kHeads, kHeadDim, "dO");
  V3 o("o", T, kHeads, kHeadDim), dq("dq", T, kHeads, kHeadDim), dk("dk", T, kKvHeads, kHeadDim),
      dv("dv", T, kKvHeads, kHeadDim);
  V2 lse("lse", T, kHeads);
  attention::forward<ES>(space, vq, vk, vv, batch, o, lse);
  attention::backward<ES>(space, vq, vk, vv, o, lse, vdo, batch, dq, dk, dv);
  return {toVec(o), toVec(dq), toVec(dk), toVec(dv)};
}

void checkOne(const MicroBatch& mb, Strategy strategy, CommMode mode, MPI_Comm comm, unsigned seed,
              trace::Recorder* rec = nullptr, runtime::BufferPool* pool = nullptr) {
  int cp = 1, rank = 0;
  MPI_Comm_size(comm, &cp);
  MPI_Comm_rank(comm, &rank);
  const auto cost = testCost();
  CpConfig cfg;
  cfg.comm = commModeName(mode);
  const ShardPlan plan = planShards(mb, strategy, cp, cost, cfg);
  validatePlan(plan, mb);
  const CommPlan cpl = planComm(plan, mode, cost);

  const std::int64_t T = mb.tokens();
  const std::int64_t wq = kHeads * kHeadDim, wk = kKvHeads * kHeadDim;
  const auto q = randomVec(static_cast<std::size_t>(T * wq), seed + 1);
  const auto k = randomVec(static_cast<std::size_t>(T * wk), seed + 2);
  const auto v = randomVec(static_cast<std::size_t>(T * wk), seed + 3);
  const auto dO = randomVec(static_cast<std::size_t>(T * wq), seed + 4);
  const Reference ref = singleRank(mb, q, k, v, dO);

  const std::int64_t n = plan.ranks[rank].tokens;
  ES space;
  V3 lq = toView3(localRows(plan, rank, q, wq), n, kHeads, kHeadDim, "lq");
  V3 lk = toView3(localRows(plan, rank, k, wk), n, kKvHeads, kHeadDim, "lk");
  V3 lv = toView3(localRows(plan, rank, v, wk), n, kKvHeads, kHeadDim, "lv");
  V3 ldo = toView3(localRows(plan, rank, dO, wq), n, kHeads, kHeadDim, "ldo");
  V3 o("o", n, kHeads, kHeadDim), dq("dq", n, kHeads, kHeadDim), dk("dk", n, kKvHeads, kHeadDim),
      dv("dv", n, kKvHeads, kHeadDim);
  V2 lse("lse", n, kHeads);
  // Garbage in the outputs must not leak through (dq/dk/dv are overwritten).
  Kokkos::deep_copy(dq, 7.0f);
  Kokkos::deep_copy(dk, 7.0f);
  Kokkos::deep_copy(dv, 7.0f);

  DistAttentionOptions opt;
  opt.cost = &cost;
  opt.recorder = rec;
  opt.pool = pool;
  DistributedAttention da(plan, cpl, comm, kHeads, kKvHeads, kHeadDim, opt);
  da.forward(space, lq, lk, lv, o, lse);
  da.backward(space, lq, o, lse, ldo, dq, dk, dv);

  const auto go = gatherToPacked(plan, cpl, comm, toVec(o).data(), wq);
  const auto gdq = gatherToPacked(plan, cpl, comm, toVec(dq).data(), wq);
  const auto gdk = gatherToPacked(plan, cpl, comm, toVec(dk).data(), wk);
  const auto gdv = gatherToPacked(plan, cpl, comm, toVec(dv).data(), wk);
  std::string what = std::string(strategyName(strategy)) + "/" + commModeName(mode) + " cp=" + std::to_string(cp) +
                     " applied=" + plan.strategy + " T=" + std::to_string(T) +
                     " segments=" + std::to_string(mb.segments.size());
  EXPECT_LE(maxAbsDiff(go, ref.o), 1e-4) << "O " << what;
  EXPECT_LE(maxAbsDiff(gdq, ref.dq), 1e-4) << "dQ " << what;
  EXPECT_LE(maxAbsDiff(gdk, ref.dk), 1e-4) << "dK " << what;
  EXPECT_LE(maxAbsDiff(gdv, ref.dv), 1e-4) << "dV " << what;
}

}  // namespace

TEST(CpEquivalence, EveryStrategyAndCommModeMatchesSingleRank) {
  const int cp = worldSize();
  unsigned seed = 1;
  for (const auto& lens : mixes(cp)) {
    const MicroBatch mb = makeMb(lens);
    for (Strategy s : allStrategies())
      for (CommMode m : {CommMode::AllGather, CommMode::ShardingAware}) checkOne(mb, s, m, MPI_COMM_WORLD, seed += 10);
  }
}

// Buffers from an activation pool: a second micro-batch of the same plan (other values)
// allocates nothing and still matches one rank, so a reused block's old contents (the
// KV-buffer gradient and the gathered dK/dV are accumulated into) never leak through.
TEST(CpEquivalence, PoolBuffersAreReusedAndStillMatchSingleRank) {
  const MicroBatch mb = makeMb({5, 90, 3, 41, 120});
  for (Strategy s : {Strategy::PerSequence, Strategy::PerDocument})
    for (CommMode m : {CommMode::AllGather, CommMode::ShardingAware}) {
      ES space;
      runtime::BufferPool pool(space);
      checkOne(mb, s, m, MPI_COMM_WORLD, 300, nullptr, &pool);
      const std::int64_t first = pool.misses();
      EXPECT_GT(first, 0);
      checkOne(mb, s, m, MPI_COMM_WORLD, 400, nullptr, &pool);
      EXPECT_EQ(pool.misses(), first) << strategyName(s) << "/" << commModeName(m);
      EXPECT_GT(pool.hits(), 0);
    }
}

// A CP group that is a sub-communicator (cp=2 groups side by side, each with its own
// micro-batch), as in a cp x dp mesh.
TEST(CpEquivalence, SubCommunicatorGroups) {
  const int n = worldSize(), r = worldRank();
  if (n < 2 || n % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  MPI_Comm sub;
  MPI_Comm_split(MPI_COMM_WORLD, r / 2, r, &sub);
  const MicroBatch mb = makeMb(r / 2 == 0 ? std::vector<std::int64_t>{5, 90, 3, 41} : std::vector<std::int64_t>{77, 1});
  for (Strategy s : {Strategy::PerSequence, Strategy::PerDocument})
    for (CommMode m : {CommMode::AllGather, CommMode::ShardingAware}) checkOne(mb, s, m, sub, 99 + r / 2);
  MPI_Comm_free(&sub);
}

// Events: one KV exchange and one attn event per phase, with the right labels/phases.
TEST(CpEquivalence, RecordsExchangeAndAttentionEvents) {
  trace::Recorder rec = trace::alignedRecorder(MPI_COMM_WORLD, {0, worldRank(), 0, 0});
  rec.setContext({3, 1, trace::Phase::None, 0});
  const MicroBatch mb = makeMb({40, 9, 100});
  for (CommMode m : {CommMode::AllGather, CommMode::ShardingAware}) {
    rec.clear();
    checkOne(mb, Strategy::PerDocument, m, MPI_COMM_WORLD, 5, &rec);
    const int xchg = rec.region(m == CommMode::AllGather ? trace::labels::kKvAllgather : trace::labels::kKvExchange);
    const int attn = rec.region(trace::labels::kAttn);
    int nx = 0, na = 0;
    for (const auto& e : rec.events()) {
      EXPECT_EQ(e.step, 3);
      EXPECT_EQ(e.micro_batch, 1);
      EXPECT_TRUE(e.phase == trace::Phase::Fwd || e.phase == trace::Phase::Bwd);
      EXPECT_LE(e.start_ns, e.end_ns);
      if (e.region == xchg) ++nx;
      if (e.region == attn) {
        ++na;
        EXPECT_GT(e.flops, 0.0);
      }
    }
    EXPECT_EQ(nx, 2);
    EXPECT_EQ(na, 2);
  }
}
