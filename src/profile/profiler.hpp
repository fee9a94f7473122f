#pragma once
/// \file profiler.hpp
/// \brief The kernel profiler behind `wlb profile` (docs/profile-format.md): the attention
/// kernels' achieved throughput (GFLOP/s on tile-padded FLOPs) over a grid of query x key
/// lengths, forward and backward, plus GEMM and FMA peak throughput, as the hardware
/// profile JSON the cost model reads.
///
/// With decks it measures what the decks run instead of generic sizes (profile version 2):
/// it plans every strategy's steps (packers + CP shard planners, as `wlb run` does), times
/// the layer's ops (the GEMMs, SwiGLU and residual work, input/gradient fills) at the
/// per-rank token counts the plans produce, times the attention table over the range of
/// the plans' piece shapes at the deck's heads and head_dim, and fits the attention factors
/// from whole per-rank batches of those plans.
///
/// Single process (the layer ops run on MPI_COMM_SELF: MPI must be initialised) and
/// Kokkos initialised; run it on an otherwise idle core.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/output_file.hpp"

namespace wlb::profile {

/// What to measure and how. Messages name the `wlb profile` options these fields stand for.
struct ProfileOptions {
  std::string name = "cpu-1core";  ///< the profile's name
  /// Attention shape of the generic grid; with `decks` they come from the decks (model.*,
  /// mesh.tp) and setting them is an error (`head_opts_given`).
  int head_dim = 64, heads = 2, kv_heads = 1;
  bool head_opts_given = false;
  int tile_q = 64, tile_k = 64;              ///< the kernel's tiles
  int reps = 3;                              ///< repetitions per cell (the best is kept)
  double min_seconds = 0.05;                 ///< least time per repetition
  double peak_gflops = 0.0;                  ///< FP32 peak to record; 0: the measured FMA loop
  std::vector<std::int64_t> q_lens, k_lens;  ///< the grid; empty: defaults (with decks: the plans' pieces)
  std::vector<std::string> decks;            ///< deck-shaped profile of these decks (one layer shape)
  std::vector<std::string> overrides;        ///< table.key=value applied to every deck
  std::string precision = "fp32";            ///< attention + GEMM arithmetic: fp32, tf32, bf16
  std::string attention = "auto";            ///< Hopper kernel variant (attention::setHopperVariant)
  std::string base;                          ///< profile whose fields this one does not measure are kept
  bool quick = false;                        ///< small grids, short timings (tests)
  bool wall_clock = false;                   ///< wall time even on a single-threaded backend
  bool progress = true;                      ///< a line per measured cell on stderr
};

// NOLINTNEXTLINE(bugprone-exception-escape): flagged for its nlohmann::json member, whose moves do not throw
struct ProfileResult {
  nlohmann::json profile;  ///< the profile document (docs/profile-format.md)
  /// As measured (the document rounds them and records 220 when no peak was measured).
  double peak_gflops = 0.0, linear_gflops = 0.0;
  int tile_q = 0, tile_k = 0, head_dim = 0;  ///< what the grid was measured at
};

/// Measure the profile. Bad options or decks -> wlb::InputError (before anything is timed).
ProfileResult measureProfile(ProfileOptions o);

/// Write `profile` to `path` with wlb::writeFileAtomically: a failure leaves nothing
/// half-written; an unwritable path -> wlb::InputError naming --out.
void writeProfile(const nlohmann::json& profile, const std::string& path, const TemporaryTracker& track_temporary = {});

}  // namespace wlb::profile
