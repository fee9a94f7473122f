#include "packing/runner.hpp"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "core/error.hpp"

namespace wlb::packing {

nlohmann::json RunResult::toJson() const {
  nlohmann::json j = {{"packer", packer}, {"summary", summary.toJson()}, {"wall_seconds", wall_seconds}};
  if (checked)
    j["check"] = {{"ok", check_ok},
                  {"lost_tokens", lost_tokens},
                  {"duplicated", duplicated},
                  {"completed_documents", completed_docs},
                  {"in_flight_documents", in_flight_docs},
                  {"report", check_report}};
  return j;
}

RunResult runPacker(data::LengthSource& src, Packer& packer, const model::CostModel& cost, const RunOptions& opt) {
  using clock = std::chrono::steady_clock;
  const auto w0 = clock::now();
  RunResult r;
  r.packer = packer.name();
  ConservationChecker checker(capacity(packer));
  if (opt.check) checker.addHeld(packer.heldSegments());  // non-empty only on a resumed stream
  const std::int64_t first = src.nextStep();
  for (std::int64_t t = first; t < first + opt.steps; ++t) {
    auto docs = src.next(t);
    if (opt.check) checker.addIncoming(docs);
    const auto t0 = clock::now();
    StepPlan plan = packer.pack(t, docs);
    const auto t1 = clock::now();
    if (opt.check) checker.addPlan(plan);
    StepMetrics m = computeMetrics(plan, cost);
    m.plan_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
    m.solver = packer.lastSolverInfo();
    r.summary.add(m);
    if (opt.on_step) opt.on_step(plan, m, static_cast<std::int64_t>(docs.size()));
  }
  r.summary.finish();
  if (opt.check) {
    r.checked = true;
    const auto pending = packer.pendingTokens();
    r.check_ok = checker.ok(pending);
    r.lost_tokens = checker.lostTokens(pending);
    r.duplicated = checker.duplicated();
    r.completed_docs = checker.completed();
    r.in_flight_docs = checker.inFlight();
    r.check_report = checker.report(pending);
  }
  r.wall_seconds = std::chrono::duration<double>(clock::now() - w0).count();
  return r;
}

nlohmann::json saveCheckpoint(const data::LengthSource& src, const Packer& packer) {
  return {{"format", "wlb-packer-state"},
          {"version", 1},
          {"packer", packer.name()},
          {"source", src.saveState()},
          {"state", packer.saveState()}};
}

// (Lengths: segsFromJson; no micro-batch bound, since SlimPack keeps samples longer than a
// micro-batch whole and slices them itself.)
void checkHeld(const data::LengthSource& src, const Packer& packer) {
  std::vector<Segment> held = packer.heldSegments();
  for (const Segment& s : held)
    if (s.doc >= src.nextId() || s.arrival_step >= src.nextStep())
      throw InputError(
          fmt::format("packer state: held segment [doc {}, offset {}, length {}, arrival {}] is not a "
                      "piece of a document the source drew (next id {}, next step {})",
                      s.doc, s.offset, s.length, s.arrival_step, src.nextId(), src.nextStep()));
  std::sort(held.begin(), held.end(),
            [](const Segment& a, const Segment& b) { return a.doc != b.doc ? a.doc < b.doc : a.offset < b.offset; });
  for (std::size_t i = 1; i < held.size(); ++i)
    if (held[i].doc == held[i - 1].doc && held[i].offset < held[i - 1].offset + held[i - 1].length)
      throw InputError(
          fmt::format("packer state: document {} is held twice (tokens {}..{} and from {}): restoring "
                      "it would duplicate them",
                      held[i].doc, held[i - 1].offset, held[i - 1].offset + held[i - 1].length - 1, held[i].offset));
}

void loadCheckpoint(const nlohmann::json& j, data::LengthSource& src, Packer& packer, const std::string& what) {
  try {
    if (j.at("format").get<std::string>() != "wlb-packer-state" || j.at("version").get<int>() != 1)
      throw InputError(fmt::format("{}: not a wlb-packer-state version 1 checkpoint", what));
    const auto name = j.at("packer").get<std::string>();
    if (name != packer.name())
      throw InputError(fmt::format("{}: checkpoint is for packer '{}', not '{}'", what, name, packer.name()));
    src.loadState(j.at("source"));
    packer.loadState(j.at("state"));
    checkHeld(src, packer);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("{}: bad packer checkpoint: {}", what, e.what()));
  } catch (const InputError& e) {
    // name the file: the source/packer messages do not know it
    const std::string msg = e.what();
    if (msg.rfind(what, 0) == 0) throw;
    throw InputError(fmt::format("{}: {}", what, msg), e.collective());
  }
}

}  // namespace wlb::packing
