// Deck parsing: good decks resolve, every kind of bad deck is rejected naming the key.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/deck.hpp"
#include "core/deck_schema.hpp"
#include "core/error.hpp"

namespace {

std::string errorOf(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    (void)wlb::parseDeck(text, "test.toml", overrides);
  } catch (const wlb::InputError& e) {
    return e.what();
  }
  return "";
}

TEST(Deck, EmptyDeckResolvesDefaults) {
  const wlb::Deck d = wlb::parseDeck("", "empty.toml");
  EXPECT_EQ(d.model.head_dim, d.model.hidden / d.model.heads);
  EXPECT_EQ(d.data.s_max, d.data.context_window);
  EXPECT_EQ(d.packing.micro_batches, d.mesh.pp);
}

TEST(Deck, FullDeckParses) {
  const wlb::Deck d = wlb::parseDeck(R"(
[model]
hidden = 4096
heads = 32
kv_heads = 8
ffn = 14336
layers = 32
[mesh]
tp = 8
cp = 2
pp = 4
dp = 1
[data]
context_window = 131072
s_max = 163840
seed = 7
[packing]
strategy = "fixed_greedy"
micro_batches = 8
outlier_thresholds = [32768, 65536]
[cp]
strategy = "hybrid"
comm = "sharding_aware"
[run]
strategies = ["plain", "wlb", "best_fit+per_document"]
)",
                                     "full.toml");
  EXPECT_EQ(d.model.head_dim, 128);
  EXPECT_EQ(d.mesh.size(), 64);
  EXPECT_EQ(d.data.s_max, 163840);
  EXPECT_EQ(d.packing.outlier_thresholds.size(), 2u);
  const auto s = wlb::resolveStrategies(d);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].packer, "original");
  EXPECT_EQ(s[0].sharding, "per_sequence");
  EXPECT_EQ(s[1].packer, "wlb");
  EXPECT_EQ(s[1].sharding, "adaptive");
  EXPECT_EQ(s[2].packer, "best_fit");
  EXPECT_EQ(s[2].sharding, "per_document");
}

TEST(Deck, ResolvedTomlRoundTrips) {
  const wlb::Deck d = wlb::parseDeck("[model]\nhidden = 1024\nheads = 16\n[data]\nlength_scale = 0.0625\n", "a.toml");
  const std::string text = d.toToml();
  // The derived head_dim is shown as a comment, so the resolved text parses as it is.
  EXPECT_NE(text.find("# head_dim = 64  (derived)"), std::string::npos) << text;
  const wlb::Deck e = wlb::parseDeck(text, "b.toml");
  EXPECT_EQ(e.toToml(), text);
  EXPECT_DOUBLE_EQ(e.data.length_scale, 0.0625);
}

TEST(Deck, OverridesApplyInOrder) {
  const wlb::Deck d = wlb::parseDeck("[mesh]\ncp = 2\n", "o.toml",
                                     {"mesh.cp=4", "cp.strategy=hybrid", "run.strategies=[\"plain\",\"wlb\"]",
                                      "mesh.cp = 8", "data.length_scale=0.5"});
  EXPECT_EQ(d.mesh.cp, 8);
  EXPECT_EQ(d.cp.strategy, "hybrid");
  EXPECT_EQ(d.run.strategies.size(), 2u);
  EXPECT_DOUBLE_EQ(d.data.length_scale, 0.5);
}

TEST(Deck, SetOfASweptKeyPinsIt) {
  // --set names one value of a swept key: that key leaves the sweep, the others stay
  const char* text = R"(
[sweep]
"packing.micro_batches" = [4, 8]
mesh.cp = [1, 2]
)";
  const wlb::Deck d = wlb::parseDeck(text, "p.toml", {"packing.micro_batches=8"});
  EXPECT_EQ(d.packing.micro_batches, 8);
  ASSERT_EQ(d.sweep.size(), 1u);
  EXPECT_EQ(d.sweep.begin()->first, "mesh.cp");
  const wlb::Deck one = wlb::parseDeck(text, "p.toml", {" packing.micro_batches = 4", "mesh.cp=2"});
  EXPECT_TRUE(one.sweep.empty());
  EXPECT_EQ(one.packing.micro_batches, 4);
  EXPECT_EQ(one.mesh.cp, 2);
}

TEST(Deck, SweepExpandsCartesianProduct) {
  const wlb::Deck d = wlb::parseDeck(R"(
[output]
dir = "out"
[sweep]
"data.context_window" = [32768, 65536, 131072]
mesh.cp = [1, 2]
)",
                                     "s.toml");
  const auto cases = wlb::expandSweep(d);
  ASSERT_EQ(cases.size(), 6u);
  std::set<std::pair<std::int64_t, std::int64_t>> seen;
  std::set<std::string> dirs;
  for (const auto& c : cases) {
    seen.insert({c.data.context_window, c.mesh.cp});
    EXPECT_EQ(c.data.s_max, c.data.context_window);  // the default follows each case's window
    EXPECT_TRUE(c.sweep.empty());
    dirs.insert(c.output.dir);
  }
  EXPECT_EQ(seen.size(), 6u);
  EXPECT_EQ(dirs.size(), 6u);
}

// A case folder is one name under output.dir whatever the value: a '/' (or anything a
// folder name should not hold) becomes '_', so "../../x" cannot leave output.dir; two
// values that then name one folder are refused rather than written over each other.
TEST(Deck, SweepCaseFoldersStayInsideOutputDir) {
  const auto cases = wlb::expandSweep(
      wlb::parseDeck("[output]\ndir = \"out\"\n[sweep]\n\"model.name\" = [\"../../x\", \"a/b c\"]\n", "s.toml"));
  ASSERT_EQ(cases.size(), 2u);
  EXPECT_EQ(cases[0].output.dir, "out/model.name-.._.._x");
  EXPECT_EQ(cases[1].output.dir, "out/model.name-a_b_c");
  EXPECT_EQ(cases[0].model.name, "../../x");  // the value itself is unchanged
  try {                                       // refused when the deck loads: its cases are checked there
    (void)wlb::parseDeck("[output]\ndir = \"out\"\n[sweep]\n\"model.name\" = [\"a/b\", \"a_b\"]\n", "s.toml");
    FAIL() << "two cases writing to one folder were accepted";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("same folder out/model.name-a_b"), std::string::npos) << e.what();
  }
}

TEST(Deck, SweptDerivedKeysKeepTheirCaseValues) {
  // micro_batches and s_max default to values derived from other keys; a case that sweeps
  // them gets the swept value, not the derived default
  const auto cases = wlb::expandSweep(wlb::parseDeck(R"(
[mesh]
pp = 2
[model]
layers = 4
[data]
context_window = 8192
[sweep]
"packing.micro_batches" = [2, 8]
"data.s_max" = [16384, 32768]
)",
                                                     "d.toml"));
  ASSERT_EQ(cases.size(), 4u);
  std::set<std::pair<std::int64_t, std::int64_t>> seen;
  for (const auto& c : cases) seen.insert({c.packing.micro_batches, c.data.s_max});
  EXPECT_EQ(seen, (std::set<std::pair<std::int64_t, std::int64_t>>{{2, 16384}, {2, 32768}, {8, 16384}, {8, 32768}}));
}

TEST(Deck, SweepKeepsWrittenValuesThatEqualTheirDerivedDefault) {
  // micro_batches = 4 written with pp = 4 stays 4 in the pp = 2 case (it was reset to the
  // case's pp because it equalled the deck's); s_max written equal to the window stays too,
  // so a threshold within it is no error in a smaller-window case.
  const wlb::Deck d = wlb::parseDeck(R"(
[mesh]
pp = 4
[model]
layers = 8
[data]
context_window = 65536
s_max = 65536
[packing]
micro_batches = 4
outlier_thresholds = [40000]
[sweep]
"mesh.pp" = [2, 4]
"data.context_window" = [32768, 65536]
)",
                                     "d.toml");
  for (const auto& c : wlb::expandSweep(d)) {
    EXPECT_EQ(c.packing.micro_batches, 4) << c.output.dir;
    EXPECT_EQ(c.data.s_max, 65536) << c.output.dir;
  }
  // Derived ones still follow the case.
  const wlb::Deck derived =
      wlb::parseDeck("[mesh]\npp = 4\n[model]\nlayers = 8\n[sweep]\n\"mesh.pp\" = [2, 4]\n", "d.toml");
  for (const auto& c : wlb::expandSweep(derived)) EXPECT_EQ(c.packing.micro_batches, c.mesh.pp);
}

TEST(Deck, SweepBaseIsOnlyItsCases) {
  // s_max 4096 is below the default 131072 window, but every case sets a window it fits:
  // the deck is valid, and validate's printed deck reads back to the same cases.
  const wlb::Deck d = wlb::parseDeck(
      "[data]\ns_max = 4096\n[packing]\noutlier_thresholds = [1000]\n[sweep]\n\"data.context_window\" = [1024, "
      "2048]\n\"mesh.pp\" = [1, 2]\n[model]\nlayers = 4\n",
      "s.toml");
  const auto cases = wlb::expandSweep(d);
  ASSERT_EQ(cases.size(), 4u);
  for (const auto& c : cases) {
    EXPECT_EQ(c.data.s_max, 4096);
    EXPECT_EQ(c.packing.micro_batches, c.mesh.pp);  // derived, per case
  }
  const auto again = wlb::expandSweep(wlb::parseDeck(d.toToml(), "printed.toml"));
  ASSERT_EQ(again.size(), cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(again[i].toToml(), cases[i].toToml()) << i;
  // Strings with control characters print as TOML that parses back.
  wlb::Deck odd = wlb::parseDeck("[model]\nname = \"a\\rb\\u0001c\\u007f\"\n", "o.toml");
  EXPECT_EQ(wlb::parseDeck(odd.toToml(), "o2.toml").model.name, odd.model.name);
  // A malformed value is an error, not a string with a quote in it; one value per --set.
  EXPECT_THROW((void)wlb::parseDeck("", "x.toml", {"model.name=\"abc"}), wlb::InputError);
  EXPECT_THROW((void)wlb::parseDeck("", "x.toml", {"model.hidden=1024\n[model]\nheads = 3"}), wlb::InputError);
  EXPECT_EQ(wlb::parseDeck("", "x.toml", {"model.name=llama"}).model.name, "llama");
  // output.dir names the sweep's root; the rank product cannot wrap past the limit.
  EXPECT_THROW((void)wlb::parseDeck("[sweep]\n\"output.dir\" = [\"a\", \"b\"]\n", "x.toml"), wlb::InputError);
  try {  // 2^64 ranks: the product wrapped to 0 and passed
    (void)wlb::parseDeck("[mesh]\ntp = 4096\ncp = 65536\npp = 65536\ndp = 1048576\n", "x.toml");
    FAIL() << "2^64 ranks accepted";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("18446744073709551616 ranks; at most"), std::string::npos) << e.what();
  }
}

TEST(Deck, SweepCasesNameTheirOverridesAndStayDistinct) {
  const auto cases = wlb::expandSweep(wlb::parseDeck(
      "[output]\ndir = \"\"\n[sweep]\n\"data.length_scale\" = [0.5, 1e-4]\nmesh.cp = [1, 2]\n", "s.toml"));
  ASSERT_EQ(cases.size(), 4u);
  EXPECT_EQ(cases[0].output.dir.front(), 'd');  // output.dir = "": the working directory, not '/'
  for (const auto& c : cases) {
    ASSERT_EQ(c.sweep_case.size(), 2u);
    EXPECT_EQ(c.sweep_case[0].rfind("data.length_scale=", 0), 0u) << c.sweep_case[0];
    EXPECT_EQ(c.sweep_case[1], "mesh.cp=" + std::to_string(c.mesh.cp));
    // the overrides rebuild the case from the deck without its sweep
    wlb::Deck again = wlb::parseDeck("", "s.toml", c.sweep_case);
    EXPECT_EQ(again.data.length_scale, c.data.length_scale);
  }
  // 1 and 1.0 are one value: the case would run twice into two folders.
  try {
    (void)wlb::expandSweep(wlb::parseDeck("[sweep]\n\"data.length_scale\" = [1, 1.0]\n", "s.toml"));
    FAIL() << "a value listed twice was accepted";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("same deck"), std::string::npos) << e.what();
  }
  // 0 (derive it) and the value it derives to are one case too.
  try {
    (void)wlb::expandSweep(
        wlb::parseDeck("[data]\ncontext_window = 8192\n[sweep]\n\"data.s_max\" = [0, 8192]\n", "s.toml"));
    FAIL() << "s_max 0 beside the s_max it derives was accepted";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("same deck"), std::string::npos) << e.what();
  }
}

TEST(Deck, SweptValueThatBreaksACrossKeyRuleIsRejected) {
  try {  // refused when the deck loads
    (void)wlb::parseDeck("[data]\ncontext_window = 8192\n[sweep]\n\"data.s_max\" = [4096, 16384]\n", "s.toml");
    FAIL() << "s_max 4096 below the 8192 window was accepted";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("data.s_max"), std::string::npos) << e.what();
  }
}

TEST(Deck, CommandOfOneCaseRefusesASweepingDeck) {
  const wlb::Deck d = wlb::parseDeck("[sweep]\n\"mesh.cp\" = [1, 2]\n", "s.toml");
  try {
    wlb::requireOneCase(d, "s.toml", "wlb run");
    FAIL() << "a sweeping deck was accepted";
  } catch (const wlb::InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("s.toml"), std::string::npos) << m;
    EXPECT_NE(m.find("mesh.cp"), std::string::npos) << m;
    EXPECT_NE(m.find("--set"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(wlb::requireOneCase(wlb::parseDeck("[sweep]\n\"mesh.cp\" = [1, 2]\n", "s.toml", {"mesh.cp=2"}),
                                      "s.toml", "wlb run"));
}

struct BadDeck {
  const char* what;
  std::string text;
  std::vector<std::string> overrides;
  std::vector<std::string> expect;  // substrings of the message
};

class BadDecks : public ::testing::TestWithParam<BadDeck> {};

TEST_P(BadDecks, RejectedNamingTheKey) {
  const auto& p = GetParam();
  const std::string msg = errorOf(p.text, p.overrides);
  ASSERT_FALSE(msg.empty()) << p.what << ": deck was accepted";
  for (const auto& e : p.expect)
    EXPECT_NE(msg.find(e), std::string::npos) << p.what << ": '" << msg << "' lacks '" << e << "'";
}

INSTANTIATE_TEST_SUITE_P(
    All, BadDecks,
    ::testing::Values(
        BadDeck{"typo key", "[model]\nhiden = 3\n", {}, {"test.toml:2", "hiden", "[model]", "hidden"}},
        BadDeck{"typo table", "[modle]\nhidden = 3\n", {}, {"[modle]", "[model]"}},
        BadDeck{"key outside table", "hidden = 3\n", {}, {"hidden", "inside a table"}},
        BadDeck{"string for int", "[model]\nhidden = \"big\"\n", {}, {"model.hidden", "integer", "\"big\""}},
        BadDeck{"float for int", "[mesh]\ncp = 2.5\n", {}, {"mesh.cp", "integer"}},
        BadDeck{"zero tp", "[mesh]\ntp = 0\n", {}, {"mesh.tp", "out of range", "[1,"}},
        BadDeck{"negative window", "[data]\ncontext_window = -5\n", {}, {"data.context_window", "-5"}},
        BadDeck{"bad enum", "[cp]\nstrategy = \"per_doc\"\n", {}, {"cp.strategy", "per_document"}},
        BadDeck{"bad packer", "[packing]\nstrategy = \"greedy\"\n", {}, {"packing.strategy", "allowed"}},
        BadDeck{"heads do not divide hidden", "[model]\nhidden = 100\nheads = 3\n", {}, {"model.heads", "divide"}},
        BadDeck{"kv_heads do not divide heads", "[model]\nheads = 8\nkv_heads = 3\n", {}, {"model.kv_heads"}},
        BadDeck{"s_max below window", "[data]\ncontext_window = 4096\ns_max = 2048\n", {}, {"data.s_max", "2048"}},
        BadDeck{"file source without path", "[data]\nsource = \"text\"\n", {}, {"data.path"}},
        BadDeck{"thresholds not increasing",
                "[packing]\noutlier_thresholds = [8000, 4000]\n",
                {},
                {"packing.outlier_thresholds", "increasing"}},
        BadDeck{
            "unknown strategy pair", "[run]\nstrategies = [\"wlb+per_token\"]\n", {}, {"run.strategies", "per_token"}},
        BadDeck{"duplicate strategy", "[run]\nstrategies = [\"wlb\", \"wlb\"]\n", {}, {"run.strategies", "twice"}},
        BadDeck{"virtual stages without interleaving",
                "[mesh]\npp = 2\nvirtual_stages = 2\n[model]\nlayers = 4\n",
                {},
                {"mesh.virtual_stages", "interleaved"}},
        BadDeck{"fewer layers than pipeline stages",
                "[mesh]\npp = 3\n[model]\nlayers = 2\n",
                {},
                {"model.layers", "pp * virtual_stages"}},
        BadDeck{"TOML syntax", "[model\nhidden = 1\n", {}, {"test.toml", "syntax"}},
        BadDeck{"derived key set", "[model]\nhead_dim = 64\n", {}, {"model.head_dim", "derived"}},
        BadDeck{"sweep value twice", "[sweep]\n\"model.hidden\" = [64, 64]\n", {}, {"[sweep]", "64 twice"}},
        BadDeck{"empty plan file name", "[output]\nplan = \"\"\n", {}, {"output.plan", "empty"}},
        BadDeck{"override of a derived key", "", {"model.head_dim=32"}, {"--set", "model.head_dim", "derived"}},
        BadDeck{"sweep of a derived key",
                "[sweep]\n\"model.head_dim\" = [32, 64]\n",
                {},
                {"[sweep]", "model.head_dim", "derived"}},
        BadDeck{"override unknown key", "", {"mesh.ranks=4"}, {"--set", "ranks", "[mesh]"}},
        BadDeck{"override out of range", "", {"mesh.dp=0"}, {"--set", "mesh.dp", "out of range"}},
        BadDeck{"override without table", "", {"cp=2"}, {"--set", "table.key=value"}},
        BadDeck{"sweep not a list", "[sweep]\n\"mesh.cp\" = 2\n", {}, {"[sweep]", "mesh.cp", "array"}},
        BadDeck{"sweep bad value",
                "[sweep]\n\"cp.strategy\" = [\"per_sequence\", \"nope\"]\n",
                {},
                {"cp.strategy", "nope"}},
        BadDeck{"sweep key spelled twice",
                "[sweep]\n\"mesh.cp\" = [1, 2]\n\"mesh.cp \" = [4]\n",
                {},
                {"[sweep]", "both sweep mesh.cp"}},
        BadDeck{"sweep value an inline table",
                "[sweep]\n\"packing.micro_batches\" = [{a = 1}, 2]\n",
                {},
                {"[sweep] 'packing.micro_batches' lists an inline table"}},
        BadDeck{"sweep value an inline table inside an array",
                "[sweep]\n\"packing.micro_batches\" = [2, [{a = 1}]]\n",
                {},
                {"[sweep] 'packing.micro_batches' lists an inline table"}},
        BadDeck{"sweep key quoted and dotted",
                "[sweep]\n\"mesh.cp\" = [1, 2]\nmesh.cp = [4]\n",
                {},
                {"[sweep]", "both sweep mesh.cp"}},
        BadDeck{"tp does not divide ffn",
                "[model]\nheads = 8\nkv_heads = 8\nhidden = 512\nffn = 1001\n[mesh]\ntp = 2\n",
                {},
                {"mesh.tp", "model.ffn"}},
        BadDeck{"tp neither divides nor is a multiple of kv_heads",
                "[model]\nheads = 12\nkv_heads = 6\nhidden = 768\nffn = 1536\n[mesh]\ntp = 4\n",
                {},
                {"mesh.tp", "model.kv_heads"}},
        BadDeck{
            "tp does not divide heads", "[model]\nheads = 8\nhidden = 512\n[mesh]\ntp = 3\n", {}, {"mesh.tp", "heads"}},
        // fuzz_deck: toml11 overran its buffer on this (invalid UTF-8 in a literal string)
        BadDeck{"invalid UTF-8 in a string", "[run]\n'\x81'", {}, {"test.toml:2", "not valid UTF-8", "byte offset 7"}},
        BadDeck{"truncated UTF-8", "# caf\xc3", {}, {"test.toml:1", "not valid UTF-8"}},
        BadDeck{"overlong UTF-8", "# \xc0\xaf\n", {}, {"not valid UTF-8"}},
        BadDeck{"invalid UTF-8 in an override", "", {"output.dir=\"\xff\""}, {"--set", "not valid UTF-8"}}),
    [](const ::testing::TestParamInfo<BadDeck>& i) {
      std::string n = i.param.what;
      for (auto& c : n)
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
      return n;
    });

TEST(Deck, Utf8TextIsAccepted) {
  const auto d =
      wlb::parseDeck("# caf\xc3\xa9 \xe2\x80\x94 \xf0\x9f\x9a\x80\n[output]\ndir = \"r\xc3\xa9sultats\"\n", "u.toml");
  EXPECT_EQ(d.output.dir, "r\xc3\xa9sultats");
}

TEST(Deck, ReferenceCoversEveryKey) {
  const std::string md = wlb::deckReferenceMarkdown();
  for (const auto& k : wlb::deckSchema()) EXPECT_NE(md.find("`" + k.key + "`"), std::string::npos) << k.name();
}

TEST(Deck, ShippedDecksValidate) {
  // every deck under inputs/ (the paper grid and its lists included) loads and expands
  int n = 0, run16 = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(std::string(WLB_SOURCE_DIR) + "/inputs")) {
    if (e.path().extension() != ".toml") continue;
    ++n;
    const std::string f = e.path().string();
    wlb::Deck d;
    EXPECT_NO_THROW(d = wlb::loadDeck(f)) << f;
    EXPECT_NO_THROW((void)wlb::expandSweep(d)) << f;
    EXPECT_NO_THROW((void)wlb::resolveStrategies(d)) << f;
    if (e.path().filename().string().rfind("run16_", 0) == 0) {
      ++run16;
      EXPECT_EQ(d.mesh.tp * d.mesh.cp * d.mesh.pp * d.mesh.dp, 16) << f;  // one rank per core of a 16-core host
    }
  }
  EXPECT_GE(n, 20);
  EXPECT_EQ(run16, 5);
}

}  // namespace

TEST(Deck, PathWithAControlCharacterIsRefused) {
  for (const char* key : {"output.dir", "output.trace", "hardware.profile", "train.dataset"}) {
    try {
      (void)wlb::parseDeck("", "p.toml", {std::string(key) + "=\"a\\tb\""});
      FAIL() << key << " with a tab was accepted";
    } catch (const wlb::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("key '") + key + "': holds the control character 0x09"),
                std::string::npos)
          << e.what();
    }
  }
}
