// Unit tests of the HDF5 RAII wrappers (src/core/h5.hpp), serial files only.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/h5.hpp"

namespace {

std::string tmpPath(const std::string& stem) {
  return "wlb_test_h5_" + stem + "_" + std::to_string(::getpid()) + ".h5";
}

struct Rec {
  std::int64_t a;
  double b;
  std::int32_t c;
};

}  // namespace

TEST(H5, NumericDatasetsRoundTrip) {
  const auto path = tmpPath("num");
  std::vector<float> q(2 * 3 * 4);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.5f * static_cast<float>(i);
  std::vector<std::int64_t> ids = {5, -1, 1LL << 40};
  {
    auto f = wlb::h5::File::create(path);
    f.writeDataset<float>("q", q.data(), {2, 3, 4});
    auto g = f.createGroup("grp");
    g.writeDataset("ids", ids);
    g.setAttribute("count", std::int64_t{3});
    g.setAttribute("scale", 1.5);
    g.setAttribute("name", std::string("hello world"));
    g.setAttribute("empty", std::string());
    g.setAttribute("vec", std::vector<int>{1, 2, 3});
  }
  auto f = wlb::h5::File::open(path);
  std::vector<hsize_t> dims;
  auto q2 = f.readDataset<float>("q", &dims, 3);
  EXPECT_EQ(dims, (std::vector<hsize_t>{2, 3, 4}));
  EXPECT_EQ(q2, q);
  EXPECT_EQ(f.readDatasetShape<float>("q", {2, 3, 4}), q);
  EXPECT_EQ(f.readDataset<std::int64_t>("grp/ids"), ids);
  EXPECT_EQ(f.readDataset<std::int64_t>("/grp/ids"), ids);
  auto g = f.openGroup("grp");
  EXPECT_EQ(g.attribute<std::int64_t>("count"), 3);
  EXPECT_DOUBLE_EQ(g.attribute<double>("scale"), 1.5);
  EXPECT_EQ(g.stringAttribute("name"), "hello world");
  EXPECT_EQ(g.stringAttribute("empty"), "");
  EXPECT_EQ(g.vectorAttribute<int>("vec"), (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(f.exists("grp/ids"));
  EXPECT_FALSE(f.exists("nope/ids"));
  EXPECT_EQ(f.children(), (std::vector<std::string>{"grp", "q"}));
  std::remove(path.c_str());
}

TEST(H5, NamedErrors) {
  const auto path = tmpPath("err");
  {
    auto f = wlb::h5::File::create(path);
    f.writeDataset<float>("q", std::vector<float>{1, 2, 3});
    f.writeStrings("s", {"a", "b"});
  }
  auto f = wlb::h5::File::open(path);
  try {
    f.readDataset<float>("k");
    FAIL() << "expected InputError";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("/k"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f.readDatasetShape<float>("q", {3, 1}), wlb::InputError);
  EXPECT_THROW(f.readDataset<float>("q", nullptr, 2), wlb::InputError);
  EXPECT_THROW(f.readDataset<float>("s"), wlb::InputError);
  EXPECT_THROW(f.stringAttribute("missing"), wlb::InputError);
  EXPECT_THROW(f.openGroup("g"), wlb::InputError);
  EXPECT_THROW(wlb::h5::File::open(path + ".missing"), wlb::InputError);
  std::remove(path.c_str());
}

TEST(H5, TruncatedFileIsInputError) {
  const auto path = tmpPath("trunc");
  {
    auto f = wlb::h5::File::create(path);
    f.writeDataset<double>("x", std::vector<double>(1000, 1.0));
  }
  {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 3));
  }
  try {
    auto f = wlb::h5::File::open(path);
    f.readDataset<double>("x");
    FAIL() << "expected InputError";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

TEST(H5, StringsAndCompound) {
  const auto path = tmpPath("cmp");
  std::vector<Rec> recs = {{1, 2.5, 3}, {-4, 0.25, 7}};
  {
    auto f = wlb::h5::File::create(path);
    f.writeStrings("labels", {"attn", "", "qkv_proj"});
    auto t = wlb::h5::Datatype::compound(sizeof(Rec));
    t.insert("a", offsetof(Rec, a), H5T_NATIVE_INT64)
        .insert("b", offsetof(Rec, b), H5T_NATIVE_DOUBLE)
        .insert("c", offsetof(Rec, c), H5T_NATIVE_INT32);
    auto ds = f.createDataset("recs", t.id(), wlb::h5::Dataspace::simple({recs.size()}));
    ds.writeAll(t.id(), recs.data());
  }
  auto f = wlb::h5::File::open(path);
  EXPECT_EQ(f.readStrings("labels"), (std::vector<std::string>{"attn", "", "qkv_proj"}));
  auto ds = f.openDataset("recs");
  EXPECT_EQ(ds.type().memberNames(), (std::vector<std::string>{"a", "b", "c"}));
  auto t = wlb::h5::Datatype::compound(sizeof(Rec));
  t.insert("a", offsetof(Rec, a), H5T_NATIVE_INT64)
      .insert("b", offsetof(Rec, b), H5T_NATIVE_DOUBLE)
      .insert("c", offsetof(Rec, c), H5T_NATIVE_INT32);
  std::vector<Rec> back(2);
  ds.readAll(t.id(), back.data());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(back[i].a, recs[i].a);
    EXPECT_EQ(back[i].b, recs[i].b);
    EXPECT_EQ(back[i].c, recs[i].c);
  }
  std::remove(path.c_str());
}
