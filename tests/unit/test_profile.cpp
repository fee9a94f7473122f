// wlb-timeout: 120
// The kernel profiler (profile/profiler.hpp) on the host: a tiny attention grid gives a
// version-1 profile of the documented shape (docs/profile-format.md), a deck gives the
// version-2 parts shaped by its plans, a base profile's unmeasured fields are carried over,
// bad options fail before anything is timed, and the profile is written atomically. No
// timing is asserted beyond "measured and positive": the machines are shared.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/output_file.hpp"
#include "profile/profiler.hpp"

using namespace wlb;
namespace fs = std::filesystem;

namespace {

std::string tmpPath(const std::string& name) {
  return ::testing::TempDir() + "/profile_" + name;
}

/// Fast settings: one repetition, a millisecond each.
profile::ProfileOptions quickOptions() {
  profile::ProfileOptions o;
  o.quick = true;
  o.reps = 1;
  o.min_seconds = 0.001;
  o.progress = false;
  return o;
}

/// The deck of tests/cli/test_calibrate.sh: two CP ranks, three strategies, a few steps.
std::string tinyDeck(const std::string& name, int ffn = 96) {
  const std::string path = tmpPath(name);
  std::ofstream(path) << "[model]\nname = \"tiny\"\nhidden = 64\nheads = 4\nkv_heads = 2\nffn = " << ffn
                      << "\nlayers = 1\n\n[mesh]\ncp = 2\n\n[data]\nseed = 7\ncontext_window = 1024\n"
                         "length_scale = 0.0078125\n\n[packing]\nmicro_batches = 2\n\n[cp]\ncomm = "
                         "\"sharding_aware\"\n\n[run]\nsteps = 2\nwarmup = 1\nstrategies = [\"plain\", \"fixed\", "
                         "\"wlb\"]\n";
  return path;
}

bool ascending(const std::vector<std::int64_t>& v) {
  return std::adjacent_find(v.begin(), v.end(), [](auto a, auto b) { return a >= b; }) == v.end();
}

void expectTable(const nlohmann::json& t, std::size_t rows, std::size_t cols) {
  ASSERT_EQ(t.at("gflops").size(), rows);
  for (const auto& r : t.at("gflops")) {
    ASSERT_EQ(r.size(), cols);
    for (const auto& x : r) EXPECT_GT(x.get<double>(), 0.0);
  }
}

}  // namespace

TEST(Profile, GridGivesVersion1Profile) {
  auto o = quickOptions();
  o.name = "unit";
  o.q_lens = {64, 16, 64};  // sorted and made distinct
  o.k_lens = {16, 64, 100};
  o.head_dim = 32;
  o.tile_q = 32;
  o.tile_k = 16;
  const auto r = profile::measureProfile(o);
  const auto& j = r.profile;
  EXPECT_EQ(j.at("format"), "wlb-hardware-profile");
  EXPECT_EQ(j.at("version"), 1);
  EXPECT_EQ(j.at("name"), "unit");
  EXPECT_EQ(j.at("tile_q"), 32);
  EXPECT_EQ(j.at("tile_k"), 16);
  EXPECT_EQ(j.at("head_dim"), 32);
  EXPECT_EQ(r.tile_q, 32);
  EXPECT_EQ(r.tile_k, 16);
  EXPECT_EQ(r.head_dim, 32);
  EXPECT_GT(j.at("peak_gflops").get<double>(), 0.0);
  EXPECT_GT(j.at("linear_gflops").get<double>(), 0.0);
  EXPECT_GT(r.linear_gflops, 0.0);
  EXPECT_FALSE(j.contains("linear_ops"));
  EXPECT_FALSE(j.contains("deck_profile"));
  EXPECT_GE(j.at("sources").size(), 2u);
  for (const char* ph : {"fwd", "bwd"}) {
    const auto& t = j.at("attention").at(ph);
    EXPECT_EQ(t.at("q_lens").get<std::vector<std::int64_t>>(), (std::vector<std::int64_t>{16, 64}));
    EXPECT_EQ(t.at("k_lens").get<std::vector<std::int64_t>>(), (std::vector<std::int64_t>{16, 64, 100}));
    expectTable(t, 2, 3);
    // a k < q cell carries the value measured at k = q: one measurement, written twice
    EXPECT_EQ(t.at("gflops")[1][0], t.at("gflops")[1][1]);
  }
  // the file format the cost model reads: the document round-trips through writeProfile
  const std::string path = tmpPath("grid.json");
  std::vector<std::pair<std::string, bool>> tracked;
  profile::writeProfile(j, path, [&](const std::string& p, bool made) { tracked.emplace_back(p, made); });
  std::ifstream in(path);
  EXPECT_EQ(nlohmann::json::parse(in), j);
  ASSERT_EQ(tracked.size(), 2u);
  EXPECT_TRUE(tracked[0].second);
  EXPECT_FALSE(tracked[1].second);
  EXPECT_EQ(tracked[0].first, tracked[1].first);
  EXPECT_FALSE(fs::exists(tracked[0].first));  // the temporary was renamed
}

TEST(Profile, BaseFieldsAreCarriedOver) {
  const std::string base = tmpPath("base.json");
  std::ofstream(base) << R"({"peak_gflops": 1234.5, "links": {"cp_gbps": 7.0}, "description": "theirs",
                             "linear_gflops": 1.0})";
  auto o = quickOptions();
  o.q_lens = {16};
  o.k_lens = {16};
  o.head_dim = 16;
  o.base = base;
  const auto j = profile::measureProfile(o).profile;
  EXPECT_EQ(j.at("peak_gflops"), 1234.5);  // the base's peak wins; the measured one is kept beside it
  EXPECT_TRUE(j.contains("measured_fma_gflops"));
  EXPECT_EQ(j.at("links").at("cp_gbps"), 7.0);
  EXPECT_NE(j.at("linear_gflops"), 1.0);  // measured here, not carried over
  EXPECT_NE(j.at("description"), "theirs");
  EXPECT_NE(j.at("sources").back().get<std::string>().find("carried over from base profile"), std::string::npos);
}

TEST(Profile, BadOptionsFailBeforeMeasuring) {
  const auto bad = [](const std::string& says, auto edit) {
    auto o = quickOptions();
    o.q_lens = {16};
    o.k_lens = {16};
    edit(o);
    try {
      profile::measureProfile(o);
      ADD_FAILURE() << "no InputError; want one naming " << says;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  bad("--tile-q", [](auto& o) { o.tile_q = 24; });
  bad("--head-dim", [](auto& o) { o.head_dim = 0; });
  bad("--head-dim", [](auto& o) { o.head_dim = 512; });
  bad("--heads", [](auto& o) {
    o.heads = 3;
    o.kv_heads = 2;
  });
  bad("--q-lens", [](auto& o) { o.q_lens = {0, 16}; });
  bad("--reps", [](auto& o) { o.reps = 0; });
  bad("--precision", [](auto& o) { o.precision = "fp64"; });
  bad("--base", [](auto& o) { o.base = tmpPath("nosuch.json"); });
  std::ofstream(tmpPath("array.json")) << "[1, 2]\n";
  bad("--base", [](auto& o) { o.base = tmpPath("array.json"); });  // JSON, but not a profile's fields
  bad("nosuch.toml", [](auto& o) { o.decks = {tmpPath("nosuch.toml")}; });
  const std::string deck = tinyDeck("bad_opts.toml");
  bad("come from the deck", [&](auto& o) {
    o.decks = {deck};
    o.head_opts_given = true;  // the deck gives the heads
  });
  const std::string other = tinyDeck("other_ffn.toml", 128);
  bad("model.ffn", [&](auto& o) { o.decks = {deck, other}; });  // one layer shape per profile
}

TEST(Profile, WriteUnderAFileIsBadInput) {
  std::vector<std::pair<std::string, bool>> tracked;
  std::ofstream(tmpPath("afile")) << "x";
  const std::string path = tmpPath("afile/p.json");
  EXPECT_THROW(profile::writeProfile(nlohmann::json{{"format", "wlb-hardware-profile"}}, path,
                                     [&](const std::string& p, bool made) { tracked.emplace_back(p, made); }),
               InputError);
  EXPECT_FALSE(fs::exists(path));
  // whatever temporary was registered was forgotten again (here none: the folder fails first)
  std::size_t made = 0;
  for (const auto& t : tracked) made += t.second ? 1 : 0;
  EXPECT_EQ(2 * made, tracked.size());
}

TEST(Profile, DeckShapedProfile) {
  const std::string deck = tinyDeck("tiny.toml");
  auto o = quickOptions();
  o.decks = {deck};
  o.name = "deck";
  const auto r = profile::measureProfile(o);
  const auto& j = r.profile;
  EXPECT_EQ(j.at("version"), 2);
  // heads and head_dim come from the deck: 4 heads, 2 KV heads, 64 / 4 = 16 per head
  EXPECT_EQ(j.at("head_dim"), 16);
  EXPECT_EQ(r.head_dim, 16);

  const auto& dp = j.at("deck_profile");
  EXPECT_EQ(dp.at("decks"), nlohmann::json::array({"profile_tiny.toml"}));  // file names
  EXPECT_EQ(dp.at("strategies").size(), 3u);
  EXPECT_GT(dp.at("planned_steps").get<std::int64_t>(), 0);
  EXPECT_GT(dp.at("rank_batches").get<std::int64_t>(), 0);
  EXPECT_GE(dp.at("pieces").get<std::int64_t>(), dp.at("rank_batches").get<std::int64_t>());
  const auto tok = dp.at("tokens_per_rank").get<std::vector<std::int64_t>>();
  ASSERT_EQ(tok.size(), 2u);
  EXPECT_LE(tok[0], tok[1]);
  EXPECT_FALSE(dp.at("timed_batches").empty());
  for (const auto& b : dp.at("timed_batches")) {
    EXPECT_GT(b.at("tokens").get<std::int64_t>(), 0);
    EXPECT_GT(b.at("fwd_s").at("measured").get<double>(), 0.0);
    EXPECT_GT(b.at("bwd_s").at("table").get<double>(), 0.0);
  }

  // attention grid over the plans' piece shapes
  const auto pq = dp.at("piece_q").get<std::vector<std::int64_t>>();
  const auto pk = dp.at("piece_k").get<std::vector<std::int64_t>>();
  for (const char* ph : {"fwd", "bwd"}) {
    const auto& t = j.at("attention").at(ph);
    const auto q = t.at("q_lens").get<std::vector<std::int64_t>>(), k = t.at("k_lens").get<std::vector<std::int64_t>>();
    EXPECT_TRUE(ascending(q));
    EXPECT_TRUE(ascending(k));
    EXPECT_EQ(q.front(), pq[0]);
    EXPECT_EQ(q.back(), pq[1]);
    EXPECT_EQ(k.front(), pk[0]);
    EXPECT_EQ(k.back(), pk[1]);
    expectTable(t, q.size(), k.size());
  }

  // linear ops at the plans' token counts, including context_window / cp where the cost
  // model reads them
  const auto& lo = j.at("linear_ops");
  EXPECT_EQ(lo.at("shape").at("hidden"), 64);
  EXPECT_EQ(lo.at("shape").at("ffn"), 96);
  EXPECT_EQ(lo.at("shape").at("tp"), 1);
  const auto tokens = lo.at("tokens").get<std::vector<std::int64_t>>();
  EXPECT_TRUE(ascending(tokens));
  EXPECT_NE(std::find(tokens.begin(), tokens.end(), 512), tokens.end());
  for (const char* op : {"qkv_proj", "out_proj", "mlp"})
    for (const char* ph : {"fwd", "bwd"}) {
      const auto g = lo.at("gflops").at(op).at(ph).get<std::vector<double>>();
      ASSERT_EQ(g.size(), tokens.size()) << op << " " << ph;
      for (double x : g) EXPECT_GT(x, 0.0) << op << " " << ph;
    }
  for (const char* key : {"elementwise_ns_per_token", "fill_ns_per_token"})
    for (const char* ph : {"fwd", "bwd"}) {
      const auto v = lo.at(key).at(ph).get<std::vector<double>>();
      ASSERT_EQ(v.size(), tokens.size()) << key;
      for (double x : v) EXPECT_GE(x, 0.0) << key;
    }
  // the backward's selective recomputation, measured beside the ops (its own events)
  const auto rc = lo.at("recompute_ns_per_token").get<std::vector<double>>();
  ASSERT_EQ(rc.size(), tokens.size());
  for (double x : rc) EXPECT_GT(x, 0.0);

  // factors: every key of the format, the attention ones fitted and clamped
  const auto& f = j.at("factors");
  for (const char* key : {"attn.fwd", "attn.bwd"}) {
    const double x = f.at(key).get<double>();
    EXPECT_GE(x, 1e-3);
    EXPECT_LE(x, 1e3);
  }
}

// The one temp-and-rename writer (core/output_file.hpp) that writeProfile, validate-sim and
// the driver's text outputs share: a failure after the temporary exists removes it, leaves
// the previous file as it was, and forgets the temporary it registered.
TEST(Profile, AtomicWriteLeavesNothingOnFailure) {
  const std::string dir = tmpPath("atomic");
  fs::remove_all(dir);  // a run before this one leaves its files
  fs::create_directories(dir);
  std::vector<std::pair<std::string, bool>> tracked;
  const auto track = [&](const std::string& p, bool made) { tracked.emplace_back(p, made); };
  const auto leftovers = [&] {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir))
      n += e.path().filename().string().find(".tmp.") != std::string::npos;
    return n;
  };
  // the rename fails: the target is a folder
  fs::create_directories(dir + "/taken");
  EXPECT_THROW(writeFileAtomically(dir + "/taken", "--out", "text\n", track), InputError);
  EXPECT_TRUE(fs::is_directory(dir + "/taken"));
  ASSERT_EQ(tracked.size(), 2u);
  EXPECT_TRUE(tracked[0].second);
  EXPECT_FALSE(tracked[1].second);
  EXPECT_EQ(leftovers(), 0u);
  // the check of the complete temporary fails: the old file stays
  const std::string path = dir + "/p.json";
  std::ofstream(path) << "old\n";
  EXPECT_THROW(
      writeFileAtomically(path, "--out", "new\n", track, [](const std::string&) { throw InputError("does not load"); }),
      InputError);
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "old");
  EXPECT_EQ(leftovers(), 0u);
  EXPECT_EQ(tracked.size(), 4u);
  // and it succeeds: the new text, no temporary
  writeFileAtomically(path, "--out", "new\n", track);
  std::ifstream in2(path);
  std::getline(in2, line);
  EXPECT_EQ(line, "new");
  EXPECT_EQ(leftovers(), 0u);
  // into folders it makes: a failure removes them again (they are tracked for a signal too)
  tracked.clear();
  EXPECT_THROW(writeFileAtomically(dir + "/new/deeper/p.json", "--out", "x\n", track,
                                   [](const std::string&) { throw InputError("does not load"); }),
               InputError);
  EXPECT_FALSE(fs::exists(dir + "/new"));
  EXPECT_EQ(tracked.size(), 6u);  // two folders and the temporary, each made and forgotten
  writeFileAtomically(dir + "/new/deeper/p.json", "--out", "x\n", track);
  EXPECT_TRUE(fs::is_regular_file(dir + "/new/deeper/p.json"));
}
