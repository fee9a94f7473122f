// `wlb validate DECK`: full validation — the deck, and every file it names (length file or
// dataset index, hardware profile) opened and read — so that a batch submission fails
// before it is queued; prints the resolved deck; writes nothing.
#include <iostream>

#include "app/command.hpp"
#include "core/deck_schema.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"
#include "packing/simulate_deck.hpp"

namespace {
struct Opts {
  wlb::app::DeckArgs deck;
  bool reference = false;
  bool cases = false;
};

const bool registered = wlb::app::registerCommand(
    "validate", "Validate a deck and print it fully resolved (writes nothing)", [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, o->deck, /*optional=*/true);
      sub.add_flag("--reference", o->reference, "Print the reference of every deck key (Markdown) and exit");
      sub.add_flag("--cases", o->cases, "Also print every case of the deck's [sweep]");
      return [o]() -> int {
        // the files the deck names, read as the commands read them (InputError naming the
        // file and line / byte offset / key), and the strategies as run / train take them
        // (a slimpack plan needs the packflow schedule)
        auto checkFiles = [](const wlb::Deck& d) {
          for (const auto& c : wlb::expandSweep(d)) {
            (void)wlb::data::makeLengthSource(c);
            (void)wlb::model::HardwareProfile::fromDeck(c);
            wlb::packing::checkPackerSchedule(c, c.packing.strategy);  // wlb train's packer
            for (const auto& s : wlb::resolveStrategies(c)) wlb::packing::checkPackerSchedule(c, s.packer);
          }
        };
        if (o->reference) {
          if (wlb::app::worldRank() == 0) std::cout << wlb::deckReferenceMarkdown();
          return 0;
        }
        if (o->deck.path.empty()) throw wlb::InputError("validate: a DECK argument is required", true);
        const wlb::Deck deck = o->deck.loadWithSweep();  // every rank: the same validation and exit code
        // every rank reads them: rank 0's "valid" only when they all could
        wlb::app::onEveryRank([&] { checkFiles(deck); });
        if (wlb::app::worldRank() != 0) return 0;
        std::cout << "# " << deck.source_path << ": valid\n" << deck.toToml();
        // Keys whose 0 or [] stands for a value derived from others, as the packers use them
        // (comments: the text above stays the deck as written).
        if (!deck.sweep.empty()) {
          // the base deck is no case: its values may break a rule every case's values replace
          std::cout << "\n# derived (the values the packers use): per [sweep] case; pin the swept keys with --set "
                       "to see one case's\n";
        } else {
          const auto po = wlb::packing::PackerOptions::fromDeck(deck);
          std::string levels;
          for (const auto l : po.outlier_thresholds) levels += (levels.empty() ? "" : ", ") + std::to_string(l);
          std::cout << "\n# derived (the values the packers use):\n"
                    << "#   data.s_max = " << po.s_max << "\n"
                    << "#   packing.micro_batches = " << po.micro_batches << " per replica\n"
                    << "#   packing.outlier_thresholds = [" << levels << "]\n"
                    << "#   packing.max_queue_wait = " << po.max_queue_wait << "\n";
        }
        if (o->cases) {
          const auto cases = wlb::expandSweep(deck);
          std::cout << "\n# " << cases.size() << " sweep case(s)\n";
          // the case's folder, then its overrides as --set takes them (run/slurm/sweep reads them)
          for (const auto& c : cases) {
            std::cout << "#   " << c.output.dir;
            for (const auto& s : c.sweep_case) std::cout << '\t' << s;
            std::cout << '\n';
          }
        }
        return 0;
      };
    });
}  // namespace
