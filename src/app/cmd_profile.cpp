// `wlb profile --out profile.json`: measure the attention kernels' achieved throughput over
// a grid of query x key lengths, GEMM and FMA peak throughput, and write the hardware
// profile JSON read by the cost model (docs/profile-format.md); with `--deck DECK...` the
// profile is shaped by what the decks run (profile version 2). The profiler is
// profile/profiler.hpp.
#include <cstdio>
#include <memory>
#include <string>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "attention/flops.hpp"
#include "core/output_file.hpp"
#include "profile/profiler.hpp"

namespace {

struct Opts {
  std::string out;
  wlb::profile::ProfileOptions p;
};

int run(const Opts& o) {
  if (wlb::app::worldRank() != 0) return 0;
  // May be --base (read whole before anything is written), not a --deck.
  wlb::checkOutputPath(o.out, "--out", o.p.decks);
  const auto r = wlb::profile::measureProfile(o.p);
  wlb::profile::writeProfile(r.profile, o.out, wlb::app::trackTemporary);
  std::printf("wlb profile: wrote %s (tiles %dx%d, head_dim %d, peak %.1f, linear %.1f GFLOP/s)\n", o.out.c_str(),
              r.tile_q, r.tile_k, r.head_dim, r.peak_gflops, r.linear_gflops);
  return 0;
}

const bool registered = wlb::app::registerCommand(
    "profile", "Measure attention/GEMM throughput and write the hardware profile JSON for the cost model",
    [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      sub.add_option("--out", o->out, "Output profile JSON")->required();
      sub.add_option("--name", o->p.name, "Profile name");
      auto* hd = sub.add_option("--head-dim", o->p.head_dim, "Head dimension to profile");
      auto* hs = sub.add_option("--heads", o->p.heads, "Query heads");
      auto* kh = sub.add_option("--kv-heads", o->p.kv_heads, "KV heads");
      sub.add_option("--deck", o->p.decks,
                     "Profile what this deck runs (repeatable; one layer shape): plans its strategies, times the "
                     "layer's ops at the plans' token counts and attention over the plans' piece shapes "
                     "(profile version 2)")
          ->type_name("DECK");
      sub.add_option("--set", o->p.overrides, "Override a key of every --deck: table.key=value (repeatable)")
          ->type_name("TABLE.KEY=VALUE");
      sub.add_option("--tile-q", o->p.tile_q, "Query tile of the kernel");
      sub.add_option("--tile-k", o->p.tile_k, "Key tile of the kernel");
      sub.add_option("--q-lens", o->p.q_lens, "Query lengths of the grid")->delimiter(',');
      sub.add_option("--k-lens", o->p.k_lens, "Key lengths of the grid")->delimiter(',');
      sub.add_option("--reps", o->p.reps, "Repetitions per cell (best is kept)");
      sub.add_option("--min-seconds", o->p.min_seconds, "Minimum time per repetition");
      sub.add_option("--peak-gflops", o->p.peak_gflops, "FP32 peak to record (default: measured FMA loop)");
      sub.add_option("--precision", o->p.precision,
                     "Arithmetic of the timed attention kernels and GEMM: fp32, tf32 or bf16 (GPU tensor cores; host "
                     "builds compute every mode in FP32)")
          ->check(CLI::IsMember({"fp32", "tf32", "bf16"}));
      sub.add_option("--attention", o->p.attention, wlb::attention::hopperVariantHelp())
          ->check(CLI::IsMember(wlb::attention::hopperVariants()));
      sub.add_option("--base", o->p.base,
                     "Profile JSON whose fields this command does not measure (links, topology, memory, peak) are "
                     "kept");
      sub.add_flag("--quick", o->p.quick, "Small grid, short timings (tests)");
      sub.add_flag("--wall-clock", o->p.wall_clock, "Time with wall clock even on a single-threaded backend");
      return [o, hd, hs, kh]() -> int {
        o->p.head_opts_given = hd->count() + hs->count() + kh->count() > 0;
        return run(*o);
      };
    });

}  // namespace
