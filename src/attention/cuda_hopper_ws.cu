/// \file cuda_hopper_ws.cu
/// \brief Hopper BF16 attention, warp-specialised (FlashAttention-3 dataflow; see
/// cuda_hopper.hpp): the forward below and, after it, the backward. Compiled for sm_90a
/// only, without Kokkos.
///
/// One block per SM, persistent: it walks work units (a query tile of NC*64 rows of one
/// head) of the longest-first list, one producer warpgroup + NC consumer warpgroups (64 rows
/// each). The producer gives its registers away (setmaxnreg) and one of its threads issues
/// TMA loads: each unit's Q tile, then its K and V tiles of BN keys into an ST-stage ring,
/// each stage (and Q) with a "full" mbarrier (TMA bytes) and a "free" one (every consumer
/// warp has finished reading it) — so the next unit's Q and first tiles load while the
/// consumers finish the current one. The consumers keep the tiles in the layout the
/// synchronous kernel (cuda_hopper.cu) reads — 128-byte swizzled column blocks, which is
/// what a TMA box of 64 BF16 columns with SWIZZLE_128B writes — and overlap two ways:
///  - within a warpgroup, S = Q K_j^T is issued together with O += P_{j-1} V_{j-1}, and the
///    softmax of tile j runs while the tensor cores do the PV product of tile j - 1;
///  - across warpgroups (ping-pong), a consumer may issue its MMAs only on its turn (named
///    barriers passed round the consumers), so one's softmax runs under another's MMAs.
/// Every consumer walks the block's key tiles in step (the turn protocol needs equal
/// counts); a consumer whose rows do not see a tile skips its math, not its turn.
///
/// Rows past a piece inside the tensors are loaded (TMA boxes are not clipped per piece);
/// scores there are masked, and V rows past the piece's last key are zeroed in shared
/// memory before they multiply P, so non-finite data there cannot leak into O.

#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "attention/cuda_hopper.hpp"
#include "attention/cuda_wgmma.hpp"

namespace wlb::attention::hopper {
namespace kern {

template <int D, int BN, int ST, int NC>
struct WsGeo {
  static constexpr int rowBytes = D * 2;     ///< one head of one token (BF16)
  static constexpr int cpr = rowBytes / 16;  ///< 16-byte chunks per row
  static constexpr int rows = 64 * NC;       ///< query rows per block
  static constexpr int threads = 128 * (NC + 1);
  static constexpr int qBytes = rows * rowBytes;
  static constexpr int kvBytes = BN * rowBytes;  ///< one K or V stage
  static constexpr int bars = 2 + 4 * ST;        ///< Q full, Q free; K full, V full, K free, V free per stage
  static constexpr int smem = 1024 + qBytes + 2 * ST * kvBytes + 8 * bars;  // + alignment slack
  static constexpr int steps = D * 2 / 32;  ///< MMA k-steps over head_dim (32 bytes each)
  // the block's registers (its launch count, 168 or 128 per thread) re-split: a little for the
  // producer, the rest to the consumers; the sums are exactly the launch allocation, as
  // FlashAttention-3 splits them (an increase beyond what was released never returns)
  static constexpr int launchRegs = NC == 2 ? 168 : 128;
  static constexpr int producerRegs = NC == 2 ? 24 : 32;
  static constexpr int consumerRegs = NC == 2 ? 240 : 160;
  static_assert(producerRegs + NC * consumerRegs == (NC + 1) * launchRegs, "register split");
  static_assert(smem <= 227 * 1024, "shared memory of one block");
  static_assert(BN % 64 == 0 && BN <= 256 && rows <= 256, "TMA boxes of at most 256 rows");
};

/// Zeros rows [r0, r1) of an R-row swizzled tile (one consumer warpgroup, `tid` in [0, 128)).
template <int R, int CPR>
__device__ __forceinline__ void zeroRows(char* s, int r0, int r1, int tid) {
  for (int i = tid; i < (r1 - r0) * CPR; i += 128) {
    const int r = r0 + i / CPR, c = i % CPR;
    *reinterpret_cast<uint4*>(s + swz<R>(r, c)) = make_uint4(0u, 0u, 0u, 0u);
  }
}

/// A work unit (query tile of a piece, head) and its key tiles [jb, je) (split-KV: a part).
struct Unit {
  int h, qb, nq, kb, nk, off, q0, jb, je, slot;
};
template <int BQ, int BN>
__device__ __forceinline__ Unit unitOf(const cuda::Args& a, int u) {
  Unit w;
  const int item = u / a.heads;
  w.h = u % a.heads;
  const int p = a.work[2 * item], tile = a.work[2 * item + 1];
  w.qb = a.ranges[4 * p];
  w.nq = a.ranges[4 * p + 1] - w.qb;
  w.kb = a.ranges[4 * p + 2];
  w.nk = a.ranges[4 * p + 3] - w.kb;
  w.off = w.nk - w.nq;
  w.q0 = tile * BQ;
  const int qend = w.q0 + BQ < w.nq ? w.q0 + BQ : w.nq;
  const int nkt = (w.off + qend + BN - 1) / BN;  // key tiles visible to some valid row (>= 1)
  w.jb = 0;
  w.je = nkt;
  w.slot = -1;
  if (a.split) {  // as in cuda_hopper.cu
    w.jb = a.split[3 * item];
    w.je = a.split[3 * item + 1] < nkt ? a.split[3 * item + 1] : nkt;
    w.slot = a.split[3 * item + 2];
  }
  return w;
}

/// Persistent: block b takes work units b, b + gridDim.x, ... of the longest-first list
/// (unit u = item u / heads, head u % heads); producer and consumers walk the same sequence,
/// so the K/V ring's stages and phases simply continue from unit to unit, and the producer
/// loads the next unit's Q (once every consumer has issued its last QK^T) and first tiles
/// while the consumers finish the current one.
template <int D, int BN, int ST, int NC>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
    forwardWsKernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                    const __grid_constant__ CUtensorMap tv, const cuda::Args a) {
#if defined(WLB_HOPPER_DEVICE)
  using G = WsGeo<D, BN, ST, NC>;
  constexpr int BQ = G::rows;
  constexpr int kTurnBar = 1;  // named barriers 1..NC: consumer c's turn to issue its MMAs
  constexpr int kOwnBar = 8;   // named barriers 8..8+NC-1: one consumer warpgroup alone
  extern __shared__ char smraw[];
  char* sQ = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(smraw) + 1023) & ~std::uintptr_t{1023});
  char* sK = sQ + G::qBytes;        // ST stages
  char* sV = sK + ST * G::kvBytes;  // ST stages
  std::uint64_t* qFull = reinterpret_cast<std::uint64_t*>(sV + ST * G::kvBytes);
  std::uint64_t* qFree = qFull + 1;
  std::uint64_t* kFull = qFree + 1;
  std::uint64_t* vFull = kFull + ST;
  std::uint64_t* kFree = vFull + ST;
  std::uint64_t* vFree = kFree + ST;

  const int tid = threadIdx.x, wg = tid >> 7;
  const int units = a.nwork * a.heads, group = a.heads / a.kv_heads;

  if (tid == 0) {
    mbarInit(qFull, 1);
    mbarInit(qFree, 4 * NC);  // lane 0 of every consumer warp
    for (int s = 0; s < ST; ++s) {
      mbarInit(kFull + s, 1);
      mbarInit(vFull + s, 1);
      mbarInit(kFree + s, 4 * NC);
      mbarInit(vFree + s, 4 * NC);
    }
    fenceBarrierInit();
  }
  __syncthreads();

  // ---- producer: one thread issues every load ----
  if (wg == 0) {
    regsDec<G::producerRegs>();
    if (tid == 0) {
      prefetchTensorMap(&tq);
      prefetchTensorMap(&tk);
      prefetchTensorMap(&tv);
      int it = 0;  // K/V tiles loaded so far (the ring's position)
      for (int u = blockIdx.x, k = 0; u < units; u += gridDim.x, ++k) {
        const Unit w = unitOf<BQ, BN>(a, u);
        const int hk = w.h / group;
        mbarWait(qFree, (k & 1) ^ 1);  // every consumer issued its last QK^T of the previous unit
        mbarExpectTx(qFull, G::qBytes);
        for (int cb = 0; cb < D / 64; ++cb) tmaLoad3(sQ + cb * BQ * 128, &tq, cb * 64, w.h, w.qb + w.q0, qFull);
        for (int j = w.jb; j < w.je; ++j, ++it) {
          const int s = it % ST, row = w.kb + j * BN;
          const unsigned free = ((it / ST) & 1) ^ 1;  // the stage's previous use released
          mbarWait(kFree + s, free);
          mbarExpectTx(kFull + s, G::kvBytes);
          for (int cb = 0; cb < D / 64; ++cb)
            tmaLoad3(sK + s * G::kvBytes + cb * BN * 128, &tk, cb * 64, hk, row, kFull + s);
          mbarWait(vFree + s, free);
          mbarExpectTx(vFull + s, G::kvBytes);
          for (int cb = 0; cb < D / 64; ++cb)
            tmaLoad3(sV + s * G::kvBytes + cb * BN * 128, &tv, cb * 64, hk, row, vFull + s);
        }
      }
    }
    return;
  }

  // ---- consumers ----
  regsInc<G::consumerRegs>();
  // the consumer index broadcast from lane 0: provably warp-uniform, so the MMAs under the
  // conditions below stay asynchronous (ptxas serialises wgmma on divergent paths)
  const int c = __shfl_sync(0xffffffffu, wg - 1, 0);
  const int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const bool last = c == NC - 1;
  const float sl2 = a.scale_log2;

  const auto waitTurn = [&] { barSync(kTurnBar + c, 256); };
  // the last consumer's final turn of a unit is passed to nobody (every sync has its arrive)
  const auto passTurn = [&](bool final) { barArriveIf(kTurnBar + (c + 1) % NC, 256, !(last && final)); };
  const auto releaseK = [&](int i) { mbarArriveIf(kFree + i % ST, lane == 0); };
  const auto releaseV = [&](int i) { mbarArriveIf(vFree + i % ST, lane == 0); };
  const auto releaseQ = [&] { mbarArriveIf(qFree, lane == 0); };
  ConsumerWaits wait;
  const auto waitK = [&](int i) { wait(kFull + i % ST, (i / ST) & 1); };
  const auto waitV = [&](int i) { wait(vFull + i % ST, (i / ST) & 1); };

  float o[D / 2];
  float s[BN / 2];
  unsigned pa[BN / 16][4];
  float m0, m1, l0, l1;

  int it = 0;  // K/V tiles consumed so far, as the producer counts them
  for (int u = blockIdx.x, k = 0; u < units; u += gridDim.x, ++k) {
    const Unit w = unitOf<BQ, BN>(a, u);
    const int n = w.je - w.jb, off = w.off, nk = w.nk;
    const int wfirst = w.q0 + c * 64;
    const int wlast = wfirst + 63 < w.nq ? wfirst + 63 : w.nq - 1;  // < wfirst: no valid row
    const int wr = wfirst + warp * 16 + g;                          // this thread's rows: wr, wr + 8
    const char* sQc = sQ + c * 64 * 128;

    if (last) barArrive(kTurnBar, 256);  // consumer 0 issues first
    wait(qFull, k & 1);
    if (wfirst > wlast || n <= 0) {  // no valid row (or tile): keep the turns and releases, skip the math
      releaseQ();
      for (int i = 0; i <= n; ++i) {
        if (i < n) waitK(it + i);
        if (i > 0) waitV(it + i - 1);
        waitTurn();
        passTurn(i == n);
        if (i < n) releaseK(it + i);
        if (i > 0) releaseV(it + i - 1);
      }
      it += n;
      continue;
    }

#pragma unroll
    for (int e = 0; e < D / 2; ++e) o[e] = 0.0f;
    m0 = m1 = -INFINITY;
    l0 = l1 = 0.0f;

    // Every tile of the unit is computed, also one this warpgroup's rows do not see (its
    // scores are all masked: P = 0, the running max unchanged), so that no MMA or wait sits
    // on a branch: ptxas serialises the pipeline otherwise.
    const auto issueS = [&](int i) {
      const char* sKj = sK + (i % ST) * G::kvBytes;
#pragma unroll
      for (int ks = 0; ks < G::steps; ++ks) {
        const int cb = ks * 32 / 128, in = ks * 32 % 128;
        mmaSS<true, BN>(s, desc(sQc + cb * BQ * 128 + in, 16, 1024), desc(sKj + cb * BN * 128 + in, 16, 1024));
      }
      wgmmaCommit();
    };
    const auto issuePV = [&](int i) {
      const char* sVj = sV + (i % ST) * G::kvBytes;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) mmaRS<true, D>(o, pa[kk], desc(sVj + kk * 16 * 128, BN * 128, 1024));
      wgmmaCommit();
    };
    const auto zeroS = [&] {
#pragma unroll
      for (int e = 0; e < BN / 2; ++e) s[e] = 0.0f;
      fenceRegs(s);
    };
    // V rows past the piece's last key (its ragged last tile): P is 0 there, V must be finite
    const auto zeroTail = [&](int j, int i) {
      const int k0 = j * BN;
      if (k0 + BN > nk) {
        zeroRows<BN, G::cpr>(sV + (i % ST) * G::kvBytes, nk - k0, BN, tid & 127);
        fenceProxyAsync();
        barSync(kOwnBar + c, 128);
      }
    };
    // mask and online softmax (base 2) of key tile j in s; the rescale factors of O
    const auto softmax = [&](int j, float& al0, float& al1) {
      onlineSoftmax<BN>(s, j * BN, wfirst, wr, t, off, nk, sl2, m0, m1, l0, l1, al0, al1);
    };
    // O in the new max's scale, P as the next product's A fragments (after P V of the last tile)
    const auto rescaleAndPack = [&](float al0, float al1) {
      rescaleRows<D>(o, al0, al1);
      packP<true, BN>(pa, s);
    };

    float al0, al1;
    // round 0: S of the first tile alone
    waitK(it);
    zeroS();
    waitTurn();
    wgmmaFence();
    issueS(it);
    passTurn(false);
    wgmmaWait<0>();
    fenceRegs(s);
    releaseK(it);
    if (n == 1) releaseQ();  // the unit's last QK^T has run: the next unit's Q may land
    softmax(w.jb, al0, al1);
    rescaleAndPack(al0, al1);
    // rounds 1 .. n-1: S of tile i with P V of tile i - 1; the softmax of i under that product
    for (int i = 1; i < n; ++i) {
      waitK(it + i);
      waitV(it + i - 1);
      zeroTail(w.jb + i - 1, it + i - 1);
      zeroS();
      fenceRegs(o);
      waitTurn();
      wgmmaFence();
      issueS(it + i);
      issuePV(it + i - 1);
      passTurn(false);
      wgmmaWait<1>();  // S landed; P V may still run
      fenceRegs(s);
      releaseK(it + i);
      if (i == n - 1) releaseQ();
      softmax(w.jb + i, al0, al1);
      wgmmaWait<0>();
      fenceRegs(o);
      releaseV(it + i - 1);
      rescaleAndPack(al0, al1);
    }
    // round n: P V of the last tile
    waitV(it + n - 1);
    zeroTail(w.je - 1, it + n - 1);
    fenceRegs(o);
    waitTurn();
    wgmmaFence();
    issuePV(it + n - 1);
    passTurn(true);
    wgmmaWait<0>();
    fenceRegs(o);
    releaseV(it + n - 1);
    it += n;

    storeRows<true, D, BQ>(a, o, m0, m1, l0, l1, wr, t, w.qb, w.q0, w.nq, w.h, w.slot);
  }
  wait.trapIfHung();
#else
  (void)tq, (void)tk, (void)tv, (void)a;
  WLB_HOPPER_UNSUPPORTED();
#endif
}

// ---------------- warp-specialised backward ------------------------------------------------

template <int D, int ST, int BM_>
struct WsBwdGeo {
  static constexpr int BN = kBwdKeys, BM = BM_;  ///< keys per block (64 per consumer), query rows per step
  static_assert(BM == 64 || (BM == 128 && D == 64), "128 query rows per step only at D = 64");
  static constexpr int rowBytes = D * 2, cpr = rowBytes / 16;
  static constexpr int kvBytes = BN * rowBytes;  ///< K or V
  static constexpr int qBytes = BM * rowBytes;   ///< one Q or dO stage
  static constexpr int dsBytes = BN * BM * 2;    ///< one dS^T buffer [128 keys][BM queries]
  /// staged dQ rows in floats: padded by 4 (16 bytes: rows stay aligned for the bulk
  /// reduction, fragment stores spread over the banks). Each consumer's dQ tile is 64 rows
  /// x 64 columns; D = 64: one buffer per consumer (BM = 64: both over the same rows;
  /// BM = 128: each over its own half of the step's rows)
  static constexpr int dqStride = D + 4;
  static constexpr int dqBytes = (D == 128 ? 1 : 2) * 64 * dqStride * 4;
  static constexpr int oK = 0, oV = kvBytes, oQ = 2 * kvBytes, odO = oQ + ST * qBytes, odS = odO + ST * qBytes,
                       odQ = odS + 2 * dsBytes, oLD = odQ + dqBytes, oBar = oLD + ST * 2 * BM * 4;
  static constexpr int bars = 1 + 2 * ST;  ///< K/V full; per stage full, free
  static constexpr int launchRegs = 168, producerRegs = 40, consumerRegs = 232;
  static_assert(producerRegs + 2 * consumerRegs == 3 * launchRegs, "register split");
  static constexpr int smem = 1024 + oBar + 8 * bars;
  static_assert(smem <= 227 * 1024, "shared memory of one block");
};

/// One consumer's share of a 128-row step at D = 64 (keys [64 c, 64 c + 64) of the tile
/// against the step's 128 queries), ordered to fit the consumer's registers: the 64-row
/// step's order (S^T and dP^T issued together, bwdScores) would hold four 64-key x 128-query
/// or 64 x 64 accumulators at once, 192 registers before any index, and ptxas spilled. Here
/// S^T = K_c Q^T is waited for alone and becomes P^T as BF16 A fragments (pa); then dP^T =
/// V_c dO^T and dV += P^T dO are issued together and dP^T waited for; dS^T = P^T (dP^T -
/// delta) is formed from the BF16 P^T (the value dV's product uses; dS^T is rounded to BF16
/// next anyway) into da and the dS^T tile; dK += dS^T Q is issued. bwdDq waits for dV and
/// dK. Thread (warp, g, t) holds keys key0 and key0 + 8, queries q0 + 8i + 2t + {0, 1}.
__device__ __forceinline__ void bwdStepWide(float (&dk)[32], float (&dv)[32], unsigned (&pa)[8][4],
                                            unsigned (&da)[8][4], const char* sK, const char* sV, const char* sQ,
                                            const char* sdO, char* sdS, const float* L, const float* Dl, float sl2,
                                            bool masked, int c, int key0, int q0, int r0, int t, int off, int nq,
                                            int nk) {
  constexpr int BM = 128;
  float acc[64];
  // S^T (64 keys x 128 queries)
#pragma unroll
  for (int e = 0; e < 64; ++e) acc[e] = 0.0f;
  fenceRegs(acc);
  wgmmaFence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    mmaSS<true, BM>(acc, desc(sK + c * 64 * 128 + ks * 32, 16, 1024), desc(sQ + ks * 32, 16, 1024));
  wgmmaCommit();
  wgmmaWait<0>();
  fenceRegs(acc);
  // P^T from the LSE, masked where the tile needs it, as BF16 A fragments
  bwdP<BM>(acc, L, sl2, masked, key0, q0, t, off, nq, nk);
  packP<true, BM>(pa, acc);
  // dP^T (64 keys x 128 queries) and dV += P^T dO (k = the queries, dO read transposed)
#pragma unroll
  for (int e = 0; e < 64; ++e) acc[e] = 0.0f;
  fenceRegs(acc);
  fenceRegs(dv);
  wgmmaFence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    mmaSS<true, BM>(acc, desc(sV + c * 64 * 128 + ks * 32, 16, 1024), desc(sdO + ks * 32, 16, 1024));
  wgmmaCommit();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) mmaRS<true, 64>(dv, pa[kk], desc(sdO + kk * 16 * 128, BM * 128, 1024));
  wgmmaCommit();
  wgmmaWait<1>();  // dP^T; dV may still run
  fenceRegs(acc);
  // dS^T = P^T (dP^T - delta), P^T from its BF16 fragment (element 4i + e: pa[i / 2][2 (i & 1) + e / 2], half e & 1)
#pragma unroll
  for (int i = 0; i < BM / 8; ++i) {
    const float2 d2 = *reinterpret_cast<const float2*>(Dl + 8 * i + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned pw = pa[i >> 1][2 * (i & 1) + (e >> 1)];
      const float pv = __uint_as_float((e & 1) ? (pw & 0xFFFF0000u) : (pw << 16));
      acc[4 * i + e] = pv * (acc[4 * i + e] - ((e & 1) ? d2.y : d2.x));
    }
  }
  packP<true, BM>(da, acc);
  storeDsT<BM>(sdS, da, r0, t);
  // dK += dS^T Q (k = the queries, Q read transposed)
  fenceRegs(dk);
  wgmmaFence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) mmaRS<true, 64>(dk, da[kk], desc(sQ + kk * 16 * 128, BM * 128, 1024));
  wgmmaCommit();
}

/// One block per (key tile of 128 keys, KV head), as the synchronous backward
/// (cuda_hopper.cu), whose per-step arithmetic it keeps: one producer warpgroup, two
/// consumers of 64 keys each with their dK and dV in registers. The producer's warp 0 loads
/// K and V once (TMA), then per step of BM query rows (the GQA group's heads x the query
/// tiles that see the key tile) Q and dO by TMA into an ST-stage ring and that step's LSE
/// and delta by its 32 lanes; a stage's "full" mbarrier counts the TMA bytes and the 32
/// lanes' arrivals, its "free" one lane 0 of every consumer warp. Per step each consumer:
/// S^T = K Q^T and dP^T = V dO^T, P^T and dS^T, dV += P^T dO and dK += dS^T Q issued
/// without waiting, dS^T to a double-buffered tile, one barrier with the other consumer,
/// dQ = dS K, and the scaled dQ tile staged in shared memory and added to dq by bulk
/// reductions (one per row: 64 instead of 2048 vector reductions per consumer and step).
/// BM = 128 (D = 64, as FlashAttention-3's tile there): twice the queries per step, so
/// every product is twice as wide (S^T and dP^T m64n128) or deep (dV, dK and dQ over 128)
/// for the same waits and barriers, and each consumer forms dQ for its half of the rows
/// over all 128 keys (half the bulk reductions of BM = 64, where both add the same rows).
/// Rows past the piece's queries (ragged query tile) and keys (ragged key tile) are zeroed
/// in shared memory: the TMA boxes load whatever lies there, and P = 0 must not meet a
/// non-finite value.
template <int D, int ST, int BM_>
__global__ void __launch_bounds__(384, 1)
    backwardWsKernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                     const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                     const cuda::Args a) {
#if defined(WLB_HOPPER_DEVICE)
  using G = WsBwdGeo<D, ST, BM_>;
  constexpr int BN = G::BN, BM = G::BM;
  constexpr int kPairBar = 1;  // both consumers
  constexpr int kOwnBar = 2;   // 2, 3: one consumer alone
  extern __shared__ char smraw[];
  char* sm = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(smraw) + 1023) & ~std::uintptr_t{1023});
  char* sK = sm + G::oK;
  char* sV = sm + G::oV;
  float* sLD = reinterpret_cast<float*>(sm + G::oLD);  // per stage: LSE (base 2) [BM], then delta [BM]
  std::uint64_t* kvFull = reinterpret_cast<std::uint64_t*>(sm + G::oBar);
  std::uint64_t* full = kvFull + 1;
  std::uint64_t* free = full + ST;

  const int tid = threadIdx.x, wg = tid >> 7;
  const int Hkv = a.kv_heads, H = a.heads, group = a.heads / a.kv_heads;
  const int item = blockIdx.x / Hkv, hk = blockIdx.x % Hkv;
  const int p = a.work[2 * item], kt = a.work[2 * item + 1];
  const int qb = a.ranges[4 * p], nq = a.ranges[4 * p + 1] - qb, kb = a.ranges[4 * p + 2],
            nk = a.ranges[4 * p + 3] - kb, off = nk - nq;
  const int k0 = kt * BN;
  const int qt0 = (k0 - off > 0 ? k0 - off : 0) / BM;  // first query tile that sees the key tile
  const int per = (nq + BM - 1) / BM - qt0;            // steps per head
  const int steps = per * group;
  const auto stepHead = [&](int st) { return hk * group + st / per; };
  const auto stepRow = [&](int st) { return (qt0 + st % per) * BM; };

  if (tid == 0) {
    mbarInit(kvFull, 1);
    for (int s = 0; s < ST; ++s) {
      mbarInit(full + s, 33);  // lane 0's expect_tx and the 32 lanes' LSE / delta stores
      mbarInit(free + s, 8);   // lane 0 of every consumer warp
    }
    fenceBarrierInit();
  }
  __syncthreads();

  // ---- producer: warp 0 ----
  if (wg == 0) {
    regsDec<G::producerRegs>();
    if (tid >= 32) return;
    const int lane = tid;
    if (lane == 0) {
      prefetchTensorMap(&tq);
      prefetchTensorMap(&tdo);
      prefetchTensorMap(&tk);
      prefetchTensorMap(&tv);
      mbarExpectTx(kvFull, 2 * G::kvBytes);
      for (int cb = 0; cb < D / 64; ++cb) {
        tmaLoad3(sK + cb * BN * 128, &tk, cb * 64, hk, kb + k0, kvFull);
        tmaLoad3(sV + cb * BN * 128, &tv, cb * 64, hk, kb + k0, kvFull);
      }
    }
    for (int st = 0; st < steps; ++st) {
      const int s = st % ST, h = stepHead(st), q0 = stepRow(st);
      mbarWait(free + s, ((st / ST) & 1) ^ 1);  // the stage's previous use released
      if (lane == 0) {
        mbarExpectTx(full + s, 2 * G::qBytes);
        for (int cb = 0; cb < D / 64; ++cb) {
          tmaLoad3(sm + G::oQ + s * G::qBytes + cb * BM * 128, &tq, cb * 64, h, qb + q0, full + s);
          tmaLoad3(sm + G::odO + s * G::qBytes + cb * BM * 128, &tdo, cb * 64, h, qb + q0, full + s);
        }
      }
      float* ld = sLD + s * 2 * BM;
      for (int r = lane; r < BM; r += 32) {
        const int q = q0 + r;
        ld[r] = q < nq ? a.lse[static_cast<std::int64_t>(qb + q) * a.lse_s0 + h] * 1.4426950408889634f : 0.0f;
        ld[BM + r] = q < nq ? a.delta[static_cast<std::int64_t>(qb + q) * H + h] : 0.0f;
      }
      mbarArrive(full + s);  // releases this lane's stores to the consumers' wait
    }
    return;
  }

  // ---- consumers: keys [64 c, 64 c + 64) of the tile ----
  regsInc<G::consumerRegs>();
  const int c = __shfl_sync(0xffffffffu, wg - 1, 0);  // warp-uniform (see the forward)
  const int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3, ct = tid & 127;
  ConsumerWaits wait;
  wait(kvFull, 0);
  if (k0 + BN > nk) {  // ragged key tile: this consumer's rows past the piece's keys
    const int lo = nk - k0 > c * 64 ? nk - k0 : c * 64;
    if (lo < c * 64 + 64) {
      zeroRows<BN, G::cpr>(sK, lo, c * 64 + 64, ct);
      zeroRows<BN, G::cpr>(sV, lo, c * 64 + 64, ct);
    }
    fenceProxyAsync();  // the other consumer's dQ product reads them after the pair barrier
  }
  barSync(kOwnBar + c, 128);

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int e = 0; e < D / 2; ++e) dk[e] = dv[e] = 0.0f;
  const int key0 = k0 + c * 64 + warp * 16 + g;  // this thread's accumulator rows key0, key0 + 8
  const float sl2 = a.scale_log2, sc = a.scale;
  const int colBase = D == 128 ? c * 64 : 0;  // dQ columns of this consumer
  const int rowBase = BM == 128 ? c * 64 : 0;  // dQ rows of this consumer within the step
  char* sdQ = sm + G::odQ + (D == 128 ? 0 : c * 64 * G::dqStride * 4);

  for (int st = 0; st < steps; ++st) {
    const int s = st % ST, h = stepHead(st), q0 = stepRow(st);
    char* sQ = sm + G::oQ + s * G::qBytes;
    char* sdO = sm + G::odO + s * G::qBytes;
    char* sdS = sm + G::odS + (st & 1) * G::dsBytes;
    const float* L = sLD + s * 2 * BM;
    const float* Dl = L + BM;
    wait(full + s, (st / ST) & 1);
    if (q0 + BM > nq) {  // ragged query tile: rows past the piece's queries
      zeroRows<BM, G::cpr>(sQ, nq - q0, BM, ct);
      zeroRows<BM, G::cpr>(sdO, nq - q0, BM, ct);
      fenceProxyAsync();
      barSync(kOwnBar + c, 128);
    }

    // S^T = K_c Q^T, dP^T = V_c dO^T (64 keys x 64 queries); P^T and dS^T; dV += P^T dO,
    // dK += dS^T Q issued; dS^T to this step's buffer for dQ (the other buffer may still feed
    // the other consumer's dQ product of the previous step)
    const bool diag = q0 + off < k0 + c * 64 + 63 || q0 + BM > nq || k0 + BN > nk;
    unsigned pa[BM / 16][4], da[BM / 16][4];
    if constexpr (BM == 128) {
      bwdStepWide(dk, dv, pa, da, sK, sV, sQ, sdO, sdS, L, Dl, sl2, diag, c, key0, q0, c * 64 + warp * 16 + g, t, off,
                  nq, nk);
    } else {
      float sv[32], dp[32];
      bwdScores<D>(sv, dp, sK, sV, sQ, sdO, c);
      bwdProbs(sv, dp, L, Dl, sl2, diag, key0, q0, t, off, nq, nk);
      bwdDkDv<D>(dk, dv, pa, da, sv, dp, sQ, sdO);
      storeDsT(sdS, da, c * 64 + warp * 16 + g, t);
    }
    fenceProxyAsync();
    barSync(kPairBar, 256);  // both consumers' dS^T (and zeroed K rows) visible

    // dQ (64 queries x 64 columns) = dS K (and dV, dK waited for)
    float dq[32];
    bwdDq<D, BM>(dq, dk, dv, sdS, sK, c);
    mbarArriveIf(free + s, lane == 0);  // Q, dO, LSE and delta of the stage read

    // dQ staged (scaled) and added to dq in bulk, one row per thread of the first 64
    if (ct < 64) bulkWaitRead<0>();  // the previous step's row has left the staging tile
    barSync(kOwnBar + c, 128);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float* row = reinterpret_cast<float*>(sdQ) + (warp * 16 + g + 8 * half) * G::dqStride + colBase + 2 * t;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        *reinterpret_cast<float2*>(row + 8 * i) = make_float2(dq[4 * i + 2 * half] * sc, dq[4 * i + 2 * half + 1] * sc);
    }
    fenceProxyAsync();
    barSync(kOwnBar + c, 128);
    if (ct < 64 && q0 + rowBase + ct < nq) {
      bulkReduceAddF32(a.dq + static_cast<std::int64_t>(qb + q0 + rowBase + ct) * a.dq_s0 + h * D + colBase,
                       sdQ + (ct * G::dqStride + colBase) * 4, 64 * 4);
      bulkCommit();
    }
  }
  if (ct < 64) bulkWait<0>();  // every reduction done before the block's shared memory goes
  wait.trapIfHung();

  addKeyGrads<D>(a, dk, dv, key0, nk, kb, hk, t);
#else
  (void)tq, (void)tdo, (void)tk, (void)tv, (void)a;
  WLB_HOPPER_UNSUPPORTED();
#endif
}

// ---------------- host side ----------------------------------------------------------------

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/// The driver's tensor-map encoder, through the runtime (no link against libcuda).
EncodeTiled encoder() {
  static const EncodeTiled fn = []() -> EncodeTiled {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

/// One head's columns of a BF16 token matrix [rows][heads][D] (row stride s0 elements) in
/// boxes of `box` rows x 64 columns, 128-byte swizzled: one box is one column block of a
/// staged tile. Rows past `rows` arrive as zeros.
CUtensorMap tokenMap(const void* base, int D, int heads, std::int64_t rows, std::int64_t s0, int box) {
  const EncodeTiled enc = encoder();
  if (!enc) throw std::runtime_error("wlb::attention::hopper: cuTensorMapEncodeTiled is not available");
  CUtensorMap m;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows > 0 ? rows : 1)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(D) * 2, static_cast<cuuint64_t>(s0) * 2};
  const cuuint32_t boxDim[3] = {64, 1, static_cast<cuuint32_t>(box)};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, boxDim, elem,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("wlb::attention::hopper: cuTensorMapEncodeTiled failed (CUresult " + std::to_string(r) +
                             ")");
  return m;
}

/// setmaxnreg re-splits the registers a block was launched with: a consumer's increase waits
/// until the producer's decrease has freed them, so a kernel compiled to fewer registers than
/// the split assumes would wait forever. Refused here instead (once per kernel).
void checkRegisterPool(const void* kernel, int launchRegs, const char* what) {
  cudaFuncAttributes f{};
  check(cudaFuncGetAttributes(&f, kernel), "cudaFuncGetAttributes");
  if (f.numRegs != launchRegs)
    throw std::runtime_error(std::string("wlb::attention::hopper: the ") + what + " was compiled to " +
                             std::to_string(f.numRegs) + " registers per thread, its register split assumes " +
                             std::to_string(launchRegs));
}

template <int D, int BN, int ST, int NC>
void launchWs(cudaStream_t st, const cuda::Args& a) {
  using G = WsGeo<D, BN, ST, NC>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(forwardWsKernel<D, BN, ST, NC>, cudaFuncAttributeMaxDynamicSharedMemorySize, G::smem);
  check(attr, "cudaFuncSetAttribute");
  static const bool pool = (checkRegisterPool(reinterpret_cast<const void*>(forwardWsKernel<D, BN, ST, NC>),
                                              G::launchRegs, "warp-specialised forward"),
                            true);
  (void)pool;
  const CUtensorMap tq = tokenMap(a.q, D, a.heads, a.q_rows, a.q_s0, G::rows);
  const CUtensorMap tk = tokenMap(a.k, D, a.kv_heads, a.k_rows, a.k_s0, BN);
  const CUtensorMap tv = tokenMap(a.v, D, a.kv_heads, a.k_rows, a.v_s0, BN);
  // one block per SM (the shared memory allows no second), each walking its units
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  const int units = a.nwork * a.heads, blocks = units < sms ? units : sms;
  forwardWsKernel<D, BN, ST, NC><<<blocks, G::threads, G::smem, st>>>(tq, tk, tv, a);
  check(cudaGetLastError(), "warp-specialised forward launch");
  combineParts(st, a, true, G::rows);
}

template <int D, int ST, int BM>
void launchBwdWs(cudaStream_t st, const cuda::Args& a) {
  using G = WsBwdGeo<D, ST, BM>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(backwardWsKernel<D, ST, BM>, cudaFuncAttributeMaxDynamicSharedMemorySize, G::smem);
  check(attr, "cudaFuncSetAttribute");
  static const bool pool = (checkRegisterPool(reinterpret_cast<const void*>(backwardWsKernel<D, ST, BM>), G::launchRegs,
                                              "warp-specialised backward"),
                            true);
  (void)pool;
  const CUtensorMap tq = tokenMap(a.q, D, a.heads, a.q_rows, a.q_s0, G::BM);
  const CUtensorMap tdo = tokenMap(a.dO, D, a.heads, a.q_rows, a.dO_s0, G::BM);
  const CUtensorMap tk = tokenMap(a.k, D, a.kv_heads, a.k_rows, a.k_s0, G::BN);
  const CUtensorMap tv = tokenMap(a.v, D, a.kv_heads, a.k_rows, a.v_s0, G::BN);
  backwardWsKernel<D, ST, BM><<<a.nwork * a.kv_heads, 384, G::smem, st>>>(tq, tdo, tk, tv, a);
  check(cudaGetLastError(), "warp-specialised backward launch");
}

// D = 128: 2 consumers, 2 stages (160 KiB); D = 64: 3 consumers (more rows per block
// against the softmax's share), 3 stages (112 KiB).
constexpr int kWsKeys = 128;
constexpr int wsConsumers(int D) {
  return D == 64 ? 3 : 2;
}

}  // namespace kern
using namespace kern;

int wsRows(int head_dim) {
  return 64 * wsConsumers(head_dim);
}

int wsKeys(int) {
  return kWsKeys;
}

void backwardWs(void* stream, const cuda::Args& a) {
  if (a.nwork == 0) return;
  const auto st = static_cast<cudaStream_t>(stream);
  // D = 128: 64 query rows per step, 2 Q/dO stages (195 KiB in all); D = 64: 128 rows, 2
  // stages (197 KiB), or with a.bwd_rows = 64 the previous tile: 64 rows, 3 stages (148 KiB)
  if (a.head_dim == 64) return a.bwd_rows == 64 ? launchBwdWs<64, 3, 64>(st, a) : launchBwdWs<64, 2, 128>(st, a);
  if (a.head_dim == 128) return launchBwdWs<128, 2, 64>(st, a);
  throw std::runtime_error("wlb::attention::hopper: head_dim " + std::to_string(a.head_dim) + " not supported");
}

void forwardWs(void* stream, const cuda::Args& a) {
  if (a.nwork == 0) return;
  const auto st = static_cast<cudaStream_t>(stream);
  if (a.head_dim == 64) return launchWs<64, kWsKeys, 3, wsConsumers(64)>(st, a);
  if (a.head_dim == 128) return launchWs<128, kWsKeys, 2, wsConsumers(128)>(st, a);
  throw std::runtime_error("wlb::attention::hopper: head_dim " + std::to_string(a.head_dim) + " not supported");
}

}  // namespace wlb::attention::hopper
