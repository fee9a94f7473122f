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
#include <memory>
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
  /// Load, validate, apply overrides. Throws InputError.
  Deck load() const;
};

/// Add positional DECK (required unless `optional`) and repeatable --set.
void addDeckArgs(CLI::App& sub, DeckArgs& args, bool optional = false);

/// MPI rank and size of MPI_COMM_WORLD (MPI is initialised by main for every command).
int worldRank();
int worldSize();

}  // namespace wlb::app
