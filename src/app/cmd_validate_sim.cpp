// `wlb validate-sim DECK...`: the simulator's validation loop on the machine at hand
// (docs/simulator.md § Validating on this machine): profile -> measured calibration runs ->
// calibrate -> measured validation runs on other documents -> `wlb simulate --as-run` ->
// per strategy measured vs predicted throughput, error and ordering. The loop is
// profile/validate_sim.hpp; exit 3 when an error exceeds the tolerance or an ordering differs.
#include <cstdio>
#include <memory>
#include <string>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "profile/validate_sim.hpp"

namespace {

int run(wlb::profile::ValidateSimOptions o) {
  if (wlb::app::worldSize() > 1)
    throw wlb::InputError("wlb validate-sim runs as one process (it starts `mpirun` for the measured runs itself)",
                          true);
  o.track_temporary = wlb::app::trackTemporary;
  o.track_child = wlb::app::trackChild;
  try {
    const auto r = wlb::profile::validateSim(o);
    std::fputs(r.table.c_str(), stdout);
    std::fflush(stdout);
    return r.pass ? 0 : wlb::profile::kValidateSimMissed;
  } catch (const wlb::profile::StageFailed& f) {
    std::fprintf(stderr, "wlb validate-sim: %s\n", f.what());
    return f.exitCode();
  }
}

const bool registered = wlb::app::registerCommand(
    "validate-sim",
    "Validate the simulator on this machine: profile -> measured runs -> calibrate -> simulate -> error per strategy",
    [](CLI::App& sub) {
      auto o = std::make_shared<wlb::profile::ValidateSimOptions>();
      sub.add_option("decks", o->decks, "Decks to run and simulate (each runs on tp*cp*pp*dp ranks)")
          ->required();
      sub.add_option("--set", o->overrides, "Override a key of every deck: table.key=value (repeatable)")
          ->type_name("TABLE.KEY=VALUE");
      sub.add_option("--out", o->out, "Directory for the profiles, traces, logs and validation.json")->type_name("DIR");
      sub.add_option("--tolerance", o->tolerance, "Largest |error| on throughput per strategy, percent");
      sub.add_option("--steps", o->steps, "Measured steps per run and simulation (default: run.steps)");
      sub.add_option("--warmup", o->warmup, "Warm-up steps (default: run.warmup)");
      sub.add_option("--profile", o->profile, "Start from this profile instead of measuring one (`wlb profile --deck`)")
          ->type_name("FILE");
      sub.add_flag("--quick", o->quick, "Quick profile (small grids, few repetitions: tests)");
      sub.add_option("--calibrate-on", o->calibrate_on,
                     "Calibrate on these decks only (name or file; repeatable); default: every deck")
          ->type_name("DECK");
      sub.add_flag("--no-calibrate", o->no_calibrate, "Skip the calibration runs: validate the profile as measured");
      sub.add_flag("--malloc-default", o->malloc_default,
                   "Leave glibc malloc at its defaults in every stage (default: large buffers kept on the heap, "
                   "docs/simulator.md)");
      sub.add_option("--seed-offset", o->seed_offset,
                     "Validation runs use data.seed + this (0 = the calibration's own documents: circular)");
      sub.add_option("--rounds", o->rounds,
                     "Measured runs per deck and purpose; the fastest is kept (the spread is printed)");
      sub.add_option("--mpirun", o->mpirun, "Launcher for the measured runs (words split on spaces)");
      return [o]() -> int { return run(*o); };
    });

}  // namespace
