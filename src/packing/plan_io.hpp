#pragma once
/// \file plan_io.hpp
/// \brief The JSONL plan format written by `wlb plan` (docs/plan-format.md): a header line
/// then one line per step. Readers for the CP planner, simulator and executor.

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/types.hpp"
#include "packing/packer.hpp"

namespace wlb::packing {

/// First line of a plan file.
struct PlanHeader {
  std::string format = "wlb-plan";
  int version = 1;
  std::string packer;
  std::int64_t dp = 1, micro_batches = 1, context_window = 0, s_max = 0;
  std::string source;                   ///< LengthSource::describe()
  std::int64_t documents_per_epoch = 0; ///< file sources: file index = doc id % this
  std::uint64_t seed = 0;
  std::int64_t first_step = 0;
};
nlohmann::json toJson(const PlanHeader& h);
PlanHeader headerFromJson(const nlohmann::json& j);

/// One step line: {"type":"step","step":t,"replicas":[[[[doc,offset,length,arrival],...],..],..],
/// "delayed":[ids],"incoming":n,"metrics":{...}}.
nlohmann::json stepToJson(const StepPlan& plan, const StepMetrics& metrics,
                          std::int64_t incoming_docs);
StepPlan stepFromJson(const nlohmann::json& j);

/// A whole plan file in memory.
struct PlanFile {
  PlanHeader header;
  std::vector<StepPlan> steps;
};
/// Read a plan file. InputError naming the file and line on bad content.
PlanFile readPlanFile(const std::string& path);

}  // namespace wlb::packing
