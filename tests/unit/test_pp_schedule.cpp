// Pipeline schedules as data: shape, validity and the dependency structure of GPipe,
// 1F1B and interleaved 1F1B.
#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "core/error.hpp"
#include "pp/dag.hpp"
#include "pp/schedule.hpp"

using namespace wlb;
using namespace wlb::pp;

TEST(PpSchedule, ParseNames) {
  EXPECT_EQ(parseScheduleKind("gpipe"), ScheduleKind::GPipe);
  EXPECT_EQ(parseScheduleKind("1f1b"), ScheduleKind::OneFOneB);
  EXPECT_EQ(parseScheduleKind("interleaved"), ScheduleKind::Interleaved);
  EXPECT_THROW(parseScheduleKind("zigzag"), InputError);
}

TEST(PpSchedule, GPipeOrder) {
  const Schedule s = makeGPipe(2, 3);
  EXPECT_EQ(renderSchedule(s), "stage 0: F0 F1 F2 B2 B1 B0\nstage 1: F0 F1 F2 B2 B1 B0\n");
  validateSchedule(s);
}

TEST(PpSchedule, OneFOneBOrder) {
  const Schedule s = makeOneFOneB(3, 4);
  EXPECT_EQ(renderSchedule(s),
            "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
            "stage 1: F0 F1 B0 F2 B1 F3 B2 B3\n"
            "stage 2: F0 B0 F1 B1 F2 B2 F3 B3\n");
  validateSchedule(s);
  // Fewer micro-batches than stages: warm-up is clamped.
  const Schedule t = makeOneFOneB(4, 2);
  validateSchedule(t);
  EXPECT_EQ(renderSchedule(t).substr(0, 20), "stage 0: F0 F1 B0 B1");
}

TEST(PpSchedule, InterleavedMatchesMegatronOrder) {
  // p = 2, v = 2, M = 4: Megatron's forward order is groups of p micro-batches per chunk.
  const Schedule s = makeInterleaved(2, 4, 2);
  validateSchedule(s);
  const auto& st0 = s.order[0];
  // Stage 0 warm-up = (p-0-1)*2 + (v-1)*p = 4 forwards: F0.0 F1.0 F0.1 F1.1
  ASSERT_GE(st0.size(), 4u);
  EXPECT_EQ(st0[0], (Task{Phase::Fwd, 0, 0}));
  EXPECT_EQ(st0[1], (Task{Phase::Fwd, 1, 0}));
  EXPECT_EQ(st0[2], (Task{Phase::Fwd, 0, 1}));
  EXPECT_EQ(st0[3], (Task{Phase::Fwd, 1, 1}));
  // First backward on stage 0 is micro-batch 0 through the last chunk.
  EXPECT_EQ(st0[5], (Task{Phase::Bwd, 0, 1}));
}

TEST(PpSchedule, InterleavedRequiresDivisibleMicroBatches) {
  EXPECT_THROW(makeInterleaved(4, 6, 2), InputError);
  EXPECT_NO_THROW(makeInterleaved(4, 8, 2));
  // v = 1 degenerates to 1F1B and has no divisibility requirement.
  EXPECT_NO_THROW(makeInterleaved(4, 6, 1));
}

TEST(PpSchedule, EveryScheduleValidAndDeadlockFree) {
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 5, 8, 16, 24}) {
      for (auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
        const Schedule s = makeSchedule(kind, p, m);
        ASSERT_NO_THROW(validateSchedule(s)) << scheduleKindName(kind) << p << "x" << m;
        std::vector<double> f(static_cast<std::size_t>(m), 1.0), b(f.size(), 2.0);
        ASSERT_NO_THROW(simulateDag(s, PipelineCosts::uniformStages(p, 1, f, b)));
      }
      for (int v : {2, 3, 4}) {
        if (m % p) continue;
        const Schedule s = makeInterleaved(p, m, v);
        ASSERT_NO_THROW(validateSchedule(s)) << "interleaved " << p << "x" << m << "x" << v;
        EXPECT_EQ(s.taskCount(), static_cast<std::size_t>(2 * p * m * v));
        std::vector<double> f(static_cast<std::size_t>(m), 1.0), b(f.size(), 2.0);
        const DagResult r = simulateDag(s, PipelineCosts::uniformStages(p, v, f, b));
        // Every dependency respected: forward of vstage k+1 starts after vstage k's.
        for (int mb = 0; mb < m; ++mb) {
          double last_f = -1;
          for (int vs = 0; vs < p * v; ++vs) {
            const int st = s.stageOf(vs), ch = s.chunkOf(vs);
            const auto& o = s.order[static_cast<std::size_t>(st)];
            for (std::size_t i = 0; i < o.size(); ++i)
              if (o[i] == Task{Phase::Fwd, mb, ch}) {
                const double t = r.start[r.vertexOf(st, i)];
                EXPECT_GE(t, last_f);
                last_f = r.finish[r.vertexOf(st, i)];
              }
          }
        }
      }
    }
}

TEST(PpSchedule, ValidateCatchesBrokenSchedules) {
  Schedule s = makeOneFOneB(2, 2);
  std::swap(s.order[1][0], s.order[1][1]);  // B0 before F0
  EXPECT_THROW(validateSchedule(s), std::logic_error);
  Schedule d = makeGPipe(2, 2);
  d.order[0][1] = d.order[0][0];  // duplicate F0
  EXPECT_THROW(validateSchedule(d), std::logic_error);
}
