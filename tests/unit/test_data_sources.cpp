// wlb-timeout: 120
// Length sources: presets (determinism, caps, shape), readers (text, JSONL, Megatron .idx
// built from the format spec), bad-file errors, checkpoint of the source position.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"
#include "data/length_source.hpp"

using namespace wlb;

namespace {
Deck smallDeck(const std::string& preset, std::uint64_t seed = 7) {
  Deck d;
  d.data.source = "generator";
  d.data.preset = preset;
  d.data.seed = seed;
  d.data.context_window = 8192;
  d.data.length_scale = preset == "long_context_128k" ? 1.0 / 16 : 1.0;
  d.mesh.dp = 2;
  d.packing.micro_batches = 4;
  return d;
}
std::string tmpPath(const std::string& name) {
  return ::testing::TempDir() + "/data_" + name;
}
void writeFile(const std::string& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
}
template <class T>
void put(std::string& b, T v) {
  b.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
std::string expectInputError(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InputError";
  return "";
}
}  // namespace

TEST(DataPresets, DeterministicCappedContiguousAndFillSteps) {
  for (const auto& name : data::presetNames()) {
    auto a = data::makeLengthSource(smallDeck(name));
    auto b = data::makeLengthSource(smallDeck(name));
    auto c = data::makeLengthSource(smallDeck(name, 8));
    DocId next = 0;
    bool differs = false;
    for (std::int64_t t = 0; t < 50; ++t) {
      auto da = a->next(t), db = b->next(t), dc = c->next(t);
      ASSERT_EQ(da.size(), db.size()) << name;
      std::int64_t seqs = 0, room = 0;
      for (std::size_t i = 0; i < da.size(); ++i) {
        EXPECT_EQ(da[i].length, db[i].length);
        EXPECT_EQ(da[i].id, next++);
        EXPECT_EQ(da[i].arrival_step, t);
        EXPECT_GE(da[i].length, 1);
        EXPECT_LE(da[i].length, 8192) << name;
        if (da[i].length > room) {
          ++seqs;
          room = 8192;
        }
        room -= da[i].length;
      }
      EXPECT_LE(seqs, 8) << name << " step " << t;  // fits the original dataloader batch
      if (dc.size() != da.size() || dc[0].length != da[0].length) differs = true;
    }
    EXPECT_TRUE(differs) << name << ": seed has no effect";
  }
}

TEST(DataPresets, LongContextShape) {
  Deck d = smallDeck("long_context_128k");
  d.data.context_window = 131072;
  d.data.length_scale = 1.0;
  auto src = data::makeLengthSource(d);
  std::vector<std::int64_t> lens;
  for (std::int64_t t = 0; t < 60; ++t)
    for (const auto& doc : src->next(t)) lens.push_back(doc.length);
  const auto st = data::computeLengthStats(lens, 131072);
  EXPECT_EQ(st.max, 131072);                      // longest reach the window
  EXPECT_LT(st.percentiles[2].second, 131072 / 32);  // median short
  std::int64_t under_half = 0;
  for (auto l : lens)
    if (l < 65536) under_half += l;
  EXPECT_GT(static_cast<double>(under_half) / static_cast<double>(st.total_tokens), 0.5);
}

TEST(DataPresets, LengthScaleAndUnknownPreset) {
  data::Rng r1(1), r2(1);
  const auto& p = data::presetByName("pile");
  for (int i = 0; i < 100; ++i) {
    const auto a = data::sampleLength(p, r1, 1.0, 0), b = data::sampleLength(p, r2, 0.5, 0);
    EXPECT_NEAR(static_cast<double>(b), std::max(1.0, a * 0.5), 1.0);
  }
  const auto msg = expectInputError([] { data::presetByName("nope"); });
  EXPECT_NE(msg.find("data.preset"), std::string::npos);
  EXPECT_NE(msg.find("long_context_128k"), std::string::npos);
}

TEST(DataSources, SaveRestoreReproducesStream) {
  for (const auto& name : {"long_context_128k", "sft_chat"}) {
    auto a = data::makeLengthSource(smallDeck(name));
    for (std::int64_t t = 0; t < 13; ++t) a->next(t);
    const auto state = a->saveState();
    auto b = data::makeLengthSource(smallDeck(name));
    b->loadState(nlohmann::json::parse(state.dump()));
    for (std::int64_t t = 13; t < 30; ++t) {
      auto da = a->next(t), db = b->next(t);
      ASSERT_EQ(da.size(), db.size());
      for (std::size_t i = 0; i < da.size(); ++i) {
        EXPECT_EQ(da[i].id, db[i].id);
        EXPECT_EQ(da[i].length, db[i].length);
      }
    }
    EXPECT_THROW(b->next(5), InputError);  // out of order
  }
}

TEST(DataReaders, TextCommentsErrorsAndWrapAround) {
  const auto p = tmpPath("lens.txt");
  writeFile(p, "# lengths\n100\n\n  2000  # a comment\n9000\n");
  EXPECT_EQ(data::readTextLengths(p), (std::vector<std::int64_t>{100, 2000, 9000}));
  Deck d = smallDeck("pile");
  d.data.source = "text";
  d.data.path = p;
  d.mesh.dp = 1;
  d.packing.micro_batches = 1;
  auto src = data::makeLengthSource(d);
  EXPECT_EQ(src->documentsPerEpoch(), 3);
  std::vector<std::int64_t> seen;
  for (std::int64_t t = 0; t < 6; ++t)
    for (const auto& doc : src->next(t)) seen.push_back(doc.length);
  // Wraps around; 9000 > S is kept whole (packers split it).
  ASSERT_GE(seen.size(), 6u);
  EXPECT_EQ(seen[3], 100);
  EXPECT_EQ(seen[5], 9000);
  const auto bad = tmpPath("bad.txt");
  writeFile(bad, "10\n20\nabc\n");
  auto msg = expectInputError([&] { data::readTextLengths(bad); });
  EXPECT_NE(msg.find(bad + ":3"), std::string::npos) << msg;
  writeFile(bad, "10\n-5\n");
  msg = expectInputError([&] { data::readTextLengths(bad); });
  EXPECT_NE(msg.find(":2"), std::string::npos) << msg;
  msg = expectInputError([&] { data::readTextLengths(tmpPath("missing.txt")); });
  EXPECT_NE(msg.find("missing.txt"), std::string::npos);
}

TEST(DataReaders, Jsonl) {
  const auto p = tmpPath("lens.jsonl");
  writeFile(p, "{\"length\": 5, \"text\": \"x\"}\n{\"length\": 70}\n\n{\"n_tokens\": 3}\n");
  auto msg = expectInputError([&] { data::readJsonlLengths(p, "length"); });
  EXPECT_NE(msg.find(p + ":4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("length"), std::string::npos);
  writeFile(p, "{\"n_tokens\": 5}\n{\"n_tokens\": 70}\n");
  EXPECT_EQ(data::readJsonlLengths(p, "n_tokens"), (std::vector<std::int64_t>{5, 70}));
  writeFile(p, "{\"n_tokens\": 5}\n{broken\n");
  msg = expectInputError([&] { data::readJsonlLengths(p, "n_tokens"); });
  EXPECT_NE(msg.find(p + ":2"), std::string::npos) << msg;
  // A NUL byte ended nlohmann's input: the document after it on the line was dropped.
  writeFile(p, std::string("{\"n_tokens\": 5}\n{\"n_tokens\": 6}\0{\"n_tokens\": 7}\n", 48));
  msg = expectInputError([&] { data::readJsonlLengths(p, "n_tokens"); });
  EXPECT_NE(msg.find(p + ":2: invalid JSON"), std::string::npos) << msg;
  EXPECT_NE(msg.find("NUL byte"), std::string::npos) << msg;
}

TEST(DataReaders, MegatronIdxFromSpec) {
  // Hand-built MMIDIDX: 5 sequences, 3 documents (doc_idx = 0, 2, 3, 5):
  // doc0 = 10+20, doc1 = 7, doc2 = 100+1.
  std::string b("MMIDIDX\0\0", 9);
  put<std::uint64_t>(b, 1);
  put<std::uint8_t>(b, 4);
  put<std::uint64_t>(b, 5);
  put<std::uint64_t>(b, 4);
  for (std::int32_t s : {10, 20, 7, 100, 1}) put(b, s);
  std::int64_t ptr = 0;
  for (std::int32_t s : {10, 20, 7, 100, 1}) {
    put(b, ptr);
    ptr += 4 * s;
  }
  for (std::int64_t d : {0, 2, 3, 5}) put(b, d);
  const auto p = tmpPath("ds.idx");
  writeFile(p, b);
  EXPECT_EQ(data::readMegatronIdx(p), (std::vector<std::int64_t>{30, 7, 101}));
  // Truncated: cut inside the pointers array.
  const auto t = tmpPath("trunc.idx");
  writeFile(t, b.substr(0, 34 + 20 + 12));
  auto msg = expectInputError([&] { data::readMegatronIdx(t); });
  EXPECT_NE(msg.find("byte offset"), std::string::npos) << msg;
  EXPECT_NE(msg.find("trunc.idx"), std::string::npos) << msg;
  writeFile(t, b.substr(0, 12));
  msg = expectInputError([&] { data::readMegatronIdx(t); });
  EXPECT_NE(msg.find("byte offset 9"), std::string::npos) << msg;
  std::string bad = b;
  bad[0] = 'X';
  writeFile(t, bad);
  msg = expectInputError([&] { data::readMegatronIdx(t); });
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;
  // A pointer that is negative or not a whole int32 token (a token reader would slice
  // other tokens): refused at its byte offset (pointers[] starts at 34 + 5 * 4).
  for (const std::int64_t p1 : {std::int64_t{18}, std::int64_t{-8}}) {
    bad = b;
    std::memcpy(bad.data() + 54 + 8, &p1, 8);
    writeFile(t, bad);
    msg = expectInputError([&] { data::readMegatronIdx(t); });
    EXPECT_NE(msg.find("byte offset 62: invalid pointers[1] = " + std::to_string(p1)), std::string::npos) << msg;
  }
  // doc_idx ending before the last sequence (sequences 3 and 4 in no document) or empty:
  // refused at the offset of its last entry, not read as fewer tokens (doc_idx at 94).
  bad = b;
  const std::int64_t short_end = 3;
  std::memcpy(bad.data() + 94 + 24, &short_end, 8);
  writeFile(t, bad);
  msg = expectInputError([&] { data::readMegatronIdx(t); });
  EXPECT_NE(msg.find("byte offset 118: doc_idx ends at sequence 3, but the index holds 5 sequences"), std::string::npos)
      << msg;
  bad = b.substr(0, 94);
  const std::uint64_t no_docs = 0;
  std::memcpy(bad.data() + 26, &no_docs, 8);
  writeFile(t, bad);
  msg = expectInputError([&] { data::readMegatronIdx(t); });
  EXPECT_NE(msg.find("doc_idx is empty"), std::string::npos) << msg;
  // An index of empty documents only: refused as a length source, read as none for a
  // dataset's empty validation split.
  const auto e = tmpPath("empty.idx");
  data::writeMegatronIdx(e, {});
  msg = expectInputError([&] { data::readMegatronIdx(e); });
  EXPECT_NE(msg.find("no non-empty documents"), std::string::npos) << msg;
  EXPECT_TRUE(data::readMegatronIdx(e, /*allow_empty=*/true).empty());
  // Round trip through the writer.
  const auto w = tmpPath("rt.idx");
  data::writeMegatronIdx(w, {5, 6, 70000});
  EXPECT_EQ(data::readMegatronIdx(w), (std::vector<std::int64_t>{5, 6, 70000}));
  // A path it cannot replace (a folder): an error, and no temporary left beside it.
  const auto dir = tmpPath("folder.idx");
  std::filesystem::create_directories(dir);
  msg = expectInputError([&] { data::writeMegatronIdx(dir, {5}); });
  EXPECT_NE(msg.find("folder.idx"), std::string::npos) << msg;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(dir).parent_path()))
    EXPECT_EQ(e.path().filename().string().find("folder.idx.tmp"), std::string::npos) << e.path();
}

TEST(DataStats, Buckets) {
  const auto st = data::computeLengthStats({1, 2, 3, 1000, 4096, 5000}, 4096);
  EXPECT_EQ(st.count, 6);
  EXPECT_EQ(st.total_tokens, 1 + 2 + 3 + 1000 + 4096 + 5000);
  std::int64_t c = 0, tok = 0;
  for (const auto& bk : st.buckets) {
    c += bk.count;
    tok += bk.tokens;
  }
  EXPECT_EQ(c, 6);
  EXPECT_EQ(tok, st.total_tokens);
  EXPECT_EQ(st.buckets.back().count, 1);  // > S
}
