/// \file calibration.cpp
/// \brief Fitting a hardware profile to measured runs (see calibration.hpp).

#include "model/calibration.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "core/error.hpp"

namespace wlb::model {
namespace {

struct Acc {
  double measured = 0, predicted = 0;
  std::size_t n = 0;
  void add(double m, double p) {
    measured += m;
    predicted += p;
    ++n;
  }
};

int linearOpOf(const std::string& op) {
  for (int i = 0; i < kLinearOpCount; ++i)
    if (op == linearOpName(static_cast<LinearOp>(i))) return i;
  return -1;
}

bool isKv(const std::string& op) {
  return op == "kv_exchange" || op == "kv_allgather";
}

// Five significant digits (a factor never rounds to 0).
double round4(double x) {
  if (x <= 0) return x;
  const double scale = std::pow(10.0, 4 - std::floor(std::log10(x)));
  return std::round(x * scale) / scale;
}

// The compute of one (rank, strategy, step, micro-batch, layer, phase): measured seconds
// and the prediction per factor key (profile before the fit), for the rank-speed spread.
struct Task {
  double measured = 0;
  std::vector<double> predicted = std::vector<double>(Factors::keys().size(), 0.0);
};
using Tasks = std::map<std::tuple<int, int, std::int64_t, int, int, int>, Task>;
/// A sync group's layer task (strategy, step, micro-batch, layer, phase, DP replica): the
/// TP x CP ranks computing it at once. With layer -1, the micro-batch's every layer task in
/// the replica (the same work on every stage, up to the prediction).
using GroupKey = std::tuple<int, std::int64_t, int, int, int, int>;
/// One rank's (or every rank's) step: rank, strategy, step.
using RankStep = std::tuple<int, int, std::int64_t>;

struct MeanAcc {
  double sum = 0;
  std::size_t n = 0;
  void add(double x) {
    sum += x;
    ++n;
  }
  double mean() const { return sum / static_cast<double>(n); }
};

SpreadFit fitSpread(const std::vector<MeasuredRun>& runs, const std::vector<Tasks>& tasks,
                    const std::vector<FactorFit>& factors, const HardwareProfile& profile) {
  SpreadFit f;
  f.before_rank = f.rank = profile.rank_spread;
  f.before_step = f.step = profile.step_spread;
  f.before_task = f.task = profile.task_spread;
  std::vector<double> scale(factors.size(), 1.0);  // a prediction after the fit over before it
  for (std::size_t i = 0; i < factors.size(); ++i)
    if (factors[i].fitted && factors[i].after > 0) scale[i] = factors[i].before / factors[i].after;
  // Sums of squares, their degrees of freedom, and how much of the task (step) noise the
  // means of the coarser levels carry: E[ss_step] = df_step * step^2 + step_noise * task^2,
  // E[ss_rank] = df_rank * rank^2 + rank_task * task^2 + rank_step * step^2.
  double ss_task = 0, df_task = 0, ss_step = 0, df_step = 0, step_noise = 0;
  double ss_rank = 0, df_rank = 0, rank_task = 0, rank_step = 0;
  for (std::size_t ri = 0; ri < runs.size(); ++ri) {
    struct X {
      int rank;
      double x;  // log(measured / predicted)
      RankStep rank_step;
      GroupKey group, micro_batch;
    };
    std::vector<X> xs;
    for (const auto& [k, t] : tasks[ri]) {
      double p = 0;
      for (std::size_t i = 0; i < t.predicted.size() && i < scale.size(); ++i) p += t.predicted[i] * scale[i];
      const auto [rank, strategy, step, mb, layer, phase] = k;
      if (p > 0 && t.measured > 0 && rank >= 0 && static_cast<std::size_t>(rank) < runs[ri].ranks.size()) {
        const int dp = runs[ri].ranks[static_cast<std::size_t>(rank)].dp;
        xs.push_back({rank,
                      std::log(t.measured / p),
                      {rank, strategy, step},
                      {strategy, step, mb, layer, phase, dp},
                      {strategy, step, mb, -1, phase, dp}});
      }
    }
    if (xs.size() < 2) continue;
    // interference, as in the factor fit: far slower than the run's median is left out
    std::vector<double> v;
    v.reserve(xs.size());
    for (const auto& e : xs) v.push_back(e.x);
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    const double cut = v[v.size() / 2] + std::log(kOutlierRatio);
    xs.erase(std::remove_if(xs.begin(), xs.end(), [cut](const X& e) { return e.x > cut; }), xs.end());
    std::map<int, MeanAcc> by_rank;
    std::map<RankStep, MeanAcc> by_rank_step;
    for (const auto& e : xs) {
      by_rank[e.rank].add(e.x);
      by_rank_step[e.rank_step].add(e.x);
    }
    if (by_rank.size() < 2) continue;
    const auto R = static_cast<double>(by_rank.size());

    // Task noise: each layer task around its rank's time in that step, less what its sync
    // group shares (a load common to the TP x CP ranks of a layer makes none of them wait;
    // the work's own error in the prediction). A layer without TP and CP has no group: its
    // micro-batch's layers on the other stages stand in (the same work at other times).
    std::map<GroupKey, std::size_t> members;
    for (const auto& e : xs) ++members[e.group];
    for (auto& e : xs)
      if (members[e.group] < 2) e.group = e.micro_batch;
    std::map<GroupKey, MeanAcc> groups;
    for (const auto& e : xs) groups[e.group].add(e.x - by_rank_step[e.rank_step].mean());
    // Degrees of freedom of the two-way layout (rank steps x groups), per block of one
    // replica's step: a rank step and a group always lie in one.
    struct Block {
      double n = 0;
      std::set<RankStep> rank_steps;
      std::set<GroupKey> groups;
    };
    std::map<std::tuple<int, std::int64_t, int>, Block> blocks;
    for (const auto& e : xs) {
      const auto& g = groups[e.group];
      if (g.n < 2) continue;
      const double d = e.x - by_rank_step[e.rank_step].mean() - g.mean();
      ss_task += d * d;
      auto& b = blocks[{std::get<0>(e.group), std::get<1>(e.group), std::get<5>(e.group)}];
      ++b.n;
      b.rank_steps.insert(e.rank_step);
      b.groups.insert(e.group);
      ++f.tasks;
    }
    for (const auto& [k, b] : blocks)
      df_task += std::max(0.0, b.n - static_cast<double>(b.rank_steps.size() + b.groups.size()) + 1);

    // Step wander: each rank's step around its run's mean, less the step's common part in its
    // replica (a load that slows the replica's ranks alike makes none of them wait; a
    // replica of one rank has no such part, and the step's on every rank stands in).
    using StepKey = std::tuple<int, std::int64_t, int>;  // strategy, step, DP replica (-1: all)
    std::map<StepKey, std::size_t> replica_ranks;
    for (const auto& [k, a] : by_rank_step) {
      const auto [rank, strategy, step] = k;
      ++replica_ranks[{strategy, step, runs[ri].ranks[static_cast<std::size_t>(rank)].dp}];
    }
    const auto stepKey = [&](const RankStep& k) {
      const int rank = std::get<0>(k), strategy = std::get<1>(k);
      const std::int64_t step = std::get<2>(k);
      const StepKey own{strategy, step, runs[ri].ranks[static_cast<std::size_t>(rank)].dp};
      return replica_ranks[own] >= 2 ? own : StepKey{strategy, step, -1};
    };
    std::map<StepKey, MeanAcc> step_common;
    std::map<int, std::size_t> steps_of_rank;
    for (const auto& [k, a] : by_rank_step) {
      step_common[stepKey(k)].add(a.mean() - by_rank[std::get<0>(k)].mean());
      ++steps_of_rank[std::get<0>(k)];
    }
    const double df_s = static_cast<double>(by_rank_step.size()) - R - static_cast<double>(step_common.size()) + 1;
    if (df_s > 0) {
      double inv_n = 0;
      for (const auto& [k, a] : by_rank_step) {
        const double d = a.mean() - by_rank[std::get<0>(k)].mean() - step_common[stepKey(k)].mean();
        ss_step += d * d;
        inv_n += 1.0 / static_cast<double>(a.n);
      }
      df_step += df_s;
      step_noise += df_s * inv_n / static_cast<double>(by_rank_step.size());
    }

    // Rank spread: the ranks' means around their mean; each carries its steps' wander / S_r
    // and its tasks' noise / n_r.
    double mean_of_means = 0, inv_n = 0, inv_s = 0;
    for (const auto& [r, a] : by_rank) {
      mean_of_means += a.mean();
      inv_n += 1.0 / static_cast<double>(a.n);
      inv_s += 1.0 / static_cast<double>(steps_of_rank[r]);
    }
    mean_of_means /= R;
    for (const auto& [r, a] : by_rank) ss_rank += (a.mean() - mean_of_means) * (a.mean() - mean_of_means);
    df_rank += R - 1;
    rank_task += (R - 1) * inv_n / R;
    rank_step += (R - 1) * inv_s / R;
    f.ranks += by_rank.size();
  }
  if (df_rank <= 0) {
    f.note = "needs a trace of more than one rank";
    return f;
  }
  // A spread the trace cannot fit (no layer task with a peer, one step per rank) keeps the
  // profile's value, which is also what the others are corrected by: fitting it to 0 would
  // overwrite it and leave its noise in the spreads above it.
  const double task = df_task > 0 ? std::sqrt(ss_task / df_task) : f.before_task;
  const double step =
      df_step > 0 ? std::sqrt(std::max(0.0, (ss_step - step_noise * task * task) / df_step)) : f.before_step;
  const double rank = std::sqrt(std::max(0.0, (ss_rank - rank_task * task * task - rank_step * step * step) / df_rank));
  std::string kept;
  if (df_task <= 0) kept += "task_spread";
  if (df_step <= 0) kept += std::string(kept.empty() ? "" : " and ") + "step_spread";
  if (!kept.empty()) f.note = kept + " kept (the trace has nothing to fit them by)";
  f.task = df_task > 0 ? std::min(0.999, std::round(task * 1e4) / 1e4) : f.before_task;
  f.step = df_step > 0 ? std::min(0.999, std::round(step * 1e4) / 1e4) : f.before_step;
  f.rank = std::min(0.999, std::round(rank * 1e4) / 1e4);
  f.fitted = true;
  return f;
}

}  // namespace

HardwareProfile CalibrationFit::apply(const HardwareProfile& profile) const {
  HardwareProfile p = profile;
  for (const auto& f : factors)
    if (f.fitted) p.factors.at(f.key) = f.after;
  for (const auto& l : links) {
    if (!l.fitted) continue;
    if (l.key == "links.cp_gbps") p.cp_bandwidth_gbps = l.after;
    if (l.key == "links.dp_gbps") p.dp_bandwidth_gbps = l.after;
  }
  if (spread.fitted) {
    p.rank_spread = spread.rank;
    p.step_spread = spread.step;
    p.task_spread = spread.task;
  }
  if (p.version < 2) p.version = 2;
  return p;
}

CalibrationFit fitProfile(const std::vector<MeasuredRun>& runs, const HardwareProfile& profile) {
  if (runs.empty()) throw std::invalid_argument("fitProfile: no runs");
  CalibrationFit fit;
  struct Obs {
    std::size_t run;
    std::string strategy;
    double measured, predicted;
  };
  std::map<std::string, std::vector<Obs>> obs;  // per factor key
  std::map<std::string, Acc> links;             // measured = seconds, predicted = bytes
  bool any_table = false;
  std::vector<Tasks> tasks(runs.size());
  const auto keyIndex = [](const std::string& key) {
    const auto& k = Factors::keys();
    return static_cast<std::size_t>(std::find(k.begin(), k.end(), key) - k.begin());
  };

  for (std::size_t ri = 0; ri < runs.size(); ++ri) {
    const MeasuredRun& run = runs[ri];
    CostModel cost(run.dims, profile, run.tp);
    cost.setLinearReferenceTokens(run.linear_ref_tokens);
    any_table = any_table || cost.linearTableUsed();
    const auto coord = [&](int rank) -> const MeasuredRun::Coord& {
      if (rank < 0 || static_cast<std::size_t>(rank) >= run.ranks.size())
        throw InputError(run.name + ": event of rank " + std::to_string(rank) + " outside the rank table");
      return run.ranks[static_cast<std::size_t>(rank)];
    };
    const auto strategyName = [&](int s) {
      return s >= 0 && static_cast<std::size_t>(s) < run.strategies.size() ? run.strategies[static_cast<std::size_t>(s)]
                                                                           : std::to_string(s);
    };
    const auto share = [&](int strategy, std::int64_t step, int dp, int mb, int cp) -> const RankShare* {
      const auto it = run.shares.find({strategy, step, dp, mb});
      if (it == run.shares.end() || static_cast<std::size_t>(cp) >= it->second.size()) return nullptr;
      return &it->second[static_cast<std::size_t>(cp)];
    };
    const auto add = [&](const std::string& key, int strategy, double m, double p) {
      obs[key].push_back({ri, strategyName(strategy), m, p});
    };

    // Per (rank, strategy, step): the step's span and the time inside op events.
    struct StepAcc {
      double step = -1, inside = 0, fills = 0;
      bool recomputed = false;  // the run recomputed in the backward (pipeline.recompute)
    };
    std::map<std::tuple<int, int, std::int64_t>, StepAcc> steps;
    // Collectives: the fastest member's duration per instance.
    std::map<std::tuple<int, std::int64_t, int, int, int, int, int>, std::pair<double, double>> kv;  // -> (s, bytes)
    std::map<std::tuple<int, std::int64_t, int, int>, std::pair<double, double>> grad;  // strategy, step, tp, pp
    std::size_t compute_events = 0;
    // Linear ops: (rank, strategy, step, micro-batch, layer, phase, op) -> (seconds, FLOPs)
    std::map<std::tuple<int, int, std::int64_t, int, int, int, int>, std::pair<double, double>> ops;

    for (const MeasuredEvent& e : run.events) {
      if (e.seconds < 0) throw InputError(run.name + ": event with negative duration");
      const auto& c = coord(e.rank);
      auto& st = steps[{e.rank, e.strategy, e.step}];
      if (e.op == "step") {
        st.step = e.seconds;
        continue;
      }
      if (e.op == "idle") continue;
      st.inside += e.seconds;
      if (e.op == "embed" || e.op == "loss" || e.op == "recompute") {
        st.fills += e.seconds;  // elementwise work
        st.recomputed = st.recomputed || e.op == "recompute";
        ++compute_events;
        continue;
      }
      const Phase ph = e.phase == 2 ? Phase::Bwd : Phase::Fwd;
      const char* phn = phaseName(ph);
      if (e.op == "attn") {
        ++compute_events;
        const RankShare* sh = share(e.strategy, e.step, c.dp, e.micro_batch, c.cp);
        if (!sh || e.phase == 0) {
          ++fit.unmatched_events;
          continue;
        }
        double pred = 0;
        for (const auto& p : sh->pieces) pred += cost.attnSeconds(p.q0, p.q, ph);
        add(std::string("attn.") + phn, e.strategy, e.seconds, pred);
        Task& t = tasks[ri][{e.rank, e.strategy, e.step, e.micro_batch, e.layer, e.phase}];
        t.measured += e.seconds;
        t.predicted[keyIndex(std::string("attn.") + phn)] += pred;
        continue;
      }
      if (const int op = linearOpOf(e.op); op >= 0) {
        // An op may be recorded as several events (its GEMMs with their FLOPs, then the
        // residual add and norm without): together they are the op, as `wlb profile` times it.
        ++compute_events;
        auto& acc = ops[{e.rank, e.strategy, e.step, e.micro_batch, e.layer, e.phase, op}];
        acc.first += e.seconds;
        acc.second += e.flops;
        continue;
      }
      if (isKv(e.op)) {
        auto& x = kv[{e.strategy, e.step, c.dp, c.tp, e.micro_batch, e.layer, e.phase}];
        if (x.second == 0 || (e.seconds < x.first && e.bytes > 0)) x = {e.seconds, e.bytes};
        continue;
      }
      if (e.op == "grad_allreduce") {
        auto& x = grad[{e.strategy, e.step, c.tp, c.pp}];
        if (x.second == 0 || e.seconds < x.first) x = {e.seconds, std::max(x.second, e.bytes)};
        continue;
      }
    }
    if (compute_events == 0)
      throw InputError(run.name + ": no compute events (attn, qkv_proj, out_proj, mlp, embed, loss) to fit");
    for (const auto& [k, v] : ops) {
      const auto [rank, strategy, step, mb, layer, phase, op] = k;
      const Phase ph = phase == 2 ? Phase::Bwd : Phase::Fwd;
      const double per_token = cost.linearOpFlops(static_cast<LinearOp>(op), 1, ph);
      if (v.second <= 0 || per_token <= 0 || phase == 0) {
        ++fit.unmatched_events;
        continue;
      }
      if (!(v.second / per_token < 1e15))  // no op of a step has that many tokens: damage
        throw InputError(run.name + ": an op's FLOP count is more than any step of this model holds (about 1e" +
                         std::to_string(std::llround(std::log10(v.second))) + ")");
      const auto tokens = static_cast<std::int64_t>(std::llround(v.second / per_token));
      const std::string key = std::string(linearOpName(static_cast<LinearOp>(op))) + "." + phaseName(ph);
      const double pred = cost.linearOpSeconds(static_cast<LinearOp>(op), tokens, ph);
      add(key, strategy, v.first, pred);
      Task& t = tasks[ri][{rank, strategy, step, mb, layer, phase}];
      t.measured += v.first;
      t.predicted[keyIndex(key)] += pred;
    }

    // Elementwise: fills + the step's time outside every op event, summed over the pipeline
    // stages of one (tp, cp, dp) coordinate and step, against the model's layers over that
    // coordinate's micro-batches. With pp > 1 a stage holds a share of the layers and the
    // embedding or the loss end, and its waits are `pp_recv` events (inside), so the sum over
    // stages is the whole model's unlabelled work; with pp = 1 the group is one rank.
    // (strategy, step, dp, cp, tp) -> (seconds, recomputed)
    std::map<std::tuple<int, std::int64_t, int, int, int>, std::pair<double, bool>> groups;
    for (const auto& [k, st] : steps) {
      if (st.step < 0) continue;
      const auto [rank, strategy, step] = k;
      const auto& c = coord(rank);
      auto& g = groups[{strategy, step, c.dp, c.cp, c.tp}];
      g.first += st.fills + std::max(0.0, st.step - st.inside);
      g.second = g.second || st.recomputed;
    }
    for (const auto& [g, m] : groups) {
      const auto [measured, recomputed] = m;
      const auto [strategy, step, dp, cp, tp] = g;
      double pred = 0;
      for (auto it = run.shares.lower_bound({strategy, step, dp, std::numeric_limits<int>::min()});
           it != run.shares.end() && std::get<0>(it->first) == strategy && std::get<1>(it->first) == step &&
           std::get<2>(it->first) == dp;
           ++it) {
        if (static_cast<std::size_t>(cp) >= it->second.size()) continue;
        const std::int64_t n = it->second[static_cast<std::size_t>(cp)].tokens;
        pred += static_cast<double>(run.dims.layers) *
                (cost.elementwiseSeconds(n, Phase::Fwd) + cost.elementwiseSeconds(n, Phase::Bwd) +
                 (recomputed ? cost.recomputeSeconds(n) : 0.0));
      }
      add("elementwise", strategy, measured, pred);
    }
    for (const auto& [k, v] : kv)
      if (v.second > 0 && v.first > 0) links["links.cp_gbps"].add(v.first, v.second);
    const double n = static_cast<double>(run.dp * run.cp);
    for (const auto& [k, v] : grad)
      if (v.second > 0 && v.first > 0 && n > 1)
        links[run.dp > 1 ? "links.dp_gbps" : "links.cp_gbps"].add(v.first, 2.0 * (n - 1.0) / n * v.second);
  }

  // Interference: an event far slower than its kind's median (measured / predicted) was
  // stalled by something the profile does not describe (another job, the OS); it is left out
  // of the fit and counted. Events far faster are kept (nothing makes a kernel 3x faster).
  std::map<std::string, std::vector<Obs>> kept;
  std::map<std::string, std::pair<std::size_t, double>> dropped;
  for (auto& [key, v] : obs) {
    std::map<std::size_t, double> med;  // per run: its own conditions
    for (std::size_t run = 0; run < runs.size(); ++run) {
      std::vector<double> r;
      for (const auto& o : v)
        if (o.run == run && o.predicted > 0) r.push_back(o.measured / o.predicted);
      if (r.empty()) continue;
      std::nth_element(r.begin(), r.begin() + static_cast<std::ptrdiff_t>(r.size() / 2), r.end());
      med[run] = r[r.size() / 2];
    }
    for (const auto& o : v) {
      if (med[o.run] > 0 && o.predicted > 0 && o.measured > kOutlierRatio * med[o.run] * o.predicted) {
        ++dropped[key].first;
        dropped[key].second += o.measured;
      } else {
        kept[key].push_back(o);
      }
    }
  }
  std::map<std::pair<std::size_t, std::string>, std::map<std::string, Acc>> per_strategy;
  for (const auto& key : Factors::keys()) {
    FactorFit f;
    f.key = key;
    f.before = f.after = profile.factors.at(key);
    for (const auto& o : kept[key]) {
      f.measured_s += o.measured;
      f.predicted_s += o.predicted;
      ++f.events;
      per_strategy[{o.run, o.strategy}][key].add(o.measured, o.predicted);
    }
    f.outliers = dropped[key].first;
    f.outlier_s = dropped[key].second;
    if (f.events == 0) {
      f.note = "no events";
    } else if (f.measured_s <= 0) {
      f.note = "no measured time";
    } else if (f.predicted_s <= 0) {
      f.note = key == "elementwise" && !any_table
                   ? "not modelled: the profile has no linear_ops table for this model shape (wlb profile --deck)"
                   : "the profile predicts no time";
    } else {
      f.after = f.before * f.predicted_s / f.measured_s;
      f.fitted = true;
    }
    fit.factors.push_back(f);
  }
  for (const char* key : {"links.cp_gbps", "links.dp_gbps"}) {
    LinkFit l;
    l.key = key;
    l.before = l.after = std::string(key) == "links.cp_gbps" ? profile.cp_bandwidth_gbps : profile.dp_bandwidth_gbps;
    const auto it = links.find(key);
    if (it == links.end() || it->second.measured <= 0) {
      l.note = "no collective of this axis in the traces";
    } else {
      l.seconds = it->second.measured;
      l.bytes = it->second.predicted;
      l.instances = it->second.n;
      l.after = l.bytes / l.seconds / 1e9;
      l.fitted = true;
    }
    fit.links.push_back(l);
  }
  fit.spread = fitSpread(runs, tasks, fit.factors, profile);
  // Residuals per run and strategy with the fitted factors (prediction scales as before / after).
  for (const auto& [rs, keys] : per_strategy)
    for (const auto& [key, a] : keys) {
      const std::string& k = key;  // a lambda may not capture a structured binding before C++20 (nvcc warns)
      const auto f =
          std::find_if(fit.factors.begin(), fit.factors.end(), [&k](const FactorFit& x) { return x.key == k; });
      const double scale = f != fit.factors.end() && f->fitted ? f->before / f->after : 1.0;
      fit.residuals.push_back({rs.second, key, a.measured, a.predicted * scale, rs.first});
    }
  return fit;
}

nlohmann::json applyToJson(const nlohmann::json& profile_json, const CalibrationFit& fit,
                           const std::vector<std::string>& trace_names, const std::string& created) {
  nlohmann::json j = profile_json;
  j["version"] = 2;
  nlohmann::json factors = nlohmann::json::object(), hist_f = nlohmann::json::object();
  for (const auto& f : fit.factors) {
    factors[f.key] = round4(f.after);
    hist_f[f.key] = {{"before", round4(f.before)},          {"after", round4(f.after)}, {"measured_s", f.measured_s},
                     {"predicted_before_s", f.predicted_s}, {"events", f.events},       {"outlier_events", f.outliers}};
    if (!f.fitted) hist_f[f.key]["note"] = f.note;
  }
  j["factors"] = factors;
  nlohmann::json hist_l = nlohmann::json::object();
  for (const auto& l : fit.links) {
    if (!l.fitted) continue;
    const std::string k = l.key.substr(std::string("links.").size());
    if (!j.contains("links") || !j["links"].is_object()) j["links"] = nlohmann::json::object();
    j["links"][k] = std::round(l.after * 1e3) / 1e3;
    hist_l[l.key] = {{"before", l.before}, {"after", std::round(l.after * 1e3) / 1e3}, {"instances", l.instances}};
  }
  nlohmann::json hist_s = nlohmann::json::object();
  if (fit.spread.fitted) {
    const auto& sp = fit.spread;
    j["rank_speed"] = {{"spread", sp.rank}, {"step_spread", sp.step}, {"task_spread", sp.task}};
    hist_s = {
        {"before", {{"spread", sp.before_rank}, {"step_spread", sp.before_step}, {"task_spread", sp.before_task}}},
        {"after", {{"spread", sp.rank}, {"step_spread", sp.step}, {"task_spread", sp.task}}},
        {"ranks", fit.spread.ranks},
        {"tasks", fit.spread.tasks}};
  } else {
    hist_s["note"] = fit.spread.note;
  }
  if (!j.contains("calibration") || !j["calibration"].is_array()) j["calibration"] = nlohmann::json::array();
  j["calibration"].push_back(
      {{"created", created}, {"traces", trace_names}, {"factors", hist_f}, {"links", hist_l}, {"rank_speed", hist_s}});
  std::string names;
  for (const auto& t : trace_names) names += (names.empty() ? "" : ", ") + t;
  // a list of where the numbers came from; a hand-written string is kept as its first entry
  if (!j.contains("sources"))
    j["sources"] = nlohmann::json::array();
  else if (!j["sources"].is_array())
    j["sources"] = nlohmann::json::array({j["sources"]});
  j["sources"].push_back("calibrated by `wlb calibrate` at " + created + " from " + names +
                         ": factors = profiled throughput x predicted / measured op time per op kind; links from the "
                         "fastest member of each collective; rank_speed from the spread of each rank's layer times "
                         "(see `calibration`)");
  return j;
}

}  // namespace wlb::model
