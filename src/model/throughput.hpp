#pragma once
/// \file throughput.hpp
/// \brief The one comparison metric of `wlb run`, `wlb simulate` and the report
/// (docs/algorithms.md § Comparing strategies): throughput — trained tokens and useful model
/// FLOPs per second — over a window that ends with every deferred document trained, and
/// the throughput speedup with a 95% paired bootstrap interval over steps.
///
/// Why not step time: a packer that defers documents trains fewer tokens per step while it
/// defers, so a step-time ratio flatters it. Here each strategy's window is followed by
/// drain steps (no new documents, only what its packer still holds) whose work and time
/// count, so no strategy ends the comparison owing work.

#include <cstdint>
#include <limits>
#include <vector>

#include "core/types.hpp"
#include "model/cost_model.hpp"

namespace wlb::model {

/// Drain steps in a row without progress after which a packer still holding documents is a
/// bug, not a slow drain (`wlb run`, `wlb simulate` and `wlb profile` stop there). A long
/// document drains at a window a step for as long as it takes: 200000 tokens at a window of
/// 16 is 12500 steps, each one progress.
inline constexpr std::int64_t kMaxDrainSteps = 10000;

/// Watches one packer's drain: stalled() is true once its pending tokens have not fallen
/// for kMaxDrainSteps steps in a row (a packer may hold documents for a few steps while
/// they wait, but not for ever).
class DrainWatch {
 public:
  bool stalled(std::int64_t pending) {
    if (pending < least_) {
      least_ = pending;
      still_ = 0;
      return false;
    }
    return ++still_ >= kMaxDrainSteps;
  }

 private:
  std::int64_t least_ = std::numeric_limits<std::int64_t>::max(), still_ = 0;
};

/// One measured (or simulated) step: wall seconds, trained tokens, useful FLOPs.
struct StepWork {
  double seconds = 0, tokens = 0, flops = 0;
};

/// Useful FLOPs of a step plan over `layers` transformer layers and the LM head, forward +
/// backward: attention over each segment's causal pairs (no tile padding, whole TP group),
/// the linear ops of its tokens, and the head's 2 * hidden * vocab per token (backward 2x;
/// none when the dims have no vocabulary). Identical for every strategy that trains the
/// same tokens in the same segments, so FLOP/s compares work, not tokens.
double usefulFlops(const StepPlan& plan, const CostModel& cost, std::int64_t layers);

/// Totals over a window of steps.
struct Throughput {
  double seconds = 0, tokens = 0, flops = 0;
  double tokensPerSecond() const { return seconds > 0 ? tokens / seconds : 0; }
  double flopsPerSecond() const { return seconds > 0 ? flops / seconds : 0; }
};
Throughput total(const std::vector<StepWork>& steps);

/// Steps appended after the measured window to drain deferred documents are folded into
/// the last measured step, so strategies that drained for different numbers of steps still
/// pair step by step. `drain` is the tail of `steps` to fold (0 = none).
std::vector<StepWork> foldDrain(std::vector<StepWork> steps, std::size_t drain);

/// Throughput ratio `other` / `base` (tokens per second) with a 95% interval from a paired
/// bootstrap over step indices (both vectors the same length; deterministic for a seed).
/// With one step the interval is the point; resamples whose baseline steps are all empty
/// (no tokens) have no ratio and are left out of the interval.
struct Ratio {
  double value = 0, lo = 0, hi = 0;
};
Ratio throughputSpeedup(const std::vector<StepWork>& base, const std::vector<StepWork>& other, int resamples = 2000,
                        std::uint64_t seed = 12345);

}  // namespace wlb::model
