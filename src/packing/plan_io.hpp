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
  std::string source;                    ///< LengthSource::describe()
  std::int64_t documents_per_epoch = 0;  ///< file sources: file index = doc id % this
  std::uint64_t seed = 0;
  std::int64_t first_step = 0;
  /// `wlb run`'s plan files: the strategy's name and CP sharding (written only when set).
  std::string strategy, sharding;
};
nlohmann::json toJson(const PlanHeader& h);
PlanHeader headerFromJson(const nlohmann::json& j);

/// One step line: the plan's JSON (core/plan_json.hpp) plus "incoming":n and "metrics":{...};
/// the reader ignores the two.
nlohmann::json stepToJson(const StepPlan& plan, const StepMetrics& metrics, std::int64_t incoming_docs);
StepPlan stepFromJson(const nlohmann::json& j);

/// A whole plan file in memory.
struct PlanFile {
  PlanHeader header;
  std::vector<StepPlan> steps;
  std::vector<std::int64_t> step_lines;  ///< line number (1-based) of each step, for messages
  std::vector<std::int64_t> incoming;    ///< each step's `incoming` (0 where absent)
  std::vector<nlohmann::json> metrics;   ///< each step's `metrics` (null where absent)
};
/// Read a plan file. InputError naming the file and line on bad content.
PlanFile readPlanFile(const std::string& path);

/// The plans one `wlb run` wrote (docs/runtime.md § Outputs), for `wlb simulate --plans`.
struct RunPlans {
  struct Strategy {
    std::string path;      ///< the plan file
    std::string strategy;  ///< header's `strategy`, else its packer
    std::string sharding;  ///< header's `sharding`; empty: not recorded (a `wlb plan` file)
    PlanFile file;
  };
  std::vector<Strategy> strategies;  ///< in the run's order (summary.json) where known
  /// From the run's summary.json beside the plans; -1 where there is none.
  std::int64_t steps = -1, warmup = -1;
};
/// Read one plan file, or every complete plan file (`*.jsonl`) of a run's output
/// directory with its summary.json. InputError naming the file (and line) on bad input,
/// a directory without plans, or two files of one strategy.
RunPlans readRunPlans(const std::string& path);

}  // namespace wlb::packing
