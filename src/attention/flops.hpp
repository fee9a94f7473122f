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
  /// LSE. Off by default until measured on an H100; other paths ignore it.
  bool split_kv = false;
  /// BF16 on a Hopper device: the warp-specialised kernels (cuda_hopper_ws.cu) instead of
  /// the synchronous ones — a persistent forward with a TMA producer warpgroup, consumer
  /// warpgroups in ping-pong and the next tile's QK^T issued before this tile's softmax, and
  /// a backward with a TMA producer and dQ added by bulk reductions. Off by default until
  /// measured on an H100; other paths and precisions ignore it.
  bool warp_specialized = false;
};

/// The Hopper kernel variants by name (deck `run.attention`, `wlb profile --attention`,
/// `bench_attention_gpu --paths`): "auto" (the synchronous kernels), "split" (split_kv),
/// "ws" (warp_specialized), "ws-split" (both). False for another name (cfg unchanged).
inline bool setHopperVariant(KernelConfig& cfg, const std::string& name) {
  const bool split = name == "split" || name == "ws-split", ws = name == "ws" || name == "ws-split";
  if (!split && !ws && name != "auto") return false;
  cfg.split_kv = split;
  cfg.warp_specialized = ws;
  return true;
}
inline const char* hopperVariant(const KernelConfig& cfg) {
  if (cfg.warp_specialized) return cfg.split_kv ? "ws-split" : "ws";
  return cfg.split_kv ? "split" : "auto";
}
/// The variant names setHopperVariant takes.
inline const std::vector<std::string>& hopperVariants() {
  static const std::vector<std::string> v{"auto", "split", "ws", "ws-split"};
  return v;
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
/// Backward FLOPs, counted as 2.5x forward (docs/attention.md).
inline double backwardFlops(double pairs, std::int64_t heads, std::int64_t head_dim) {
  return 2.5 * forwardFlops(pairs, heads, head_dim);
}

}  // namespace wlb::attention
