// `wlb train DECK [--resume] [--exit-after N]`: train the LLaMA-style model on a `wlb data prepare` dataset
// with the deck's packer choosing the batches; validation loss, checkpoints, resume
// (docs/training.md). Under mpirun on a TP x CP x DP mesh (mesh.tp x mesh.cp x mesh.dp ranks).
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "train/trainer.hpp"

namespace {
struct Opts {
  wlb::app::DeckArgs deck;
  bool resume = false, quiet = false;
  std::int64_t exit_after = -1;
};

const bool registered = wlb::app::registerCommand(
    "train", "Train a LLaMA-style model on a prepared token dataset, batches chosen by the deck's packer",
    [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, o->deck);
      sub.add_flag("--resume", o->resume, "Continue from the checkpoint in train.checkpoint_dir");
      sub.add_flag("--quiet", o->quiet, "No progress lines");
      sub.add_option("--exit-after", o->exit_after,
                     "Stop once N steps of the run are done, with a checkpoint; --resume continues "
                     "(SIGUSR1 stops the same way after the step in progress)")
          ->check(CLI::Range(std::int64_t{1}, std::numeric_limits<std::int64_t>::max()));
      return [o]() -> int {
        const wlb::Deck deck = o->deck.load("wlb train");
        wlb::train::TrainOptions to;
        to.command = "wlb train " + o->deck.path + (o->resume ? " --resume" : "") +
                     (o->exit_after > 0 ? " --exit-after " + std::to_string(o->exit_after) : "");
        to.resume = o->resume;
        to.progress = !o->quiet;
        to.track_temporary = wlb::app::trackTemporary;
        to.exit_after_steps = o->exit_after;
        // SIGUSR1 (Slurm's `--signal=USR1@SECONDS` before a time limit; mpirun passes it on to
        // every rank) asks for a clean stop after the step in progress. main() caught it
        // before MPI started; again here in case the MPI library replaced the handler.
        wlb::app::catchStopSignal();
        to.exit_request = wlb::app::stopRequest();
        // Resume tests: WLB_TRAIN_KILL_AFTER_STEP=k kills the process (SIGKILL) after step k.
        if (const char* k = std::getenv("WLB_TRAIN_KILL_AFTER_STEP")) to.kill_after_step = std::atoll(k);
        const auto summary = wlb::train::train(deck, to);
        int rank = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        if (rank == 0) {
          std::fputs(wlb::train::formatSummary(summary).c_str(), stdout);
          std::fflush(stdout);
        }
        return 0;
      };
    });
}  // namespace
