#pragma once
/// \file validate_sim.hpp
/// \brief The simulator's validation loop on the machine at hand, behind `wlb validate-sim`
/// (docs/simulator.md § Validating on this machine): deck-shaped profile -> measured
/// calibration runs -> calibrate -> measured validation runs on other documents (data.seed
/// + offset) -> `wlb simulate --as-run` of the same decks and documents -> per strategy
/// measured vs predicted throughput, error and ordering.
///
/// Every stage is a `wlb` command run as a child process (through the launcher where it
/// needs the deck's ranks), printed before it runs and logged under OUT/logs; the report
/// goes to OUT/validation.json. The caller must be a single process.

#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/output_file.hpp"

namespace wlb::profile {

/// Exit code of `wlb validate-sim` when the comparison misses the tolerance or the
/// ordering (2 stays bad input).
constexpr int kValidateSimMissed = 3;

/// What to validate and how. Messages name the `wlb validate-sim` options these fields stand for.
struct ValidateSimOptions {
  std::vector<std::string> decks;      ///< decks to run and simulate (two or more strategies)
  std::vector<std::string> overrides;  ///< table.key=value for every deck, passed to every stage
  /// Calibrate one profile on these decks only (name, path or file name) and use it for
  /// every deck; empty: each deck is calibrated on its own run.
  std::vector<std::string> calibrate_on;
  std::string out = "wlb-out/validate-sim";  ///< profiles, traces, logs and validation.json
  std::string profile;                       ///< start from this profile instead of measuring one
  std::string mpirun = "mpirun";             ///< launcher of the measured runs (words split on spaces)
  std::string wlb;                           ///< the `wlb` the stages run; empty: this process's executable
  double tolerance = 5.0;                    ///< largest |error| on throughput per strategy, percent
  std::int64_t steps = -1, warmup = -1;      ///< per run and simulation; -1: the deck's run.steps / run.warmup
  std::int64_t seed_offset = 1;              ///< validation runs use data.seed + this (0: circular)
  int rounds = 3;                            ///< measured runs per deck and purpose; the fastest is kept
  bool quick = false;                        ///< quick profile (small grids, few repetitions: tests)
  bool no_calibrate = false;                 ///< validate the profile as measured
  /// Leave glibc malloc at its defaults in every stage; by default large buffers stay on
  /// the heap (docs/simulator.md), unless the caller set GLIBC_TUNABLES.
  bool malloc_default = false;
  std::FILE* log = stdout;  ///< each stage's command and outcome as it runs
  TemporaryTracker track_temporary;  ///< the driver's hook for temporaries (core/output_file.hpp)
  ChildTracker track_child;          ///< and for the stages' processes
};

// NOLINTNEXTLINE(bugprone-exception-escape): flagged for its nlohmann::json member, whose moves do not throw
struct ValidateSimResult {
  bool pass = false;                 ///< every |error| within tolerance, every ordering the same up to ties
  double max_abs_error_percent = 0;  ///< over every deck and strategy
  std::string table;                 ///< per strategy measured vs predicted, orderings, verdict (printable)
  nlohmann::json report;             ///< what OUT/validation.json holds
  std::string out;                   ///< the output directory, absolute
};

/// A stage's command failed; its log's last lines went to `log`.
class StageFailed : public std::runtime_error {
 public:
  StageFailed(const std::string& what, int exit_code) : std::runtime_error(what), exit_code_(exit_code) {}
  /// 2 when the stage reported bad input, else 1.
  int exitCode() const { return exit_code_; }

 private:
  int exit_code_;
};

/// Run the loop. Bad options or decks -> wlb::InputError before anything runs or OUT is
/// made; a failed stage -> StageFailed (the outputs so far stay in OUT).
ValidateSimResult validateSim(const ValidateSimOptions& o);

}  // namespace wlb::profile
