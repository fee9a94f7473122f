// Throughput over the same documents and its bootstrap interval (throughput.hpp).
#include "model/throughput.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

namespace wlb::model {

double usefulFlops(const StepPlan& plan, const CostModel& cost, std::int64_t layers) {
  double f = 0;
  for (const auto& rep : plan.replicas)
    for (const auto& mb : rep)
      for (const auto& s : mb.segments)
        // a slimpack slice's pairs are those of its queries against its key prefix (its
        // document's slices sum to the unsliced document's)
        f += cost.attnFlops(s.q_offset, s.length, Phase::Fwd) + cost.attnFlops(s.q_offset, s.length, Phase::Bwd) +
             cost.linearFlops(s.length, Phase::Fwd) + cost.linearFlops(s.length, Phase::Bwd);
  // the cost model's FLOPs are per TP rank
  double tokens = 0;
  for (const auto& rep : plan.replicas)
    for (const auto& mb : rep) tokens += static_cast<double>(mb.tokens());
  const auto& d = cost.dims();
  const double head = 2.0 * static_cast<double>(d.hidden) * static_cast<double>(d.vocab) * (1.0 + kLinearBwdFactor);
  return f * static_cast<double>(cost.tp()) * static_cast<double>(layers) + head * tokens;
}

Throughput total(const std::vector<StepWork>& steps) {
  Throughput t;
  for (const auto& s : steps) {
    t.seconds += s.seconds;
    t.tokens += s.tokens;
    t.flops += s.flops;
  }
  return t;
}

std::vector<StepWork> foldDrain(std::vector<StepWork> steps, std::size_t drain) {
  if (drain == 0) return steps;
  if (drain >= steps.size()) throw std::invalid_argument("foldDrain: no measured step to fold the drain into");
  const std::size_t last = steps.size() - drain - 1;
  for (std::size_t i = last + 1; i < steps.size(); ++i) {
    steps[last].seconds += steps[i].seconds;
    steps[last].tokens += steps[i].tokens;
    steps[last].flops += steps[i].flops;
  }
  steps.resize(last + 1);
  return steps;
}

Ratio throughputSpeedup(const std::vector<StepWork>& base, const std::vector<StepWork>& other, int resamples,
                        std::uint64_t seed) {
  if (base.size() != other.size()) throw std::invalid_argument("throughputSpeedup: unpaired step records");
  Ratio r;
  const auto ratio = [](const Throughput& b, const Throughput& o) {
    return b.tokensPerSecond() > 0 ? o.tokensPerSecond() / b.tokensPerSecond() : 0.0;
  };
  r.value = r.lo = r.hi = ratio(total(base), total(other));
  const std::size_t n = base.size();
  if (n < 2 || resamples < 1) return r;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::size_t> pick(0, n - 1);
  std::vector<double> v;
  v.reserve(static_cast<std::size_t>(resamples));
  for (int s = 0; s < resamples; ++s) {
    Throughput b, o;
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t i = pick(rng);
      b.seconds += base[i].seconds;
      b.tokens += base[i].tokens;
      o.seconds += other[i].seconds;
      o.tokens += other[i].tokens;
    }
    // A resample of only empty baseline steps (a packer still filling its window) has no
    // ratio: it is left out, not counted as 0.
    if (b.tokensPerSecond() > 0) v.push_back(ratio(b, o));
  }
  if (v.empty()) return r;
  std::sort(v.begin(), v.end());
  const auto q = [&](double p) {
    return v[static_cast<std::size_t>(std::lround(p * static_cast<double>(v.size() - 1)))];
  };
  r.lo = q(0.025);
  r.hi = q(0.975);
  return r;
}

}  // namespace wlb::model
