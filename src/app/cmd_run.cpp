// `wlb run DECK`: execute the deck's strategies for real on the MPI job (TP x CP x PP x
// DP, pipeline stages walking the deck's schedule) with Kokkos kernels and report
// measured throughput, step time, bubbles and imbalance (docs/runtime.md). The world size
// must equal tp*cp*pp*dp.
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "core/output_file.hpp"
#include "runtime/run.hpp"

namespace {
struct Opts {
  wlb::app::DeckArgs deck;
  long long steps = -1, warmup = -1;
  bool quiet = false, no_output = false, gemm_timing = false, kernel_timing = false;
  std::string gradients;
};

// NumPy .npy (format 1.0): a little-endian float32 vector that numpy.load reads.
std::string npyText(const std::vector<float>& v) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(v.size()) + ",), }";
  const std::size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  const auto len = static_cast<std::uint16_t>(header.size());
  std::string out("\x93NUMPY\x01\x00", 8);
  out.append(reinterpret_cast<const char*>(&len), 2);
  out += header;
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  return out;
}

// --gradients DIR: each strategy's weight gradients of its last step (STRATEGY.npy,
// tensor by tensor in model order, each whole: StrategyResult::gradients) and every step's loss
// (losses.json), to compare builds (CPU vs GPU) or meshes. All complete under temporary
// names before the first rename: a full disk leaves every earlier file whole.
void writeGradients(const std::string& dir, const wlb::runtime::RunReport& report) {
  nlohmann::json losses = nlohmann::json::object();
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& r : report.strategies) {
    files.emplace_back((std::filesystem::path(dir) / (r.name + ".npy")).string(), npyText(r.gradients));
    nlohmann::json steps = nlohmann::json::array();
    for (const auto& s : r.steps)  // a step without tokens has no loss: null (a NaN dumps so)
      steps.push_back({{"step", s.step}, {"loss", s.loss}, {"warmup", s.warmup}, {"drain", s.drain}});
    losses[r.name] = steps;
  }
  files.emplace_back((std::filesystem::path(dir) / "losses.json").string(), losses.dump(1) + "\n");
  wlb::writeFilesAtomically(files, "--gradients", wlb::app::trackTemporary);
}

const bool registered = wlb::app::registerCommand(
    "run", "Execute the deck's strategies on this MPI job with real kernels and report measured step times",
    [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, o->deck);
      sub.add_option("--steps", o->steps, "Measured steps per strategy (default: run.steps)")
          ->check(wlb::app::intAtLeast(1, wlb::app::kMaxStepsOption));
      sub.add_option("--warmup", o->warmup, "Warm-up steps before them, not measured (default: run.warmup)")
          ->check(wlb::app::intAtLeast(0, wlb::app::kMaxStepsOption));
      sub.add_flag("--quiet", o->quiet, "No per-step progress lines");
      sub.add_flag("--no-output", o->no_output, "Do not write the trace, plan and summary.json files");
      sub.add_flag("--gemm-timing", o->gemm_timing,
                   "Time every GEMM of the measured steps on its own (fenced before and after) and report each "
                   "product's rate; the steps lose launch overlap, so their times are not a throughput figure");
      sub.add_flag("--kernel-timing", o->kernel_timing,
                   "Time every Kokkos kernel and deep copy of the measured steps on its own (fenced before and after: "
                   "norms, RoPE, SwiGLU, residuals, cross-entropy, KV moves) and report each label's time");
      sub.add_option(
          "--gradients", o->gradients,
          "Write each strategy's last-step weight gradients (DIR/STRATEGY.npy) and losses (DIR/losses.json)");
      return [o]() -> int {
        const wlb::Deck deck = o->deck.load("wlb run");  // every rank's, agreed
        // --gradients' folder: made before the run (a place no folder can be made in fails
        // now, not after the run's outputs are written), removed again unless written.
        std::optional<wlb::app::OutputFolders> gradients_dir;
        wlb::app::checkOnRankZero([&] {  // rank 0 writes them
          if (o->gradients.empty()) return;
          wlb::checkOutputFolder(o->gradients, "--gradients");
          wlb::checkOutputPath(o->gradients + "/losses.json", "--gradients");
          gradients_dir.emplace(o->gradients + "/losses.json");
          if (gradients_dir->error())
            throw wlb::InputError("--gradients '" + o->gradients + "': cannot create the folder (" +
                                  gradients_dir->error().message() + ")");
        });
        wlb::runtime::RunOptions ro;
        ro.steps = o->steps;
        ro.warmup = o->warmup;
        ro.progress = !o->quiet;
        ro.write_outputs = !o->no_output;
        ro.gradients_dir = o->gradients;
        ro.track_temporary = wlb::app::trackTemporary;
        ro.keep_gradients = !o->gradients.empty();
        ro.gemm_timing = o->gemm_timing;
        ro.kernel_timing = o->kernel_timing;
        ro.command = "wlb run " + o->deck.path;
        for (const auto& s : o->deck.overrides) ro.command += " --set " + s;
        if (o->steps >= 0) ro.command += " --steps " + std::to_string(o->steps);
        if (o->warmup >= 0) ro.command += " --warmup " + std::to_string(o->warmup);
        if (o->gemm_timing) ro.command += " --gemm-timing";
        if (o->kernel_timing) ro.command += " --kernel-timing";
        // Failure-handling tests: WLB_INJECT_FAILURE=RANK:STEP makes that rank throw mid-step,
        // RANK:STEP:kill makes it die there (SIGKILL).
        if (const char* f = std::getenv("WLB_INJECT_FAILURE")) {
          long long step = -1;
          int used = 0;
          if (std::sscanf(f, "%d:%lld%n", &ro.fail_rank, &step, &used) != 2 ||
              !(f[used] == '\0' || std::string(f + used) == ":kill"))
            throw wlb::InputError(
                "WLB_INJECT_FAILURE must be RANK:STEP or RANK:STEP:kill, got '" + std::string(f) + "'", true);
          ro.fail_step = step;
          ro.fail_kill = f[used] != '\0';
        }
        const auto report = wlb::runtime::runDeck(deck, ro);
        if (wlb::app::worldRank() == 0) {
          std::fputs(wlb::runtime::formatReport(report).c_str(), stdout);
          std::fflush(stdout);
          if (!o->gradients.empty()) {
            writeGradients(o->gradients, report);
            gradients_dir->keep();
          }
        }
        return 0;
      };
    });
}  // namespace
