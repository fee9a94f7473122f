// DAG simulator: critical paths on hand-built cases, the bubble formula, memory peaks,
// variable-length micro-batches, inter-slice dependencies and deadlock detection.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "pp/dag.hpp"
#include "pp/schedule.hpp"

using namespace wlb::pp;

namespace {
std::vector<double> rep(int m, double x) { return std::vector<double>(static_cast<std::size_t>(m), x); }

/// Independent reference: list-schedule each stage's tasks in order, repeatedly picking any
/// stage whose next task has all dependencies finished (event-free fixed point).
double referenceMakespan(const Schedule& s, const PipelineCosts& c) {
  const int p = s.stages, M = s.micro_batches, V = s.virtualStages();
  std::vector<double> ff(static_cast<std::size_t>(V * M), -1), bf(ff.size(), -1);
  std::vector<std::size_t> pos(static_cast<std::size_t>(p), 0);
  std::vector<double> free_at(static_cast<std::size_t>(p), 0);
  bool progress = true;
  double mk = 0;
  while (progress) {
    progress = false;
    for (int st = 0; st < p; ++st) {
      auto& i = pos[static_cast<std::size_t>(st)];
      const auto& o = s.order[static_cast<std::size_t>(st)];
      while (i < o.size()) {
        const Task t = o[i];
        const int vs = s.virtualStage(st, t.chunk);
        double ready = free_at[static_cast<std::size_t>(st)];
        if (t.phase == Phase::Fwd) {
          if (vs > 0) {
            const double d = ff[c.at(vs - 1, t.mb)];
            if (d < 0) break;
            ready = std::max(ready, d + (s.stageOf(vs - 1) != st ? c.p2p[t.mb] : 0.0));
          }
        } else {
          if (vs + 1 < V) {
            const double d = bf[c.at(vs + 1, t.mb)];
            if (d < 0) break;
            ready = std::max(ready, d + (s.stageOf(vs + 1) != st ? c.p2p[t.mb] : 0.0));
          } else {
            const double d = ff[c.at(vs, t.mb)];
            if (d < 0) break;
            ready = std::max(ready, d);
          }
        }
        const double fin =
            ready + (t.phase == Phase::Fwd ? c.fwd[c.at(vs, t.mb)] : c.bwd[c.at(vs, t.mb)]);
        (t.phase == Phase::Fwd ? ff : bf)[c.at(vs, t.mb)] = fin;
        free_at[static_cast<std::size_t>(st)] = fin;
        mk = std::max(mk, fin);
        ++i;
        progress = true;
      }
    }
  }
  return mk;
}
}  // namespace

TEST(PpDag, SingleMicroBatchWithTransfers) {
  // p = 2, one micro-batch, f = b = 1, P2P = 0.5: F0 F1 (+0.5) B1 B0 (+0.5) = 5.
  const Schedule s = makeOneFOneB(2, 1);
  const DagResult r = simulateDag(s, PipelineCosts::uniformStages(2, 1, {1.0}, {1.0}, 0.5));
  EXPECT_DOUBLE_EQ(r.makespan, 5.0);
  EXPECT_EQ(r.critical_path.size(), 4u);
}

TEST(PpDag, BubbleFormulaEqualMicroBatches) {
  for (auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB})
    for (int p : {2, 4, 8})
      for (int m : {1, 4, 8, 16}) {
        const double f = 1.0, b = 2.0;
        const DagResult r =
            simulateDag(makeSchedule(kind, p, m), PipelineCosts::uniformStages(p, 1, rep(m, f), rep(m, b)));
        EXPECT_NEAR(r.makespan, (m + p - 1) * (f + b), 1e-9) << scheduleKindName(kind) << p << " " << m;
        EXPECT_NEAR(r.bubbleFraction(), double(p - 1) / double(m + p - 1), 1e-12);
        for (int st = 0; st < p; ++st) EXPECT_NEAR(r.busy[st], m * (f + b), 1e-9);
      }
}

TEST(PpDag, InterleavedShrinksTheBubble) {
  // Megatron: bubble time = (p-1)(f+b)/v when each chunk costs 1/v of a stage.
  const int p = 4, m = 8;
  const double f = 1.0, b = 2.0;
  for (int v : {2, 4}) {
    const DagResult r = simulateDag(makeInterleaved(p, m, v),
                                    PipelineCosts::uniformStages(p, v, rep(m, f / v), rep(m, b / v)));
    EXPECT_NEAR(r.makespan, m * (f + b) + (p - 1) * (f + b) / v, 1e-9) << v;
  }
}

TEST(PpDag, VariableLengthHandCase) {
  // p = 2, M = 2, 1F1B; micro-batch 1 is 4x larger. Stage 0: F0 F1 B0 B1; stage 1:
  // F0 B0 F1 B1. Critical path: F0@0 F1@0 F1@1 B1@1 B1@0 = 1 + 4 + 4 + 8 + 8 = 25.
  const Schedule s = makeOneFOneB(2, 2);
  const DagResult r = simulateDag(s, PipelineCosts::uniformStages(2, 1, {1.0, 4.0}, {2.0, 8.0}));
  EXPECT_DOUBLE_EQ(r.makespan, 25.0);
  ASSERT_EQ(r.critical_path.size(), 5u);
  std::vector<std::pair<int, int>> path;  // (stage, mb)
  for (auto v : r.critical_path) path.push_back({r.vertices[v].stage, r.vertices[v].task.mb});
  EXPECT_EQ(path, (std::vector<std::pair<int, int>>{{0, 0}, {0, 1}, {1, 1}, {1, 1}, {0, 1}}));
}

TEST(PpDag, LargestMicroBatchDominates) {
  // One outlier micro-batch (10x the others): its forward and backward through every
  // stage lie on the critical path, the step is at least the forwards queued before it on
  // stage 0 plus its own chain through all stages, and balancing the same total work
  // shortens the step (imbalance is amplified by the pipeline).
  const int p = 4, m = 8, big = 5;
  std::vector<double> f = rep(m, 1.0), b = rep(m, 2.0);
  f[big] = 10.0;
  b[big] = 20.0;
  for (auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    const DagResult r = simulateDag(makeSchedule(kind, p, m), PipelineCosts::uniformStages(p, 1, f, b));
    double before = 0, total = 0;
    for (int i = 0; i < m; ++i) {
      if (i < big) before += f[i];
      total += f[i] + b[i];
    }
    EXPECT_GE(r.makespan + 1e-9, before + p * (f[big] + b[big])) << scheduleKindName(kind);
    int on_path = 0;
    for (auto v : r.critical_path) on_path += r.vertices[v].task.mb == big;
    EXPECT_EQ(on_path, 2 * p) << scheduleKindName(kind);
    const DagResult bal = simulateDag(makeSchedule(kind, p, m),
        PipelineCosts::uniformStages(p, 1, rep(m, total / m / 3.0), rep(m, 2.0 * total / m / 3.0)));
    EXPECT_NEAR(bal.makespan, (m + p - 1) * total / m, 1e-9);
    EXPECT_LT(bal.makespan, r.makespan);
  }
}

TEST(PpDag, MatchesReferenceListScheduler) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.1, 5.0);
  for (int trial = 0; trial < 60; ++trial) {
    const int p = 1 + trial % 5, mult = 1 + trial % 3, m = p * mult, v = 1 + trial % 3;
    for (auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved}) {
      const Schedule s = makeSchedule(kind, p, m, v);
      PipelineCosts c(s.virtualStages(), m, p);
      for (auto& x : c.fwd) x = u(rng);
      for (auto& x : c.bwd) x = u(rng);
      for (auto& x : c.p2p) x = u(rng) * 0.1;
      const DagResult r = simulateDag(s, c);
      EXPECT_NEAR(r.makespan, referenceMakespan(s, c), 1e-9) << scheduleKindName(kind) << p << m << v;
    }
  }
}

TEST(PpDag, MemoryPeaksOnKnownSchedules) {
  const int p = 4, m = 8;
  const double act = 3.0, weights = 100.0;
  for (auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    PipelineCosts c = PipelineCosts::uniformStages(p, 1, rep(m, 1.0), rep(m, 2.0));
    std::fill(c.act_bytes.begin(), c.act_bytes.end(), act);
    std::fill(c.static_bytes.begin(), c.static_bytes.end(), weights);
    const DagResult r = simulateDag(makeSchedule(kind, p, m), c);
    for (int st = 0; st < p; ++st) {
      const int expect = kind == ScheduleKind::GPipe ? m : std::min(p - st, m);
      EXPECT_EQ(r.peak_inflight[st], expect) << scheduleKindName(kind) << " stage " << st;
      EXPECT_DOUBLE_EQ(r.peak_bytes[st], weights + act * expect);
      // Timeline starts and ends at the static bytes.
      EXPECT_DOUBLE_EQ(r.memory_timeline[st].front().second, weights);
      EXPECT_DOUBLE_EQ(r.memory_timeline[st].back().second, weights);
    }
  }
  // 1F1B holds at most p micro-batches on stage 0 whatever M is.
  const DagResult big = simulateDag(makeOneFOneB(p, 64), PipelineCosts::uniformStages(p, 1, rep(64, 1), rep(64, 2)));
  EXPECT_LE(big.peak_inflight[0], p);
}

TEST(PpDag, InterSliceDependenciesAndDeadlock) {
  // Two slices of one sample as micro-batches 0 and 1: forward in order, backward LIFO.
  const std::vector<ExtraDep> slices = {{0, Phase::Fwd, 1, Phase::Fwd}, {1, Phase::Bwd, 0, Phase::Bwd}};
  // GPipe runs backwards in reverse order: consistent with LIFO slices.
  const DagResult g = simulateDag(makeGPipe(2, 2), PipelineCosts::uniformStages(2, 1, {1, 1}, {2, 2}), slices);
  EXPECT_GT(g.makespan, 0);
  // 1F1B's stage 1 runs B0 before F1 — B0 waits for B1 which waits for F1: a cycle.
  EXPECT_THROW(simulateDag(makeOneFOneB(2, 2), PipelineCosts::uniformStages(2, 1, {1, 1}, {2, 2}), slices),
               std::logic_error);
}

TEST(PpDag, RejectsMismatchedCosts) {
  EXPECT_THROW(simulateDag(makeOneFOneB(2, 3), PipelineCosts::uniformStages(2, 1, {1, 1}, {1, 1})),
               std::logic_error);
}
