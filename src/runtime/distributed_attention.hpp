#pragma once
/// \file distributed_attention.hpp
/// \brief Context-parallel attention over MPI: one micro-batch's attention, sharded by a
/// ShardPlan over the ranks of a CP communicator, KV moved by the plan's CommPlan
/// (docs/runtime.md, shard_plan.hpp for the layout contract).
///
/// Every CP rank holds the q, k, v of its own tokens in *local order* (the rank's pieces
/// concatenated in ascending packed order, `RankShard::pieces[i].local_begin`):
///   q, o, dO, dq : [local tokens][heads][head_dim]
///   k, v, dk, dv : [local tokens][kv_heads][head_dim]
///   lse          : [local tokens][heads]
///
/// Forward builds the rank's KV buffer (`RankShard::kv_tokens` rows) from the plan:
///   * AllGather: an all-gather(v) of every rank's K and V (counts = gather_counts), then
///     a reorder into the KV buffer (the allGatherKvIndex() map).
///   * ShardingAware: one point-to-point message per CommPlan::Transfer (K and V of the
///     transfer's runs, packed back to back), own runs copied locally.
/// Every pack, unpack and reorder is a Kokkos kernel on the execution-space instance over
/// the plan's row maps (shard_plan.hpp: ownRunRows, transferLocalRows, transferKvSlots),
/// so device buffers never pass through host loops; the bytes move through a
/// parallel::GroupComm (host-staged MPI, or NCCL on device memory).
/// then runs `attention::forward` on the rank's pieces (queries local[local_begin,
/// +q_len), keys kv[kv_begin, +kv_len), causal bottom-right).
///
/// Backward runs `attention::backward` into a zeroed KV-buffer gradient and returns the
/// dK/dV partial sums to their owners:
///   * AllGather: scatter into an all-gather-shaped buffer, MPI_Reduce_scatter.
///   * ShardingAware: the reverse messages, added into the owner's dK/dV.
/// dq, dk, dv are OVERWRITTEN (unlike the single-rank kernel, which accumulates).
///
/// The KV buffer built in forward is kept by the object and reused by backward (no second
/// exchange). Every MPI call is preceded by a fence of the execution space. The plan and
/// comm plan must be identical on every rank of the communicator and outlive the object.
/// Every buffer (KV buffer, messages, gathered rows, KV-buffer gradient) is a
/// [rows][kv_heads][head_dim] block of DistAttentionOptions::pool when one is given, so a
/// repeated step allocates nothing here either.

#include <mpi.h>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "attention/attention.hpp"
#include "cp/shard_plan.hpp"
#include "parallel/group_comm.hpp"

namespace wlb::model {
class CostModel;
}
namespace wlb::trace {
class Recorder;
}
namespace wlb::runtime {
class BufferPool;

/// Device views used by the distributed attention (default execution space).
struct DistViews {
  using Space = Kokkos::DefaultExecutionSpace;
  using mem = Space::memory_space;
  using View3 = Kokkos::View<float***, Kokkos::LayoutRight, mem>;
  using View2 = Kokkos::View<float**, Kokkos::LayoutRight, mem>;
  using Const3 = Kokkos::View<const float***, Kokkos::LayoutRight, mem>;
  using Const2 = Kokkos::View<const float**, Kokkos::LayoutRight, mem>;
  using BView3 = Kokkos::View<attention::bf16***, Kokkos::LayoutRight, mem>;  ///< BF16 storage
  using BConst3 = Kokkos::View<const attention::bf16***, Kokkos::LayoutRight, mem>;
};

struct DistAttentionOptions {
  attention::KernelConfig kernel{};
  float softmax_scale = 0.0f;  ///< <= 0 -> 1/sqrt(head_dim)
  /// FLOPs recorded on `attn` events (CostModel::attnFlops per piece). Null -> the
  /// kernel's own useful-FLOP count (attention/flops.hpp).
  const model::CostModel* cost = nullptr;
  /// Events are recorded here when non-null (labels kv_allgather / kv_exchange, attn;
  /// phase fwd/bwd; step, micro-batch and layer from the recorder's current context). Their
  /// bytes: K/V in their storage type forward (FP32 4, BF16 2 per element), dK/dV in FP32.
  trace::Recorder* recorder = nullptr;
  /// Moves the bytes (mpi host-staged or nccl); must be over the same ranks as `comm`.
  /// Null -> a host-staged MPI group over `comm`.
  parallel::GroupComm* group = nullptr;
  /// Buffers come from here when non-null (the stage's activation pool: cached across
  /// layers, micro-batches and steps, and a failed allocation first gives the pool's free
  /// blocks back); else each call allocates its own. Must outlive the object.
  BufferPool* pool = nullptr;
};

/// Seconds spent by the last forward()/backward() call of this rank.
struct DistAttentionTimes {
  double comm_fwd = 0, attn_fwd = 0;    ///< KV exchange (incl. waiting) / kernel
  double comm_bwd = 0, attn_bwd = 0;    ///< dKV return (incl. waiting) / kernel
  double bytes_fwd = 0, bytes_bwd = 0;  ///< bytes this rank sent + received
};

/// One micro-batch's distributed attention on one CP rank.
class DistributedAttention {
 public:
  using Space = DistViews::Space;
  using View3 = DistViews::View3;
  using View2 = DistViews::View2;
  using Const3 = DistViews::Const3;
  using Const2 = DistViews::Const2;
  using BView3 = DistViews::BView3;
  using BConst3 = DistViews::BConst3;

  /// `comm` has plan.cp ranks; this rank's index in it selects its shard. Throws
  /// std::invalid_argument on a size mismatch or bad head counts.
  /// `like`: another object of the same plan, comm plan and communicator (a micro-batch's
  /// other layer) whose varlen batch and device row maps this one shares instead of
  /// building and uploading its own (they depend on the plan alone).
  DistributedAttention(const cp::ShardPlan& plan, const cp::CommPlan& comm_plan, MPI_Comm comm, int heads, int kv_heads,
                       int head_dim, DistAttentionOptions opt = {}, const DistributedAttention* like = nullptr);
  ~DistributedAttention();
  DistributedAttention(const DistributedAttention&) = delete;
  DistributedAttention& operator=(const DistributedAttention&) = delete;

  int rank() const { return rank_; }
  std::int64_t localTokens() const { return local_tokens_; }
  std::int64_t kvTokens() const { return kv_tokens_; }
  const attention::VarlenBatch& batch() const { return *batch_; }

  /// Exchange KV and run the attention forward. o/lse are overwritten. Collective over
  /// the CP communicator.
  void forward(const Space& space, Const3 q, Const3 k, Const3 v, View3 o, View2 lse);
  /// BF16 storage of q, k, v, o (and of the KV buffer and the K/V on the wire: half the
  /// bytes); lse FP32. (kv_heads * head_dim must be even: BF16 pairs travel as words.)
  void forward(const Space& space, BConst3 q, BConst3 k, BConst3 v, BView3 o, View2 lse);

  /// Attention backward and dK/dV return. Needs the preceding forward() of this object
  /// (its KV buffer); o/lse are that forward's outputs. dq/dk/dv are overwritten.
  /// Collective over the CP communicator.
  void backward(const Space& space, Const3 q, Const3 o, Const2 lse, Const3 dO, View3 dq, View3 dk, View3 dv);
  /// BF16 storage of q, o, dO (a BF16 forward's); the gradients are FP32.
  void backward(const Space& space, BConst3 q, BConst3 o, Const2 lse, BConst3 dO, View3 dq, View3 dk, View3 dv);

  /// Drop the KV buffer kept for backward.
  void releaseKv();
  /// Bytes of the KV buffer (K and V, in their storage type) kept from forward for
  /// backward; 0 once released.
  std::int64_t heldKvBytes() const {
    return have_kv_ ? static_cast<std::int64_t>(4 * (kv_k_.span() + kv_v_.span()) + 2 * (kv_kb_.span() + kv_vb_.span()))
                    : 0;
  }

  const DistAttentionTimes& times() const { return times_; }

  /// FLOPs of this rank's pieces in a phase (cost model if given, else kernel count).
  double attnFlops(bool backward) const;

 private:
  template <class T>
  void forwardT(const Space& space, Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> q,
                Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> k,
                Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> v,
                Kokkos::View<T***, Kokkos::LayoutRight, DistViews::mem> o, View2 lse);
  template <class T>
  void backwardT(const Space& space, Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> q,
                 Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> o, Const2 lse,
                 Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> dO, View3 dq, View3 dk, View3 dv);
  template <class T>
  void exchangeKvForward(const Space& space, const T* k, const T* v, T* kv_k, T* kv_v);
  void returnKvGradBackward(const Space& space, View3 dk, View3 dv);
  /// A [rows][kv_heads][head_dim] buffer of T from opt_.pool, else allocated; zeroed when asked.
  template <class T>
  Kokkos::View<T***, Kokkos::LayoutRight, DistViews::mem> rowBuffer(const Space& space, const char* label,
                                                                    std::int64_t rows, bool zero = false) const;
  void buildMaps();
  struct Maps;  // the plan's row maps in device memory (built once per object)

  const cp::ShardPlan* plan_;
  const cp::CommPlan* comm_plan_;
  MPI_Comm comm_;
  int rank_ = 0;
  int heads_, kv_heads_, head_dim_;
  DistAttentionOptions opt_;
  std::int64_t local_tokens_ = 0, kv_tokens_ = 0;
  std::shared_ptr<const attention::VarlenBatch> batch_;
  View3 kv_k_, kv_v_;     ///< KV buffer (kept from forward for backward), FP32 storage
  BView3 kv_kb_, kv_vb_;  ///< the same, BF16 storage
  /// The kept K or V buffer of storage type T: forward stores it, backward reads it.
  template <class T>
  auto& keptK() {
    if constexpr (std::is_same_v<T, float>)
      return kv_k_;
    else
      return kv_kb_;
  }
  template <class T>
  auto& keptV() {
    if constexpr (std::is_same_v<T, float>)
      return kv_v_;
    else
      return kv_vb_;
  }
  bool have_kv_ = false;
  DistAttentionTimes times_;
  std::unique_ptr<parallel::GroupComm> own_group_;
  parallel::GroupComm* group_ = nullptr;
  std::shared_ptr<const Maps> maps_;
};

/// Gather a rank-local buffer ([local tokens][width] floats, local order) of every CP
/// rank back into packed (sequence) order on every rank: out[p] = local_{owner[p]}
/// [local_index[p]]. Collective (MPI_Allgatherv). Used by tests and diagnostics.
std::vector<float> gatherToPacked(const cp::ShardPlan& plan, const cp::CommPlan& comm_plan, MPI_Comm comm,
                                  const float* local, std::int64_t width);

}  // namespace wlb::runtime
