// Parallel trace writer: every rank records events, the writer puts them into one file
// collectively, and the file reads back exactly.
// wlb-mpi-ranks: 1 2 4
// wlb-timeout: 120
//
// The traces are left in $WLB_TRACE_TEST_DIR (default: the working directory, i.e. the
// build's tests directory) as trace_np<N>.h5 and trace_sim_np<N>.h5: the pytest suite in
// tests/analysis reads them (env WLB_BUILD_DIR).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "mpi_world.hpp"
#include "trace/clock_sync.hpp"
#include "trace/reader.hpp"
#include "trace/recorder.hpp"
#include "trace/writer.hpp"

namespace tr = wlb::trace;

namespace {

std::string outDir() {
  const char* d = std::getenv("WLB_TRACE_TEST_DIR");
  return (d && *d) ? std::string(d) : std::string(".");
}

using wlb::test::worldRank;
using wlb::test::worldSize;

/// Mesh used by the test: cp = min(2, size), dp = size / cp.
tr::RankCoord coordOf(int rank, int size) {
  int cp = size >= 2 ? 2 : 1;
  return tr::RankCoord{0, rank % cp, 0, rank / cp};
}

struct Expected {
  std::string label, strategy;
  tr::Event e;
};

/// The deterministic events rank `r` records (times in ns, rank-dependent).
std::vector<Expected> expectedEvents(int r) {
  std::vector<Expected> out;
  const char* strategies[] = {"plain", "wlb"};
  const char* ops[] = {"qkv_proj", "attn", "out_proj"};
  std::int64_t t = 1000 + 17 * r;
  for (int s = 0; s < 2; ++s) {
    for (int step = 0; step < 2; ++step) {
      for (int mb = 0; mb < 2; ++mb) {
        for (int ph = 1; ph <= 2; ++ph) {
          for (int o = 0; o < 3; ++o) {
            Expected x;
            x.label = ops[o];
            x.strategy = strategies[s];
            x.e.rank = r;
            x.e.step = step;
            x.e.micro_batch = mb;
            x.e.phase = static_cast<tr::Phase>(ph);
            x.e.layer = o % 2;
            x.e.chunk = 0;
            x.e.start_ns = t;
            x.e.end_ns = t + 100 * (o + 1) + r;
            x.e.flops = 1e9 * (o + 1) + r;
            x.e.bytes = 0.5 * r;
            t = x.e.end_ns + 5;
            out.push_back(x);
          }
        }
      }
      Expected g;
      g.label = "grad_allreduce";
      g.strategy = strategies[s];
      g.e.rank = r;
      g.e.step = step;
      g.e.start_ns = t;
      g.e.end_ns = t + 250;
      g.e.bytes = 4096.0 * (r + 1);
      t = g.e.end_ns + 5;
      out.push_back(g);
    }
  }
  if (r % 2 == 1) {  // a label only odd ranks know: the label tables must be merged
    Expected c;
    c.label = "custom_odd";
    c.strategy = "wlb";
    c.e.rank = r;
    c.e.start_ns = t;
    c.e.end_ns = t + 1;
    out.push_back(c);
  }
  return out;
}

wlb::StepPlan makePlan(std::int64_t step, int dp, int mbs) {
  wlb::StepPlan p;
  p.step = step;
  p.replicas.resize(static_cast<std::size_t>(dp));
  wlb::DocId id = 100 * step;
  for (int d = 0; d < dp; ++d) {
    for (int m = 0; m < mbs; ++m) {
      wlb::MicroBatch mb;
      for (int k = 0; k <= m; ++k) mb.segments.push_back({id++, 0, 64 * (k + 1) + d, step});
      p.replicas[static_cast<std::size_t>(d)].push_back(mb);
    }
  }
  p.delayed = {7, 9};
  return p;
}

bool sameEvent(const tr::Event& a, const tr::Event& b) {
  return a.rank == b.rank && a.step == b.step && a.micro_batch == b.micro_batch && a.phase == b.phase &&
         a.layer == b.layer && a.chunk == b.chunk && a.start_ns == b.start_ns && a.end_ns == b.end_ns &&
         a.flops == b.flops && a.bytes == b.bytes;
}

}  // namespace

TEST(TraceWrite, ParallelRoundTripExact) {
  const int rank = worldRank(), size = worldSize();
  const auto coord = coordOf(rank, size);
  tr::Recorder rec = tr::alignedRecorder(MPI_COMM_WORLD, coord);
  EXPECT_EQ(rec.rank(), rank);
  if (rank == 0) {
    EXPECT_EQ(rec.clockOffsetNs(), 0);
  }

  const auto expected = expectedEvents(rank);
  for (const auto& x : expected) {
    rec.setStrategy(x.strategy);
    tr::Event e = x.e;
    e.region = rec.region(x.label);
    e.strategy = rec.strategy();
    rec.record(e);
  }

  const std::string path = outDir() + "/trace_np" + std::to_string(size) + ".h5";
  tr::RunMeta meta;
  meta.deck_toml = "[run]\nsteps = 2\n";
  meta.command = "test_trace_write";
  meta.warmup = 0;
  meta.extra = {{"note", "mpi test"}};
  tr::Writer w(path, meta, MPI_COMM_WORLD);
  const int dp = size / (size >= 2 ? 2 : 1);
  for (int step = 0; step < 2; ++step) {
    w.addPlan("plain", makePlan(step, dp, 2), "", step == 0 ? R"({"shard":"per_sequence"})" : "");
    w.addPlan("wlb", makePlan(step, dp, 2));
  }
  EXPECT_EQ(w.commit(rec), path);
  MPI_Barrier(MPI_COMM_WORLD);

  // Every rank reads the whole file and checks every rank's slice.
  auto t = tr::readTrace(path);
  EXPECT_EQ(t.source, "measured");
  EXPECT_EQ(t.mpi_size, size);
  EXPECT_EQ(t.world_size, size);
  EXPECT_EQ(t.cp, size >= 2 ? 2 : 1);
  EXPECT_EQ(t.dp, dp);
  EXPECT_EQ(t.tp, 1);
  EXPECT_EQ(t.pp, 1);
  EXPECT_EQ(t.deck_toml, meta.deck_toml);
  EXPECT_EQ(t.meta.at("note"), "mpi test");
  EXPECT_EQ(t.meta.at("command"), "test_trace_write");
  EXPECT_FALSE(t.meta.at("git_hash").empty());
  EXPECT_FALSE(t.meta.at("kokkos_version").empty());
  EXPECT_EQ(t.start_time.size(), 24u) << t.start_time;  // 2025-01-31T12:00:00.123Z
  EXPECT_EQ(t.strategies, (std::vector<std::string>{"plain", "wlb"}));
  EXPECT_EQ(t.regions.front(), "step");
  EXPECT_GE(t.regionId("attn"), 0);
  EXPECT_EQ(t.regionId("custom_odd") >= 0, size >= 2);

  ASSERT_EQ(t.ranks.size(), static_cast<std::size_t>(size));
  std::size_t total = 0;
  for (int r = 0; r < size; ++r) {
    const auto& row = t.ranks[static_cast<std::size_t>(r)];
    EXPECT_EQ(row.rank, r);
    auto c = coordOf(r, size);
    EXPECT_EQ(row.cp, c.cp);
    EXPECT_EQ(row.dp, c.dp);
    EXPECT_EQ(row.event_offset, static_cast<std::int64_t>(total));
    const auto want = expectedEvents(r);
    EXPECT_EQ(row.event_count, static_cast<std::int64_t>(want.size()));
    auto got = t.eventsOfRank(r);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(sameEvent(got[i], want[i].e)) << "rank " << r << " event " << i;
      EXPECT_EQ(t.regions.at(static_cast<std::size_t>(got[i].region)), want[i].label);
      EXPECT_EQ(t.strategies.at(static_cast<std::size_t>(got[i].strategy)), want[i].strategy);
    }
    total += want.size();
  }
  EXPECT_EQ(t.events.size(), total);

  // Plans: rank 0's, 2 strategies x 2 steps, segments matching makePlan.
  ASSERT_EQ(t.plan_steps.size(), 4u);
  EXPECT_EQ(t.plan_steps[0].strategy, 0);
  EXPECT_EQ(t.plan_steps[1].strategy, 1);
  EXPECT_EQ(t.plan_steps[0].shard_json, R"({"shard":"per_sequence"})");
  EXPECT_EQ(t.plan_steps[1].shard_json, "{}");  // none given: the schema's "no shard plans"
  EXPECT_NE(t.plan_steps[0].packing_json.find("\"replicas\""), std::string::npos);
  std::size_t segs = 0;
  for (int step = 0; step < 2; ++step) {
    auto p = makePlan(step, dp, 2);
    for (const auto& rep : p.replicas)
      for (const auto& mb : rep) segs += 2 * mb.segments.size();
  }
  ASSERT_EQ(t.segments.size(), segs);
  EXPECT_EQ(t.segments[0].doc, 0);
  EXPECT_EQ(t.segments[0].length, 64);
}

TEST(TraceWrite, ScopesProduceOrderedEventsOnEveryRank) {
  const int rank = worldRank(), size = worldSize();
  tr::Recorder rec = tr::alignedRecorder(MPI_COMM_WORLD, coordOf(rank, size));
  rec.setStrategy("wlb");
  rec.setContext({0, 0, tr::Phase::Fwd, 0, 0});
  { tr::Recorder::Scope s(rec, tr::labels::kAttn, 123.0); }
  {
    tr::Recorder::Scope s(rec, tr::labels::kKvAllgather, 0.0, 64.0);
    s.context().phase = tr::Phase::Bwd;
  }
  const std::string path = outDir() + "/trace_scopes_np" + std::to_string(size) + ".h5";
  tr::Writer w(path, tr::RunMeta{}, MPI_COMM_WORLD);
  w.commit(rec);
  auto t = tr::readTrace(path);
  ASSERT_EQ(t.events.size(), static_cast<std::size_t>(2 * size));
  for (int r = 0; r < size; ++r) {
    auto ev = t.eventsOfRank(r);
    ASSERT_EQ(ev.size(), 2u);
    EXPECT_EQ(t.regions[static_cast<std::size_t>(ev[0].region)], "attn");
    EXPECT_EQ(ev[0].phase, tr::Phase::Fwd);
    EXPECT_EQ(ev[0].flops, 123.0);
    EXPECT_EQ(t.regions[static_cast<std::size_t>(ev[1].region)], "kv_allgather");
    EXPECT_EQ(ev[1].phase, tr::Phase::Bwd);
    EXPECT_EQ(ev[1].bytes, 64.0);
    EXPECT_LE(ev[0].start_ns, ev[0].end_ns);
    EXPECT_LE(ev[0].end_ns, ev[1].start_ns);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::remove(path.c_str());
}

TEST(TraceWrite, RankWithoutEventsStillWrites) {
  const int rank = worldRank(), size = worldSize();
  tr::Recorder rec = tr::alignedRecorder(MPI_COMM_WORLD, coordOf(rank, size));
  if (rank == size - 1) rec.record(rec.region("attn"), 10, 20);
  const std::string path = outDir() + "/trace_sparse_np" + std::to_string(size) + ".h5";
  tr::Writer w(path, tr::RunMeta{}, MPI_COMM_WORLD);
  w.commit(rec);
  auto t = tr::readTrace(path);
  ASSERT_EQ(t.events.size(), 1u);
  EXPECT_EQ(t.events[0].rank, size - 1);
  EXPECT_EQ(t.ranks.back().event_count, 1);
  EXPECT_EQ(t.ranks.back().event_offset, 0);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::remove(path.c_str());
}

/// A simulated trace (serial writer, virtual ranks) with a 1F1B-like pipeline for the
/// analysis tests: mesh tp=1 cp=2 pp=2 dp=2 (8 virtual ranks), 2 strategies, 3 steps.
TEST(TraceWrite, SerialSimulatedTraceForAnalysis) {
  if (worldRank() != 0) return;
  const int size = worldSize();
  tr::Recorder rec;  // serial, no MPI
  std::vector<tr::RankCoord> coords;
  for (int dp = 0; dp < 2; ++dp)
    for (int pp = 0; pp < 2; ++pp)
      for (int cp = 0; cp < 2; ++cp) coords.push_back({0, cp, pp, dp});
  rec.setVirtualRanks(coords);
  const int attn = rec.region("attn"), lin = rec.region("qkv_proj"), ar = rec.region("grad_allreduce");
  tr::RunMeta meta;
  meta.source = "simulated";
  meta.deck_toml = "[run]\nsteps = 3\n";
  tr::Writer w(outDir() + "/trace_sim_np" + std::to_string(size) + ".h5", meta);
  for (const char* sname : {"plain", "wlb"}) {
    const bool balanced = std::string(sname) == "wlb";
    const int s = rec.setStrategy(sname);
    for (int step = 0; step < 3; ++step) {
      auto plan = makePlan(step, 2, 2);
      w.addPlan(sname, plan);
      std::int64_t base = step * 100000;
      for (std::size_t r = 0; r < coords.size(); ++r) {
        const auto& c = coords[r];
        std::int64_t t = base + c.pp * 1000;
        for (int ph = 1; ph <= 2; ++ph) {
          for (int mb = 0; mb < 2; ++mb) {
            // Unbalanced "plain": micro-batch 1 and CP rank 1 get more attention work.
            std::int64_t a = balanced ? 3000 : 2000 + 2000 * mb + 1000 * c.cp;
            std::int64_t l = 1000;
            tr::Event e;
            e.rank = static_cast<int>(r);
            e.strategy = s;
            e.step = step;
            e.micro_batch = mb;
            e.phase = static_cast<tr::Phase>(ph);
            e.region = lin;
            e.start_ns = t;
            e.end_ns = t + l * ph;
            e.flops = 1e6 * ph;
            rec.record(e);
            e.region = attn;
            e.start_ns = e.end_ns;
            e.end_ns = e.start_ns + a * ph;
            e.flops = 1e3 * static_cast<double>(a) * ph;
            rec.record(e);
            t = e.end_ns + 100;
          }
        }
        tr::Event g;
        g.rank = static_cast<int>(r);
        g.strategy = s;
        g.step = step;
        g.region = ar;
        g.start_ns = t;
        g.end_ns = t + 500;
        rec.record(g);
      }
    }
  }
  auto path = w.commit(rec);
  auto t = tr::readTrace(path);
  EXPECT_EQ(t.source, "simulated");
  EXPECT_EQ(t.mpi_size, 1);
  EXPECT_EQ(t.world_size, 8);
  EXPECT_EQ(t.cp, 2);
  EXPECT_EQ(t.pp, 2);
  EXPECT_EQ(t.dp, 2);
  EXPECT_EQ(t.strategies, (std::vector<std::string>{"plain", "wlb"}));
  EXPECT_EQ(t.events.size(), rec.events().size());
  // Serial path sorts events by rank: every rank's slice is contiguous.
  for (const auto& row : t.ranks)
    for (const auto& e : t.eventsOfRank(row.rank)) EXPECT_EQ(e.rank, row.rank);
}
