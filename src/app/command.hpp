#pragma once
/// \file command.hpp
/// \brief Subcommand registry of the thin `wlb` driver. Each cmd_*.cpp registers itself:
///
///   static const bool registered = wlb::app::registerCommand(
///       "plan", "Pack documents into micro-batches", [](CLI::App& sub) {
///         auto opts = std::make_shared<Opts>();
///         wlb::app::addDeckArgs(sub, opts->deck);
///         sub.add_option("--steps", opts->steps, "...");
///         return [opts]() -> int { ...; return 0; };
///       });
///
/// Runners throw wlb::InputError for bad input; main prints it and exits 2.

#include <CLI/CLI.hpp>

#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/deck.hpp"
#include "core/error.hpp"

namespace wlb::app {

using Runner = std::function<int()>;
using Setup = std::function<Runner(CLI::App& sub)>;

/// Register a subcommand (called from static initialisers).
bool registerCommand(const std::string& name, const std::string& description, Setup setup);

/// Deck arguments shared by every subcommand that takes a deck.
struct DeckArgs {
  std::string path;                    ///< positional DECK
  std::vector<std::string> overrides;  ///< --set table.key=value (repeatable)
  /// Load, validate, apply overrides, for a command that runs one case (`command` names it
  /// in the error a deck with a [sweep] gets). Throws InputError.
  Deck load(const std::string& command) const;
  /// The same, keeping the deck's [sweep] (wlb validate lists its cases).
  Deck loadWithSweep() const;
};

/// The files a deck makes a command read (data::deckInputFiles): the deck itself, its length
/// file or dataset, `train.dataset` and its hardware profile. No output of the command may be
/// one of them.
std::vector<std::string> deckInputs(const Deck& deck);

/// Runs `checks` (of the output paths rank 0 writes, say) on rank 0 and throws its
/// InputError on every rank, so that no rank goes on alone (or waits for one that left).
void checkOnRankZero(const std::function<void()>& checks);

/// Runs `read` (a command's input files: a length file, a checkpoint, a deck list) on every
/// rank and throws on every rank if it failed on any: where all failed, rank 0's message
/// for all; else each failing rank's own message and rank 0's count. A rank that read
/// another working directory's files must not fail alone (its message unprinted) or leave
/// the others waiting.
void onEveryRank(const std::function<void()>& read, const std::string& what = "the inputs");

/// onEveryRank for a read that returns what it read (a cost model, a length source).
template <class Read>
auto readOnEveryRank(Read read) -> decltype(read()) {
  std::optional<decltype(read())> got;
  onEveryRank([&] { got.emplace(read()); });
  return std::move(*got);
}

/// Add positional DECK (required unless `optional`) and repeatable --set.
void addDeckArgs(CLI::App& sub, DeckArgs& args, bool optional = false);

/// The largest step count an option takes: the deck's bound on run.steps and run.warmup
/// (so `--steps N` and `--set run.steps=N` accept the same values, and steps + warmup
/// cannot overflow).
constexpr long long kMaxStepsOption = 1'000'000'000'000LL;

/// Integer option validator: in [min, max], with a message that names the bound (CLI11's
/// PositiveNumber prints the largest double as its upper bound).
inline CLI::Validator intAtLeast(long long min, long long max = std::numeric_limits<long long>::max()) {
  return CLI::Validator(
      [min, max](std::string& s) -> std::string {
        const std::string range = max == std::numeric_limits<long long>::max()
                                      ? "at least " + std::to_string(min)
                                      : "in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
        std::size_t pos = 0;
        long long v = 0;
        try {
          v = std::stoll(s, &pos);
        } catch (const std::out_of_range&) {
          return "'" + s + "' is out of range (must be " + range + ")";
        } catch (...) {
          pos = 0;
        }
        if (pos == 0 || pos != s.size()) return "'" + s + "' is not an integer";
        if (v < min || v > max) return "must be " + range + " (got " + s + ")";
        return {};
      },
      max == std::numeric_limits<long long>::max()
          ? "INT>=" + std::to_string(min)
          : "INT in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
}

/// MPI rank and size of MPI_COMM_WORLD (MPI is initialised by main for every command).
int worldRank();
int worldSize();

}  // namespace wlb::app
