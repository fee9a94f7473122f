#pragma once
// Helpers shared by the packer implementations (not a public interface).
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "packing/packer.hpp"

namespace wlb::packing::detail {
nlohmann::json segsToJson(const std::vector<Segment>& v);
std::vector<Segment> segsFromJson(const nlohmann::json& a);
bool longerFirst(const Segment& a, const Segment& b);
void fillDelayed(StepPlan& plan, const std::vector<const std::vector<Segment>*>& held);
std::int64_t tokensOf(const std::vector<Segment>& v);
/// Put N micro-batches into plan.replicas[dp][M]: in order (replica r gets mbs r*M..),
/// or, when `work` is given, snake-dealt by decreasing work.
void distribute(StepPlan& plan, std::vector<MicroBatch>& mbs, const PackerOptions& opt,
                const std::vector<double>* work);
std::unique_ptr<Packer> makeFixedOptimal(const PackerOptions& opt, const model::CostModel& cost);
}  // namespace wlb::packing::detail
