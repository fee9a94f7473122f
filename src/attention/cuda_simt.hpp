#pragma once
/// \file cuda_simt.hpp
/// \brief Internal: FP32 attention kernels on the CUDA cores (exact FP32 FFMA, no tensor
/// cores): FlashAttention-2 style forward and backward of the varlen causal GQA attention of
/// attention.hpp. Included only under KOKKOS_ENABLE_CUDA, after cuda_common.hpp.
///
/// Every kernel is a Kokkos TeamPolicy launch (vector length 1, so team_rank() is the linear
/// thread id and warps are consecutive ranks) with team scratch as shared memory. Team
/// scratch is capped at 48 KiB per team, which is what shapes the tiles: operands are staged
/// in chunks through two buffers filled by cp.async (the copy of chunk g+1 overlaps the math
/// on chunk g; one barrier per chunk), accumulators live in registers, and register tiles are
/// large enough (8x4 .. 8x8 outputs per thread) that shared-memory bandwidth (one register
/// per lane per clock per SM) is not the limit.
///
/// Forward  (64 threads, team = 32 query rows x one head): Q tile resident in scratch; per
///          key tile of 64 keys, K in 32-d chunks gives S (8 rows x 4 keys per thread), the
///          online softmax (row max over the 16 lanes of a row group by shuffles), P to
///          scratch, then V in chunks of 2048/D keys accumulates O (8 rows x D/16 columns per
///          thread) in registers.
/// Backward (256 threads, team = 64 keys x one KV head; loops over the group's query heads
///          and the 32-row query tiles that see the keys): threads 0..127 compute S^T = K Q^T
///          and accumulate dV += P^T dO, threads 128..255 compute dP^T = V dO^T and accumulate
///          dK += dS^T Q (8 keys x D/16 columns per thread each), all 256 compute
///          dQ = dS K for the tile and add it to dq with vector reductions (red.v4). dK/dV are
///          added with reductions at the end (pieces may share keys). LaunchBounds<256, 1>:
///          ~210 registers, no spills (a 128-register cap for 2 teams/SM spills a little).
///
/// Masking: the bottom-right causal mask is applied to every tile (a compare per score);
/// padded query rows load the piece's last row and padded keys its last key, so every value
/// stays finite; masked probabilities are exactly 0.

#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention/attention.hpp"
#include "attention/cuda_common.hpp"

#if defined(KOKKOS_ENABLE_CUDA)

#if defined(__CUDA_ARCH__)
#define WLB_SIMT_UNROLL _Pragma("unroll")
#define WLB_SIMT_NO_UNROLL _Pragma("unroll 1")
#else
#define WLB_SIMT_UNROLL
#define WLB_SIMT_NO_UNROLL
#endif

namespace wlb::attention::cuda {
namespace simt {

constexpr float kLn2 = 0.693147180559945309f;
constexpr float kLog2e = 1.442695040888963407f;

KOKKOS_INLINE_FUNCTION int imin(int x, int y) {
  return x < y ? x : y;
}
KOKKOS_INLINE_FUNCTION int imax(int x, int y) {
  return x > y ? x : y;
}
KOKKOS_INLINE_FUNCTION float4 ld4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
KOKKOS_INLINE_FUNCTION void st4(float* p, float4 v) {
  *reinterpret_cast<float4*>(p) = v;
}
KOKKOS_INLINE_FUNCTION float comp(const float4& v, int u) {
  return u == 0 ? v.x : (u == 1 ? v.y : (u == 2 ? v.z : v.w));
}
/// acc[0..3] += s * v
KOKKOS_INLINE_FUNCTION void fma4(float* acc, float s, const float4& v) {
  acc[0] = fmaf(s, v.x, acc[0]);
  acc[1] = fmaf(s, v.y, acc[1]);
  acc[2] = fmaf(s, v.z, acc[2]);
  acc[3] = fmaf(s, v.w, acc[3]);
}
/// acc += dot(x, y)
KOKKOS_INLINE_FUNCTION float dot4(float acc, const float4& x, const float4& y) {
  acc = fmaf(x.x, y.x, acc);
  acc = fmaf(x.y, y.y, acc);
  acc = fmaf(x.z, y.z, acc);
  return fmaf(x.w, y.w, acc);
}

/// The device operations the kernel bodies use (barrier, async copy, shuffle, exp2, vector
/// reduction). The bodies are templates on this type so that a host emulation can run them.
struct DeviceOps {
  KOKKOS_INLINE_FUNCTION void barrier() const {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
  }
  /// 16-byte global -> shared copy (asynchronous: visible after waitAll + barrier).
  KOKKOS_INLINE_FUNCTION void copy16(float* dst, const float* src) const {
#ifdef __CUDA_ARCH__
    ptx::cpAsync16(dst, src);
#else
    (void)dst;
    (void)src;
#endif
  }
  KOKKOS_INLINE_FUNCTION void commit() const {
#ifdef __CUDA_ARCH__
    ptx::cpAsyncCommit();
#endif
  }
  KOKKOS_INLINE_FUNCTION void waitAll() const {
#ifdef __CUDA_ARCH__
    ptx::cpAsyncWaitAll();
#endif
  }
  /// Butterfly shuffle; the team's threads call it together (all lanes of every warp).
  KOKKOS_INLINE_FUNCTION float shflXor(float v, int mask) const {
#ifdef __CUDA_ARCH__
    return __shfl_xor_sync(0xffffffffu, v, mask);
#else
    (void)mask;
    return v;
#endif
  }
  /// 2^x, max relative error ~2^-22 (MUFU.EX2); 2^-inf = 0.
  KOKKOS_INLINE_FUNCTION float ex2(float x) const {
#ifdef __CUDA_ARCH__
    return ptx::fastExp2(x);
#else
    return x;
#endif
  }
  /// dst[0..3] += v (global, 16-byte aligned), one vector reduction in L2 on sm_90.
  KOKKOS_INLINE_FUNCTION void add4(float* dst, float4 v) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
#elif defined(__CUDA_ARCH__)
    atomicAdd(dst, v.x);
    atomicAdd(dst + 1, v.y);
    atomicAdd(dst + 2, v.z);
    atomicAdd(dst + 3, v.w);
#else
    (void)dst;
    (void)v;
#endif
  }
};

// ============================== forward ===============================================

template <int D>
struct FwdCfg {
  static_assert(D == 64 || D == 128, "SIMT forward: head_dim 64 or 128");
  static constexpr int T = 64;           ///< threads: 4 row groups x 16 key (column) groups
  static constexpr int BQ = 32;          ///< query rows per team; thread rows rg + 4 i, i < 8
  static constexpr int BK = 64;          ///< keys per tile; thread keys kg + 16 j, j < 4
  static constexpr int NC = D / 64;      ///< float4 column groups of O per thread: 4 kg + 64 c
  static constexpr int QS = D + 4;       ///< Q row stride (floats) in scratch
  static constexpr int KD = 32;          ///< head-dim slice per K chunk
  static constexpr int KS = KD + 4;      ///< K chunk row stride
  static constexpr int NKC = D / KD;     ///< K chunks per key tile
  static constexpr int VK = 2048 / D;    ///< keys per V chunk (16 or 32)
  static constexpr int VS = D + 4;       ///< V chunk row stride
  static constexpr int NVC = BK / VK;    ///< V chunks per key tile
  static constexpr int NST = NKC + NVC;  ///< chunks (pipeline stages) per key tile
  static constexpr int PS = BK + 16;     ///< P row stride: rows of a warp 16 banks apart
  static constexpr int STAGE = (BK * KS > VK * VS) ? BK * KS : VK * VS;
  static constexpr int P_OFF = BQ * QS;
  static constexpr int ST_OFF = P_OFF + BQ * PS;
  static constexpr int FLOATS = ST_OFF + 2 * STAGE;
  static constexpr std::size_t BYTES = FLOATS * sizeof(float) + 16;  // + alignment slack
  static_assert(BK * (KD / 4) % T == 0 && VK * (D / 4) % T == 0 && BQ * (D / 4) % T == 0, "copy split");
};

/// One forward team: query tile `work[league / heads]` of head `league % heads`.
/// `sm`: 16-byte aligned scratch of FwdCfg<D>::FLOATS floats.
template <int D, class Ops>
KOKKOS_INLINE_FUNCTION void fwdTeam(const Ops& ops, const Args& a, const int league, const int tid, float* sm) {
  using C = FwdCfg<D>;
  const int H = a.heads, group = a.heads / a.kv_heads;
  const int item = league / H, h = league - item * H, hk = h / group;
  const int piece = a.work[2 * item], qt = a.work[2 * item + 1];
  const int qb = a.ranges[4 * piece], nq = a.ranges[4 * piece + 1] - qb;
  const int kb = a.ranges[4 * piece + 2], nk = a.ranges[4 * piece + 3] - kb;
  const int off = nk - nq, q0 = qt * C::BQ;
  const int qlast = imin(q0 + C::BQ, nq) - 1;    // last valid row of the tile (piece-local)
  const int ntiles = (off + qlast) / C::BK + 1;  // key tiles holding a visible key
  const int nstages = ntiles * C::NST;
  const float* Q = static_cast<const float*>(a.q) + h * D;
  const float* K = static_cast<const float*>(a.k) + hk * D;
  const float* V = static_cast<const float*>(a.v) + hk * D;
  float* Qs = sm;
  float* Ps = sm + C::P_OFF;
  float* St = sm + C::ST_OFF;

  // Q tile (rows past the piece load its last row: finite, never stored)
  for (int i = tid; i < C::BQ * (D / 4); i += C::T) {
    const int r = i / (D / 4), c = i - r * (D / 4);
    const int row = imin(q0 + r, nq - 1);
    ops.copy16(Qs + r * C::QS + 4 * c, Q + static_cast<std::int64_t>(qb + row) * a.q_s0 + 4 * c);
  }
  // stage g: key tile g / NST, chunk g % NST (K slices of the head dim, then V key slices)
  auto issue = [&](const int g) {
    const int t = g / C::NST, st = g - t * C::NST, k0 = t * C::BK;
    float* buf = St + (g & 1) * C::STAGE;
    if (st < C::NKC) {
      const int d0 = st * C::KD;
      for (int i = tid; i < C::BK * (C::KD / 4); i += C::T) {
        const int kk = i / (C::KD / 4), c = i - kk * (C::KD / 4);
        const int key = imin(k0 + kk, nk - 1);
        ops.copy16(buf + kk * C::KS + 4 * c, K + static_cast<std::int64_t>(kb + key) * a.k_s0 + d0 + 4 * c);
      }
    } else {
      const int v0 = k0 + (st - C::NKC) * C::VK;
      for (int i = tid; i < C::VK * (D / 4); i += C::T) {
        const int kk = i / (D / 4), c = i - kk * (D / 4);
        const int key = imin(v0 + kk, nk - 1);
        ops.copy16(buf + kk * C::VS + 4 * c, V + static_cast<std::int64_t>(kb + key) * a.v_s0 + 4 * c);
      }
    }
  };
  issue(0);
  ops.commit();

  const int rg = tid >> 4, kg = tid & 15;
  const float sl2 = a.scale_log2;
  float o[8][4 * C::NC];
  float m[8], l[8];
  WLB_SIMT_UNROLL
  for (int i = 0; i < 8; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
    WLB_SIMT_UNROLL
    for (int c = 0; c < 4 * C::NC; ++c) o[i][c] = 0.0f;
  }
  int g = 0;  // current stage
  // start stage g: its chunk becomes visible to all, and (barrier) everyone is done with the
  // buffer of stage g-1, which the copy of stage g+1 then overwrites
  auto begin = [&]() {
    ops.waitAll();
    ops.barrier();
    if (g + 1 < nstages) {
      issue(g + 1);
      ops.commit();
    }
  };

  WLB_SIMT_NO_UNROLL
  for (int t = 0; t < ntiles; ++t) {
    // ---- S[8 rows][4 keys] = Q[rows] . K[keys], head dim in chunks of KD
    float s[8][4];
    WLB_SIMT_UNROLL
    for (int i = 0; i < 8; ++i) WLB_SIMT_UNROLL
    for (int j = 0; j < 4; ++j) s[i][j] = 0.0f;
    WLB_SIMT_NO_UNROLL
    for (int st = 0; st < C::NKC; ++st, ++g) {
      begin();
      const float* qp = Qs + rg * C::QS + st * C::KD;
      const float* kp = St + (g & 1) * C::STAGE + kg * C::KS;
      WLB_SIMT_UNROLL
      for (int c = 0; c < C::KD / 4; ++c) {
        float4 kv[4];
        WLB_SIMT_UNROLL
        for (int j = 0; j < 4; ++j) kv[j] = ld4(kp + 16 * j * C::KS + 4 * c);
        WLB_SIMT_UNROLL
        for (int i = 0; i < 8; ++i) {
          const float4 qv = ld4(qp + 4 * i * C::QS + 4 * c);
          WLB_SIMT_UNROLL
          for (int j = 0; j < 4; ++j) s[i][j] = dot4(s[i][j], qv, kv[j]);
        }
      }
    }
    // ---- online softmax of key tile t (log2 domain); P -> scratch; rescale O.
    // P was last read in tile t-1's V stages, all behind this tile's stage barriers.
    const int k0 = t * C::BK;
    WLB_SIMT_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int r = rg + 4 * i;
      const int lastKey = off + imin(q0 + r, nq - 1);
      float mx = -INFINITY;
      WLB_SIMT_UNROLL
      for (int j = 0; j < 4; ++j) {
        const float x = (k0 + kg + 16 * j <= lastKey) ? s[i][j] * sl2 : -INFINITY;
        s[i][j] = x;
        mx = fmaxf(mx, x);
      }
      mx = fmaxf(mx, ops.shflXor(mx, 1));
      mx = fmaxf(mx, ops.shflXor(mx, 2));
      mx = fmaxf(mx, ops.shflXor(mx, 4));
      mx = fmaxf(mx, ops.shflXor(mx, 8));
      const float mnew = fmaxf(m[i], mx);  // finite: key 0 of tile 0 is visible to every row
      const float alpha = (m[i] == -INFINITY) ? 0.0f : ops.ex2(m[i] - mnew);
      const float msub = (mnew == -INFINITY) ? 0.0f : mnew;
      m[i] = mnew;
      float psum = 0.0f;
      WLB_SIMT_UNROLL
      for (int j = 0; j < 4; ++j) {
        const float pv = ops.ex2(s[i][j] - msub);
        psum += pv;
        Ps[r * C::PS + kg + 16 * j] = pv;
      }
      l[i] = fmaf(l[i], alpha, psum);
      WLB_SIMT_UNROLL
      for (int c = 0; c < 4 * C::NC; ++c) o[i][c] *= alpha;
    }
    // ---- O[8 rows][cols] += P[rows][keys] V[keys][cols], keys in chunks of VK
    // (P becomes visible at the first V stage's barrier)
    WLB_SIMT_NO_UNROLL
    for (int st = 0; st < C::NVC; ++st, ++g) {
      begin();
      const float* pp = Ps + rg * C::PS + st * C::VK;
      const float* vp = St + (g & 1) * C::STAGE + 4 * kg;
      WLB_SIMT_UNROLL
      for (int k4 = 0; k4 < C::VK / 4; ++k4) {
        float4 pv[8];
        WLB_SIMT_UNROLL
        for (int i = 0; i < 8; ++i) pv[i] = ld4(pp + 4 * i * C::PS + 4 * k4);
        WLB_SIMT_UNROLL
        for (int u = 0; u < 4; ++u) {
          WLB_SIMT_UNROLL
          for (int c = 0; c < C::NC; ++c) {
            const float4 vv = ld4(vp + (4 * k4 + u) * C::VS + 64 * c);
            WLB_SIMT_UNROLL
            for (int i = 0; i < 8; ++i) fma4(&o[i][4 * c], comp(pv[i], u), vv);
          }
        }
      }
    }
  }

  // ---- normalise, store O and lse of the valid rows
  float* O = static_cast<float*>(a.o_out) + h * D;
  WLB_SIMT_UNROLL
  for (int i = 0; i < 8; ++i) {
    float lt = l[i];
    lt += ops.shflXor(lt, 1);
    lt += ops.shflXor(lt, 2);
    lt += ops.shflXor(lt, 4);
    lt += ops.shflXor(lt, 8);
    const int r = rg + 4 * i;
    if (q0 + r < nq) {
      const std::int64_t trow = qb + q0 + r;
      const float inv = 1.0f / lt;
      float* op = O + trow * a.o_s0 + 4 * kg;
      WLB_SIMT_UNROLL
      for (int c = 0; c < C::NC; ++c)
        st4(op + 64 * c,
            make_float4(o[i][4 * c] * inv, o[i][4 * c + 1] * inv, o[i][4 * c + 2] * inv, o[i][4 * c + 3] * inv));
      if (kg == 0) a.lse_out[trow * a.lse_s0 + h] = (m[i] + log2f(lt)) * kLn2;
    }
  }
}

// ============================== backward ==============================================

template <int D>
struct BwdCfg {
  static_assert(D == 64 || D == 128, "SIMT backward: head_dim 64 or 128");
  static constexpr int T = 256;      ///< two roles of 128 threads (S^T/dV and dP^T/dK)
  static constexpr int BK = 64;      ///< keys per team
  static constexpr int BQ = 32;      ///< query rows per step
  static constexpr int NC = D / 64;  ///< float4 column groups of dK/dV per thread: 4 cg + 64 c
  // phase A (S^T, dP^T): head-dim chunks of 16, rows of 16 floats, float4 slots XOR-swizzled
  static constexpr int DC = 16;
  static constexpr int NA = D / DC;
  static constexpr int A_K = 0, A_V = BK * DC, A_Q = 2 * BK * DC, A_DO = 2 * BK * DC + BQ * DC;
  // phase C (dV += P^T dO, dK += dS^T Q): query-row chunks of Q and dO
  static constexpr int RS = D + 4;
  static constexpr int RC = 1024 / D;
  static constexpr int NCC = BQ / RC;
  // phase D (dQ = dS K): key chunks of K
  static constexpr int KC = 2048 / D;
  static constexpr int NDC = BK / KC;
  static constexpr int NST = NA + NCC + NDC;  ///< chunks (pipeline stages) per step
  static constexpr int PS = BK + 16;          ///< P / dS row stride
  static constexpr int STAGE = 2 * BK * DC + 2 * BQ * DC;
  static constexpr int P_OFF = 0, DS_OFF = BQ * PS, ST_OFF = 2 * BQ * PS;
  static constexpr int FLOATS = ST_OFF + 2 * STAGE;
  static constexpr std::size_t BYTES = FLOATS * sizeof(float) + 16;
  // phase D thread grid: CG column groups of 4 x RG row groups, RPT rows each (rg + RG i)
  static constexpr int CG = D / 4, RG = T / CG, RPT = BQ / RG;
  static_assert(2 * RC * RS <= STAGE && KC * RS <= STAGE, "chunk fits a stage buffer");
  static_assert(RC * (D / 4) == T && (KC * (D / 4)) % T == 0 && BQ * (D / 4) % T == 0, "copy split");
  static_assert(BK * DC / 4 == T && BQ * DC / 4 == T / 2, "phase A copy split");
};

/// Row `row` (16 floats), float4 slot c4 of a phase-A chunk: slots XOR-swizzled so that 8
/// consecutive rows at the same slot hit 8 different 16-byte bank groups.
KOKKOS_INLINE_FUNCTION int swz(int row, int c4) {
  return row * 16 + ((c4 ^ ((row >> 1) & 3)) << 2);
}

/// One backward team: key tile `work[league / kv_heads]` of KV head `league % kv_heads`.
template <int D, class Ops>
KOKKOS_INLINE_FUNCTION void bwdTeam(const Ops& ops, const Args& a, const int league, const int tid, float* sm) {
  using C = BwdCfg<D>;
  const int H = a.heads, Hkv = a.kv_heads, G = a.heads / a.kv_heads;
  const int item = league / Hkv, hk = league - item * Hkv;
  const int piece = a.work[2 * item], kt = a.work[2 * item + 1];
  const int qb = a.ranges[4 * piece], nq = a.ranges[4 * piece + 1] - qb;
  const int kb = a.ranges[4 * piece + 2], nk = a.ranges[4 * piece + 3] - kb;
  const int off = nk - nq, k0 = kt * C::BK;
  const int qt0 = imax(0, k0 - off) / C::BQ;       // first query tile that sees a key of ours
  const int nqt = (nq + C::BQ - 1) / C::BQ - qt0;  // >= 1 (keyWork lists pieces with nq > 0)
  const int nstages = G * nqt * C::NST;            // stage sequence: per step NA A, NCC C, NDC D chunks
  const float* Qg = static_cast<const float*>(a.q);
  const float* dOg = static_cast<const float*>(a.dO);
  const float* K = static_cast<const float*>(a.k) + hk * D;
  const float* V = static_cast<const float*>(a.v) + hk * D;
  float* Ps = sm + C::P_OFF;
  float* dSs = sm + C::DS_OFF;
  float* St = sm + C::ST_OFF;

  // stage g: step g / NST = (head hk*G + step / nqt, query tile qt0 + step % nqt), chunk g % NST
  auto issue = [&](const int g) {
    const int step = g / C::NST, st = g - step * C::NST;
    const int hi = step / nqt, h = hk * G + hi, q0 = (qt0 + step - hi * nqt) * C::BQ;
    float* buf = St + (g & 1) * C::STAGE;
    if (st < C::NA) {
      const int d0 = st * C::DC;
      {
        const int kk = tid >> 2, c4 = tid & 3;
        const std::int64_t key = kb + imin(k0 + kk, nk - 1);
        ops.copy16(buf + C::A_K + swz(kk, c4), K + key * a.k_s0 + d0 + 4 * c4);
        ops.copy16(buf + C::A_V + swz(kk, c4), V + key * a.v_s0 + d0 + 4 * c4);
      }
      {
        const int u = tid & 127, rr = u >> 2, c4 = u & 3;
        const std::int64_t row = qb + imin(q0 + rr, nq - 1);
        if (tid < 128)
          ops.copy16(buf + C::A_Q + swz(rr, c4), Qg + row * a.q_s0 + h * D + d0 + 4 * c4);
        else
          ops.copy16(buf + C::A_DO + swz(rr, c4), dOg + row * a.dO_s0 + h * D + d0 + 4 * c4);
      }
    } else if (st < C::NA + C::NCC) {
      const int r0 = q0 + (st - C::NA) * C::RC;
      const int rr = tid / (D / 4), c = tid - rr * (D / 4);
      const std::int64_t row = qb + imin(r0 + rr, nq - 1);
      ops.copy16(buf + rr * C::RS + 4 * c, Qg + row * a.q_s0 + h * D + 4 * c);
      ops.copy16(buf + (C::RC + rr) * C::RS + 4 * c, dOg + row * a.dO_s0 + h * D + 4 * c);
    } else {
      const int kc0 = k0 + (st - C::NA - C::NCC) * C::KC;
      for (int i = tid; i < C::KC * (D / 4); i += C::T) {
        const int kk = i / (D / 4), c = i - kk * (D / 4);
        const std::int64_t key = kb + imin(kc0 + kk, nk - 1);
        ops.copy16(buf + kk * C::RS + 4 * c, K + key * a.k_s0 + 4 * c);
      }
    }
  };
  issue(0);
  ops.commit();

  const int role = tid >> 7, t7 = tid & 127;
  // A: rows rg + 8 i, keys kg + 16 j; C: keys 4 rg + {0..3} and 32 + 4 rg + {0..3}, cols 4 kg + 64 c
  const int rg = t7 >> 4, kg = t7 & 15;
  const int rgD = tid / C::CG, cgD = tid - rgD * C::CG;  // D: rows rgD + RG i, cols 4 cgD + {0..3}
  const float sl2 = a.scale_log2, scale = a.scale;
  float acc2[8][4 * C::NC];  // dV (role 0) or dK (role 1): [key u][col]
  WLB_SIMT_UNROLL
  for (int u = 0; u < 8; ++u) WLB_SIMT_UNROLL
  for (int c = 0; c < 4 * C::NC; ++c) acc2[u][c] = 0.0f;
  int g = 0;  // current stage
  auto begin = [&]() {
    ops.waitAll();
    ops.barrier();  // chunk g visible; everyone is done with chunk g-1's buffer
    if (g + 1 < nstages) {
      issue(g + 1);
      ops.commit();
    }
  };

  WLB_SIMT_NO_UNROLL
  for (int step = 0; step < G * nqt; ++step) {
    const int hi = step / nqt, h = hk * G + hi, q0 = (qt0 + step - hi * nqt) * C::BQ;
    // ---- phase A: acc[i][j] = Y[row rg+8i] . X[key kg+16j]: S^T = K Q^T (role 0) or
    //      dP^T = V dO^T (role 1), head dim in chunks of 16
    float acc[4][4];
    float rowv[4];  // lse * log2 e (role 0) or delta (role 1) of rows rg + 8 i
    WLB_SIMT_UNROLL
    for (int i = 0; i < 4; ++i) {
      const std::int64_t trow = qb + imin(q0 + rg + 8 * i, nq - 1);
      rowv[i] = role == 0 ? a.lse[trow * a.lse_s0 + h] * kLog2e : a.delta[trow * H + h];
      WLB_SIMT_UNROLL
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    }
    WLB_SIMT_NO_UNROLL
    for (int st = 0; st < C::NA; ++st, ++g) {
      begin();
      const float* buf = St + (g & 1) * C::STAGE;
      const float* X = buf + (role == 0 ? C::A_K : C::A_V);
      const float* Y = buf + (role == 0 ? C::A_Q : C::A_DO);
      WLB_SIMT_UNROLL
      for (int c4 = 0; c4 < 4; ++c4) {
        float4 xv[4];
        WLB_SIMT_UNROLL
        for (int j = 0; j < 4; ++j) xv[j] = ld4(X + swz(kg + 16 * j, c4));
        WLB_SIMT_UNROLL
        for (int i = 0; i < 4; ++i) {
          const float4 yv = ld4(Y + swz(rg + 8 * i, c4));
          WLB_SIMT_UNROLL
          for (int j = 0; j < 4; ++j) acc[i][j] = dot4(acc[i][j], yv, xv[j]);
        }
      }
    }
    // ---- P = exp(S - lse) (0 where masked or padded), then dS = P (dP - delta) scale.
    // P and dS were last read in the previous step's C / D stages, behind this step's A barriers.
    if (role == 0) {
      WLB_SIMT_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int row = q0 + rg + 8 * i;
        WLB_SIMT_UNROLL
        for (int j = 0; j < 4; ++j) {
          const int key = k0 + kg + 16 * j;
          const bool vis = row < nq && key <= off + row;
          const float e = ops.ex2(fmaf(acc[i][j], sl2, -rowv[i]));
          Ps[(rg + 8 * i) * C::PS + kg + 16 * j] = vis ? e : 0.0f;
        }
      }
    }
    ops.barrier();
    if (role == 1) {
      WLB_SIMT_UNROLL
      for (int i = 0; i < 4; ++i) WLB_SIMT_UNROLL
      for (int j = 0; j < 4; ++j) {
        const int idx = (rg + 8 * i) * C::PS + kg + 16 * j;
        dSs[idx] = Ps[idx] * (acc[i][j] - rowv[i]) * scale;
      }
    }
    // ---- phase C: acc2[key][col] += Z[row][key] M[row][col] over the rows of each chunk,
    //      Z = P, M = dO (role 0: dV) or Z = dS, M = Q (role 1: dK). dS is visible from the
    //      first C stage's barrier on.
    WLB_SIMT_NO_UNROLL
    for (int cc = 0; cc < C::NCC; ++cc, ++g) {
      begin();
      const float* Z = (role == 0 ? Ps : dSs) + cc * C::RC * C::PS + 4 * rg;
      const float* M = St + (g & 1) * C::STAGE + (role == 0 ? C::RC * C::RS : 0) + 4 * kg;
      WLB_SIMT_UNROLL
      for (int rr = 0; rr < C::RC; ++rr) {
        const float4 z0 = ld4(Z + rr * C::PS);
        const float4 z1 = ld4(Z + rr * C::PS + 32);
        WLB_SIMT_UNROLL
        for (int c = 0; c < C::NC; ++c) {
          const float4 mv = ld4(M + rr * C::RS + 64 * c);
          WLB_SIMT_UNROLL
          for (int u = 0; u < 4; ++u) {
            fma4(&acc2[u][4 * c], comp(z0, u), mv);
            fma4(&acc2[4 + u][4 * c], comp(z1, u), mv);
          }
        }
      }
    }
    // ---- phase D: dq[row][col] = dS[row][keys] K[keys][col], keys in chunks of KC;
    //      then added to dq (other teams add other keys' contributions)
    float dq[C::RPT][4];
    WLB_SIMT_UNROLL
    for (int i = 0; i < C::RPT; ++i) WLB_SIMT_UNROLL
    for (int c = 0; c < 4; ++c) dq[i][c] = 0.0f;
    WLB_SIMT_NO_UNROLL
    for (int dc = 0; dc < C::NDC; ++dc, ++g) {
      begin();
      const float* Z = dSs + rgD * C::PS + dc * C::KC;
      const float* Kc = St + (g & 1) * C::STAGE + 4 * cgD;
      WLB_SIMT_UNROLL
      for (int k4 = 0; k4 < C::KC / 4; ++k4) {
        float4 zv[C::RPT];
        WLB_SIMT_UNROLL
        for (int i = 0; i < C::RPT; ++i) zv[i] = ld4(Z + i * C::RG * C::PS + 4 * k4);
        WLB_SIMT_UNROLL
        for (int u = 0; u < 4; ++u) {
          const float4 kv = ld4(Kc + (4 * k4 + u) * C::RS);
          WLB_SIMT_UNROLL
          for (int i = 0; i < C::RPT; ++i) fma4(dq[i], comp(zv[i], u), kv);
        }
      }
    }
    WLB_SIMT_UNROLL
    for (int i = 0; i < C::RPT; ++i) {
      const int row = q0 + rgD + C::RG * i;
      if (row < nq)
        ops.add4(a.dq + static_cast<std::int64_t>(qb + row) * a.dq_s0 + h * D + 4 * cgD,
                 make_float4(dq[i][0], dq[i][1], dq[i][2], dq[i][3]));
    }
  }

  // ---- dV (role 0) / dK (role 1) of the valid keys
  float* dst = role == 0 ? a.dv : a.dk;
  const std::int64_t s0 = role == 0 ? a.dv_s0 : a.dk_s0;
  WLB_SIMT_UNROLL
  for (int u = 0; u < 8; ++u) {
    const int key = k0 + (u < 4 ? 4 * rg + u : 32 + 4 * rg + (u - 4));
    if (key < nk) {
      float* p = dst + static_cast<std::int64_t>(kb + key) * s0 + hk * D + 4 * kg;
      WLB_SIMT_UNROLL
      for (int c = 0; c < C::NC; ++c)
        ops.add4(p + 64 * c, make_float4(acc2[u][4 * c], acc2[u][4 * c + 1], acc2[u][4 * c + 2], acc2[u][4 * c + 3]));
    }
  }
}

// ============================== launches ==============================================

#if defined(__CUDACC__)
/// The team scratch pointer re-derived from a __shared__ symbol, so that the compiler emits
/// shared-memory instructions (LDS.128) instead of generic loads.
__device__ __forceinline__ float* sharedScratch(void* kokkosScratch) {
  extern __shared__ float4 wlb_attention_simt_smem[];
  char* base = reinterpret_cast<char*>(wlb_attention_simt_smem);
  std::ptrdiff_t off = static_cast<char*>(kokkosScratch) - base;
  off = (off + 15) & ~static_cast<std::ptrdiff_t>(15);
  return reinterpret_cast<float*>(base + off);
}
#endif

template <int D>
struct FwdKernel {
  using Policy = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<FwdCfg<D>::T, 4>>;
  Args a;
  KOKKOS_INLINE_FUNCTION void operator()(const typename Policy::member_type& team) const {
#ifdef __CUDA_ARCH__
    const std::size_t bytes = FwdCfg<D>::BYTES;  // a copy: get_shmem takes a reference
    float* sm = sharedScratch(team.team_scratch(0).get_shmem(bytes));
    fwdTeam<D>(DeviceOps{}, a, team.league_rank(), team.team_rank(), sm);
#else
    (void)team;
#endif
  }
};

template <int D>
struct BwdKernel {
  using Policy = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<BwdCfg<D>::T, 1>>;
  Args a;
  KOKKOS_INLINE_FUNCTION void operator()(const typename Policy::member_type& team) const {
#ifdef __CUDA_ARCH__
    const std::size_t bytes = BwdCfg<D>::BYTES;  // a copy: get_shmem takes a reference
    float* sm = sharedScratch(team.team_scratch(0).get_shmem(bytes));
    bwdTeam<D>(DeviceOps{}, a, team.league_rank(), team.team_rank(), sm);
#else
    (void)team;
#endif
  }
};

template <int D>
void launchForward(const Kokkos::Cuda& space, const Args& a) {
  using P = typename FwdKernel<D>::Policy;
  Kokkos::parallel_for("wlb::attention::cuda::simt::fwd",
                       P(space, a.nwork * a.heads, FwdCfg<D>::T)
                           .set_scratch_size(0, Kokkos::PerTeam(static_cast<int>(FwdCfg<D>::BYTES))),
                       FwdKernel<D>{a});
}

template <int D>
void launchBackward(const Kokkos::Cuda& space, const Args& a) {
  using P = typename BwdKernel<D>::Policy;
  Kokkos::parallel_for("wlb::attention::cuda::simt::bwd",
                       P(space, a.nwork * a.kv_heads, BwdCfg<D>::T)
                           .set_scratch_size(0, Kokkos::PerTeam(static_cast<int>(BwdCfg<D>::BYTES))),
                       BwdKernel<D>{a});
}

inline bool aligned16(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}
inline bool strideOk(std::int64_t s) {
  return s % 4 == 0;
}

}  // namespace simt

/// True when the FP32 SIMT kernels handle this head_dim.
inline bool simtSupports(int head_dim) {
  return head_dim == 64 || head_dim == 128;
}

/// FP32 forward: overwrites o_out rows and lse_out of every piece's queries (a.ranges set by
/// the caller). Returns false without launching when the head_dim is unsupported or a
/// pointer / row stride is not 16-byte aligned (cp.async and float4 stores need it).
/// Asynchronous on `space`: the caller fences (forwardCuda).
inline bool simtForward(const Kokkos::Cuda& space, Args a, const VarlenBatch& b) {
  if (!simtSupports(a.head_dim)) return false;
  if (!simt::aligned16(a.q) || !simt::aligned16(a.k) || !simt::aligned16(a.v) || !simt::aligned16(a.o_out) ||
      !simt::strideOk(a.q_s0) || !simt::strideOk(a.k_s0) || !simt::strideOk(a.v_s0) || !simt::strideOk(a.o_s0))
    return false;
  if (b.pieces.empty() || a.heads <= 0) return true;
  const WorkView work = queryWork(space, b, simt::FwdCfg<64>::BQ, simt::FwdCfg<64>::BK);
  a.work = work.data();
  a.nwork = static_cast<int>(work.extent(0));
  if (a.nwork > 0) {
    if (a.head_dim == 128)
      simt::launchForward<128>(space, a);
    else
      simt::launchForward<64>(space, a);
  }
  return true;
}

/// FP32 backward: a.delta (rowsum(dO∘O), [q_tokens][heads]), a.lse, a.dO set by the caller;
/// ACCUMULATES (+=) into dq, dk and dv with vector reductions. Returns false without
/// launching when the head_dim is unsupported or a pointer / row stride is misaligned.
/// Asynchronous on `space`: the caller fences (backwardCuda).
inline bool simtBackward(const Kokkos::Cuda& space, Args a, const VarlenBatch& b) {
  if (!simtSupports(a.head_dim)) return false;
  if (!simt::aligned16(a.q) || !simt::aligned16(a.k) || !simt::aligned16(a.v) || !simt::aligned16(a.dO) ||
      !simt::aligned16(a.dq) || !simt::aligned16(a.dk) || !simt::aligned16(a.dv) || !simt::strideOk(a.q_s0) ||
      !simt::strideOk(a.k_s0) || !simt::strideOk(a.v_s0) || !simt::strideOk(a.dO_s0) || !simt::strideOk(a.dq_s0) ||
      !simt::strideOk(a.dk_s0) || !simt::strideOk(a.dv_s0))
    return false;
  if (b.pieces.empty() || a.kv_heads <= 0) return true;
  const WorkView work = keyWork(space, b, simt::BwdCfg<64>::BK);
  a.work = work.data();
  a.nwork = static_cast<int>(work.extent(0));
  if (a.nwork > 0) {
    if (a.head_dim == 128)
      simt::launchBackward<128>(space, a);
    else
      simt::launchBackward<64>(space, a);
  }
  return true;
}

}  // namespace wlb::attention::cuda

#undef WLB_SIMT_UNROLL
#undef WLB_SIMT_NO_UNROLL

#endif  // KOKKOS_ENABLE_CUDA
