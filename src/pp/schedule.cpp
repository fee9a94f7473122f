#include "pp/schedule.hpp"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>

#include "core/error.hpp"

namespace wlb::pp {

ScheduleKind parseScheduleKind(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::GPipe;
  if (name == "1f1b") return ScheduleKind::OneFOneB;
  if (name == "interleaved") return ScheduleKind::Interleaved;
  throw InputError("pipeline.schedule: unknown schedule '" + name + "' (allowed: gpipe, 1f1b, interleaved)", true);
}

const char* scheduleKindName(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::GPipe:
      return "gpipe";
    case ScheduleKind::OneFOneB:
      return "1f1b";
    case ScheduleKind::Interleaved:
      return "interleaved";
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
  for (auto& o : s.order) o.reserve(static_cast<std::size_t>(2 * micro_batches * chunks));
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

Schedule makeSchedule(ScheduleKind kind, int stages, int micro_batches, int chunks) {
  switch (kind) {
    case ScheduleKind::GPipe:
      return makeGPipe(stages, micro_batches);
    case ScheduleKind::OneFOneB:
      return makeOneFOneB(stages, micro_batches);
    case ScheduleKind::Interleaved:
      return makeInterleaved(stages, micro_batches, chunks);
  }
  throw std::logic_error("makeSchedule: bad kind");
}

void validateSchedule(const Schedule& s) {
  if (static_cast<int>(s.order.size()) != s.stages)
    throw std::logic_error("schedule: order has " + std::to_string(s.order.size()) + " stages, expected " +
                           std::to_string(s.stages));
  const std::size_t per = static_cast<std::size_t>(s.micro_batches * s.chunks);
  for (int st = 0; st < s.stages; ++st) {
    const auto& o = s.order[static_cast<std::size_t>(st)];
    if (o.size() != 2 * per)
      throw std::logic_error("schedule: stage " + std::to_string(st) + " has " + std::to_string(o.size()) +
                             " tasks, expected " + std::to_string(2 * per));
    std::vector<int> seen(2 * per, 0);
    for (const Task& t : o) {
      if (t.mb < 0 || t.mb >= s.micro_batches || t.chunk < 0 || t.chunk >= s.chunks)
        throw std::logic_error("schedule: stage " + std::to_string(st) + " has an out-of-range task");
      const std::size_t key = static_cast<std::size_t>(t.mb * s.chunks + t.chunk);
      if (t.phase == Phase::Fwd) {
        if (seen[key]++) throw std::logic_error("schedule: duplicate forward task");
      } else {
        if (!seen[key])
          throw std::logic_error("schedule: stage " + std::to_string(st) + " runs B" + std::to_string(t.mb) + "." +
                                 std::to_string(t.chunk) + " before its forward");
        if (seen[per + key]++) throw std::logic_error("schedule: duplicate backward task");
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
