#pragma once
/// \file cuda_hopper.hpp
/// \brief Internal: the Hopper (sm_90a) attention forward and BF16 backward — warpgroup MMAs (`wgmma`) reading
/// Q, K and V from shared memory. Built only with the CUDA backend, as its own translation
/// unit (cuda_hopper.cu, compiled for sm_90a without Kokkos), and called from the Kokkos
/// dispatch on the caller's instance stream.
///
/// Why not a Kokkos TeamPolicy: Kokkos 4.x caps team scratch at sharedMemPerBlock (48 KiB),
/// and the kernel stages a 128-row Q tile plus double-buffered K/V tiles (96-192 KiB); a
/// raw launch may opt in to the 227 KiB an H100 block can have.

#include <cstdint>

#include "attention/cuda_args.hpp"

namespace wlb::attention::hopper {

/// True when the current CUDA device is compute capability 9.0 (the sm_90a code runs
/// nowhere else) and the kernels were built.
bool usable();

/// Head dims the kernels handle (64, 128).
bool supports(int head_dim);

/// Query rows per work item and keys per staged tile of the forward (the Kokkos side
/// builds the longest-first work list with these).
int forwardRows(bool bf16, int head_dim);
int forwardKeys(bool bf16, int head_dim);

/// Forward over `a.work` (nwork items x heads blocks) on `stream` (a cudaStream_t):
/// `bf16` = BF16 storage and MMAs; else FP32 storage on TF32 MMAs. With `a.split` (a
/// split-KV plan, split_kv.hpp) the items walk their key-tile ranges, the parts write
/// a.o_part / a.lse_part, and a combine pass over `a.groups` merges them into O and the
/// LSE. Throws std::runtime_error when a launch fails.
void forward(void* stream, const cuda::Args& a, bool bf16);

/// The warp-specialised BF16 forward (cuda_hopper_ws.cu: TMA producer warpgroup, consumer
/// warpgroups in ping-pong, the next tile's QK^T issued before this tile's softmax): query
/// rows per work item and keys per tile, for the work list and split-KV plan.
int wsRows(int head_dim);
int wsKeys(int head_dim);

/// As forward() with bf16 = true, on the warp-specialised kernel. Needs a.q_rows and
/// a.k_rows (the tensors' row counts, for the TMA descriptors) and 16-byte aligned rows
/// with row strides a multiple of 16 bytes.
void forwardWs(void* stream, const cuda::Args& a);

/// What the warp-specialised kernels need of their tensors: 16-byte aligned bases and row
/// strides of a multiple of 16 bytes — for the TMA loads of q, k, v (and dO with
/// `backward`), and for the backward's bulk dQ reductions of dq. The dispatcher takes the
/// synchronous kernels where this fails.
inline bool wsReady(const cuda::Args& a, bool backward) {
  const auto ok = [](const void* p, std::int64_t stride_bytes) {
    return reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && stride_bytes % 16 == 0;
  };
  const bool loads = ok(a.q, 2 * a.q_s0) && ok(a.k, 2 * a.k_s0) && ok(a.v, 2 * a.v_s0);
  return loads && (!backward || (ok(a.dO, 2 * a.dO_s0) && ok(a.dq, 4 * a.dq_s0)));
}

/// The warp-specialised BF16 backward (cuda_hopper_ws.cu: a TMA producer warp, two
/// consumer warpgroups, dQ added by bulk reductions): the same work list, arguments and
/// contract as backward(), plus a.q_rows / a.k_rows as forwardWs() and a 16-byte aligned
/// a.dq with a.dq_s0 a multiple of 4.
void backwardWs(void* stream, const cuda::Args& a);

/// Keys per block of the BF16 backward (the work list's key tiles).
int backwardKeys();

/// BF16 backward over `a.work` (key tiles of backwardKeys() x KV heads): accumulates into
/// a.dq, a.dk, a.dv; a.delta holds rowsum(dO∘O). Throws std::runtime_error when the
/// launch fails.
void backward(void* stream, const cuda::Args& a);

}  // namespace wlb::attention::hopper
