/// \file cuda_hopper.cu
/// \brief Hopper attention forward (see cuda_hopper.hpp): FlashAttention-2 dataflow on
/// warpgroup MMAs. Compiled for sm_90a only, without Kokkos.
///
/// One block = NWG warpgroups (128 threads each) over NWG*64 query rows of one head; each
/// warpgroup owns 64 rows. Q, K and V tiles sit in shared memory in the 128-byte swizzled
/// layout the MMA descriptors read (16-byte chunk c of row r at chunk c ^ (r % 8), tiles
/// cut into 128-byte column blocks); K/V tiles of BN keys are double-buffered, the copy
/// of tile j + 2 overlapping the math of tile j + 1. S = Q K^T reads both operands from
/// shared memory; P stays in registers (the accumulator layout of an m64nN tile is the
/// A-fragment layout of the next product) and O += P V reads V from shared memory —
/// transposed by the MMA itself for BF16, stored transposed (key-permuted to match P's
/// fragment) for TF32, which has no transposed operand. Online softmax in base 2 as in the
/// sm_80 kernels (cuda_mma.hpp), whose masking and output contracts this kernel keeps.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "attention/cuda_hopper.hpp"
#include "attention/cuda_wgmma.hpp"

namespace wlb::attention::hopper {
namespace kern {
using namespace cuda::ptx;  // cp.async, conversions, exp2, quad shuffles, reductions

// ---------------- geometry ----------------------------------------------------------------

template <bool BF, int D, int BN, int NWG>
struct Geo {
  static constexpr int esize = BF ? 2 : 4;
  static constexpr int rowBytes = D * esize;  ///< one head of one token
  static constexpr int cpr = rowBytes / 16;   ///< 16-byte chunks per row
  static constexpr int rows = 64 * NWG;       ///< query rows per block
  static constexpr int threads = 128 * NWG;
  static constexpr int qBytes = rows * rowBytes;
  static constexpr int kvBytes = BN * rowBytes;             ///< one K (or V, or transposed V) stage
  static constexpr int smem = qBytes + 4 * kvBytes + 1024;  // + alignment slack
  static constexpr int steps = D * esize / 32;              ///< MMA k-steps over head_dim (32 bytes each)
  static_assert(BN % 32 == 0 && rowBytes % 128 == 0, "tiles are whole 128-byte blocks");
};

/// cp.async rows [r0, r0 + R) of a token matrix (row stride `sb` bytes, rows clamped to
/// [0, valid): the clamped copies are masked or never stored) into a swizzled tile.
template <int R, int CPR, int NT>
__device__ __forceinline__ void stage(char* s, const char* g, std::int64_t sb, int r0, int valid, int tid) {
#pragma unroll 4
  for (int i = tid; i < R * CPR; i += NT) {
    const int r = i / CPR, c = i % CPR;
    const int src = r0 + r < valid ? r0 + r : valid - 1;
    cpAsync16(s + swz<R>(r, c), g + src * sb + c * 16);
  }
}

/// TF32: V rows [r0, r0 + BN) of one head into registers (lanes of a warp take 32
/// consecutive keys of one 4-float column chunk, so the transposed stores below are free
/// of bank conflicts).
template <int D, int BN, int NT>
struct VRegs {
  static constexpr int n = BN * D / 4 / NT;
  float4 x[n];
  __device__ __forceinline__ void load(const char* g, std::int64_t sb, int r0, int valid, int tid) {
#pragma unroll
    for (int i = 0; i < n; ++i) {
      const int e = tid + i * NT, key = e % BN, c = e / BN;
      const int src = r0 + key < valid ? r0 + key : valid - 1;
      x[i] = *reinterpret_cast<const float4*>(g + src * sb + c * 16);
    }
  }
  /// Transposed store: Vt[d][key] as BN/32 column blocks of D rows x 32 keys, keys of each
  /// group of 8 permuted (key 2u -> slot u, key 2u+1 -> slot u+4) to match P's fragments.
  __device__ __forceinline__ void store(char* s, int tid) const {
#pragma unroll
    for (int i = 0; i < n; ++i) {
      const int e = tid + i * NT, key = e % BN, c = e / BN;
      const int kin = key & 31, slot = (kin & ~7) | ((kin & 7) >> 1) | ((kin & 1) << 2);
      const float v[4] = {x[i].x, x[i].y, x[i].z, x[i].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int d = 4 * c + j;
        *reinterpret_cast<unsigned*>(s + (key >> 5) * D * 128 + d * 128 + (((slot >> 2) ^ (d & 7)) << 4) +
                                     (slot & 3) * 4) = tf32(v[j]);
      }
    }
  }
};

// ---------------- forward kernel ----------------------------------------------------------

template <bool BF, int D, int BN, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1) forwardKernel(const cuda::Args a) {
#if defined(WLB_HOPPER_DEVICE)
  using G = Geo<BF, D, BN, NWG>;
  constexpr int NT = G::threads, BQ = G::rows, KS = BF ? 16 : 8;
  extern __shared__ char smraw[];
  char* sQ = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(smraw) + 1023) & ~std::uintptr_t{1023});
  char* sK = sQ + G::qBytes;       // two stages
  char* sV = sK + 2 * G::kvBytes;  // two stages (TF32: transposed)

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int H = a.heads;
  const int item = blockIdx.x / H, h = blockIdx.x % H;
  const int p = a.work[2 * item], tile = a.work[2 * item + 1];
  const int qb = a.ranges[4 * p], nq = a.ranges[4 * p + 1] - qb, kb = a.ranges[4 * p + 2],
            nk = a.ranges[4 * p + 3] - kb, off = nk - nq;
  const int q0 = tile * BQ;
  const int hk = h / (a.heads / a.kv_heads);
  const std::int64_t qsb = a.q_s0 * G::esize, ksb = a.k_s0 * G::esize, vsb = a.v_s0 * G::esize;
  const char* Qg = static_cast<const char*>(a.q) + (static_cast<std::int64_t>(qb) * a.q_s0 + h * D) * G::esize;
  const char* Kg = static_cast<const char*>(a.k) + (static_cast<std::int64_t>(kb) * a.k_s0 + hk * D) * G::esize;
  const char* Vg = static_cast<const char*>(a.v) + (static_cast<std::int64_t>(kb) * a.v_s0 + hk * D) * G::esize;

  const int qend = q0 + BQ < nq ? q0 + BQ : nq;
  const int nkt = (off + qend + BN - 1) / BN;  // key tiles visible to some valid row (>= 1)
  // split-KV: this item walks key tiles [jb, je) and writes a partial output to `slot`; a
  // part starts where every row of the tile sees a key (split_kv.hpp), so every row's
  // running max is finite after the part's first tile as after tile 0
  int jb = 0, je = nkt, slot = -1;
  if (a.split) {
    jb = a.split[3 * item];
    je = a.split[3 * item + 1] < nkt ? a.split[3 * item + 1] : nkt;
    slot = a.split[3 * item + 2];
  }

  // group 0: Q and tile jb; group 1: tile jb + 1 (maybe empty); group j + 2 is issued after tile j
  stage<BQ, G::cpr, NT>(sQ, Qg, qsb, q0, nq, tid);
  stage<BN, G::cpr, NT>(sK, Kg, ksb, jb * BN, nk, tid);
  if constexpr (BF) stage<BN, G::cpr, NT>(sV, Vg, vsb, jb * BN, nk, tid);
  cpAsyncCommit();
  if (jb + 1 < je) {
    stage<BN, G::cpr, NT>(sK + G::kvBytes, Kg, ksb, (jb + 1) * BN, nk, tid);
    if constexpr (BF) stage<BN, G::cpr, NT>(sV + G::kvBytes, Vg, vsb, (jb + 1) * BN, nk, tid);
  }
  cpAsyncCommit();
  VRegs<D, BN, NT> vr;  // TF32 only: the next V tile on its way to the transposed stage
  if constexpr (!BF) {
    vr.load(Vg, vsb, jb * BN, nk, tid);
    vr.store(sV, tid);
    if (jb + 1 < je) vr.load(Vg, vsb, (jb + 1) * BN, nk, tid);
  }

  // this warpgroup's rows: warp w holds rows wr + {g, g + 8}
  const int wfirst = q0 + wg * 64;
  const int wlast = (wfirst + 63 < nq ? wfirst + 63 : nq - 1);  // < wfirst: no valid row
  const int wr = wfirst + warp * 16 + g;
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  const float sl2 = a.scale_log2;

  for (int j = jb; j < je; ++j) {
    const int buf = (j - jb) & 1;
    const char* sKj = sK + buf * G::kvBytes;
    const char* sVj = sV + buf * G::kvBytes;
    cpAsyncWait<1>();  // tile j landed; tile j + 1 may be in flight
    fenceProxyAsync();
    __syncthreads();
    const int k0 = j * BN;
    if (wfirst <= wlast && k0 <= wlast + off) {  // uniform in the warpgroup
      float s[BN / 2];
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] = 0.0f;
      fenceRegs(s);
      wgmmaFence();
#pragma unroll
      for (int ks = 0; ks < G::steps; ++ks) {
        const int cb = ks * 32 / 128, in = ks * 32 % 128;
        mmaSS<BF, BN>(s, desc(sQ + cb * BQ * 128 + wg * 64 * 128 + in, 16, 1024),
                      desc(sKj + cb * BN * 128 + in, 16, 1024));
      }
      wgmmaCommit();
      wgmmaWait<0>();
      fenceRegs(s);

      // mask (diagonal and ragged tiles only), online softmax in base 2, O rescaled
      float al0, al1;
      onlineSoftmax<BN>(s, k0, wfirst, wr, t, off, nk, sl2, m0, m1, l0, l1, al0, al1);
      rescaleRows<D>(o, al0, al1);

      // O += P V (every fragment of P built before the MMAs: registers written between
      // asynchronous MMAs would make the compiler serialise them)
      unsigned pa[BN / KS][4];
      packP<BF, BN>(pa, s);
      fenceRegs(o);
      wgmmaFence();
#pragma unroll
      for (int kk = 0; kk < BN / KS; ++kk) {
        if constexpr (BF)  // V [key][d]: 16 keys = two 8-row groups (1024 B apart), D/64 column blocks
          mmaRS<BF, D>(o, pa[kk], desc(sVj + kk * 16 * 128, BN * 128, 1024));
        else  // Vt [d][key]: 8 keys = 32 bytes of a 128-byte column block of 32 keys
          mmaRS<BF, D>(o, pa[kk], desc(sVj + (kk >> 2) * D * 128 + (kk & 3) * 32, 16, 1024));
      }
      wgmmaCommit();
      wgmmaWait<0>();
      fenceRegs(o);
    }
    if constexpr (!BF) {
      if (j + 1 < je) {
        vr.store(sV + (buf ^ 1) * G::kvBytes, tid);  // last read by tile j - 1
        if (j + 2 < je) vr.load(Vg, vsb, (j + 2) * BN, nk, tid);
      }
    }
    __syncthreads();  // every warpgroup is done with stage `buf`
    if (j + 2 < je) {
      stage<BN, G::cpr, NT>(sK + buf * G::kvBytes, Kg, ksb, (j + 2) * BN, nk, tid);
      if constexpr (BF) stage<BN, G::cpr, NT>(sV + buf * G::kvBytes, Vg, vsb, (j + 2) * BN, nk, tid);
    }
    cpAsyncCommit();
  }

  if (wfirst > wlast) return;
  storeRows<BF, D, BQ>(a, o, m0, m1, l0, l1, wr, t, qb, q0, nq, h, slot);
#else
  (void)a;
  WLB_HOPPER_UNSUPPORTED();
#endif
}

// ---------------- split-KV combine ---------------------------------------------------------

// One block per (split query tile, head): row by row, the parts' weights exp(lse_s - lse)
// from their LSEs, then the output columns in pairs across the block's threads (coalesced
// reads of each part's row); writes O and the LSE as the unsplit forward would.
template <bool BF, int D>
__global__ void __launch_bounds__(64) combineKernel(const cuda::Args a, int rows) {
#if defined(WLB_HOPPER_DEVICE)
  const int H = a.heads;
  const int gi = blockIdx.x / H, h = blockIdx.x % H;
  const int p = a.groups[4 * gi], tile = a.groups[4 * gi + 1], slot0 = a.groups[4 * gi + 2],
            parts = a.groups[4 * gi + 3];
  const int qb = a.ranges[4 * p], nq = a.ranges[4 * p + 1] - qb, q0 = tile * rows;
  const int nr = nq - q0 < rows ? nq - q0 : rows;
  const std::int64_t slotRows = static_cast<std::int64_t>(rows) * H;
  for (int r = 0; r < nr; ++r) {
    const std::int64_t pr = static_cast<std::int64_t>(r) * H + h;
    float mx = -INFINITY;
    for (int s = 0; s < parts; ++s) mx = fmaxf(mx, a.lse_part[(slot0 + s) * slotRows + pr]);
    float sum = 0.0f;
    for (int s = 0; s < parts; ++s) sum += expf(a.lse_part[(slot0 + s) * slotRows + pr] - mx);
    const float l = mx + logf(sum);
    const std::int64_t orow = static_cast<std::int64_t>(qb + q0 + r) * a.o_s0 + h * D;
    for (int d = 2 * static_cast<int>(threadIdx.x); d < D; d += 2 * static_cast<int>(blockDim.x)) {
      float x0 = 0.0f, x1 = 0.0f;
      for (int s = 0; s < parts; ++s) {
        const float w = expf(a.lse_part[(slot0 + s) * slotRows + pr] - l);
        const float2 v = *reinterpret_cast<const float2*>(a.o_part + ((slot0 + s) * slotRows + pr) * D + d);
        x0 = fmaf(w, v.x, x0);
        x1 = fmaf(w, v.y, x1);
      }
      if constexpr (BF)
        *reinterpret_cast<unsigned*>(static_cast<char*>(a.o_out) + (orow + d) * 2) = packBf16(x0, x1);
      else
        *reinterpret_cast<float2*>(static_cast<float*>(a.o_out) + orow + d) = make_float2(x0, x1);
    }
    if (threadIdx.x == 0) a.lse_out[static_cast<std::int64_t>(qb + q0 + r) * a.lse_s0 + h] = l;
  }
#else
  (void)a, (void)rows;
  WLB_HOPPER_UNSUPPORTED();
#endif
}

// ---------------- backward kernel (BF16) --------------------------------------------------

template <int D>
struct BwdGeo {
  static constexpr int rowBytes = D * 2;
  static constexpr int cpr = rowBytes / 16;
  static constexpr int kvBytes = kBwdKeys * rowBytes;  ///< K or V tile
  static constexpr int qBytes = kBwdRows * rowBytes;   ///< Q or dO tile (two stages each)
  static constexpr int dsBytes = kBwdKeys * kBwdRows * 2;
  static constexpr int oK = 0, oV = kvBytes, oQ = 2 * kvBytes, odO = oQ + 2 * qBytes, odS = odO + 2 * qBytes,
                       oL = odS + dsBytes, oDl = oL + 2 * kBwdRows * 4;
  static constexpr int smem = oDl + 2 * kBwdRows * 4 + 1024;
};

/// One block per (key tile of 128 keys, KV head); warpgroup w owns keys [64 w, 64 w + 64)
/// and keeps their dK and dV in registers. Steps of 64 query rows over the GQA group's
/// heads and the query tiles that see the tile, Q/dO double-buffered (the copy of step s + 1
/// overlaps step s). Per step: S^T = K Q^T and dP^T = V dO^T (both operands in shared
/// memory), P^T from the LSE, dS^T = P^T (dP^T - delta); dV += P^T dO and dK += dS^T Q with
/// P^T / dS^T as register A operands; dS^T goes to shared memory and dQ = dS K is one more
/// MMA over both warpgroups' keys (D = 128: each warpgroup takes 64 of the head_dim columns;
/// D = 64: each its own keys), reduced into dq in L2. Pieces may share keys, so dK/dV end
/// with reductions too.
template <int D>
__global__ void __launch_bounds__(256, 1) backwardKernel(const cuda::Args a) {
#if defined(WLB_HOPPER_DEVICE)
  using G = BwdGeo<D>;
  constexpr int BN = kBwdKeys, BM = kBwdRows, NT = 256;
  extern __shared__ char smraw[];
  char* sm = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(smraw) + 1023) & ~std::uintptr_t{1023});
  char* sK = sm + G::oK;
  char* sV = sm + G::oV;
  char* sdS = sm + G::odS;
  float* sL = reinterpret_cast<float*>(sm + G::oL);
  float* sDl = reinterpret_cast<float*>(sm + G::oDl);

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int Hkv = a.kv_heads, H = a.heads, group = a.heads / a.kv_heads;
  const int item = blockIdx.x / Hkv, hk = blockIdx.x % Hkv;
  const int p = a.work[2 * item], kt = a.work[2 * item + 1];
  const int qb = a.ranges[4 * p], nq = a.ranges[4 * p + 1] - qb, kb = a.ranges[4 * p + 2],
            nk = a.ranges[4 * p + 3] - kb, off = nk - nq;
  const int k0 = kt * BN;
  const std::int64_t qsb = a.q_s0 * 2, dosb = a.dO_s0 * 2;
  const char* Qg = static_cast<const char*>(a.q) + static_cast<std::int64_t>(qb) * qsb;
  const char* dOg = static_cast<const char*>(a.dO) + static_cast<std::int64_t>(qb) * dosb;

  const int qt0 = (k0 - off > 0 ? k0 - off : 0) / BM;  // first query tile that sees the key tile
  const int nqt = (nq + BM - 1) / BM;
  const int per = nqt - qt0;  // steps per head
  const int steps = per * group;

  // step s -> (head, first query row)
  auto stepHead = [&](int st) { return hk * group + st / per; };
  auto stepRow = [&](int st) { return (qt0 + st % per) * BM; };
  auto issue = [&](int st) {  // Q and dO of step st into stage st & 1
    const int h = stepHead(st), r0 = stepRow(st), b = st & 1;
    stage<BM, G::cpr, NT>(sm + G::oQ + b * G::qBytes, Qg + h * D * 2, qsb, r0, nq, tid);
    stage<BM, G::cpr, NT>(sm + G::odO + b * G::qBytes, dOg + h * D * 2, dosb, r0, nq, tid);
    cpAsyncCommit();
  };
  // LSE (base 2) and delta of step st: one value per thread of the first warpgroup
  auto loadLD = [&](int st) -> float {
    const int h = stepHead(st), r = stepRow(st) + (tid & 63);
    if (r >= nq) return 0.0f;
    return tid < 64 ? a.lse[static_cast<std::int64_t>(qb + r) * a.lse_s0 + h] * 1.4426950408889634f
                    : a.delta[static_cast<std::int64_t>(qb + r) * H + h];
  };

  stage<BN, G::cpr, NT>(sK, static_cast<const char*>(a.k) + (static_cast<std::int64_t>(kb) * a.k_s0 + hk * D) * 2,
                        a.k_s0 * 2, k0, nk, tid);
  stage<BN, G::cpr, NT>(sV, static_cast<const char*>(a.v) + (static_cast<std::int64_t>(kb) * a.v_s0 + hk * D) * 2,
                        a.v_s0 * 2, k0, nk, tid);
  if (steps > 0) issue(0);  // same group as K/V
  if (tid < 128 && steps > 0) (tid < 64 ? sL : sDl)[tid & 63] = loadLD(0);

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
  const int key0 = k0 + wg * 64 + warp * 16 + g;  // this thread's accumulator rows key0, key0 + 8
  const float sl2 = a.scale_log2;

  for (int st = 0; st < steps; ++st) {
    const int b = st & 1, h = stepHead(st), q0 = stepRow(st);
    const char* sQ = sm + G::oQ + b * G::qBytes;
    const char* sdO = sm + G::odO + b * G::qBytes;
    const float* L = sL + b * BM;
    const float* Dl = sDl + b * BM;
    cpAsyncWait<0>();
    fenceProxyAsync();
    __syncthreads();  // step st's tiles landed; every thread finished step st - 1
    float ld = 0.0f;
    if (st + 1 < steps) {
      issue(st + 1);
      if (tid < 128) ld = loadLD(st + 1);
    }

    // S^T = K_w Q^T, dP^T = V_w dO^T (64 keys x 64 queries per warpgroup); P^T and dS^T;
    // dV += P^T dO, dK += dS^T Q issued; dS^T to shared memory for dQ
    float sv[32], dp[32];
    bwdScores<D>(sv, dp, sK, sV, sQ, sdO, wg);
    const bool diag = q0 + off < k0 + wg * 64 + 63 || q0 + BM > nq || k0 + BN > nk;
    bwdProbs(sv, dp, L, Dl, sl2, diag, key0, q0, t, off, nq, nk);
    unsigned pa[4][4], da[4][4];
    bwdDkDv<D>(dk, dv, pa, da, sv, dp, sQ, sdO);
    storeDsT(sdS, da, wg * 64 + warp * 16 + g, t);
    if (tid < 128 && st + 1 < steps) (tid < 64 ? sL : sDl)[(b ^ 1) * BM + (tid & 63)] = ld;
    fenceProxyAsync();
    __syncthreads();  // both warpgroups' dS^T visible

    // dQ (64 queries x 64 columns) = dS K (and dV, dK waited for)
    float dq[32];
    bwdDq<D>(dq, dk, dv, sdS, sK, wg);
    const float sc = a.scale;
    const int colBase = D == 128 ? wg * 64 : 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int q = q0 + warp * 16 + g + 8 * half;
      if (q >= nq) continue;
      float* dst = a.dq + static_cast<std::int64_t>(qb + q) * a.dq_s0 + h * D + colBase + 2 * t;
#pragma unroll
      for (int i = 0; i < 8; ++i) redAdd2(dst + 8 * i, dq[4 * i + 2 * half] * sc, dq[4 * i + 2 * half + 1] * sc);
    }
  }

  addKeyGrads<D>(a, dk, dv, key0, nk, kb, hk, t);
#else
  (void)a;
  WLB_HOPPER_UNSUPPORTED();
#endif
}

// ---------------- host side ----------------------------------------------------------------

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("wlb::attention::hopper: ") + what + ": " + cudaGetErrorString(e));
}

template <bool BF, int D, int BN, int NWG>
void launch(cudaStream_t st, const cuda::Args& a) {
  using G = Geo<BF, D, BN, NWG>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(forwardKernel<BF, D, BN, NWG>, cudaFuncAttributeMaxDynamicSharedMemorySize, G::smem);
  check(attr, "cudaFuncSetAttribute");
  forwardKernel<BF, D, BN, NWG><<<a.nwork * a.heads, G::threads, G::smem, st>>>(a);
  check(cudaGetLastError(), "forward launch");
  combineParts(st, a, BF, G::rows);
}

void combineParts(cudaStream_t st, const cuda::Args& a, bool bf16, int rows) {
  if (!a.split || a.ngroups == 0) return;
  const int blocks = a.ngroups * a.heads;
  if (bf16 && a.head_dim == 64) combineKernel<true, 64><<<blocks, 64, 0, st>>>(a, rows);
  if (bf16 && a.head_dim == 128) combineKernel<true, 128><<<blocks, 64, 0, st>>>(a, rows);
  if (!bf16 && a.head_dim == 64) combineKernel<false, 64><<<blocks, 64, 0, st>>>(a, rows);
  if (!bf16 && a.head_dim == 128) combineKernel<false, 128><<<blocks, 64, 0, st>>>(a, rows);
  check(cudaGetLastError(), "split-KV combine launch");
}

template <int D>
void launchBackward(cudaStream_t st, const cuda::Args& a) {
  static const cudaError_t attr =
      cudaFuncSetAttribute(backwardKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, BwdGeo<D>::smem);
  check(attr, "cudaFuncSetAttribute");
  backwardKernel<D><<<a.nwork * a.kv_heads, 256, BwdGeo<D>::smem, st>>>(a);
  check(cudaGetLastError(), "backward launch");
}

/// Keys per staged tile: the widest that fits shared memory next to a 128-row Q tile
/// (TF32 D = 128: Q 64 KiB + 4 x 32 KiB).
template <bool BF>
constexpr int keysFor(int D) {
  return BF ? (D == 64 ? 128 : 128) : 64;
}

}  // namespace kern
using namespace kern;

bool supports(int head_dim) {
  return head_dim == 64 || head_dim == 128;
}

bool usable() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) return false;
    return major == 9 && minor == 0;
  }();
  return ok;
}

int forwardRows(bool, int) {
  return 128;
}

int forwardKeys(bool bf16, int head_dim) {
  return bf16 ? keysFor<true>(head_dim) : keysFor<false>(head_dim);
}

void forward(void* stream, const cuda::Args& a, bool bf16) {
  if (a.nwork == 0) return;
  const auto st = static_cast<cudaStream_t>(stream);
  if (bf16) {
    if (a.head_dim == 64) return launch<true, 64, keysFor<true>(64), 2>(st, a);
    if (a.head_dim == 128) return launch<true, 128, keysFor<true>(128), 2>(st, a);
  } else {
    if (a.head_dim == 64) return launch<false, 64, keysFor<false>(64), 2>(st, a);
    if (a.head_dim == 128) return launch<false, 128, keysFor<false>(128), 2>(st, a);
  }
  throw std::runtime_error("wlb::attention::hopper: head_dim " + std::to_string(a.head_dim) + " not supported");
}

int backwardKeys() {
  return kBwdKeys;
}

void backward(void* stream, const cuda::Args& a) {
  if (a.nwork == 0) return;
  const auto st = static_cast<cudaStream_t>(stream);
  if (a.head_dim == 64) return launchBackward<64>(st, a);
  if (a.head_dim == 128) return launchBackward<128>(st, a);
  throw std::runtime_error("wlb::attention::hopper: head_dim " + std::to_string(a.head_dim) + " not supported");
}

}  // namespace wlb::attention::hopper
