// wlb-mpi-ranks: 2 4
// wlb-timeout: 180
// wlb train on a TP x CP x PP x DP mesh: the same data and seed give the losses of one
// rank on dp = N, cp = N, tp = 2, pp = 2 and their products (within float reassociation),
// every replica ends with the same weights, no document is lost or trained twice, a resumed
// run continues bit-identically on the same mesh (DP, CP, TP, PP), the trace holds the
// training metrics, and one rank's bad input stops every rank with one InputError (no hang).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "data/prepare.hpp"
#include "mpi_world.hpp"
#include "trace/reader.hpp"
#include "train/trainer.hpp"

using namespace wlb;

namespace {

using wlb::test::worldRank;
using wlb::test::worldSize;

std::string bcast(std::string s) {
  int len = static_cast<int>(s.size());
  MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
  s.resize(static_cast<std::size_t>(len));
  MPI_Bcast(s.data(), len, MPI_CHAR, 0, MPI_COMM_WORLD);
  return s;
}

// A corpus of pseudo-English documents with long-tailed lengths (a few longer than the
// context window, so the packers cut them), prepared once by rank 0.
const std::string& dataset() {
  static std::string prefix;
  if (!prefix.empty()) return prefix;
  std::string dir;
  if (worldRank() == 0) {
    char tmpl[] = "/tmp/wlb-test-train-XXXXXX";
    dir = mkdtemp(tmpl);
    std::filesystem::create_directories(dir + "/corpus");
    const char* words[] = {"the",  "model",  "packs",   "documents", "into",     "micro", "batches",
                           "and",  "trains", "on",      "every",     "rank",     "of",    "a",
                           "mesh", "with",   "context", "parallel",  "attention"};
    std::uint64_t x = 12345;
    auto next = [&]() {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      return x >> 33;
    };
    for (int d = 0; d < 64; ++d) {
      const std::size_t len = 20 + next() % (d % 9 == 0 ? 600 : 160);
      std::string text;
      while (text.size() < len) text += std::string(words[next() % 19]) + (next() % 7 == 0 ? ".\n" : " ");
      std::ofstream(dir + "/corpus/doc" + std::to_string(100 + d) + ".txt") << text;
    }
    data::PrepareOptions po;
    po.source = dir + "/corpus";
    po.out_prefix = dir + "/data";
    po.valid_fraction = 0.2;
    po.progress = false;
    data::prepareDataset(po);
  }
  prefix = bcast(dir) + "/data";
  return prefix;
}

std::string deckText(const std::string& packer) {
  return R"(
[model]
hidden = 16
heads = 4
kv_heads = 2
ffn = 32
layers = 2
vocab = 256
[data]
context_window = 128
[packing]
strategy = ")" +
         packer + R"("
[cp]
comm = "sharding_aware"
[train]
steps = 8
lr = 0.01
warmup_steps = 2
eval_interval = 4
log_interval = 100
)";
}

// Deck for mesh tp x cp x pp x dp with a global batch of 4 micro-batches (dp x micro_batches).
Deck makeDeck(const std::string& packer, int dp, int cp, const std::string& out, std::vector<std::string> extra = {},
              int tp = 1, int pp = 1) {
  std::vector<std::string> o = {"mesh.dp=" + std::to_string(dp),
                                "mesh.cp=" + std::to_string(cp),
                                "mesh.tp=" + std::to_string(tp),
                                "mesh.pp=" + std::to_string(pp),
                                "packing.micro_batches=" + std::to_string(4 / dp),
                                "train.dataset=\"" + dataset() + "\"",
                                "output.dir=\"" + out + "\""};
  o.insert(o.end(), extra.begin(), extra.end());
  return parseDeck(deckText(packer), "test-train", o);
}

train::TrainOptions quiet(MPI_Comm comm) {
  train::TrainOptions t;
  t.progress = false;
  t.comm = comm;
  return t;
}

// The reference: one rank (rank 0 alone, on MPI_COMM_SELF), shared with every rank.
struct Ref {
  std::vector<double> losses, evals;
  std::int64_t tokens = 0;
};
// `layers`: model.layers (0: the deck's).
Ref reference(const std::string& packer, int layers = 0) {
  static std::map<std::string, Ref> cache;
  const std::string key = packer + (layers > 0 ? "-l" + std::to_string(layers) : "");
  if (cache.count(key)) return cache[key];
  Ref r;
  std::string out = dataset() + "-ref-" + key;
  std::vector<std::string> extra;
  if (layers > 0) extra.push_back("model.layers=" + std::to_string(layers));
  if (worldRank() == 0) {
    const auto s = train::train(makeDeck(packer, 1, 1, out, extra), quiet(MPI_COMM_SELF));
    r.losses = s.losses;
    r.evals = s.eval_losses;
    r.tokens = s.tokens;
  }
  int n = static_cast<int>(r.losses.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
  r.losses.resize(static_cast<std::size_t>(n));
  r.evals.resize(static_cast<std::size_t>(n));
  MPI_Bcast(r.losses.data(), n, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Bcast(r.evals.data(), n, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  long long t = r.tokens;
  MPI_Bcast(&t, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  r.tokens = t;
  return cache[key] = r;
}

double relDiff(double a, double b) {
  return std::abs(a - b) / std::max(1e-12, std::abs(b));
}

// Rounding differs across meshes (partial gradient sums added in another order), and the
// difference grows through the AdamW updates; 8 steps stay far inside this.
constexpr double kTol = 1e-5;

void expectMatches(const train::TrainSummary& s, const Ref& ref, const std::string& what, int tp = 1, int cp = 1,
                   int pp = 1) {
  ASSERT_EQ(s.losses.size(), ref.losses.size()) << what;
  EXPECT_EQ(s.tokens, ref.tokens) << what;
  double worst = 0;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) worst = std::max(worst, relDiff(s.losses[i], ref.losses[i]));
  if (worldRank() == 0)
    std::printf("%s: largest relative difference of a step's loss to one rank's: %.2e (loss %.4f -> %.4f)\n",
                what.c_str(), worst, s.losses.front(), s.losses.back());
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_LE(relDiff(s.losses[i], ref.losses[i]), kTol) << what << " step " << i;
    EXPECT_EQ(std::isnan(s.eval_losses[i]), std::isnan(ref.evals[i])) << what << " step " << i;
    if (!std::isnan(ref.evals[i])) {
      EXPECT_LE(relDiff(s.eval_losses[i], ref.evals[i]), kTol) << what << " step " << i;
    }
  }
  // Every replica applied the same update: the weights (of one TP slice and pipeline
  // stage) have the same bits on every rank holding them (rank = tp + TP (cp + CP (pp + PP dp))).
  std::vector<unsigned long long> h(static_cast<std::size_t>(worldSize()));
  unsigned long long mine = s.weights_hash;
  MPI_Allgather(&mine, 1, MPI_UNSIGNED_LONG_LONG, h.data(), 1, MPI_UNSIGNED_LONG_LONG, MPI_COMM_WORLD);
  std::map<std::pair<int, int>, unsigned long long> held;  // (tp rank, stage) -> hash
  for (int r = 0; r < static_cast<int>(h.size()); ++r) {
    const auto key = std::make_pair(r % tp, r / (tp * cp) % pp);
    const auto it = held.emplace(key, h[static_cast<std::size_t>(r)]).first;
    EXPECT_EQ(h[static_cast<std::size_t>(r)], it->second) << what << " rank " << r;
  }
}

using SegKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>;  // step, doc, offset, length
std::multiset<SegKey> segmentsOf(const std::string& trace_path) {
  const auto t = trace::readTrace(trace_path);
  std::multiset<SegKey> out;
  for (const auto& s : t.segments) out.insert({s.step, s.doc, s.offset, s.length});
  return out;
}

}  // namespace

TEST(TrainMesh, DpMatchesOneRank) {
  const int n = worldSize();
  const Ref ref = reference("original");
  const std::string out = dataset() + "-dp" + std::to_string(n);
  const auto s = train::train(makeDeck("original", n, 1, out), quiet(MPI_COMM_WORLD));
  expectMatches(s, ref, "dp=" + std::to_string(n));
  if (worldRank() == 0) {
    // The replicas together trained exactly the one-rank run's segments.
    const auto a = segmentsOf(dataset() + "-ref-original/trace.h5");
    const auto b = segmentsOf(out + "/trace.h5");
    EXPECT_EQ(a, b);
    EXPECT_FALSE(a.empty());
  }
}

TEST(TrainMesh, CpMatchesOneRank) {
  const int n = worldSize();
  const Ref ref = reference("wlb");
  for (const int dp : {1, 2}) {
    if (n % dp != 0 || n / dp < 2) continue;
    const int cp = n / dp;
    const std::string what = "dp=" + std::to_string(dp) + " cp=" + std::to_string(cp);
    const std::string out = dataset() + "-dp" + std::to_string(dp) + "cp" + std::to_string(cp);
    if (dp == 1) {
      const auto s = train::train(makeDeck("wlb", dp, cp, out), quiet(MPI_COMM_WORLD));
      expectMatches(s, ref, what);
    } else {
      // wlb balances over the replicas: compare dp x cp with the one-rank original run
      const Ref ref_o = reference("original");
      const auto s = train::train(makeDeck("original", dp, cp, out), quiet(MPI_COMM_WORLD));
      expectMatches(s, ref_o, what);
    }
  }
}

TEST(TrainMesh, TpMatchesOneRank) {
  // tp = 2 (heads, KV heads and MLP columns split), with cp = 2 and with dp = 2 on 4 ranks
  const int n = worldSize();
  const std::string what = n == 2 ? "tp=2" : "tp=2 cp=" + std::to_string(n / 2);
  const auto s = train::train(makeDeck("wlb", 1, n / 2, dataset() + "-tp2cp", {}, 2), quiet(MPI_COMM_WORLD));
  expectMatches(s, reference("wlb"), what, 2);
  if (worldRank() == 0) {
    // the TP sums are timed: tp_allreduce events and /train/ranks tp_comm_seconds
    const auto t = trace::readTrace(dataset() + "-tp2cp/trace.h5");
    ASSERT_GE(t.regionId("tp_allreduce"), 0);
    for (const auto& r : t.train_ranks) {
      if (r.tokens > 0) {
        EXPECT_GT(r.tp_comm_seconds, 0.0) << "step " << r.step << " rank " << r.rank;
      }
    }
  }
  if (n >= 4) {
    const auto d = train::train(makeDeck("original", n / 2, 1, dataset() + "-tp2dp", {}, 2), quiet(MPI_COMM_WORLD));
    expectMatches(d, reference("original"), "tp=2 dp=" + std::to_string(n / 2), 2);
  }
}

TEST(TrainMesh, PpMatchesOneRank) {
  // pp = 2 (1F1B) on 2 ranks; on 4: pp = 2 x tp = 2, pp = 2 x cp = 2 (GPipe), pp = 4 (4 layers)
  const int n = worldSize();
  const Ref ref = reference("wlb");
  if (n == 2) {
    const auto s = train::train(makeDeck("wlb", 1, 1, dataset() + "-pp2", {}, 1, 2), quiet(MPI_COMM_WORLD));
    expectMatches(s, ref, "pp=2", 1, 1, 2);
    if (worldRank() == 0) {
      // the stages' messages are timed: pp_send / pp_recv events
      const auto t = trace::readTrace(dataset() + "-pp2/trace.h5");
      EXPECT_GE(t.regionId("pp_send"), 0);
      EXPECT_GE(t.regionId("pp_recv"), 0);
    }
    return;
  }
  const auto a = train::train(makeDeck("wlb", 1, 1, dataset() + "-pp2tp2", {}, 2, 2), quiet(MPI_COMM_WORLD));
  expectMatches(a, ref, "pp=2 tp=2", 2, 1, 2);
  const auto b = train::train(makeDeck("wlb", 1, 2, dataset() + "-pp2cp2", {"pipeline.schedule=\"gpipe\""}, 1, 2),
                              quiet(MPI_COMM_WORLD));
  expectMatches(b, ref, "pp=2 cp=2 gpipe", 1, 2, 2);
  const auto c =
      train::train(makeDeck("wlb", 1, 1, dataset() + "-pp4", {"model.layers=4"}, 1, 4), quiet(MPI_COMM_WORLD));
  expectMatches(c, reference("wlb", 4), "pp=4", 1, 1, 4);
}

static void expectResumed(const train::TrainSummary& a, const train::TrainSummary& b, const std::string& cut, int n,
                          const std::string& what) {
  EXPECT_EQ(b.first_step, 3) << what;
  ASSERT_EQ(b.losses.size(), 5u) << what;
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(a.losses[i + 3], b.losses[i]) << what << " step " << i + 3;  // bit for bit
    EXPECT_EQ(std::isnan(a.eval_losses[i + 3]), std::isnan(b.eval_losses[i])) << what;
    if (!std::isnan(b.eval_losses[i])) {
      EXPECT_EQ(a.eval_losses[i + 3], b.eval_losses[i]) << what;
    }
  }
  EXPECT_EQ(a.weights_hash, b.weights_hash) << what;
  EXPECT_EQ(a.tokens, b.tokens) << what;
  if (worldRank() == 0) {
    // The resumed trace holds the whole curve: steps before the checkpoint from the log.
    const auto t = trace::readTrace(cut + "/trace.h5");
    ASSERT_EQ(t.train_steps.size(), 8u) << what;
    for (std::size_t i = 0; i < 8; ++i) {
      EXPECT_EQ(t.train_steps[i].step, static_cast<std::int64_t>(i)) << what;
      EXPECT_EQ(t.train_steps[i].loss, a.losses[i]) << what << " step " << i;
    }
    EXPECT_EQ(t.meta.at("first_step"), "3") << what;
    EXPECT_EQ(t.train_ranks.size(), 5u * static_cast<std::size_t>(n)) << what;  // this invocation's timings
  }
}

TEST(TrainMesh, ResumeIsBitIdenticalOnTheSameMesh) {
  // 2 ranks: dp = 2, tp = 2, pp = 2; 4 ranks: dp = 2 x cp = 2, tp = 2 x dp = 2, pp = 2 x tp = 2.
  const int n = worldSize();
  for (const auto& [tp, pp] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{n / 2, 2}}) {
    const int cp = tp == 1 && pp == 1 && n >= 4 ? 2 : 1, dp = n / cp / tp / pp;
    const std::string what = "tp=" + std::to_string(tp) + " cp=" + std::to_string(cp) + " pp=" + std::to_string(pp) +
                             " dp=" + std::to_string(dp);
    const std::string tag = "-tp" + std::to_string(tp) + "pp" + std::to_string(pp);
    const std::string full = dataset() + "-full" + tag, cut = dataset() + "-cut" + tag;
    const std::vector<std::string> ck = {"train.checkpoint_interval=3"};
    const auto a = train::train(makeDeck("wlb", dp, cp, full, ck, tp, pp), quiet(MPI_COMM_WORLD));
    auto stop = quiet(MPI_COMM_WORLD);
    stop.stop_after_step = 4;  // a "kill" between the checkpoints after steps 2 and 5
    (void)train::train(makeDeck("wlb", dp, cp, cut, ck, tp, pp), stop);
    auto res = quiet(MPI_COMM_WORLD);
    res.resume = true;
    const auto b = train::train(makeDeck("wlb", dp, cp, cut, ck, tp, pp), res);
    expectResumed(a, b, cut, n, what);
  }
}

TEST(TrainMesh, TraceHoldsTrainingMetrics) {
  const int n = worldSize();
  const std::string out = dataset() + "-dp" + std::to_string(n);  // DpMatchesOneRank's run
  if (worldRank() != 0) return;
  if (!std::filesystem::exists(out + "/trace.h5")) GTEST_SKIP() << "needs DpMatchesOneRank's run";
  const auto t = trace::readTrace(out + "/trace.h5");
  EXPECT_EQ(t.source, "measured");
  EXPECT_EQ(t.dp, n);
  EXPECT_EQ(t.meta.at("executor"), "wlb::train::train");
  ASSERT_EQ(t.train_steps.size(), 8u);
  std::int64_t seg_tokens = 0;
  for (const auto& s : t.segments) seg_tokens += s.length;
  std::int64_t tokens = 0;
  for (std::size_t i = 0; i < t.train_steps.size(); ++i) {
    const auto& r = t.train_steps[i];
    EXPECT_EQ(r.step, static_cast<std::int64_t>(i));
    EXPECT_GT(r.loss, 0.0);
    EXPECT_GT(r.tokens, r.predicted);
    EXPECT_GT(r.seconds, 0.0);
    EXPECT_NEAR(r.tokens_per_second, static_cast<double>(r.tokens) / r.seconds, 1e-6 * r.tokens_per_second);
    EXPECT_GT(r.lr, 0.0);
    EXPECT_GT(r.grad_norm, 0.0);
    EXPECT_EQ(std::isnan(r.eval_loss), i != 3 && i != 7) << i;  // eval_interval 4
    tokens += r.tokens;
  }
  EXPECT_EQ(tokens, seg_tokens);  // /plan/segments: every trained token
  ASSERT_EQ(t.train_ranks.size(), 8u * static_cast<std::size_t>(n));
  std::vector<std::int64_t> per_step(8, 0);
  for (const auto& r : t.train_ranks) {
    ASSERT_GE(r.step, 0);
    ASSERT_LT(r.step, 8);
    EXPECT_GE(r.rank, 0);
    EXPECT_LT(r.rank, n);
    EXPECT_GT(r.step_seconds, 0.0);
    EXPECT_GE(r.step_seconds, r.compute_seconds);
    EXPECT_GE(r.compute_seconds, r.attn_seconds);
    EXPECT_EQ(r.eval_seconds > 0, r.step == 3 || r.step == 7);
    per_step[static_cast<std::size_t>(r.step)] += r.tokens;
  }
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(per_step[i], t.train_steps[i].tokens) << i;
  // Per-rank events: attention, the gradient all-reduce and the optimizer on every rank.
  for (const char* l : {"attn", "grad_allreduce", "optimizer", "step"}) {
    const int id = t.regionId(l);
    ASSERT_GE(id, 0) << l;
    for (int r = 0; r < n; ++r) {
      const auto ev = t.eventsOfRank(r);
      EXPECT_TRUE(std::any_of(ev.begin(), ev.end(), [&](const trace::Event& e) { return e.region == id; }))
          << l << " on rank " << r;
    }
  }
}

TEST(TrainMesh, OneRanksBadInputStopsEveryRank) {
  // Rank 1 alone names a dataset that does not exist: every rank throws the same
  // InputError (naming the key) instead of waiting for rank 1 in a collective.
  const int n = worldSize();
  const std::string out = dataset() + "-bad";
  Deck deck = makeDeck("wlb", n, 1, out);
  if (worldRank() == 1) deck.train.dataset = dataset() + "-missing";
  try {
    (void)train::train(deck, quiet(MPI_COMM_WORLD));
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("train.dataset"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_TRUE(e.collective());
  }
  // TP must divide the heads, SlimPack's slices need the PackFlow schedule: errors naming
  // the key.
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"mesh.tp=3"}, "mesh.tp"}, {{"packing.strategy=\"slimpack\""}, "pipeline.schedule"}};
  for (const auto& [sets, key] : bad) {
    std::vector<std::string> o = sets;
    o.push_back("train.dataset=\"" + dataset() + "\"");
    try {
      (void)train::train(parseDeck(deckText("wlb"), "t", o), quiet(MPI_COMM_WORLD));
      ADD_FAILURE() << key;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (worldRank() == 0) std::filesystem::remove_all(std::filesystem::path(dataset()).parent_path());
}
