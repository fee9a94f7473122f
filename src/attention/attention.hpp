#pragma once
/// \file attention.hpp
/// \brief Variable-length, causal, document-masked multi-head attention (GQA) with Kokkos:
/// forward (O, log-sum-exp) and flash-attention-style backward (dQ, dK, dV).
///
/// Layout (all FP32, Kokkos::LayoutRight, memory space of the execution space):
///   q, o, dO, dq : [q_tokens][heads][head_dim]
///   k, v, dk, dv : [k_tokens][kv_heads][head_dim]      heads % kv_heads == 0
///   lse          : [q_tokens][heads]  natural-log log-sum-exp of the scaled scores
/// Query head h uses KV head h / (heads / kv_heads). Scores are s = scale * q.k with
/// scale = 1/sqrt(head_dim) unless `softmax_scale` is given.
///
/// A batch is a list of *pieces*. Piece i has queries [q_begin, q_end) of the query
/// buffer and keys [k_begin, k_end) of the key buffer with nk = k_end - k_begin >=
/// nq = q_end - q_begin; the keys are the piece's document prefix and the causal mask is
/// aligned bottom-right: query j of the piece sees keys [0, nk - nq + j] of the piece.
/// Pieces may share (overlapping) key ranges; their query ranges must be disjoint.
///
/// Contracts:
///   forward  OVERWRITES o and lse rows of every piece's queries (other rows untouched).
///   backward ACCUMULATES (+=) into dq, dk and dv: zero them before the first call. Keys
///            shared by several pieces (or by several calls) receive the sum of all
///            contributions. lse and o must be the forward outputs for the same inputs.
/// Both enqueue work on `space` and fence it before returning. Host-path workspaces are
/// cached per calling thread (grow-only, reused across calls); device-path temporaries are
/// freed on return. Tiles: see KernelConfig (default 64 x 64, as in the shipped profile).

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <vector>

#include "attention/bf16.hpp"
#include "attention/flops.hpp"

namespace wlb::attention {

/// One piece: query rows [q_begin, q_end), key rows [k_begin, k_end).
struct PieceRange {
  std::int64_t q_begin = 0, q_end = 0, k_begin = 0, k_end = 0;
  std::int64_t nq() const { return q_end - q_begin; }
  std::int64_t nk() const { return k_end - k_begin; }
};

/// The pieces of one call, on the host (planning) and in device memory.
struct VarlenBatch {
  std::vector<PieceRange> pieces;  ///< host copy
  /// [pieces][4] = q_begin, q_end, k_begin, k_end in the default memory space.
  Kokkos::View<std::int64_t* [4], Kokkos::LayoutRight, Kokkos::DefaultExecutionSpace::memory_space>
      ranges;
  std::int64_t q_tokens = 0;  ///< max q_end (rows the query buffers must have)
  std::int64_t k_tokens = 0;  ///< max k_end

  /// From explicit ranges. Throws std::invalid_argument on negative/empty-key pieces,
  /// nq > nk, or overlapping query ranges.
  static VarlenBatch fromRanges(std::vector<PieceRange> pieces);
  /// cu_seqlens style: piece i has queries [cu_q[i], cu_q[i+1]) and keys
  /// [cu_k[i], cu_k[i+1]). Both arrays non-decreasing, same length >= 1.
  static VarlenBatch fromCuSeqlens(const std::vector<std::int64_t>& cu_q,
                                   const std::vector<std::int64_t>& cu_k);
  /// Whole documents packed in one sequence (queries = keys): cu = prefix sums of lengths.
  static VarlenBatch fromDocLengths(const std::vector<std::int64_t>& lengths);

  /// Sum over pieces of usefulPairs / paddedPairs.
  double usefulPairs() const;
  double paddedPairs(const KernelConfig& cfg) const;
};

/// View types for an execution space.
template <class ExecSpace>
struct Views {
  using mem = typename ExecSpace::memory_space;
  using In3 = Kokkos::View<const float***, Kokkos::LayoutRight, mem>;
  using Out3 = Kokkos::View<float***, Kokkos::LayoutRight, mem>;
  using In2 = Kokkos::View<const float**, Kokkos::LayoutRight, mem>;
  using Out2 = Kokkos::View<float**, Kokkos::LayoutRight, mem>;
  using In3b = Kokkos::View<const bf16***, Kokkos::LayoutRight, mem>;  ///< BF16 storage
  using Out3b = Kokkos::View<bf16***, Kokkos::LayoutRight, mem>;
};

/// Forward: o = softmax(scale * q k^T + mask) v, lse = log sum exp(scale * q k^T + mask).
/// Throws std::invalid_argument on inconsistent shapes. softmax_scale <= 0 -> 1/sqrt(D).
template <class ExecSpace>
void forward(const ExecSpace& space, typename Views<ExecSpace>::In3 q,
             typename Views<ExecSpace>::In3 k, typename Views<ExecSpace>::In3 v,
             const VarlenBatch& batch, typename Views<ExecSpace>::Out3 o,
             typename Views<ExecSpace>::Out2 lse, const KernelConfig& cfg = {},
             float softmax_scale = 0.0f);

/// Backward: dq += dL/dq, dk += dL/dk, dv += dL/dv given dO = dL/do (see file comment).
template <class ExecSpace>
void backward(const ExecSpace& space, typename Views<ExecSpace>::In3 q,
              typename Views<ExecSpace>::In3 k, typename Views<ExecSpace>::In3 v,
              typename Views<ExecSpace>::In3 o, typename Views<ExecSpace>::In2 lse,
              typename Views<ExecSpace>::In3 dO, const VarlenBatch& batch,
              typename Views<ExecSpace>::Out3 dq, typename Views<ExecSpace>::Out3 dk,
              typename Views<ExecSpace>::Out3 dv, const KernelConfig& cfg = {},
              float softmax_scale = 0.0f);

/// BF16 storage (what GPU training uses): q, k, v, o and dO in BF16, lse and the
/// gradients dq, dk, dv in FP32 (they accumulate). Same contracts as above; on a CUDA
/// device the BF16 tensor-core kernels run whatever `cfg.precision` says.
template <class ExecSpace>
void forward(const ExecSpace& space, typename Views<ExecSpace>::In3b q,
             typename Views<ExecSpace>::In3b k, typename Views<ExecSpace>::In3b v,
             const VarlenBatch& batch, typename Views<ExecSpace>::Out3b o,
             typename Views<ExecSpace>::Out2 lse, const KernelConfig& cfg = {},
             float softmax_scale = 0.0f);
template <class ExecSpace>
void backward(const ExecSpace& space, typename Views<ExecSpace>::In3b q,
              typename Views<ExecSpace>::In3b k, typename Views<ExecSpace>::In3b v,
              typename Views<ExecSpace>::In3b o, typename Views<ExecSpace>::In2 lse,
              typename Views<ExecSpace>::In3b dO, const VarlenBatch& batch,
              typename Views<ExecSpace>::Out3 dq, typename Views<ExecSpace>::Out3 dk,
              typename Views<ExecSpace>::Out3 dv, const KernelConfig& cfg = {},
              float softmax_scale = 0.0f);

/// Name of the kernel family `forward` runs for these arguments: "host-simd",
/// "portable", "cuda-simt-fp32", "cuda-mma-tf32", "cuda-mma-bf16", "cuda-wgmma-tf32",
/// "cuda-wgmma-bf16" or "cuda-wgmma-ws-bf16" (for benchmarks and `wlb kernel`).
template <class ExecSpace>
const char* kernelName(int head_dim, const KernelConfig& cfg, bool bf16_storage = false);

/// True when `forward`/`backward` on this space with this head_dim and config run the host
/// SIMD micro-kernels (else the portable team path).
template <class ExecSpace>
bool usesHostKernels(int head_dim, const KernelConfig& cfg);

/// Throws std::invalid_argument unless tiles are multiples of 16 in [16, 256].
void validateConfig(const KernelConfig& cfg);

// Instantiated in attention.cpp for the default execution space (and the default host
// space when it differs).
extern template void forward<Kokkos::DefaultExecutionSpace>(
    const Kokkos::DefaultExecutionSpace&, Views<Kokkos::DefaultExecutionSpace>::In3,
    Views<Kokkos::DefaultExecutionSpace>::In3, Views<Kokkos::DefaultExecutionSpace>::In3,
    const VarlenBatch&, Views<Kokkos::DefaultExecutionSpace>::Out3,
    Views<Kokkos::DefaultExecutionSpace>::Out2, const KernelConfig&, float);
extern template void backward<Kokkos::DefaultExecutionSpace>(
    const Kokkos::DefaultExecutionSpace&, Views<Kokkos::DefaultExecutionSpace>::In3,
    Views<Kokkos::DefaultExecutionSpace>::In3, Views<Kokkos::DefaultExecutionSpace>::In3,
    Views<Kokkos::DefaultExecutionSpace>::In3, Views<Kokkos::DefaultExecutionSpace>::In2,
    Views<Kokkos::DefaultExecutionSpace>::In3, const VarlenBatch&,
    Views<Kokkos::DefaultExecutionSpace>::Out3, Views<Kokkos::DefaultExecutionSpace>::Out3,
    Views<Kokkos::DefaultExecutionSpace>::Out3, const KernelConfig&, float);
extern template bool usesHostKernels<Kokkos::DefaultExecutionSpace>(int, const KernelConfig&);
extern template void forward<Kokkos::DefaultExecutionSpace>(
    const Kokkos::DefaultExecutionSpace&, Views<Kokkos::DefaultExecutionSpace>::In3b,
    Views<Kokkos::DefaultExecutionSpace>::In3b, Views<Kokkos::DefaultExecutionSpace>::In3b,
    const VarlenBatch&, Views<Kokkos::DefaultExecutionSpace>::Out3b,
    Views<Kokkos::DefaultExecutionSpace>::Out2, const KernelConfig&, float);
extern template void backward<Kokkos::DefaultExecutionSpace>(
    const Kokkos::DefaultExecutionSpace&, Views<Kokkos::DefaultExecutionSpace>::In3b,
    Views<Kokkos::DefaultExecutionSpace>::In3b, Views<Kokkos::DefaultExecutionSpace>::In3b,
    Views<Kokkos::DefaultExecutionSpace>::In3b, Views<Kokkos::DefaultExecutionSpace>::In2,
    Views<Kokkos::DefaultExecutionSpace>::In3b, const VarlenBatch&,
    Views<Kokkos::DefaultExecutionSpace>::Out3, Views<Kokkos::DefaultExecutionSpace>::Out3,
    Views<Kokkos::DefaultExecutionSpace>::Out3, const KernelConfig&, float);
extern template const char* kernelName<Kokkos::DefaultExecutionSpace>(int, const KernelConfig&, bool);

}  // namespace wlb::attention
