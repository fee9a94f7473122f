// Host SIMD path of the attention kernels (see attention_host.hpp, docs/attention.md).
#include "attention/attention_host.hpp"

#if WLB_ATTN_HOST_SIMD

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "attention/host_simd.hpp"

// GCC 12 flags _mm512_undefined_ps inside the AVX-512 reduce intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// Products of tile, vector and head_dim indices (at most tile x head_dim, far below 2^31)
// are formed in int and widened only as offsets.
// NOLINTBEGIN(bugprone-implicit-widening-of-multiplication-result)
namespace wlb::attention::host {
namespace {

// ---- register-blocked GEMM micro-kernels ----------------------------------------------
// C[M][N] (= or +=) A[M][K] * B[K][N]; row-major with leading dimensions; M % RB == 0 and
// N % W == 0. RB rows of A are broadcast, NV vectors of a B row are loaded, RB*NV
// accumulators stay in registers over the whole K loop.
template <int RB, int NV, bool ACC>
WLB_AI void microKernel(std::int64_t K, const float* __restrict A, std::int64_t lda,
                        const float* __restrict B, std::int64_t ldb, float* __restrict C,
                        std::int64_t ldc) {
  vf c[RB][NV];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) c[r][j] = ACC ? ld(C + r * ldc + W * j) : vf{};
#pragma GCC unroll 4
  for (std::int64_t kk = 0; kk < K; ++kk) {
    const float* b = B + kk * ldb;
    vf bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = ld(b + W * j);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const vf av = bc(A[r * lda + kk]);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) c[r][j] = fmadd(av, bv[j], c[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) st(C + r * ldc + W * j, c[r][j]);
}

// Register block: kRB rows x kNV vectors. AVX-512 (32 zmm): 6 x 4 = 24 accumulators
// (measured best). AVX2 (16 ymm): 6 x 2 = 12 accumulators + 2 B vectors + 1 broadcast.
#if WLB_VW == 16
constexpr int kRB = 6, kNV = 4;
#else
constexpr int kRB = 6, kNV = 2;
#endif
constexpr int kPanel = kNV * W;  ///< columns per panel

template <int NV, bool ACC>
WLB_AI void rowPanel(std::int64_t M, std::int64_t K, const float* __restrict A, std::int64_t lda,
                     const float* __restrict B, std::int64_t ldb, float* __restrict C,
                     std::int64_t ldc) {
  std::int64_t i = 0;
  for (; i + kRB <= M; i += kRB) microKernel<kRB, NV, ACC>(K, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  const float* Ai = A + i * lda;
  float* Ci = C + i * ldc;
  switch (M - i) {
    case 5: microKernel<5, NV, ACC>(K, Ai, lda, B, ldb, Ci, ldc); break;
    case 4: microKernel<4, NV, ACC>(K, Ai, lda, B, ldb, Ci, ldc); break;
    case 3: microKernel<3, NV, ACC>(K, Ai, lda, B, ldb, Ci, ldc); break;
    case 2: microKernel<2, NV, ACC>(K, Ai, lda, B, ldb, Ci, ldc); break;
    case 1: microKernel<1, NV, ACC>(K, Ai, lda, B, ldb, Ci, ldc); break;
    default: break;
  }
}

/// C[M][N] (= or +=) A[M][K] B[K][N]; N % W == 0. Column panels of kPanel are the outer
/// loop so a K x kPanel panel of B stays in L1 while all row blocks stream past it.
template <bool ACC>
void gemm(std::int64_t M, std::int64_t N, std::int64_t K, const float* __restrict A,
          std::int64_t lda, const float* __restrict B, std::int64_t ldb, float* __restrict C,
          std::int64_t ldc) {
  if (K <= 0) {
    if (!ACC)
      for (std::int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * N);
    return;
  }
  std::int64_t j = 0;
  for (; j + kPanel <= N; j += kPanel) rowPanel<kNV, ACC>(M, K, A, lda, B + j, ldb, C + j, ldc);
  switch ((N - j) / W) {
    case 3: rowPanel<3, ACC>(M, K, A, lda, B + j, ldb, C + j, ldc); break;
    case 2: rowPanel<2, ACC>(M, K, A, lda, B + j, ldb, C + j, ldc); break;
    case 1: rowPanel<1, ACC>(M, K, A, lda, B + j, ldb, C + j, ldc); break;
    default: break;
  }
}

// ---- per-thread aligned scratch ---------------------------------------------------------
struct Scratch {
  float* p = nullptr;
  std::size_t n = 0;
  ~Scratch() { std::free(p); }
  float* get(std::size_t floats) {
    if (floats > n) {
      std::free(p);
      const std::size_t bytes = ((floats * sizeof(float) + 63) / 64) * 64;
      p = static_cast<float*>(std::aligned_alloc(64, bytes));
      n = floats;
    }
    return p;
  }
};
float* scratch(std::size_t floats) {
  static thread_local Scratch s;
  return s.get(floats);
}
struct Workspaces {
  Scratch slot[8];
};

std::size_t round16(std::size_t n) { return (n + 15) / 16 * 16; }

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLazy = 8.0f;  ///< forward: rescale only when the row max grows by > 2^8

}  // namespace

int vectorWidth() { return W; }

double fmaLoop(long iters) {
  // 12 independent accumulators cover the FMA latency x ports of current x86 cores; the
  // sum is returned through a volatile so the loop is not removed.
  vf acc[12];
  for (auto& x : acc) x = vf{};
  // volatile inputs: the compiler cannot fold the loop (an asm register constraint would
  // not fit every vector width / target)
  volatile float va = 1.0f + 1e-7f, vb = 1e-7f;
  const vf a = bc(va), b = bc(vb);
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (auto& x : acc) x = fmadd(a, b, x);
  }
  vf s{};
  for (const auto& x : acc) s += x;
  volatile float sink = hsum(s);
  (void)sink;
  return static_cast<double>(iters) * 12.0 * 2.0 * W;
}

float* workspace(int slot, std::size_t floats) {
  static thread_local Workspaces w;
  return w.slot[slot].get(floats == 0 ? 16 : floats);
}

namespace {

/// dst[c * ldd + r] = s * src[r * lds + c] for c < C, r < T: a tile of n <= T rows of C
/// floats transposed to C rows of T, zero past row n (C and T multiples of 8).
void packTile(const float* src, std::int64_t lds, std::int64_t n, int C, float* dst, std::int64_t T, float s) {
  for (std::int64_t r0 = 0; r0 < T; r0 += 8) {
    const std::int64_t nr = std::clamp<std::int64_t>(n - r0, 0, 8);
    for (std::int64_t c0 = 0; c0 < C; c0 += 8)
      packTransposed8(nr > 0 ? src + r0 * lds + c0 : src, lds, nr, dst + c0 * T + r0, T, s);
  }
}

}  // namespace

void packKeyTile(const Args& a, std::int64_t piece, std::int64_t kt, int hk) {
  const PieceRange& pr = a.pieces[piece];
  const int D = a.head_dim, TK = a.tile_k;
  float* dst = a.KT + ((static_cast<std::int64_t>(hk) * a.nkblk + a.kb_off[piece] + kt) * D) * TK;
  const std::int64_t k0 = kt * TK, cnt = std::min<std::int64_t>(TK, pr.nk() - k0);
  const float* src = a.k + (pr.k_begin + k0) * a.k_s0 + static_cast<std::int64_t>(hk) * D;
  packTile(src, a.k_s0, cnt, D, dst, TK, 1.0f);
}

void forwardTile(const Args& a, std::int64_t piece, std::int64_t qg, int h) {
  const PieceRange& pr = a.pieces[piece];
  const int D = a.head_dim, TQ = a.tile_q, TK = a.tile_k;
  const int hk = h / (a.heads / a.kv_heads);
  const std::int64_t nq = pr.nq(), nk = pr.nk(), off = nk - nq;
  const std::int64_t nqt = (nq + TQ - 1) / TQ;
  const std::int64_t G = std::max(1, a.q_group);
  const std::int64_t t0 = qg * G, ng = std::min<std::int64_t>(G, nqt - t0);
  if (ng <= 0) return;

  // scratch: S[TQ][TK] | per query tile g: Qs[TQ][D] | O[TQ][D] | m[TQ] | lsum[TQ][W]
  const std::size_t per = round16(TQ * D) * 2 + round16(TQ) + TQ * W;
  float* S = scratch(round16(TQ * TK) + ng * per);
  auto Qs_of = [&](std::int64_t g) { return S + round16(TQ * TK) + g * per; };
  auto O_of = [&](std::int64_t g) { return Qs_of(g) + round16(TQ * D); };
  auto m_of = [&](std::int64_t g) { return O_of(g) + round16(TQ * D); };
  auto lsum_of = [&](std::int64_t g) { return m_of(g) + round16(TQ); };

  const vf sc2 = bc(a.scale2);
  for (std::int64_t g = 0; g < ng; ++g) {
    const std::int64_t q0 = (t0 + g) * TQ, rows = std::min<std::int64_t>(TQ, nq - q0);
    float* Qs = Qs_of(g);
    float* O = O_of(g);
    float* m = m_of(g);
    float* lsum = lsum_of(g);
    for (std::int64_t r = 0; r < TQ; ++r) {
      float* dst = Qs + r * D;
      if (r < rows) {
        const float* src = a.q + (pr.q_begin + q0 + r) * a.q_s0 + static_cast<std::int64_t>(h) * D;
        for (int d = 0; d < D; d += W) st(dst + d, ld(src + d) * sc2);
      } else {
        for (int d = 0; d < D; d += W) st(dst + d, vf{});
      }
      for (int d = 0; d < D; d += W) st(O + r * D + d, vf{});
      st(lsum + r * W, vf{});
      m[r] = -std::numeric_limits<float>::infinity();
    }
  }

  const float* KTh = a.KT + (static_cast<std::int64_t>(hk) * a.nkblk + a.kb_off[piece]) * D * TK;
  const float* Vh = a.v + pr.k_begin * a.v_s0 + static_cast<std::int64_t>(hk) * D;
  const vf ninf = bc(-std::numeric_limits<float>::infinity());
  const int nvk = TK / W;
  // the last tile of the group sees the most keys
  const std::int64_t LmaxLast =
      std::min(off + (t0 + ng - 1) * TQ + std::min<std::int64_t>(TQ, nq - (t0 + ng - 1) * TQ) - 1, nk - 1);
  const std::int64_t nktAll = LmaxLast / TK + 1;
  // key tiles outer, the group's query tiles inner: each packed K^T block and V block is
  // fetched from memory once per group and reused from cache by the other query tiles
  for (std::int64_t kt = 0; kt < nktAll; ++kt) {
    const std::int64_t k0 = kt * TK;
    for (std::int64_t g = 0; g < ng; ++g) {
      const std::int64_t q0 = (t0 + g) * TQ, rows = std::min<std::int64_t>(TQ, nq - q0);
      const std::int64_t Lmin = off + q0, Lmax = std::min(off + q0 + rows - 1, nk - 1);
      if (kt > Lmax / TK) continue;  // fully masked for this query tile
      float* Qs = Qs_of(g);
      float* O = O_of(g);
      float* m = m_of(g);
      float* lsum = lsum_of(g);
      gemm<false>(TQ, TK, D, Qs, D, KTh + kt * D * TK, TK, S, TK);
      if (k0 + TK - 1 > Lmin) {  // diagonal tile: mask keys beyond each row's limit
        for (std::int64_t r = 0; r < TQ; ++r) {
          const std::int64_t L = r < rows ? std::min(off + q0 + r, nk - 1) : Lmax;
          const vi lim = bci(static_cast<int>(L - k0));
          for (int j = 0; j < nvk; ++j) {
            const vi kidx = iotaW() + W * j;
            float* s = S + r * TK + W * j;
            st(s, kidx > lim ? ninf : ld(s));
          }
        }
      }
      // online softmax with lazy rescaling (as in FlashAttention-3): the running max m of a
      // row is raised, and O and the sums rescaled, only when a score exceeds m by more than
      // kLazy (log2 units); otherwise P = 2^(S - m) <= 2^kLazy, harmless in float. The
      // check is one vector compare per row, no horizontal max.
      for (std::int64_t r = 0; r < TQ; ++r) {
        float* s = S + r * TK;
        vf mx = ld(s);
        for (int j = 1; j < nvk; ++j) mx = vmax(mx, ld(s + W * j));
        const float mo = m[r];
        vf acc = ld(lsum + r * W);
        if (anyGreater(mx, mo + kLazy)) {  // also the first tile (m = -inf)
          const float mn = hmax(mx);
          const vf alv = exp2v(bc(mo - mn));  // 0 when mo = -inf; no libm call in the loop
          m[r] = mn;
          acc = acc * alv;
          float* orow = O + r * D;
          for (int d = 0; d < D; d += W) st(orow + d, ld(orow + d) * alv);
        }
        const vf mr = bc(m[r]);
        for (int j = 0; j < nvk; ++j) {
          const vf p = exp2v(ld(s + W * j) - mr);
          st(s + W * j, p);
          acc += p;
        }
        st(lsum + r * W, acc);
      }
      const std::int64_t cnt = std::min<std::int64_t>(TK, Lmax + 1 - k0);
      gemm<true>(TQ, D, cnt, S, TK, Vh + k0 * a.v_s0, a.v_s0, O, D);
    }
  }
  for (std::int64_t g = 0; g < ng; ++g) {
    const std::int64_t q0 = (t0 + g) * TQ, rows = std::min<std::int64_t>(TQ, nq - q0);
    const float* O = O_of(g);
    const float* m = m_of(g);
    const float* lsum = lsum_of(g);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float l = hsum(ld(lsum + r * W));
      const vf inv = bc(1.0f / l);
      const std::int64_t t = pr.q_begin + q0 + r;
      float* dst = a.o_out + t * a.o_s0 + static_cast<std::int64_t>(h) * D;
      for (int d = 0; d < D; d += W) st(dst + d, ld(O + r * D + d) * inv);
      a.lse_out[t * a.lse_s0 + h] = (m[r] + std::log2(l)) * kLn2;
    }
  }
}

void packQueryTile(const Args& a, std::int64_t piece, std::int64_t qt, int h) {
  const PieceRange& pr = a.pieces[piece];
  const int D = a.head_dim, TQ = a.tile_q;
  const std::int64_t q0 = qt * TQ, rows = std::min<std::int64_t>(TQ, pr.nq() - q0);
  const std::int64_t blk = static_cast<std::int64_t>(h) * a.nqblk + a.qb_off[piece] + qt;
  float* qt_ = a.QT + blk * D * TQ;
  float* dot = a.dOT + blk * D * TQ;
  float* lse2 = a.LSE2 + blk * TQ;
  float* dlt = a.DLT + blk * TQ;
  for (std::int64_t r = 0; r < TQ; ++r) {
    if (r < rows) {
      const std::int64_t t = pr.q_begin + q0 + r;
      const float* ds = a.dO + t * a.dO_s0 + static_cast<std::int64_t>(h) * D;
      const float* os = a.o + t * a.o_s0 + static_cast<std::int64_t>(h) * D;
      vf acc{};
      for (int d = 0; d < D; d += W) acc = fmadd(ld(ds + d), ld(os + d), acc);
      dlt[r] = hsum(acc);
      lse2[r] = a.lse[t * a.lse_s0 + h] * kLog2e;
    } else {
      dlt[r] = 0.0f;
      lse2[r] = 0.0f;
    }
  }
  const float* qb = a.q + (pr.q_begin + q0) * a.q_s0 + static_cast<std::int64_t>(h) * D;
  const float* db = a.dO + (pr.q_begin + q0) * a.dO_s0 + static_cast<std::int64_t>(h) * D;
  packTile(qb, a.q_s0, rows, D, qt_, TQ, a.scale2);
  packTile(db, a.dO_s0, rows, D, dot, TQ, 1.0f);
}

void backwardKvHead(const Args& a, int hk) {
  const int D = a.head_dim, TQ = a.tile_q, TK = a.tile_k;
  const int group = a.heads / a.kv_heads;
  const std::int64_t G = std::max(1, a.k_group);
  // scratch: ST[TK][TQ] | dPT[TK][TQ] | per key tile g of the group: Kn | Vn | dK | dV ([TK][D])
  const std::size_t kd = round16(static_cast<std::size_t>(TK) * D),
                    kq = round16(static_cast<std::size_t>(TK) * TQ);
  float* ST = scratch(2 * kq + G * 4 * kd);
  float* dPT = ST + kq;
  auto Kn_of = [&](std::int64_t g) { return dPT + kq + g * 4 * kd; };
  const int nvq = TQ / W;

  for (std::int64_t p = 0; p < a.num_pieces; ++p) {
    const PieceRange& pr = a.pieces[p];
    const std::int64_t nq = pr.nq(), nk = pr.nk(), off = nk - nq;
    if (nq <= 0) continue;
    const std::int64_t nkt = (nk + TK - 1) / TK;
    // groups of G key tiles: every query tile block (Q^T, dO^T, dQ^T, Q and dO rows) is
    // fetched once per group and reused from cache by the group's key tiles
    for (std::int64_t kg = 0; kg < nkt; kg += G) {
      const std::int64_t ng = std::min<std::int64_t>(G, nkt - kg);
      for (std::int64_t g = 0; g < ng; ++g) {
        const std::int64_t k0 = (kg + g) * TK, kcnt = std::min<std::int64_t>(TK, nk - k0);
        float* Kn = Kn_of(g);
        float* Vn = Kn + kd;
        float* dK = Vn + kd;
        float* dV = dK + kd;
        for (std::int64_t r = 0; r < TK; ++r) {
          float* kr = Kn + r * D;
          float* vr = Vn + r * D;
          if (r < kcnt) {
            const float* ks = a.k + (pr.k_begin + k0 + r) * a.k_s0 + static_cast<std::int64_t>(hk) * D;
            const float* vs = a.v + (pr.k_begin + k0 + r) * a.v_s0 + static_cast<std::int64_t>(hk) * D;
            for (int d = 0; d < D; d += W) {
              st(kr + d, ld(ks + d));
              st(vr + d, ld(vs + d));
            }
          } else {
            for (int d = 0; d < D; d += W) {
              st(kr + d, vf{});
              st(vr + d, vf{});
            }
          }
          for (int d = 0; d < D; d += W) {
            st(dK + r * D + d, vf{});
            st(dV + r * D + d, vf{});
          }
        }
      }
      // the group's first key tile is seen by the most query tiles
      const std::int64_t qfirst0 = std::max<std::int64_t>(0, kg * TK - off);
      for (int h = hk * group; h < (hk + 1) * group; ++h) {
        for (std::int64_t qt = qfirst0 / TQ; qt * TQ < nq; ++qt) {
          const std::int64_t q0 = qt * TQ, qcnt = std::min<std::int64_t>(TQ, nq - q0);
          const std::int64_t blk = static_cast<std::int64_t>(h) * a.nqblk + a.qb_off[p] + qt;
          const float* QTb = a.QT + blk * D * TQ;
          const float* dOTb = a.dOT + blk * D * TQ;
          const float* lse2 = a.LSE2 + blk * TQ;
          const float* dlt = a.DLT + blk * TQ;
          float* dQTb = a.dQT + blk * D * TQ;
          const float* dOrows = a.dO + (pr.q_begin + q0) * a.dO_s0 + static_cast<std::int64_t>(h) * D;
          const float* Qrows = a.q + (pr.q_begin + q0) * a.q_s0 + static_cast<std::int64_t>(h) * D;
          for (std::int64_t g = 0; g < ng; ++g) {
            const std::int64_t kt = kg + g;
            const std::int64_t k0 = kt * TK, kcnt = std::min<std::int64_t>(TK, nk - k0);
            // query tile qt sees key tile kt iff its last row reaches the tile's first key
            if (off + q0 + qcnt - 1 < k0) break;  // later key tiles of the group: masked too
            const float* Kn = Kn_of(g);
            const float* Vn = Kn + kd;
            float* dK = const_cast<float*>(Vn) + kd;
            float* dV = dK + kd;
            const float* KTblk =
                a.KT + ((static_cast<std::int64_t>(hk) * a.nkblk + a.kb_off[p] + kt) * D) * TK;
            const std::int64_t kmax = k0 + kcnt - 1;  // last valid key of the tile
            gemm<false>(TK, TQ, D, Kn, D, QTb, TQ, ST, TQ);
            gemm<false>(TK, TQ, D, Vn, D, dOTb, TQ, dPT, TQ);
            const bool masked = (off + q0 < kmax) || qcnt < TQ;
            for (std::int64_t r = 0; r < TK; ++r) {
              float* s = ST + r * TQ;
              float* dp = dPT + r * TQ;
              // query q (piece-local) sees key k0+r iff off + q >= k0 + r and q < nq
              const vi qlo = bci(static_cast<int>(k0 + r - off - q0));
              const vi qhi = bci(static_cast<int>(qcnt));
              for (int j = 0; j < nvq; ++j) {
                vf pv = exp2v(ld(s + W * j) - ld(lse2 + W * j));
                if (masked) {
                  const vi qi = iotaW() + W * j;
                  pv = (qi >= qlo) & (qi < qhi) ? pv : vf{};
                }
                st(s + W * j, pv);
                st(dp + W * j, pv * (ld(dp + W * j) - ld(dlt + W * j)));
              }
            }
            // ST now holds P^T, dPT holds dS^T
            gemm<true>(TK, D, qcnt, ST, TQ, dOrows, a.dO_s0, dV, D);
            gemm<true>(TK, D, qcnt, dPT, TQ, Qrows, a.q_s0, dK, D);
            // key tile 0 (every query sees key 0) writes the block, the later ones add: no
            // zeroing pass over dQ^T, and the same sums as adding to zeros
            if (kt == 0)
              gemm<false>(D, TQ, kcnt, KTblk, TK, dPT, TQ, dQTb, TQ);
            else
              gemm<true>(D, TQ, kcnt, KTblk, TK, dPT, TQ, dQTb, TQ);
          }
        }
      }
      const vf sc = bc(a.scale);
      for (std::int64_t g = 0; g < ng; ++g) {
        const std::int64_t k0 = (kg + g) * TK, kcnt = std::min<std::int64_t>(TK, nk - k0);
        const float* dK = Kn_of(g) + 2 * kd;
        const float* dV = dK + kd;
        for (std::int64_t r = 0; r < kcnt; ++r) {
          float* dkr = a.dk + (pr.k_begin + k0 + r) * a.dk_s0 + static_cast<std::int64_t>(hk) * D;
          float* dvr = a.dv + (pr.k_begin + k0 + r) * a.dv_s0 + static_cast<std::int64_t>(hk) * D;
          for (int d = 0; d < D; d += W) {
            st(dkr + d, fmadd(ld(dK + r * D + d), sc, ld(dkr + d)));
            st(dvr + d, ld(dvr + d) + ld(dV + r * D + d));
          }
        }
      }
    }
  }
}

void unpackDq(const Args& a, std::int64_t piece, std::int64_t qt, int h) {
  const PieceRange& pr = a.pieces[piece];
  const int D = a.head_dim, TQ = a.tile_q;
  const std::int64_t q0 = qt * TQ, rows = std::min<std::int64_t>(TQ, pr.nq() - q0);
  const std::int64_t blk = static_cast<std::int64_t>(h) * a.nqblk + a.qb_off[piece] + qt;
  const float* src = a.dQT + blk * D * TQ;
  float* dst = a.dq + (pr.q_begin + q0) * a.dq_s0 + static_cast<std::int64_t>(h) * D;
  for (std::int64_t r0 = 0; r0 < rows; r0 += 8)
    for (std::int64_t d0 = 0; d0 < D; d0 += 8)
      addTransposed8(src + d0 * TQ + r0, TQ, dst + r0 * a.dq_s0 + d0, a.dq_s0, std::min<std::int64_t>(8, rows - r0),
                     a.scale);
}

}  // namespace wlb::attention::host
// NOLINTEND(bugprone-implicit-widening-of-multiplication-result)

#endif  // WLB_ATTN_HOST_SIMD
