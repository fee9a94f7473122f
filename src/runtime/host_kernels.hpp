#pragma once
/// \file host_kernels.hpp
/// \brief Internal: vectorised host (CPU) bodies of executor kernels the compiler left
/// scalar. The SwiGLU and the loss's cross-entropy called libm's expf, which keeps a loop
/// from vectorising (the SwiGLU forward and backward ran at 5-6 ns per element on a 2-core
/// AMD EPYC, all of it the exponential); the RMSNorm summed each row as one float chain,
/// which the compiler may not reorder into vector lanes by itself. The caller's labelled
/// Kokkos kernel hands out the work: chunks of kChunk elements (SwiGLU), rows
/// (cross-entropy, RMSNorm) or blocks of rows (the gain's gradient). Defined where
/// WLB_ATTN_HOST_SIMD is 1 (GCC/Clang host compilers); elsewhere the Kokkos lambdas run.
/// A ragged end runs as a whole vector on a padded copy, so an element's result never
/// depends on where a chunk or the array ends.

#include <cstdint>

#include "attention/attention_host.hpp"  // WLB_ATTN_HOST_SIMD
#include "attention/bf16.hpp"

namespace wlb::runtime::simd {

#if WLB_ATTN_HOST_SIMD
/// The executor's space (Kokkos' default) runs on the host: its kernels take these bodies.
inline constexpr bool kOnHost =
    Kokkos::SpaceAccessibility<Kokkos::DefaultExecutionSpace, Kokkos::HostSpace>::accessible;
#endif

/// Elements per work item of the chunked host kernels (a multiple of every vector width).
inline constexpr std::int64_t kChunk = 4096;

/// s = silu(a1) * a3 = a1 sigmoid(a1) a3, elementwise.
template <class T>
void swiglu(const T* a1, const T* a3, T* s, std::int64_t b, std::int64_t e);

/// The SwiGLU backward from ds = dL/ds: da1 = ds a3 sg (1 + a1 (1 - sg)), da3 = ds a1 sg
/// with sg = sigmoid(a1). da3 may be a3 itself (each element is read before it is written).
template <class T>
void swigluBackward(const T* a1, const T* a3, const T* ds, T* da1, T* da3, std::int64_t b, std::int64_t e);

/// One row's cross-entropy over V logits z (FP32): returns lse(z) - z[target]; with dl, also
/// writes dl[j] = (softmax(z)_j - [j == target]) * scale in storage T. dl may be z itself
/// (FP32 storage: the gradient over the logits). Reads the row three times (maximum, sum of
/// exponentials, gradient), one exponential per element and pass: a row of a CPU run's
/// vocabulary stays in cache between them, where the device kernel folds the first two into
/// one online pass at the price of two exponentials per element.
template <class T>
float crossEntropyRow(const float* z, std::int64_t V, std::int64_t target, float scale, T* dl);

/// RMSNorm of one row of h values: returns rstd = 1 / sqrt(mean(x^2) + eps) and writes
/// y = x rstd g in storage T.
template <class T>
float rmsNormRow(const float* x, const float* g, float eps, std::int64_t h, T* y);

/// RMSNorm backward of one row (rstd r): dx += r (g dy - x r mean(g dy x r)).
void rmsNormBackwardRow(const float* x, const float* g, const float* dy, float r, std::int64_t h, float* dx);

/// out[j] += the sum of x(rows[k], j) over k in [b, e), formed from 0 in the order of k and
/// then added (what the device kernel of the embedding's gradient computes, bit for bit);
/// the columns run as vectors, blocks of them held in registers while the rows stream by.
void sumRowsInto(const float* x, std::int64_t ldx, const std::int32_t* rows, std::int64_t b, std::int64_t e,
                 std::int64_t h, float* out);

/// An RMSNorm gain's gradient over rows [i0, i1) (row strides ldx, lddy): part[j] = sum of
/// dy(i, j) x(i, j) rstd(i), rows in order; the columns run as vectors.
void gainGradRows(const float* x, std::int64_t ldx, const float* dy, std::int64_t lddy, const float* rstd,
                  std::int64_t i0, std::int64_t i1, std::int64_t h, float* part);

}  // namespace wlb::runtime::simd
