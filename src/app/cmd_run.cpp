// `wlb run DECK`: execute the deck's strategies for real on the MPI job (TP x CP x PP x
// DP, pipeline stages walking the deck's schedule) with Kokkos kernels and report
// measured throughput, step time, bubbles and imbalance (docs/runtime.md). The world size
// must equal tp*cp*pp*dp.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "app/command.hpp"
#include "core/error.hpp"
#include "runtime/run.hpp"

namespace {
struct Opts {
  wlb::app::DeckArgs deck;
  long long steps = -1, warmup = -1;
  bool quiet = false, no_output = false;
};

const bool registered = wlb::app::registerCommand(
    "run", "Execute the deck's strategies on this MPI job with real kernels and report measured step times",
    [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, o->deck);
      sub.add_option("--steps", o->steps, "Measured steps per strategy (default: run.steps)")
          ->check(wlb::app::intAtLeast(1));
      sub.add_option("--warmup", o->warmup, "Warm-up steps before them, not measured (default: run.warmup)")
          ->check(wlb::app::intAtLeast(0));
      sub.add_flag("--quiet", o->quiet, "No per-step progress lines");
      sub.add_flag("--no-output", o->no_output, "Do not write the trace and plan files");
      return [o]() -> int {
        // Every rank reads the same deck: a bad deck fails identically everywhere.
        wlb::Deck deck;
        try {
          deck = o->deck.load();
        } catch (const wlb::InputError& e) {
          throw wlb::InputError(e.what(), /*collective=*/true);
        }
        wlb::runtime::RunOptions ro;
        ro.steps = o->steps;
        ro.warmup = o->warmup;
        ro.progress = !o->quiet;
        ro.write_outputs = !o->no_output;
        ro.command = "wlb run " + o->deck.path;
        for (const auto& s : o->deck.overrides) ro.command += " --set " + s;
        if (o->steps >= 0) ro.command += " --steps " + std::to_string(o->steps);
        if (o->warmup >= 0) ro.command += " --warmup " + std::to_string(o->warmup);
        // Failure-handling tests: WLB_INJECT_FAILURE=RANK:STEP makes that rank throw mid-step.
        if (const char* f = std::getenv("WLB_INJECT_FAILURE")) {
          long long step = -1;
          if (std::sscanf(f, "%d:%lld", &ro.fail_rank, &step) != 2)
            throw wlb::InputError("WLB_INJECT_FAILURE must be RANK:STEP, got '" + std::string(f) + "'", true);
          ro.fail_step = step;
        }
        const auto report = wlb::runtime::runDeck(deck, ro);
        if (wlb::app::worldRank() == 0) {
          std::fputs(wlb::runtime::formatReport(report).c_str(), stdout);
          std::fflush(stdout);
        }
        return 0;
      };
    });
}  // namespace
