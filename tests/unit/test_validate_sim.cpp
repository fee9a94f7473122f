// wlb-timeout: 180
// The simulator's validation loop (profile/validate_sim.hpp) on a tiny two-rank deck: every
// stage runs (profile -> calibration run -> calibrate -> validation run -> simulate), the
// report has a row per strategy and predicts the plans that ran, an impossible tolerance
// fails the verdict, a failing stage is StageFailed, and bad options fail before anything
// runs or the output directory is made. Errors themselves are not asserted: timings on a
// shared machine.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "profile/validate_sim.hpp"

using namespace wlb;
namespace fs = std::filesystem;

namespace {

std::string tmpPath(const std::string& name) {
  return ::testing::TempDir() + "/vsim_" + name;
}

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// The deck of tests/cli/test_calibrate.sh (two CP ranks, three strategies) with two
/// layers; `run` and `mesh` replace its strategies and its mesh.
std::string tinyDeck(const std::string& name, const std::string& run = "strategies = [\"plain\", \"fixed\", \"wlb\"]",
                     const std::string& mesh = "cp = 2") {
  const std::string path = tmpPath(name);
  std::ofstream(path) << "[model]\nname = \"tiny\"\nhidden = 64\nheads = 4\nkv_heads = 2\nffn = 96\nlayers = 2\n\n"
                         "[mesh]\n"
                      << mesh
                      << "\n\n[data]\nseed = 7\ncontext_window = 1024\nlength_scale = 0.0078125\n\n"
                         "[packing]\nmicro_batches = 2\n\n[cp]\ncomm = \"sharding_aware\"\n\n[run]\nsteps = 2\nwarmup "
                         "= 1\n"
                      << run << "\n";
  return path;
}

/// Options for a test: this build's `wlb`, one round, a quick profile, a fresh `out`.
profile::ValidateSimOptions options(const std::string& deck, const std::string& out) {
  profile::ValidateSimOptions o;
  o.decks = {deck};
  o.out = tmpPath(out);
  o.wlb = WLB_BINARY;
  o.rounds = 1;
  o.quick = true;
  fs::remove_all(o.out);
  return o;
}

/// Runs validateSim with the stage lines in a file; returns them with the result.
std::pair<profile::ValidateSimResult, std::string> runLogged(profile::ValidateSimOptions o, const std::string& log) {
  const std::string path = tmpPath(log);
  std::FILE* f = std::fopen(path.c_str(), "w");
  EXPECT_NE(f, nullptr);
  o.log = f;
  profile::ValidateSimResult r;
  try {
    r = profile::validateSim(o);
  } catch (...) {
    std::fclose(f);
    std::fprintf(stderr, "%s", readFile(path).c_str());
    throw;
  }
  std::fclose(f);
  return {r, readFile(path)};
}

}  // namespace

TEST(ValidateSim, WholeLoopOnATinyDeck) {
  const std::string deck = tinyDeck("tiny.toml");
  auto o = options(deck, "loop");
  std::vector<std::pair<std::string, bool>> tracked;
  o.track_temporary = [&](const std::string& p, bool made) { tracked.emplace_back(p, made); };
  const auto [r, log] = runLogged(o, "loop.log");

  EXPECT_TRUE(fs::path(r.out).is_absolute());
  const auto& j = r.report;
  EXPECT_EQ(j.at("format"), "wlb-validate-sim");
  EXPECT_EQ(j.at("seed_offset"), 1);
  EXPECT_EQ(j.at("calibration"), "per deck");
  EXPECT_EQ(j.at("pass"), r.pass);
  EXPECT_DOUBLE_EQ(j.at("max_abs_error_percent").get<double>(), r.max_abs_error_percent);
  // the report on disk is the one returned, written under a tracked temporary
  EXPECT_EQ(nlohmann::json::parse(readFile(r.out + "/validation.json")), j);
  ASSERT_EQ(tracked.size(), 2u);
  EXPECT_TRUE(tracked[0].second);
  EXPECT_FALSE(tracked[1].second);

  // the stages in order, each run to success and printed before it ran
  std::vector<std::string> prefixes = {"profile", "measured calibration run", "calibrate", "measured validation run",
                                       "simulate --as-run"};
  ASSERT_EQ(j.at("stages").size(), prefixes.size());
  double stage_cpu = 0;
  for (std::size_t i = 0; i < prefixes.size(); ++i) {
    const auto& st = j.at("stages")[i];
    EXPECT_EQ(st.at("stage").get<std::string>().rfind(prefixes[i], 0), 0u) << st;
    EXPECT_EQ(st.at("exit"), 0);
    EXPECT_GE(st.at("cpu_seconds").get<double>(), 0.0);
    stage_cpu += st.at("cpu_seconds").get<double>();
    EXPECT_NE(log.find("== " + st.at("stage").get<std::string>()), std::string::npos) << log;
  }
  // the report's CPU seconds are the stages' (it once held the CPU model's name)
  EXPECT_DOUBLE_EQ(j.at("cpu_seconds").get<double>(), stage_cpu);
  EXPECT_TRUE(fs::exists(r.out + "/profile.json"));
  EXPECT_TRUE(fs::exists(r.out + "/profile.calibrated.vsim_tiny.json"));

  ASSERT_EQ(j.at("decks").size(), 1u);
  const auto& d = j.at("decks")[0];
  EXPECT_EQ(d.at("deck"), "vsim_tiny");
  EXPECT_EQ(d.at("ranks"), 2);
  EXPECT_EQ(d.at("data_seed"), 8);  // data.seed + seed_offset: documents the calibration did not see
  EXPECT_EQ(d.at("profile"), "profile.calibrated.vsim_tiny.json");
  EXPECT_EQ(d.at("plan_segments_differing"), 0);  // the simulation predicted the plans that ran
  EXPECT_GT(d.at("plan_segments").get<std::int64_t>(), 0);
  std::vector<std::string> names;
  for (const auto& row : d.at("strategies")) {
    names.push_back(row.at("strategy"));
    EXPECT_GT(row.at("measured_tokens_per_second").get<double>(), 0.0);
    EXPECT_GT(row.at("predicted_tokens_per_second").get<double>(), 0.0);
    EXPECT_EQ(row.at("measured_tokens_per_second_rounds").size(), 1u);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"plain", "fixed", "wlb"}));

  for (const auto& s : names) EXPECT_NE(r.table.find("vsim_tiny        " + s), std::string::npos) << r.table;
  EXPECT_NE(r.table.find("ordering by throughput: measured"), std::string::npos);
  EXPECT_NE(r.table.find(r.pass ? "vs tolerance 5.0%: PASS" : "vs tolerance 5.0%: FAIL"), std::string::npos);

  // 2. The calibrated profile as given, not calibrated again: an impossible tolerance fails
  auto o2 = options(deck, "strict");
  o2.profile = r.out + "/profile.calibrated.vsim_tiny.json";
  o2.no_calibrate = true;
  o2.tolerance = 1e-9;
  const auto [r2, log2] = runLogged(o2, "strict.log");
  EXPECT_FALSE(r2.pass);
  EXPECT_EQ(r2.report.at("calibration"), "none");
  ASSERT_EQ(r2.report.at("stages").size(), 2u);  // the validation run and the simulation only
  EXPECT_NE(r2.table.find(": FAIL"), std::string::npos);
}

TEST(ValidateSim, PipelineDeckRunsTheWholeLoop) {
  // pp = 2: the stages split the layers (and the embedding and loss ends), which the
  // calibration sums over; the simulation must predict the plans that ran.
  auto o = options(tinyDeck("pp2.toml", "strategies = [\"plain\", \"wlb\"]", "pp = 2"), "loop_pp2");
  const auto [r, log] = runLogged(o, "loop_pp2.log");
  const auto& j = r.report;
  ASSERT_EQ(j.at("decks").size(), 1u);
  const auto& d = j.at("decks")[0];
  EXPECT_EQ(d.at("ranks"), 2);
  EXPECT_EQ(d.at("plan_segments_differing"), 0);
  EXPECT_GT(d.at("plan_segments").get<std::int64_t>(), 0);
  ASSERT_EQ(d.at("strategies").size(), 2u);
  for (const auto& st : j.at("stages")) EXPECT_EQ(st.at("exit"), 0) << st;
  // the calibrated profile holds a fitted elementwise factor (pp > 1 included)
  const auto prof = nlohmann::json::parse(readFile(r.out + "/profile.calibrated.vsim_pp2.json"));
  EXPECT_NE(prof.at("factors").at("elementwise").get<double>(), 1.0);
  EXPECT_NE(log.find("measured validation run: vsim_pp2"), std::string::npos);
}

TEST(ValidateSim, FailedStageIsStageFailed) {
  auto o = options(tinyDeck("stage.toml"), "stage");
  o.profile = std::string(WLB_SOURCE_DIR) + "/inputs/profiles/epyc-avx2-1core.json";  // read before any stage
  o.no_calibrate = true;
  o.mpirun = "false";  // a launcher that fails
  const std::string log = tmpPath("stage.log");
  std::FILE* f = std::fopen(log.c_str(), "w");
  o.log = f;
  try {
    profile::validateSim(o);
    ADD_FAILURE() << "no StageFailed";
  } catch (const profile::StageFailed& e) {
    EXPECT_EQ(e.exitCode(), 1);
    EXPECT_NE(std::string(e.what()).find(fs::absolute(o.out).string()), std::string::npos) << e.what();
  }
  std::fclose(f);
  EXPECT_NE(readFile(log).find("FAILED (exit 1)"), std::string::npos) << readFile(log);
}

TEST(ValidateSim, BadOptionsFailBeforeAnythingRuns) {
  const std::string deck = tinyDeck("bad.toml");
  const auto bad = [&](const std::string& says, auto edit) {
    auto o = options(deck, "bad");
    edit(o);
    try {
      profile::validateSim(o);
      ADD_FAILURE() << "no InputError; want one naming " << says;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(o.out));
  };
  bad("--tolerance", [](auto& o) { o.tolerance = 0; });
  bad("--seed-offset", [](auto& o) { o.seed_offset = -1; });
  bad("--rounds", [](auto& o) { o.rounds = 0; });
  bad("--steps", [](auto& o) { o.steps = 0; });
  bad("--warmup", [](auto& o) { o.warmup = -2; });
  bad("--profile", [](auto& o) { o.profile = tmpPath("nosuch.json"); });
  bad("no decks", [](auto& o) { o.decks.clear(); });
  bad("nosuch.toml", [](auto& o) { o.decks = {tmpPath("nosuch.toml")}; });
  bad("--calibrate-on", [](auto& o) { o.calibrate_on = {"other"}; });
  bad("--mpirun", [](auto& o) { o.mpirun = "  "; });
  bad("fewer than two strategies", [](auto& o) { o.decks = {tinyDeck("one.toml", "strategies = [\"plain\"]")}; });
}
