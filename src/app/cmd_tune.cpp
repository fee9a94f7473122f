// `wlb tune DECK`: sweep wlb outlier thresholds on a sample of the stream, print imbalance
// vs mean per-token delay, pick the most balanced setting under packing.delay_budget.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "core/output_file.hpp"
#include "core/progress.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"
#include "packing/runner.hpp"

namespace {

struct Opts {
  wlb::app::DeckArgs deck;
  std::int64_t sample_steps = 100;
  int max_levels = 3;
  std::string json;
};

std::string fmtList(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

int runTune(const Opts& o) {
  using namespace wlb;
  const bool root = app::worldRank() == 0;
  if (o.sample_steps < 1) throw InputError("--sample-steps: must be >= 1", true);
  if (o.max_levels < 0 || o.max_levels > 4) throw InputError("--max-levels: must be in 0..4", true);
  const Deck deck = o.deck.load("wlb tune");
  app::checkOnRankZero([&] {
    if (!o.json.empty()) checkOutputPath(o.json, "--json", app::deckInputs(deck));
  });
  // the profile and the length file are read on every rank: one that cannot must not fail alone
  const model::CostModel cost = app::readOnEveryRank([&] {
    (void)data::makeLengthSource(deck);
    return model::CostModel::fromDeck(deck);
  });
  const auto base = packing::PackerOptions::fromDeck(deck);
  const std::int64_t S = base.context_window;
  // Candidate levels: multiples of S/8 up to 7S/8, every subset of up to max_levels of them,
  // plus the deck's own levels (the defaults where it sets none), and "no queues" as a
  // reference row: a deck cannot ask for it ([] means the defaults), so it is never advised.
  std::vector<std::int64_t> grid;
  for (int k = 1; k <= 7; ++k) grid.push_back(S * k / 8);
  const std::vector<std::int64_t> no_queues;
  std::vector<std::vector<std::int64_t>> cands = {no_queues};
  const int G = static_cast<int>(grid.size());
  for (int mask = 1; mask < (1 << G); ++mask) {
    if (__builtin_popcount(static_cast<unsigned>(mask)) > o.max_levels) continue;
    std::vector<std::int64_t> c;
    for (int i = 0; i < G; ++i)
      if (mask & (1 << i)) c.push_back(grid[static_cast<std::size_t>(i)]);
    cands.push_back(c);
  }
  if (std::find(cands.begin(), cands.end(), base.outlier_thresholds) == cands.end())
    cands.push_back(base.outlier_thresholds);
  const auto label = [&](const std::vector<std::int64_t>& th) -> std::string {
    if (th == no_queues) return "no queues (reference)";
    auto s = fmtList(th);
    if (th == base.outlier_thresholds) return s + (deck.packing.outlier_thresholds.empty() ? " (defaults)" : " (deck)");
    return s;
  };
  struct Row {
    std::vector<std::int64_t> th;
    packing::RunSummary s;
  };
  std::vector<Row> rows;
  Progress progress("wlb tune", static_cast<std::int64_t>(cands.size()), "candidates", root);
  for (const auto& th : cands) {
    progress.update(static_cast<std::int64_t>(rows.size()), fmtList(th));
    auto opt = base;
    opt.outlier_thresholds = th;
    auto src = data::makeLengthSource(deck);
    auto p = packing::makePacker("wlb", opt, cost);
    packing::RunOptions ro;
    ro.steps = o.sample_steps;
    rows.push_back({th, packing::runPacker(*src, *p, cost, ro).summary});
  }
  std::sort(rows.begin(), rows.end(),
            [](const Row& a, const Row& b) { return a.s.imbalance_mean < b.s.imbalance_mean; });
  const double budget = deck.packing.delay_budget;
  const Row* best = nullptr;
  for (const auto& r : rows)
    if (r.th != no_queues && r.s.delay_mean <= budget) {
      best = &r;
      break;
    }
  if (root) {
    std::cout << fmt::format("wlb tune: {} candidates x {} sample steps, S={}, s_max={}, N={}, delay budget {} steps\n",
                             rows.size(), o.sample_steps, S, base.s_max, base.N(), budget);
    std::cout << fmt::format("{:<40} {:>10} {:>10} {:>11} {:>10}  {}\n", "thresholds", "imbalance", "imb.max",
                             "delay.mean", "delay.max", "");
    const std::size_t show = std::min<std::size_t>(rows.size(), 25);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      if (i >= show && &r != best && r.th != no_queues && r.th != base.outlier_thresholds) continue;
      std::cout << fmt::format("{:<40} {:>10.4f} {:>10.4f} {:>11.3f} {:>10.0f}  {}\n", label(r.th), r.s.imbalance_mean,
                               r.s.imbalance_max, r.s.delay_mean, r.s.delay_max,
                               &r == best                ? "<- best under budget"
                               : r.s.delay_mean > budget ? "over budget"
                               : r.th == no_queues       ? "no deck sets it"
                                                         : "");
    }
    if (rows.size() > show) std::cout << fmt::format("... {} more candidates (see --json)\n", rows.size() - show);
    if (best)
      std::cout << fmt::format("best: --set 'packing.outlier_thresholds={}'  (imbalance {:.4f}, mean delay {:.3f})\n",
                               fmtList(best->th), best->s.imbalance_mean, best->s.delay_mean);
    else
      std::cout << "no candidate meets the delay budget\n";
    if (!o.json.empty()) {
      nlohmann::json j = nlohmann::json::array();
      for (const auto& r : rows)
        j.push_back({{"thresholds", r.th},
                     {"label", label(r.th)},
                     {"no_queues", r.th == no_queues},
                     {"summary", r.s.toJson()},
                     {"best", &r == best}});
      app::writeAtomically(o.json, "--json", j.dump(2) + "\n");
    }
  }
  return best ? 0 : 1;
}

const bool registered = wlb::app::registerCommand(
    "tune", "Sweep wlb outlier thresholds: imbalance vs per-token delay, best under the delay budget",
    [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, o->deck);
      sub.add_option("--sample-steps", o->sample_steps, "Steps of the stream to evaluate each candidate on");
      sub.add_option("--max-levels", o->max_levels, "Most outlier levels per candidate (0..4)");
      sub.add_option("--json", o->json, "Write every candidate's summary as JSON");
      return [o]() { return runTune(*o); };
    });

}  // namespace
