// `wlb data stats [DECK]`: length statistics of a deck's source or of every preset.
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "app/command.hpp"
#include "core/error.hpp"
#include "data/length_source.hpp"

namespace {

struct Opts {
  wlb::app::DeckArgs deck;
  std::string preset;
  bool all = false;
  std::int64_t steps = 100;
  std::int64_t window = 0;
};

void printStats(const std::string& title, const wlb::data::LengthStats& s, std::int64_t S) {
  std::cout << fmt::format("== {}\n", title);
  std::cout << fmt::format("documents {}  tokens {}  mean {:.1f}  min {}  max {}\n", s.count, s.total_tokens, s.mean,
                           s.min, s.max);
  std::string pc;
  for (const auto& [p, v] : s.percentiles) pc += fmt::format("  p{:g}={}", p, v);
  std::cout << "percentiles:" << pc << "\n";
  std::cout << fmt::format("{:>22} {:>10} {:>8} {:>8}\n", "length bucket", "docs", "doc%", "token%");
  for (const auto& b : s.buckets) {
    if (b.count == 0 && b.lo > S) continue;
    const std::string range = b.lo > S
                                  ? fmt::format("> {}", S)
                                  : fmt::format("[{}, {}{}", b.lo, b.hi - 1 == S ? S : b.hi, b.hi - 1 == S ? "]" : ")");
    std::cout << fmt::format("{:>22} {:>10} {:>7.2f}% {:>7.2f}%\n", range, b.count,
                             s.count ? 100.0 * b.count / s.count : 0.0,
                             s.total_tokens ? 100.0 * b.tokens / s.total_tokens : 0.0);
  }
}

int runStats(const Opts& o) {
  using namespace wlb;
  Deck deck;
  if (!o.deck.path.empty()) deck = o.deck.load();
  if (o.window > 0) deck.data.context_window = o.window;
  if (o.steps < 1) throw InputError("--steps: must be >= 1", true);
  std::vector<std::string> presets;
  if (o.all)
    presets = data::presetNames();
  else if (!o.preset.empty())
    presets = {o.preset};
  const bool root = app::worldRank() == 0;
  auto statsOf = [&](const Deck& d) {
    auto src = data::makeLengthSource(d);
    std::vector<std::int64_t> lens;
    const std::int64_t epoch = src->documentsPerEpoch();
    for (std::int64_t t = 0; epoch > 0 ? static_cast<std::int64_t>(lens.size()) < epoch : t < o.steps; ++t)
      for (const auto& doc : src->next(t)) {
        if (epoch > 0 && static_cast<std::int64_t>(lens.size()) >= epoch) break;
        lens.push_back(doc.length);
      }
    return std::make_pair(src->describe(), data::computeLengthStats(lens, d.data.context_window));
  };
  if (presets.empty()) {
    auto [desc, st] = statsOf(deck);
    if (root)
      printStats(fmt::format("{} (S={}{})", desc, deck.data.context_window,
                             deck.data.source == "generator" ? fmt::format(", {} steps", o.steps) : ", one epoch"),
                 st, deck.data.context_window);
    return 0;
  }
  for (const auto& p : presets) {
    Deck d = deck;
    d.data.source = "generator";
    d.data.preset = p;
    const auto& spec = data::presetByName(p);
    auto [desc, st] = statsOf(d);
    if (root) {
      printStats(fmt::format("{} (S={}, {} steps)", desc, d.data.context_window, o.steps), st, d.data.context_window);
      std::cout << "fitted to: " << spec.sources << "\n\n";
    }
  }
  return 0;
}

const bool registered =
    wlb::app::registerCommand("data", "Document-length sources: `wlb data stats [DECK]`", [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      sub.require_subcommand(1);
      CLI::App* stats = sub.add_subcommand("stats", "Count, mean, percentiles and token share by length bucket");
      wlb::app::addDeckArgs(*stats, o->deck, /*optional=*/true);
      stats->add_option("--preset", o->preset, "Generator preset (overrides the deck's source)");
      stats->add_flag("--all-presets", o->all, "Every generator preset");
      stats->add_option("--steps", o->steps, "Steps (global batches) to sample from a generator")
          ->check(wlb::app::intAtLeast(1));
      stats->add_option("--window", o->window, "Context window S (overrides data.context_window)");
      return [o]() { return runStats(*o); };
    });

}  // namespace
