#pragma once
/// \file cuda_mma.hpp
/// \brief Internal: tensor-core attention kernels for CUDA (sm_80+; tuned on sm_90),
/// FlashAttention-2 style, launched as Kokkos TeamPolicy kernels on the caller's instance.
///
/// Forward (BF16 storage with m16n8k16 bf16 MMAs, or FP32 storage with m16n8k8 TF32 MMAs):
/// one team of 4 warps per (query tile, head); each warp owns 32 (BF16) or 16 (TF32) query
/// rows with Q, the scores and the O accumulators in registers; K and V tiles are staged in
/// team scratch by cp.async; online softmax in base 2 in steps of 32 keys (BF16); key tiles
/// past the last visible key are never visited and only diagonal steps are masked. Work
/// items are ordered longest first.
///
/// Backward (BF16): one team of 4 warps per (key tile of 64 keys, KV head), looping over
/// the GQA group's query heads and the 16-row query tiles that see the key tile; each warp
/// owns 16 keys and keeps their dK/dV in registers; P is recomputed from the LSE,
/// delta = rowsum(dO∘O) comes from a pre-pass, and dQ is accumulated by vector float
/// reductions in L2 (pieces may share keys, so dK/dV also end with reductions).
///
/// Fragment layouts (PTX ISA, mma.m16n8k16 / m16n8k8): lane = 4*g + t. The accumulator of
/// an m16n8 tile holds rows g and g+8, columns 2t and 2t+1 — the same registers are the A
/// operand of the next product (P·V), for TF32 with the key order permuted so that column t
/// of A is key 2t and column t+4 is key 2t+1 (B rows are loaded in the same order).

#include "attention/cuda_common.hpp"
#if defined(WLB_HAVE_HOPPER)
#include "attention/cuda_hopper.hpp"
#endif

#if defined(KOKKOS_ENABLE_CUDA)

namespace wlb::attention::cuda {

constexpr int kMmaThreads = 128;  // 4 warps
constexpr int kBwdKeys = 64;      // keys per backward team (16 per warp)
constexpr int kBwdRows = 16;      // query rows per backward step

/// Tile geometry of the forward kernel for an element type and head_dim.
template <class T, int D>
struct FwdTile {
  static constexpr bool bf = std::is_same<T, bf16>::value;
  static constexpr int esize = bf ? 2 : 4;
  /// smem row stride in elements: bf16 rows are XOR-swizzled in 16-byte chunks (no pad),
  /// float rows padded by 4 floats (conflict-free scalar fragment loads)
  static constexpr int ld = bf ? D : D + 4;
  /// keys per staged K/V tile (K + V fill 32-35 KiB). `stages` = 2 double-buffers at half
  /// the keys; on an H100 that ran no faster (case a: 213 vs 219 TFLOP/s) and spilled, so
  /// the copy of the next tile overlaps only the other team on the SM.
  static constexpr int bk = bf ? (D == 64 ? 128 : 64) : (D == 64 ? 64 : 32);
  static constexpr int stages = 1;
  /// m16 tiles per warp: BF16 keeps 32 query rows per warp, so every K/V fragment read from
  /// shared memory feeds two MMAs (+5-10% over 16 rows on an H100); TF32 has no registers
  /// left for that (its Q fragments are twice as large).
  static constexpr int mt = bf ? 2 : 1;
  /// teams per SM the register budget aims at (LaunchBounds). Measured on an H100 at
  /// D = 128: 16 rows per warp with 3 teams per SM ran no faster than 32 rows with 2.
  static constexpr int minBlocks = 2;
  static constexpr int rows = 64 * mt;  ///< query rows per team (4 warps)
  /// keys per softmax step (bounded by the score registers: mt * sk / 2 per thread)
  static constexpr int sk = (bf && mt == 2) ? 32 : bk;
  static constexpr int tileBytes = bk * ld * esize;
  static constexpr int scratch = 2 * stages * tileBytes + 128;  // K, V per stage, alignment slack
};

inline bool mmaSupports(int head_dim) {
  return head_dim == 64 || head_dim == 128;
}

#if defined(__CUDACC__)

/// Byte offset of element (row, col) in a staged tile (16-byte chunk swizzle for bf16).
template <class T, int D>
__device__ __forceinline__ int tileOffset(int row, int col) {
  using G = FwdTile<T, D>;
  if constexpr (G::bf) {
    constexpr int cpr = D / 8;  // 16-byte chunks per row
    const int c = col >> 3;
    return (row * cpr + (c ^ (row & 7))) * 16 + (col & 7) * 2;
  } else {
    return (row * G::ld + col) * 4;
  }
}

/// Stage rows [r0, r0 + rows) of a K or V tile (rows clamped to [0, valid) of the piece;
/// the clamped copies are masked by the caller) into `smem` with cp.async.
template <class T, int D, int ROWS>
__device__ __forceinline__ void stageTile(char* smem, const T* base, std::int64_t s0, int r0, int valid, int tid) {
  constexpr int cpr = D * static_cast<int>(sizeof(T)) / 16;
  constexpr int per = sizeof(T) == 2 ? 8 : 4;  // elements per chunk
  for (int i = tid; i < ROWS * cpr; i += kMmaThreads) {
    const int r = i / cpr, c = i % cpr;
    int src = r0 + r;
    src = src < valid ? src : valid - 1;
    ptx::cpAsync16(smem + tileOffset<T, D>(r, c * per), base + static_cast<std::int64_t>(src) * s0 + c * per);
  }
}

using ptx::cpAsyncWait;
using ptx::quadMax;
using ptx::quadSum;

template <class T, int D>
__device__ void forwardTeam(const Args& a, int item, int h, int tid, char* smem) {
  using G = FwdTile<T, D>;
  constexpr int BK = G::bk, SK = G::sk, MT = G::mt, BQ = G::rows;
  constexpr int NT = SK / 8;          // score n-tiles per softmax step
  constexpr int KS = G::bf ? 16 : 8;  // mma k
  constexpr int QK = D / KS;          // k-steps over head_dim
  constexpr int DT = D / 8;           // O n-tiles
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int p = a.work[2 * item], tile = a.work[2 * item + 1];
  const int qb = a.ranges[4 * p], nq = a.ranges[4 * p + 1] - qb, kb = a.ranges[4 * p + 2],
            nk = a.ranges[4 * p + 3] - kb, off = nk - nq;
  const int q0 = tile * BQ;
  const int hk = h / (a.heads / a.kv_heads);
  const T* Q = static_cast<const T*>(a.q);
  const T* Kg = static_cast<const T*>(a.k) + static_cast<std::int64_t>(kb) * a.k_s0 + hk * D;
  const T* Vg = static_cast<const T*>(a.v) + static_cast<std::int64_t>(kb) * a.v_s0 + hk * D;
  constexpr int ST = G::stages;

  const int qend = q0 + BQ < nq ? q0 + BQ : nq;
  const int klim = off + qend;           // keys [0, klim) are visible to some valid row
  const int nkt = (klim + BK - 1) / BK;  // staged key tiles

  // stage s holds K then V; tile j lives in stage j % ST
  for (int j = 0; j < ST; ++j) {
    if (j < nkt) {
      stageTile<T, D, BK>(smem + 2 * j * G::tileBytes, Kg, a.k_s0, j * BK, nk, tid);
      stageTile<T, D, BK>(smem + (2 * j + 1) * G::tileBytes, Vg, a.v_s0, j * BK, nk, tid);
    }
    ptx::cpAsyncCommit();  // possibly empty: keeps the group count uniform
  }

  // this warp's query rows (piece-relative): m-tile i holds rows rbase + 16 i + {g, g + 8};
  // rows past nq read the last valid row and are never stored
  const int rbase = q0 + warp * 16 * MT;
  unsigned qa[MT][QK][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    const int r0 = rbase + 16 * i + g, r1 = r0 + 8;
    const T* q0p = Q + static_cast<std::int64_t>(qb + (r0 < nq ? r0 : nq - 1)) * a.q_s0 + h * D;
    const T* q1p = Q + static_cast<std::int64_t>(qb + (r1 < nq ? r1 : nq - 1)) * a.q_s0 + h * D;
#pragma unroll
    for (int ks = 0; ks < QK; ++ks) {
      if constexpr (G::bf) {
        qa[i][ks][0] = *reinterpret_cast<const unsigned*>(q0p + ks * 16 + 2 * t);
        qa[i][ks][1] = *reinterpret_cast<const unsigned*>(q1p + ks * 16 + 2 * t);
        qa[i][ks][2] = *reinterpret_cast<const unsigned*>(q0p + ks * 16 + 8 + 2 * t);
        qa[i][ks][3] = *reinterpret_cast<const unsigned*>(q1p + ks * 16 + 8 + 2 * t);
      } else {
        qa[i][ks][0] = ptx::tf32(q0p[ks * 8 + t]);
        qa[i][ks][1] = ptx::tf32(q1p[ks * 8 + t]);
        qa[i][ks][2] = ptx::tf32(q0p[ks * 8 + t + 4]);
        qa[i][ks][3] = ptx::tf32(q1p[ks * 8 + t + 4]);
      }
    }
  }

  float o[MT][DT][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int n = 0; n < DT; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.0f;
    m[i][0] = m[i][1] = -INFINITY;
    l[i][0] = l[i][1] = 0.0f;
  }
  const float sl2 = a.scale_log2;

  for (int j = 0; j < nkt; ++j) {
    const char* sK = smem + 2 * (j % ST) * G::tileBytes;
    const char* sV = sK + G::tileBytes;
    cpAsyncWait<ST - 1>();  // tile j has landed (tile j + 1 may still be in flight)
    __syncthreads();
#pragma unroll 1
    for (int ss = 0; ss < BK / SK; ++ss) {
      const int kt0 = ss * SK;      // first key of the step inside the staged tile
      const int k0 = j * BK + kt0;  // piece-relative
      if (k0 >= klim) break;        // uniform across the team
      float s[MT][NT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.0f;
      // S = Q K^T
      if constexpr (G::bf) {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          const int key = kt0 + np * 16 + (lane >> 4) * 8 + (lane & 7);
#pragma unroll
          for (int ks = 0; ks < QK; ++ks) {
            unsigned b0, b1, b2, b3;
            ptx::ldmatrixX4(b0, b1, b2, b3, sK + tileOffset<T, D>(key, ks * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              ptx::mmaBf16(s[i][2 * np], qa[i][ks], b0, b1);
              ptx::mmaBf16(s[i][2 * np + 1], qa[i][ks], b2, b3);
            }
          }
        }
      } else {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const float* kr = reinterpret_cast<const float*>(sK + tileOffset<T, D>(kt0 + n * 8 + g, 0));
#pragma unroll
          for (int ks = 0; ks < QK; ++ks) {
            const unsigned b0 = ptx::tf32(kr[ks * 8 + t]), b1 = ptx::tf32(kr[ks * 8 + t + 4]);
#pragma unroll
            for (int i = 0; i < MT; ++i) ptx::mmaTf32(s[i][n], qa[i][ks], b0, b1);
          }
        }
      }

      // mask (diagonal and ragged steps only), online softmax in base 2
      const bool diag = k0 + SK - 1 > rbase + off || k0 + SK > nk;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int row0 = rbase + 16 * i + g;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          if (diag) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = k0 + n * 8 + 2 * t + (e & 1);
              const int row = row0 + (e < 2 ? 0 : 8);
              if (key > row + off || key >= nk) s[i][n][e] = -INFINITY;
            }
          }
          mx0 = fmaxf(mx0, fmaxf(s[i][n][0], s[i][n][1]));
          mx1 = fmaxf(mx1, fmaxf(s[i][n][2], s[i][n][3]));
        }
        // a row may see no key of this step (it lies past the row's diagonal) but always
        // saw key 0 before, so the running max is finite from the first step on
        // scores stay unscaled; the max is kept in scaled base-2 units and the scale folds
        // into one FFMA per score below
        const float mn0 = fmaxf(m[i][0], quadMax(mx0) * sl2), mn1 = fmaxf(m[i][1], quadMax(mx1) * sl2);
        const float al0 = ptx::fastExp2(m[i][0] - mn0), al1 = ptx::fastExp2(m[i][1] - mn1);
        m[i][0] = mn0;
        m[i][1] = mn1;
        float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          s[i][n][0] = ptx::fastExp2(fmaf(s[i][n][0], sl2, -mn0));
          s[i][n][1] = ptx::fastExp2(fmaf(s[i][n][1], sl2, -mn0));
          s[i][n][2] = ptx::fastExp2(fmaf(s[i][n][2], sl2, -mn1));
          s[i][n][3] = ptx::fastExp2(fmaf(s[i][n][3], sl2, -mn1));
          ls0 += s[i][n][0] + s[i][n][1];
          ls1 += s[i][n][2] + s[i][n][3];
        }
        l[i][0] = l[i][0] * al0 + ls0;  // per-thread partial sums; the quad reduces them at the end
        l[i][1] = l[i][1] * al1 + ls1;
#pragma unroll
        for (int n = 0; n < DT; ++n) {
          o[i][n][0] *= al0;
          o[i][n][1] *= al0;
          o[i][n][2] *= al1;
          o[i][n][3] *= al1;
        }
      }

      // O += P V
      if constexpr (G::bf) {
#pragma unroll
        for (int kk = 0; kk < SK / 16; ++kk) {
          unsigned pa[MT][4];
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            pa[i][0] = ptx::packBf16(s[i][2 * kk][0], s[i][2 * kk][1]);
            pa[i][1] = ptx::packBf16(s[i][2 * kk][2], s[i][2 * kk][3]);
            pa[i][2] = ptx::packBf16(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
            pa[i][3] = ptx::packBf16(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
          }
          const int key = kt0 + kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            unsigned b0, b1, b2, b3;
            ptx::ldmatrixX4T(b0, b1, b2, b3, sV + tileOffset<T, D>(key, dp * 16 + (lane >> 4) * 8));
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              ptx::mmaBf16(o[i][2 * dp], pa[i], b0, b1);
              ptx::mmaBf16(o[i][2 * dp + 1], pa[i], b2, b3);
            }
          }
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < NT; ++kk) {
          unsigned pa[MT][4];
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            pa[i][0] = ptx::tf32(s[i][kk][0]);
            pa[i][1] = ptx::tf32(s[i][kk][2]);
            pa[i][2] = ptx::tf32(s[i][kk][1]);
            pa[i][3] = ptx::tf32(s[i][kk][3]);
          }
          const float* v0 = reinterpret_cast<const float*>(sV + tileOffset<T, D>(kt0 + kk * 8 + 2 * t, 0));
          const float* v1 = reinterpret_cast<const float*>(sV + tileOffset<T, D>(kt0 + kk * 8 + 2 * t + 1, 0));
#pragma unroll
          for (int n = 0; n < DT; ++n) {
            const unsigned b0 = ptx::tf32(v0[n * 8 + g]), b1 = ptx::tf32(v1[n * 8 + g]);
#pragma unroll
            for (int i = 0; i < MT; ++i) ptx::mmaTf32(o[i][n], pa[i], b0, b1);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with tile j: tile j + ST may land in its stage
    if (j + ST < nkt) {
      stageTile<T, D, BK>(const_cast<char*>(sK), Kg, a.k_s0, (j + ST) * BK, nk, tid);
      stageTile<T, D, BK>(const_cast<char*>(sV), Vg, a.v_s0, (j + ST) * BK, nk, tid);
    }
    ptx::cpAsyncCommit();
  }

  T* O = static_cast<T*>(a.o_out);
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float ls = quadSum(l[i][half]);
      const int row = rbase + 16 * i + g + 8 * half;
      if (row >= nq) continue;
      const float inv = 1.0f / ls;
      T* orow = O + static_cast<std::int64_t>(qb + row) * a.o_s0 + h * D + 2 * t;
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        const float x0 = o[i][n][2 * half] * inv, x1 = o[i][n][2 * half + 1] * inv;
        if constexpr (G::bf)
          *reinterpret_cast<unsigned*>(orow + n * 8) = ptx::packBf16(x0, x1);
        else
          *reinterpret_cast<float2*>(orow + n * 8) = make_float2(x0, x1);
      }
      if (t == 0)
        a.lse_out[static_cast<std::int64_t>(qb + row) * a.lse_s0 + h] = (m[i][half] + log2f(ls)) * 0.6931471805599453f;
    }
  }
}

// ---------------- backward (BF16) -----------------------------------------------------

template <int D>
struct BwdTile {
  static constexpr int kvBytes = kBwdKeys * D * 2;
  static constexpr int rowBytes = kBwdRows * D * 2;
  static constexpr int dsBytes = kBwdKeys * kBwdRows * 2;
  static constexpr int oK = 0, oV = kvBytes, oQ = 2 * kvBytes, odO = oQ + rowBytes, odS = odO + rowBytes,
                       oL = odS + dsBytes, oDl = oL + kBwdRows * 4;
  static constexpr int scratch = oDl + kBwdRows * 4 + 128;
  /// teams per SM: 3 at D = 64 (+17% on an H100: more warps hide the barrier and MMA
  /// latencies); D = 128 needs all 255 registers.
  static constexpr int minBlocks = D == 64 ? 3 : 2;
};

/// dS^T scratch: [key][16 queries] bf16, two 16-byte chunks per row, swapped on every
/// other group of 4 rows so that ldmatrix's 8 rows hit 8 distinct bank groups.
__device__ __forceinline__ int dsOffset(int row, int col) {
  return row * 32 + (((col >> 3) ^ ((row >> 2) & 1)) * 16) + (col & 7) * 2;
}

template <int D>
__device__ void backwardTeam(const Args& a, int item, int hk, int tid, char* smem) {
  using G = BwdTile<D>;
  using T = bf16;
  constexpr int BK = kBwdKeys, BQ = kBwdRows, DT = D / 8, DW = D / 4;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int p = a.work[2 * item], kt = a.work[2 * item + 1];
  const int qb = a.ranges[4 * p], nq = a.ranges[4 * p + 1] - qb, kb = a.ranges[4 * p + 2],
            nk = a.ranges[4 * p + 3] - kb, off = nk - nq;
  const int k0 = kt * BK;
  const int H = a.heads, group = a.heads / a.kv_heads;
  char* sK = smem + G::oK;
  char* sV = smem + G::oV;
  char* sQ = smem + G::oQ;
  char* sdO = smem + G::odO;
  char* sdS = smem + G::odS;
  float* sL = reinterpret_cast<float*>(smem + G::oL);
  float* sDl = reinterpret_cast<float*>(smem + G::oDl);
  const T* Qg = static_cast<const T*>(a.q);
  const T* dOg = static_cast<const T*>(a.dO);

  stageTile<T, D, BK>(sK, static_cast<const T*>(a.k) + static_cast<std::int64_t>(kb) * a.k_s0 + hk * D, a.k_s0, k0, nk,
                      tid);
  stageTile<T, D, BK>(sV, static_cast<const T*>(a.v) + static_cast<std::int64_t>(kb) * a.v_s0 + hk * D, a.v_s0, k0, nk,
                      tid);
  ptx::cpAsyncCommit();

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int n = 0; n < DT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  const int key0 = k0 + warp * 16 + g, key1 = key0 + 8;  // this thread's accumulator rows
  const int qfirst = k0 - off > 0 ? k0 - off : 0;        // first query that sees the tile
  const int nqt = (nq + BQ - 1) / BQ;
  const float sl2 = a.scale_log2;

  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    for (int qt = qfirst / BQ; qt < nqt; ++qt) {
      const int q0 = qt * BQ;
      stageTile<T, D, BQ>(sQ, Qg + static_cast<std::int64_t>(qb) * a.q_s0 + h * D, a.q_s0, q0, nq, tid);
      stageTile<T, D, BQ>(sdO, dOg + static_cast<std::int64_t>(qb) * a.dO_s0 + h * D, a.dO_s0, q0, nq, tid);
      ptx::cpAsyncCommit();
      if (tid < BQ) {
        const int r = q0 + tid;
        sL[tid] = r < nq ? a.lse[static_cast<std::int64_t>(qb + r) * a.lse_s0 + h] * 1.4426950408889634f : 0.0f;
      } else if (tid < 2 * BQ) {
        const int r = q0 + tid - BQ;
        sDl[tid - BQ] = r < nq ? a.delta[static_cast<std::int64_t>(qb + r) * H + h] : 0.0f;
      }
      cpAsyncWait<0>();
      __syncthreads();

      // S^T = K_w Q^T and dP^T = V_w dO^T (16 keys x 16 queries per warp)
      float s[2][4], dp[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
      {
        const int brow = (lane >> 4) * 8 + (lane & 7);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          unsigned qf0, qf1, qf2, qf3, of0, of1, of2, of3;
          ptx::ldmatrixX4(qf0, qf1, qf2, qf3, sQ + tileOffset<T, D>(brow, ks * 16 + ((lane >> 3) & 1) * 8));
          ptx::ldmatrixX4(of0, of1, of2, of3, sdO + tileOffset<T, D>(brow, ks * 16 + ((lane >> 3) & 1) * 8));
          unsigned ka[4], va[4];
          const int arow = warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
          ptx::ldmatrixX4(ka[0], ka[1], ka[2], ka[3], sK + tileOffset<T, D>(arow, ks * 16 + (lane >> 4) * 8));
          ptx::ldmatrixX4(va[0], va[1], va[2], va[3], sV + tileOffset<T, D>(arow, ks * 16 + (lane >> 4) * 8));
          ptx::mmaBf16(s[0], ka, qf0, qf1);
          ptx::mmaBf16(s[1], ka, qf2, qf3);
          ptx::mmaBf16(dp[0], va, of0, of1);
          ptx::mmaBf16(dp[1], va, of2, of3);
        }
      }
      // P^T from the LSE, dS^T = P^T (dP^T - delta) (the softmax scale is applied at the end)
      const bool diag = q0 + off < k0 + BK - 1 || q0 + BQ > nq || k0 + BK > nk;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = n * 8 + 2 * t + (e & 1);
          float pv = ptx::fastExp2(s[n][e] * sl2 - sL[qi]);
          if (diag) {
            const int key = e < 2 ? key0 : key1, q = q0 + qi;
            if (key > q + off || q >= nq || key >= nk) pv = 0.0f;
          }
          s[n][e] = pv;
          dp[n][e] = pv * (dp[n][e] - sDl[qi]);
        }
      // dV += P^T dO, dK += dS^T Q (k = the 16 queries: one k-step)
      {
        const unsigned pa[4] = {ptx::packBf16(s[0][0], s[0][1]), ptx::packBf16(s[0][2], s[0][3]),
                                ptx::packBf16(s[1][0], s[1][1]), ptx::packBf16(s[1][2], s[1][3])};
        const unsigned da[4] = {ptx::packBf16(dp[0][0], dp[0][1]), ptx::packBf16(dp[0][2], dp[0][3]),
                                ptx::packBf16(dp[1][0], dp[1][1]), ptx::packBf16(dp[1][2], dp[1][3])};
        const int brow = ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
        for (int d2 = 0; d2 < D / 16; ++d2) {
          unsigned b0, b1, b2, b3;
          ptx::ldmatrixX4T(b0, b1, b2, b3, sdO + tileOffset<T, D>(brow, d2 * 16 + (lane >> 4) * 8));
          ptx::mmaBf16(dv[2 * d2], pa, b0, b1);
          ptx::mmaBf16(dv[2 * d2 + 1], pa, b2, b3);
          ptx::ldmatrixX4T(b0, b1, b2, b3, sQ + tileOffset<T, D>(brow, d2 * 16 + (lane >> 4) * 8));
          ptx::mmaBf16(dk[2 * d2], da, b0, b1);
          ptx::mmaBf16(dk[2 * d2 + 1], da, b2, b3);
        }
        // dS^T to scratch for dQ
        const int r0 = warp * 16 + g;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          *reinterpret_cast<unsigned*>(sdS + dsOffset(r0, n * 8 + 2 * t)) = da[2 * n];
          *reinterpret_cast<unsigned*>(sdS + dsOffset(r0 + 8, n * 8 + 2 * t)) = da[2 * n + 1];
        }
      }
      __syncthreads();

      // dQ (16 queries x D) += dS K: warp w takes head_dim columns [w*D/4, (w+1)*D/4)
      {
        float dq[DW / 8][4];
#pragma unroll
        for (int n = 0; n < DW / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          unsigned af[4];
          ptx::ldmatrixX4T(af[0], af[1], af[2], af[3],
                           sdS + dsOffset(kk * 16 + (lane >> 4) * 8 + (lane & 7), ((lane >> 3) & 1) * 8));
          const int krow = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
          for (int d2 = 0; d2 < DW / 16; ++d2) {
            unsigned b0, b1, b2, b3;
            ptx::ldmatrixX4T(b0, b1, b2, b3, sK + tileOffset<T, D>(krow, warp * DW + d2 * 16 + (lane >> 4) * 8));
            ptx::mmaBf16(dq[2 * d2], af, b0, b1);
            ptx::mmaBf16(dq[2 * d2 + 1], af, b2, b3);
          }
        }
        const float sc = a.scale;
#pragma unroll
        for (int n = 0; n < DW / 8; ++n) {
          const int col = warp * DW + n * 8 + 2 * t;
          if (q0 + g < nq)
            ptx::redAdd2(a.dq + static_cast<std::int64_t>(qb + q0 + g) * a.dq_s0 + h * D + col, dq[n][0] * sc,
                         dq[n][1] * sc);
          if (q0 + g + 8 < nq)
            ptx::redAdd2(a.dq + static_cast<std::int64_t>(qb + q0 + g + 8) * a.dq_s0 + h * D + col, dq[n][2] * sc,
                         dq[n][3] * sc);
        }
      }
      // no trailing barrier: the next step's copies overwrite sQ/sdO/sL/sDl, last read
      // before the barrier above, and sdS is rewritten only after the next step's barrier
    }
  }

  const float sc = a.scale;
#pragma unroll
  for (int n = 0; n < DT; ++n) {
    const int col = n * 8 + 2 * t;
    if (key0 < nk) {
      const std::int64_t r = kb + key0;
      ptx::redAdd2(a.dk + r * a.dk_s0 + hk * D + col, dk[n][0] * sc, dk[n][1] * sc);
      ptx::redAdd2(a.dv + r * a.dv_s0 + hk * D + col, dv[n][0], dv[n][1]);
    }
    if (key1 < nk) {
      const std::int64_t r = kb + key1;
      ptx::redAdd2(a.dk + r * a.dk_s0 + hk * D + col, dk[n][2] * sc, dk[n][3] * sc);
      ptx::redAdd2(a.dv + r * a.dv_s0 + hk * D + col, dv[n][2], dv[n][3]);
    }
  }
}

__device__ __forceinline__ char* align128(void* p) {
  return reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(p) + 127) & ~static_cast<std::uintptr_t>(127));
}

// Entry points callable from a Kokkos lambda (compiled for host too, where they do nothing:
// the launch is always on a Cuda instance).
template <class T, int D>
KOKKOS_INLINE_FUNCTION void forwardEntry(const Args& a, int item, int h, int tid, void* scratch) {
#if defined(__CUDA_ARCH__)
  forwardTeam<T, D>(a, item, h, tid, align128(scratch));
#else
  (void)a, (void)item, (void)h, (void)tid, (void)scratch;
#endif
}
template <int D>
KOKKOS_INLINE_FUNCTION void backwardEntry(const Args& a, int item, int hk, int tid, void* scratch) {
#if defined(__CUDA_ARCH__)
  backwardTeam<D>(a, item, hk, tid, align128(scratch));
#else
  (void)a, (void)item, (void)hk, (void)tid, (void)scratch;
#endif
}

template <class T, int D>
void launchForward(const Kokkos::Cuda& space, Args a, const VarlenBatch& b) {
  using G = FwdTile<T, D>;
  const WorkView work = queryWork(space, b, G::rows, G::bk);  // a.ranges: set by the caller
  a.work = work.data();
  a.nwork = static_cast<int>(work.extent(0));
  if (a.nwork == 0) return;
  const int H = a.heads;
  using Policy = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<kMmaThreads, G::minBlocks>>;
  Kokkos::parallel_for(
      G::bf ? "wlb::attention::cuda::fwd::bf16" : "wlb::attention::cuda::fwd::tf32",
      Policy(space, a.nwork * H, kMmaThreads).set_scratch_size(0, Kokkos::PerTeam(G::scratch)),
      KOKKOS_LAMBDA(const typename Policy::member_type& team) {
        forwardEntry<T, D>(a, team.league_rank() / H, team.league_rank() % H, team.team_rank(),
                           team.team_scratch(0).get_shmem(static_cast<int>(G::scratch)));
      });
}

template <int D>
void launchBackward(const Kokkos::Cuda& space, Args a, const VarlenBatch& b) {
  using G = BwdTile<D>;
  const WorkView work = keyWork(space, b, kBwdKeys);  // a.ranges: set by the caller
  a.work = work.data();
  a.nwork = static_cast<int>(work.extent(0));
  if (a.nwork == 0) return;
  const int Hkv = a.kv_heads;
  using Policy = Kokkos::TeamPolicy<Kokkos::Cuda, Kokkos::LaunchBounds<kMmaThreads, G::minBlocks>>;
  Kokkos::parallel_for(
      "wlb::attention::cuda::bwd::bf16",
      Policy(space, a.nwork * Hkv, kMmaThreads).set_scratch_size(0, Kokkos::PerTeam(G::scratch)),
      KOKKOS_LAMBDA(const typename Policy::member_type& team) {
        backwardEntry<D>(a, team.league_rank() / Hkv, team.league_rank() % Hkv, team.team_rank(),
                         team.team_scratch(0).get_shmem(static_cast<int>(G::scratch)));
      });
}

/// True when the forward of this element type and head_dim runs the Hopper wgmma kernels
/// (cuda_hopper.hpp): built with them, a compute-capability 9.0 device, `allow`.
inline bool useHopper(int head_dim, bool allow) {
#if defined(WLB_HAVE_HOPPER)
  return allow && hopper::supports(head_dim) && hopper::usable();
#else
  (void)head_dim, (void)allow;
  return false;
#endif
}

/// Tensor-core forward (T = bf16: BF16 MMAs; T = float: TF32 MMAs): the Hopper kernels
/// where useHopper (cfg.path other than Sm80) — the warp-specialised one for BF16 with
/// cfg.warp_specialized, split-KV with cfg.split_kv — else the sm_80 ones. False when
/// head_dim is not supported (nothing launched).
template <class T>
bool mmaForward(const Kokkos::Cuda& space, const Args& a, const VarlenBatch& b, const KernelConfig& cfg) {
#if defined(WLB_HAVE_HOPPER)
  if (useHopper(a.head_dim, cfg.path != KernelConfig::Path::Sm80)) {
    constexpr bool bf = std::is_same<T, bf16>::value;
    const bool ws = bf && cfg.warp_specialized && hopper::wsReady(a, false);
    const int rows = ws ? hopper::wsRows(a.head_dim) : hopper::forwardRows(bf, a.head_dim);
    const int keys = ws ? hopper::wsKeys(a.head_dim) : hopper::forwardKeys(bf, a.head_dim);
    Args h = a;
    h.q_rows = b.q_tokens;
    h.k_rows = b.k_tokens;
    const auto run = [&] {
      if (ws)
        hopper::forwardWs(space.cuda_stream(), h);
      else
        hopper::forward(space.cuda_stream(), h, bf);
    };
    if (cfg.split_kv) {
      const split_kv::Plan plan = split_kv::plan(b.pieces, rows, keys);
      if (!plan.groups.empty()) {
        SplitWork sw(space, plan, static_cast<std::int64_t>(rows) * a.heads * a.head_dim,
                     static_cast<std::int64_t>(rows) * a.heads);
        h.work = sw.work.data();
        h.nwork = static_cast<int>(sw.work.extent(0));
        h.split = sw.split.data();
        h.groups = sw.groups.data();
        h.ngroups = static_cast<int>(sw.groups.extent(0));
        h.o_part = sw.o_part;
        h.lse_part = sw.lse_part;
        run();
        return true;
      }
    }
    const WorkView work = queryWork(space, b, rows, keys);
    h.work = work.data();
    h.nwork = static_cast<int>(work.extent(0));
    run();
    return true;
  }
#else
  (void)cfg;
#endif
  if (a.head_dim == 64) {
    launchForward<T, 64>(space, a, b);
    return true;
  }
  if (a.head_dim == 128) {
    launchForward<T, 128>(space, a, b);
    return true;
  }
  return false;
}

/// BF16 tensor-core backward (the Hopper kernels where useHopper, cfg.path other than Sm80:
/// the warp-specialised one with cfg.ws_backward when the tensors meet hopper::wsReady);
/// a.delta must hold rowsum(dO∘O). Accumulates into dq, dk, dv.
inline bool mmaBackward(const Kokkos::Cuda& space, const Args& a, const VarlenBatch& b, const KernelConfig& cfg) {
#if defined(WLB_HAVE_HOPPER)
  if (useHopper(a.head_dim, cfg.path != KernelConfig::Path::Sm80)) {
    const WorkView work = keyWork(space, b, hopper::backwardKeys());
    Args h = a;
    h.work = work.data();
    h.nwork = static_cast<int>(work.extent(0));
    h.q_rows = b.q_tokens;
    h.k_rows = b.k_tokens;
    h.bwd_rows = cfg.ws_bwd_rows;
    if (cfg.ws_backward && hopper::wsReady(a, true))
      hopper::backwardWs(space.cuda_stream(), h);
    else
      hopper::backward(space.cuda_stream(), h);
    return true;
  }
#else
  (void)cfg;
#endif
  if (a.head_dim == 64) {
    launchBackward<64>(space, a, b);
    return true;
  }
  if (a.head_dim == 128) {
    launchBackward<128>(space, a, b);
    return true;
  }
  return false;
}

#endif  // __CUDACC__

}  // namespace wlb::attention::cuda

#endif  // KOKKOS_ENABLE_CUDA
