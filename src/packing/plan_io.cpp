// JSONL plan format (docs/plan-format.md).
#include "packing/plan_io.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <type_traits>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/input_file.hpp"

namespace wlb::packing {

nlohmann::json toJson(const PlanHeader& h) {
  nlohmann::json j = {{"type", "header"},
                      {"format", h.format},
                      {"version", h.version},
                      {"packer", h.packer},
                      {"dp", h.dp},
                      {"micro_batches", h.micro_batches},
                      {"context_window", h.context_window},
                      {"s_max", h.s_max},
                      {"source", h.source},
                      {"documents_per_epoch", h.documents_per_epoch},
                      {"seed", h.seed},
                      {"first_step", h.first_step}};
  if (!h.strategy.empty()) j["strategy"] = h.strategy;
  if (!h.sharding.empty()) j["sharding"] = h.sharding;
  return j;
}

namespace {
// Integers are read only from JSON integers in the target's range: nlohmann's get<> on a
// float such as 1e23 is undefined behaviour (found by fuzz_plan), and a silent wrap would
// turn a corrupt plan into a plausible one.
template <class T>
T integer(const nlohmann::json& v, const char* what) {
  static_assert(std::is_integral_v<T>);
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u <= static_cast<std::uint64_t>(std::numeric_limits<T>::max())) return static_cast<T>(u);
  } else if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if constexpr (std::is_signed_v<T>) {
      if (i >= std::numeric_limits<T>::min() && i <= std::numeric_limits<T>::max()) return static_cast<T>(i);
    } else if (i >= 0) {
      return static_cast<T>(i);
    }
  }
  std::string shown = v.dump();
  if (shown.size() > 40) shown = shown.substr(0, 40) + "...";
  throw InputError(fmt::format("'{}' must be an integer in [{}, {}], got {}", what, std::numeric_limits<T>::min(),
                               std::numeric_limits<T>::max(), shown));
}
template <class T>
T integerAt(const nlohmann::json& j, const char* key) {
  return integer<T>(j.at(key), key);
}
template <class T>
T integerOr(const nlohmann::json& j, const char* key, T fallback) {
  const auto it = j.find(key);
  return it == j.end() ? fallback : integer<T>(*it, key);
}
}  // namespace

PlanHeader headerFromJson(const nlohmann::json& j) {
  PlanHeader h;
  h.format = j.at("format").get<std::string>();
  h.version = integerAt<int>(j, "version");
  h.packer = j.at("packer").get<std::string>();
  h.dp = integerAt<std::int64_t>(j, "dp");
  h.micro_batches = integerAt<std::int64_t>(j, "micro_batches");
  h.context_window = integerAt<std::int64_t>(j, "context_window");
  h.s_max = integerAt<std::int64_t>(j, "s_max");
  h.source = j.value("source", std::string());
  h.documents_per_epoch = integerOr<std::int64_t>(j, "documents_per_epoch", 0);
  h.seed = integerOr<std::uint64_t>(j, "seed", 0);
  h.first_step = integerOr<std::int64_t>(j, "first_step", 0);
  h.strategy = j.value("strategy", std::string());
  h.sharding = j.value("sharding", std::string());
  if (h.dp < 1 || h.micro_batches < 1 || h.context_window < 1 || h.s_max < h.context_window)
    throw InputError(
        fmt::format("header: need dp >= 1, micro_batches >= 1, 1 <= context_window <= s_max (got {}, {}, "
                    "{}, {})",
                    h.dp, h.micro_batches, h.context_window, h.s_max));
  return h;
}

nlohmann::json stepToJson(const StepPlan& plan, const StepMetrics& metrics, std::int64_t incoming_docs) {
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
  nlohmann::json j = {{"type", "step"},          {"step", plan.step},         {"replicas", std::move(reps)},
                      {"delayed", plan.delayed}, {"incoming", incoming_docs}, {"metrics", toJson(metrics)}};
  addSlimpackFields(plan, j);
  return j;
}

void addSlimpackFields(const StepPlan& plan, nlohmann::json& j) {
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
}

StepPlan stepFromJson(const nlohmann::json& j) {
  StepPlan p;
  p.step = integerAt<std::int64_t>(j, "step");
  for (const auto& rep : j.at("replicas")) {
    std::vector<MicroBatch> mbs;
    for (const auto& mb : rep) {
      MicroBatch m;
      for (const auto& s : mb) {
        if (!s.is_array() || s.size() < 4 || s.size() > 5)
          throw InputError("segment must be [doc, offset, length, arrival_step(, q_offset)]");
        Segment seg{integer<DocId>(s[0], "doc"), integer<std::int64_t>(s[1], "offset"),
                    integer<std::int64_t>(s[2], "length"), integer<std::int64_t>(s[3], "arrival_step"),
                    s.size() == 5 ? integer<std::int64_t>(s[4], "q_offset") : 0};
        if (seg.doc < 0 || seg.offset < 0 || seg.length < 1 || seg.arrival_step < 0 || seg.q_offset < 0 ||
            seg.q_offset > seg.offset)
          throw InputError(
              fmt::format("segment [{}, {}, {}, {}, {}]: need doc >= 0, offset >= 0, length >= 1, "
                          "arrival_step >= 0, 0 <= q_offset <= offset",
                          seg.doc, seg.offset, seg.length, seg.arrival_step, seg.q_offset));
        m.segments.push_back(seg);
      }
      mbs.push_back(std::move(m));
    }
    p.replicas.push_back(std::move(mbs));
  }
  for (const auto& d : j.at("delayed")) p.delayed.push_back(integer<DocId>(d, "delayed"));
  if (const auto it = j.find("backward"); it != j.end()) {
    if (!it->is_array() || it->size() != p.replicas.size())
      throw InputError("'backward' must hold one cut-point list per replica");
    for (std::size_t r = 0; r < it->size(); ++r) {
      std::int64_t segs = 0;
      for (const auto& mb : p.replicas[r]) segs += static_cast<std::int64_t>(mb.segments.size());
      std::vector<std::int64_t> cuts;
      for (const auto& c : (*it)[r]) cuts.push_back(integer<std::int64_t>(c, "backward"));
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
      m.slot = integer<std::int64_t>(e.at("slot"), "merged slot");
      for (const auto& g : e.at("group")) m.group.push_back(integer<std::int64_t>(g, "merged group"));
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
      p.memory.held.push_back(integer<DocId>(d, "memory.held"));
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

PlanFile readPlanFile(const std::string& path) {
  auto f = openInput(path, "plan file");
  PlanFile pf;
  std::string line;
  std::int64_t lineno = 0;
  bool have_header = false;
  while (std::getline(f, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const auto j = nlohmann::json::parse(line);
      const auto type = j.at("type").get<std::string>();
      if (type == "header") {
        if (have_header) throw InputError(fmt::format("{}:{}: second header line", path, lineno));
        pf.header = headerFromJson(j);
        if (pf.header.format != "wlb-plan" || pf.header.version != 1)
          throw InputError(fmt::format("{}:{}: not a wlb-plan version 1 file", path, lineno));
        have_header = true;
      } else if (type == "step") {
        if (!have_header) throw InputError(fmt::format("{}:{}: step before header", path, lineno));
        pf.steps.push_back(stepFromJson(j));
        pf.step_lines.push_back(lineno);
        pf.incoming.push_back(j.value("incoming", std::int64_t{0}));
        pf.metrics.push_back(j.contains("metrics") && j["metrics"].is_object() ? j["metrics"] : nlohmann::json());
        const auto& reps = pf.steps.back().replicas;
        // slimpack chooses its MicroPack count per step (the same on every replica).
        const bool per_step = pf.header.packer == "slimpack";
        const auto M =
            per_step && !reps.empty() ? static_cast<std::int64_t>(reps.front().size()) : pf.header.micro_batches;
        bool shape = static_cast<std::int64_t>(reps.size()) == pf.header.dp && M >= 1;
        for (const auto& r : reps) shape = shape && static_cast<std::int64_t>(r.size()) == M;
        if (!shape)
          throw InputError(fmt::format("{}:{}: step's replicas are not dp x micro_batches = {} x {} (header)", path,
                                       lineno, pf.header.dp, per_step ? std::string("M") : std::to_string(M)));
      } else if (type != "summary") {
        throw InputError(fmt::format("{}:{}: unknown line type '{}'", path, lineno, type));
      }
    } catch (const nlohmann::json::exception& e) {
      throw InputError(fmt::format("{}:{}: {}", path, lineno, e.what()));
    } catch (const InputError& e) {
      const std::string w = e.what();
      if (w.rfind(path, 0) == 0) throw;
      throw InputError(fmt::format("{}:{}: {}", path, lineno, w));
    }
  }
  if (!have_header) throw InputError(fmt::format("{}: empty plan file (no header line)", path));
  return pf;
}

RunPlans readRunPlans(const std::string& path) {
  namespace fs = std::filesystem;
  RunPlans rp;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    if (!fs::exists(path, ec)) throw InputError(fmt::format("{}: no such plan file or run directory", path));
    RunPlans::Strategy st;
    st.path = path;
    st.file = readPlanFile(path);
    st.strategy = st.file.header.strategy.empty() ? st.file.header.packer : st.file.header.strategy;
    st.sharding = st.file.header.sharding;
    rp.strategies.push_back(std::move(st));
    return rp;
  }
  // A run directory: its complete plan files (a killed run leaves only `*.partial` ones).
  std::vector<std::string> files;
  bool partial = false;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file()) continue;
    if (name.size() > 6 && name.substr(name.size() - 6) == ".jsonl") files.push_back(e.path().string());
    if (name.size() > 14 && name.substr(name.size() - 14) == ".jsonl.partial") partial = true;
  }
  if (ec) throw InputError(fmt::format("{}: cannot list the directory: {}", path, ec.message()));
  if (files.empty())
    throw InputError(fmt::format("{}: no plan files (*.jsonl){}", path,
                                 partial ? "; only *.partial ones: the run did not finish" : ""));
  std::sort(files.begin(), files.end());
  std::set<std::string> seen;
  for (const auto& f : files) {
    RunPlans::Strategy st;
    st.path = f;
    st.file = readPlanFile(f);
    st.strategy = st.file.header.strategy.empty() ? st.file.header.packer : st.file.header.strategy;
    st.sharding = st.file.header.sharding;
    if (!seen.insert(st.strategy).second)
      throw InputError(fmt::format("{}:1: a second plan file of strategy '{}' in {}", f, st.strategy, path));
    rp.strategies.push_back(std::move(st));
  }
  // summary.json: the run's strategy order and its step accounting (warm-up, measured steps).
  const fs::path summary = fs::path(path) / "summary.json";
  if (fs::exists(summary, ec)) {
    auto in = openInput(summary.string(), "run summary");
    try {
      const auto j = nlohmann::json::parse(in);
      if (j.value("format", std::string()) != "wlb-run-summary") throw InputError("not a wlb-run-summary (\"format\")");
      rp.steps = integerAt<std::int64_t>(j, "steps");
      rp.warmup = integerAt<std::int64_t>(j, "warmup");
      std::vector<std::string> order;
      for (const auto& s : j.at("strategies")) order.push_back(s.at("strategy").get<std::string>());
      const auto rank = [&](const RunPlans::Strategy& s) {
        return std::find(order.begin(), order.end(), s.strategy) - order.begin();
      };
      std::stable_sort(rp.strategies.begin(), rp.strategies.end(),
                       [&](const auto& a, const auto& b) { return rank(a) < rank(b); });
    } catch (const nlohmann::json::exception& e) {
      throw InputError(fmt::format("{}: {}", summary.string(), e.what()));
    } catch (const InputError& e) {
      throw InputError(fmt::format("{}: {}", summary.string(), e.what()));
    }
  }
  return rp;
}

}  // namespace wlb::packing
