// wlb-timeout: 60
// Hardware profile loading: the attention efficiency factor scales every attention
// prediction, and bad values are rejected naming the file and key.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "model/cost_model.hpp"
#include "model/throughput.hpp"

using namespace wlb;

namespace {

std::string writeProfile(const std::string& name, const std::string& extra) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << R"({"format": "wlb-hardware-profile", "version": 1, "peak_gflops": 100,
    "linear_gflops": 50, "tile_q": 64, "tile_k": 64,
    "attention": {
      "fwd": {"q_lens": [64, 1024], "k_lens": [64, 1024], "gflops": [[40, 50], [40, 80]]},
      "bwd": {"q_lens": [64, 1024], "k_lens": [64, 1024], "gflops": [[30, 45], [30, 90]]}}
    )" << extra << "}";
  return path;
}

model::ModelDims smallDims() {
  model::ModelDims dims;
  dims.hidden = 256;
  dims.heads = 4;
  dims.kv_heads = 2;
  dims.head_dim = 64;
  dims.ffn = 704;
  return dims;
}

}  // namespace

TEST(HardwareProfile, AttentionEfficiencyScalesTableAndLatency) {
  const auto base = model::HardwareProfile::load(writeProfile("p1.json", ""));
  const auto eff = model::HardwareProfile::load(writeProfile("p2.json", R"(, "attention_efficiency": 0.8)"));
  EXPECT_DOUBLE_EQ(base.attention_efficiency, 1.0);
  EXPECT_DOUBLE_EQ(eff.attention_efficiency, 0.8);
  for (auto p : {model::Phase::Fwd, model::Phase::Bwd})
    for (double q : {64.0, 300.0, 1024.0})
      EXPECT_NEAR(eff.attnGflops(p, q, 1024.0), 0.8 * base.attnGflops(p, q, 1024.0), 1e-9);
  EXPECT_DOUBLE_EQ(base.attnGflops(model::Phase::Fwd, 1024, 1024), 80.0);

  const model::ModelDims dims = smallDims();
  const model::CostModel a(dims, base), b(dims, eff);
  // Attention latency grows by 1/0.8; linear work is untouched.
  EXPECT_NEAR(b.attnSeconds(0, 1000, model::Phase::Bwd), a.attnSeconds(0, 1000, model::Phase::Bwd) / 0.8,
              1e-12);
  EXPECT_DOUBLE_EQ(b.linearSeconds(1000, model::Phase::Fwd), a.linearSeconds(1000, model::Phase::Fwd));
}

TEST(HardwareProfile, BadAttentionEfficiencyNamesFileAndKey) {
  for (const char* v : {"0", "-1", "2.5", "\"fast\""}) {
    const auto path = writeProfile("bad.json", std::string(R"(, "attention_efficiency": )") + v);
    try {
      (void)model::HardwareProfile::load(path);
      FAIL() << "accepted attention_efficiency " << v;
    } catch (const InputError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("attention_efficiency"), std::string::npos) << msg;
      EXPECT_NE(msg.find("bad.json"), std::string::npos) << msg;
    }
  }
}

// Fields the cost model does not use are still checked, so that calibrate does not rewrite a
// damaged file: head_dim (what the tables were measured at), calibration (its history).
TEST(HardwareProfile, BadHeadDimAndCalibrationNameTheKey) {
  for (const auto& [extra, key] :
       std::vector<std::pair<std::string, std::string>>{{R"(, "head_dim": 0)", "head_dim"},
                                                        {R"(, "head_dim": 2.5)", "head_dim"},
                                                        {R"(, "calibration": "oops")", "calibration"},
                                                        {R"(, "calibration": [1, 2])", "calibration"}}) {
    try {
      (void)model::HardwareProfile::load(writeProfile("badkey.json", extra));
      ADD_FAILURE() << "accepted " << extra;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("profile key '" + key + "'"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(
      model::HardwareProfile::load(writeProfile("okkey.json", R"(, "head_dim": 128, "calibration": [{}])")));
}

// Misspelt keys of the closed tables and near-misses of the read top-level keys are refused
// (they would be ignored and their defaults used); a number past a double and text after the
// JSON name the file; free metadata keys load.
TEST(HardwareProfile, SlipsAndDamageNameTheKeyOrFile) {
  for (const auto& [extra, key] :
       std::vector<std::pair<std::string, std::string>>{{R"(, "links": {"cp_gpbs": 5})", "links.cp_gpbs"},
                                                        {R"(, "rank_speed": {"spreads": 0.1})", "rank_speed.spreads"},
                                                        {R"(, "factor": {})", "factor"},
                                                        {R"(, "version2": 1)", "version2"}}) {
    try {
      (void)model::HardwareProfile::load(writeProfile("slip.json", extra));
      ADD_FAILURE() << "accepted " << extra;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("profile key '" + key + "': unknown key (did you mean"), std::string::npos)
          << e.what();
    }
  }
  for (const char* extra : {R"(, "linear_gflops": 1e999)", "} trailing"}) {
    try {
      (void)model::HardwareProfile::load(writeProfile("damaged.json", extra));
      ADD_FAILURE() << "accepted " << extra;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("damaged.json: not valid JSON"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(model::HardwareProfile::load(writeProfile(
      "meta.json",
      R"(, "description": "x", "notes": ["y"], "source": "z", "created": "today", "date": 1, "node": 2)")));
}

// Cells with k < q are ignored (docs/profile-format.md): also in the row above q that the
// interpolation blends in. Here every such cell is tiny; the rates at k >= q must not move.
TEST(HardwareProfile, CellsWithKBelowQAreIgnored) {
  const auto base = model::HardwareProfile::load(writeProfile("kq.json", ""));
  const std::string path = ::testing::TempDir() + "kq_tiny.json";
  std::ofstream(path) << R"({"format": "wlb-hardware-profile", "version": 1, "peak_gflops": 100,
    "linear_gflops": 50, "tile_q": 64, "tile_k": 64,
    "attention": {
      "fwd": {"q_lens": [64, 1024], "k_lens": [64, 1024], "gflops": [[40, 50], [0.001, 80]]},
      "bwd": {"q_lens": [64, 1024], "k_lens": [64, 1024], "gflops": [[30, 45], [0.001, 90]]}}})";
  const auto tiny = model::HardwareProfile::load(path);
  for (auto p : {model::Phase::Fwd, model::Phase::Bwd})
    for (double q : {64.0, 100.0, 300.0, 1024.0})
      for (double k : {q, 2 * q, 1024.0})
        EXPECT_DOUBLE_EQ(tiny.attnGflops(p, q, k), base.attnGflops(p, q, k)) << q << " " << k;
}

// The analytic curve counts whole query tiles, as the padded FLOPs do: a piece shorter
// than a tile costs one tile (no more), and a longer piece never costs less than a shorter
// one with the same prefix (a 1-query piece used to cost more than a 10-query one).
TEST(HardwareProfile, AnalyticAttentionCostGrowsWithThePiece) {
  const auto hw = model::HardwareProfile::analytic();
  ASSERT_TRUE(hw.fwd.empty());
  const model::ModelDims dims = smallDims();
  const model::CostModel cm(dims, hw);
  for (auto p : {model::Phase::Fwd, model::Phase::Bwd}) {
    for (std::int64_t q0 : {0, 100, 4096}) {
      // Same key tiles when the prefix ends on a tile edge: then the same cost.
      if (q0 % hw.tile_k == 0) {
        EXPECT_DOUBLE_EQ(cm.attnSeconds(q0, 1, p), cm.attnSeconds(q0, hw.tile_q, p));
      }
      double prev = 0.0;
      for (std::int64_t q = 1; q <= 4 * hw.tile_q + 3; ++q) {
        const double s = cm.attnSeconds(q0, q, p);
        EXPECT_GE(s, prev) << "q0 " << q0 << " q " << q;
        prev = s;
      }
    }
    // Whole tiles keep the curve they always had: 0.7 * q / (q + tile_q).
    const double q = 4.0 * static_cast<double>(hw.tile_q);
    EXPECT_NEAR(hw.attnGflops(p, q, q), hw.peak_gflops * 0.7 * 0.8, 1e-9 * hw.peak_gflops);
  }
}

// The bootstrap interval of a throughput ratio leaves out resamples whose baseline steps
// are all empty (a fixed_greedy window still filling: no tokens, no ratio); it used to count
// them as 0, so a strategy compared with itself got [0, 1] around 1.
TEST(Throughput, SpeedupIntervalSkipsResamplesWithoutBaseTokens) {
  const std::vector<model::StepWork> steps = {{0.0, 0.0, 0.0}, {0.0, 0.0, 0.0}, {2.0, 100.0, 1e9}};
  const auto self = model::throughputSpeedup(steps, steps);
  EXPECT_DOUBLE_EQ(self.value, 1.0);
  EXPECT_DOUBLE_EQ(self.lo, 1.0);
  EXPECT_DOUBLE_EQ(self.hi, 1.0);
  std::vector<model::StepWork> faster = steps;
  faster[2].seconds = 1.0;
  const auto r = model::throughputSpeedup(steps, faster);
  EXPECT_DOUBLE_EQ(r.value, 2.0);
  EXPECT_DOUBLE_EQ(r.lo, 2.0);
  EXPECT_DOUBLE_EQ(r.hi, 2.0);
}

// A drain is a bug only once it stops making progress: a long document trains a window a
// step for as long as it takes (200000 tokens at a window of 16: 12500 steps), and a
// packer may hold documents for a few steps while they wait.
TEST(Throughput, DrainWatchStopsOnlyAStalledDrain) {
  model::DrainWatch slow;
  for (std::int64_t pending = 200000; pending > 0; pending -= 16) ASSERT_FALSE(slow.stalled(pending));
  model::DrainWatch waiting;
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(waiting.stalled(100));  // held while it waits
  EXPECT_FALSE(waiting.stalled(40));
  model::DrainWatch stuck;
  EXPECT_FALSE(stuck.stalled(7));
  for (std::int64_t i = 1; i < model::kMaxDrainSteps; ++i) ASSERT_FALSE(stuck.stalled(7));
  EXPECT_TRUE(stuck.stalled(7));
}
