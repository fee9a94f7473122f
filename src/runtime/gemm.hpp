#pragma once
/// \file gemm.hpp
/// \brief The transformer layer's GEMMs behind a small Kokkos-View interface. Host memory
/// spaces call single-threaded CBLAS `sgemm` (OpenBLAS; one core per MPI rank), other
/// memory spaces a portable Kokkos kernel.

#include <Kokkos_Core.hpp>

#include <string>

namespace wlb::runtime {

using Space = Kokkos::DefaultExecutionSpace;
using Mem = Space::memory_space;
/// Row-major matrices / activations ([tokens][features]).
using Mat = Kokkos::View<float**, Kokkos::LayoutRight, Mem>;
using CMat = Kokkos::View<const float**, Kokkos::LayoutRight, Mem>;
/// [tokens][heads][head_dim] activations (attention layout).
using Act3 = Kokkos::View<float***, Kokkos::LayoutRight, Mem>;

enum class Trans : int { N, T };

/// C = alpha * op(A) * op(B) + beta * C (row-major). Throws std::invalid_argument on
/// shape mismatch. Enqueued on `space`; the CBLAS path runs synchronously after a fence.
void gemm(const Space& space, Trans ta, Trans tb, float alpha, CMat a, CMat b, float beta, Mat c);

/// The same storage viewed as [tokens][heads*head_dim] (unmanaged, no copy).
Mat flat(const Act3& v);

/// "cblas" or "kokkos" (which path gemm() takes for the default memory space).
std::string gemmBackend();

/// 2*m*n*k.
inline double gemmFlops(double m, double n, double k) {
  return 2.0 * m * n * k;
}

}  // namespace wlb::runtime
