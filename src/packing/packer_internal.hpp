#pragma once
// Helpers shared by the packer implementations (not a public interface).
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/cost_model.hpp"
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
/// A packer whose only state between steps is the segments it carries over to the next
/// (original, best_fit, fixed_optimal): saved, restored and reported as held here.
class CarryPacker : public Packer {
 public:
  using Packer::Packer;
  nlohmann::json saveState() const override { return {{"carry", segsToJson(carry_)}}; }
  void loadState(const nlohmann::json& s) override { carry_ = segsFromJson(s.at("carry")); }
  std::vector<Segment> heldSegments() const override { return carry_; }

 protected:
  std::vector<Segment> carry_;
};

/// Fast W(d) = cost.segmentWork(d) for d <= max_len: reproduces the cost model's tile-padded
/// attention count with a prefix table (O(1) per call instead of O(d / tile)). At
/// construction it compares itself with cost.segmentWork on sample lengths and falls back
/// to the cost model (memoised) if they differ by more than 1e-9 relative.
class WorkTable {
 public:
  WorkTable(const model::CostModel& cost, std::int64_t max_len);
  double work(std::int64_t len) const;
  double attn(std::int64_t len) const;  ///< attention only, fwd + bwd
  bool exact() const { return fast_; }

 private:
  double fastAttn(std::int64_t len) const;
  const model::CostModel* cost_;
  std::int64_t max_len_;
  bool fast_ = false;
  std::vector<double> prefix_;  ///< prefix_[m] = sum_{i=1..m} ceil(i*tq/tk)
  double flops_per_block_fwd_ = 0;
  double lin_per_token_ = 0;   ///< linear (fwd + bwd) seconds per token
};

std::unique_ptr<Packer> makeWlb(const PackerOptions& opt, const model::CostModel& cost);
std::unique_ptr<Packer> makeFixedOptimal(const PackerOptions& opt, const model::CostModel& cost);
std::unique_ptr<Packer> makeSlimPack(const PackerOptions& opt, const model::CostModel& cost);
}  // namespace wlb::packing::detail
