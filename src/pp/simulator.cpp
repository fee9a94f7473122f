#include "pp/simulator.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "cp/shard_plan.hpp"
#include "data/length_source.hpp"
#include "model/memory.hpp"
#include "pp/slice_shards.hpp"
#include "trace/recorder.hpp"

namespace wlb::pp {

Recompute parseRecompute(const std::string& name) {
  if (name == "none") return Recompute::None;
  if (name == "selective") return Recompute::Selective;
  if (name == "full") return Recompute::Full;
  throw InputError("pipeline.recompute: unknown value '" + name + "' (allowed: none, selective, full)", true);
}

bool executorRecomputesSelective(const std::string& name) {
  const Recompute r = parseRecompute(name);
  if (r == Recompute::Full)
    throw InputError(
        "pipeline.recompute = \"full\": wlb run and wlb train (and simulate --as-run, which models "
        "them) recompute \"none\" or \"selective\"; \"full\" is simulated only",
        true);
  return r == Recompute::Selective;
}

// ---- Micro-batch work ------------------------------------------------------------------

MicroBatchWork microBatchWork(const MicroBatch& mb, const cp::MicroBatchShards& plans, const std::string& sharding,
                              int cp, const model::CostModel& cost) {
  MicroBatchWork w;
  const auto n = static_cast<std::size_t>(cp);
  w.tokens = mb.tokens();
  w.rank_tokens.assign(n, 0);
  w.rank_kv_tokens.assign(n, 0);
  w.attn_fwd.assign(n, 0.0);
  w.attn_bwd.assign(n, 0.0);
  w.attn_flops_fwd.assign(n, 0.0);
  w.attn_flops_bwd.assign(n, 0.0);
  w.kv_fwd_bytes.assign(n, 0.0);
  w.kv_bwd_bytes.assign(n, 0.0);
  w.kv_peers.assign(n, 0);
  w.sharding = sharding;
  if (plans.empty) return w;
  const cp::ShardPlan& plan = plans.shard;
  const cp::CommPlan& comm = plans.comm;
  const cp::ShardMetrics m = cp::computeMetrics(plan, comm, cost);
  w.sharding = plan.strategy;
  w.kv_exchange = cp > 1 && comm.mode == cp::CommMode::ShardingAware;
  w.kv_fwd_recv_bytes.assign(n, 0.0);
  w.kv_bwd_recv_bytes.assign(n, 0.0);
  for (std::size_t r = 0; r < n; ++r) {
    w.rank_tokens[r] = m.ranks[r].tokens;
    w.rank_kv_tokens[r] = m.ranks[r].kv_tokens;
    w.attn_fwd[r] = m.ranks[r].attn_seconds_fwd;
    w.attn_bwd[r] = m.ranks[r].attn_seconds_bwd;
    w.attn_flops_fwd[r] = m.ranks[r].attn_flops_fwd;
    w.attn_flops_bwd[r] = m.ranks[r].attn_flops_bwd;
    if (cp > 1) {
      const cp::RankComm& rc = comm.ranks[r];
      w.kv_fwd_bytes[r] = std::max(rc.fwd_bytes_recv, rc.fwd_bytes_sent);
      w.kv_bwd_bytes[r] = std::max(rc.bwd_bytes_recv, rc.bwd_bytes_sent);
      w.kv_fwd_recv_bytes[r] = rc.fwd_bytes_recv;
      w.kv_bwd_recv_bytes[r] = rc.bwd_bytes_recv;
      // the cost model's count: a direction's latency is its busier side, sends or receives
      w.kv_peers[r] = comm.mode == cp::CommMode::AllGather ? cp - 1 : std::max(rc.peers, rc.out_peers);
    }
  }
  return w;
}

MicroBatchWork planMicroBatchWork(const MicroBatch& mb, const std::string& sharding, int cp,
                                  const model::CostModel& cost, const CpConfig& cfg) {
  const auto plans = cp::planReplicaShards({mb}, sharding, cp, cost, cfg);
  return microBatchWork(mb, plans.front(), sharding, cp, cost);
}

MicroBatchWork balancedMicroBatchWork(const std::vector<std::int64_t>& doc_lengths, int cp,
                                      const model::CostModel& cost) {
  MicroBatchWork w;
  double af = 0, ab = 0, ff = 0, fb = 0;
  for (auto d : doc_lengths) {
    w.tokens += d;
    af += cost.attnSeconds(0, d, Phase::Fwd);
    ab += cost.attnSeconds(0, d, Phase::Bwd);
    ff += cost.attnFlops(0, d, Phase::Fwd);
    fb += cost.attnFlops(0, d, Phase::Bwd);
  }
  const auto n = static_cast<std::size_t>(cp);
  for (std::size_t r = 0; r < n; ++r) w.rank_tokens.push_back(evenShare(w.tokens, cp, r));
  w.rank_kv_tokens.assign(n, 0);
  w.attn_fwd.assign(n, af / cp);
  w.attn_bwd.assign(n, ab / cp);
  w.attn_flops_fwd.assign(n, ff / cp);
  w.attn_flops_bwd.assign(n, fb / cp);
  const double kv = cp > 1 ? cost.kvBytes(w.tokens) * (cp - 1) / cp : 0.0;  // an all-gather's
  w.kv_fwd_bytes.assign(n, kv);
  w.kv_bwd_bytes.assign(n, kv);
  w.kv_peers.assign(n, cp - 1);
  w.sharding = "balanced";
  return w;
}

// ---- SlimPack work (PackFlow) ------------------------------------------------------------

double AttnSecondsMemo::operator()(std::int64_t q0, std::int64_t q, Phase p) {
  if (q0 == 0 && q >= 0 && q < kDirect) {
    auto& t = whole_[p == Phase::Bwd ? 1 : 0];
    if (static_cast<std::int64_t>(t.size()) <= q)
      t.resize(static_cast<std::size_t>(std::min(kDirect, std::max<std::int64_t>(2 * q, 4096))),
               std::numeric_limits<double>::quiet_NaN());
    double& v = t[static_cast<std::size_t>(q)];
    if (std::isnan(v)) v = cost_->attnSeconds(0, q, p);
    return v;
  }
  if (q0 < 0 || q < 0 || q0 >= (std::int64_t{1} << 31) || q >= (std::int64_t{1} << 31))
    return cost_->attnSeconds(q0, q, p);
  if (map_.size() > (1u << 18)) map_.clear();
  const auto key = (static_cast<std::uint64_t>(q0) << 32) ^ static_cast<std::uint64_t>(q) ^
                   (p == Phase::Bwd ? (std::uint64_t{1} << 63) : 0);
  const auto [it, fresh] = map_.try_emplace(key, 0.0);
  if (fresh) it->second = cost_->attnSeconds(q0, q, p);
  return it->second;
}

bool isSlimPackPlan(const StepPlan& plan) {
  if (!plan.backward.empty() || !plan.merged.empty()) return true;
  for (const auto& rep : plan.replicas)
    for (const auto& mb : rep)
      for (const auto& s : mb.segments)
        if (s.q_offset != 0) return true;
  return false;
}

void packFlowWork(const ReplicaSlices& r, const SliceShards* sh, int k, const model::CostModel& cost,
                  AttnSecondsMemo& attn, MicroBatchWork& w) {
  const int cp = sh ? sh->cp : 1;
  const auto n = static_cast<std::size_t>(cp);
  const auto ku = static_cast<std::size_t>(k);
  w.tokens = 0;
  w.sharding = sh ? sh->strategy : "whole";
  w.rank_tokens.assign(n, 0);
  w.rank_tokens_bwd.assign(n, 0);
  w.attn_fwd.assign(n, 0.0);
  w.attn_bwd.assign(n, 0.0);
  w.attn_flops_fwd.assign(n, 0.0);
  w.attn_flops_bwd.assign(n, 0.0);
  w.kv_fwd_recv_bytes.clear();  // `w` may hold a DP-Merge unit of an earlier step
  w.kv_bwd_recv_bytes.clear();
  w.kv_exchange = false;
  w.kv_across_dp = false;
  std::int64_t tb = 0, cf = 0, cb = 0;  // backward tokens; tokens of continued segments
  for (const bool bwd : {false, true}) {
    const auto& cuts = bwd ? r.bwd_cuts : r.fwd_cuts;
    for (auto i = cuts[ku]; i < cuts[ku + 1]; ++i) {
      const Segment& s = r.segments[static_cast<std::size_t>(i)];
      (bwd ? tb : w.tokens) += s.length;
      if (r.continued[static_cast<std::size_t>(i)]) (bwd ? cb : cf) += s.length;
      const auto piece = [&](std::size_t c, std::int64_t q0, std::int64_t q) {
        (bwd ? w.rank_tokens_bwd : w.rank_tokens)[c] += q;
        const Phase ph = bwd ? Phase::Bwd : Phase::Fwd;
        (bwd ? w.attn_bwd : w.attn_fwd)[c] += attn(s.q_offset + q0, q, ph);
        (bwd ? w.attn_flops_bwd : w.attn_flops_fwd)[c] += cost.attnFlops(s.q_offset + q0, q, ph);
      };
      if (!sh) {
        piece(0, 0, s.length);
        continue;
      }
      for (const auto& p : sh->parts[static_cast<std::size_t>(i)])
        piece(static_cast<std::size_t>(p.rank), p.q_offset, p.q_len);
    }
  }
  // Every rank keeps whole accumulators (and, cp > 1, the K/V cache) of continued segments.
  w.rank_kv_tokens.assign(n, cf);
  w.rank_kv_tokens_bwd.assign(n, cb);
  // cp > 1: the forward all-gathers the MicroPack's K/V; the backward gathers them again
  // and reduce-scatters their gradient.
  const double share = cp > 1 ? static_cast<double>(cp - 1) / cp : 0.0;
  w.kv_fwd_bytes.assign(n, cost.kvBytes(w.tokens) * share);
  w.kv_bwd_bytes.assign(n, 2.0 * cost.kvBytes(tb) * share);
  w.kv_peers.assign(n, cp - 1);
}

MicroBatchWork packFlowWork(const ReplicaSlices& r, const SliceShards* sh, int k, const model::CostModel& cost,
                            AttnSecondsMemo& attn) {
  MicroBatchWork w;
  packFlowWork(r, sh, k, cost, attn, w);
  return w;
}

void packFlowReplicaWork(const ReplicaSlices& r, const SliceShards* sh, const model::CostModel& cost,
                         AttnSecondsMemo& attn, std::vector<MicroBatchWork>& out) {
  out.resize(static_cast<std::size_t>(r.microPacks()));
  for (int k = 0; k < r.microPacks(); ++k) packFlowWork(r, sh, k, cost, attn, out[static_cast<std::size_t>(k)]);
}

std::vector<MicroBatchWork> packFlowReplicaWork(const ReplicaSlices& r, const SliceShards* sh,
                                                const model::CostModel& cost, AttnSecondsMemo& attn) {
  std::vector<MicroBatchWork> out;
  packFlowReplicaWork(r, sh, cost, attn, out);
  return out;
}

MicroBatchWork mergedShareWork(const MicroBatch& mb, int g, int j, int cp, const std::string& sharding,
                               const model::CostModel& cost, const CpConfig& cfg) {
  const int n = g * cp;
  const auto plans = cp::planReplicaShards({mb}, sharding, n, cost, cfg);
  const MicroBatchWork all = microBatchWork(mb, plans.front(), sharding, n, cost);
  MicroBatchWork w;
  w.tokens = all.tokens;
  w.sharding = all.sharding;
  const auto take = [&](const auto& v, auto& out) {
    out.assign(v.begin() + static_cast<std::ptrdiff_t>(j) * cp, v.begin() + static_cast<std::ptrdiff_t>(j + 1) * cp);
  };
  take(all.rank_tokens, w.rank_tokens);
  take(all.rank_kv_tokens, w.rank_kv_tokens);
  take(all.attn_fwd, w.attn_fwd);
  take(all.attn_bwd, w.attn_bwd);
  take(all.attn_flops_fwd, w.attn_flops_fwd);
  take(all.attn_flops_bwd, w.attn_flops_bwd);
  take(all.kv_fwd_bytes, w.kv_fwd_bytes);
  take(all.kv_bwd_bytes, w.kv_bwd_bytes);
  take(all.kv_peers, w.kv_peers);
  take(all.kv_fwd_recv_bytes, w.kv_fwd_recv_bytes);
  take(all.kv_bwd_recv_bytes, w.kv_bwd_recv_bytes);
  w.kv_exchange = all.kv_exchange;
  w.kv_across_dp = g > 1;
  return w;
}

std::vector<std::vector<MicroBatchWork>> packFlowPlanWork(const StepPlan& plan, const std::string& sharding, int cp,
                                                          const model::CostModel& cost, const CpConfig& cfg,
                                                          AttnSecondsMemo& attn, std::vector<PackFlowDeps>& flow) {
  std::vector<std::vector<MicroBatchWork>> works;
  packFlowPlanWork(plan, sharding, cp, cost, cfg, attn, flow, works);
  return works;
}

void packFlowPlanWork(const StepPlan& plan, const std::string& sharding, int cp, const model::CostModel& cost,
                      const CpConfig& cfg, AttnSecondsMemo& attn, std::vector<PackFlowDeps>& flow,
                      std::vector<std::vector<MicroBatchWork>>& works) {
  if (!plan.backward.empty() && plan.backward.size() != plan.replicas.size())
    throw InputError("plan: 'backward' holds " + std::to_string(plan.backward.size()) + " replicas, the step " +
                     std::to_string(plan.replicas.size()));
  works.resize(plan.replicas.size());
  flow.clear();
  for (std::size_t d = 0; d < plan.replicas.size(); ++d) {
    const ReplicaSlices r =
        replicaSlices(plan.replicas[d], plan.backward.empty() ? std::vector<std::int64_t>{} : plan.backward[d]);
    if (cp > 1) {
      const SliceShards sh = sliceShards(r, sharding, cp, cost, cfg);
      packFlowReplicaWork(r, &sh, cost, attn, works[d]);
    } else {
      packFlowReplicaWork(r, nullptr, cost, attn, works[d]);  // every segment whole on its rank
    }
    flow.push_back(planFlowDeps(plan, d, r));
  }
  for (const auto& m : plan.merged) {
    const auto g = static_cast<int>(m.group.size());
    const MicroBatch& mb = plan.replicas[static_cast<std::size_t>(m.group.front())][static_cast<std::size_t>(m.slot)];
    for (int j = 0; j < g; ++j)
      works[static_cast<std::size_t>(m.group[static_cast<std::size_t>(j)])][static_cast<std::size_t>(m.slot)] =
          mergedShareWork(mb, g, j, cp, sharding, cost, cfg);
  }
}

// ---- Network ---------------------------------------------------------------------------

Network Network::resolve(const Deck& deck, const model::HardwareProfile& hw) {
  Network n;
  n.tp_bps = hw.tp_bandwidth_gbps * 1e9;
  n.cp_bps = hw.cp_bandwidth_gbps * 1e9;
  n.pp_bps = hw.pp_bandwidth_gbps * 1e9;
  n.dp_bps = hw.dp_bandwidth_gbps * 1e9;
  n.latency_s = hw.link_latency_us * 1e-6;
  const std::string path = model::HardwareProfile::pathOf(deck);
  if (path.empty()) return n;
  nlohmann::json j;
  try {
    std::ifstream in(path);
    in >> j;
  } catch (const std::exception&) {
    return n;  // HardwareProfile::load already reported bad JSON
  }
  if (!j.is_object() || !j.contains("topology")) return n;
  const auto& t = j["topology"];
  auto num = [&](const char* key) {
    if (!t.contains(key) || !t[key].is_number() || t[key].get<double>() <= 0)
      throw InputError(path + ": key 'topology." + key + "' must be a positive number");
    return t[key].get<double>();
  };
  const double g = num("gpus_per_node"), intra = num("intra_node_gbps") * 1e9, inter = num("inter_node_gbps") * 1e9;
  const auto& m = deck.mesh;
  const auto& h = deck.hardware;
  auto pick = [&](double span, double override_gbps, double& out) {
    if (override_gbps > 0) return;  // the deck's explicit value wins
    out = span <= g ? intra : inter;
  };
  pick(static_cast<double>(m.tp), h.tp_bandwidth_gbps, n.tp_bps);
  pick(static_cast<double>(m.tp * m.cp), h.cp_bandwidth_gbps, n.cp_bps);
  pick(static_cast<double>(m.tp * m.cp * m.pp), h.pp_bandwidth_gbps, n.pp_bps);
  pick(static_cast<double>(m.size()), h.dp_bandwidth_gbps, n.dp_bps);
  return n;
}

SimConfig SimConfig::fromDeck(const Deck& deck, const model::HardwareProfile& hw) {
  SimConfig c;
  c.tp = static_cast<int>(deck.mesh.tp);
  c.cp = static_cast<int>(deck.mesh.cp);
  c.pp = static_cast<int>(deck.mesh.pp);
  c.dp = static_cast<int>(deck.mesh.dp);
  const PipelineLayout layout = pipelineLayout(deck);
  c.chunks = layout.chunks;
  c.schedule = layout.kind;
  c.recompute = parseRecompute(deck.pipeline.recompute);
  c.net = Network::resolve(deck, hw);
  c.memory_bytes = hw.memory_gb * 1e9;
  c.rank_spread = hw.rank_spread;
  c.step_spread = hw.step_spread;
  c.task_spread = hw.task_spread;
  return c;
}

namespace {

/// The standard normal quantile (P. J. Acklam's rational approximation, relative error
/// 1.2e-9).
double normalQuantile(double p) {
  static constexpr double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,  -2.759285104469687e+02,
                                 1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  static constexpr double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                                 6.680131188771972e+01, -1.328068155288572e+01};
  static constexpr double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                                 -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
  static constexpr double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                                 3.754408661907416e+00};
  constexpr double low = 0.02425;
  const auto tail = [&](double q) {
    return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
           ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  };
  if (p < low) return tail(std::sqrt(-2 * std::log(p)));
  if (p > 1 - low) return -tail(std::sqrt(-2 * std::log(1 - p)));
  const double q = p - 0.5, r = q * q;
  return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
         (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
}
// The rank-speed spread's draws come from fixed seeds of the portable generator: the same on
// every machine and every run, so a simulation stays a function of its inputs.
constexpr std::uint64_t kScatterSeed = 0x5eed, kNoiseSeed = 0x7015e, kStepSeed = 0x57e9;

}  // namespace

// ---- StepSimulator ---------------------------------------------------------------------

StepSimulator::StepSimulator(SimConfig cfg, const model::CostModel& cost) : cfg_(cfg), cost_(&cost) {
  if (cfg_.tp < 1 || cfg_.cp < 1 || cfg_.pp < 1 || cfg_.dp < 1 || cfg_.chunks < 1)
    throw InputError("simulator: mesh dimensions must be >= 1", true);
  if (cost.dims().layers < static_cast<std::int64_t>(cfg_.pp) * cfg_.chunks)
    throw InputError("model.layers (" + std::to_string(cost.dims().layers) + ") must be at least pp * virtual_stages",
                     true);
  if (cfg_.rank_spread < 0 || cfg_.rank_spread >= 1 || cfg_.step_spread < 0 || cfg_.step_spread >= 1 ||
      cfg_.task_spread < 0 || cfg_.task_spread >= 1)
    throw InputError("simulator: rank_speed spreads must lie in [0, 1)", true);
  const int n = cfg_.ranks();
  if (cfg_.rank_spread > 0 && n > 1) {
    // The normal quantiles (i + 1/2) / n, scattered over the ranks by a fixed shuffle: the
    // slow ranks land in different groups, as nothing ties them to a coordinate.
    std::vector<int> at(static_cast<std::size_t>(n));
    std::iota(at.begin(), at.end(), 0);
    data::Rng rng(kScatterSeed);
    rank_factor_.assign(kPlacements, std::vector<double>(static_cast<std::size_t>(n)));
    for (auto& factors : rank_factor_) {
      for (int i = n - 1; i > 0; --i)
        std::swap(at[static_cast<std::size_t>(i)], at[rng.nextU64() % static_cast<std::uint64_t>(i + 1)]);
      for (int r = 0; r < n; ++r)
        factors[static_cast<std::size_t>(r)] =
            std::max(0.05, 1.0 + cfg_.rank_spread *
                                     normalQuantile((at[static_cast<std::size_t>(r)] + 0.5) / static_cast<double>(n)));
    }
  }
}

double StepSimulator::rankFactor(int rank, int placement) const {
  return rank_factor_.empty() ? 1.0
                              : rank_factor_.at(static_cast<std::size_t>(placement)).at(static_cast<std::size_t>(rank));
}

bool StepSimulator::noisy() const {
  return cfg_.task_spread > 0 && cfg_.ranks() > 1;
}

bool StepSimulator::wanders() const {
  return cfg_.step_spread > 0 && cfg_.ranks() > 1;
}

std::vector<double> StepSimulator::rankSpeeds(int placement, int step) const {
  if (rank_factor_.empty() && !wanders()) return {};
  const int n = cfg_.ranks();
  std::vector<double> f(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) f[static_cast<std::size_t>(r)] = rankFactor(r, placement);
  if (wanders()) {
    // A rank's speed also wanders from step to step (log-normal, mean 1): its own draw per
    // (step, scatter), fixed seeds, so two strategies' same step share them.
    data::Rng rng(kStepSeed,
                  static_cast<std::uint64_t>(std::max(step, 0)) * kPlacements + static_cast<std::uint64_t>(placement));
    const double shift = 0.5 * cfg_.step_spread * cfg_.step_spread;
    for (auto& x : f) x *= std::exp(cfg_.step_spread * rng.normal() - shift);
  }
  return f;
}

double StepSimulator::groupSeconds(const std::vector<double>& x, int stage, int replica,
                                   const std::vector<double>& speed, data::Rng* noise, double* factors) const {
  if (speed.empty() && !noise) {
    if (factors) std::fill(factors, factors + static_cast<std::ptrdiff_t>(cfg_.cp) * cfg_.tp, 1.0);
    return *std::max_element(x.begin(), x.end());
  }
  const MeshShape mesh = cfg_.mesh();
  // Each member's own draw: the group waits for its slowest, and the draw of the task on
  // the next stage is another one, so noise both lengthens groups and travels down the
  // pipeline and into the slowest replica. Log-normal with mean 1: the profile's times stay
  // the mean, and task_spread is the log's standard deviation, as calibrate fits it.
  const double shift = 0.5 * cfg_.task_spread * cfg_.task_spread;
  double m = 0;
  for (int r = 0; r < cfg_.cp; ++r)
    for (int t = 0; t < cfg_.tp; ++t) {
      double f = 1;
      if (!speed.empty()) f *= speed[static_cast<std::size_t>(mesh.rankOf({t, r, stage, replica}))];
      if (noise) f *= std::exp(cfg_.task_spread * noise->normal() - shift);
      if (factors) factors[r * cfg_.tp + t] = f;
      m = std::max(m, x[static_cast<std::size_t>(r)] * f);
    }
  return m;
}

StepSimulator::StepSimulator(const Deck& deck, const model::CostModel& cost)
    : StepSimulator(SimConfig::fromDeck(deck, cost.hardware()), cost) {}

const Schedule& StepSimulator::schedule(int micro_batches) const {
  for (const auto& [m, s] : schedules_)
    if (m == micro_batches) return s;
  schedules_.emplace_back(micro_batches, makeSchedule(cfg_.schedule, cfg_.pp, micro_batches, cfg_.chunks));
  return schedules_.back().second;
}

int StepSimulator::layersOf(int vstage) const {
  return layerBlock(static_cast<int>(cost_->dims().layers), cfg_.pp * cfg_.chunks, vstage).count;
}

double StepSimulator::stageParams(int stage) const {
  const auto& d = cost_->dims();
  const double h = static_cast<double>(d.hidden), kv = static_cast<double>(d.kv_heads * d.head_dim),
               ffn = static_cast<double>(d.ffn), vocab = static_cast<double>(d.vocab);
  const double per_layer = h * (h + 2.0 * kv) + h * h + 3.0 * h * ffn;
  int layers = 0;
  for (int c = 0; c < cfg_.chunks; ++c) layers += layersOf(c * cfg_.pp + stage);
  double p = layers * (per_layer / cfg_.tp + 2.0 * h);
  if (!cfg_.lm_head) return p;
  if (stage == 0) p += vocab * h / cfg_.tp;            // input embedding
  if (stage == cfg_.pp - 1) p += vocab * h / cfg_.tp;  // output head (untied)
  return p;
}

double StepSimulator::activationBytesPerToken() const {
  const auto& d = cost_->dims();
  const double h = static_cast<double>(d.hidden), kv = static_cast<double>(d.kv_heads * d.head_dim),
               ffn = static_cast<double>(d.ffn), b = static_cast<double>(d.dtype_bytes);
  double elems = 0;
  switch (cfg_.recompute) {
    case Recompute::None:
      elems = 6.0 * h + 2.0 * kv + 3.0 * ffn;
      break;
    case Recompute::Selective:
      elems = 4.0 * h + 2.0 * kv + 2.0 * ffn;
      break;
    case Recompute::Full:
      elems = h;
      break;
  }
  return elems * b / cfg_.tp;  // sequence parallelism shards everything over TP
}

StepSimulator::RankLayerCost StepSimulator::layerCost(const MicroBatchWork& w, int r) const {
  RankLayerCost c;
  const auto ri = static_cast<std::size_t>(r);
  const std::int64_t tok = w.rank_tokens[ri];
  const std::int64_t tok_b = w.rank_tokens_bwd.empty() ? tok : w.rank_tokens_bwd[ri];
  if (tok == 0 && tok_b == 0 && w.attn_fwd[ri] == 0) return c;
  const auto& d = cost_->dims();
  const auto& net = cfg_.net;
  LayerParts& f = c.f;
  LayerParts& b = c.b;
  if (cfg_.tp > 1) {
    // Sequence parallel: 2 all-gathers + 2 reduce-scatters per layer per phase, each
    // moving (tp-1)/tp of the rank's [tokens x hidden] activation (ring); the executor's
    // are two all-reduces of the same volume, in fp32 (commScale).
    auto buffers = [&](std::int64_t n) {
      return 2.0 * static_cast<double>(n) * static_cast<double>(d.hidden * d.dtype_bytes) * commScale();
    };
    auto sp = [&](std::int64_t n) {
      return 2.0 * ((cfg_.tp - 1.0) / cfg_.tp * buffers(n) / net.tp_bps) + 4.0 * (cfg_.tp - 1) * net.latency_s;
    };
    f.tp = sp(tok);
    b.tp = sp(tok_b);
    f.tp_bytes = buffers(tok);
    b.tp_bytes = buffers(tok_b);
  }
  // KV traffic wherever the work has some: CP > 1, and a DP-Merge unit's group at any cp.
  if (!w.kv_fwd_bytes.empty()) {
    const double lat = w.kv_peers[ri] * net.latency_s;
    // a DP-Merge group's ring crosses the replicas' DP links: the slower link paces it, as
    // in the gradient reduction
    const double bps = w.kv_across_dp ? std::min(net.cp_bps, net.dp_bps) : net.cp_bps;
    f.kv = commScale() * w.kv_fwd_bytes[ri] / bps + (w.kv_fwd_bytes[ri] > 0 ? lat : 0.0);
    b.kv = commScale() * w.kv_bwd_bytes[ri] / bps + (w.kv_bwd_bytes[ri] > 0 ? lat : 0.0);
    // the trace's bytes: what the rank receives (the time above: its busier side)
    const bool recv = !w.kv_fwd_recv_bytes.empty();
    f.kv_bytes = commScale() * (recv ? w.kv_fwd_recv_bytes[ri] : w.kv_fwd_bytes[ri]);
    b.kv_bytes = commScale() * (recv ? w.kv_bwd_recv_bytes[ri] : w.kv_bwd_bytes[ri]);
  }
  f.attn = w.attn_fwd[ri];
  b.attn = w.attn_bwd[ri];
  f.linear = tok > 0 ? cost_->linearSeconds(tok, Phase::Fwd) : 0.0;
  b.linear = tok_b > 0 ? cost_->linearSeconds(tok_b, Phase::Bwd) : 0.0;
  c.fwd = f.attn + f.linear + f.tp + f.kv;
  c.bwd = b.attn + b.linear + b.tp + b.kv;
  if (cfg_.recompute == Recompute::Full) {  // the backward runs the forward again first
    c.bwd += c.fwd;
    b.attn += f.attn;
    b.linear += f.linear;
    b.tp += f.tp;
    b.kv += f.kv;
    b.tp_bytes += f.tp_bytes;
    b.kv_bytes += f.kv_bytes;
  }
  if (cfg_.recompute == Recompute::Selective && tok_b > 0) {
    b.recompute = cost_->recomputeSeconds(tok_b);
    c.bwd += b.recompute;
  }
  return c;
}

double StepSimulator::commScale() const {
  const double b = static_cast<double>(cost_->dims().dtype_bytes);
  return cfg_.comm_element_bytes > 0 && b > 0 ? cfg_.comm_element_bytes / b : 1.0;
}

double StepSimulator::headFlops(std::int64_t tokens, Phase p) const {
  if (!cfg_.lm_head) return 0.0;
  const auto& d = cost_->dims();
  const double f =
      2.0 * static_cast<double>(tokens) * static_cast<double>(d.hidden) * static_cast<double>(d.vocab) / cfg_.tp;
  return p == Phase::Fwd ? f : model::kLinearBwdFactor * f;
}

double StepSimulator::headSeconds(std::int64_t tokens, Phase p) const {
  return headFlops(tokens, p) / (cost_->hardware().linear_gflops * 1e9);
}

double StepSimulator::p2pSeconds(std::int64_t tokens, const std::vector<std::int64_t>& rank_tokens) const {
  if (cfg_.pp * cfg_.chunks <= 1 || tokens == 0) return 0.0;
  return cfg_.net.latency_s + p2pBytes(rank_tokens) / cfg_.net.pp_bps;
}

double StepSimulator::p2pBytes(const std::vector<std::int64_t>& rank_tokens) const {
  std::int64_t tok = 0;
  for (auto t : rank_tokens) tok = std::max(tok, t);
  const auto& d = cost_->dims();
  // Scatter-gather optimisation: each TP rank sends 1/tp of the activation.
  return cfg_.executor_memory ? static_cast<double>(tok * d.hidden) * 4.0  // every TP rank, fp32
                              : static_cast<double>(tok * d.hidden * d.dtype_bytes) / cfg_.tp;
}

double StepSimulator::gradSyncSeconds(int stage) const {
  const int n = cfg_.dp * cfg_.cp;
  if (n <= 1) return 0.0;
  const double bytes = stageParams(stage) * static_cast<double>(cost_->dims().dtype_bytes) * commScale();
  const double bw = cfg_.dp > 1 ? std::min(cfg_.net.dp_bps, cfg_.net.cp_bps) : cfg_.net.cp_bps;
  return 2.0 * (n - 1.0) / n * bytes / bw + 2.0 * (n - 1) * cfg_.net.latency_s;
}

PipelineCosts StepSimulator::pipelineCosts(const std::vector<MicroBatchWork>& mbs, int replica, int placement,
                                           int step) const {
  const int M = static_cast<int>(mbs.size()), V = cfg_.pp * cfg_.chunks;
  PipelineCosts c(V, M, cfg_.pp);
  const double act_tok = activationBytesPerToken();
  const auto& d = cost_->dims();
  if (std::any_of(mbs.begin(), mbs.end(), [](const MicroBatchWork& w) { return !w.rank_tokens_bwd.empty(); })) {
    c.free_bytes.assign(c.act_bytes.size(), 0.0);
    c.p2p_bwd.assign(c.p2p.size(), 0.0);
  }
  // each CP rank's time of a task, of which groupSeconds makes the group's
  std::vector<double> fr(static_cast<std::size_t>(cfg_.cp)), br(fr.size());
  // The task noise's draws: a fixed stream per (step, scatter, replica), so a simulation
  // stays a function of its inputs and two strategies' same step share their draws.
  std::optional<data::Rng> rng;
  if (noisy())
    rng.emplace(kNoiseSeed,
                (static_cast<std::uint64_t>(std::max(step, 0)) * kPlacements + static_cast<std::uint64_t>(placement)) *
                        static_cast<std::uint64_t>(cfg_.dp) +
                    static_cast<std::uint64_t>(replica));
  data::Rng* noise = rng ? &*rng : nullptr;
  const std::vector<double> speed = rankSpeeds(placement, step);
  const std::size_t members = static_cast<std::size_t>(cfg_.cp) * static_cast<std::size_t>(cfg_.tp);
  if (noise || !speed.empty()) c.member_factor.assign(c.fwd.size() * 2 * members, 1.0);
  const auto factorsOf = [&](std::size_t task, int bwd) {
    return c.member_factor.empty() ? nullptr
                                   : c.member_factor.data() + (task * 2 + static_cast<std::size_t>(bwd)) * members;
  };
  for (int m = 0; m < M; ++m) {
    const MicroBatchWork& w = mbs[static_cast<std::size_t>(m)];
    if (w.cp() != cfg_.cp)
      throw std::logic_error("simulator: micro-batch work has " + std::to_string(w.cp()) + " CP ranks, mesh has " +
                             std::to_string(cfg_.cp));
    // The backward's tokens differ from the forward's under SlimPack's asymmetric partition.
    const bool split = !w.rank_tokens_bwd.empty();
    const auto& tokens_b = split ? w.rank_tokens_bwd : w.rank_tokens;
    std::vector<RankLayerCost> lc(static_cast<std::size_t>(cfg_.cp));
    std::int64_t max_tok = 0, max_tok_b = 0;
    for (int r = 0; r < cfg_.cp; ++r) {
      lc[static_cast<std::size_t>(r)] = layerCost(w, r);
      max_tok = std::max(max_tok, w.rank_tokens[static_cast<std::size_t>(r)]);
      max_tok_b = std::max(max_tok_b, tokens_b[static_cast<std::size_t>(r)]);
    }
    // Activation bytes a unit of `toks` tokens per CP rank holds on virtual stage vs; `kvs`:
    // the KV-buffer tokens (CP) or, for slices, the tokens of continued slices, which keep
    // fp32 dK/dV accumulators (runtime/sliced.hpp).
    // slices: FP32 accumulators, and under CP the cached K/V (runtime/sliced.hpp)
    const std::int64_t kv_elem =
        split ? 4 + (cfg_.cp > 1 ? cfg_.executor_storage_bytes : 0) : cfg_.executor_storage_bytes;
    auto actBytes = [&](const std::vector<std::int64_t>& toks, const std::vector<std::int64_t>& kvs, std::int64_t max_t,
                        double l, bool last) {
      double act = l * act_tok * static_cast<double>(max_t);
      const auto kvOf = [&](std::size_t ri) { return ri < kvs.size() ? kvs[ri] : toks[ri]; };
      if (cfg_.executor_memory) {
        // the worst CP rank: its layers' activations and, on the last stage, the gradient of
        // the loss's input that the executor keeps from the forward (model/memory.hpp)
        double worst = 0;
        for (int r = 0; r < cfg_.cp; ++r) {
          const std::size_t ri = static_cast<std::size_t>(r);
          worst = std::max(worst, l * static_cast<double>(model::executorLayerActivationBytes(
                                          d, cfg_.tp, toks[ri], kvOf(ri), cfg_.executor_storage_bytes, kv_elem,
                                          cfg_.recompute == Recompute::Selective)) +
                                      (last ? static_cast<double>(model::executorHeadBytes(d, toks[ri])) : 0.0));
        }
        act = worst;
      } else if (split) {
        std::int64_t kv = 0;
        for (int r = 0; r < cfg_.cp; ++r) kv = std::max(kv, kvOf(static_cast<std::size_t>(r)));
        act += l * static_cast<double>(kv) * 2.0 * static_cast<double>(d.kv_heads * d.head_dim) *
               (4.0 + (cfg_.cp > 1 ? d.dtype_bytes : 0)) / cfg_.tp;
      }
      if (last && cfg_.lm_head)  // fp32 logits of the vocab-parallel loss, held until the backward
        act += static_cast<double>(max_t) * static_cast<double>(d.vocab) * 4.0 / cfg_.tp;
      return act;
    };
    for (int vs = 0; vs < V; ++vs) {
      const double l = layersOf(vs);
      const bool last = vs == V - 1;
      for (int r = 0; r < cfg_.cp; ++r) {
        const auto ri = static_cast<std::size_t>(r);
        fr[ri] = l * lc[ri].fwd + (last ? headSeconds(w.rank_tokens[ri], Phase::Fwd) : 0.0);
        br[ri] = l * lc[ri].bwd + (last ? headSeconds(tokens_b[ri], Phase::Bwd) : 0.0);
      }
      c.fwd[c.at(vs, m)] = groupSeconds(fr, vs % cfg_.pp, replica, speed, noise, factorsOf(c.at(vs, m), 0));
      c.bwd[c.at(vs, m)] = groupSeconds(br, vs % cfg_.pp, replica, speed, noise, factorsOf(c.at(vs, m), 1));
      c.act_bytes[c.at(vs, m)] = actBytes(w.rank_tokens, w.rank_kv_tokens, max_tok, l, last);
      if (!c.free_bytes.empty())
        c.free_bytes[c.at(vs, m)] =
            split ? actBytes(tokens_b, w.rank_kv_tokens_bwd, max_tok_b, l, last) : c.act_bytes[c.at(vs, m)];
    }
    c.p2p[static_cast<std::size_t>(m)] = p2pSeconds(w.tokens, w.rank_tokens);
    if (!c.p2p_bwd.empty())
      c.p2p_bwd[static_cast<std::size_t>(m)] =
          split ? p2pSeconds(std::accumulate(tokens_b.begin(), tokens_b.end(), std::int64_t{0}), tokens_b)
                : c.p2p[static_cast<std::size_t>(m)];
  }
  const double per_param = static_cast<double>(d.dtype_bytes) + cfg_.grad_bytes_per_param +
                           cfg_.optimizer_bytes_per_param / (cfg_.dp * cfg_.cp);
  for (int s = 0; s < cfg_.pp; ++s) c.static_bytes[static_cast<std::size_t>(s)] = stageParams(s) * per_param;
  return c;
}

double StepSimulator::stageFreeBytes(int s) const {
  if (cfg_.memory_bytes <= 0) return std::numeric_limits<double>::infinity();
  const auto& d = cost_->dims();
  const double per_param = static_cast<double>(d.dtype_bytes) + cfg_.grad_bytes_per_param +
                           cfg_.optimizer_bytes_per_param / (cfg_.dp * cfg_.cp);
  return cfg_.memory_bytes - stageParams(s) * per_param;
}

double StepSimulator::stageBytesPerToken(int s) const {
  const auto& d = cost_->dims();
  double layers = 0;
  for (int c = 0; c < cfg_.chunks; ++c) layers += layersOf(c * cfg_.pp + s);
  double per_token =
      cfg_.executor_memory
          ? layers * static_cast<double>(model::executorLayerActivationBytes(
                         d, cfg_.tp, 1, 0, cfg_.executor_storage_bytes, -1, cfg_.recompute == Recompute::Selective))
          : layers * activationBytesPerToken();
  if (s == cfg_.pp - 1 && cfg_.lm_head) per_token += static_cast<double>(d.vocab) * 4.0 / cfg_.tp;
  if (s == cfg_.pp - 1 && cfg_.executor_memory) per_token += static_cast<double>(model::executorHeadBytes(d, 1));
  return per_token / cfg_.cp;
}

std::int64_t StepSimulator::microBatchTokenBudget() const {
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
  if (cfg_.memory_bytes <= 0) return kNone;
  double best = static_cast<double>(kNone);
  for (int s = 0; s < cfg_.pp; ++s) {
    const double free_bytes = stageFreeBytes(s);
    if (free_bytes <= 0) return kNone;
    best = std::min(best, free_bytes / static_cast<double>(cfg_.pp - s) / stageBytesPerToken(s));
  }
  return best >= static_cast<double>(kNone) ? kNone : std::max<std::int64_t>(1, static_cast<std::int64_t>(best));
}

StepResult StepSimulator::simulate(const std::vector<std::vector<MicroBatchWork>>& works, trace::Recorder* rec,
                                   int step, double t0, const std::vector<PackFlowDeps>* flow) const {
  if (rank_factor_.empty() && !wanders() && !noisy()) return simulateOnce(works, rec, step, t0, flow, 0);
  // The median step over the scatters of the slow ranks and the draws of the task noise;
  // its events recorded (if asked) by simulating that scatter once more with the recorder.
  std::vector<StepResult> results;
  results.reserve(kPlacements);
  std::vector<int> order(kPlacements);
  for (int p = 0; p < kPlacements; ++p) results.push_back(simulateOnce(works, nullptr, step, t0, flow, p));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return std::make_pair(results[a].step_seconds, a) < std::make_pair(results[b].step_seconds, b);
  });
  const int median = order[order.size() / 2];
  return rec ? simulateOnce(works, rec, step, t0, flow, median) : std::move(results[median]);
}

StepResult StepSimulator::simulateOnce(const std::vector<std::vector<MicroBatchWork>>& works, trace::Recorder* rec,
                                       int step, double t0, const std::vector<PackFlowDeps>* flow,
                                       int placement) const {
  if (static_cast<int>(works.size()) != cfg_.dp)
    throw std::logic_error("simulator: plan has " + std::to_string(works.size()) +
                           " replicas, mesh has dp = " + std::to_string(cfg_.dp));
  if (flow && !flow->empty() && flow->size() != works.size())
    throw std::logic_error("simulator: slice dependencies for " + std::to_string(flow->size()) +
                           " replicas, plan has " + std::to_string(works.size()));
  // Each replica's schedule: the cached one, or PackFlow over that replica's slices.
  std::vector<Schedule> own(works.size());
  std::vector<const Schedule*> scheds(works.size());
  for (std::size_t d = 0; d < works.size(); ++d) {
    const int M = static_cast<int>(works[d].size());
    const PackFlowDeps* deps = flow && !flow->empty() && !(*flow)[d].trivial() ? &(*flow)[d] : nullptr;
    if (deps && cfg_.schedule != ScheduleKind::PackFlow)
      throw InputError(std::string("pipeline.schedule = \"") + scheduleKindName(cfg_.schedule) +
                           "\" cannot run a slimpack plan (slices whose backward runs last-in-first-out, backward "
                           "MicroPacks grouped apart from the forward ones): use pipeline.schedule = \"packflow\"",
                       true);
    if (deps) {
      own[d] = makePackFlow(cfg_.pp, M, *deps);
      scheds[d] = &own[d];
    } else {
      scheds[d] = &schedule(M);
    }
  }
  const int P = cfg_.pp, C = cfg_.cp, D = cfg_.dp;
  StepResult res;
  res.replica_seconds.assign(static_cast<std::size_t>(D), 0.0);
  res.peak_bytes.assign(static_cast<std::size_t>(P), 0.0);
  res.rank_busy.assign(static_cast<std::size_t>(D) * static_cast<std::size_t>(P) * static_cast<std::size_t>(C), 0.0);
  std::vector<double> stage_done(static_cast<std::size_t>(P), 0.0), grad(static_cast<std::size_t>(P));
  for (int s = 0; s < P; ++s) grad[s] = gradSyncSeconds(s);

  std::vector<DagResult> dags;
  dags.reserve(static_cast<std::size_t>(D));
  std::vector<PipelineCosts> costs;
  costs.reserve(static_cast<std::size_t>(D));
  for (int d = 0; d < D; ++d) {
    const auto& mbs = works[static_cast<std::size_t>(d)];
    costs.push_back(pipelineCosts(mbs, d, placement, step));
    dags.push_back(simulateDag(*scheds[static_cast<std::size_t>(d)], costs.back()));
    const DagResult& r = dags.back();
    res.replica_seconds[d] = r.makespan;
    res.pipeline_seconds = std::max(res.pipeline_seconds, r.makespan);
    res.bubble_fraction += r.bubbleFraction() / D;
    for (int s = 0; s < P; ++s) {
      stage_done[s] = std::max(stage_done[s], r.stage_finish[s]);
      res.peak_bytes[s] = std::max(res.peak_bytes[s], r.peak_bytes[s]);
    }
  }
  res.static_bytes = costs.front().static_bytes;
  res.peak_activation_bytes.assign(static_cast<std::size_t>(P), 0.0);
  for (int s = 0; s < P; ++s) res.peak_activation_bytes[s] = res.peak_bytes[s] - res.static_bytes[s];
  for (int s = 0; s < P; ++s) {
    res.step_seconds = std::max(res.step_seconds, stage_done[s] + grad[s]);
    res.grad_sync_seconds = std::max(res.grad_sync_seconds, grad[s]);
    if (cfg_.memory_bytes > 0 && res.peak_bytes[s] > cfg_.memory_bytes) res.fits_memory = false;
  }

  // Every rank's own busy time (and, if asked, its predicted events).
  const int V = P * cfg_.chunks;
  const MeshShape mesh = cfg_.mesh();  // rank <-> coordinates, as the executor's ranks
  int r_attn = 0, r_mlp = 0, r_tp = 0, r_kv = 0, r_kvx = 0, r_send = 0, r_grad = 0, r_recompute = 0, strat = 0;
  if (rec) {
    namespace L = trace::labels;
    const auto need = static_cast<std::size_t>(cfg_.ranks());
    if (rec->virtualRanks().size() != need) {
      std::vector<trace::RankCoord> coords(need);
      for (std::size_t r = 0; r < need; ++r) coords[r] = mesh.coordOf(static_cast<int>(r));
      rec->setVirtualRanks(std::move(coords));
    }
    r_attn = rec->region(L::kAttn);
    r_mlp = rec->region(L::kMlp);
    r_tp = rec->region(L::kTpAllreduce);
    r_kv = rec->region(L::kKvAllgather);
    r_kvx = rec->region(L::kKvExchange);
    r_send = rec->region(L::kPpSend);
    r_grad = rec->region(L::kGradAllreduce);
    r_recompute = rec->region(L::kRecompute);
    strat = rec->strategy();
  }
  const auto ns = [&](double sec) { return static_cast<std::int64_t>(std::llround((t0 + sec) * 1e9)); };
  double busy_total = 0;
  for (int d = 0; d < D; ++d) {
    const auto& mbs = works[static_cast<std::size_t>(d)];
    const DagResult& r = dags[static_cast<std::size_t>(d)];
    const Schedule& sched = *scheds[static_cast<std::size_t>(d)];
    std::vector<RankLayerCost> lcs(mbs.size() * static_cast<std::size_t>(C));  // every stage reads them
    for (std::size_t m = 0; m < mbs.size(); ++m)
      for (int c = 0; c < C; ++c)
        lcs[m * static_cast<std::size_t>(C) + static_cast<std::size_t>(c)] = layerCost(mbs[m], c);
    for (int s = 0; s < P; ++s) {
      for (int c = 0; c < C; ++c) {
        double busy = grad[s];
        for (std::size_t v = r.stage_offset[s]; v < r.stage_offset[s + 1]; ++v) {
          const Task& t = r.vertices[v].task;
          const int vs = sched.virtualStage(s, t.chunk);
          const MicroBatchWork& w = mbs[static_cast<std::size_t>(t.mb)];
          const RankLayerCost& lc =
              lcs[static_cast<std::size_t>(t.mb) * static_cast<std::size_t>(C) + static_cast<std::size_t>(c)];
          const double l = layersOf(vs);
          const bool last = vs == V - 1;
          const auto tok = t.phase == Phase::Bwd && !w.rank_tokens_bwd.empty()
                               ? w.rank_tokens_bwd[static_cast<std::size_t>(c)]
                               : w.rank_tokens[static_cast<std::size_t>(c)];
          const double head = last ? headSeconds(tok, t.phase) : 0.0;
          const double own = l * (t.phase == Phase::Fwd ? lc.fwd : lc.bwd) + head;
          busy += own;  // at the profile's mean speed (rank_busy, idle_fraction)
          if (!rec || own <= 0) continue;
          // Each TP member at its own speed and noise draw, as the task's length has them
          // (the task lasts its slowest member's): its events end within the task.
          const auto& pcd = costs[static_cast<std::size_t>(d)];
          const auto factor = [&](int tr) {
            if (pcd.member_factor.empty()) return 1.0;
            const std::size_t task = pcd.at(vs, t.mb) * 2 + (t.phase == Phase::Fwd ? 0 : 1);
            return pcd.member_factor[task * static_cast<std::size_t>(C * cfg_.tp) +
                                     static_cast<std::size_t>(c * cfg_.tp + tr)];
          };
          // Split the task into attention / recomputation / linear / TP / KV pieces in that order.
          const auto ci = static_cast<std::size_t>(c);
          const bool fwd = t.phase == Phase::Fwd;
          const LayerParts& p = fwd ? lc.f : lc.b;
          const bool full = cfg_.recompute == Recompute::Full && !fwd;
          const auto flopsOf = [&](const std::vector<double>& v) { return v.empty() ? 0.0 : v[ci]; };
          const double attn_flops = l * (fwd ? flopsOf(w.attn_flops_fwd)
                                             : flopsOf(w.attn_flops_bwd) + (full ? flopsOf(w.attn_flops_fwd) : 0.0));
          double lin_flops = 0, head_flops = 0;
          if (tok > 0) {
            lin_flops = l * (fwd || full ? cost_->linearFlops(tok, Phase::Fwd) : 0.0) +
                        (fwd ? 0.0 : l * cost_->linearFlops(tok, Phase::Bwd));
            if (last) head_flops = headFlops(tok, t.phase);
          }
          const trace::Phase ph = fwd ? trace::Phase::Fwd : trace::Phase::Bwd;
          double cur = r.start[v];
          for (int tr = 0; tr < cfg_.tp; ++tr) {
            const int rank = mesh.rankOf({tr, c, s, d});
            const double f = factor(tr);
            double x = cur;
            auto emit = [&](int region, double dur, double bytes, double flops = 0.0) {
              if (dur <= 0) return;
              if (region != r_send) dur *= f;  // a compute piece at this member's speed
              trace::Event e;
              e.rank = rank;
              e.strategy = strat;
              e.step = step;
              e.micro_batch = t.mb;
              e.region = region;
              e.layer = -1;
              e.chunk = t.chunk;
              e.phase = ph;
              e.start_ns = ns(x);
              e.end_ns = ns(x + dur);
              e.flops = flops;
              e.bytes = bytes;
              rec->record(e);
              x += dur;
            };
            emit(r_attn, l * p.attn, 0, attn_flops);
            emit(r_recompute, l * p.recompute, 0);
            emit(r_mlp, l * p.linear + head, 0, lin_flops + head_flops);
            emit(r_tp, l * p.tp, l * p.tp_bytes);
            emit(w.kv_exchange ? r_kvx : r_kv, l * p.kv, l * p.kv_bytes);
            const bool sends = fwd ? vs + 1 < V : vs > 0;
            if (sends && cfg_.pp > 1) {
              x = r.finish[v];
              const auto& pc = costs[static_cast<std::size_t>(d)];
              const auto mb = static_cast<std::size_t>(t.mb);
              const bool bwd_own = !fwd && !pc.p2p_bwd.empty();  // SlimPack: the backward unit's own message
              const auto& toks_sent = !fwd && !w.rank_tokens_bwd.empty() ? w.rank_tokens_bwd : w.rank_tokens;
              emit(r_send, bwd_own ? pc.p2p_bwd[mb] : pc.p2p[mb], p2pBytes(toks_sent));
            }
          }
        }
        res.rank_busy[(static_cast<std::size_t>(d) * P + s) * C + c] = busy;
        busy_total += busy * cfg_.tp;
        if (rec && grad[s] > 0)
          for (int tr = 0; tr < cfg_.tp; ++tr) {
            trace::Event e;
            e.rank = mesh.rankOf({tr, c, s, d});
            e.strategy = strat;
            e.step = step;
            e.region = r_grad;
            e.phase = trace::Phase::Bwd;  // a step-level event after the backward
            e.start_ns = ns(stage_done[s]);
            e.end_ns = ns(stage_done[s] + grad[s]);
            e.bytes = stageParams(s) * static_cast<double>(cost_->dims().dtype_bytes) * commScale();
            rec->record(e);
          }
      }
    }
  }
  if (res.step_seconds > 0)
    res.idle_fraction = 1.0 - busy_total / (static_cast<double>(cfg_.ranks()) * res.step_seconds);
  return res;
}

StepResult StepSimulator::simulatePlan(const StepPlan& plan, const std::string& sharding, const CpConfig& cfg,
                                       trace::Recorder* rec, int step, double t0) const {
  std::vector<std::vector<MicroBatchWork>> works(plan.replicas.size());
  if (isSlimPackPlan(plan)) {
    // Slices: each unit is a forward and a backward MicroPack, ordered by PackFlow.
    AttnSecondsMemo attn(*cost_);
    std::vector<PackFlowDeps> flow;
    works = packFlowPlanWork(plan, sharding, cfg_.cp, *cost_, cfg, attn, flow);
    return simulate(works, rec, step, t0, &flow);
  }
  for (std::size_t d = 0; d < plan.replicas.size(); ++d) {
    const auto& rep = plan.replicas[d];
    const auto plans = cp::planReplicaShards(rep, sharding, cfg_.cp, *cost_, cfg);  // as `wlb run` plans them
    for (std::size_t m = 0; m < rep.size(); ++m)
      works[d].push_back(microBatchWork(rep[m], plans[m], sharding, cfg_.cp, *cost_));
  }
  return simulate(works, rec, step, t0);
}

}  // namespace wlb::pp
