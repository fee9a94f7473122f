#pragma once
/// \file cuda_args.hpp
/// \brief Internal: the raw argument block of the CUDA attention kernels. Free of Kokkos so
/// that the Hopper kernels (cuda_hopper.cu, compiled for sm_90a apart from the Kokkos
/// translation units) take the same block as the Kokkos launches.

#include <cstdint>

namespace wlb::attention::cuda {

/// Raw device pointers of one call. Rows are tokens; inside a row [heads][D] is
/// contiguous (checked by the dispatcher), so element (t, h, d) is at t*s0 + h*D + d.
/// Inputs are bf16 or float as the kernel's element type says; gradients, lse and delta
/// are always float.
struct Args {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;   // backward: forward output
  const void* dO = nullptr;  // backward
  void* o_out = nullptr;     // forward
  float* lse_out = nullptr;  // forward
  const float* lse = nullptr;
  const float* delta = nullptr;  // backward: [q_tokens][heads] rowsum(dO∘O)
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  std::int64_t q_s0 = 0, k_s0 = 0, v_s0 = 0, o_s0 = 0, dO_s0 = 0, lse_s0 = 0, dq_s0 = 0, dk_s0 = 0, dv_s0 = 0;
  std::int64_t q_rows = 0, k_rows = 0;  ///< rows of q (o) and of k, v (the TMA kernel's tensor extents)
  int heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 1.0f;           ///< softmax scale
  float scale_log2 = 1.0f;      ///< scale * log2(e): the kernels use exp2
  const int* ranges = nullptr;  ///< [pieces][4]: q_begin, q_end, k_begin, k_end
  const int* work = nullptr;    ///< [nwork][2]: piece, tile index; longest first
  int nwork = 0;
  int bwd_rows = 0;  ///< query rows per step of the warp-specialised backward at D = 64 (KernelConfig::ws_bwd_rows)
  // Split-KV (Hopper forward, split_kv.hpp); null `split`: every item walks all its visible
  // key tiles and writes O.
  const int* split = nullptr;   ///< [nwork][3]: first key tile, end key tile, partial slot (-1: O)
  float* o_part = nullptr;      ///< [slots][rows per item][heads][head_dim] normalised partial outputs
  float* lse_part = nullptr;    ///< [slots][rows per item][heads] their LSEs (natural log)
  const int* groups = nullptr;  ///< [ngroups][4]: piece, tile, first slot, parts (the combine pass)
  int ngroups = 0;
};

}  // namespace wlb::attention::cuda
