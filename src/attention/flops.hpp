#pragma once
/// \file flops.hpp
/// \brief Work accounting of the attention kernels, without Kokkos (cheap to include from
/// planners and the cost model).
///
/// A *piece* has `nq` queries and `nk >= nq` keys (its document prefix); the causal mask is
/// aligned bottom-right: query j (0-based) sees keys [0, nk - nq + j].

#include <cstdint>
#include <string>
#include <vector>

namespace wlb::attention {

/// Tiles of the kernel: a work unit is tile_q queries x tile_k keys. Both are multiples of
/// 16 in [16, 256]. The cost model pads work to these tiles.
struct KernelConfig {
  int tile_q = 64;  ///< queries per tile
  int tile_k = 64;  ///< keys per tile
  /// Auto: the fastest path for the execution space (host SIMD micro-kernels on host
  /// spaces when head_dim % 16 == 0). Portable: the plain Kokkos team path (what device
  /// backends run); used by tests to cross-check both. Sm80: on a CUDA device, the sm_80
  /// kernels (mma.sync / FP32 SIMT) even where the Hopper wgmma forward would run (what the
  /// GPU benchmark compares against); elsewhere the same as Auto.
  enum class Path : int { Auto = 0, Portable = 1, Sm80 = 2 } path = Path::Auto;
  /// Arithmetic of the matrix products on a CUDA device. Fp32: exact FP32 on the CUDA
  /// cores. Tf32: FP32 storage, forward products on TF32 tensor cores (backward in exact
  /// FP32). Bf16: BF16 tensor cores with FP32 accumulation (FP32 storage is rounded to
  /// BF16 on the way in; BF16 storage always takes these kernels). Host and portable paths
  /// compute every mode in FP32, which is at least as accurate.
  enum class Precision : int { Fp32 = 0, Tf32 = 1, Bf16 = 2 } precision = Precision::Fp32;
  /// Split-KV in the Hopper forward (split_kv.hpp): pieces with at most 256 queries over at
  /// least 16K keys run as several work items over parts of their keys, merged by their
  /// LSE. Off by default: on the H100 it paid only for 64 queries over 128K keys (1.07x)
  /// and cost up to 6x elsewhere on the CP-piece grid; other paths ignore it.
  bool split_kv = false;
  /// BF16 on a Hopper device: the warp-specialised forward (cuda_hopper_ws.cu: a
  /// persistent kernel with a TMA producer warpgroup, consumer warpgroups in ping-pong and
  /// the next tile's QK^T issued before this tile's softmax) instead of the synchronous one.
  /// On by default: measured 1.5-1.7x the synchronous forward on the H100 (docs/attention.md,
  /// "Measured on the H100"); other paths and precisions ignore it.
  bool warp_specialized = true;
  /// BF16 on a Hopper device: the warp-specialised backward (a TMA producer, dQ added by
  /// bulk reductions) instead of the synchronous one. Off by default: measured at half the
  /// synchronous backward's rate at D = 128 (1.09x it at D = 64).
  bool ws_backward = false;
  /// Query rows per step of the warp-specialised backward at D = 64: 0 (the default) = 128,
  /// FlashAttention-3's tile there; 64 = the tile of D = 128 (the kernel measured on the
  /// H100 before 2026-11-27), kept to compare the two on one card. D = 128 always steps 64
  /// rows (128 would not fit the consumers' registers).
  int ws_bwd_rows = 0;
};

/// The Hopper kernel variants by name (deck `run.attention`, `wlb profile --attention`,
/// `wlb kernel --attention`, `bench_attention_gpu --paths`): which forward and backward run
/// and whether split-KV is on. "auto" is the fastest measured pair.
struct HopperVariant {
  const char* name;
  bool ws_forward, ws_backward, split_kv;
};
inline const std::vector<HopperVariant>& hopperVariantTable() {
  static const std::vector<HopperVariant> t{{"auto", true, false, false},  {"split", true, false, true},
                                            {"ws", true, true, false},     {"ws-split", true, true, true},
                                            {"sync", false, false, false}, {"sync-split", false, false, true}};
  return t;
}
/// Sets cfg's variant; false for another name (cfg unchanged).
inline bool setHopperVariant(KernelConfig& cfg, const std::string& name) {
  for (const HopperVariant& v : hopperVariantTable())
    if (name == v.name) {
      cfg.warp_specialized = v.ws_forward;
      cfg.ws_backward = v.ws_backward;
      cfg.split_kv = v.split_kv;
      return true;
    }
  return false;
}
/// cfg's variant name ("custom" for a combination no name gives: a warp-specialised
/// backward after the synchronous forward).
inline const char* hopperVariant(const KernelConfig& cfg) {
  for (const HopperVariant& v : hopperVariantTable())
    if (cfg.warp_specialized == v.ws_forward && cfg.ws_backward == v.ws_backward && cfg.split_kv == v.split_kv)
      return v.name;
  return "custom";
}
/// The variant names setHopperVariant takes.
inline const std::vector<std::string>& hopperVariants() {
  static const std::vector<std::string> v = [] {
    std::vector<std::string> names;
    for (const HopperVariant& h : hopperVariantTable()) names.push_back(h.name);
    return names;
  }();
  return v;
}
/// What each name selects (help texts of the deck key and the commands).
inline const char* hopperVariantHelp() {
  return "Attention kernels on a Hopper GPU (BF16): auto (the warp-specialised forward and the synchronous "
         "backward, the fastest measured), split (auto with split-KV for pieces of <= 256 queries over >= 16K keys), "
         "ws (warp-specialised forward and backward), ws-split (ws with split-KV), sync (the synchronous kernels), "
         "sync-split (sync with split-KV); other devices ignore it.";
}
/// The names joined by ", " (error messages and help texts).
inline std::string hopperVariantList() {
  std::string s;
  for (const std::string& n : hopperVariants()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

/// Unmasked query-key pairs of a piece: nq*(nk-nq) + nq*(nq+1)/2.
inline double usefulPairs(std::int64_t nq, std::int64_t nk) {
  const double q = static_cast<double>(nq), o = static_cast<double>(nk - nq);
  return q * o + q * (q + 1.0) / 2.0;
}

/// Pairs the tiled kernel visits: for each query tile, every key tile that holds at least
/// one key visible to a valid row of that tile, counted as full tile_q x tile_k blocks.
inline double paddedPairs(std::int64_t nq, std::int64_t nk, const KernelConfig& cfg) {
  const std::int64_t tq = cfg.tile_q, tk = cfg.tile_k, off = nk - nq;
  double pairs = 0.0;
  for (std::int64_t q0 = 0; q0 < nq; q0 += tq) {
    const std::int64_t last = (q0 + tq < nq ? q0 + tq : nq) - 1;  // last valid row
    const std::int64_t ktiles = (off + last) / tk + 1;            // tiles up to its limit
    pairs += static_cast<double>(ktiles) * static_cast<double>(tq * tk);
  }
  return pairs;
}

/// Forward FLOPs (QK^T and PV) for `pairs` pairs: 4 * pairs * head_dim * heads.
inline double forwardFlops(double pairs, std::int64_t heads, std::int64_t head_dim) {
  return 4.0 * pairs * static_cast<double>(heads) * static_cast<double>(head_dim);
}
/// Backward / forward FLOPs: the backward recomputes the scores (QK^T) and runs four more
/// products (dV, dP, dQ, dK), counted as 2.5x forward (docs/attention.md).
inline constexpr double kBackwardFactor = 2.5;
/// Backward FLOPs for `pairs` pairs.
inline double backwardFlops(double pairs, std::int64_t heads, std::int64_t head_dim) {
  return kBackwardFactor * forwardFlops(pairs, heads, head_dim);
}

}  // namespace wlb::attention
