#pragma once
/// \file runner.hpp
/// \brief Drive a length source and a packer over consecutive steps, timing each pack()
/// call, computing metrics and (optionally) checking conservation. Used by `wlb plan`,
/// `wlb tune`, the tests and the benchmark.

#include <cstdint>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"

namespace wlb::packing {

struct RunOptions {
  std::int64_t steps = 1;
  bool check = false;  ///< run a ConservationChecker alongside
  /// Called after every step (plan, metrics, number of incoming documents).
  std::function<void(const StepPlan&, const StepMetrics&, std::int64_t)> on_step;
};

struct RunResult {
  std::string packer;
  RunSummary summary;
  bool checked = false, check_ok = true;
  std::int64_t lost_tokens = 0, duplicated = 0, completed_docs = 0, in_flight_docs = 0;
  std::string check_report;
  double wall_seconds = 0;
  nlohmann::json toJson() const;
};

/// Runs steps [src.nextStep(), src.nextStep() + steps).
RunResult runPacker(data::LengthSource& src, Packer& packer, const model::CostModel& cost,
                    const RunOptions& opt);

/// Checkpoint of a (source, packer) pair as one JSON document
/// {"format":"wlb-packer-state","version":1,"packer":...,"source":{...},"state":{...}}.
nlohmann::json saveCheckpoint(const data::LengthSource& src, const Packer& packer);
/// What a restored packer holds must be pieces of documents the restored source drew, no
/// two sharing a token (InputError otherwise): an edited or mismatched state would lose or
/// duplicate tokens from the restart on.
void checkHeld(const data::LengthSource& src, const Packer& packer);
/// Restore; InputError (naming `what`) when the checkpoint is for another packer or bad.
void loadCheckpoint(const nlohmann::json& j, data::LengthSource& src, Packer& packer,
                    const std::string& what);

}  // namespace wlb::packing
