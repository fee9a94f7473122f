// `wlb train DECK [--resume]`: train the LLaMA-style model on a `wlb data prepare` dataset
// with the deck's packer choosing the batches; validation loss, checkpoints, resume
// (docs/training.md). Under mpirun on a TP x CP x DP mesh (mesh.tp x mesh.cp x mesh.dp ranks).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
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
};

const bool registered = wlb::app::registerCommand(
    "train", "Train a LLaMA-style model on a prepared token dataset, batches chosen by the deck's packer",
    [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, o->deck);
      sub.add_flag("--resume", o->resume, "Continue from the checkpoint in train.checkpoint_dir");
      sub.add_flag("--quiet", o->quiet, "No progress lines");
      return [o]() -> int {
        const wlb::Deck deck = o->deck.load("wlb train");
        wlb::train::TrainOptions to;
        to.command = "wlb train " + o->deck.path + (o->resume ? " --resume" : "");
        to.resume = o->resume;
        to.progress = !o->quiet;
        to.track_temporary = wlb::app::trackTemporary;
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
