// wlb-mpi-ranks: 1 2 4
// wlb-timeout: 300
// The pipeline executor (runtime/pipeline.hpp): the same deck gives the same losses and
// weight gradients at pp = 1 and pp = world size (and pp = 2 x cp = 2, tp = 2 on 2 ranks,
// tp = 2 x pp = 2 on 4), for
// every schedule, with variable-length and empty micro-batches (the wlb packer's drain
// steps) and uneven layer splits (9 layers); every stage reports an activation peak (its
// equality with the memory model is checked by tests/cli/test_run.sh and test_sliced).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "mpi_world.hpp"
#include "runtime/run.hpp"

using namespace wlb;
using namespace wlb::runtime;

namespace {

using wlb::test::worldRank;
using wlb::test::worldSize;

const char* kDeck = R"(
[model]
hidden = 64
heads = 4
kv_heads = 2
ffn = 96
layers = 9
vocab = 256
[data]
source = "generator"
preset = "long_context_128k"
seed = 11
context_window = 512
length_scale = 0.0078125
[packing]
micro_batches = 4
[cp]
comm = "sharding_aware"
[run]
steps = 2
warmup = 0
strategies = ["plain", "wlb"]
)";

RunReport runOn(const std::vector<std::string>& sets, MPI_Comm comm) {
  const Deck deck = parseDeck(kDeck, "pipeline-test-deck", sets);
  RunOptions opt;
  opt.progress = false;
  opt.write_outputs = false;
  opt.keep_gradients = true;
  opt.comm = comm;
  return runDeck(deck, opt);
}

// ||a - b|| / ||b||
double relErr(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The pp = 1 reference on world rank 0 alone (the other ranks wait).
RunReport reference() {
  MPI_Comm self = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, worldRank() == 0 ? 0 : MPI_UNDEFINED, 0, &self);
  RunReport ref;
  if (self != MPI_COMM_NULL) {
    ref = runOn({"mesh.pp=1", "mesh.cp=1"}, self);
    MPI_Comm_free(&self);
  }
  return ref;
}

void expectSame(const RunReport& got, const RunReport& ref, const std::string& what) {
  if (worldRank() != 0) return;
  ASSERT_EQ(got.strategies.size(), ref.strategies.size()) << what;
  for (std::size_t s = 0; s < ref.strategies.size(); ++s) {
    const auto& g = got.strategies[s];
    const auto& r = ref.strategies[s];
    ASSERT_EQ(g.steps.size(), r.steps.size()) << what << " " << r.name;
    bool empty_mb_seen = false;
    for (std::size_t i = 0; i < r.steps.size(); ++i) {
      EXPECT_EQ(g.steps[i].tokens, r.steps[i].tokens) << what << " " << r.name << " step " << i;
      if (std::isnan(r.steps[i].loss))  // a step without tokens has no loss on either mesh
        EXPECT_TRUE(std::isnan(g.steps[i].loss)) << what << " " << r.name << " step " << i;
      else
        EXPECT_NEAR(g.steps[i].loss, r.steps[i].loss, 1e-4 * std::abs(r.steps[i].loss) + 1e-6)
            << what << " " << r.name << " step " << i;
      empty_mb_seen |= r.steps[i].drain;
    }
    ASSERT_FALSE(r.gradients.empty());
    EXPECT_LE(relErr(g.gradients, r.gradients), 1e-4) << what << " " << r.name;
    if (r.name == "wlb") {
      EXPECT_TRUE(empty_mb_seen) << "the wlb packer's drain should leave micro-batches empty";
    }
  }
}

}  // namespace

TEST(Pipeline, EveryScheduleMatchesPpOne) {
  const int n = worldSize();
  const RunReport ref = reference();
  if (worldRank() == 0) {
    ASSERT_EQ(ref.strategies.size(), 2u);
    for (const auto& s : ref.strategies)
      EXPECT_EQ(s.gradients.size(),
                256u * 64 + 9u * (64 + 64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 + 3 * 64 * 96) + 64 + 64 * 256);
  }
  struct Case {
    int pp, cp;
    const char* schedule;
    int chunks;
    int tp = 1;  // the gradients come back whole on every mesh, so TP compares too
  };
  std::vector<Case> cases;
  if (n == 1) cases = {{1, 1, "gpipe", 1}, {1, 1, "interleaved", 3}};
  if (n == 2) cases = {{2, 1, "gpipe", 1}, {2, 1, "1f1b", 1}, {2, 1, "interleaved", 2}, {1, 1, "1f1b", 1, 2}};
  if (n == 4)
    cases = {{4, 1, "gpipe", 1}, {4, 1, "1f1b", 1},        {4, 1, "interleaved", 2},
             {2, 2, "1f1b", 1},  {2, 2, "interleaved", 2}, {2, 1, "1f1b", 1, 2}};
  for (const Case& c : cases) {
    const std::string what = "tp=" + std::to_string(c.tp) + " pp=" + std::to_string(c.pp) +
                             " cp=" + std::to_string(c.cp) + " " + c.schedule + " chunks=" + std::to_string(c.chunks);
    SCOPED_TRACE(what);
    const RunReport got = runOn(
        {"mesh.tp=" + std::to_string(c.tp), "mesh.pp=" + std::to_string(c.pp), "mesh.cp=" + std::to_string(c.cp),
         std::string("pipeline.schedule=\"") + c.schedule + "\"", "mesh.virtual_stages=" + std::to_string(c.chunks)},
        MPI_COMM_WORLD);
    expectSame(got, ref, what);
    if (worldRank() == 0)
      for (const auto& s : got.strategies) {
        ASSERT_EQ(s.stage_peak_bytes.size(), static_cast<std::size_t>(c.pp));
        for (double b : s.stage_peak_bytes) EXPECT_GT(b, 0.0);
        if (c.pp > 1) {
          EXPECT_GT(s.bubble, 0.0) << s.name;
        }
      }
  }
}

TEST(Pipeline, BadPipelinesAreDeckErrorsNamingTheKey) {
  const int n = worldSize();
  // interleaved 1F1B needs micro-batches divisible by the stages
  if (n >= 2) {
    try {
      runOn({"mesh.pp=" + std::to_string(n), "pipeline.schedule=\"interleaved\"", "mesh.virtual_stages=2",
             "packing.micro_batches=" + std::to_string(n + 1)},
            MPI_COMM_WORLD);
      ADD_FAILURE() << "no error";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("packing.micro_batches"), std::string::npos) << e.what();
    }
  }
  // more virtual stages than layers: the deck itself is rejected, naming the key
  try {
    (void)parseDeck(kDeck, "pipeline-test-deck",
                    {"mesh.pp=" + std::to_string(n), "model.layers=" + std::to_string(n),
                     "pipeline.schedule=\"interleaved\"", "mesh.virtual_stages=2"});
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers"), std::string::npos) << e.what();
  }
}
