// Trace recorder, serial writer and reader: labels, contexts, scopes (with fence), a
// killed writer leaves nothing under the final name, incomplete/truncated files are
// InputErrors naming the file.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.hpp"
#include "core/h5.hpp"
#include "trace/reader.hpp"
#include "trace/recorder.hpp"
#include "trace/writer.hpp"

namespace tr = wlb::trace;

namespace {

std::string tmpPath(const std::string& stem) {
  return "wlb_test_trace_" + stem + "_" + std::to_string(::getpid()) + ".h5";
}

bool fileExists(const std::string& p) { return std::ifstream(p).good(); }

struct FakeSpace {
  int* fences;
  void fence() const { ++*fences; }
};

}  // namespace

TEST(TraceRecorder, StandardLabelsHaveFixedIds) {
  tr::Recorder a, b;
  EXPECT_EQ(a.region("attn"), b.region("attn"));
  EXPECT_EQ(a.regions(), tr::labels::standard());
  const int n = static_cast<int>(a.regions().size());
  EXPECT_EQ(a.region("my_op"), n);
  EXPECT_EQ(a.region("my_op"), n);
  EXPECT_EQ(a.regions().back(), "my_op");
}

TEST(TraceRecorder, ScopeUsesContextAndFences) {
  tr::Recorder rec(3, {1, 2, 0, 1});
  rec.setStrategy("wlb");
  rec.setContext({5, 2, tr::Phase::Bwd, 7, 1});
  int fences = 0;
  FakeSpace space{&fences};
  {
    tr::Recorder::Scope s(rec, "attn", space, 10.0, 20.0);
    EXPECT_EQ(fences, 1);     // at the start: work queued before the region stays out of it
    rec.context().step = 99;  // later context changes do not affect an open scope
  }
  EXPECT_EQ(fences, 2);  // and at the end: the region's own device work is in it
  {
    tr::Recorder::Scope s(rec, rec.region("mlp"));
    s.cancel();
  }
  ASSERT_EQ(rec.events().size(), 1u);
  const auto& e = rec.events()[0];
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.step, 5);
  EXPECT_EQ(e.micro_batch, 2);
  EXPECT_EQ(e.phase, tr::Phase::Bwd);
  EXPECT_EQ(e.layer, 7);
  EXPECT_EQ(e.chunk, 1);
  EXPECT_EQ(e.region, rec.region("attn"));
  EXPECT_EQ(e.flops, 10.0);
  EXPECT_EQ(e.bytes, 20.0);
  EXPECT_LE(e.start_ns, e.end_ns);
  EXPECT_GE(e.start_ns, 0);
  EXPECT_EQ(rec.strategies(), (std::vector<std::string>{"wlb"}));
}

TEST(TraceWriter, SerialVirtualRanksRoundTrip) {
  const auto path = tmpPath("virtual");
  tr::Recorder rec;
  std::vector<tr::RankCoord> coords;
  for (int i = 0; i < 1000; ++i) coords.push_back({i % 2, (i / 2) % 5, (i / 10) % 10, i / 100});
  rec.setVirtualRanks(coords);
  const int attn = rec.region("attn");
  rec.setStrategy("sim");
  // Record out of rank order: the writer sorts by rank (stable).
  for (int i = 999; i >= 0; --i) {
    tr::Event e;
    e.rank = i;
    e.region = attn;
    e.step = 1;
    e.micro_batch = i % 4;
    e.phase = tr::Phase::Fwd;
    e.start_ns = i;
    e.end_ns = 2 * i + 1;
    e.flops = i * 0.5;
    rec.record(e);
    e.start_ns = 5000 + i;
    e.end_ns = 6000 + i;
    rec.record(e);
  }
  tr::RunMeta meta;
  meta.source = "simulated";
  tr::Writer w(path, meta);
  EXPECT_EQ(w.commit(rec), path);
  auto t = tr::readTrace(path);
  EXPECT_EQ(t.source, "simulated");
  EXPECT_EQ(t.world_size, 1000);
  EXPECT_EQ(t.tp, 2);
  EXPECT_EQ(t.cp, 5);
  EXPECT_EQ(t.pp, 10);
  EXPECT_EQ(t.dp, 10);
  ASSERT_EQ(t.events.size(), 2000u);
  for (int r = 0; r < 1000; ++r) {
    auto ev = t.eventsOfRank(r);
    ASSERT_EQ(ev.size(), 2u);
    EXPECT_EQ(ev[0].start_ns, r);
    EXPECT_EQ(ev[0].end_ns, 2 * r + 1);
    EXPECT_EQ(ev[1].start_ns, 5000 + r);
    EXPECT_EQ(ev[0].flops, r * 0.5);
    EXPECT_EQ(t.ranks[static_cast<std::size_t>(r)].pp, coords[static_cast<std::size_t>(r)].pp);
  }
  std::remove(path.c_str());
}

TEST(TraceWriter, KilledWriterLeavesNoFileUnderFinalName) {
  const auto path = tmpPath("killed");
  std::remove(path.c_str());
  std::fflush(nullptr);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Child: serial writer (no MPI calls), SIGKILLed just before `complete` is written.
    tr::Recorder rec;
    rec.record(rec.region("attn"), 1, 2);
    tr::WriterOptions opts;
    opts.before_complete = [](const std::string&) { ::raise(SIGKILL); };
    tr::Writer w(path, tr::RunMeta{}, opts);
    w.commit(rec);
    ::_exit(0);  // not reached
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
  EXPECT_FALSE(fileExists(path)) << "a killed writer left " << path;
  // The half-written temporary file exists and is not a complete trace.
  const std::string tmp = path + ".tmp-" + std::to_string(child);
  EXPECT_TRUE(fileExists(tmp));
  EXPECT_FALSE(tr::isCompleteTrace(tmp));
  try {
    tr::readTrace(tmp);
    FAIL() << "expected InputError";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(tmp), std::string::npos) << e.what();
  }
  std::remove(tmp.c_str());
}

TEST(TraceReader, IncompleteFileIsInputErrorNamingFile) {
  const auto path = tmpPath("incomplete");
  {
    auto f = wlb::h5::File::create(path);
    f.writeDataset<int>("events", std::vector<int>{1, 2});
  }
  try {
    tr::readTrace(path);
    FAIL() << "expected InputError";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("incomplete"), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

// The schema version is the root's attribute, repeated in /meta: the two must agree, and a
// 'complete' flag that is there but not 1 is named with its value.
TEST(TraceReader, RootAttributesAreChecked) {
  const auto path = tmpPath("root-attrs");
  const auto refused = [&](const std::string& attr, int value, const std::string& want) {
    tr::Recorder rec;
    rec.record(rec.region("attn"), 1, 2);
    tr::Writer(path, tr::RunMeta{}).commit(rec);
    EXPECT_NO_THROW(tr::readTrace(path));
    {
      auto f = wlb::h5::File::open(path, wlb::h5::File::Mode::ReadWrite);
      f.setAttribute(attr, value);
    }
    try {
      tr::readTrace(path);
      ADD_FAILURE() << "accepted " << attr << " = " << value;
    } catch (const wlb::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  refused("schema_version", 2, "schema_version 2 (/) differs from 1 (/meta)");
  refused("complete", 0, "'complete' = 0");
  std::remove(path.c_str());
}

// A trace whose figures cannot be real is refused by row, not averaged over: a NaN FLOP
// count, a negative byte count, an event ending before it starts, a negative warm-up.
TEST(TraceReader, ImpossibleFiguresAreInputErrors) {
  const auto path = tmpPath("figures");
  const auto refused = [&](const tr::Event& bad, int warmup, const std::string& want) {
    tr::Recorder rec;
    tr::Event ok;
    ok.region = rec.region("attn");
    ok.start_ns = 10;
    ok.end_ns = 20;
    ok.flops = 1e9;
    rec.record(ok);
    tr::Event b = bad;
    b.region = ok.region;
    rec.record(b);
    tr::RunMeta meta;
    meta.warmup = warmup;
    tr::Writer(path, meta).commit(rec);
    try {
      tr::readTrace(path);
      ADD_FAILURE() << "accepted a trace with " << want;
    } catch (const wlb::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    std::remove(path.c_str());
  };
  tr::Event e;
  e.start_ns = 30;
  e.end_ns = 40;
  tr::Event nan = e, neg = e, back = e;
  nan.flops = std::nan("");
  neg.bytes = -1;
  back.end_ns = 29;
  refused(nan, 0, "/events row 1 is damaged");
  refused(neg, 0, "/events row 1 is damaged");
  refused(back, 0, "/events row 1 is damaged");
  refused(e, -1, "warmup -1 is negative");
  tr::Event phase = e;
  phase.phase = static_cast<tr::Phase>(7);
  refused(phase, 0, "/events row 1 has phase 7");
}

// The mesh every coordinate is read against: sizes of at least 1 whose product is the world.
TEST(TraceReader, MeshThatIsNotTheWorldIsAnInputError) {
  const auto path = tmpPath("mesh");
  for (const auto& [attr, value, want] : std::vector<std::tuple<std::string, int, std::string>>{
           {"mesh_cp", 0, "/meta mesh_cp 0 is not a mesh size"}, {"mesh_dp", 2, "is not world_size 1"}}) {
    tr::Recorder rec;
    rec.record(rec.region("attn"), 1, 2);
    tr::Writer(path, tr::RunMeta{}).commit(rec);
    {
      auto f = wlb::h5::File::open(path, wlb::h5::File::Mode::ReadWrite);
      f.openGroup("meta").setAttribute(attr, value);
    }
    try {
      tr::readTrace(path);
      ADD_FAILURE() << "accepted " << attr << " = " << value;
    } catch (const wlb::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    std::remove(path.c_str());
  }
}

TEST(TraceReader, TruncatedAndMissingFilesAreInputErrors) {
  const auto path = tmpPath("trunc");
  {
    tr::Recorder rec;
    for (int i = 0; i < 5000; ++i) rec.record(rec.region("attn"), i, i + 1);
    tr::Writer(path, tr::RunMeta{}).commit(rec);
  }
  ASSERT_TRUE(tr::isCompleteTrace(path));
  {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  EXPECT_FALSE(tr::isCompleteTrace(path));
  try {
    tr::readTrace(path);
    FAIL() << "expected InputError";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
  EXPECT_THROW(tr::readTrace(path), wlb::InputError);
}

TEST(TraceWriter, PlanJsonMatchesPlanLineShape) {
  wlb::StepPlan p;
  p.step = 3;
  p.replicas = {{wlb::MicroBatch{{{11, 0, 5, 2}, {12, 4, 6, 3}}}}};
  auto j = tr::Writer::planToJson("wlb", p);
  EXPECT_NE(j.find("\"type\":\"step\""), std::string::npos) << j;
  EXPECT_NE(j.find("\"step\":3"), std::string::npos) << j;
  EXPECT_NE(j.find("[[[[11,0,5,2],[12,4,6,3]]]]"), std::string::npos) << j;
}
