/// \file simulate_deck.cpp
/// \brief The simulated strategy comparison (see simulate_deck.hpp).

#include "packing/simulate_deck.hpp"

#include <algorithm>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>

#include "core/error.hpp"

#include "cp/shard_plan.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"
#include "pp/simulator.hpp"
#include "trace/recorder.hpp"

namespace wlb::packing {

void checkPackerSchedule(const Deck& deck, const std::string& packer) {
  if (packer == "slimpack" && deck.pipeline.schedule != "packflow")
    throw InputError("pipeline.schedule = \"" + deck.pipeline.schedule +
                         "\" cannot run slimpack plans (slices whose backward runs last-in-first-out, backward "
                         "MicroPacks grouped apart from the forward ones): set pipeline.schedule = \"packflow\" "
                         "(docs/simulator.md)",
                     true);
}

void checkReplay(const Deck& deck, const RunPlans::Strategy& r, std::int64_t needed) {
  const auto& h = r.file.header;
  const auto fail = [&](std::int64_t line, const std::string& what) {
    throw InputError(fmt::format("{}:{}: {}", r.path, line, what), true);
  };
  if (h.dp != deck.mesh.dp)
    fail(1, fmt::format("the plans have dp = {} replicas; the deck's mesh.dp = {}", h.dp, deck.mesh.dp));
  if (h.packer != "slimpack" && h.micro_batches != data::microBatchesPerReplica(deck))
    fail(1, fmt::format("the plans have {} micro-batches per replica; the deck's packing.micro_batches gives {}",
                        h.micro_batches, data::microBatchesPerReplica(deck)));
  if (h.context_window != deck.data.context_window)
    fail(1, fmt::format("the plans' context_window = {}; the deck's data.context_window = {}", h.context_window,
                        deck.data.context_window));
  if (h.s_max != data::resolvedSMax(deck))
    fail(1, fmt::format("the plans' s_max = {}; the deck's data.s_max gives {}", h.s_max, data::resolvedSMax(deck)));
  if (const auto names = packerNames(); std::find(names.begin(), names.end(), h.packer) == names.end())
    fail(1, fmt::format("packer '{}' is none of this build's packers", h.packer));
  const auto& st = r.file.steps;
  for (std::size_t i = 0; i < st.size(); ++i)
    if (st[i].step != h.first_step + static_cast<std::int64_t>(i))
      fail(r.file.step_lines[i], fmt::format("step {} where step {} was expected (a run writes its steps in order)",
                                             st[i].step, h.first_step + static_cast<std::int64_t>(i)));
  if (static_cast<std::int64_t>(st.size()) < needed)
    throw InputError(fmt::format("{}: holds {} step(s), fewer than the {} warm-up and measured steps to simulate "
                                 "(--warmup / --steps, else the run's summary.json, else run.warmup / run.steps)",
                                 r.path, st.size(), needed),
                     true);
  try {
    (void)cp::parseStrategy(r.sharding.empty() ? deck.cp.strategy : r.sharding);
  } catch (const InputError& e) {
    fail(1, e.what());
  }
}

std::vector<SimStrategyResult> simulateDeck(const Deck& deck_in, const SimulateOptions& opt) {
  Deck deck = deck_in;
  std::vector<std::pair<std::string, std::string>> names = opt.strategies;
  if (names.empty())
    for (const auto& s : deck.run.strategies) names.push_back({s, s});
  std::vector<StrategyPair> pairs;
  const std::int64_t steps = opt.steps > 0 ? opt.steps : deck.run.steps;
  const std::int64_t warmup = opt.warmup >= 0 ? opt.warmup : std::max<std::int64_t>(0, deck.run.warmup);
  if (opt.replay.empty()) {
    deck.run.strategies.clear();
    for (const auto& n : names) deck.run.strategies.push_back(n.second);
    pairs = resolveStrategies(deck);
  } else {
    // Replay: the strategies are the files', each checked against the deck before anything runs.
    names.clear();
    for (const auto& r : opt.replay) {
      checkReplay(deck, r, warmup + steps);
      const std::string sharding = r.sharding.empty() ? deck.cp.strategy : r.sharding;
      pairs.push_back({r.strategy, r.file.header.packer, sharding});
      names.push_back({r.strategy, r.file.header.packer + "+" + sharding});
    }
  }
  for (const auto& pr : pairs) checkPackerSchedule(deck, pr.packer);

  const model::CostModel cost = model::CostModel::fromDeck(deck);
  pp::SimConfig sim_cfg = pp::SimConfig::fromDeck(deck, cost.hardware());
  if (opt.as_run) {
    // What `wlb run` executes (docs/runtime.md): the embedding and the fused loss are timed
    // through the deck-shaped profile's per-micro-batch part (fill_ns), not as an LM head
    // of its own; fp32 tensors on the wire and in memory, the executor's memory model. The
    // cost model, packers and shard planners are unchanged.
    sim_cfg.lm_head = false;
    sim_cfg.comm_element_bytes = 4;
    sim_cfg.executor_memory = true;
    sim_cfg.executor_storage_bytes = deck.run.precision == "bf16" ? 2 : 4;
    (void)pp::executorRecomputesSelective(deck.pipeline.recompute);  // "full" is not what runs
  }
  if (opt.mean_speed) sim_cfg.rank_spread = sim_cfg.step_spread = sim_cfg.task_spread = 0;
  const pp::StepSimulator sim(sim_cfg, cost);
  trace::Recorder* rec = opt.recorder;

  std::vector<SimStrategyResult> rows;
  for (std::size_t si = 0; si < pairs.size(); ++si) {
    const auto& pr = pairs[si];
    const std::string& name = si < names.size() ? names[si].first : pr.name;
    const RunPlans::Strategy* replay = opt.replay.empty() ? nullptr : &opt.replay[si];
    std::unique_ptr<data::LengthSource> src;
    std::unique_ptr<Packer> packer;
    if (!replay) {
      src = data::makeLengthSource(deck);
      packer = makePacker(pr.packer, deck, cost);
    }
    if (rec) rec->setStrategy(name);
    SimStrategyResult row;
    row.strategy = name;
    row.packer = pr.packer;
    row.sharding = pr.sharding;
    row.peak_gb.assign(static_cast<std::size_t>(deck.mesh.pp), 0.0);
    row.peak_act_bytes.assign(static_cast<std::size_t>(deck.mesh.pp), 0.0);
    double t = 0;
    std::vector<model::StepWork> work;  // measured steps, then drain steps
    // Measured steps, then drain steps (no new documents) until the packer holds
    // nothing: every strategy trains the whole stream of the window (throughput.hpp).
    model::DrainWatch drain_watch;
    for (std::int64_t step = 0;; ++step) {
      const bool drain = step >= warmup + steps;
      StepPlan plan;
      pp::StepResult r;
      std::int64_t incoming = 0;
      if (replay) {
        // the run's steps, its drain included: they end where the file does
        const auto& pf = replay->file;
        if (step >= static_cast<std::int64_t>(pf.steps.size())) break;
        const auto i = static_cast<std::size_t>(step);
        plan = pf.steps[i];
        incoming = i < pf.incoming.size() ? pf.incoming[i] : 0;
        try {
          r = sim.simulatePlan(plan, pr.sharding, deck.cp, rec, static_cast<int>(step), t);
        } catch (const InputError& e) {
          throw InputError(fmt::format("{}:{}: {}", replay->path, pf.step_lines[i], e.what()), true);
        }
      } else {
        if (drain && packer->pendingTokens() == 0) break;
        if (drain && drain_watch.stalled(packer->pendingTokens()))
          throw std::logic_error(
              fmt::format("wlb simulate: {} still holds {} tokens after {} drain steps without "
                          "progress",
                          pr.packer, packer->pendingTokens(), model::kMaxDrainSteps));
        const auto docs = drain ? std::vector<Document>{} : src->next(step);
        incoming = static_cast<std::int64_t>(docs.size());
        plan = packer->pack(step, docs);
        r = sim.simulatePlan(plan, pr.sharding, deck.cp, rec, static_cast<int>(step), t);
      }
      if (opt.on_plan) opt.on_plan(name, plan, incoming);
      t += r.step_seconds;
      for (std::size_t s = 0; s < r.peak_bytes.size(); ++s)
        row.peak_gb[s] = std::max(row.peak_gb[s], r.peak_bytes[s] / 1e9);
      for (std::size_t s = 0; s < r.peak_activation_bytes.size(); ++s)
        row.peak_act_bytes[s] = std::max(row.peak_act_bytes[s], r.peak_activation_bytes[s]);
      row.fits = row.fits && r.fits_memory;
      if (!plan.memory.partition.empty()) ++row.partitions[plan.memory.partition];
      row.held += static_cast<std::int64_t>(plan.memory.held.size());
      row.merged += static_cast<std::int64_t>(plan.merged.size());
      if (!drain && opt.on_step) opt.on_step(name);
      if (step < warmup) continue;
      double tokens = 0;
      for (const auto& rep : plan.replicas)
        for (const auto& mb : rep) tokens += static_cast<double>(mb.tokens());
      work.push_back({r.step_seconds, tokens, model::usefulFlops(plan, cost, deck.model.layers)});
      if (drain) {
        ++row.drain_steps;
        continue;
      }
      ++row.steps;
      row.step_s += r.step_seconds;
      row.bubble += r.bubble_fraction;
      row.idle += r.idle_fraction;
      row.grad_s += r.grad_sync_seconds;
    }
    const double n = static_cast<double>(std::max<std::int64_t>(row.steps, 1));
    row.work = model::foldDrain(std::move(work), static_cast<std::size_t>(row.drain_steps));
    const auto tot = model::total(row.work);
    row.tokens = tot.tokens;
    row.tokens_per_s = tot.tokensPerSecond();
    row.flops_per_s = tot.flopsPerSecond();
    row.step_s /= n;
    row.bubble /= n;
    row.idle /= n;
    row.grad_s /= n;
    rows.push_back(std::move(row));
  }
  // Throughput speedup against plain (or the first strategy listed), with its 95%
  // bootstrap interval over steps; the step-time ratio is kept as a secondary column.
  std::size_t bi = 0;
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (rows[i].strategy == "plain") bi = i;
  for (auto& r : rows) {
    const auto sp = model::throughputSpeedup(rows[bi].work, r.work);
    r.speedup = sp.value;
    r.speedup_lo = sp.lo;
    r.speedup_hi = sp.hi;
    r.step_ratio = r.step_s > 0 ? rows[bi].step_s / r.step_s : 0;
    r.baseline = rows[bi].strategy;
  }
  return rows;
}

}  // namespace wlb::packing
