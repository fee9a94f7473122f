#pragma once
/// \file layer.hpp
/// \brief One layer of the model (llama.hpp) on one rank, forward and backward
/// (docs/runtime.md): RMSNorm -> Q/K/V -> RoPE -> context-parallel attention
/// (runtime/distributed_attention.hpp) -> out-projection -> residual -> RMSNorm -> SwiGLU MLP ->
/// residual. Heads, KV heads and MLP columns are split over TP (column-parallel QKV/W1/W3,
/// row-parallel Wo/W2): the outputs of Wo and W2 and the input gradients of the two norms'
/// branches are summed over the TP group.
///
/// Every op is a timed region of the trace Recorder with FLOPs from the cost model:
/// qkv_proj (norm, GEMMs, RoPE), attn, kv_allgather / kv_exchange, out_proj, mlp (norm,
/// GEMMs, SwiGLU), tp_allreduce. The regions are the cost model's three linear ops, so the
/// simulator, the profile and the calibration time what the executor runs.

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/types.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"
#include "parallel/group_comm.hpp"
#include "parallel/mesh.hpp"
#include "runtime/distributed_attention.hpp"
#include "runtime/gemm.hpp"
#include "runtime/llama.hpp"
#include "runtime/op_timer.hpp"
#include "runtime/pool.hpp"

namespace wlb::trace {
class Recorder;
}

namespace wlb::runtime {

/// Layer dimensions on one TP rank.
struct LayerShape {
  int hidden = 0;    ///< model width (not split)
  int heads = 0;     ///< query heads on this TP rank
  int kv_heads = 0;  ///< KV heads on this TP rank
  int head_dim = 0;
  int ffn = 0;  ///< MLP width on this TP rank
  /// From model dims and the TP degree; InputError (naming the key) when heads, kv_heads
  /// or ffn are not divisible by tp, hidden != heads*head_dim or head_dim is odd.
  static LayerShape fromDims(const model::ModelDims& d, int tp);
  static LayerShape of(const LlamaConfig& c);
  std::int64_t qWidth() const { return static_cast<std::int64_t>(heads) * head_dim; }
  std::int64_t kvWidth() const { return static_cast<std::int64_t>(kv_heads) * head_dim; }
};

/// FLOPs of one linear op for `tokens` tokens on one TP rank (the cost model's formula).
using LinearOp = model::LinearOp;
double linearOpFlops(const model::CostModel& cost, LinearOp op, std::int64_t tokens, model::Phase phase);

/// RoPE's cos/sin of every (position, pair) up to the largest position seen, computed in
/// double on the host once and grown when a longer span arrives.
class RopeTable {
 public:
  RopeTable(int head_dim, double theta) : half_(head_dim / 2), theta_(theta) {}
  /// Make positions [0, n) available (collective-free; may reallocate).
  void ensure(const Space& space, std::int64_t n);
  Mat cos() const { return cos_; }
  Mat sin() const { return sin_; }

 private:
  int half_;
  double theta_;
  Mat cos_, sin_;
};

/// Environment of a layer execution on one rank.
struct LayerEnv {
  const Space* space = nullptr;
  MPI_Comm cp_comm = MPI_COMM_NULL;  ///< the micro-batch's CP group
  MPI_Comm tp_comm = MPI_COMM_NULL;  ///< MPI_COMM_NULL or a 1-rank comm when tp == 1
  int tp = 1;
  const model::CostModel* cost = nullptr;  ///< FLOPs of recorded events (required)
  trace::Recorder* recorder = nullptr;     ///< optional
  const RopeTable* rope = nullptr;         ///< required; covers every position of the rows
  float norm_eps = 1e-5f;
  attention::KernelConfig kernel{};  ///< its precision is the attention's
  /// run.precision: the GEMMs' arithmetic; Bf16 also means BF16 storage of what the GEMMs
  /// and the attention read (activations kept for backward, the weights' working copy).
  Precision precision = Precision::Fp32;
  /// Collectives of the CP / TP groups (run.comm_backend); null -> host-staged MPI over
  /// cp_comm / tp_comm.
  parallel::GroupComm* cp_group = nullptr;
  parallel::GroupComm* tp_group = nullptr;
  /// Activations and temporaries come from here (pool.hpp); null -> fresh allocations.
  BufferPool* pool = nullptr;
  /// pipeline.recompute = "selective" (pp::executorRecomputesSelective): the norms' outputs
  /// and the SwiGLU product are not kept but computed again in the backward
  /// (model::executorLayerActivationBytes).
  bool recompute_selective = false;
  /// `wlb run --gemm-timing`: times every product by name while active; null -> untimed.
  OpTimer* gemm_timer = nullptr;
  /// A rank of `mesh`: its CP and TP groups (with their collectives), GEMMs and attention at
  /// `precision` (`wlb run` and `wlb train` alike).
  bool bf16Storage() const { return precision == Precision::Bf16; }
  static LayerEnv onMesh(const Space& space, const parallel::Mesh& mesh, const model::CostModel& cost,
                         trace::Recorder* recorder, Precision precision, parallel::GroupComm* cp_group,
                         parallel::GroupComm* tp_group);
};

/// gemm() at env.precision, the product named `name` (layer.cpp, head.cpp: "mlp.w1.fwd",
/// "qkv_proj.q.dgrad", ...); timed between two fences when env.gemm_timer is active.
template <class A, class B, class C>
void layerGemm(const LayerEnv& env, const char* name, Trans ta, Trans tb, float alpha, const A& a, const B& b,
               float beta, const C& c) {
  if (!env.gemm_timer || !env.gemm_timer->active()) {
    gemm(*env.space, ta, tb, alpha, a, b, beta, c, env.precision);
    return;
  }
  kk::fence(*env.space, "wlb::runtime::gemm_timer::before");
  const auto t0 = std::chrono::steady_clock::now();
  gemm(*env.space, ta, tb, alpha, a, b, beta, c, env.precision);
  kk::fence(*env.space, "wlb::runtime::gemm_timer::after");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double k = static_cast<double>(ta == Trans::N ? a.extent(1) : a.extent(0));
  env.gemm_timer->add(name, s, 2.0 * static_cast<double>(c.extent(0)) * static_cast<double>(c.extent(1)) * k);
}

/// What one layer keeps from forward to backward for a run of rows (in packed or local
/// order): the input and its norm, the post-attention residual and its norm, the two norms'
/// reciprocal RMS, Q/K/V/O and the LSE, the MLP's two projections and gated product. The
/// residual stream (x, h), the RMS and the LSE are FP32; the rest has storage type T (float,
/// or bf16 with run.precision = "bf16"). Its bytes are model::executorLayerActivationBytes
/// with no KV buffer.
template <class T>
struct LayerActsT {
  using Lse = Kokkos::View<float**, Kokkos::LayoutRight, Mem>;
  Mat x, h;
  MatT<T> xn1, hn, a1, a3, s;
  Vec rstd1, rstd2;
  Act3T<T> q, k, v, o;
  Lse lse;
  std::int64_t rows() const { return static_cast<std::int64_t>(x.extent(0)); }
  std::int64_t bytes() const;
  /// A deep copy of rows [r0, r1) (a SlimPack slice's share of its forward MicroPack), in
  /// buffers from `pool` (null: allocated).
  LayerActsT copyRows(const Space& space, BufferPool* pool, std::int64_t r0, std::int64_t r1) const;
  /// The rows of `parts` one after another (deep copies from `pool`; one part is returned
  /// as is).
  static LayerActsT concat(const Space& space, BufferPool* pool, const std::vector<const LayerActsT*>& parts);
};
using LayerActs = LayerActsT<float>;

/// RMSNorm of every row (one team per row): y = x * rstd * g, rstd = 1/sqrt(mean(x^2) + eps);
/// y in its storage type (float or bf16).
template <class T>
void rmsNorm(const Space& space, const Mat& x, const Vec& g, float eps, const MatT<T>& y, const Vec& rstd);
/// Its backward: dx += rstd * (g*dy - xhat * mean(g*dy*xhat)) and dg += the gain's gradient
/// (block partial sums, then their ordered sum: deterministic without atomics, and a GPU is
/// not left with one thread per column walking every row). Scratch from `pool` (null:
/// allocated).
void rmsNormBackward(const Space& space, BufferPool* pool, const Mat& x, const Vec& g, const Vec& rstd, const Mat& dy,
                     const Mat& dx, const Vec& dg);

/// The parts of a layer around its attention, shared by LayerStep and the sliced executor
/// (sliced.hpp). `pos`: the rows' RoPE positions.
/// `w`: the weights the kernels read (Llama::working<T>), `g`: the FP32 gradients.
/// norm1, Q/K/V, RoPE: a.xn1, a.rstd1, a.q, a.k, a.v from a.x.
template <class T>
void qkvForward(const LayerEnv& env, const LayerShape& s, const LayerParamsT<T>& w, LayerActsT<T>& a, const IVec& pos);
/// Given a.o (and a.x): h = x + O Wo, y = h + SwiGLU(norm2(h)); keeps what backward needs.
template <class T>
Mat outMlpForward(const LayerEnv& env, const LayerParamsT<T>& w, LayerActsT<T>& a);
/// Backward of outMlpForward: accumulates dWo, dW1..3, dg2, sets dh (dL/dh incl. the
/// residual) and returns dO (storage type T). Drops the MLP activations.
template <class T>
Act3T<T> outMlpBackward(const LayerEnv& env, const LayerParamsT<T>& w, const LayerParams& g, LayerActsT<T>& a,
                        const Mat& dy, Mat& dh);
/// Backward of qkvForward: RoPE's transpose on dq/dk, accumulates dWq/dWk/dWv and dg1,
/// returns dx = dh + norm1'(dq Wq^T + dk Wk^T + dv Wv^T). dq and dk are rotated in place.
template <class T>
Mat qkvBackward(const LayerEnv& env, const LayerParamsT<T>& w, const LayerParams& g, const LayerActsT<T>& a,
                const Act3& dq, const Act3& dk, const Act3& dv, const Mat& dh, const IVec& pos);

/// Forward/backward of one layer for one unit (this CP rank's rows of a micro-batch);
/// keeps the activations of forward for backward.
class LayerStep {
 public:
  /// `like`: another layer's step of the same unit, whose attention maps (varlen batch,
  /// KV row maps) this one shares: they are built once per unit, not per layer.
  LayerStep(const LayerEnv& env, const Llama& model, int layer, const cp::ShardPlan& plan, const cp::CommPlan& comm,
            const LayerStep* like = nullptr);
  /// y for x [local rows][hidden]; `keep` = false (evaluation) drops every activation.
  Mat forward(const Mat& x, const IVec& pos, bool keep = true);
  /// Given dL/dy, accumulate weight gradients and return dL/dx. Frees the activations.
  Mat backward(const Mat& dy, const IVec& pos);
  std::int64_t tokens() const { return n_; }
  /// Attention kernel seconds of the last forward + backward on this rank.
  double attnSeconds() const { return attn_seconds_; }
  /// Bytes of the activations kept from forward to backward (model::
  /// executorLayerActivationBytes, KV buffer included); 0 after backward.
  std::int64_t savedBytes() const;

 private:
  template <class T>
  Mat forwardT(const Mat& x, const IVec& pos, bool keep);
  template <class T>
  Mat backwardT(const Mat& dy, const IVec& pos);
  template <class T>
  LayerActsT<T>& acts();
  LayerEnv env_;
  const Llama* model_;
  int layer_;
  std::int64_t n_;
  std::unique_ptr<DistributedAttention> attn_;
  LayerActsT<float> acts_;
  LayerActsT<bf16> bacts_;  ///< with BF16 storage
  double attn_seconds_ = 0;
};

}  // namespace wlb::runtime
