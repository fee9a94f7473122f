// JSONL plan format (docs/plan-format.md).
#include "packing/plan_io.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/input_file.hpp"
#include "core/json_text.hpp"
#include "core/plan_json.hpp"

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

PlanHeader headerFromJson(const nlohmann::json& j) {
  PlanHeader h;
  h.format = j.at("format").get<std::string>();
  h.version = jsonIntegerAt<int>(j, "version");
  h.packer = j.at("packer").get<std::string>();
  h.dp = jsonIntegerAt<std::int64_t>(j, "dp");
  h.micro_batches = jsonIntegerAt<std::int64_t>(j, "micro_batches");
  h.context_window = jsonIntegerAt<std::int64_t>(j, "context_window");
  h.s_max = jsonIntegerAt<std::int64_t>(j, "s_max");
  h.source = j.value("source", std::string());
  h.documents_per_epoch = jsonIntegerOr<std::int64_t>(j, "documents_per_epoch", 0);
  h.seed = jsonIntegerOr<std::uint64_t>(j, "seed", 0);
  h.first_step = jsonIntegerOr<std::int64_t>(j, "first_step", 0);
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
  nlohmann::json j = planToJson(plan);
  j["incoming"] = incoming_docs;
  j["metrics"] = toJson(metrics);
  return j;
}

StepPlan stepFromJson(const nlohmann::json& j) {
  return planFromJson(j);
}

PlanFile readPlanFile(const std::string& path) {
  auto f = openInput(path, "plan file");
  PlanFile pf;
  std::string line;
  std::int64_t lineno = 0;
  bool have_header = false;
  // Every token once: a replay trains what the file says, so a segment planned twice (an
  // edited file) would count its tokens twice. The tokens of each document, with the line.
  struct Span {
    std::int64_t begin, end, line;
  };
  std::unordered_map<DocId, std::vector<Span>> spans;
  while (std::getline(f, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const auto j = parseJsonText(line);
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
        // What a packer can write (planFromJson has checked each segment's fields): a replay
        // sizes its buffers and work by these numbers. A DP-Merge slot holds one sample for its
        // group of g replicas, up to g x s_max tokens (ConservationChecker's rule).
        const StepPlan& plan = pf.steps.back();
        for (std::size_t ri = 0; ri < reps.size(); ++ri)
          for (std::size_t m = 0; m < reps[ri].size(); ++m) {
            const auto* mg = plan.mergedAt(static_cast<std::int64_t>(m));
            const std::int64_t limit = pf.header.s_max * (mg ? static_cast<std::int64_t>(mg->group.size()) : 1);
            std::int64_t tokens = 0;
            for (const Segment& sg : reps[ri][m].segments) {
              if (sg.length > limit - tokens)  // no sum that could overflow
                throw InputError(
                    fmt::format("{}:{}: replica {} micro-batch {}: segment [doc {}, offset {}, length {}] "
                                "takes it past {} tokens (s_max = {} in the header{})",
                                path, lineno, ri, m, sg.doc, sg.offset, sg.length, limit, pf.header.s_max,
                                mg ? ", times its DP-Merge group" : ""));
              tokens += sg.length;
              if (sg.arrival_step > plan.step)
                throw InputError(
                    fmt::format("{}:{}: segment [doc {}, offset {}, length {}] arrives at step {}, after "
                                "step {} that trains it",
                                path, lineno, sg.doc, sg.offset, sg.length, sg.arrival_step, plan.step));
              spans[sg.doc].push_back({sg.offset, sg.offset + sg.length, lineno});
            }
          }
      }  // other types (the summary, later additions) are not the reader's: skipped
    } catch (const nlohmann::json::exception& e) {
      throw InputError(fmt::format("{}:{}: {}", path, lineno, e.what()));
    } catch (const InputError& e) {
      const std::string w = e.what();
      if (w.rfind(path, 0) == 0) throw;
      throw InputError(fmt::format("{}:{}: {}", path, lineno, w));
    }
  }
  if (!have_header) throw InputError(fmt::format("{}: empty plan file (no header line)", path));
  for (auto& [doc, v] : spans) {
    std::sort(v.begin(), v.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
    for (std::size_t i = 1; i < v.size(); ++i)
      if (v[i].begin < v[i - 1].end) {
        const auto& [a, b] = v[i].line < v[i - 1].line ? std::pair(v[i], v[i - 1]) : std::pair(v[i - 1], v[i]);
        throw InputError(fmt::format("{}:{}: document {}: tokens [{}, {}) are planned again (line {} plans [{}, {}))",
                                     path, b.line, doc, b.begin, b.end, a.line, a.begin, a.end));
      }
  }
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
  // A run directory. Its summary.json (when there) names the run's strategies in order and,
  // from the version that records them, each one's plan file: a rerun into the same folder
  // with fewer strategies leaves the older plans beside them, which are not this run's.
  std::vector<std::string> order, named;
  const fs::path summary = fs::path(path) / "summary.json";
  if (fs::exists(summary, ec)) {
    auto in = openInput(summary.string(), "run summary");
    try {
      const auto j = parseJsonText(in);
      if (j.value("format", std::string()) != "wlb-run-summary") throw InputError("not a wlb-run-summary (\"format\")");
      rp.steps = jsonIntegerAt<std::int64_t>(j, "steps");
      rp.warmup = jsonIntegerAt<std::int64_t>(j, "warmup");
      for (const auto& st : j.at("strategies")) {
        order.push_back(st.at("strategy").get<std::string>());
        if (st.contains("plan")) named.push_back((fs::path(path) / st.at("plan").get<std::string>()).string());
      }
      if (!named.empty() && named.size() != order.size())
        throw InputError("some strategies name their plan file (\"plan\"), others do not");
    } catch (const nlohmann::json::exception& e) {
      throw InputError(fmt::format("{}: {}", summary.string(), e.what()));
    } catch (const InputError& e) {
      throw InputError(fmt::format("{}: {}", summary.string(), e.what()));
    }
  }
  // Without named files: the directory's complete plan files (a killed run leaves only
  // `*.partial` ones), of the summary's strategies where there is one.
  std::vector<std::string> files = named;
  bool partial = false;
  if (named.empty()) {
    for (const auto& e : fs::directory_iterator(path, ec)) {
      const std::string name = e.path().filename().string();
      if (!e.is_regular_file()) continue;
      if (name.size() > 6 && name.substr(name.size() - 6) == ".jsonl") files.push_back(e.path().string());
      if (name.size() > 14 && name.substr(name.size() - 14) == ".jsonl.partial") partial = true;
    }
    if (ec) throw InputError(fmt::format("{}: cannot list the directory: {}", path, ec.message()));
    std::sort(files.begin(), files.end());
  }
  if (files.empty())
    throw InputError(fmt::format("{}: no plan files (*.jsonl){}", path,
                                 partial ? "; only *.partial ones: the run did not finish" : ""));
  std::set<std::string> seen;
  for (const auto& f : files) {
    if (!named.empty() && !fs::exists(f, ec))
      throw InputError(fmt::format("{}: the plan file {} that summary.json names is missing", path, f));
    RunPlans::Strategy st;
    st.path = f;
    st.file = readPlanFile(f);
    st.strategy = st.file.header.strategy.empty() ? st.file.header.packer : st.file.header.strategy;
    st.sharding = st.file.header.sharding;
    if (!order.empty() && std::find(order.begin(), order.end(), st.strategy) == order.end()) {
      if (!named.empty())
        throw InputError(fmt::format("{}:1: plans strategy '{}', which summary.json does not list", f, st.strategy));
      continue;  // an older run's strategy, not this run's
    }
    if (!seen.insert(st.strategy).second)
      throw InputError(fmt::format("{}:1: a second plan file of strategy '{}' in {}", f, st.strategy, path));
    rp.strategies.push_back(std::move(st));
  }
  if (!order.empty()) {
    if (rp.strategies.size() != order.size())
      throw InputError(fmt::format("{}: summary.json lists {} strateg{}, {} plan file(s) of them found", path,
                                   order.size(), order.size() == 1 ? "y" : "ies", rp.strategies.size()));
    const auto rank = [&](const RunPlans::Strategy& s) {
      return std::find(order.begin(), order.end(), s.strategy) - order.begin();
    };
    std::stable_sort(rp.strategies.begin(), rp.strategies.end(),
                     [&](const auto& x, const auto& y) { return rank(x) < rank(y); });
  }
  return rp;
}

}  // namespace wlb::packing
