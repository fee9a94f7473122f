#pragma once
/// \file dag.hpp
/// \brief DAG simulator of one pipeline (docs/simulator.md). Vertices are the tasks of a
/// Schedule, (stage, phase, micro-batch, chunk); a micro-batch index may stand for a
/// MicroPack or one slice of a sample. Edges:
///   - schedule order: consecutive tasks of one stage (no delay);
///   - inter-stage: F(v, m) -> F(v+1, m) and B(v+1, m) -> B(v, m) over virtual stages,
///     delayed by the P2P transfer time of micro-batch m; F(last, m) -> B(last, m) for a
///     `paired` schedule (PackFlow's backward units say what they wait for in its deps);
///   - the schedule's deps and extra (inter-slice) edges: (m_a, phase_a) -> (m_b, phase_b) on
///     every virtual stage.
/// start(v) = max over predecessors of (finish + edge delay); finish = start + cost.
/// Computed in one topological sweep, O(V + E); a cyclic schedule (deadlock) throws.
/// Memory: per stage constant bytes (weights, gradients, optimizer state) plus the
/// activations of a (micro-batch, chunk), allocated when its forward starts and freed when
/// its backward finishes (PackFlow: a forward MicroPack allocates its slices' activations,
/// a backward MicroPack frees its own slices').

#include <cstdint>
#include <vector>

#include "pp/schedule.hpp"

namespace wlb::pp {

/// Per-task costs of one pipeline, in seconds, and the bytes each task's activations hold.
struct PipelineCosts {
  int vstages = 0, micro_batches = 0;
  std::vector<double> fwd, bwd;      ///< [vstage * micro_batches + mb] seconds
  std::vector<double> p2p;           ///< [mb] seconds of one stage-to-stage transfer (each way)
  std::vector<double> act_bytes;     ///< [vstage * micro_batches + mb] activation bytes held
  std::vector<double> static_bytes;  ///< [stage] weights + grads + optimizer state
  /// Unpaired schedules (PackFlow): bytes the backward of unit mb frees, [vstage *
  /// micro_batches + mb] (the activations of the slices it holds), and the seconds of its
  /// gradient transfer, [mb]. Empty: act_bytes and p2p (backward m frees forward m's).
  std::vector<double> free_bytes, p2p_bwd;
  /// With a rank-speed spread or task noise: each member's time multiplier of each task (its
  /// rank's speed x its own noise draw; the task lasts its slowest member's), [(at(vs, mb) * 2
  /// + (backward ? 1 : 0)) * members + cp_rank * tp + tp_rank], members = cp * tp. Empty: 1.
  std::vector<double> member_factor;

  PipelineCosts() = default;
  PipelineCosts(int vstages_, int micro_batches_, int stages)
      : vstages(vstages_),
        micro_batches(micro_batches_),
        fwd(static_cast<std::size_t>(vstages_ * micro_batches_), 0.0),
        bwd(fwd.size(), 0.0),
        p2p(static_cast<std::size_t>(micro_batches_), 0.0),
        act_bytes(fwd.size(), 0.0),
        static_bytes(static_cast<std::size_t>(stages), 0.0) {}
  std::size_t at(int vs, int mb) const {
    return static_cast<std::size_t>(vs) * static_cast<std::size_t>(micro_batches) + static_cast<std::size_t>(mb);
  }
  /// Same cost for every virtual stage: fwd[mb], bwd[mb] (convenience for tests).
  static PipelineCosts uniformStages(int stages, int chunks, const std::vector<double>& fwd,
                                     const std::vector<double>& bwd, double p2p = 0.0);
};

/// Dependency between two tasks of the same virtual stage (schedule.hpp's TaskDep; SlimPack
/// slice order: the forward of slice j waits for slice j-1's forward; backward runs slices
/// last-in-first-out).
using ExtraDep = TaskDep;

struct Vertex {
  int stage = 0;
  Task task;
};

/// Result of one DAG simulation.
struct DagResult {
  std::vector<Vertex> vertices;             ///< stage by stage, in schedule order
  std::vector<std::size_t> stage_offset;    ///< first vertex of each stage (+ end)
  std::vector<double> start, finish, cost;  ///< per vertex
  double makespan = 0;                      ///< max finish
  std::vector<double> busy;                 ///< per stage: sum of task costs
  std::vector<double> stage_finish;         ///< per stage: finish of its last task
  std::vector<double> peak_bytes;           ///< per stage: static + peak activations
  std::vector<int> peak_inflight;           ///< per stage: max live (micro-batch, chunk) activations
  /// per stage: (time, bytes incl. static) after each allocation / free.
  std::vector<std::vector<std::pair<double, double>>> memory_timeline;
  std::vector<std::size_t> critical_path;  ///< vertex ids, first to last

  /// Idle fraction of the pipeline: 1 - sum(busy) / (stages * makespan). For M equal
  /// micro-batches and free communication this is (p-1)/(M+p-1) under GPipe and 1F1B.
  double bubbleFraction() const;
  std::size_t vertexOf(int stage, std::size_t pos) const { return stage_offset[stage] + pos; }
};

/// Simulate `sched` with `costs`. Throws std::logic_error if the schedule deadlocks or
/// the costs do not match the schedule's shape.
DagResult simulateDag(const Schedule& sched, const PipelineCosts& costs, const std::vector<ExtraDep>& extra = {});

}  // namespace wlb::pp
