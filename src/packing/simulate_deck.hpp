#pragma once
/// \file simulate_deck.hpp
/// \brief `wlb simulate`'s strategy loop as a library call, beside runtime::runDeck: for
/// each strategy, the deck's length stream -> packer -> CP plans -> DAG simulator, for the
/// warm-up and measured steps and then drain steps (no new documents) until the packer
/// holds nothing, and the throughput comparison over that window (model/throughput.hpp).
/// Pure: no MPI, no HDF5 (a trace is recorded into a Recorder the caller writes).

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/deck.hpp"
#include "core/types.hpp"
#include "model/throughput.hpp"
#include "packing/plan_io.hpp"

namespace wlb::trace {
class Recorder;
}

namespace wlb::packing {

struct SimulateOptions {
  /// (display name, strategy spec) pairs, in order; the first named "plain" (else the
  /// first) is the speedup baseline. Empty: the deck's run.strategies.
  std::vector<std::pair<std::string, std::string>> strategies;
  std::int64_t steps = -1, warmup = -1;  ///< < 0: the deck's run.steps / run.warmup
  /// What `wlb run` executes: transformer layers only, fp32 on the wire and in memory.
  bool as_run = false;
  /// Every rank at the profile's mean speed: the profile's rank_speed spreads left out.
  bool mean_speed = false;
  trace::Recorder* recorder = nullptr;  ///< predicted events of every rank, if given
  /// Called with each planned step and the number of documents that arrived for it (e.g.
  /// to add it to a trace file).
  std::function<void(const std::string& strategy, const StepPlan& plan, std::int64_t incoming)> on_plan;
  /// Called after each warm-up or measured step (progress).
  std::function<void(const std::string& strategy)> on_step;
  /// Replay (`wlb simulate --plans`): simulate exactly these plans, one entry per strategy,
  /// instead of planning the deck's length stream. Each file's steps are the warm-up, the
  /// measured steps and then drain steps, as `wlb run` wrote them; its sharding (else the
  /// deck's cp.strategy) shards them. `strategies` is ignored when this is set.
  std::vector<RunPlans::Strategy> replay;
};

/// One strategy's predicted comparison numbers (the `wlb simulate` table row).
struct SimStrategyResult {
  std::string strategy, packer, sharding, baseline;
  std::int64_t steps = 0, drain_steps = 0;
  double step_s = 0, bubble = 0, idle = 0, grad_s = 0;   ///< means over the measured steps
  double tokens = 0, tokens_per_s = 0, flops_per_s = 0;  ///< over measured + drain steps
  double speedup = 1, speedup_lo = 1, speedup_hi = 1;    ///< tokens/s vs the baseline, 95% interval
  double step_ratio = 1;                                 ///< baseline step_s / step_s (secondary)
  std::vector<model::StepWork> work;                     ///< per measured step, drain folded into the last
  std::vector<double> peak_gb;                           ///< [pp] static + activations, max over steps
  std::vector<double> peak_act_bytes;                    ///< [pp] activations alone
  bool fits = true;
  /// slimpack: steps per memory partition (StepPlan::MemoryFit, "flops", "sample_ends",
  /// "whole_samples", "over"), the samples held back to fit, and DP-Merge units.
  std::map<std::string, std::int64_t> partitions;
  std::int64_t held = 0, merged = 0;
};

/// A packer's plans need the deck's pipeline schedule to run them: `slimpack` plans hold
/// slices and need `pipeline.schedule = "packflow"` (InputError naming the key otherwise).
/// PackFlow takes every other packer's plans (it is then 1F1B's order).
void checkPackerSchedule(const Deck& deck, const std::string& packer);

/// A replayed plan file must be the deck's: its replicas, micro-batches per replica and
/// window, its steps numbered in order, at least `needed` (warm-up + measured) steps, a
/// known sharding. InputError naming the file and line otherwise.
void checkReplay(const Deck& deck, const RunPlans::Strategy& plans, std::int64_t needed);

/// Simulate every strategy of `deck`. InputError for bad decks, strategies or schedules, and
/// for replayed plans that do not fit the deck (naming the file and line).
std::vector<SimStrategyResult> simulateDeck(const Deck& deck, const SimulateOptions& opt = {});

}  // namespace wlb::packing
