// Token datasets: byte tokenizer, .bin/.idx writer <-> reader round trip (and the length
// reader on the same index), the path-hash split, prepareDataset on a small tree.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"
#include "data/indexed_dataset.hpp"
#include "data/length_source.hpp"
#include "data/prepare.hpp"
#include "data/tokenizer.hpp"

using namespace wlb;
namespace fs = std::filesystem;

namespace {
std::string tmpPath(const std::string& name) {
  return ::testing::TempDir() + "/prep_" + name;
}
void writeFile(const fs::path& p, const std::string& s) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << s;
}
std::string decodeDoc(const data::IndexedDataset& ds, std::int64_t i) {
  const auto t = ds.document(i);
  return data::ByteTokenizer::decode(t.data(), t.size());
}
}  // namespace

TEST(DataPrepare, ByteTokenizerRoundTrip) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  std::vector<data::Token> t;
  data::ByteTokenizer::encode(all, t);
  ASSERT_EQ(t.size(), 256u);
  EXPECT_EQ(t[255], 255);
  EXPECT_EQ(data::ByteTokenizer::decode(t.data(), t.size()), all);
  t.push_back(300);
  EXPECT_THROW(data::ByteTokenizer::decode(t.data(), t.size()), InputError);
}

TEST(DataPrepare, WriterReaderRoundTrip) {
  const auto prefix = tmpPath("rt");
  for (const auto* e : {".bin", ".idx"}) fs::remove(prefix + e);  // TempDir outlives a run
  const std::vector<std::string> docs = {"hello", std::string("\0\xff\x80 binary", 10), "x", std::string(70000, 'q')};
  {
    data::IndexedDatasetWriter w(prefix);
    std::vector<data::Token> t;
    for (const auto& d : docs) {
      t.clear();
      data::ByteTokenizer::encode(d, t);
      w.add(t);
    }
    EXPECT_FALSE(fs::exists(prefix + ".idx"));  // nothing under the final name before commit
    w.commit();
    EXPECT_EQ(w.tokens(), 5 + 10 + 1 + 70000);
  }
  for (const auto& t : {prefix + ".bin.tmp", prefix + ".idx.tmp"}) EXPECT_FALSE(fs::exists(t)) << t;
  EXPECT_EQ(fs::file_size(prefix + ".bin"), 2u * (5 + 10 + 1 + 70000));
  data::IndexedDataset ds(prefix);
  EXPECT_EQ(ds.dtype(), data::kMegatronUint16);
  ASSERT_EQ(ds.documents(), 4);
  for (std::int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(ds.length(i), static_cast<std::int64_t>(docs[i].size()));
    EXPECT_EQ(decodeDoc(ds, i), docs[i]) << i;
  }
  // the planning reader sees the same document lengths
  EXPECT_EQ(data::readMegatronIdx(prefix + ".idx"), (std::vector<std::int64_t>{5, 10, 1, 70000}));
  // a .bin shorter than the index says -> InputError naming the index
  fs::resize_file(prefix + ".bin", 100);
  try {
    data::IndexedDataset bad(prefix);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("rt.idx"), std::string::npos) << e.what();
  }
}

TEST(DataPrepare, UnfinishedWriterLeavesNothing) {
  const auto prefix = tmpPath("abandoned");
  {
    data::IndexedDatasetWriter w(prefix);
    w.add(std::vector<data::Token>{1, 2, 3});
  }
  for (const auto& p : {".bin", ".idx", ".bin.tmp", ".idx.tmp"}) EXPECT_FALSE(fs::exists(prefix + p)) << p;
  EXPECT_THROW(data::IndexedDatasetWriter(tmpPath("no/such/dir/x")), InputError);
}

TEST(DataPrepare, SplitByPathHash) {
  // Deterministic, independent of any RNG state; the fraction is honoured on many paths.
  EXPECT_EQ(data::documentHash("a/b.txt"), data::documentHash("a/b.txt"));
  EXPECT_NE(data::documentHash("a/b.txt"), data::documentHash("a/c.txt"));
  int held = 0;
  for (int i = 0; i < 20000; ++i) held += data::inValidSplit("dir/file" + std::to_string(i) + ".c", 0.1);
  EXPECT_NEAR(held / 20000.0, 0.1, 0.01);
  EXPECT_FALSE(data::inValidSplit("anything", 0.0));
}

TEST(DataPrepare, PrepareDirectory) {
  const fs::path root = tmpPath("tree");
  fs::remove_all(root);
  writeFile(root / "b.txt", "second file");
  writeFile(root / "a" / "z.txt", std::string(25, 'z'));
  writeFile(root / "empty", "");
  data::PrepareOptions o;
  o.source = root.string();
  o.out_prefix = tmpPath("out");
  o.max_bytes = 10;
  o.progress = false;
  const auto r = data::prepareDataset(o);
  EXPECT_EQ(r.regular_files, 3);
  EXPECT_EQ(r.skipped_small, 1);
  EXPECT_EQ(r.cut_files, 2);
  EXPECT_EQ(r.train.files, 2);
  EXPECT_EQ(r.train.documents, 5);  // a/z.txt: 10 + 10 + 5, b.txt: 10 + 1 (sorted: a/z.txt first)
  EXPECT_EQ(r.valid.documents, 0);
  data::IndexedDataset ds(r.train_prefix);
  ASSERT_EQ(ds.documents(), 5);
  EXPECT_EQ(decodeDoc(ds, 0), std::string(10, 'z'));
  EXPECT_EQ(decodeDoc(ds, 2), std::string(5, 'z'));
  EXPECT_EQ(decodeDoc(ds, 3), "second fil");
  EXPECT_EQ(decodeDoc(ds, 4), "e");
  EXPECT_EQ(data::IndexedDataset(r.valid_prefix).documents(), 0);

  o.source = (root / "missing").string();
  EXPECT_THROW(data::prepareDataset(o), InputError);
  fs::remove(root / "b.txt");
  fs::remove(root / "a" / "z.txt");
  o.source = root.string();
  EXPECT_THROW(data::prepareDataset(o), InputError);  // only an empty file left
}

// Outputs written inside the source tree: this run's own (PREFIX_*) are never read, and an
// earlier run's with another prefix (any MMIDIDX .idx and the .bin beside it) are token
// datasets, not text: a second preparation under another prefix finds the same documents.
// A .bin without a Megatron index beside it is an ordinary file.
TEST(DataPrepare, DatasetsInsideTheSourceAreNotDocuments) {
  const fs::path root = tmpPath("inside");
  fs::remove_all(root);
  writeFile(root / "a.txt", "first document");
  writeFile(root / "b.txt", "the second document");
  writeFile(root / "blob.bin", "not tokens");
  data::PrepareOptions o;
  o.source = root.string();
  o.out_prefix = (root / "one").string();
  o.progress = false;
  const auto first = data::prepareDataset(o);
  EXPECT_EQ(first.regular_files, 3);
  EXPECT_EQ(first.skipped_datasets, 0);
  o.out_prefix = (root / "two").string();
  const auto second = data::prepareDataset(o);
  EXPECT_EQ(second.regular_files, 3);
  EXPECT_EQ(second.skipped_datasets, 4);  // one_train and one_valid, .bin and .idx each
  EXPECT_EQ(second.train.documents + second.valid.documents, first.train.documents + first.valid.documents);
  EXPECT_EQ(second.train.tokens + second.valid.tokens, first.train.tokens + first.valid.tokens);
  EXPECT_TRUE(data::isMegatronIndexFile(first.train_prefix + ".idx"));
  EXPECT_FALSE(data::isMegatronIndexFile((root / "a.txt").string()));
  EXPECT_FALSE(data::isMegatronIndexFile((root / "missing.idx").string()));
  // A file that only starts with the magic is no dataset: it and its .bin are documents.
  const fs::path alone = tmpPath("magic-only");
  fs::remove_all(alone);
  writeFile(alone / "a.txt", "first document");
  writeFile(alone / "fake.idx", std::string("MMIDIDX\0\0", 9) + "and then text, no index");
  writeFile(alone / "fake.bin", "plain text beside it");
  o.source = alone.string();
  o.out_prefix = (alone / "out").string();
  const auto third = data::prepareDataset(o);
  EXPECT_EQ(third.skipped_datasets, 0);
  EXPECT_EQ(third.train.documents + third.valid.documents, 3);
}

// Hard links are one file under several names (a tarball's link entries unpack as such):
// one document at the first path, not one per name (which could land in both splits).
TEST(DataPrepare, HardLinksAreOneDocument) {
  const fs::path root = tmpPath("hardlinks");
  fs::remove_all(root);
  writeFile(root / "a.txt", "the one text");
  for (const char* n : {"b", "c", "sub/d"}) {
    fs::create_directories((root / n).parent_path());
    fs::create_hard_link(root / "a.txt", root / n);
  }
  writeFile(root / "z.txt", "another text");
  data::PrepareOptions o;
  o.source = root.string();
  o.out_prefix = tmpPath("hardlinks-out");
  o.valid_fraction = 0.5;
  o.progress = false;
  const auto r = data::prepareDataset(o);
  EXPECT_EQ(r.regular_files, 2);
  EXPECT_EQ(r.skipped_hard_links, 3);
  EXPECT_EQ(r.train.documents + r.valid.documents, 2);
  EXPECT_EQ(r.train.tokens + r.valid.tokens, 24);
}
