/// \file gemm.cpp
/// \brief CBLAS / Kokkos-Kernels / portable GEMM behind the View interface of gemm.hpp.

#include "runtime/gemm.hpp"

#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"

// Kokkos-Kernels serves device memory only (host keeps the single-threaded CBLAS path).
#if defined(WLB_HAVE_KOKKOSKERNELS) && \
    (defined(KOKKOS_ENABLE_CUDA) || defined(KOKKOS_ENABLE_HIP) || defined(KOKKOS_ENABLE_SYCL))
#include <KokkosBlas3_gemm.hpp>
#if defined(KOKKOS_ENABLE_CUDA) && defined(KOKKOSKERNELS_ENABLE_TPL_CUBLAS)
#include <cublas_v2.h>
#include <KokkosBlas_tpl_spec.hpp>  // CudaBlasSingleton: the handle KokkosBlas::gemm uses
#define WLB_GEMM_CUBLAS_EX 1
#endif
#define WLB_GEMM_KK 1
#else
#define WLB_GEMM_KK 0
#endif
#if !defined(WLB_GEMM_CUBLAS_EX)
#define WLB_GEMM_CUBLAS_EX 0
#endif

#if defined(WLB_HAVE_CBLAS)
#include <cblas.h>
#define WLB_GEMM_CBLAS 1
#else
// Fortran BLAS (any vendor): column-major sgemm.
extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                       const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);
#define WLB_GEMM_CBLAS 0
#endif

namespace wlb::runtime {
namespace {

constexpr bool kHostMem = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;

void singleThreadedBlas() {
#if WLB_GEMM_CBLAS && defined(OPENBLAS_VERSION)
  // One core per MPI rank: the pthread OpenBLAS would otherwise oversubscribe the node.
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
#endif
}

template <class V>
std::int64_t rowsOf(const V& v, Trans t) {
  return t == Trans::N ? static_cast<std::int64_t>(v.extent(0)) : static_cast<std::int64_t>(v.extent(1));
}
template <class V>
std::int64_t colsOf(const V& v, Trans t) {
  return t == Trans::N ? static_cast<std::int64_t>(v.extent(1)) : static_cast<std::int64_t>(v.extent(0));
}

#if WLB_GEMM_CUBLAS_EX
// TF32 / BF16 products on FP32 storage: cublasGemmEx with a reduced-precision compute
// type on the handle Kokkos-Kernels owns, on the instance's stream. Row-major C = A B is
// column-major C^T = B^T A^T.
void cublasReduced(const Space& space, Trans ta, Trans tb, float alpha, const CMat& a, const CMat& b, float beta,
                   const Mat& c, std::int64_t m, std::int64_t n, std::int64_t k, Precision p) {
  auto& s = KokkosBlas::Impl::CudaBlasSingleton::singleton();
  const cublasComputeType_t ct = p == Precision::Tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F_FAST_16BF;
  const cublasOperation_t opa = ta == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t opb = tb == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  cublasStatus_t st = cublasSetStream(s.handle, space.cuda_stream());
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasGemmEx(s.handle, opb, opa, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha,
                      b.data(), CUDA_R_32F, static_cast<int>(b.extent(1)), a.data(), CUDA_R_32F,
                      static_cast<int>(a.extent(1)), &beta, c.data(), CUDA_R_32F, static_cast<int>(c.extent(1)), ct,
                      CUBLAS_GEMM_DEFAULT);
  cublasSetStream(s.handle, nullptr);
  if (st != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("wlb::runtime::gemm: cublasGemmEx failed: ") + cublasGetStatusString(st));
}
// BF16 A and B, FP32 accumulation, C in FP32 or BF16 (ctype).
void cublasBf16(const Space& space, Trans ta, Trans tb, float alpha, const CBMat& a, const CBMat& b, float beta,
                void* c, cudaDataType_t ctype, std::int64_t ldc, std::int64_t m, std::int64_t n, std::int64_t k) {
  auto& s = KokkosBlas::Impl::CudaBlasSingleton::singleton();
  const cublasOperation_t opa = ta == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t opb = tb == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;
  cublasStatus_t st = cublasSetStream(s.handle, space.cuda_stream());
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasGemmEx(s.handle, opb, opa, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha,
                      b.data(), CUDA_R_16BF, static_cast<int>(b.extent(1)), a.data(), CUDA_R_16BF,
                      static_cast<int>(a.extent(1)), &beta, c, ctype, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
  cublasSetStream(s.handle, nullptr);
  if (st != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("wlb::runtime::gemm: cublasGemmEx (bf16) failed: ") +
                             cublasGetStatusString(st));
}
#endif

void checkShapes(std::int64_t m, std::int64_t k, std::int64_t kb, std::int64_t n, std::int64_t cm, std::int64_t cn) {
  if (kb != k || cm != m || cn != n)
    throw std::invalid_argument("wlb::runtime::gemm: shape mismatch (" + std::to_string(m) + "x" + std::to_string(k) +
                                " * " + std::to_string(kb) + "x" + std::to_string(n) + " -> " + std::to_string(cm) +
                                "x" + std::to_string(cn) + ")");
}

// Host scratch of the widened BF16 operands (grow-only, per thread: one core per rank).
std::vector<float>& scratch(int which) {
  thread_local std::vector<float> buf[3];
  return buf[which];
}
Mat widenedHost(const CBMat& v, int which) {
  auto& buf = scratch(which);
  const std::size_t n = v.size();
  if (buf.size() < n) buf.resize(n);
  const bf16* src = v.data();
  for (std::size_t i = 0; i < n; ++i) buf[i] = attention::toFloat(src[i]);
  return Mat(buf.data(), v.extent(0), v.extent(1));
}

// Portable kernel for BF16 operands (device backends without cuBLAS).
template <class C>
void portableBf16(const Space& space, bool at, bool bt, float alpha, const CBMat& a, const CBMat& b, float beta,
                  const C& c, std::int64_t m, std::int64_t n, std::int64_t k) {
  Kokkos::parallel_for(
      "wlb::runtime::gemm_bf16", Kokkos::MDRangePolicy<Space, Kokkos::Rank<2>>(space, {0, 0}, {m, n}),
      KOKKOS_LAMBDA(const std::int64_t i, const std::int64_t j) {
        float s = 0.0f;
        for (std::int64_t l = 0; l < k; ++l)
          s += attention::toFloat(at ? a(l, i) : a(i, l)) * attention::toFloat(bt ? b(j, l) : b(l, j));
        const float old = beta == 0.0f ? 0.0f : beta * attention::toFloat(c(i, j));
        c(i, j) = attention::fromFloat<typename C::non_const_value_type>(alpha * s + old);
      });
}

}  // namespace

const char* precisionName(Precision p) {
  switch (p) {
    case Precision::Fp32:
      return "fp32";
    case Precision::Tf32:
      return "tf32";
    case Precision::Bf16:
      return "bf16";
  }
  return "?";
}

Precision parsePrecision(const std::string& name, const std::string& key) {
  if (name == "fp32") return Precision::Fp32;
  if (name == "tf32") return Precision::Tf32;
  if (name == "bf16") return Precision::Bf16;
  throw InputError("key '" + key + "': unknown precision \"" + name + "\" (expected fp32, tf32 or bf16)");
}

void gemm(const Space& space, Trans ta, Trans tb, float alpha, CMat a, CMat b, float beta, Mat c, Precision precision) {
  const std::int64_t m = rowsOf(a, ta), k = colsOf(a, ta), n = colsOf(b, tb);
  checkShapes(m, k, rowsOf(b, tb), n, static_cast<std::int64_t>(c.extent(0)), static_cast<std::int64_t>(c.extent(1)));
  if (m == 0 || n == 0) return;
  if constexpr (kHostMem) {
    kk::fence(space, "wlb::runtime::gemm");
    if (k == 0) {
      // C = beta * C.
      for (std::int64_t i = 0; i < m * n; ++i) c.data()[i] = beta == 0.0f ? 0.0f : beta * c.data()[i];
      return;
    }
    singleThreadedBlas();
    const int lda = static_cast<int>(a.extent(1)), ldb = static_cast<int>(b.extent(1)),
              ldc = static_cast<int>(c.extent(1));
#if WLB_GEMM_CBLAS
    cblas_sgemm(CblasRowMajor, ta == Trans::N ? CblasNoTrans : CblasTrans, tb == Trans::N ? CblasNoTrans : CblasTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a.data(), lda, b.data(), ldb,
                beta, c.data(), ldc);
#else
    // Row-major C = op(A) op(B)  <=>  column-major C^T = op(B)^T op(A)^T.
    const char tA = ta == Trans::N ? 'N' : 'T', tB = tb == Trans::N ? 'N' : 'T';
    const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
    sgemm_(&tB, &tA, &ni, &mi, &ki, &alpha, b.data(), &ldb, a.data(), &lda, &beta, c.data(), &ldc);
#endif
  } else {
#if WLB_GEMM_KK
    if (k > 0) {
#if WLB_GEMM_CUBLAS_EX
      if (precision != Precision::Fp32) {
        cublasReduced(space, ta, tb, alpha, a, b, beta, c, m, n, k, precision);
        return;
      }
#endif
      const char* tA = ta == Trans::N ? "N" : "T";
      const char* tB = tb == Trans::N ? "N" : "T";
      KokkosBlas::gemm(space, tA, tB, alpha, a, b, beta, c);
      return;
    }
#endif
    (void)precision;
    // Portable path: one thread per output element (device backends without Kokkos-Kernels).
    const bool at = ta == Trans::T, bt = tb == Trans::T;
    Kokkos::parallel_for(
        "wlb::runtime::gemm", Kokkos::MDRangePolicy<Space, Kokkos::Rank<2>>(space, {0, 0}, {m, n}),
        KOKKOS_LAMBDA(const std::int64_t i, const std::int64_t j) {
          float s = 0.0f;
          for (std::int64_t l = 0; l < k; ++l) s += (at ? a(l, i) : a(i, l)) * (bt ? b(j, l) : b(l, j));
          c(i, j) = alpha * s + (beta == 0.0f ? 0.0f : beta * c(i, j));
        });
  }
}

namespace {

// BF16 operands into C of element type E (float or bf16).
template <class E>
void gemmBf16(const Space& space, Trans ta, Trans tb, float alpha, const CBMat& a, const CBMat& b, float beta,
              const MatT<E>& c) {
  const std::int64_t m = rowsOf(a, ta), k = colsOf(a, ta), n = colsOf(b, tb);
  checkShapes(m, k, rowsOf(b, tb), n, static_cast<std::int64_t>(c.extent(0)), static_cast<std::int64_t>(c.extent(1)));
  if (m == 0 || n == 0) return;
  if constexpr (kHostMem) {
    kk::fence(space, "wlb::runtime::gemm_bf16");
    if constexpr (std::is_same_v<E, float>) {
      gemm(space, ta, tb, alpha, widenedHost(a, 0), widenedHost(b, 1), beta, c, Precision::Fp32);
    } else {
      // an FP32 C in scratch, rounded once at the end
      auto& buf = scratch(2);
      const std::size_t sz = c.size();
      if (buf.size() < sz) buf.resize(sz);
      bf16* cd = c.data();
      if (beta != 0.0f)
        for (std::size_t i = 0; i < sz; ++i) buf[i] = attention::toFloat(cd[i]);
      const Mat cf(buf.data(), c.extent(0), c.extent(1));
      gemm(space, ta, tb, alpha, widenedHost(a, 0), widenedHost(b, 1), beta, cf, Precision::Fp32);
      for (std::size_t i = 0; i < sz; ++i) cd[i] = attention::toBf16(buf[i]);
    }
  } else {
#if WLB_GEMM_CUBLAS_EX
    if (k > 0) {
      cublasBf16(space, ta, tb, alpha, a, b, beta, c.data(), std::is_same_v<E, float> ? CUDA_R_32F : CUDA_R_16BF,
                 static_cast<std::int64_t>(c.extent(1)), m, n, k);
      return;
    }
#endif
    portableBf16(space, ta == Trans::T, tb == Trans::T, alpha, a, b, beta, c, m, n, k);
  }
}

}  // namespace

void gemm(const Space& space, Trans ta, Trans tb, float alpha, CBMat a, CBMat b, float beta, Mat c, Precision) {
  gemmBf16<float>(space, ta, tb, alpha, a, b, beta, c);
}

void gemm(const Space& space, Trans ta, Trans tb, float alpha, CBMat a, CBMat b, float beta, BMat c, Precision) {
  gemmBf16<bf16>(space, ta, tb, alpha, a, b, beta, c);
}

template <class T>
void convert(const Space& space, const Mat& src, const MatT<T>& dst) {
  if (src.extent(0) != dst.extent(0) || src.extent(1) != dst.extent(1))
    throw std::invalid_argument("wlb::runtime::convert: extents differ");
  const float* s = src.data();
  T* d = dst.data();
  Kokkos::parallel_for(
      "wlb::runtime::to_storage", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(src.size())),
      KOKKOS_LAMBDA(const std::int64_t i) { d[i] = attention::fromFloat<T>(s[i]); });
}
template void convert<float>(const Space&, const Mat&, const MatT<float>&);
template void convert<bf16>(const Space&, const Mat&, const MatT<bf16>&);

void widen(const Space& space, const CBMat& src, const Mat& dst) {
  if (src.extent(0) != dst.extent(0) || src.extent(1) != dst.extent(1))
    throw std::invalid_argument("wlb::runtime::widen: extents differ");
  const bf16* s = src.data();
  float* d = dst.data();
  Kokkos::parallel_for(
      "wlb::runtime::widen", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(src.size())),
      KOKKOS_LAMBDA(const std::int64_t i) { d[i] = attention::toFloat(s[i]); });
}

std::string gemmBackend() {
  if (!kHostMem) return WLB_GEMM_KK ? (WLB_GEMM_CUBLAS_EX ? "kokkos-kernels (cuBLAS)" : "kokkos-kernels") : "kokkos";
  return WLB_GEMM_CBLAS ? "cblas" : "blas";
}

}  // namespace wlb::runtime
