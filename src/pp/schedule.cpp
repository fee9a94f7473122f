#include "pp/schedule.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>

#include "core/error.hpp"

namespace wlb::pp {

ScheduleKind parseScheduleKind(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::GPipe;
  if (name == "1f1b") return ScheduleKind::OneFOneB;
  if (name == "interleaved") return ScheduleKind::Interleaved;
  if (name == "packflow") return ScheduleKind::PackFlow;
  throw InputError("pipeline.schedule: unknown schedule '" + name + "' (allowed: gpipe, 1f1b, interleaved, packflow)",
                   true);
}

const char* scheduleKindName(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::GPipe:
      return "gpipe";
    case ScheduleKind::OneFOneB:
      return "1f1b";
    case ScheduleKind::Interleaved:
      return "interleaved";
    case ScheduleKind::PackFlow:
      return "packflow";
  }
  return "?";
}

namespace {
void checkShape(int stages, int micro_batches, int chunks) {
  if (stages < 1) throw InputError("mesh.pp: pipeline stages must be >= 1", true);
  if (micro_batches < 1) throw InputError("packing.micro_batches: need at least one micro-batch", true);
  if (chunks < 1) throw InputError("mesh.virtual_stages: must be >= 1", true);
}
Schedule blank(ScheduleKind kind, int stages, int micro_batches, int chunks) {
  Schedule s;
  s.kind = kind;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.chunks = chunks;
  s.order.assign(static_cast<std::size_t>(stages), {});
  for (auto& o : s.order) o.reserve(2 * static_cast<std::size_t>(micro_batches) * static_cast<std::size_t>(chunks));
  return s;
}
}  // namespace

PipelineLayout pipelineLayout(const Deck& deck) {
  PipelineLayout p;
  p.kind = parseScheduleKind(deck.pipeline.schedule);
  p.stages = static_cast<int>(deck.mesh.pp);
  p.chunks =
      p.kind == ScheduleKind::Interleaved ? static_cast<int>(std::max<std::int64_t>(1, deck.mesh.virtual_stages)) : 1;
  return p;
}

Schedule PipelineLayout::schedule(int micro_batches) const {
  return makeSchedule(kind, stages, micro_batches, chunks);
}

LayerBlock layerBlock(int layers, int vstages, int vstage) {
  if (vstages < 1 || vstage < 0 || vstage >= vstages)
    throw std::logic_error("layerBlock: virtual stage " + std::to_string(vstage) + " of " + std::to_string(vstages));
  if (layers < vstages)
    throw InputError("model.layers = " + std::to_string(layers) + " is fewer than the " + std::to_string(vstages) +
                         " pipeline (virtual) stages: every stage needs at least one layer",
                     true);
  const int base = layers / vstages, extra = layers % vstages;
  LayerBlock b;
  b.count = base + (vstage < extra ? 1 : 0);
  b.first = vstage * base + std::min(vstage, extra);
  return b;
}

Schedule makeGPipe(int stages, int micro_batches) {
  checkShape(stages, micro_batches, 1);
  Schedule s = blank(ScheduleKind::GPipe, stages, micro_batches, 1);
  for (int st = 0; st < stages; ++st) {
    auto& o = s.order[static_cast<std::size_t>(st)];
    for (int m = 0; m < micro_batches; ++m) o.push_back({Phase::Fwd, m, 0});
    for (int m = micro_batches - 1; m >= 0; --m) o.push_back({Phase::Bwd, m, 0});
  }
  return s;
}

Schedule makeOneFOneB(int stages, int micro_batches) {
  checkShape(stages, micro_batches, 1);
  Schedule s = blank(ScheduleKind::OneFOneB, stages, micro_batches, 1);
  for (int st = 0; st < stages; ++st) {
    auto& o = s.order[static_cast<std::size_t>(st)];
    const int warmup = std::min(stages - st - 1, micro_batches);
    const int steady = micro_batches - warmup;
    for (int m = 0; m < warmup; ++m) o.push_back({Phase::Fwd, m, 0});
    for (int i = 0; i < steady; ++i) {
      o.push_back({Phase::Fwd, warmup + i, 0});
      o.push_back({Phase::Bwd, i, 0});
    }
    for (int i = steady; i < micro_batches; ++i) o.push_back({Phase::Bwd, i, 0});
  }
  return s;
}

Schedule makeInterleaved(int stages, int micro_batches, int chunks) {
  checkShape(stages, micro_batches, chunks);
  if (chunks == 1) {
    Schedule s = makeOneFOneB(stages, micro_batches);
    s.kind = ScheduleKind::Interleaved;
    return s;
  }
  if (micro_batches % stages != 0)
    throw InputError("pipeline.schedule = interleaved needs packing.micro_batches (" + std::to_string(micro_batches) +
                         ") divisible by mesh.pp (" + std::to_string(stages) + "), as Megatron does",
                     true);
  Schedule s = blank(ScheduleKind::Interleaved, stages, micro_batches, chunks);
  const int p = stages, v = chunks, total = micro_batches * chunks;
  auto taskOf = [&](int k, Phase ph) {
    const int group = k / (p * v);
    const int in_group = k % (p * v);
    int chunk = in_group / p;
    if (ph == Phase::Bwd) chunk = v - 1 - chunk;
    return Task{ph, group * p + in_group % p, chunk};
  };
  for (int st = 0; st < p; ++st) {
    auto& o = s.order[static_cast<std::size_t>(st)];
    int warmup = (micro_batches == p) ? total : std::min((p - st - 1) * 2 + (v - 1) * p, total);
    const int steady = total - warmup;
    for (int k = 0; k < warmup; ++k) o.push_back(taskOf(k, Phase::Fwd));
    for (int i = 0; i < steady; ++i) {
      o.push_back(taskOf(warmup + i, Phase::Fwd));
      o.push_back(taskOf(i, Phase::Bwd));
    }
    for (int k = steady; k < total; ++k) o.push_back(taskOf(k, Phase::Bwd));
  }
  return s;
}

// ---- PackFlow ----------------------------------------------------------------------------

ReplicaSlices replicaSlices(const std::vector<MicroBatch>& fwd, const std::vector<std::int64_t>& bwd_cuts) {
  ReplicaSlices r;
  r.fwd_cuts.push_back(0);
  for (std::size_t k = 0; k < fwd.size(); ++k) {
    for (const auto& s : fwd[k].segments) {
      r.segments.push_back(s);
      r.fwd_pack.push_back(static_cast<int>(k));
    }
    r.fwd_cuts.push_back(static_cast<std::int64_t>(r.segments.size()));
  }
  const auto n = static_cast<std::int64_t>(r.segments.size());
  r.bwd_cuts = bwd_cuts.empty() ? r.fwd_cuts : bwd_cuts;
  bool ok = r.bwd_cuts.size() == r.fwd_cuts.size() && r.bwd_cuts.front() == 0 && r.bwd_cuts.back() == n;
  for (std::size_t k = 1; ok && k < r.bwd_cuts.size(); ++k) ok = r.bwd_cuts[k - 1] <= r.bwd_cuts[k];
  if (!ok)
    throw InputError("plan: 'backward' of a replica must hold " + std::to_string(fwd.size() + 1) +
                     " non-decreasing cut points from 0 to its " + std::to_string(n) +
                     " segments (docs/plan-format.md)");
  // (doc, end offset, segment), sorted: a segment's predecessor is the last segment of its
  // document that ends where it starts.
  std::vector<std::tuple<DocId, std::int64_t, std::int64_t>> ends;
  ends.reserve(r.segments.size());
  for (std::size_t i = 0; i < r.segments.size(); ++i)
    ends.emplace_back(r.segments[i].doc, r.segments[i].offset + r.segments[i].length, static_cast<std::int64_t>(i));
  std::sort(ends.begin(), ends.end());
  const auto find = [&](const Segment& s) -> std::int64_t {
    const auto next = std::make_tuple(s.doc, s.offset, std::numeric_limits<std::int64_t>::max());
    const auto it = std::upper_bound(ends.begin(), ends.end(), next);
    if (it == ends.begin()) return -1;
    const auto& [doc, end, i] = *std::prev(it);
    return doc == s.doc && end == s.offset ? i : -1;
  };
  r.continued.assign(r.segments.size(), 0);
  r.prev.reserve(r.segments.size());
  for (const auto& s : r.segments) {
    const std::int64_t p = find(s);
    r.prev.push_back(p);
    if (s.q_offset > 0 && r.prev.back() >= 0) r.continued[static_cast<std::size_t>(r.prev.back())] = 1;
  }
  r.bwd_pack.resize(r.segments.size());
  for (std::size_t k = 0; k + 1 < r.bwd_cuts.size(); ++k)
    for (auto i = r.bwd_cuts[k]; i < r.bwd_cuts[k + 1]; ++i)
      r.bwd_pack[static_cast<std::size_t>(i)] = static_cast<int>(k);
  return r;
}

bool PackFlowDeps::trivial() const {
  if (!before.empty()) return false;
  for (std::size_t k = 0; k < needs.size(); ++k)
    if (needs[k] != static_cast<int>(k)) return false;
  return true;
}

PackFlowDeps packFlowDeps(const ReplicaSlices& r) {
  const int M = r.microPacks();
  PackFlowDeps d;
  d.needs.assign(static_cast<std::size_t>(M), -1);
  for (int k = 0; k < M; ++k) {
    const auto b0 = r.bwd_cuts[static_cast<std::size_t>(k)], b1 = r.bwd_cuts[static_cast<std::size_t>(k) + 1];
    for (auto i = b0; i < b1; ++i) d.needs[k] = std::max(d.needs[k], r.fwd_pack[static_cast<std::size_t>(i)]);
  }
  // A slice's keys are its document's tokens before it: it follows the segment of the same
  // document that ends where it starts.
  std::vector<std::pair<int, int>> before;
  for (std::size_t i = 0; i < r.segments.size(); ++i) {
    const Segment& s = r.segments[i];
    if (s.q_offset == 0 || r.prev[i] < 0) continue;  // no prefix, or trained in an earlier step
    const auto j = static_cast<std::size_t>(r.prev[i]);
    if (r.fwd_pack[j] > r.fwd_pack[i])
      throw InputError("plan: the slice of document " + std::to_string(s.doc) + " at offset " +
                       std::to_string(s.offset) + " is in forward MicroPack " + std::to_string(r.fwd_pack[i]) +
                       ", before the slice it continues (MicroPack " + std::to_string(r.fwd_pack[j]) +
                       "): PackFlow runs forwards first-in-first-out");
    if (r.bwd_pack[i] != r.bwd_pack[j]) before.push_back({r.bwd_pack[i], r.bwd_pack[j]});
  }
  std::sort(before.begin(), before.end());
  before.erase(std::unique(before.begin(), before.end()), before.end());
  d.before = std::move(before);
  return d;
}

PackFlowDeps planFlowDeps(const StepPlan& plan, std::size_t d, const ReplicaSlices& r) {
  PackFlowDeps deps = packFlowDeps(r);
  for (const auto& m : plan.merged)
    if (m.member(static_cast<std::int64_t>(d)) >= 0 && m.slot < static_cast<std::int64_t>(deps.needs.size()))
      deps.needs[static_cast<std::size_t>(m.slot)] = static_cast<int>(m.slot);
  return deps;
}

std::vector<int> packFlowBackwardOrder(int M, const PackFlowDeps& deps) {
  std::vector<int> needs = deps.needs;
  if (needs.empty())
    for (int k = 0; k < M; ++k) needs.push_back(k);
  if (static_cast<int>(needs.size()) != M)
    throw std::logic_error("packFlowBackwardOrder: " + std::to_string(needs.size()) + " needs for " +
                           std::to_string(M) + " MicroPacks");
  std::vector<std::vector<int>> succ(static_cast<std::size_t>(M));
  std::vector<int> indeg(static_cast<std::size_t>(M), 0);
  for (const auto& [b, a] : deps.before) {
    if (b < 0 || b >= M || a < 0 || a >= M || a == b)
      throw std::logic_error("packFlowBackwardOrder: dependency out of range");
    succ[static_cast<std::size_t>(b)].push_back(a);
    ++indeg[static_cast<std::size_t>(a)];
  }
  // Of the backwards free to go, the one whose forward need comes first; empty ones last.
  using Key = std::tuple<int, int>;
  std::priority_queue<Key, std::vector<Key>, std::greater<>> ready;
  auto key = [&](int k) {
    return Key{needs[static_cast<std::size_t>(k)] < 0 ? M : needs[static_cast<std::size_t>(k)], k};
  };
  for (int k = 0; k < M; ++k)
    if (indeg[static_cast<std::size_t>(k)] == 0) ready.push(key(k));
  std::vector<int> order;
  order.reserve(static_cast<std::size_t>(M));
  while (!ready.empty()) {
    const int k = std::get<1>(ready.top());
    ready.pop();
    order.push_back(k);
    for (const int a : succ[static_cast<std::size_t>(k)])
      if (--indeg[static_cast<std::size_t>(a)] == 0) ready.push(key(a));
  }
  if (static_cast<int>(order.size()) != M)
    throw InputError(
        "plan: the slices' backward order is cyclic (a sample's slices must run last-in-first-out in "
        "the backward); pipeline.schedule = packflow cannot order this plan");
  return order;
}

Schedule makePackFlow(int stages, int micro_batches, const PackFlowDeps& deps_in) {
  checkShape(stages, micro_batches, 1);
  PackFlowDeps deps = deps_in;
  if (deps.needs.empty())
    for (int k = 0; k < micro_batches; ++k) deps.needs.push_back(k);
  for (const int n : deps.needs)
    if (n >= micro_batches) throw std::logic_error("makePackFlow: a backward needs a forward out of range");
  const std::vector<int> beta = packFlowBackwardOrder(micro_batches, deps);
  Schedule s = blank(ScheduleKind::PackFlow, stages, micro_batches, 1);
  s.paired = false;
  for (int k = 0; k < micro_batches; ++k)
    if (deps.needs[static_cast<std::size_t>(k)] >= 0)
      s.deps.push_back({deps.needs[static_cast<std::size_t>(k)], Phase::Fwd, k, Phase::Bwd});
  for (const auto& [b, a] : deps.before) s.deps.push_back({b, Phase::Bwd, a, Phase::Bwd});
  // Stage s keeps 1F1B's p-s-1 forwards ahead of what the next backward needs (so it has
  // forwards to run while that backward comes up the pipeline), one backward per forward.
  // The forwards before the i-th backward never increase from one stage to the next, so
  // the cross-stage transfers cannot close a cycle.
  for (int st = 0; st < stages; ++st) {
    auto& o = s.order[static_cast<std::size_t>(st)];
    int nf = 0;
    std::size_t i = 0;
    const int ahead = stages - st - 1;
    while (i < beta.size()) {
      if (nf < micro_batches) o.push_back({Phase::Fwd, nf++, 0});
      if (nf == micro_batches || deps.needs[static_cast<std::size_t>(beta[i])] + ahead < nf)
        o.push_back({Phase::Bwd, beta[i++], 0});
    }
  }
  return s;
}

Schedule makeSchedule(ScheduleKind kind, int stages, int micro_batches, int chunks) {
  switch (kind) {
    case ScheduleKind::GPipe:
      return makeGPipe(stages, micro_batches);
    case ScheduleKind::OneFOneB:
      return makeOneFOneB(stages, micro_batches);
    case ScheduleKind::Interleaved:
      return makeInterleaved(stages, micro_batches, chunks);
    case ScheduleKind::PackFlow:
      return makePackFlow(stages, micro_batches);
  }
  throw std::logic_error("makeSchedule: bad kind");
}

void validateSchedule(const Schedule& s) {
  if (static_cast<int>(s.order.size()) != s.stages)
    throw std::logic_error("schedule: order has " + std::to_string(s.order.size()) + " stages, expected " +
                           std::to_string(s.stages));
  const std::size_t per = static_cast<std::size_t>(s.micro_batches) * static_cast<std::size_t>(s.chunks);
  for (int st = 0; st < s.stages; ++st) {
    const auto& o = s.order[static_cast<std::size_t>(st)];
    if (o.size() != 2 * per)
      throw std::logic_error("schedule: stage " + std::to_string(st) + " has " + std::to_string(o.size()) +
                             " tasks, expected " + std::to_string(2 * per));
    std::vector<int> seen(2 * per, 0);
    for (const Task& t : o) {
      if (t.mb < 0 || t.mb >= s.micro_batches || t.chunk < 0 || t.chunk >= s.chunks)
        throw std::logic_error("schedule: stage " + std::to_string(st) + " has an out-of-range task");
      const std::size_t key =
          static_cast<std::size_t>(t.mb) * static_cast<std::size_t>(s.chunks) + static_cast<std::size_t>(t.chunk);
      if (t.phase == Phase::Fwd) {
        if (seen[key]++) throw std::logic_error("schedule: duplicate forward task");
      } else {
        if (s.paired && !seen[key])
          throw std::logic_error("schedule: stage " + std::to_string(st) + " runs B" + std::to_string(t.mb) + "." +
                                 std::to_string(t.chunk) + " before its forward");
        if (seen[per + key]++) throw std::logic_error("schedule: duplicate backward task");
      }
    }
    // Dependencies hold in every stage's order (per chunk).
    if (s.deps.empty()) continue;
    std::vector<std::size_t> pos(2 * per, 0);
    for (std::size_t i = 0; i < o.size(); ++i) {
      const Task& t = o[i];
      pos[(t.phase == Phase::Fwd ? 0 : per) + static_cast<std::size_t>(t.mb * s.chunks + t.chunk)] = i;
    }
    for (const TaskDep& d : s.deps) {
      if (d.from_mb < 0 || d.from_mb >= s.micro_batches || d.to_mb < 0 || d.to_mb >= s.micro_batches)
        throw std::logic_error("schedule: dependency out of range");
      for (int c = 0; c < s.chunks; ++c) {
        const auto at = [&](int mb, Phase ph) {
          return pos[(ph == Phase::Fwd ? 0 : per) + static_cast<std::size_t>(mb * s.chunks + c)];
        };
        if (at(d.from_mb, d.from_phase) >= at(d.to_mb, d.to_phase))
          throw std::logic_error("schedule: stage " + std::to_string(st) + " runs " +
                                 (d.to_phase == Phase::Fwd ? "F" : "B") + std::to_string(d.to_mb) + " before " +
                                 (d.from_phase == Phase::Fwd ? "F" : "B") + std::to_string(d.from_mb) +
                                 ", which it depends on");
      }
    }
  }
}

std::string renderSchedule(const Schedule& s) {
  std::ostringstream os;
  for (int st = 0; st < s.stages; ++st) {
    os << "stage " << st << ":";
    for (const Task& t : s.order[static_cast<std::size_t>(st)]) {
      os << ' ' << (t.phase == Phase::Fwd ? 'F' : 'B') << t.mb;
      if (s.chunks > 1) os << '.' << t.chunk;
    }
    os << '\n';
  }
  return os.str();
}

}  // namespace wlb::pp
