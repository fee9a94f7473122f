#pragma once
/// \file host_simd.hpp
/// \brief Internal: the vector vocabulary of the host (CPU) kernels — one native register of
/// floats (16 lanes with AVX-512, 8 otherwise), loads, stores, broadcasts, FMA, reductions,
/// 2^x for the softmax and e^x for everything else — shared by the attention's host path
/// (attention_host.cpp) and the executor's elementwise host kernels (runtime/host_kernels).
/// Include only where WLB_ATTN_HOST_SIMD is 1 (attention_host.hpp decides: GCC/Clang host
/// compilers, not nvcc/hipcc device compilation).

#include <cstdint>
#include <cstring>

#include "attention/attention_host.hpp"

#if !WLB_ATTN_HOST_SIMD
#error "attention/host_simd.hpp needs a GCC/Clang host compiler (WLB_ATTN_HOST_SIMD)"
#endif

// Vector path, decided once: AVX-512 intrinsics, AVX2+FMA intrinsics, or plain GCC vectors.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define WLB_HOST_AVX2 1
#else
#define WLB_HOST_AVX2 0
#endif
#if defined(__AVX512F__) || WLB_HOST_AVX2
#include <immintrin.h>
#endif

// GCC 12 flags _mm512_undefined_ps inside the AVX-512 reduce intrinsics.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace wlb::attention::host {

// ---- W-float vectors -------------------------------------------------------------------
// One native register: 16 floats (zmm) with AVX-512, 8 (ymm) otherwise. A wider GCC vector
// than the hardware has is split into pieces by the compiler and the register-blocked
// micro-kernels then spill, so the width follows the target (-march=native).
#if defined(__AVX512F__)
#define WLB_VW 16
#else
#define WLB_VW 8
#endif
constexpr int W = WLB_VW;
// typedefs, not aliases: GCC documents its vector, alignment and may_alias attributes on
// typedef declarations
// NOLINTBEGIN(modernize-use-using)
typedef float vf __attribute__((vector_size(4 * WLB_VW)));
typedef float vfu __attribute__((vector_size(4 * WLB_VW), aligned(4), may_alias));
typedef int vi __attribute__((vector_size(4 * WLB_VW)));
// NOLINTEND(modernize-use-using)

#define WLB_AI inline __attribute__((always_inline))

WLB_AI vf ld(const float* p) {
  return *reinterpret_cast<const vfu*>(p);
}
WLB_AI void st(float* p, vf x) {
  *reinterpret_cast<vfu*>(p) = x;
}
WLB_AI vf bc(float x) {
  // an intrinsic, not vf{} + x: the add of +0.0 cannot be folded (it maps -0 to +0), and
  // would put an extra add in front of every broadcast of the micro-kernels
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif WLB_HOST_AVX2
  return _mm256_set1_ps(x);
#else
  vf r;
  for (int i = 0; i < W; ++i) r[i] = x;
  return r;
#endif
}
WLB_AI vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif WLB_HOST_AVX2
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}
WLB_AI vf vmax(vf a, vf b) {
#if defined(__AVX512F__)
  return _mm512_max_ps(a, b);
#elif WLB_HOST_AVX2
  return _mm256_max_ps(a, b);
#else
  return a > b ? a : b;
#endif
}
WLB_AI float hmax(vf a) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(a);
#else
  float m = a[0];
  for (int i = 1; i < W; ++i) m = a[i] > m ? a[i] : m;
  return m;
#endif
}
WLB_AI float hsum(vf a) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(a);
#else
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += a[i];
  return s;
#endif
}
/// any lane of a > b
WLB_AI bool anyGreater(vf a, float b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(a, _mm512_set1_ps(b), _CMP_GT_OQ) != 0;
#elif WLB_HOST_AVX2
  return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(b), _CMP_GT_OQ)) != 0;
#else
  for (int i = 0; i < W; ++i)
    if (a[i] > b) return true;
  return false;
#endif
}
WLB_AI vi iotaW() {
  vi r;
  for (int i = 0; i < W; ++i) r[i] = i;
  return r;
}
WLB_AI vi bci(int x) {
  return vi{} + x;
}

/// 2^x for x <= ~0 (scores minus the running max); 0 for x < -126 and -inf; relative error
/// < 2e-7 (degree-5 minimax polynomial of 2^f on f in [-0.5, 0.5], evaluated in float).
WLB_AI vf exp2v(vf x) {
  constexpr float c1 = 6.9314700365e-01f, c2 = 2.4022242427e-01f, c3 = 5.5507335812e-02f, c4 = 9.6715129912e-03f,
                  c5 = 1.3264727313e-03f;
#if defined(__AVX512F__)
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.0f));
  const vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = x - n;
  vf p = fmadd(bc(c5), f, bc(c4));
  p = fmadd(p, f, bc(c3));
  p = fmadd(p, f, bc(c2));
  p = fmadd(p, f, bc(c1));
  p = fmadd(p, f, bc(1.0f));
  return _mm512_scalef_ps(p, n);
#else
  const vi under = x < bc(-126.0f);
  x = under ? bc(-126.0f) : x;
#if WLB_HOST_AVX2
  const vf n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vi ni = __builtin_convertvector(n, vi);
#else
  const vi ni = __builtin_convertvector(x + 128.5f, vi) - 128;  // floor(x + 0.5)
  const vf n = __builtin_convertvector(ni, vf);
#endif
  const vf f = x - n;
  vf p = fmadd(bc(c5), f, bc(c4));
  p = fmadd(p, f, bc(c3));
  p = fmadd(p, f, bc(c2));
  p = fmadd(p, f, bc(c1));
  p = fmadd(p, f, bc(1.0f));
  vf sc;
  const vi bits = (ni + 127) << 23;
  std::memcpy(&sc, &bits, sizeof sc);
  const vf r = p * sc;
  return under ? vf{} : r;
#endif
}

WLB_AI vf vmin(vf a, vf b) {
#if defined(__AVX512F__)
  return _mm512_min_ps(a, b);
#elif WLB_HOST_AVX2
  return _mm256_min_ps(a, b);
#else
  return a < b ? a : b;
#endif
}

/// e^x over the whole float range, relative error about 1e-7 (libm's expf: 0.5 ulp): x = n
/// ln2 + r with ln2 in two parts (Cody-Waite, n ln2_hi exact), |r| <= ln2 / 2, and e^r by its
/// degree-7 Taylor polynomial (remainder < 1.2e-8). x is clamped to [-87, 88] first, so the
/// result saturates at e^-87 and e^88 instead of reaching 0 or inf; NaN stays NaN (the clamps
/// return their second operand, x, for a NaN). For the elementwise host kernels (sigmoid,
/// softmax of the loss), where libm's scalar expf keeps a loop from vectorising.
WLB_AI vf expv(vf x) {
  x = vmin(bc(88.0f), vmax(bc(-87.0f), x));
  const vf y = x * bc(1.4426950408889634f);
#if defined(__AVX512F__)
  const vf n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif WLB_HOST_AVX2
  const vf n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf n = (y + bc(12582912.0f)) - bc(12582912.0f);  // round to nearest: 1.5 * 2^23
#endif
  vf r = fmadd(n, bc(-0.693145751953125f), x);
  r = fmadd(n, bc(-1.428606820309417e-06f), r);
  vf p = fmadd(bc(1.0f / 5040.0f), r, bc(1.0f / 720.0f));
  p = fmadd(p, r, bc(1.0f / 120.0f));
  p = fmadd(p, r, bc(1.0f / 24.0f));
  p = fmadd(p, r, bc(1.0f / 6.0f));
  p = fmadd(p, r, bc(0.5f));
  p = fmadd(p, r, bc(1.0f));
  p = fmadd(p, r, bc(1.0f));
  vf sc;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  std::memcpy(&sc, &bits, sizeof sc);
  return p * sc;
}

// ---- 8 x 8 transposes (the tile packers of attention_host.cpp) ------------------------
// Blocks of 8 whatever W is: head_dim and the tiles are multiples of 16. With AVX (the
// haswell and skylake-avx512 targets and native builds) a block goes through eight ymm
// registers: eight row loads and eight stores instead of 64 strided scalar ones.

#if defined(__AVX__)
WLB_AI void transpose8x8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

/// dst[c * ldd + r] = s * src[r * lds + c] for r, c < 8; rows r >= n (0 <= n <= 8) are read
/// as zeros and src is not touched for them.
WLB_AI void packTransposed8(const float* src, std::int64_t lds, std::int64_t n, float* dst, std::int64_t ldd, float s) {
#if defined(__AVX__)
  __m256 r[8];
  const __m256 sv = _mm256_set1_ps(s);
  for (int i = 0; i < 8; ++i) r[i] = i < n ? _mm256_mul_ps(_mm256_loadu_ps(src + i * lds), sv) : _mm256_setzero_ps();
  transpose8x8(r);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * ldd, r[i]);
#else
  for (int c = 0; c < 8; ++c)
    for (int i = 0; i < 8; ++i) dst[c * ldd + i] = i < n ? src[i * lds + c] * s : 0.0f;
#endif
}

/// dst[r * ldd + c] += s * src[c * lds + r] for r < n (0 <= n <= 8), c < 8: a block of a
/// transposed tile added back into rows.
WLB_AI void addTransposed8(const float* src, std::int64_t lds, float* dst, std::int64_t ldd, std::int64_t n, float s) {
#if defined(__AVX__)
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  transpose8x8(r);
  const __m256 sv = _mm256_set1_ps(s);
  for (int i = 0; i < n; ++i)
    _mm256_storeu_ps(dst + i * ldd, _mm256_add_ps(_mm256_loadu_ps(dst + i * ldd), _mm256_mul_ps(sv, r[i])));
#else
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < 8; ++c) dst[i * ldd + c] += s * src[c * lds + i];
#endif
}

}  // namespace wlb::attention::host

#pragma GCC diagnostic pop
