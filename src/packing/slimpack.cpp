// slimpack: SlimPack's planner (docs/packing.md § slimpack, docs/algorithms.md § SlimPack).
#include "packing/slimpack.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

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
                         const model::CostModel& cost) {
  ReplicaPacks out;
  const auto M = static_cast<std::size_t>(m);
  out.packs.resize(M);
  std::vector<double> f(docs.size());
  std::int64_t tokens = 0;
  double total = 0;
  for (std::size_t i = 0; i < docs.size(); ++i) {
    f[i] = sliceFlops(cost, 0, docs[i].length, Phase::Fwd);
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
  for (const auto i : shorts) {
    if (!fit) break;
    std::size_t best = M;
    for (std::size_t k = 0; k < M; ++k) {
      if (tok[k] + docs[i].length > s_max || used[k] + f[i] > tau + std::max(0.0, slack)) continue;
      if (best == M || used[k] > used[best]) best = k;
    }
    if (best == M) {
      leftovers.push_back(i);
    } else {
      slack -= std::max(0.0, used[best] + f[i] - std::max(tau, used[best]));
      add(best, docs[i], 0, docs[i].length);
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

std::vector<std::int64_t> backwardPartition(const std::vector<double>& bwd, const std::vector<std::int64_t>& tokens,
                                            std::int64_t m, std::int64_t s_max) {
  const std::size_t n = bwd.size();
  // Greedy groups under a FLOPs cap: the fewest groups for that cap (cuts optional).
  auto groups = [&](double cap, std::vector<std::int64_t>* cuts) {
    std::int64_t g = 0, t = 0;
    double f = 0;
    if (cuts) cuts->assign(1, 0);
    for (std::size_t i = 0; i < n; ++i) {
      if (i > 0 && (f + bwd[i] > cap || t + tokens[i] > s_max)) {
        ++g;
        if (cuts) cuts->push_back(static_cast<std::int64_t>(i));
        f = 0;
        t = 0;
      }
      f += bwd[i];
      t += tokens[i];
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

std::vector<std::int64_t> candidateCounts(std::int64_t i_min, std::int64_t n) {
  std::vector<std::int64_t> v;
  for (std::int64_t k = 0; k < std::min<std::int64_t>(n, 40); ++k) v.push_back(i_min + (std::int64_t{1} << k) - 1);
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
    const auto dp = static_cast<std::size_t>(opt_.dp);
    const auto s_max = opt_.s_max;
    // Every MicroPack holds at most s_max tokens and what the per-stage memory budget leaves
    // for one in-flight MicroPack (pp::StepSimulator::microBatchTokenBudget); the chosen
    // count's simulated peak is checked again below.
    const std::int64_t s_fill = std::min(s_max, sim_.microBatchTokenBudget());
    // Phase 1: samples by decreasing forward FLOPs to the replica with the least so far.
    // DP-Merge: a sample whose forward FLOPs exceed a replica's share (sum / dp) runs on the
    // g least-loaded replicas together, sharded over them as a CP group: g = ceil(f / share),
    // or more if each member's share of its tokens would exceed s_fill; a sample that would
    // need more than dp replicas is slimmed on one replica instead.
    std::vector<double> f(incoming.size());
    double total = 0;
    for (std::size_t i = 0; i < incoming.size(); ++i) {
      f[i] = slimpack::sliceFlops(*cost_, 0, incoming[i].length, Phase::Fwd);
      total += f[i];
    }
    const double share = total / static_cast<double>(dp);
    std::vector<std::size_t> order(incoming.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return f[a] != f[b] ? f[a] > f[b] : incoming[a].id < incoming[b].id;
    });
    std::vector<std::vector<Document>> rep(dp);
    std::vector<double> load(dp, 0.0);
    std::vector<std::int64_t> rtok(dp, 0);
    struct Group {
      Document doc;
      std::vector<std::int64_t> members;  // ascending; the owner first
    };
    std::vector<Group> groups;
    for (const auto i : order) {
      const auto g = std::max<std::size_t>(static_cast<std::size_t>(std::ceil(f[i] / share - 1e-9)),
                                           static_cast<std::size_t>((incoming[i].length + s_fill - 1) / s_fill));
      if (opt_.slimpack_dp_merge && dp > 1 && f[i] > share * (1 + 1e-9) && g <= dp) {
        std::vector<std::int64_t> by_load(dp);
        std::iota(by_load.begin(), by_load.end(), 0);
        std::stable_sort(by_load.begin(), by_load.end(), [&](std::int64_t a, std::int64_t b) {
          return load[static_cast<std::size_t>(a)] < load[static_cast<std::size_t>(b)];
        });
        by_load.resize(g);
        std::sort(by_load.begin(), by_load.end());
        for (const auto r : by_load) load[static_cast<std::size_t>(r)] += f[i] / static_cast<double>(g);
        groups.push_back({incoming[i], std::move(by_load)});
        continue;
      }
      const auto r = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      rep[r].push_back(incoming[i]);
      load[r] += f[i];
      rtok[r] += incoming[i].length;
    }
    // Phase 2 for every candidate MicroPack count; the simulator picks. Merged samples take
    // the leading slots (their own forward and backward units), the same on every replica
    // (empty where a replica is no member).
    const std::int64_t unit = s_fill * opt_.pp;
    const std::int64_t i_min =
        std::max<std::int64_t>(1, (*std::max_element(rtok.begin(), rtok.end()) + unit - 1) / unit);
    const auto U = static_cast<std::int64_t>(groups.size());
    StepPlan best;
    pp::StepResult best_res;
    bool have = false;
    nlohmann::json cands = nlohmann::json::array();
    for (const auto i : slimpack::candidateCounts(i_min, opt_.slimpack_candidates)) {
      const std::int64_t m = i * opt_.pp;
      StepPlan plan;
      plan.step = step;
      bool balanced = true;
      for (std::int64_t u = 0; u < U; ++u)
        plan.merged.push_back({u, groups[static_cast<std::size_t>(u)].members});
      for (std::size_t r = 0; r < dp; ++r) {
        auto rp = slimpack::packReplica(rep[r], m, s_fill, *cost_);
        balanced = balanced && rp.balanced;
        std::vector<double> bw;
        std::vector<std::int64_t> bt;
        for (const auto& mb : rp.packs)
          for (const auto& s : mb.segments) {
            bw.push_back(slimpack::sliceFlops(*cost_, s.q_offset, s.length, Phase::Bwd));
            bt.push_back(s.length);
          }
        auto cuts = slimpack::backwardPartition(bw, bt, m, s_fill);
        // Empty only for a token-infeasible fill (never here): the forward grouping then.
        if (cuts.empty()) cuts = pp::replicaSlices(rp.packs).fwd_cuts;
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
        for (auto& mb : rp.packs) packs.push_back(std::move(mb));
        plan.replicas.push_back(std::move(packs));
        plan.backward.push_back(std::move(all_cuts));
      }
      std::vector<pp::PackFlowDeps> flow;
      const auto works =
          pp::packFlowPlanWork(plan, "per_document", sim_.config().cp, *cost_, CpConfig{}, attn_, flow);
      const auto res = sim_.simulate(works, nullptr, 0, 0, &flow);
      cands.push_back({{"micropacks", m},
                       {"step_seconds", res.step_seconds},
                       {"fits_memory", res.fits_memory},
                       {"balanced", balanced}});
      // The fastest that fits memory; if none fits, the fastest.
      const bool better = !have || (res.fits_memory && !best_res.fits_memory) ||
                          (res.fits_memory == best_res.fits_memory && res.step_seconds < best_res.step_seconds);
      if (better) {
        best = std::move(plan);
        best_res = res;
        have = true;
      }
    }
    info_ = {{"micropacks", static_cast<std::int64_t>(best.replicas.front().size())},
             {"merged", U},
             {"token_cap", s_fill},
             {"step_seconds", best_res.step_seconds},
             {"fits_memory", best_res.fits_memory},
             {"candidates", std::move(cands)}};
    return best;  // nothing is held back: every sample trains in its own step
  }

  nlohmann::json saveState() const override { return {{"carry", nlohmann::json::array()}}; }
  void loadState(const nlohmann::json& s) override {
    if (!s.at("carry").is_array() || !s.at("carry").empty())
      throw InputError("slimpack checkpoint: 'carry' must be an empty list (slimpack holds nothing back)");
  }
  std::vector<Segment> heldSegments() const override { return {}; }
  nlohmann::json lastSolverInfo() const override { return info_; }

 private:
  pp::StepSimulator sim_;
  pp::AttnSecondsMemo attn_;
  nlohmann::json info_;
};

}  // namespace

namespace detail {
std::unique_ptr<Packer> makeSlimPack(const PackerOptions& opt, const model::CostModel& cost) {
  return std::make_unique<SlimPackPacker>(opt, cost);
}
}  // namespace detail

}  // namespace wlb::packing
