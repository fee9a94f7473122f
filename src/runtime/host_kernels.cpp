// Vectorised host bodies of the executor's elementwise kernels (see host_kernels.hpp).
#include "runtime/host_kernels.hpp"

#if WLB_ATTN_HOST_SIMD

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attention/host_simd.hpp"

namespace wlb::runtime::simd {
namespace {

namespace hs = attention::host;
using hs::vf;
using hs::vi;
constexpr int W = hs::W;
// typedefs, not aliases: GCC documents its vector, alignment and may_alias attributes on
// typedef declarations
// NOLINTBEGIN(modernize-use-using)
typedef std::uint16_t vh __attribute__((vector_size(2 * WLB_VW)));
typedef std::uint16_t vhu __attribute__((vector_size(2 * WLB_VW), aligned(2), may_alias));
typedef std::uint32_t vu __attribute__((vector_size(4 * WLB_VW)));
// NOLINTEND(modernize-use-using)

// W values of the storage type, widened to float / rounded back (bf16.hpp's conversions:
// round to nearest even, a NaN stays a quiet NaN).
WLB_AI vf load(const float* p) {
  return hs::ld(p);
}
WLB_AI vf load(const attention::bf16* p) {
  const vu u = __builtin_convertvector(*reinterpret_cast<const vhu*>(p), vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
WLB_AI void store(float* p, vf x) {
  hs::st(p, x);
}
WLB_AI void store(attention::bf16* p, vf x) {
  vu u;
  std::memcpy(&u, &x, sizeof u);
  const vu nan = ((u & 0x7f800000u) == 0x7f800000u) & ((u & 0x007fffffu) != 0u);
  const vu rounded = (u + (0x7fffu + ((u >> 16) & 1u))) >> 16;
  const vu bits = nan ? ((u >> 16) | 0x0040u) : rounded;
  *reinterpret_cast<vhu*>(p) = __builtin_convertvector(bits, vh);
}

WLB_AI vf sigmoid(vf v) {
  return hs::bc(1.0f) / (hs::bc(1.0f) + hs::expv(-v));
}

/// Runs body(i) on the full vectors of [b, e) in place, and on the ragged end through
/// padded copies of the NI inputs and NO outputs (zeros past the end; nothing past it is
/// written).
template <class T, int NI, int NO, class Body>
WLB_AI void vectors(const T* const (&in)[NI], T* const (&out)[NO], std::int64_t b, std::int64_t e, Body body) {
  std::int64_t i = b;
  for (; i + W <= e; i += W) body(in, out, i);
  if (i == e) return;
  const std::int64_t m = e - i;
  T pin[NI][W] = {}, pout[NO][W] = {};
  const T* pi[NI];
  T* po[NO];
  for (int k = 0; k < NI; ++k) {
    std::copy(in[k] + i, in[k] + e, pin[k]);
    pi[k] = pin[k];
  }
  for (int k = 0; k < NO; ++k) po[k] = pout[k];
  body(pi, po, 0);
  for (int k = 0; k < NO; ++k) std::copy(pout[k], pout[k] + m, out[k] + i);
}

}  // namespace

template <class T>
void swiglu(const T* a1, const T* a3, T* s, std::int64_t b, std::int64_t e) {
  const T* const in[2] = {a1, a3};
  T* const out[1] = {s};
  vectors<T, 2, 1>(in, out, b, e, [](const T* const(&x)[2], T* const(&y)[1], std::int64_t i) {
    const vf v = load(x[0] + i);
    store(y[0] + i, v * sigmoid(v) * load(x[1] + i));
  });
}

template <class T>
void swigluBackward(const T* a1, const T* a3, const T* ds, T* da1, T* da3, std::int64_t b, std::int64_t e) {
  const T* const in[3] = {a1, a3, ds};
  T* const out[2] = {da1, da3};
  vectors<T, 3, 2>(in, out, b, e, [](const T* const(&x)[3], T* const(&y)[2], std::int64_t i) {
    const vf v = load(x[0] + i), a3v = load(x[1] + i), d = load(x[2] + i);
    const vf sg = sigmoid(v);
    store(y[0] + i, d * a3v * sg * (hs::bc(1.0f) + v * (hs::bc(1.0f) - sg)));
    store(y[1] + i, d * v * sg);
  });
}

template <class T>
float crossEntropyRow(const float* z, std::int64_t V, std::int64_t target, float scale, T* dl) {
  const std::int64_t full = V - V % W, m = V - full;
  float tail[W];  // the ragged end, padded with the row's first value (harmless to a maximum)
  for (int l = 0; l < W; ++l) tail[l] = l < m ? z[full + l] : z[0];
  // maximum (exact in any order)
  vf mv = hs::ld(tail);
  for (std::int64_t j = 0; j < full; j += W) mv = hs::vmax(mv, hs::ld(z + j));
  const float mx = hs::hmax(mv);
  // sum of exponentials; pad lanes of the ragged end add nothing
  const vf vmx = hs::bc(mx);
  vf sv{};
  for (std::int64_t j = 0; j < full; j += W) sv += hs::expv(hs::ld(z + j) - vmx);
  if (m > 0) {
    const vf e = hs::expv(hs::ld(tail) - vmx);
    sv += hs::iotaW() < hs::bci(static_cast<int>(m)) ? e : vf{};
  }
  const float lse = mx + std::log(hs::hsum(sv));
  const float loss = lse - z[target];  // before dl may overwrite z
  if (dl == nullptr) return loss;
  // dL/dz = (softmax - one-hot) * scale
  const vf vl = hs::bc(lse), vs = hs::bc(scale), one = hs::bc(1.0f);
  const auto grad = [&](const float* zj, std::int64_t j, T* out) {
    vf p = hs::expv(hs::ld(zj) - vl);
    if (target >= j && target < j + W) p -= hs::iotaW() == hs::bci(static_cast<int>(target - j)) ? one : vf{};
    store(out, p * vs);
  };
  for (std::int64_t j = 0; j < full; j += W) grad(z + j, j, dl + j);
  if (m > 0) {
    T out[W];
    grad(tail, full, out);
    std::copy(out, out + m, dl + full);
  }
  return loss;
}

template <class T>
float rmsNormRow(const float* x, const float* g, float eps, std::int64_t h, T* y) {
  const std::int64_t full = h - h % W, m = h - full;
  vf acc{};
  for (std::int64_t j = 0; j < full; j += W) {
    const vf v = hs::ld(x + j);
    acc = hs::fmadd(v, v, acc);
  }
  float tx[W] = {}, tg[W] = {};  // the ragged end, zero-padded (adds nothing to the sum)
  std::copy(x + full, x + h, tx);
  std::copy(g + full, g + h, tg);
  const vf vt = hs::ld(tx);
  acc = hs::fmadd(vt, vt, acc);
  const float r = 1.0f / std::sqrt(hs::hsum(acc) / static_cast<float>(h) + eps);
  const vf vr = hs::bc(r);
  for (std::int64_t j = 0; j < full; j += W) store(y + j, hs::ld(x + j) * vr * hs::ld(g + j));
  if (m > 0) {
    T out[W];
    store(out, vt * vr * hs::ld(tg));
    std::copy(out, out + m, y + full);
  }
  return r;
}

void rmsNormBackwardRow(const float* x, const float* g, const float* dy, float r, std::int64_t h, float* dx) {
  const std::int64_t full = h - h % W, m = h - full;
  const vf vr = hs::bc(r);
  vf acc{};
  for (std::int64_t j = 0; j < full; j += W) acc += hs::ld(g + j) * hs::ld(dy + j) * hs::ld(x + j) * vr;
  float tx[W] = {}, tg[W] = {}, tdy[W] = {}, tdx[W] = {};  // the ragged end, zero-padded
  std::copy(x + full, x + h, tx);
  std::copy(g + full, g + h, tg);
  std::copy(dy + full, dy + h, tdy);
  std::copy(dx + full, dx + h, tdx);
  acc += hs::ld(tg) * hs::ld(tdy) * hs::ld(tx) * vr;
  const vf dot = hs::bc(hs::hsum(acc) / static_cast<float>(h));
  const auto step = [&](const float* xj, const float* gj, const float* dyj, float* dxj) {
    hs::st(dxj, hs::ld(dxj) + vr * (hs::ld(gj) * hs::ld(dyj) - hs::ld(xj) * vr * dot));
  };
  for (std::int64_t j = 0; j < full; j += W) step(x + j, g + j, dy + j, dx + j);
  if (m > 0) {
    step(tx, tg, tdy, tdx);
    std::copy(tdx, tdx + m, dx + full);
  }
}

void gainGradRows(const float* x, std::int64_t ldx, const float* dy, std::int64_t lddy, const float* rstd,
                  std::int64_t i0, std::int64_t i1, std::int64_t h, float* part) {
  const std::int64_t full = h - h % W;
  std::fill(part, part + h, 0.0f);
  for (std::int64_t i = i0; i < i1; ++i) {
    const float* xi = x + i * ldx;
    const float* dyi = dy + i * lddy;
    const vf vr = hs::bc(rstd[i]);
    for (std::int64_t j = 0; j < full; j += W)
      hs::st(part + j, hs::ld(part + j) + hs::ld(dyi + j) * hs::ld(xi + j) * vr);
    for (std::int64_t j = full; j < h; ++j) part[j] += dyi[j] * xi[j] * rstd[i];
  }
}

void sumRowsInto(const float* x, std::int64_t ldx, const std::int32_t* rows, std::int64_t b, std::int64_t e,
                 std::int64_t h, float* out) {
  constexpr std::int64_t kAcc = 8;  // independent accumulators: loads, not the add latency, set the pace
  constexpr std::int64_t kVec = W;
  std::int64_t j = 0;
  for (; j + kAcc * kVec <= h; j += kAcc * kVec) {
    vf acc[kAcc] = {};
    for (std::int64_t k = b; k < e; ++k) {
      const float* r = x + rows[k] * ldx + j;
#pragma GCC unroll 8
      for (std::int64_t a = 0; a < kAcc; ++a) acc[a] += hs::ld(r + a * kVec);
    }
#pragma GCC unroll 8
    for (std::int64_t a = 0; a < kAcc; ++a) hs::st(out + j + a * kVec, hs::ld(out + j + a * kVec) + acc[a]);
  }
  for (; j + kVec <= h; j += kVec) {
    vf acc{};
    for (std::int64_t k = b; k < e; ++k) acc += hs::ld(x + rows[k] * ldx + j);
    hs::st(out + j, hs::ld(out + j) + acc);
  }
  for (; j < h; ++j) {
    float acc = 0.0f;
    for (std::int64_t k = b; k < e; ++k) acc += x[rows[k] * ldx + j];
    out[j] += acc;
  }
}

template void swiglu<float>(const float*, const float*, float*, std::int64_t, std::int64_t);
template void swiglu<attention::bf16>(const attention::bf16*, const attention::bf16*, attention::bf16*, std::int64_t,
                                      std::int64_t);
template void swigluBackward<float>(const float*, const float*, const float*, float*, float*, std::int64_t,
                                    std::int64_t);
template void swigluBackward<attention::bf16>(const attention::bf16*, const attention::bf16*, const attention::bf16*,
                                              attention::bf16*, attention::bf16*, std::int64_t, std::int64_t);
template float crossEntropyRow<float>(const float*, std::int64_t, std::int64_t, float, float*);
template float crossEntropyRow<attention::bf16>(const float*, std::int64_t, std::int64_t, float, attention::bf16*);
template float rmsNormRow<float>(const float*, const float*, float, std::int64_t, float*);
template float rmsNormRow<attention::bf16>(const float*, const float*, float, std::int64_t, attention::bf16*);

}  // namespace wlb::runtime::simd

#endif  // WLB_ATTN_HOST_SIMD
