#pragma once
/// \file host_kernels.hpp
/// \brief Internal: vectorised host (CPU) bodies of the executor's kernels whose scalar form
/// calls libm's expf, which keeps the compiler from vectorising the loop (the SwiGLU forward
/// and backward ran at about 5 ns per element on a 2-core AMD EPYC, all of it the
/// exponential): the SwiGLU and the loss's cross-entropy. Each call covers elements [b, e) of contiguous arrays; the
/// caller's labelled Kokkos kernel hands out chunks. Defined where WLB_ATTN_HOST_SIMD is 1 (GCC/Clang host compilers);
/// elsewhere the Kokkos lambdas run. A ragged end runs as a whole vector on a padded copy, so an element's result never
/// depends on where a chunk or the array ends.

#include <cstdint>

#include "attention/attention_host.hpp"  // WLB_ATTN_HOST_SIMD
#include "attention/bf16.hpp"

namespace wlb::runtime::simd {

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

}  // namespace wlb::runtime::simd
