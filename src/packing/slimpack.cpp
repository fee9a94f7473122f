// slimpack: SlimPack's planner (docs/packing.md § slimpack, docs/algorithms.md § SlimPack).
#include "packing/slimpack.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "core/error.hpp"
#include "packing/packer.hpp"
#include "packing/packer_internal.hpp"
#include "pp/simulator.hpp"

namespace wlb::packing {
namespace slimpack {

using model::Phase;

double sliceFlops(const model::CostModel& cost, std::int64_t q0, std::int64_t q, Phase p) {
  if (q <= 0) return 0.0;
  return cost.attnFlops(q0, q, p) + cost.linearFlops(q, p);
}

std::int64_t solveSliceLength(const model::CostModel& cost, std::int64_t q0, double budget, std::int64_t max_q) {
  if (max_q <= 0 || budget <= 0) return 0;
  if (!std::isfinite(budget)) return max_q;  // an unbounded pack: the token room decides
  // F(q) = A (q q0 + q (q+1) / 2) + B q: attention per query-key pair A, linear per token B.
  const double A = cost.attnFlops(0, 1, Phase::Fwd), B = cost.linearFlops(1, Phase::Fwd);
  const double b = A * (static_cast<double>(q0) + 0.5) + B;
  // Positive root of A/2 q^2 + b q - budget, in the cancellation-free form.
  const double root = 2.0 * budget / (b + std::sqrt(b * b + 2.0 * A * budget));
  auto q = std::clamp<std::int64_t>(static_cast<std::int64_t>(std::floor(root)), 0, max_q);
  if (q < max_q && std::abs(sliceFlops(cost, q0, q + 1, Phase::Fwd) - budget) <
                       std::abs(sliceFlops(cost, q0, q, Phase::Fwd) - budget))
    ++q;
  return q;
}

ReplicaPacks packReplica(const std::vector<Document>& docs, std::int64_t m, std::int64_t s_max,
                         const model::CostModel& cost, const std::vector<double>* fwd_flops) {
  ReplicaPacks out;
  const auto M = static_cast<std::size_t>(m);
  out.packs.resize(M);
  std::vector<double> own;
  if (!fwd_flops) {
    own.resize(docs.size());
    for (std::size_t i = 0; i < docs.size(); ++i) own[i] = sliceFlops(cost, 0, docs[i].length, Phase::Fwd);
  }
  const std::vector<double>& f = fwd_flops ? *fwd_flops : own;
  std::int64_t tokens = 0;
  double total = 0;
  for (std::size_t i = 0; i < docs.size(); ++i) {
    total += f[i];
    tokens += docs[i].length;
  }
  if (tokens > m * s_max) {
    out.ok = false;
    return out;
  }
  out.tau = total / static_cast<double>(m);
  const double tau = out.tau;
  std::vector<std::size_t> order(docs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return f[a] != f[b] ? f[a] > f[b] : docs[a].id < docs[b].id; });
  std::vector<double> used(M, 0.0);
  std::vector<std::int64_t> tok(M, 0);
  auto add = [&](std::size_t k, const Document& d, std::int64_t o, std::int64_t q) {
    // q_offset = o: a slice attends to its whole document prefix.
    out.packs[k].segments.push_back(Segment{d.id, o, q, d.arrival_step, o});
    used[k] += sliceFlops(cost, o, q, Phase::Fwd);
    tok[k] += q;
  };
  // Stream documents through the packs from `k` on, cutting causal slices at the boundary
  // that fills each pack to `level` (the last pack takes what rounding leaves); with
  // `by_tokens` packs close only when full of tokens. False when tokens run out of room.
  double level = tau;
  auto stream = [&](const std::vector<std::size_t>& items, std::size_t k, bool by_tokens) {
    for (const auto idx : items) {
      const Document& d = docs[idx];
      std::int64_t o = 0;
      while (o < d.length) {
        if (k >= M) return false;
        const std::int64_t room_t = s_max - tok[k], rest = d.length - o;
        const double room_f = by_tokens || k + 1 == M ? std::numeric_limits<double>::infinity() : level - used[k];
        if (room_t <= 0 || room_f <= 0) {
          ++k;
          continue;
        }
        const std::int64_t q = rest <= room_t && sliceFlops(cost, o, rest, Phase::Fwd) <= room_f
                                   ? rest
                                   : solveSliceLength(cost, o, room_f, std::min(rest, room_t));
        if (q == 0) {
          ++k;
          continue;
        }
        add(k, d, o, q);
        o += q;
        if (o < d.length) ++k;  // the boundary closed this pack
      }
    }
    return true;
  };
  std::vector<std::size_t> longs, shorts, leftovers;
  for (const auto i : order) (f[i] > tau || docs[i].length > s_max ? longs : shorts).push_back(i);
  // Slim: long samples fill MicroPacks from the first one on.
  bool fit = stream(longs, 0, false);
  // Pack: short samples whole, best fit on the remaining forward budget. A sample that
  // overshoots tau by a sliver stays whole rather than leaving a sliver slice; the
  // overshoots of all packs together stay under 0.1% of tau, since what they take is
  // missing from the other packs.
  double slack = 1e-3 * tau;
  // Best fit = the pack with the most FLOPs that still takes the sample, the first among
  // equals: packs ordered by (used, -k), searched down from the budget (O(log m) per sample
  // instead of a scan of every pack; hundreds of packs at long windows).
  std::set<std::pair<double, std::int64_t>> by_used;  // packs with token room left
  for (std::size_t k = 0; fit && k < M; ++k)
    if (tok[k] < s_max) by_used.insert({used[k], -static_cast<std::int64_t>(k)});
  for (const auto i : shorts) {
    if (!fit) break;
    const double limit = tau + std::max(0.0, slack);
    std::size_t best = M;
    // a little above the threshold: the exact test below decides at the boundary
    auto it =
        by_used.upper_bound({limit - f[i] + 1e-9 * (std::abs(limit) + f[i]), std::numeric_limits<std::int64_t>::max()});
    while (best == M && it != by_used.begin()) {
      --it;
      const auto k = static_cast<std::size_t>(-it->second);
      if (tok[k] + docs[i].length <= s_max && used[k] + f[i] <= limit) best = k;
    }
    if (best == M) {
      leftovers.push_back(i);
    } else {
      slack -= std::max(0.0, used[best] + f[i] - std::max(tau, used[best]));
      by_used.erase(it);
      add(best, docs[i], 0, docs[i].length);
      if (tok[best] < s_max) by_used.insert({used[best], -static_cast<std::int64_t>(best)});
    }
  }
  // Mix: what fits nowhere whole fills the remaining budgets as slices, in pack order. Whole
  // samples may have overshot tau by the slack; fill every other pack to the common level L
  // with sum_k max(0, L - used_k) = the leftovers' FLOPs (slicing conserves FLOPs), so the
  // overshoot is spread instead of landing on the last pack.
  if (fit && !leftovers.empty()) {
    double rest = 0;
    for (const auto i : leftovers) rest += f[i];
    auto u = used;
    std::sort(u.begin(), u.end());
    double sum = 0;
    for (std::size_t j = 0; j < M; ++j) {
      sum += u[j];
      level = (rest + sum) / static_cast<double>(j + 1);
      if (j + 1 == M || level <= u[j + 1]) break;
    }
  }
  fit = fit && stream(leftovers, 0, false);
  if (!fit) {
    // The token limit kept the budgets from being met: fill by tokens (always fits here).
    out.balanced = false;
    for (auto& p : out.packs) p.segments.clear();
    std::fill(used.begin(), used.end(), 0.0);
    std::fill(tok.begin(), tok.end(), 0);
    stream(order, 0, true);
  }
  return out;
}

ReplicaPacks packReplicaWhole(const std::vector<Document>& docs, std::int64_t m, std::int64_t s_max,
                              const model::CostModel& cost) {
  ReplicaPacks out;
  const auto M = static_cast<std::size_t>(m);
  out.packs.resize(M);
  std::vector<double> f(docs.size()), used(M, 0.0);
  std::vector<std::int64_t> tok(M, 0);
  double total = 0;
  for (std::size_t i = 0; i < docs.size(); ++i) {
    f[i] = sliceFlops(cost, 0, docs[i].length, Phase::Fwd);
    total += f[i];
  }
  out.tau = total / static_cast<double>(m);
  std::vector<std::size_t> order(docs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return f[a] != f[b] ? f[a] > f[b] : docs[a].id < docs[b].id; });
  auto add = [&](std::size_t k, const Document& d, std::int64_t o, std::int64_t q) {
    out.packs[k].segments.push_back(Segment{d.id, o, q, d.arrival_step, o});
    used[k] += sliceFlops(cost, o, q, Phase::Fwd);
    tok[k] += q;
  };
  std::size_t k = 0;
  for (const auto i : order) {
    const Document& d = docs[i];
    for (std::int64_t o = 0; d.length > s_max && o < d.length;) {
      if (k >= M) {
        out.ok = false;
        return out;
      }
      const std::int64_t q = std::min(s_max - tok[k], d.length - o);
      if (q <= 0) {
        ++k;
        continue;
      }
      add(k, d, o, q);
      o += q;
      if (o < d.length) ++k;
    }
  }
  for (const auto i : order) {
    if (docs[i].length > s_max) continue;
    std::size_t best = M;
    for (std::size_t j = 0; j < M; ++j)
      if (tok[j] + docs[i].length <= s_max && (best == M || used[j] < used[best])) best = j;
    if (best == M) {
      out.ok = false;
      return out;
    }
    add(best, docs[i], 0, docs[i].length);
  }
  return out;
}

std::vector<std::int64_t> backwardPartition(const std::vector<double>& bwd, const std::vector<std::int64_t>& tokens,
                                            std::int64_t m, std::int64_t s_max,
                                            const std::vector<std::int64_t>* chain) {
  const std::size_t n = bwd.size();
  // Greedy groups under a FLOPs cap: the fewest groups for that cap (cuts optional). A
  // slice of a second sliced sample forces a cut before it (as late as the cap allows,
  // which keeps the greedy count minimal).
  auto groups = [&](double cap, std::vector<std::int64_t>* cuts) {
    std::int64_t g = 0, t = 0, open = -1;
    double f = 0;
    if (cuts) cuts->assign(1, 0);
    for (std::size_t i = 0; i < n; ++i) {
      const std::int64_t c = chain ? (*chain)[i] : -1;
      if (i > 0 && (f + bwd[i] > cap || t + tokens[i] > s_max || (c >= 0 && open >= 0 && c != open))) {
        ++g;
        if (cuts) cuts->push_back(static_cast<std::int64_t>(i));
        f = 0;
        t = 0;
        open = -1;
      }
      f += bwd[i];
      t += tokens[i];
      if (c >= 0) open = c;
    }
    return n > 0 ? g + 1 : 0;
  };
  const double total = std::accumulate(bwd.begin(), bwd.end(), 0.0);
  double lo = n > 0 ? std::max(*std::max_element(bwd.begin(), bwd.end()), total / static_cast<double>(m)) : 0.0;
  double hi = total;
  if (groups(hi, nullptr) > m) return {};
  if (groups(lo, nullptr) <= m) hi = lo;
  for (int it = 0; it < 200 && hi - lo > 1e-13 * hi; ++it) {
    const double mid = 0.5 * (lo + hi);
    (groups(mid, nullptr) <= m ? hi : lo) = mid;
  }
  std::vector<std::int64_t> cuts;
  groups(hi, &cuts);
  while (static_cast<std::int64_t>(cuts.size()) < m + 1) cuts.push_back(static_cast<std::int64_t>(n));
  return cuts;
}

std::vector<std::int64_t> candidateCounts(std::int64_t i_min, std::int64_t n, std::int64_t i_max) {
  std::vector<std::int64_t> v{i_min};
  for (std::int64_t k = 1; k < std::min<std::int64_t>(n, 62); ++k) {
    const std::int64_t i = i_min + (std::int64_t{1} << k) - 1;
    if (i > i_max) break;
    v.push_back(i);
  }
  return v;
}

}  // namespace slimpack

namespace {

using model::Phase;

pp::SimConfig simConfigOf(const PackerOptions& o, const model::CostModel& c) {
  pp::SimConfig s;
  if (o.sim) {
    s = *o.sim;
  } else {
    const auto& h = c.hardware();
    s.tp = static_cast<int>(c.tp());
    s.net.tp_bps = h.tp_bandwidth_gbps * 1e9;
    s.net.cp_bps = h.cp_bandwidth_gbps * 1e9;
    s.net.pp_bps = h.pp_bandwidth_gbps * 1e9;
    s.net.dp_bps = h.dp_bandwidth_gbps * 1e9;
    s.net.latency_s = h.link_latency_us * 1e-6;
    s.memory_bytes = h.memory_gb * 1e9;
  }
  s.dp = static_cast<int>(o.dp);
  s.pp = static_cast<int>(o.pp);
  // A SlimPack plan runs under PackFlow, whatever schedule the deck names for other packers.
  s.schedule = pp::ScheduleKind::PackFlow;
  // Candidates are compared at the profile's mean speed: the rank-speed spread is what the
  // simulator predicts of a plan, and its scatters would multiply the planner's time.
  s.rank_spread = s.step_spread = s.task_spread = 0;
  s.chunks = 1;
  return s;
}

class SlimPackPacker final : public Packer {
 public:
  SlimPackPacker(PackerOptions o, const model::CostModel& c)
      : Packer(std::move(o), c), sim_(simConfigOf(opt_, c), c), attn_(c) {
    if (opt_.pp < 1 || opt_.slimpack_candidates < 1)
      throw InputError(fmt::format("packing.slimpack_candidates: need >= 1 candidates and pp >= 1 (got {}, pp {})",
                                   opt_.slimpack_candidates, opt_.pp),
                       true);
  }
  std::string name() const override { return "slimpack"; }

  StepPlan pack(std::int64_t step, const std::vector<Document>& incoming) override {
    // Samples the previous step held back come first; a sample is never held twice, so none
    // waits more than one step.
    std::vector<Document> docs;
    for (const auto& s : carry_) docs.push_back(Document{s.doc, s.length, s.arrival_step});
    const std::size_t carried = docs.size();
    docs.insert(docs.end(), incoming.begin(), incoming.end());
    carry_.clear();
    Outcome best = planDocs(step, docs);
    std::vector<Document> held;
    if (!best.res.fits_memory && !best.hopeless) {
      // Hold back the heaviest samples that arrived with this step, 1, 3, 7, 15, then all of
      // them, until the rest fits. The step's longest sample stays: it is what has to be
      // sliced (no remedy fits it with company), so it trains now with less company.
      const auto longer = [&](std::size_t a, std::size_t b) {
        return docs[a].length != docs[b].length ? docs[a].length > docs[b].length : docs[a].id < docs[b].id;
      };
      std::vector<std::size_t> all(docs.size());
      std::iota(all.begin(), all.end(), 0);
      const std::size_t longest = docs.empty() ? 0 : *std::min_element(all.begin(), all.end(), longer);
      std::vector<std::size_t> fresh;
      for (std::size_t i = carried; i < docs.size(); ++i)
        if (i != longest) fresh.push_back(i);
      std::stable_sort(fresh.begin(), fresh.end(), longer);
      for (std::size_t n = 1; !fresh.empty(); n = n < 15 ? 2 * n + 1 : fresh.size()) {
        n = std::min(n, fresh.size());
        std::vector<char> hold(docs.size(), 0);
        for (std::size_t j = 0; j < n; ++j) hold[fresh[j]] = 1;
        std::vector<Document> keep, out;
        for (std::size_t i = 0; i < docs.size(); ++i) (hold[i] ? out : keep).push_back(docs[i]);
        Outcome o = planDocs(step, keep);
        if (o.res.fits_memory) {
          best = std::move(o);
          held = std::move(out);
          break;
        }
        if (n == fresh.size()) break;
      }
    }
    StepPlan plan = std::move(best.plan);
    plan.memory.partition = best.res.fits_memory ? best.partition : "over";
    plan.memory.peak_bytes = best.res.peak_bytes;
    plan.memory.budget_bytes = std::max(0.0, sim_.config().memory_bytes);
    for (const auto& d : held) {
      carry_.push_back(Segment{d.id, 0, d.length, d.arrival_step, 0});
      plan.memory.held.push_back(d.id);
    }
    std::sort(plan.memory.held.begin(), plan.memory.held.end());
    plan.delayed = plan.memory.held;
    info_ = {{"micropacks", static_cast<std::int64_t>(plan.replicas.front().size())},
             {"merged", static_cast<std::int64_t>(plan.merged.size())},
             {"token_cap", best.token_cap},
             {"step_seconds", best.res.step_seconds},
             {"fits_memory", best.res.fits_memory},
             {"partition", plan.memory.partition},
             {"held", static_cast<std::int64_t>(held.size())},
             {"candidates", std::move(best.cands)}};
    return plan;
  }

  nlohmann::json saveState() const override { return {{"carry", detail::segsToJson(carry_)}}; }
  void loadState(const nlohmann::json& s) override {
    if (!s.contains("carry") || !s.at("carry").is_array())
      throw InputError("slimpack checkpoint: 'carry' must be a list of held-back segments");
    carry_ = detail::segsFromJson(s.at("carry"));
    for (const auto& c : carry_)
      if (c.offset != 0 || c.length < 1 || c.q_offset != 0)
        throw InputError("slimpack checkpoint: 'carry' holds whole samples only (offset 0, length >= 1)");
  }
  std::vector<Segment> heldSegments() const override { return carry_; }
  nlohmann::json lastSolverInfo() const override { return info_; }

 private:
  enum class Partition { Flops, SampleEnds, Whole };

  /// The chosen plan for one set of samples and how it was found.
  struct Outcome {
    StepPlan plan;
    pp::StepResult res;
    std::string partition;
    /// A sample sliced on one replica needs more than a stage's free memory on its own (its
    /// slices' activations are all held until their last-in-first-out backward): nothing
    /// the packer does makes the step fit.
    bool hopeless = false;
    bool have = false;
    bool merged = false;  ///< the DP-Merge placement merged a sample (the plain one is tried too)
    int placements = 0;
    std::int64_t token_cap = 0;
    nlohmann::json cands = nlohmann::json::array();
  };
  struct Group {
    Document doc;
    std::vector<std::int64_t> members;  // ascending; the owner first
  };

  /// Every replica's MicroPacks with the merged slots first and the backward cut points of
  /// `part`; nothing when no backward partition meets the limits. `take`: the MicroPacks are
  /// moved out of `fwd` (no other partition of them follows).
  std::optional<StepPlan> assemble(std::int64_t step, const std::vector<Group>& groups,
                                   std::vector<slimpack::ReplicaPacks>& fwd, Partition part, std::int64_t m,
                                   std::int64_t s_fill, bool take = false) const {
    StepPlan plan;
    plan.step = step;
    for (std::size_t u = 0; u < groups.size(); ++u)
      plan.merged.push_back({static_cast<std::int64_t>(u), groups[u].members});
    for (std::size_t r = 0; r < fwd.size(); ++r) {
      const auto& rp = fwd[r].packs;
      std::vector<std::int64_t> cuts{0};
      if (part == Partition::Whole) {
        for (const auto& mb : rp) cuts.push_back(cuts.back() + static_cast<std::int64_t>(mb.segments.size()));
      } else {
        std::vector<double> bw;
        std::vector<std::int64_t> bt, chain;
        std::unordered_map<DocId, int> pieces;
        for (const auto& mb : rp)
          for (const auto& s : mb.segments) {
            bw.push_back(slimpack::sliceFlops(*cost_, s.q_offset, s.length, Phase::Bwd));
            bt.push_back(s.length);
            ++pieces[s.doc];
          }
        for (const auto& mb : rp)
          for (const auto& s : mb.segments) chain.push_back(pieces[s.doc] > 1 ? s.doc : -1);
        cuts = slimpack::backwardPartition(bw, bt, m, s_fill, part == Partition::SampleEnds ? &chain : nullptr);
        if (cuts.empty()) {
          if (part == Partition::SampleEnds) return std::nullopt;
          cuts = pp::replicaSlices(rp).fwd_cuts;  // a token-infeasible fill (never here)
        }
      }
      std::vector<MicroBatch> packs;
      std::vector<std::int64_t> all_cuts{0};
      for (const auto& gr : groups) {
        MicroBatch mb;
        if (gr.members.front() == static_cast<std::int64_t>(r))
          mb.segments.push_back(Segment{gr.doc.id, 0, gr.doc.length, gr.doc.arrival_step, 0});
        all_cuts.push_back(all_cuts.back() + static_cast<std::int64_t>(mb.segments.size()));
        packs.push_back(std::move(mb));
      }
      const std::int64_t lead = all_cuts.back();
      for (std::size_t k = 1; k < cuts.size(); ++k) all_cuts.push_back(lead + cuts[k]);
      if (take)
        packs.insert(packs.end(), std::make_move_iterator(fwd[r].packs.begin()),
                     std::make_move_iterator(fwd[r].packs.end()));
      else
        packs.insert(packs.end(), rp.begin(), rp.end());
      plan.replicas.push_back(std::move(packs));
      plan.backward.push_back(std::move(all_cuts));
    }
    return plan;
  }

  /// Simulate a candidate plan and keep it when it is better: the fastest that fits
  /// memory, or the fastest when none fits. Returns whether it fits.
  bool consider(Outcome& out, StepPlan&& plan, const char* partition, std::int64_t m, bool balanced, bool merged) {
    std::vector<pp::PackFlowDeps> flow;
    pp::packFlowPlanWork(plan, "per_document", sim_.config().cp, *cost_, CpConfig{}, attn_, flow, works_);
    const auto res = sim_.simulate(works_, nullptr, 0, 0, &flow);
    out.cands.push_back({{"micropacks", m},
                         {"partition", partition},
                         {"step_seconds", res.step_seconds},
                         {"fits_memory", res.fits_memory},
                         {"balanced", balanced},
                         {"dp_merge", merged}});
    const bool better = !out.have || (res.fits_memory && !out.res.fits_memory) ||
                        (res.fits_memory == out.res.fits_memory && res.step_seconds < out.res.step_seconds);
    if (better) {
      out.plan = std::move(plan);
      out.res = res;
      out.partition = partition;
      out.have = true;
    }
    return res.fits_memory;
  }

  Outcome planDocs(std::int64_t step, const std::vector<Document>& docs) {
    Outcome out;
    const auto dp = static_cast<std::size_t>(opt_.dp);
    const auto s_max = opt_.s_max;
    const bool memory = sim_.config().memory_bytes > 0;
    // Every MicroPack holds at most s_max tokens and what the per-stage memory budget leaves
    // for one in-flight MicroPack (pp::StepSimulator::microBatchTokenBudget); each
    // candidate's simulated peak is checked again below.
    const std::int64_t s_fill = std::min(s_max, sim_.microBatchTokenBudget());
    out.token_cap = s_fill;
    // Phase 1: samples by decreasing forward FLOPs to the replica with the least so far.
    // DP-Merge: a sample whose forward FLOPs exceed a replica's share (sum / dp) runs on the
    // g least-loaded replicas together, sharded over them as a CP group: g = ceil(f / share),
    // or more if each member's share of its tokens would exceed s_fill; a sample that would
    // need more than dp replicas is slimmed on one replica instead.
    std::vector<double> f(docs.size());
    double total = 0;
    for (std::size_t i = 0; i < docs.size(); ++i) {
      f[i] = slimpack::sliceFlops(*cost_, 0, docs[i].length, Phase::Fwd);
      total += f[i];
    }
    const double share = total / static_cast<double>(dp);
    std::vector<std::size_t> order(docs.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return f[a] != f[b] ? f[a] > f[b] : docs[a].id < docs[b].id;
    });
    // Each placement of the samples (with DP-Merge, and, when that merged any, without it:
    // a sample just above the share gains little from a CP group of replicas and pays its
    // communication, so the simulator decides between the two as between MicroPack counts).
    for (const bool merge : {true, false}) {
      if (!merge && !out.merged) break;
      placeAndPartition(out, step, docs, f, order, share, s_fill, memory, merge && opt_.slimpack_dp_merge);
    }
    return out;
  }

  /// Phase 1 (samples to replicas, merged ones to groups) and phase 2 (every candidate
  /// MicroPack count and partition, `consider`ed into `out`) for one placement rule.
  void placeAndPartition(Outcome& out, std::int64_t step, const std::vector<Document>& docs,
                         const std::vector<double>& f, const std::vector<std::size_t>& order, double share,
                         std::int64_t s_fill, bool memory, bool merge) {
    const auto dp = static_cast<std::size_t>(opt_.dp);
    std::vector<std::vector<Document>> rep(dp);
    std::vector<std::vector<double>> rep_f(dp);
    std::vector<double> load(dp, 0.0);
    std::vector<std::int64_t> rtok(dp, 0);
    std::vector<Group> groups;
    for (const auto i : order) {
      const auto g = std::max<std::size_t>(static_cast<std::size_t>(std::ceil(f[i] / share - 1e-9)),
                                           static_cast<std::size_t>((docs[i].length + s_fill - 1) / s_fill));
      if (merge && dp > 1 && f[i] > share * (1 + 1e-9) && g <= dp) {
        std::vector<std::int64_t> by_load(dp);
        std::iota(by_load.begin(), by_load.end(), 0);
        std::stable_sort(by_load.begin(), by_load.end(), [&](std::int64_t a, std::int64_t b) {
          return load[static_cast<std::size_t>(a)] < load[static_cast<std::size_t>(b)];
        });
        by_load.resize(g);
        std::sort(by_load.begin(), by_load.end());
        for (const auto r : by_load) load[static_cast<std::size_t>(r)] += f[i] / static_cast<double>(g);
        groups.push_back({docs[i], std::move(by_load)});
        out.merged = true;
        continue;
      }
      const auto r = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      rep[r].push_back(docs[i]);
      rep_f[r].push_back(f[i]);
      load[r] += f[i];
      rtok[r] += docs[i].length;
    }
    // A sample sliced on one replica that needs more than a stage's free memory: hopeless
    // for this placement (the step is hopeless if every placement is).
    bool hopeless = false;
    if (memory)
      for (const auto& rd : rep)
        for (const auto& d : rd)
          for (int s = 0; d.length > s_fill && s < sim_.config().pp; ++s)
            if (static_cast<double>(d.length) * sim_.stageBytesPerToken(s) > sim_.stageFreeBytes(s)) hopeless = true;
    out.hopeless = out.placements == 0 ? hopeless : out.hopeless && hopeless;
    ++out.placements;
    const bool merged = !groups.empty();
    // Phase 2 for every candidate MicroPack count; the simulator picks. Merged samples take
    // the leading slots (their own forward and backward units), the same on every replica
    // (empty where a replica is no member). Per count: the FLOP-balanced backward cuts; if
    // they exceed the memory, the cuts moved to sample ends.
    const std::int64_t unit = s_fill * opt_.pp;
    const std::int64_t i_min =
        std::max<std::int64_t>(1, (*std::max_element(rtok.begin(), rtok.end()) + unit - 1) / unit);
    // no more MicroPacks per stage than the fullest replica has tokens
    const std::int64_t i_max = std::max(i_min, *std::max_element(rtok.begin(), rtok.end()) / opt_.pp);
    const auto counts = slimpack::candidateCounts(i_min, opt_.slimpack_candidates, i_max);
    for (const auto i : counts) {
      const std::int64_t m = i * opt_.pp;
      std::vector<slimpack::ReplicaPacks> fwd;
      bool balanced = true;
      for (std::size_t r = 0; r < dp; ++r) {
        fwd.push_back(slimpack::packReplica(rep[r], m, s_fill, *cost_, &rep_f[r]));
        balanced = balanced && fwd.back().balanced;
      }
      const bool remedies = memory && !hopeless;  // a second partition of these MicroPacks may follow
      if (consider(out, *assemble(step, groups, fwd, Partition::Flops, m, s_fill, !remedies), "flops", m, balanced,
                   merged) ||
          !memory || hopeless)
        continue;
      if (auto plan = assemble(step, groups, fwd, Partition::SampleEnds, m, s_fill))
        consider(out, std::move(*plan), "sample_ends", m, balanced, merged);
    }
    // Fewer slices: samples whole (one grouping, 1F1B's memory, which s_fill bounds), only
    // those longer than a MicroPack sliced.
    if (memory && !out.res.fits_memory && !hopeless)
      for (const auto i : counts) {
        const std::int64_t m = i * opt_.pp;
        std::vector<slimpack::ReplicaPacks> whole;
        bool ok = true;
        for (std::size_t r = 0; r < dp && ok; ++r) {
          whole.push_back(slimpack::packReplicaWhole(rep[r], m, s_fill, *cost_));
          ok = whole.back().ok;
        }
        if (ok)
          consider(out, *assemble(step, groups, whole, Partition::Whole, m, s_fill, true), "whole_samples", m, false,
                   merged);
      }
  }

  pp::StepSimulator sim_;
  pp::AttnSecondsMemo attn_;
  std::vector<std::vector<pp::MicroBatchWork>> works_;  ///< the candidates' unit work, reused
  nlohmann::json info_;
  std::vector<Segment> carry_;  ///< whole samples held back to the next step
};

}  // namespace

namespace detail {
std::unique_ptr<Packer> makeSlimPack(const PackerOptions& opt, const model::CostModel& cost) {
  return std::make_unique<SlimPackPacker>(opt, cost);
}
}  // namespace detail

}  // namespace wlb::packing
