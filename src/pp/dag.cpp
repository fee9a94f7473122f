#include "pp/dag.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace wlb::pp {

PipelineCosts PipelineCosts::uniformStages(int stages, int chunks, const std::vector<double>& fwd,
                                           const std::vector<double>& bwd, double p2p) {
  const int m = static_cast<int>(fwd.size());
  if (bwd.size() != fwd.size()) throw std::logic_error("uniformStages: fwd/bwd size mismatch");
  PipelineCosts c(stages * chunks, m, stages);
  for (int vs = 0; vs < stages * chunks; ++vs)
    for (int mb = 0; mb < m; ++mb) {
      c.fwd[c.at(vs, mb)] = fwd[static_cast<std::size_t>(mb)];
      c.bwd[c.at(vs, mb)] = bwd[static_cast<std::size_t>(mb)];
      c.act_bytes[c.at(vs, mb)] = 1.0;
    }
  std::fill(c.p2p.begin(), c.p2p.end(), p2p);
  return c;
}

double DagResult::bubbleFraction() const {
  if (makespan <= 0 || busy.empty()) return 0.0;
  double b = 0;
  for (double x : busy) b += x;
  return 1.0 - b / (static_cast<double>(busy.size()) * makespan);
}

DagResult simulateDag(const Schedule& sched, const PipelineCosts& costs, const std::vector<ExtraDep>& extra) {
  const int p = sched.stages, M = sched.micro_batches, V = sched.virtualStages();
  if (costs.vstages != V || costs.micro_batches != M ||
      costs.fwd.size() != static_cast<std::size_t>(V) * static_cast<std::size_t>(M) ||
      costs.bwd.size() != costs.fwd.size() || costs.p2p.size() != static_cast<std::size_t>(M) ||
      (!costs.free_bytes.empty() && costs.free_bytes.size() != costs.fwd.size()) ||
      (!costs.p2p_bwd.empty() && costs.p2p_bwd.size() != costs.p2p.size()))
    throw std::logic_error("simulateDag: costs shape does not match the schedule (" + std::to_string(V) +
                           " virtual stages x " + std::to_string(M) + " micro-batches)");
  DagResult r;
  // Vertices and the (vstage, mb, phase) -> vertex map.
  r.stage_offset.resize(static_cast<std::size_t>(p) + 1, 0);
  for (int s = 0; s < p; ++s)
    r.stage_offset[s + 1] = r.stage_offset[s] + sched.order[static_cast<std::size_t>(s)].size();
  const std::size_t nv = r.stage_offset[p];
  const std::size_t kNone = static_cast<std::size_t>(-1);
  std::vector<std::size_t> vid(static_cast<std::size_t>(V * M * 2), kNone);
  auto key = [&](int vs, int mb, Phase ph) {
    return (static_cast<std::size_t>(vs) * M + mb) * 2 + static_cast<std::size_t>(ph);
  };
  r.vertices.resize(nv);
  r.cost.resize(nv);
  for (int s = 0; s < p; ++s) {
    const auto& o = sched.order[static_cast<std::size_t>(s)];
    for (std::size_t i = 0; i < o.size(); ++i) {
      const Task& t = o[i];
      const std::size_t v = r.stage_offset[s] + i;
      const int vs = sched.virtualStage(s, t.chunk);
      std::size_t& slot = vid[key(vs, t.mb, t.phase)];
      if (slot != kNone) throw std::logic_error("simulateDag: duplicate task in schedule");
      slot = v;
      r.vertices[v] = {s, t};
      r.cost[v] = t.phase == Phase::Fwd ? costs.fwd[costs.at(vs, t.mb)] : costs.bwd[costs.at(vs, t.mb)];
    }
  }
  for (std::size_t k = 0; k < vid.size(); ++k)
    if (vid[k] == kNone) throw std::logic_error("simulateDag: schedule misses a task");

  // Edges in CSR form (successor lists with delays), generated twice: once to count, once
  // to fill (no edge list of its own: it was the largest allocation of a simulation).
  const auto eachEdge = [&](auto&& edge) {
    for (int s = 0; s < p; ++s)
      for (std::size_t v = r.stage_offset[s] + 1; v < r.stage_offset[s + 1]; ++v) edge(v - 1, v, 0.0);
    for (int mb = 0; mb < M; ++mb) {
      const double d = costs.p2p[static_cast<std::size_t>(mb)];
      const double db = costs.p2p_bwd.empty() ? d : costs.p2p_bwd[static_cast<std::size_t>(mb)];
      for (int vs = 0; vs + 1 < V; ++vs) {
        const bool cross = sched.stageOf(vs) != sched.stageOf(vs + 1);
        edge(vid[key(vs, mb, Phase::Fwd)], vid[key(vs + 1, mb, Phase::Fwd)], cross ? d : 0.0);
        edge(vid[key(vs + 1, mb, Phase::Bwd)], vid[key(vs, mb, Phase::Bwd)], cross ? db : 0.0);
      }
      if (sched.paired) edge(vid[key(V - 1, mb, Phase::Fwd)], vid[key(V - 1, mb, Phase::Bwd)], 0.0);
    }
    for (const auto* list : {&sched.deps, &extra})
      for (const TaskDep& e : *list) {
        if (e.from_mb < 0 || e.from_mb >= M || e.to_mb < 0 || e.to_mb >= M)
          throw std::logic_error("simulateDag: dependency out of range");
        for (int vs = 0; vs < V; ++vs)
          edge(vid[key(vs, e.from_mb, e.from_phase)], vid[key(vs, e.to_mb, e.to_phase)], 0.0);
      }
  };
  std::vector<std::size_t> head(nv + 1, 0), indeg(nv, 0);
  eachEdge([&](std::size_t from, std::size_t to, double) {
    ++head[from + 1];
    ++indeg[to];
  });
  for (std::size_t v = 0; v < nv; ++v) head[v + 1] += head[v];
  std::vector<std::size_t> succ(head[nv]);
  std::vector<double> delay(head[nv]);
  {
    std::vector<std::size_t> fill(head.begin(), head.end() - 1);
    eachEdge([&](std::size_t from, std::size_t to, double dl) {
      succ[fill[from]] = to;
      delay[fill[from]++] = dl;
    });
  }

  // Kahn sweep: start = max(pred finish + delay).
  r.start.assign(nv, 0.0);
  r.finish.assign(nv, 0.0);
  std::vector<std::size_t> crit(nv, kNone), queue;
  queue.reserve(nv);
  for (std::size_t v = 0; v < nv; ++v)
    if (indeg[v] == 0) queue.push_back(v);
  for (std::size_t qi = 0; qi < queue.size(); ++qi) {
    const std::size_t v = queue[qi];
    r.finish[v] = r.start[v] + r.cost[v];
    for (std::size_t k = head[v]; k < head[v + 1]; ++k) {
      const std::size_t w = succ[k];
      const double t = r.finish[v] + delay[k];
      if (t >= r.start[w]) {
        r.start[w] = t;
        crit[w] = v;
      }
      if (--indeg[w] == 0) queue.push_back(w);
    }
  }
  if (queue.size() != nv)
    throw std::logic_error("simulateDag: the " + std::string(scheduleKindName(sched.kind)) +
                           " schedule deadlocks (cyclic dependencies)");

  // Per-stage statistics and memory.
  r.busy.assign(static_cast<std::size_t>(p), 0.0);
  r.stage_finish.assign(static_cast<std::size_t>(p), 0.0);
  r.peak_bytes.assign(static_cast<std::size_t>(p), 0.0);
  r.peak_inflight.assign(static_cast<std::size_t>(p), 0);
  r.memory_timeline.assign(static_cast<std::size_t>(p), {});
  std::size_t last = 0;
  for (int s = 0; s < p; ++s) {
    const double base = s < static_cast<int>(costs.static_bytes.size()) ? costs.static_bytes[s] : 0.0;
    double cur = 0, peak = 0;
    int live = 0, peak_live = 0;
    auto& tl = r.memory_timeline[static_cast<std::size_t>(s)];
    tl.reserve(r.stage_offset[s + 1] - r.stage_offset[s] + 1);
    tl.push_back({0.0, base});
    for (std::size_t v = r.stage_offset[s]; v < r.stage_offset[s + 1]; ++v) {
      const Task& t = r.vertices[v].task;
      const std::size_t at = costs.at(sched.virtualStage(s, t.chunk), t.mb);
      const std::vector<double>& bytes =
          t.phase == Phase::Bwd && !costs.free_bytes.empty() ? costs.free_bytes : costs.act_bytes;
      const double a = bytes.empty() ? 0.0 : bytes[at];
      r.busy[s] += r.cost[v];
      if (t.phase == Phase::Fwd) {
        cur += a;
        peak_live = std::max(peak_live, ++live);
        peak = std::max(peak, cur);
        tl.push_back({r.start[v], base + cur});
      } else {
        cur -= a;
        --live;
        tl.push_back({r.finish[v], base + cur});
      }
      r.stage_finish[s] = std::max(r.stage_finish[s], r.finish[v]);
      if (r.finish[v] >= r.makespan) {
        r.makespan = r.finish[v];
        last = v;
      }
    }
    r.peak_bytes[s] = base + peak;
    r.peak_inflight[s] = peak_live;
  }
  // Critical path: follow the binding predecessor back from the last-finishing vertex.
  if (nv > 0) {
    for (std::size_t v = last; v != kNone; v = crit[v]) r.critical_path.push_back(v);
    std::reverse(r.critical_path.begin(), r.critical_path.end());
  }
  return r;
}

}  // namespace wlb::pp
