#pragma once
/// \file cuda_common.hpp
/// \brief Internal: what the CUDA attention kernels share — the raw argument block, the
/// longest-first work lists, the rowsum(dO∘O) pre-pass and the PTX helpers. Included only
/// under KOKKOS_ENABLE_CUDA (from attention_impl.hpp).
///
/// Every kernel is a Kokkos TeamPolicy launch on the caller's Cuda instance. Team scratch
/// level 0 (shared memory) is capped by Kokkos 4.x at sharedMemPerBlock (48 KiB), which
/// sets the tile sizes: K/V tiles are staged in scratch, Q and the accumulators live in
/// registers.

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "attention/attention.hpp"
#include "attention/bf16.hpp"
#include "attention/cuda_args.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_bf16.h>
#endif

namespace wlb::attention::cuda {

using WorkView = Kokkos::View<int* [2], Kokkos::LayoutRight, Kokkos::CudaSpace>;
using RangeView = Kokkos::View<int* [4], Kokkos::LayoutRight, Kokkos::CudaSpace>;

inline RangeView ranges(const VarlenBatch& b) {
  RangeView r("wlb::attention::cuda::ranges", b.pieces.size());
  auto h = Kokkos::create_mirror_view(r);
  for (std::size_t i = 0; i < b.pieces.size(); ++i) {
    h(i, 0) = static_cast<int>(b.pieces[i].q_begin);
    h(i, 1) = static_cast<int>(b.pieces[i].q_end);
    h(i, 2) = static_cast<int>(b.pieces[i].k_begin);
    h(i, 3) = static_cast<int>(b.pieces[i].k_end);
  }
  Kokkos::deep_copy(r, h);
  return r;
}

namespace detail {
struct WorkItem {
  int p, t;
  std::int64_t cost;
};
/// Longest first (stable: equal costs keep piece order, so heads of one piece stay close),
/// then to the device.
inline WorkView uploadWork(std::vector<WorkItem> items, const char* label) {
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& c) { return a.cost > c.cost; });
  WorkView w(std::string(label), items.size());
  auto h = Kokkos::create_mirror_view(w);
  for (std::size_t i = 0; i < items.size(); ++i) {
    h(i, 0) = items[i].p;
    h(i, 1) = items[i].t;
  }
  Kokkos::deep_copy(w, h);
  return w;
}
}  // namespace detail

/// Query tiles of `bq` rows; cost = key tiles of `bk` the tile visits. Longest first, so the
/// long diagonal tiles start early and the short ones fill the tail (no idle SMs at the end).
inline WorkView queryWork(const VarlenBatch& b, int bq, int bk) {
  std::vector<detail::WorkItem> items;
  for (std::size_t p = 0; p < b.pieces.size(); ++p) {
    const std::int64_t nq = b.pieces[p].nq(), nk = b.pieces[p].nk(), off = nk - nq;
    for (std::int64_t t = 0; t * bq < nq; ++t) {
      const std::int64_t lim = std::min(nk, off + (t + 1) * bq);
      items.push_back({static_cast<int>(p), static_cast<int>(t), (lim + bk - 1) / bk});
    }
  }
  return detail::uploadWork(std::move(items), "wlb::attention::cuda::qwork");
}

/// Key tiles of `bk` keys (pieces with queries only); cost = query rows that see the tile.
inline WorkView keyWork(const VarlenBatch& b, int bk) {
  std::vector<detail::WorkItem> items;
  for (std::size_t p = 0; p < b.pieces.size(); ++p) {
    const std::int64_t nq = b.pieces[p].nq(), nk = b.pieces[p].nk(), off = nk - nq;
    if (nq == 0) continue;
    for (std::int64_t t = 0; t * bk < nk; ++t) {
      const std::int64_t first = std::max<std::int64_t>(0, t * bk - off);
      items.push_back({static_cast<int>(p), static_cast<int>(t), nq - first});
    }
  }
  return detail::uploadWork(std::move(items), "wlb::attention::cuda::kwork");
}

/// delta[t][h] = sum_d dO(t,h,d) * O(t,h,d) for every query row of every piece: one warp
/// per (row, head) would waste lanes at D = 64, so 8 lanes per row.
template <class T>
void computeDelta(const Kokkos::Cuda& space, const Args& a, std::int64_t q_tokens, float* delta) {
  const T* O = static_cast<const T*>(a.o);
  const T* dO = static_cast<const T*>(a.dO);
  const int H = a.heads, D = a.head_dim;
  const std::int64_t os0 = a.o_s0, ds0 = a.dO_s0;
  // rows not covered by a piece are never read; computing all rows is simpler and cheap
  Kokkos::parallel_for(
      "wlb::attention::cuda::bwd::delta",
      Kokkos::TeamPolicy<Kokkos::Cuda>(space, static_cast<int>((q_tokens * H + 15) / 16), 16, 8),
      KOKKOS_LAMBDA(const Kokkos::TeamPolicy<Kokkos::Cuda>::member_type& team) {
        const std::int64_t row = static_cast<std::int64_t>(team.league_rank()) * 16 + team.team_rank();
        if (row >= q_tokens * H) return;
        const std::int64_t t = row / H;
        const int h = static_cast<int>(row % H);
        float s = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, D),
            [&](const int d, float& acc) { acc += toFloat(dO[t * ds0 + h * D + d]) * toFloat(O[t * os0 + h * D + d]); },
            s);
        Kokkos::single(Kokkos::PerThread(team), [&]() { delta[row] = s; });
      });
}

#if defined(KOKKOS_ENABLE_CUDA) && defined(__CUDACC__)
// ---------------- PTX helpers (device only) -------------------------------------------
namespace ptx {

__device__ __forceinline__ unsigned smemAddr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
/// 16-byte global -> shared copy, bypassing registers (sm_80+).
__device__ __forceinline__ void cpAsync16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smemAddr(smem)), "l"(gmem));
}
__device__ __forceinline__ void cpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void cpAsyncWaitAll() {
  asm volatile("cp.async.wait_group 0;\n" ::);
}

__device__ __forceinline__ void ldmatrixX4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smemAddr(p)));
}
__device__ __forceinline__ void ldmatrixX4T(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smemAddr(p)));
}

/// D = A * B + D, m16n8k16, bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mmaBf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/// D = A * B + D, m16n8k8, tf32 inputs, f32 accumulators.
__device__ __forceinline__ void mmaTf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
/// Two floats -> packed bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ unsigned packBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ float fastExp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}
/// dst[0..1] += v0, v1 (one vector reduction in L2, sm_90).
__device__ __forceinline__ void redAdd2(float* dst, float v0, float v1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(v0), "f"(v1) : "memory");
#else
  atomicAdd(dst, v0);
  atomicAdd(dst + 1, v1);
#endif
}

}  // namespace ptx
#endif

}  // namespace wlb::attention::cuda
