// A StepPlan's JSON form (core/plan_json.hpp).
#include "core/plan_json.hpp"

#include <algorithm>
#include <string>
#include <vector>

namespace wlb {

nlohmann::json planToJson(const StepPlan& plan) {
  nlohmann::json reps = nlohmann::json::array();
  for (const auto& rep : plan.replicas) {
    nlohmann::json mbs = nlohmann::json::array();
    for (const auto& mb : rep) {
      nlohmann::json segs = nlohmann::json::array();
      for (const auto& s : mb.segments) {
        auto e = nlohmann::json::array({s.doc, s.offset, s.length, s.arrival_step});
        if (s.q_offset != 0) e.push_back(s.q_offset);  // slices only: old readers see 4 fields
        segs.push_back(std::move(e));
      }
      mbs.push_back(std::move(segs));
    }
    reps.push_back(std::move(mbs));
  }
  nlohmann::json j = {{"type", "step"}, {"step", plan.step}, {"replicas", std::move(reps)}, {"delayed", plan.delayed}};
  // SlimPack's fields, where the plan has them
  if (!plan.backward.empty()) j["backward"] = plan.backward;
  if (!plan.merged.empty()) {
    nlohmann::json mg = nlohmann::json::array();
    for (const auto& m : plan.merged) mg.push_back({{"slot", m.slot}, {"group", m.group}});
    j["merged"] = std::move(mg);
  }
  if (!plan.memory.partition.empty()) {
    std::vector<double> gb;
    for (const auto b : plan.memory.peak_bytes) gb.push_back(b / 1e9);
    j["memory"] = {{"partition", plan.memory.partition},
                   {"held", plan.memory.held},
                   {"peak_gb", gb},
                   {"budget_gb", plan.memory.budget_bytes / 1e9}};
  }
  return j;
}

StepPlan planFromJson(const nlohmann::json& j) {
  StepPlan p;
  p.step = jsonIntegerAt<std::int64_t>(j, "step");
  // Lists all the way down: iterating a JSON null yields nothing, so a `null` micro-batch
  // would otherwise read as an empty one.
  if (!j.at("replicas").is_array()) throw InputError("'replicas' must be a list of replicas");
  for (const auto& rep : j.at("replicas")) {
    if (!rep.is_array()) throw InputError("a replica must be a list of micro-batches");
    std::vector<MicroBatch> mbs;
    for (const auto& mb : rep) {
      if (!mb.is_array()) throw InputError("a micro-batch must be a list of segments ([] when empty)");
      MicroBatch m;
      for (const auto& s : mb) {
        if (!s.is_array() || s.size() < 4 || s.size() > 5)
          throw InputError("segment must be [doc, offset, length, arrival_step(, q_offset)]");
        Segment seg{jsonInteger<DocId>(s[0], "doc"), jsonInteger<std::int64_t>(s[1], "offset"),
                    jsonInteger<std::int64_t>(s[2], "length"), jsonInteger<std::int64_t>(s[3], "arrival_step"),
                    s.size() == 5 ? jsonInteger<std::int64_t>(s[4], "q_offset") : 0};
        if (seg.doc < 0 || seg.offset < 0 || seg.length < 1 || seg.arrival_step < 0 || seg.q_offset < 0 ||
            seg.q_offset > seg.offset || seg.length > kMaxDocTokens || seg.offset > kMaxDocTokens - seg.length)
          throw InputError(
              fmt::format("segment [{}, {}, {}, {}, {}]: need doc >= 0, offset >= 0, length >= 1, "
                          "arrival_step >= 0, 0 <= q_offset <= offset, offset + length <= {}",
                          seg.doc, seg.offset, seg.length, seg.arrival_step, seg.q_offset, kMaxDocTokens));
        m.segments.push_back(seg);
      }
      mbs.push_back(std::move(m));
    }
    p.replicas.push_back(std::move(mbs));
  }
  for (const auto& d : j.at("delayed")) p.delayed.push_back(jsonInteger<DocId>(d, "delayed"));
  if (const auto it = j.find("backward"); it != j.end()) {
    if (!it->is_array() || it->size() != p.replicas.size())
      throw InputError("'backward' must hold one cut-point list per replica");
    for (std::size_t r = 0; r < it->size(); ++r) {
      std::int64_t segs = 0;
      for (const auto& mb : p.replicas[r]) segs += static_cast<std::int64_t>(mb.segments.size());
      std::vector<std::int64_t> cuts;
      for (const auto& c : (*it)[r]) cuts.push_back(jsonInteger<std::int64_t>(c, "backward"));
      bool ok = cuts.size() == p.replicas[r].size() + 1 && cuts.front() == 0 && cuts.back() == segs;
      for (std::size_t k = 1; ok && k < cuts.size(); ++k) ok = cuts[k] >= cuts[k - 1];
      if (!ok)
        throw InputError(
            fmt::format("'backward' of replica {}: need micro_batches + 1 increasing cut points "
                        "from 0 to the replica's {} segments",
                        r, segs));
      p.backward.push_back(std::move(cuts));
    }
  }
  if (const auto it = j.find("merged"); it != j.end()) {
    if (!it->is_array()) throw InputError("'merged' must be a list of {slot, group}");
    const auto dp = static_cast<std::int64_t>(p.replicas.size());
    for (const auto& e : *it) {
      if (!e.is_object() || !e.contains("slot") || !e.contains("group") || !e.at("group").is_array())
        throw InputError("'merged' entries must be {\"slot\": k, \"group\": [replicas]}");
      StepPlan::Merged m;
      m.slot = jsonInteger<std::int64_t>(e.at("slot"), "merged slot");
      for (const auto& g : e.at("group")) m.group.push_back(jsonInteger<std::int64_t>(g, "merged group"));
      bool ok = m.group.size() >= 2 && m.slot >= 0 && p.mergedAt(m.slot) == nullptr;
      for (std::size_t i = 0; ok && i < m.group.size(); ++i)
        ok = m.group[i] >= 0 && m.group[i] < dp && (i == 0 || m.group[i] > m.group[i - 1]) &&
             m.slot < static_cast<std::int64_t>(p.replicas[static_cast<std::size_t>(m.group[i])].size());
      for (std::int64_t r = 0; ok && r < dp; ++r) {
        const auto& rep = p.replicas[static_cast<std::size_t>(r)];
        const bool owner = r == m.group.front();
        ok = m.slot < static_cast<std::int64_t>(rep.size()) &&
             (owner ? rep[static_cast<std::size_t>(m.slot)].segments.size() == 1
                    : rep[static_cast<std::size_t>(m.slot)].segments.empty());
      }
      if (!ok)
        throw InputError(
            fmt::format("'merged' slot {}: need >= 2 increasing replicas of the step, one segment in the first one's "
                        "micro-batch at that slot and an empty one in every other replica, each slot once",
                        m.slot));
      p.merged.push_back(std::move(m));
    }
  }
  if (const auto it = j.find("memory"); it != j.end()) {
    static const std::vector<std::string> kinds{"flops", "sample_ends", "whole_samples", "over"};
    if (!it->is_object() || !it->contains("partition") || !it->at("partition").is_string() ||
        std::find(kinds.begin(), kinds.end(), it->at("partition").get<std::string>()) == kinds.end())
      throw InputError("'memory.partition' must be one of \"flops\", \"sample_ends\", \"whole_samples\", \"over\"");
    p.memory.partition = it->at("partition").get<std::string>();
    for (const auto& d : it->value("held", nlohmann::json::array()))
      p.memory.held.push_back(jsonInteger<DocId>(d, "memory.held"));
    for (const auto& g : it->value("peak_gb", nlohmann::json::array())) {
      if (!g.is_number() || g.get<double>() < 0) throw InputError("'memory.peak_gb' must hold numbers >= 0");
      p.memory.peak_bytes.push_back(g.get<double>() * 1e9);
    }
    const auto& b = it->value("budget_gb", nlohmann::json(0.0));
    if (!b.is_number() || b.get<double>() < 0) throw InputError("'memory.budget_gb' must be a number >= 0");
    p.memory.budget_bytes = b.get<double>() * 1e9;
    for (const auto d : p.memory.held)
      if (std::find(p.delayed.begin(), p.delayed.end(), d) == p.delayed.end())
        throw InputError(fmt::format("'memory.held' lists document {} that 'delayed' does not", d));
  }
  return p;
}

}  // namespace wlb
