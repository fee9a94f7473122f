// The `wlb` driver: initialise MPI and Kokkos, dispatch to a registered subcommand,
// map bad input to exit code 2 on every rank without hanging.
#include <mpi.h>

#include <fmt/format.h>
#include <Kokkos_Core.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "core/heap.hpp"
#include "core/version_info.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "model/deck_inputs.hpp"
#include "parallel/comm.hpp"
#include "parallel/group_comm.hpp"
#include "runtime/gemm.hpp"

namespace wlb::app {
namespace {
struct Entry {
  std::string description;
  Setup setup;
};
std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}

// `wlb --version`: core's provenance strings plus the backends the runtime was built with.
std::string versionReport() {
  return "wlb " + versionString() + " (git " + gitHash() + ")\n" + "  Kokkos " + kokkosVersion() + ", backend " +
         kokkosBackend() + "\n" + "  MPI    " + mpiVersion() + "\n" + "  HDF5   " + hdf5Version() + "\n" + "  GEMM   " +
         runtime::gemmBackend() + "\n" + "  NCCL   " + (parallel::ncclAvailable() ? "yes" : "no") + "\n";
}
}  // namespace

bool registerCommand(const std::string& name, const std::string& description, Setup setup) {
  registry()[name] = Entry{description, std::move(setup)};
  return true;
}

void onEveryRank(const std::function<void()>& read, const std::string& what) {
  const int size = worldSize();
  if (size == 1) return read();
  std::string err;
  try {
    read();
  } catch (const InputError& e) {
    err = e.what();
  }
  const int bad = err.empty() ? 0 : 1;
  int nbad = 0;
  MPI_Allreduce(&bad, &nbad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (nbad == size) throw InputError(err, /*collective=*/true);  // rank 0's message stands for all
  if (nbad > 0) {
    if (bad) throw InputError(err);  // printed with this rank's number
    throw InputError(fmt::format("{} could not be read on {} of {} ranks (their messages name them)", what, nbad, size),
                     true);
  }
}

namespace {
std::vector<std::string>& commandLine() {
  static std::vector<std::string> args;
  return args;
}

/// The first rank whose `text` differs from rank 0's (size when none does).
int firstDiffering(const std::string& text) {
  const int size = worldSize();
  unsigned long long mine = std::hash<std::string>{}(text), first = mine;
  MPI_Bcast(&first, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  const int differs = mine != first ? worldRank() : size;
  int lowest = size;
  MPI_Allreduce(&differs, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return lowest;
}

/// The deck `load` reads on this rank, once every rank has read one and they agree: a rank
/// that cannot read it (a node-local path, another working directory) or reads another deck
/// would otherwise leave the others waiting in the run's first collective. Every rank throws
/// at the same point, so the driver's exit 2 ends the job. The options beside the deck
/// (--steps, --no-output, --resume, ...) must agree too: they shape the collectives as much.
Deck agreedDeck(const std::function<Deck()>& load, const std::string& deck_path) {
  const int size = worldSize();
  if (size == 1) return load();
  Deck d;
  onEveryRank([&] { d = load(); }, "the deck");
  // The same resolved deck everywhere: the first rank whose text differs from rank 0's.
  if (const int r = firstDiffering(d.toToml()); r < size)
    throw InputError(fmt::format("rank {} read another deck than rank 0 (after --set): every rank must read the same "
                                 "deck, so give them the same file and overrides",
                                 r),
                     true);
  // The rest of the command line: the deck's path and the --set pairs are compared resolved
  // above (another spelling of the same deck is no difference).
  std::string rest;
  const auto& args = commandLine();
  bool path_seen = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--set") {
      ++i;
      continue;
    }
    if (args[i].rfind("--set=", 0) == 0) continue;
    if (!path_seen && args[i] == deck_path) {
      path_seen = true;
      continue;
    }
    rest += args[i] + '\0';
  }
  if (const int r = firstDiffering(rest); r < size)
    throw InputError(fmt::format("rank {} was started with other options than rank 0: every rank must run the same "
                                 "command (options such as --steps or --resume shape what the ranks do together)",
                                 r),
                     true);
  return d;
}
}  // namespace

Deck DeckArgs::load(const std::string& command) const {
  return agreedDeck(
      [&] {
        Deck d = loadDeck(path, overrides);
        requireOneCase(d, path, command);
        return d;
      },
      path);
}
Deck DeckArgs::loadWithSweep() const {
  return agreedDeck([&] { return loadDeck(path, overrides); }, path);
}

std::vector<std::string> deckInputs(const Deck& deck) {
  return model::deckInputFiles(deck);
}

void checkOnRankZero(const std::function<void()>& checks) {
  std::string err;
  try {
    if (worldRank() == 0) checks();
  } catch (const InputError& e) {
    err = e.what();
  }
  // Rank 0's verdict to every rank (one message, printed once).
  err = parallel::bcastString(MPI_COMM_WORLD, err);
  if (!err.empty()) throw InputError(err, /*collective=*/true);
}

void addDeckArgs(CLI::App& sub, DeckArgs& args, bool optional) {
  auto* opt = sub.add_option(
      "deck", args.path, optional ? "TOML input deck (required unless an option says otherwise)" : "TOML input deck");
  if (!optional) opt->required();
  sub.add_option("--set", args.overrides, "Override a deck key: table.key=value (TOML value; repeatable)")
      ->allow_extra_args(false)
      ->type_name("TABLE.KEY=VALUE");
}

int worldRank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int worldSize() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

}  // namespace wlb::app

namespace {

/// An option or argument given an empty value (`--out ''`, most often an unset shell
/// variable) is bad input: the commands read an empty path as "not given".
void refuseEmptyValues(const CLI::App& sub) {
  for (const CLI::Option* opt : sub.get_options()) {
    if (opt->count() == 0 || opt->get_items_expected_min() == 0) continue;  // not given, or a flag
    for (const std::string& v : opt->results())
      if (v.empty()) throw wlb::InputError(opt->get_name() + ": an empty value", true);
  }
  for (const CLI::App* nested : sub.get_subcommands()) refuseEmptyValues(*nested);
}

/// Kokkos, the option parser and the chosen subcommand; returns the exit code. Errors from
/// the subcommand are handled here; main() catches what setting up throws.
int dispatch(int argc, char** argv) {
  int rc = 0;
  // Kokkos sees only --kokkos-* arguments (so `wlb --help` is ours), CLI11 the rest.
  std::vector<char*> kokkos_argv{argv[0]}, cli_argv{argv[0]};
  for (int i = 1; i < argc; ++i)
    (std::string(argv[i]).rfind("--kokkos-", 0) == 0 ? kokkos_argv : cli_argv).push_back(argv[i]);
  int kokkos_argc = static_cast<int>(kokkos_argv.size());
  // the command line the ranks must agree on (agreedDeck); Kokkos' options may differ (a
  // device id per rank)
  wlb::app::commandLine().assign(cli_argv.begin() + 1, cli_argv.end());
  {
    Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_argv.data());
    const int rank = wlb::app::worldRank();

    CLI::App app{"wlb — workload-balanced 4D-parallel LLM training: plan, run, simulate, analyse"};
    app.require_subcommand(0, 1);
    app.option_defaults()->always_capture_default();  // --help shows every option's default
    bool show_version = false;
    app.add_flag("--version", show_version, "Print version, git hash, Kokkos, MPI and HDF5");

    std::map<std::string, std::pair<CLI::App*, wlb::app::Runner>> subs;
    for (auto& [name, entry] : wlb::app::registry()) {
      CLI::App* sub = app.add_subcommand(name, entry.description);
      subs[name] = {sub, entry.setup(*sub)};
    }

    std::string sub;  // the subcommand running, for an out-of-memory hint
    // A rank's own error after the others may have entered a collective: end them all with
    // exit 2 (a lone rank returns it, so MPI_Finalize runs).
    const auto endEveryRank = [] {
      std::fflush(stderr);
      if (wlb::app::worldSize() > 1) MPI_Abort(MPI_COMM_WORLD, wlb::kExitBadInput);
      return wlb::kExitBadInput;
    };
    try {
      // the first word must be a subcommand (the driver has no positional arguments)
      if (cli_argv.size() > 1 && cli_argv[1][0] != '-' && !subs.count(cli_argv[1])) {
        const std::string word = cli_argv[1];
        std::vector<std::string> names;
        names.reserve(subs.size());
        for (const auto& entry : subs) names.push_back(entry.first);
        const std::string best = wlb::nearest(word, names);
        std::string list;
        for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
        throw wlb::InputError(
            "unknown subcommand '" + word + "'" +
                (wlb::editDistance(word, best) <= 2 ? " (did you mean '" + best + "'?)" : std::string()) +
                "; subcommands: " + list,
            true);
      }
      app.parse(static_cast<int>(cli_argv.size()), cli_argv.data());
      if (show_version) {
        if (rank == 0) std::cout << wlb::app::versionReport();
      } else if (app.get_subcommands().empty()) {
        if (rank == 0) std::cout << app.help();
      } else {
        const auto* chosen = app.get_subcommands().front();
        sub = chosen->get_name();
        refuseEmptyValues(*chosen);
        rc = subs.at(chosen->get_name()).second();
      }
    } catch (const CLI::ParseError& e) {
      // --help and friends are "errors" with exit code 0.
      if (rank == 0)
        rc = app.exit(e);
      else
        rc = e.get_exit_code();
      if (rc != 0) rc = wlb::kExitBadInput;
    } catch (const wlb::InputError& e) {
      if (!e.collective() || rank == 0) {
        if (e.collective() || wlb::app::worldSize() == 1)
          std::fprintf(stderr, "wlb: error: %s\n", e.what());
        else
          std::fprintf(stderr, "wlb: error (rank %d): %s\n", rank, e.what());
      }
      rc = wlb::kExitBadInput;
    } catch (const wlb::WriteError& e) {
      // no room for an output (a full disk): abort rather than return, since HDF5 may hold
      // state from the failed write that MPI_Finalize would crash on
      if (!e.collective() || rank == 0) std::fprintf(stderr, "wlb: error (rank %d): %s\n", rank, e.what());
      std::fflush(stderr);
      if (e.collective() && wlb::app::worldSize() > 1) {
        // every rank raised it and only rank 0 prints it: the others wait for rank 0's abort,
        // since an abort from them could kill rank 0 before its message is out
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank != 0) std::this_thread::sleep_for(std::chrono::seconds(30));  // a bound, not a wait
      }
      MPI_Abort(MPI_COMM_WORLD, wlb::kExitBadInput);
    } catch (const std::filesystem::filesystem_error& e) {
      // a path the user gave (an output under a file, an unwritable directory): bad input,
      // not an internal error
      std::fprintf(stderr, "wlb: error (rank %d): %s\n", rank, e.what());
      rc = endEveryRank();
    } catch (const std::exception& e) {
      if (wlb::isOutOfMemory(e)) {
        // the deck asks more of this rank than it has: say what to change
        std::fprintf(stderr, "wlb: error (rank %d): out of memory: %s\n", rank, wlb::oneLine(e).c_str());
        if (sub == "run" || sub == "train")
          std::fprintf(stderr,
                       "wlb: the deck needs more memory than this rank has (`wlb simulate DECK --as-run` prints each "
                       "stage's predicted peak): lower data.context_window, raise mesh.tp, mesh.cp or mesh.pp, or set "
                       "pipeline.recompute = \"selective\"\n");
        rc = endEveryRank();
      } else {
        std::fprintf(stderr, "wlb: internal error (rank %d): %s\n", rank, e.what());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    }
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  wlb::keepFreedHeap();  // large buffers stay with the process (core/heap.hpp)
  for (int i = 1; i < argc; ++i)  // the subcommand: the first argument that is no option
    if (argv[i][0] != '-') {
      if (std::string_view(argv[i]) == "train") wlb::app::catchStopSignal();
      break;
    }
  // THREAD_MULTIPLE where the library has it: the pipeline executor drives transfers from a
  // progress thread (runtime/pipeline.cpp); with less it polls between layers instead.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  // Setting up (Kokkos, the option parser) can throw outside dispatch's handlers: end every
  // rank with the message rather than std::terminate.
  try {
    rc = dispatch(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "wlb: internal error while setting up: %s\n", e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  } catch (...) {
    std::fprintf(stderr, "wlb: internal error while setting up\n");
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  // Flushed before MPI_Finalize (a fence): a rank that then exits 2 first makes the launcher
  // kill the others, and what they held in stdio buffers (rank 0's report) would be lost.
  std::cout.flush();
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Finalize();
  return rc;
}
