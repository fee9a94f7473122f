#pragma once
/// \file attention_host.hpp
/// \brief Internal: host (CPU) SIMD path of the attention kernels — register-blocked
/// micro-kernels over one-register float vectors (16 lanes with AVX-512, 8 with AVX2), a
/// polynomial exp2, and per-work-item drivers called from Kokkos parallel_for on host execution spaces. Not part of the
/// public API; compiled only where WLB_ATTN_HOST_SIMD is 1 (GCC/Clang host compilers, not
/// nvcc/hipcc device compilation). Layout and algorithm: docs/attention.md.

#include <cstddef>
#include <cstdint>

#include "attention/attention.hpp"

#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(__HIPCC__) && \
    !defined(__SYCL_DEVICE_ONLY__) && !defined(__NVCOMPILER)
#define WLB_ATTN_HOST_SIMD 1
#else
#define WLB_ATTN_HOST_SIMD 0
#endif

namespace wlb::attention::host {

/// Everything a host work item needs, as raw pointers (Views are unpacked by the caller).
/// Token strides are in floats; the head stride is head_dim and the last stride 1.
struct Args {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* o = nullptr;
  const float* lse = nullptr;
  const float* dO = nullptr;
  float* o_out = nullptr;
  float* lse_out = nullptr;
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  std::int64_t q_s0 = 0, k_s0 = 0, v_s0 = 0, o_s0 = 0, lse_s0 = 0, dO_s0 = 0, dq_s0 = 0,
               dk_s0 = 0, dv_s0 = 0;
  int heads = 0, kv_heads = 0, head_dim = 0, tile_q = 64, tile_k = 64;
  /// forward: query tiles per work item; they walk the key tiles together so each packed
  /// K^T / V block is read from memory once per group (not part of the cost-model tiles)
  int q_group = 4;
  /// backward: key tiles processed together per pass over the query tiles (same purpose)
  int k_group = 4;
  float scale = 1.0f;   ///< softmax scale (natural units)
  float scale2 = 1.0f;  ///< scale * log2(e): scores are kept in log2 units
  const PieceRange* pieces = nullptr;
  std::int64_t num_pieces = 0;
  // Blocked workspaces (see docs/attention.md): per piece, its tiles are consecutive.
  const std::int64_t* kb_off = nullptr;  ///< first key block of each piece
  std::int64_t nkblk = 0;                ///< key blocks per kv head
  const std::int64_t* qb_off = nullptr;  ///< first query block of each piece
  std::int64_t nqblk = 0;                ///< query blocks per head
  float* KT = nullptr;    ///< [kv_heads][nkblk][head_dim][tile_k]   K^T per key tile
  float* QT = nullptr;    ///< [heads][nqblk][head_dim][tile_q]      scale2 * Q^T per query tile
  float* dOT = nullptr;   ///< [heads][nqblk][head_dim][tile_q]      dO^T per query tile
  float* LSE2 = nullptr;  ///< [heads][nqblk][tile_q]                lse * log2(e)
  float* DLT = nullptr;   ///< [heads][nqblk][tile_q]                rowsum(dO * O)
  float* dQT = nullptr;   ///< [heads][nqblk][head_dim][tile_q]      accumulated dS K (transposed)
};

#if WLB_ATTN_HOST_SIMD
/// Floats per SIMD vector the host kernels were compiled for (16 AVX-512, 8 otherwise).
int vectorWidth();
/// Register-only FMA loop at that width: `iters` x 12 independent vector FMAs. Returns
/// the FLOPs executed; time it to read the core's FMA peak next to the kernel figures.
double fmaLoop(long iters);
/// Uninitialised 64-byte-aligned workspace number `slot` (0..7) of the calling thread, at
/// least `floats` long; cached across calls (grows, never shrinks) so repeated kernel calls
/// pay no allocation or page faults. Valid until the same thread asks for the slot again.
float* workspace(int slot, std::size_t floats);
/// Pack K^T of key tile `kt` of `piece` for kv head `hk` into KT (zero-padded).
void packKeyTile(const Args& a, std::int64_t piece, std::int64_t kt, int hk);
/// Forward of query tiles [qg * q_group, (qg + 1) * q_group) of one piece for head h
/// (writes o_out, lse_out).
void forwardTile(const Args& a, std::int64_t piece, std::int64_t qg, int h);
/// Backward pre-pass for one query tile: QT, dOT, LSE2, DLT.
void packQueryTile(const Args& a, std::int64_t piece, std::int64_t qt, int h);
/// Backward of every piece for the heads of kv head hk: accumulates dk, dv and dQT.
void backwardKvHead(const Args& a, int hk);
/// dq rows of one query tile += scale * dQT^T.
void unpackDq(const Args& a, std::int64_t piece, std::int64_t qt, int h);
#endif

}  // namespace wlb::attention::host
