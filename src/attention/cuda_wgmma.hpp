#pragma once
/// \file cuda_wgmma.hpp
/// \brief Internal: the sm_90a PTX the Hopper attention kernels share — warpgroup MMAs
/// (`wgmma`) and their shared-memory descriptors, the 128-byte swizzle, mbarriers, TMA tile
/// loads, register reallocation and named barriers. Included only by the sm_90a
/// translation units (cuda_hopper.cu, cuda_hopper_ws.cu), which nvcc compiles without Kokkos.

#include <cuda.h>  // CUtensorMap (the type only: the encoder comes through the runtime)
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention/cuda_args.hpp"
#include "attention/cuda_ptx.hpp"

namespace wlb::attention::hopper::kern {
using namespace cuda::ptx;  // cp.async, conversions, exp2, quad shuffles, reductions

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WLB_HOPPER_DEVICE 1
#endif
// A device pass for another architecture (a PTX fallback the driver might JIT) compiles
// the kernels empty: they trap there instead of returning with the outputs unwritten.
#if defined(__CUDA_ARCH__) && !defined(WLB_HOPPER_DEVICE)
#define WLB_HOPPER_UNSUPPORTED() __trap()
#else
#define WLB_HOPPER_UNSUPPORTED() ((void)0)
#endif

// ---------------- PTX wrappers ----------------------------------------------------------

/// Generic-proxy writes (cp.async, st.shared) -> visible to the MMA's async-proxy reads
/// (each writer fences, then the block barrier).
__device__ __forceinline__ void fenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/// Pins accumulator registers around asynchronous MMAs (the compiler must not move or copy
/// them while an MMA is in flight).
template <int N>
__device__ __forceinline__ void fenceRegs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

/// Shared-memory matrix descriptor: 128-byte swizzle, stride between 8-row groups `sbo`,
/// between 64-element column blocks of an MN-major operand `lbo`.
__device__ __forceinline__ std::uint64_t desc(const void* p, unsigned lbo, unsigned sbo) {
  const std::uint64_t a = smemAddr(p);
  return ((a & 0x3FFFFull) >> 4) | (static_cast<std::uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<std::uint64_t>((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

// wgmma: SS = both operands in shared memory; RS = A in registers. BF16 RS reads B
// MN-major (transposed); TF32 operands are always K-major.
/// D(64x64) += A(64x16, shared) * B(16x64, shared, K-major), bf16, f32 accumulators.
__device__ __forceinline__ void wgmmaSS_bf16_n64(float (&d)[32], std::uint64_t da, std::uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1));
}
/// As wgmmaSS_bf16_n64 with both operands MN-major (transposed in shared memory).
__device__ __forceinline__ void wgmmaSS_bf16_n64_tt(float (&d)[32], std::uint64_t da, std::uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1));
}

/// D(64x64) += A(64x16, registers) * B(16x64, shared, MN-major), bf16, f32 accumulators.
__device__ __forceinline__ void wgmmaRS_bf16_n64(float (&d)[32], const unsigned (&a)[4], std::uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

/// D(64x128) += A(64x16, shared) * B(16x128, shared, K-major), bf16, f32 accumulators.
__device__ __forceinline__ void wgmmaSS_bf16_n128(float (&d)[64], std::uint64_t da, std::uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "
      "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(1));
}

/// D(64x128) += A(64x16, registers) * B(16x128, shared, MN-major), bf16, f32 accumulators.
__device__ __forceinline__ void wgmmaRS_bf16_n128(float (&d)[64], const unsigned (&a)[4], std::uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "
      "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

/// D(64x64) += A(64x8, shared) * B(8x64, shared, K-major), tf32, f32 accumulators.
__device__ __forceinline__ void wgmmaSS_tf32_n64(float (&d)[32], std::uint64_t da, std::uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1));
}

/// D(64x64) += A(64x8, registers) * B(8x64, shared, K-major), tf32, f32 accumulators.
__device__ __forceinline__ void wgmmaRS_tf32_n64(float (&d)[32], const unsigned (&a)[4], std::uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

/// D(64x128) += A(64x8, registers) * B(8x128, shared, K-major), tf32, f32 accumulators.
__device__ __forceinline__ void wgmmaRS_tf32_n128(float (&d)[64], const unsigned (&a)[4], std::uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "
      "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

/// Byte offset of 16-byte chunk `c` of row `r` in an R-row tile stored as 128-byte column
/// blocks [c / 8][R][128 B], swizzled.
template <int R>
__device__ __forceinline__ int swz(int r, int c) {
  return (c >> 3) * R * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

template <bool BF, int N>
__device__ __forceinline__ void mmaSS(float (&d)[N / 2], std::uint64_t da, std::uint64_t db) {
  if constexpr (BF && N == 64) wgmmaSS_bf16_n64(d, da, db);
  if constexpr (BF && N == 128) wgmmaSS_bf16_n128(d, da, db);
  if constexpr (!BF && N == 64) wgmmaSS_tf32_n64(d, da, db);
}
template <bool BF, int N>
__device__ __forceinline__ void mmaRS(float (&d)[N / 2], const unsigned (&a)[4], std::uint64_t db) {
  if constexpr (BF && N == 64) wgmmaRS_bf16_n64(d, a, db);
  if constexpr (BF && N == 128) wgmmaRS_bf16_n128(d, a, db);
  if constexpr (!BF && N == 64) wgmmaRS_tf32_n64(d, a, db);
  if constexpr (!BF && N == 128) wgmmaRS_tf32_n128(d, a, db);
}

// ---------------- forward tile: online softmax ------------------------------------------
// Shared by the synchronous (cuda_hopper.cu) and the warp-specialised (cuda_hopper_ws.cu)
// forwards. A warpgroup's m64nBN score tile: thread (warp, g, t) holds rows wr = first row
// + 16 warp + g and wr + 8, keys k0 + 8i + 2t + {0, 1} (s[4i + 2half + {0, 1}]).

/// Masks the causal and ragged keys where the tile needs it (its rows from wfirst), updates
/// the running maxima m0/m1 (base 2, scaled) and the per-thread row sums l0/l1, and leaves
/// P (unnormalised) in s; al0/al1 rescale what O holds so far. Scores stay unscaled: the
/// scale folds into one FFMA per score. Every row has seen a key of the walk's first tile,
/// so the running max is finite from then on.
template <int BN>
__device__ __forceinline__ void onlineSoftmax(float (&s)[BN / 2], int k0, int wfirst, int wr, int t, int off, int nk,
                                              float sl2, float& m0, float& m1, float& l0, float& l1, float& al0,
                                              float& al1) {
  if (k0 + BN - 1 > wfirst + off || k0 + BN > nk) {  // diagonal and ragged tiles only
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + 8 * i + 2 * t + (e & 1), row = wr + (e < 2 ? 0 : 8);
        if (key > row + off || key >= nk) s[4 * i + e] = -INFINITY;
      }
  }
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
    mx0 = fmaxf(mx0, fmaxf(s[4 * i], s[4 * i + 1]));
    mx1 = fmaxf(mx1, fmaxf(s[4 * i + 2], s[4 * i + 3]));
  }
  const float mn0 = fmaxf(m0, quadMax(mx0) * sl2), mn1 = fmaxf(m1, quadMax(mx1) * sl2);
  al0 = fastExp2(m0 - mn0);
  al1 = fastExp2(m1 - mn1);
  m0 = mn0;
  m1 = mn1;
  float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
    s[4 * i] = fastExp2(fmaf(s[4 * i], sl2, -mn0));
    s[4 * i + 1] = fastExp2(fmaf(s[4 * i + 1], sl2, -mn0));
    s[4 * i + 2] = fastExp2(fmaf(s[4 * i + 2], sl2, -mn1));
    s[4 * i + 3] = fastExp2(fmaf(s[4 * i + 3], sl2, -mn1));
    ls0 += s[4 * i] + s[4 * i + 1];
    ls1 += s[4 * i + 2] + s[4 * i + 3];
  }
  l0 = l0 * al0 + ls0;  // per-thread partial sums; the quad reduces them at the end
  l1 = l1 * al1 + ls1;
}

/// O (m64nD accumulators) in the new maxima's scale.
template <int D>
__device__ __forceinline__ void rescaleRows(float (&o)[D / 2], float al0, float al1) {
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    o[4 * i] *= al0;
    o[4 * i + 1] *= al0;
    o[4 * i + 2] *= al1;
    o[4 * i + 3] *= al1;
  }
}

/// P as the A fragments of O += P V (an m64nN accumulator is laid out as the next product's
/// A fragment): BF16 pairs, or TF32 in the key order of the transposed V stage.
template <bool BF, int BN>
__device__ __forceinline__ void packP(unsigned (&pa)[BN / (BF ? 16 : 8)][4], const float (&s)[BN / 2]) {
#pragma unroll
  for (int kk = 0; kk < BN / (BF ? 16 : 8); ++kk) {
    if constexpr (BF) {
      pa[kk][0] = packBf16(s[8 * kk], s[8 * kk + 1]);
      pa[kk][1] = packBf16(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = packBf16(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = packBf16(s[8 * kk + 6], s[8 * kk + 7]);
    } else {
      pa[kk][0] = tf32(s[4 * kk]);
      pa[kk][1] = tf32(s[4 * kk + 2]);
      pa[kk][2] = tf32(s[4 * kk + 1]);
      pa[kk][3] = tf32(s[4 * kk + 3]);
    }
  }
}

// ---------------- backward step ------------------------------------------------------------
// One warpgroup's share of a step of the BF16 backward, shared by the synchronous and the
// warp-specialised kernels: keys [64 w, 64 w + 64) of a tile of kBwdKeys keys against
// kBwdRows query rows (the warp-specialised kernel's 128-row step at D = 64 is its own,
// bwdStepWide, and shares storeDsT and bwdDq), all tiles in the swizzled layout (K, V:
// kBwdKeys rows; Q, dO: the step's rows). Thread (warp, g, t) holds keys key0 = k0 + 64 w + 16 warp + g and
// key0 + 8, queries q0 + 8i + 2t + {0, 1}.

constexpr int kBwdKeys = 128;  ///< keys per block: 64 per warpgroup
constexpr int kBwdRows = 64;   ///< query rows per step

/// S^T = K_w Q^T into sv and dP^T = V_w dO^T into dp (64 keys x 64 queries), waited for.
template <int D>
__device__ __forceinline__ void bwdScores(float (&sv)[32], float (&dp)[32], const char* sK, const char* sV,
                                          const char* sQ, const char* sdO, int w) {
#pragma unroll
  for (int e = 0; e < 32; ++e) sv[e] = dp[e] = 0.0f;
  fenceRegs(sv);
  fenceRegs(dp);
  wgmmaFence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const int cb = ks >> 2, in = (ks & 3) * 32;
    wgmmaSS_bf16_n64(sv, desc(sK + cb * kBwdKeys * 128 + w * 64 * 128 + in, 16, 1024),
                     desc(sQ + cb * kBwdRows * 128 + in, 16, 1024));
  }
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const int cb = ks >> 2, in = (ks & 3) * 32;
    wgmmaSS_bf16_n64(dp, desc(sV + cb * kBwdKeys * 128 + w * 64 * 128 + in, 16, 1024),
                     desc(sdO + cb * kBwdRows * 128 + in, 16, 1024));
  }
  wgmmaCommit();
  wgmmaWait<0>();
  fenceRegs(sv);
  fenceRegs(dp);
}

/// One element of P^T from its score: accumulator element 4i + e of a 64-key tile (key
/// key0 + 8 (e / 2), query q0 + 8i + 2t + e % 2) against the LSE pair l2 (base 2) of its
/// query pair; with `masked` (diagonal or ragged tile), 0 past the causal limit, the
/// piece's queries and its keys.
__device__ __forceinline__ float bwdPElem(float sv, float2 l2, int i, int e, float sl2, bool masked, int key0, int q0,
                                          int t, int off, int nq, int nk) {
  float pv = fastExp2(fmaf(sv, sl2, -((e & 1) ? l2.y : l2.x)));
  if (masked) {
    const int key = key0 + (e < 2 ? 0 : 8), q = q0 + 8 * i + 2 * t + (e & 1);
    if (key > q + off || q >= nq || key >= nk) pv = 0.0f;
  }
  return pv;
}

/// P^T from the LSE (L[query], base 2) in place of S^T (64 keys x N queries).
template <int N>
__device__ __forceinline__ void bwdP(float (&sv)[N / 2], const float* L, float sl2, bool masked, int key0, int q0,
                                     int t, int off, int nq, int nk) {
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    const float2 l2 = *reinterpret_cast<const float2*>(L + 8 * i + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      sv[4 * i + e] = bwdPElem(sv[4 * i + e], l2, i, e, sl2, masked, key0, q0, t, off, nq, nk);
  }
}

/// P^T into sv (as bwdP) and dS^T = P^T (dP^T - delta) (Dl[query]) into dp, in one pass.
/// The softmax scale is applied at the end.
__device__ __forceinline__ void bwdProbs(float (&sv)[32], float (&dp)[32], const float* L, const float* Dl, float sl2,
                                         bool masked, int key0, int q0, int t, int off, int nq, int nk) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 l2 = *reinterpret_cast<const float2*>(L + 8 * i + 2 * t);
    const float2 d2 = *reinterpret_cast<const float2*>(Dl + 8 * i + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pv = bwdPElem(sv[4 * i + e], l2, i, e, sl2, masked, key0, q0, t, off, nq, nk);
      sv[4 * i + e] = pv;
      dp[4 * i + e] = pv * (dp[4 * i + e] - ((e & 1) ? d2.y : d2.x));
    }
  }
}

/// P^T and dS^T as BF16 A fragments (pa, da), then dV += P^T dO and dK += dS^T Q issued
/// (k = the queries; dO and Q read transposed), not waited for.
template <int D>
__device__ __forceinline__ void bwdDkDv(float (&dk)[D / 2], float (&dv)[D / 2], unsigned (&pa)[4][4],
                                        unsigned (&da)[4][4], const float (&sv)[32], const float (&dp)[32],
                                        const char* sQ, const char* sdO) {
  // packP's layout, both fragments in one loop: packP twice perturbs ptxas's allocation
  // (the warp-specialised D = 128 kernel then spills 4 bytes)
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      pa[kk][r] = packBf16(sv[8 * kk + 2 * r], sv[8 * kk + 2 * r + 1]);
      da[kk][r] = packBf16(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
    }
  fenceRegs(dv);
  fenceRegs(dk);
  wgmmaFence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    mmaRS<true, D>(dv, pa[kk], desc(sdO + kk * 16 * 128, kBwdRows * 128, 1024));
    mmaRS<true, D>(dk, da[kk], desc(sQ + kk * 16 * 128, kBwdRows * 128, 1024));
  }
  wgmmaCommit();
}

/// This thread's dS^T fragments (rows r0 and r0 + 8 of the [kBwdKeys keys][BM queries]
/// tile, stored as 128-byte column blocks of 64 queries, swizzled), for the dQ product.
template <int BM = kBwdRows>
__device__ __forceinline__ void storeDsT(char* sdS, const unsigned (&da)[BM / 16][4], int r0, int t) {
#pragma unroll
  for (int i = 0; i < BM / 8; ++i) {
    const int kk = i >> 1, hi = (i & 1) * 2;
    char* blk = sdS + (i >> 3) * kBwdKeys * 128;  // the column block of queries 8i..8i+7
    *reinterpret_cast<unsigned*>(blk + r0 * 128 + (((i & 7) ^ (r0 & 7)) << 4) + 4 * t) = da[kk][hi];
    *reinterpret_cast<unsigned*>(blk + (r0 + 8) * 128 + (((i & 7) ^ ((r0 + 8) & 7)) << 4) + 4 * t) = da[kk][hi + 1];
  }
}

/// dQ (64 queries x 64 columns) = dS K, A = dS (dS^T read transposed), B = K read
/// transposed — BM = 64: D = 128, columns [64 w, 64 w + 64) over all the tile's keys; D =
/// 64, every column over warpgroup w's keys; BM = 128 (the warp-specialised kernel at D =
/// 64): every column of the step's queries [64 w, 64 w + 64) over all the tile's keys —
/// then waits for it and for dV and dK.
template <int D, int BM = kBwdRows>
__device__ __forceinline__ void bwdDq(float (&dq)[32], float (&dk)[D / 2], float (&dv)[D / 2], const char* sdS,
                                      const char* sK, int w) {
  static_assert(BM == 64 || D == 64, "128 query rows per step only at D = 64");
#pragma unroll
  for (int e = 0; e < 32; ++e) dq[e] = 0.0f;
  fenceRegs(dq);
  wgmmaFence();
  if constexpr (BM == 128) {
#pragma unroll
    for (int kk = 0; kk < kBwdKeys / 16; ++kk)
      wgmmaSS_bf16_n64_tt(dq, desc(sdS + w * kBwdKeys * 128 + kk * 16 * 128, kBwdKeys * 128, 1024),
                          desc(sK + kk * 16 * 128, kBwdKeys * 128, 1024));
  } else if constexpr (D == 128) {
#pragma unroll
    for (int kk = 0; kk < kBwdKeys / 16; ++kk)
      wgmmaSS_bf16_n64_tt(dq, desc(sdS + kk * 16 * 128, kBwdRows * 128, 1024),
                          desc(sK + w * kBwdKeys * 128 + kk * 16 * 128, kBwdKeys * 128, 1024));
  } else {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmmaSS_bf16_n64_tt(dq, desc(sdS + (w * 64 + kk * 16) * 128, kBwdRows * 128, 1024),
                          desc(sK + (w * 64 + kk * 16) * 128, kBwdKeys * 128, 1024));
  }
  wgmmaCommit();
  wgmmaWait<0>();
  fenceRegs(dq);
  fenceRegs(dv);
  fenceRegs(dk);
}

/// A backward block's dK and dV, added to the key rows key0 and key0 + 8 that this thread's
/// accumulators hold (rows past the piece's nk keys skipped): the other blocks over the
/// same keys (GQA heads, CP pieces) add theirs, so a reduction, not a store.
template <int D>
__device__ __forceinline__ void addKeyGrads(const cuda::Args& a, const float (&dk)[D / 2], const float (&dv)[D / 2],
                                            int key0, int nk, int kb, int hk, int t) {
  const float sc = a.scale;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key0 + 8 * half;
    if (key >= nk) continue;
    const std::int64_t r = kb + key;
    float* dkr = a.dk + r * a.dk_s0 + hk * D + 2 * t;
    float* dvr = a.dv + r * a.dv_s0 + hk * D + 2 * t;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      redAdd2(dkr + 8 * i, dk[4 * i + 2 * half] * sc, dk[4 * i + 2 * half + 1] * sc);
      redAdd2(dvr + 8 * i, dv[4 * i + 2 * half], dv[4 * i + 2 * half + 1]);
    }
  }
}

// ---------------- forward epilogue --------------------------------------------------------

/// One thread's share of a forward work item's output: rows wr and wr + 8 of the m64nD
/// accumulator layout (o[4i + 2half + {0,1}] = columns 8i + 2t + {0,1} of row wr + 8half),
/// normalised by the quad-summed row sums, to O (BF16 or FP32) and the LSE — or, for a
/// split-KV part (slot >= 0), in FP32 to its slot of a.o_part / a.lse_part for the combine
/// pass. Rows >= nq are not written.
template <bool BF, int D, int BQ>
__device__ __forceinline__ void storeRows(const cuda::Args& a, const float (&o)[D / 2], float m0, float m1, float l0,
                                          float l1, int wr, int t, int qb, int q0, int nq, int h, int slot) {
  const int H = a.heads;
  float* P = slot >= 0 ? a.o_part + static_cast<std::int64_t>(slot) * BQ * H * D : nullptr;
  char* O = static_cast<char*>(a.o_out);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float ls = quadSum(half ? l1 : l0);
    const int row = wr + 8 * half;
    if (row >= nq) continue;
    const float inv = 1.0f / ls;
    const float lse = ((half ? m1 : m0) + log2f(ls)) * 0.6931471805599453f;
    if (P) {
      float* prow = P + (static_cast<std::int64_t>(row - q0) * H + h) * D + 2 * t;
#pragma unroll
      for (int i = 0; i < D / 8; ++i)
        *reinterpret_cast<float2*>(prow + i * 8) =
            make_float2(o[4 * i + 2 * half] * inv, o[4 * i + 2 * half + 1] * inv);
      if (t == 0) a.lse_part[(static_cast<std::int64_t>(slot) * BQ + (row - q0)) * H + h] = lse;
      continue;
    }
    constexpr int esize = BF ? 2 : 4;
    char* orow = O + ((static_cast<std::int64_t>(qb + row)) * a.o_s0 + h * D + 2 * t) * esize;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const float x0 = o[4 * i + 2 * half] * inv, x1 = o[4 * i + 2 * half + 1] * inv;
      if constexpr (BF)
        *reinterpret_cast<unsigned*>(orow + i * 8 * 2) = packBf16(x0, x1);
      else
        *reinterpret_cast<float2*>(orow + i * 8 * 4) = make_float2(x0, x1);
    }
    if (t == 0) a.lse_out[static_cast<std::int64_t>(qb + row) * a.lse_s0 + h] = lse;
  }
}

// ---------------- mbarriers, TMA, registers, named barriers -----------------------------

__device__ __forceinline__ void mbarInit(std::uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smemAddr(b)), "r"(count) : "memory");
}
/// Makes initialised mbarriers visible to the async proxy (TMA completes on them).
__device__ __forceinline__ void fenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/// One arrival that also announces `bytes` of TMA traffic the phase waits for.
__device__ __forceinline__ void mbarExpectTx(std::uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smemAddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarArrive(std::uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smemAddr(b)) : "memory");
}
/// mbarArrive where `pred` holds, predicated rather than branched (a branch between an MMA's
/// issue and its wait makes ptxas serialise the MMAs).
__device__ __forceinline__ void mbarArriveIf(std::uint64_t* b, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(smemAddr(b)),
      "r"(static_cast<int>(pred))
      : "memory");
}
__device__ __forceinline__ bool mbarTryWait(std::uint64_t* b, unsigned parity) {
  unsigned done = 0;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(smemAddr(b)), "r"(parity)
               : "memory");
  return done != 0;
}
/// SM cycles (about 4 s on an H100) after which an mbarrier wait is a deadlock: no phase of
/// these kernels lasts a millisecond.
inline constexpr long long kMbarWaitLimit = 1LL << 33;
/// Waits until the phase of parity `parity` has completed (parity 1 on a fresh barrier
/// returns at once: the phase before the first counts as complete). A wait past
/// kMbarWaitLimit traps, so the launch fails (an illegal-instruction error) rather than
/// hanging the process; no printf, whose call would serialise the kernels' wgmma pipeline.
__device__ __forceinline__ void mbarWait(std::uint64_t* b, unsigned parity) {
  if (mbarTryWait(b, parity)) return;
  const long long t0 = clock64();
  while (!mbarTryWait(b, parity))
    if (clock64() - t0 > kMbarWaitLimit) __trap();
}
/// mbarWait for the loops of a consumer warpgroup (raised by setmaxnreg): a wait past
/// kMbarWaitLimit marks the warpgroup hung, every later wait returns at once, and the
/// kernel traps once, after its loop (trapIfHung). A trap inside such a loop costs the
/// warpgroup its raised registers: with it, ptxas 13 spilled 508 bytes per thread of the
/// D = 128 backward and serialised its wgmma; without it, neither. The spin loop is
/// mbarWait's, written out again on purpose: built on a shared bool-returning wait instead,
/// ptxas spilled 228-268 bytes in both warp-specialised forwards and serialised their wgmma
/// (bench/ptxas_report.sh --check catches it).
struct ConsumerWaits {
  bool hung = false;
  __device__ __forceinline__ void operator()(std::uint64_t* b, unsigned parity) {
    if (hung || mbarTryWait(b, parity)) return;
    const long long t0 = clock64();
    while (!mbarTryWait(b, parity))
      if (clock64() - t0 > kMbarWaitLimit) {
        hung = true;
        return;
      }
  }
  __device__ __forceinline__ void trapIfHung() const {
    if (hung) __trap();
  }
};
/// TMA: the box at coordinates (c0, c1, c2) of `map` into shared memory at `dst`,
/// completing `bytes` on `bar` (elements outside the tensor arrive as zeros).
__device__ __forceinline__ void tmaLoad3(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                         std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(smemAddr(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smemAddr(bar))
      : "memory");
}
__device__ __forceinline__ void prefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
}
/// Bulk reduction: `bytes` of FP32 in shared memory added element-wise into global memory
/// (in L2), as one asynchronous operation of the issuing thread's bulk group. Both
/// addresses 16-byte aligned, `bytes` a multiple of 16.
__device__ __forceinline__ void bulkReduceAddF32(float* gdst, const void* ssrc, unsigned bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gdst),
               "r"(smemAddr(ssrc)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulkCommit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
/// Waits until at most N of this thread's bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
/// Waits until at most N of this thread's bulk groups are still in flight.
template <int N>
__device__ __forceinline__ void bulkWait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
/// Warpgroup-wide register reallocation (every thread of the warpgroup executes it).
template <int N>
__device__ __forceinline__ void regsDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regsInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
/// Named barrier `id` (1-15; 0 is __syncthreads) over `n` threads: sync waits, arrive
/// only counts.
__device__ __forceinline__ void barSync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void barArrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
/// barArrive where `pred` holds (warp-uniform), predicated rather than branched.
__device__ __forceinline__ void barArriveIf(int id, int n, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p bar.arrive %0, %1;\n}\n" ::"r"(id), "r"(n),
               "r"(static_cast<int>(pred))
               : "memory");
}

// ---------------- host helpers (cuda_hopper.cu) -----------------------------------------

/// Throws std::runtime_error naming `what` unless `e` is cudaSuccess.
void check(cudaError_t e, const char* what);
/// The split-KV combine pass over a.groups, for items of `rows` query rows (nothing
/// without a split plan).
void combineParts(cudaStream_t st, const cuda::Args& a, bool bf16, int rows);

}  // namespace wlb::attention::hopper::kern
