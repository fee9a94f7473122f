#pragma once
/// \file calibration.hpp
/// \brief Fit a hardware profile's factors and links to what a measured run took
/// (`wlb calibrate`, docs/profile-format.md § Calibration). Pure code (no MPI, no HDF5): the
/// caller turns a trace into a MeasuredRun; the fit compares every measured op with what the
/// cost model predicts for the same work and moves each factor by the ratio of the sums.
///
/// Per factor key (Factors::keys()):
///   attn.{fwd,bwd}      `attn` events vs sum of CostModel::attnSeconds over the rank's
///                       pieces of that micro-batch (the trace's shard plans)
///   qkv_proj/out_proj/mlp.{fwd,bwd}
///                       the op's events of one layer, micro-batch and phase together (GEMMs
///                       with FLOPs, residual and norm without: the op as `wlb profile` times
///                       it) vs linearOpSeconds at the tokens their FLOPs stand for
///                       (flops / linearOpFlops(op, 1 token))
///   elementwise         per step and (tp, cp, dp) coordinate, summed over its pipeline
///                       stages: `embed` + `loss` + `recompute` events + the step's time
///                       outside every op event (pipeline waits are `pp_recv` events), vs
///                       layers x (elementwiseSeconds + recomputeSeconds where the run
///                       recomputed) of its micro-batches
/// new factor = old factor x (predicted seconds / measured seconds), so the fitted profile
/// predicts each op kind's measured total exactly (over the calibration traces), after
/// leaving out events stalled by interference (kOutlierRatio).
/// Rank speed: SpreadFit (below).
/// Links: `links.cp_gbps` from the KV exchange (and, with dp = 1, the gradient all-reduce),
/// `links.dp_gbps` from the gradient all-reduce with dp > 1: bytes over the fastest
/// member's duration per collective instance (the others also waited for peers).

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/cost_model.hpp"

namespace wlb::model {

/// One timed region of one rank, labelled like the trace (docs/trace-schema.md).
struct MeasuredEvent {
  std::string op;  ///< trace label: attn, qkv_proj, out_proj, mlp, embed, loss, kv_exchange, ...
  int phase = 0;   ///< 0 none, 1 fwd, 2 bwd (the trace's phase enum)
  int rank = 0;    ///< world rank
  int strategy = 0;
  std::int64_t step = -1;
  int micro_batch = -1, layer = -1;
  double seconds = 0, flops = 0, bytes = 0;
};

/// One CP rank's share of one micro-batch as planned: its tokens and attention pieces.
struct RankShare {
  struct Piece {
    std::int64_t q0 = 0, q = 0;  ///< queries [q0, q0+q) of a segment; keys from its start
  };
  std::int64_t tokens = 0;
  std::vector<Piece> pieces;
};

/// What a measured run executed (plans) and how long each op took (events).
struct MeasuredRun {
  std::string name;  ///< for messages (the trace file)
  ModelDims dims;
  std::int64_t tp = 1, cp = 1, dp = 1;
  /// CostModel::setLinearReferenceTokens of the run's deck (data.context_window / mesh.cp,
  /// as CostModel::fromDeck sets it); 0 = the cost model's default.
  double linear_ref_tokens = 0;
  std::vector<std::string> strategies;  ///< MeasuredEvent::strategy indexes it
  struct Coord {
    int tp = 0, cp = 0, dp = 0;
    int pp = 0;  ///< each stage reduces its own gradients: its all-reduce is another instance
  };
  std::vector<Coord> ranks;           ///< world rank -> mesh coordinates
  std::vector<MeasuredEvent> events;  ///< measured and drain steps (no warm-up)
  /// (strategy, step, dp, micro_batch) -> share of each CP rank
  std::map<std::tuple<int, std::int64_t, int, int>, std::vector<RankShare>> shares;
};

/// An event more than this many times slower (measured / predicted) than the median of its
/// factor key in its run is interference (another job, a stall), left out of the fit and
/// counted.
inline constexpr double kOutlierRatio = 3.0;

struct FactorFit {
  std::string key;
  double before = 1, after = 1;
  double measured_s = 0;   ///< sum over the matched events (outliers excluded)
  double predicted_s = 0;  ///< same events, profile before the fit
  std::size_t events = 0;
  std::size_t outliers = 0;  ///< events left out (kOutlierRatio)
  double outlier_s = 0;      ///< their measured seconds
  bool fitted = false;
  std::string note;  ///< why not fitted
};

struct LinkFit {
  std::string key;  ///< "links.cp_gbps" | "links.dp_gbps"
  double before = 0, after = 0;
  double bytes = 0, seconds = 0;
  std::size_t instances = 0;
  bool fitted = false;
  std::string note;
};

/// Rank-speed spread (HardwareProfile::rank_spread / step_spread / task_spread) from the
/// compute of each (rank, step, micro-batch, layer, phase): x = log(measured / predicted with
/// the fitted factors). `task` is the spread of x around its rank's mean in that step, less
/// the mean its micro-batch's tasks share in the replica (the work's own prediction error);
/// `step` that of a rank's step means around its run's mean, less the step's mean over the
/// ranks (load common to every rank) and less what the task noise adds to them; `rank` that
/// of the ranks' run means, less what both add. Pooled over the runs with more than one
/// rank.
struct SpreadFit {
  double before_rank = 0, before_step = 0, before_task = 0, rank = 0, step = 0, task = 0;
  std::size_t ranks = 0, tasks = 0;  ///< over the runs used
  bool fitted = false;
  std::string note;
};

/// Measured / predicted seconds of one factor key for one strategy of one run after the fit
/// (1 = the fitted profile predicts this strategy's op time exactly).
struct StrategyResidual {
  std::string strategy, key;
  double measured_s = 0, predicted_s = 0;
  std::size_t run = 0;  ///< index into the runs
};

struct CalibrationFit {
  std::vector<FactorFit> factors;  ///< one per Factors::keys()
  std::vector<LinkFit> links;
  SpreadFit spread;
  std::vector<StrategyResidual> residuals;
  std::size_t unmatched_events = 0;  ///< attention/linear events without plan or FLOPs
  /// `profile` with the fitted factors and links.
  HardwareProfile apply(const HardwareProfile& profile) const;
};

/// Fit `profile`'s factors and links to the runs. Throws InputError naming a run that has
/// no compute events, and std::invalid_argument on inconsistent input.
CalibrationFit fitProfile(const std::vector<MeasuredRun>& runs, const HardwareProfile& profile);

/// The profile JSON `profile_json` with the fit applied: `factors` and `links` rewritten,
/// `version` 2, a `calibration` history entry (traces by file name, time, each factor
/// before/after) appended and a line added to `sources`.
nlohmann::json applyToJson(const nlohmann::json& profile_json, const CalibrationFit& fit,
                           const std::vector<std::string>& trace_names, const std::string& created);

}  // namespace wlb::model
