// JSONL plan format (docs/plan-format.md).
#include "packing/plan_io.hpp"

#include <fstream>

#include <fmt/format.h>

#include "core/error.hpp"

namespace wlb::packing {

nlohmann::json toJson(const PlanHeader& h) {
  return {{"type", "header"},          {"format", h.format},
          {"version", h.version},      {"packer", h.packer},
          {"dp", h.dp},                {"micro_batches", h.micro_batches},
          {"context_window", h.context_window}, {"s_max", h.s_max},
          {"source", h.source},        {"documents_per_epoch", h.documents_per_epoch},
          {"seed", h.seed},            {"first_step", h.first_step}};
}

PlanHeader headerFromJson(const nlohmann::json& j) {
  PlanHeader h;
  h.format = j.at("format").get<std::string>();
  h.version = j.at("version").get<int>();
  h.packer = j.at("packer").get<std::string>();
  h.dp = j.at("dp").get<std::int64_t>();
  h.micro_batches = j.at("micro_batches").get<std::int64_t>();
  h.context_window = j.at("context_window").get<std::int64_t>();
  h.s_max = j.at("s_max").get<std::int64_t>();
  h.source = j.value("source", std::string());
  h.documents_per_epoch = j.value("documents_per_epoch", std::int64_t{0});
  h.seed = j.value("seed", std::uint64_t{0});
  h.first_step = j.value("first_step", std::int64_t{0});
  return h;
}

nlohmann::json stepToJson(const StepPlan& plan, const StepMetrics& metrics,
                          std::int64_t incoming_docs) {
  nlohmann::json reps = nlohmann::json::array();
  for (const auto& rep : plan.replicas) {
    nlohmann::json mbs = nlohmann::json::array();
    for (const auto& mb : rep) {
      nlohmann::json segs = nlohmann::json::array();
      for (const auto& s : mb.segments)
        segs.push_back(nlohmann::json::array({s.doc, s.offset, s.length, s.arrival_step}));
      mbs.push_back(std::move(segs));
    }
    reps.push_back(std::move(mbs));
  }
  return {{"type", "step"},       {"step", plan.step},         {"replicas", std::move(reps)},
          {"delayed", plan.delayed}, {"incoming", incoming_docs}, {"metrics", toJson(metrics)}};
}

StepPlan stepFromJson(const nlohmann::json& j) {
  StepPlan p;
  p.step = j.at("step").get<std::int64_t>();
  for (const auto& rep : j.at("replicas")) {
    std::vector<MicroBatch> mbs;
    for (const auto& mb : rep) {
      MicroBatch m;
      for (const auto& s : mb) {
        if (!s.is_array() || s.size() != 4)
          throw InputError("segment must be [doc, offset, length, arrival_step]");
        m.segments.push_back(Segment{s[0].get<DocId>(), s[1].get<std::int64_t>(),
                                     s[2].get<std::int64_t>(), s[3].get<std::int64_t>()});
      }
      mbs.push_back(std::move(m));
    }
    p.replicas.push_back(std::move(mbs));
  }
  p.delayed = j.at("delayed").get<std::vector<DocId>>();
  return p;
}

PlanFile readPlanFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw InputError(fmt::format("{}: cannot open plan file", path));
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

}  // namespace wlb::packing
