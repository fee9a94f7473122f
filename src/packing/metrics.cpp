// Step metrics, run summaries and the conservation checker.
#include <algorithm>
#include <cmath>
#include <unordered_set>

#include <fmt/format.h>

#include "packing/packer.hpp"

namespace wlb::packing {

namespace {
double ratio(const std::vector<double>& v) {
  double mx = 0, sum = 0;
  for (double x : v) {
    mx = std::max(mx, x);
    sum += x;
  }
  if (v.empty() || sum <= 0) return 1.0;
  return mx / (sum / static_cast<double>(v.size()));
}
}  // namespace

StepMetrics computeMetrics(const StepPlan& plan, const model::CostModel& cost) {
  using model::Phase;
  StepMetrics m;
  m.step = plan.step;
  m.delayed_docs = static_cast<std::int64_t>(plan.delayed.size());
  std::vector<double> af, ab, tf, tb, tot, toks;
  std::vector<std::pair<double, double>> delays;  // (delay, tokens)
  for (std::size_t r = 0; r < plan.replicas.size(); ++r) {
    const auto& rep = plan.replicas[r];
    for (std::size_t k = 0; k < rep.size(); ++k) {
      // A DP-Merge unit: every member of its group holds 1/g of the owner's sample.
      const auto* mg = plan.mergedAt(static_cast<std::int64_t>(k));
      const bool member = mg && mg->member(static_cast<std::int64_t>(r)) >= 0;
      const auto& mb = member ? plan.replicas[static_cast<std::size_t>(mg->group.front())][k] : rep[k];
      const double share = member ? 1.0 / static_cast<double>(mg->group.size()) : 1.0;
      double a_f = 0, a_b = 0;
      std::int64_t t = 0;
      for (const auto& s : mb.segments) {
        a_f += cost.attnSeconds(s.q_offset, s.length, Phase::Fwd);  // a slice costs as a CP piece
        a_b += cost.attnSeconds(s.q_offset, s.length, Phase::Bwd);
        t += s.length;
      }
      for (const auto& s : rep[k].segments) {  // counted once, in the owner
        delays.push_back({static_cast<double>(plan.step - s.arrival_step), static_cast<double>(s.length)});
        ++m.segments;
        m.tokens += s.length;
      }
      const double l_f = t > 0 ? cost.linearSeconds(t, Phase::Fwd) : 0.0;
      const double l_b = t > 0 ? cost.linearSeconds(t, Phase::Bwd) : 0.0;
      af.push_back(share * a_f);
      ab.push_back(share * a_b);
      tf.push_back(share * (a_f + l_f));
      tb.push_back(share * (a_b + l_b));
      tot.push_back(share * (a_f + l_f + a_b + l_b));
      toks.push_back(share * static_cast<double>(t));
    }
  }
  m.micro_batches = static_cast<std::int64_t>(tot.size());
  m.imbalance_attn_fwd = ratio(af);
  m.imbalance_attn_bwd = ratio(ab);
  m.imbalance_total_fwd = ratio(tf);
  m.imbalance_total_bwd = ratio(tb);
  m.imbalance = ratio(tot);
  m.max_work_seconds = tot.empty() ? 0.0 : *std::max_element(tot.begin(), tot.end());
  if (!toks.empty()) {
    m.tokens_max = *std::max_element(toks.begin(), toks.end());
    m.tokens_mean = static_cast<double>(m.tokens) / static_cast<double>(toks.size());
  }
  if (m.tokens > 0) {
    double sum = 0;
    for (auto& [d, w] : delays) sum += d * w;
    m.delay_mean = sum / static_cast<double>(m.tokens);
    std::sort(delays.begin(), delays.end());
    m.delay_max = delays.back().first;
    const double target = 0.99 * static_cast<double>(m.tokens);
    double acc = 0;
    for (auto& [d, w] : delays) {
      acc += w;
      if (acc >= target) {
        m.delay_p99 = d;
        break;
      }
    }
  }
  return m;
}

nlohmann::json toJson(const StepMetrics& m) {
  nlohmann::json j = {{"imbalance", m.imbalance},
                      {"imbalance_attn_fwd", m.imbalance_attn_fwd},
                      {"imbalance_attn_bwd", m.imbalance_attn_bwd},
                      {"imbalance_total_fwd", m.imbalance_total_fwd},
                      {"imbalance_total_bwd", m.imbalance_total_bwd},
                      {"delay_mean", m.delay_mean},
                      {"delay_p99", m.delay_p99},
                      {"delay_max", m.delay_max},
                      {"tokens", m.tokens},
                      {"tokens_max", m.tokens_max},
                      {"tokens_mean", m.tokens_mean},
                      {"segments", m.segments},
                      {"delayed_docs", m.delayed_docs},
                      {"max_work_seconds", m.max_work_seconds},
                      {"plan_us", m.plan_us}};
  if (!m.solver.is_null()) j["solver"] = m.solver;
  return j;
}

void RunSummary::add(const StepMetrics& m) {
  ++steps;
  tokens += m.tokens;
  documents += m.segments;
  imbalance_mean += m.imbalance;
  imbalance_attn_fwd_mean += m.imbalance_attn_fwd;
  imbalance_attn_bwd_mean += m.imbalance_attn_bwd;
  imbalance_total_fwd_mean += m.imbalance_total_fwd;
  imbalance_total_bwd_mean += m.imbalance_total_bwd;
  imbalance_max = std::max(imbalance_max, m.imbalance);
  delay_token_sum_ += m.delay_mean * static_cast<double>(m.tokens);
  delay_max = std::max(delay_max, m.delay_max);
  plan_us_mean += m.plan_us;
  plan_us_max = std::max(plan_us_max, m.plan_us);
  tokens_max_over_mean += m.tokens_mean > 0 ? m.tokens_max / m.tokens_mean : 1.0;
  if (m.solver.is_object() && m.solver.contains("gap")) max_gap = std::max(max_gap, m.solver["gap"].get<double>());
}

void RunSummary::finish() {
  if (steps == 0) return;
  const double n = static_cast<double>(steps);
  imbalance_mean /= n;
  imbalance_attn_fwd_mean /= n;
  imbalance_attn_bwd_mean /= n;
  imbalance_total_fwd_mean /= n;
  imbalance_total_bwd_mean /= n;
  plan_us_mean /= n;
  tokens_max_over_mean /= n;
  delay_mean = tokens > 0 ? delay_token_sum_ / static_cast<double>(tokens) : 0.0;
}

nlohmann::json RunSummary::toJson() const {
  return {{"steps", steps},
          {"tokens", tokens},
          {"segments", documents},
          {"imbalance_mean", imbalance_mean},
          {"imbalance_attn_fwd_mean", imbalance_attn_fwd_mean},
          {"imbalance_attn_bwd_mean", imbalance_attn_bwd_mean},
          {"imbalance_total_fwd_mean", imbalance_total_fwd_mean},
          {"imbalance_total_bwd_mean", imbalance_total_bwd_mean},
          {"imbalance_max", imbalance_max},
          {"delay_mean", delay_mean},
          {"delay_max", delay_max},
          {"plan_us_mean", plan_us_mean},
          {"plan_us_max", plan_us_max},
          {"tokens_max_over_mean", tokens_max_over_mean},
          {"max_gap", max_gap}};
}

// ---- ConservationChecker ----------------------------------------------------------------
void ConservationChecker::addIncoming(const std::vector<Document>& docs) {
  for (const auto& d : docs) {
    if (d.id <= max_seen_ || d.length <= 0) {
      ++unknown_;
      continue;
    }
    max_seen_ = d.id;
    open_[d.id] = Open{d.length, 0, d.arrival_step, {}};
  }
}

void ConservationChecker::addHeld(const std::vector<Segment>& held) {
  // A held piece's document is open from its arrival; everything before its first held
  // offset was trained before the checkpoint, and its held pieces run to its end
  // (packers hold the remaining consecutive pieces of a split document).
  for (const auto& s : held) {
    if (s.length <= 0 || s.offset < 0) {
      ++unknown_;
      continue;
    }
    auto [it, fresh] = open_.try_emplace(s.doc, Open{0, s.offset, s.arrival_step, {}});
    Open& o = it->second;
    if (!fresh && o.arrival != s.arrival_step) ++early_;
    o.covered = std::min(o.covered, s.offset);
    o.length = std::max(o.length, s.offset + s.length);
    max_seen_ = std::max(max_seen_, s.doc);
  }
  for (auto& [id, o] : open_)
    if (o.covered > 0 && o.ranges.empty()) o.ranges.push_back({0, o.covered});
}

void ConservationChecker::addPlan(const StepPlan& plan) {
  for (const auto& rep : plan.replicas) {
    for (std::size_t k = 0; k < rep.size(); ++k) {
      const auto& mb = rep[k];
      // a DP-Merge unit is shared by its group: each replica holds 1/g of it
      const auto* mg = plan.mergedAt(static_cast<std::int64_t>(k));
      const std::int64_t g = mg ? static_cast<std::int64_t>(mg->group.size()) : 1;
      if ((mb.tokens() + g - 1) / g > capacity_) ++over_capacity_;
      for (const auto& s : mb.segments) {
        auto it = open_.find(s.doc);
        if (it == open_.end()) {
          if (s.doc <= max_seen_ && s.doc >= 0)
            ++duplicated_;
          else
            ++unknown_;
          continue;
        }
        Open& o = it->second;
        if (plan.step < o.arrival || s.arrival_step != o.arrival) ++early_;
        const std::int64_t b = s.offset, e = s.offset + s.length;
        if (s.length <= 0 || b < 0 || e > o.length) {
          ++unknown_;
          continue;
        }
        bool overlap = false;
        for (const auto& [rb, re] : o.ranges)
          if (b < re && rb < e) overlap = true;
        if (overlap) {
          ++duplicated_;
          continue;
        }
        o.ranges.push_back({b, e});
        o.covered += s.length;
        if (o.covered == o.length) {
          ++completed_;
          open_.erase(it);
        }
      }
    }
  }
  // Every document still in flight must be reported as delayed.
  std::unordered_set<DocId> delayed(plan.delayed.begin(), plan.delayed.end());
  for (const auto& [id, o] : open_)
    if (o.arrival <= plan.step && !delayed.count(id)) ++unreported_;
}

std::int64_t ConservationChecker::inFlightTokens() const {
  std::int64_t t = 0;
  for (const auto& [id, o] : open_) t += o.length - o.covered;
  return t;
}

std::int64_t ConservationChecker::lostTokens(std::int64_t pending) const {
  return std::max<std::int64_t>(0, inFlightTokens() - pending);
}

bool ConservationChecker::ok(std::int64_t pending) const {
  return duplicated_ == 0 && unknown_ == 0 && over_capacity_ == 0 && early_ == 0 && unreported_ == 0 &&
         inFlightTokens() == pending;
}

std::string ConservationChecker::report(std::int64_t pending) const {
  return fmt::format(
      "documents completed {}, in flight {} ({} tokens, packer holds {}), lost tokens {}, "
      "duplicated segments {}, unknown segments {}, over-capacity micro-batches {}, "
      "trained-before-arrival {}, unreported in-flight {}",
      completed_, inFlight(), inFlightTokens(), pending, lostTokens(pending), duplicated_, unknown_, over_capacity_,
      early_, unreported_);
}

}  // namespace wlb::packing
