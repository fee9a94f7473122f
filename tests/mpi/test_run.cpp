// wlb-mpi-ranks: 1 2 4
// wlb-timeout: 180
// The measured executor on real ranks: a transformer layer under CP equals the same
// layer on one rank (output, input gradient, CP-summed weight gradients), and runDeck
// runs every strategy of a small deck on cp = N and dp = N meshes, writes the trace, and
// rejects a mesh that does not match the world size on every rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "core/types.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"
#include "mpi_world.hpp"
#include "runtime/distributed_attention.hpp"
#include "runtime/layer.hpp"
#include "runtime/llama.hpp"
#include "runtime/run.hpp"
#include "runtime/tokens.hpp"

using namespace wlb;
using namespace wlb::runtime;

namespace {

using wlb::test::worldRank;
using wlb::test::worldSize;

model::ModelDims dims() {
  model::ModelDims d;
  d.hidden = 64;
  d.heads = 4;
  d.kv_heads = 2;
  d.head_dim = 16;
  d.ffn = 96;
  d.layers = 2;
  d.vocab = 100;
  d.dtype_bytes = 4;
  return d;
}

std::vector<float> host(const Mat& m) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m);
  return std::vector<float>(h.data(), h.data() + h.size());
}
Mat fromHost(const std::vector<float>& v, std::int64_t r, std::int64_t c) {
  Mat m("m", r, c);
  auto h = Kokkos::create_mirror_view(m);
  std::copy(v.begin(), v.end(), h.data());
  Kokkos::deep_copy(m, h);
  return m;
}
std::vector<float> randomVec(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

struct LayerOut {
  std::vector<float> y, dx, grads;
};

// Two layers forward + backward on `comm` with the plan's sharding; y/dx gathered back to
// packed order; weight gradients summed over the communicator.
LayerOut runLayers(const MicroBatch& mb, const std::string& strategy, cp::CommMode mode, MPI_Comm comm) {
  int cp = 1, rank = 0;
  MPI_Comm_size(comm, &cp);
  MPI_Comm_rank(comm, &rank);
  const auto d = dims();
  model::CostModel cost(d, model::HardwareProfile::analytic(), 1);
  const LlamaConfig mc = LlamaConfig::of(d);
  Llama model(mc, 3);
  const cp::ShardPlan plan = cp::planShards(mb, strategy, cp, cost, CpConfig{});
  const cp::CommPlan cpl = cp::planComm(plan, mode, cost);
  const std::int64_t T = mb.tokens(), H = d.hidden;
  const auto x = randomVec(static_cast<std::size_t>(T * H), 5), g = randomVec(static_cast<std::size_t>(T * H), 6);
  std::vector<float> lx, lg;
  // RoPE positions of the rank's rows: each token's index in its segment.
  std::vector<std::int64_t> seg_begin;
  std::int64_t at = 0;
  for (const auto& s : mb.segments) {
    seg_begin.push_back(at);
    at += s.length;
  }
  std::vector<TokenRef> refs;
  for (std::int64_t p : cp::packedPositions(plan, rank)) {
    lx.insert(lx.end(), x.begin() + p * H, x.begin() + (p + 1) * H);
    lg.insert(lg.end(), g.begin() + p * H, g.begin() + (p + 1) * H);
    const auto i =
        static_cast<std::size_t>(std::upper_bound(seg_begin.begin(), seg_begin.end(), p) - seg_begin.begin()) - 1;
    refs.push_back(TokenRef{mb.segments[i].doc, p - seg_begin[i], static_cast<std::int32_t>(p - seg_begin[i]), false});
  }
  const std::int64_t n = plan.ranks[rank].tokens;
  Space space;
  RopeTable rope(mc.headDim(), 10000.0);
  rope.ensure(space, 128);
  const TokenRows rows = TokenRows::make(space, SyntheticTokens(1, mc.vocab), refs, mc.vocab);
  LayerEnv env;
  env.space = &space;
  env.cp_comm = comm;
  env.cost = &cost;
  env.rope = &rope;
  model.zeroGrads(space);
  LayerStep l0(env, model, 0, plan, cpl), l1(env, model, 1, plan, cpl);
  Mat y = l1.forward(l0.forward(fromHost(lx, n, H), rows.positions), rows.positions);
  Mat dx = l0.backward(l1.backward(fromHost(lg, n, H), rows.positions), rows.positions);
  LayerOut out;
  out.y = runtime::gatherToPacked(plan, cpl, comm, host(y).data(), H);
  out.dx = runtime::gatherToPacked(plan, cpl, comm, host(dx).data(), H);
  auto gb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.grads());
  out.grads.assign(gb.data(), gb.data() + gb.size());
  MPI_Allreduce(MPI_IN_PLACE, out.grads.data(), static_cast<int>(out.grads.size()), MPI_FLOAT, MPI_SUM, comm);
  return out;
}

double maxRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]) / (1.0 + std::abs(static_cast<double>(b[i]))));
  return m;
}

std::string tempDir() {
  std::string dir;
  if (worldRank() == 0) {
    char tmpl[] = "/tmp/wlb-test-run-XXXXXX";
    dir = mkdtemp(tmpl);
  }
  int len = static_cast<int>(dir.size());
  MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
  dir.resize(static_cast<std::size_t>(len));
  MPI_Bcast(dir.data(), len, MPI_CHAR, 0, MPI_COMM_WORLD);
  return dir;
}

const char* kDeck = R"(
[model]
hidden = 64
heads = 4
kv_heads = 2
ffn = 96
layers = 1
vocab = 256
[data]
source = "generator"
preset = "long_context_128k"
seed = 7
context_window = 1024
length_scale = 0.0078125
[packing]
micro_batches = 2
[cp]
comm = "sharding_aware"
[run]
steps = 2
warmup = 1
strategies = ["plain", "fixed", "wlb"]
)";

}  // namespace

TEST(RunLayer, CpShardedLayersEqualSingleRank) {
  MicroBatch mb;
  mb.segments = {Segment{1, 0, 37, 0}, Segment{2, 0, 3, 0}, Segment{3, 5, 90, 0}, Segment{4, 0, 1, 0}};
  const LayerOut ref = runLayers(mb, "per_document", cp::CommMode::AllGather, MPI_COMM_SELF);
  for (const char* s : {"per_sequence", "per_document", "hybrid"})
    for (auto mode : {cp::CommMode::AllGather, cp::CommMode::ShardingAware}) {
      const LayerOut got = runLayers(mb, s, mode, MPI_COMM_WORLD);
      EXPECT_LE(maxRelDiff(got.y, ref.y), 1e-4) << s;
      EXPECT_LE(maxRelDiff(got.dx, ref.dx), 1e-4) << s;
      EXPECT_LE(maxRelDiff(got.grads, ref.grads), 1e-3) << s;
    }
}

TEST(RunDeck, EveryStrategyRunsOnCpAndDpMeshes) {
  const int n = worldSize();
  const std::string dir = tempDir();
  for (const char* axis : {"cp", "dp"}) {
    if (n == 1 && std::string(axis) == "dp") continue;
    const std::string out = dir + "/" + axis;
    const Deck deck = parseDeck(kDeck, "test-deck",
                                {std::string("mesh.") + axis + "=" + std::to_string(n), "output.dir=\"" + out + "\""});
    RunOptions opt;
    opt.progress = false;
    const RunReport rep = runDeck(deck, opt);
    if (worldRank() != 0) continue;
    ASSERT_EQ(rep.strategies.size(), 3u) << axis;
    for (const auto& s : rep.strategies) {
      // warm-up + measured steps, then the drain steps that trained what the packer held
      EXPECT_EQ(s.steps.size(), 3u + static_cast<std::size_t>(s.drain_steps));
      EXPECT_TRUE(s.steps.front().warmup);
      for (std::size_t i = 3; i < s.steps.size(); ++i) EXPECT_TRUE(s.steps[i].drain);
      EXPECT_GT(s.tokens_per_second, 0.0);
      EXPECT_GT(s.flops_per_second, 0.0);
      EXPECT_LE(s.speedup_lo, s.speedup);
      EXPECT_GE(s.speedup_hi, s.speedup);
      EXPECT_EQ(s.work.size(), 2u);  // the measured steps, drain folded into the last
      EXPECT_GT(s.step_mean, 0.0);
      EXPECT_GT(s.tokens_per_step, 0.0);
      EXPECT_GE(s.mb_imbalance, 1.0);
      EXPECT_GE(s.cp_imbalance, 1.0);
      EXPECT_EQ(s.rank_busy.size(), static_cast<std::size_t>(n));
      for (double b : s.rank_busy) EXPECT_GT(b, 0.0);
    }
    EXPECT_EQ(rep.strategies[0].packer, "original");
    EXPECT_EQ(rep.strategies[2].sharding, "adaptive");
    EXPECT_TRUE(std::filesystem::exists(rep.trace_path)) << rep.trace_path;
    EXPECT_EQ(rep.plan_paths.size(), 3u);
    for (const auto& p : rep.plan_paths) EXPECT_TRUE(std::filesystem::exists(p)) << p;
    EXPECT_NE(formatReport(rep).find("speedup"), std::string::npos);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (worldRank() == 0) std::filesystem::remove_all(dir);
}

TEST(RunDeck, MeshMismatchIsACollectiveInputError) {
  const int n = worldSize();
  const Deck bad = parseDeck(kDeck, "test-deck", {"mesh.cp=" + std::to_string(n + 1)});
  RunOptions opt;
  opt.progress = false;
  opt.write_outputs = false;
  try {
    runDeck(bad, opt);
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_TRUE(e.collective());
  }
}
