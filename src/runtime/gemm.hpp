#pragma once
/// \file gemm.hpp
/// \brief The transformer layer's GEMMs behind a small Kokkos-View interface. Host memory
/// spaces call single-threaded CBLAS `sgemm` (OpenBLAS; one core per MPI rank). Device
/// memory spaces call Kokkos-Kernels (`KokkosBlas::gemm`, cuBLAS on CUDA) when the build
/// has it from the same Kokkos installation, else a portable Kokkos kernel.

#include <Kokkos_Core.hpp>

#include <string>

#include "attention/bf16.hpp"
#include "attention/flops.hpp"
#include "core/kokkos_compat.hpp"

namespace wlb::runtime {

using Space = Kokkos::DefaultExecutionSpace;
using Mem = Space::memory_space;
/// Row-major matrices / activations ([tokens][features]).
using Mat = Kokkos::View<float**, Kokkos::LayoutRight, Mem>;
using CMat = Kokkos::View<const float**, Kokkos::LayoutRight, Mem>;
/// [tokens][heads][head_dim] activations (attention layout).
using Act3 = Kokkos::View<float***, Kokkos::LayoutRight, Mem>;

/// BF16 storage (run.precision = "bf16"): 16 raw bits, rounded to nearest even.
using attention::bf16;
/// Matrices and attention-layout activations of storage type T (float or bf16).
template <class T>
using MatT = Kokkos::View<T**, Kokkos::LayoutRight, Mem>;
template <class T>
using Act3T = Kokkos::View<T***, Kokkos::LayoutRight, Mem>;
using BMat = MatT<bf16>;
using CBMat = Kokkos::View<const bf16**, Kokkos::LayoutRight, Mem>;
using BAct3 = Act3T<bf16>;

enum class Trans : int { N, T };

/// Arithmetic of a run's matrix products: the attention kernels' modes (one enum).
/// Fp32: exact FP32. Tf32: FP32 storage, TF32 tensor cores. Bf16: operands rounded to
/// BF16, FP32 accumulation (cuBLAS compute type 32F_FAST_16BF), FP32 storage. On CUDA
/// with cuBLAS the modes differ; host and portable paths compute every mode in exact FP32
/// (at least as accurate), as the attention kernels do.
using Precision = attention::KernelConfig::Precision;
/// "fp32" | "tf32" | "bf16".
const char* precisionName(Precision p);
/// Parse a precision name; throws InputError naming `key` and the allowed values.
Precision parsePrecision(const std::string& name, const std::string& key = "run.precision");

/// C = alpha * op(A) * op(B) + beta * C (row-major). Throws std::invalid_argument on
/// shape mismatch. Enqueued on `space` (no fence on device backends); the CBLAS path runs
/// synchronously after a fence.
void gemm(const Space& space, Trans ta, Trans tb, float alpha, CMat a, CMat b, float beta, Mat c,
          Precision precision = Precision::Fp32);

/// BF16 operands, FP32 accumulation, C in FP32 or BF16 (cublasGemmEx with CUDA_R_16BF
/// on CUDA; elsewhere the operands are widened to FP32 scratch and multiplied by the FP32
/// path, which is exact for BF16 inputs). A BF16 C is read (beta != 0) and written once,
/// rounded. `precision` is ignored: BF16 storage means BF16 products.
void gemm(const Space& space, Trans ta, Trans tb, float alpha, CBMat a, CBMat b, float beta, Mat c,
          Precision precision = Precision::Bf16);
void gemm(const Space& space, Trans ta, Trans tb, float alpha, CBMat a, CBMat b, float beta, BMat c,
          Precision precision = Precision::Bf16);

/// The same storage viewed as [tokens][heads*head_dim] (unmanaged, no copy).
template <class T>
MatT<T> flat(const Act3T<T>& v) {
  return MatT<T>(v.data(), v.extent(0), v.extent(1) * v.extent(2));
}

/// `src` rounded into `dst` (same extents; FP32 -> BF16 or a copy).
template <class T>
void convert(const Space& space, const Mat& src, const MatT<T>& dst);
/// `src` widened into `dst` (BF16 -> FP32).
void widen(const Space& space, const CBMat& src, const Mat& dst);

/// Uninitialised activations, for outputs a kernel writes in full.
inline Mat newMat(const char* label, std::int64_t rows, std::int64_t cols) {
  return Mat(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), rows, cols);
}
inline Act3 newAct3(const char* label, std::int64_t tokens, int heads, int dim) {
  return Act3(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), tokens, heads, dim);
}

/// The SwiGLU gate's sigmoid, in kernels (the executor's layer and the trained model).
KOKKOS_INLINE_FUNCTION float sigmoid(float x) {
  return 1.0f / (1.0f + kk::exp(-x));
}

/// "cblas", "blas", "kokkos-kernels" or "kokkos" (which path gemm() takes for the default
/// memory space).
std::string gemmBackend();

/// 2*m*n*k.
inline double gemmFlops(double m, double n, double k) {
  return 2.0 * m * n * k;
}

}  // namespace wlb::runtime
