#pragma once
/// \file layer.hpp
/// \brief One transformer layer on one rank with real kernels (docs/runtime.md):
/// QKV projection (GEMMs), context-parallel attention (cp/distributed_attention.hpp),
/// output projection, residual, SwiGLU MLP (GEMMs), residual; and the backward of all of
/// it, accumulating weight gradients. Heads, KV heads and the MLP width are split over
/// TP ranks (Megatron style: column-parallel QKV/W1/W3, row-parallel out-proj/W2, a TP
/// all-reduce after each row-parallel GEMM in forward and of the input gradient of each
/// block in backward). Norms are omitted (negligible, elementwise).
///
/// Every op is a timed region in the trace Recorder (labels qkv_proj, attn, kv_allgather
/// / kv_exchange, out_proj, mlp, tp_allreduce) with FLOPs from the cost model.

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cp/distributed_attention.hpp"
#include "core/types.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"
#include "parallel/group_comm.hpp"
#include "runtime/gemm.hpp"

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
  /// or ffn are not divisible by tp or hidden != heads*head_dim.
  static LayerShape fromDims(const model::ModelDims& d, int tp);
  std::int64_t qWidth() const { return static_cast<std::int64_t>(heads) * head_dim; }
  std::int64_t kvWidth() const { return static_cast<std::int64_t>(kv_heads) * head_dim; }
  /// Parameters of one layer on this rank.
  std::int64_t paramCount() const;
};

/// Linear ops of a layer, for per-op FLOPs.
using LinearOp = model::LinearOp;
/// FLOPs of one linear op for `tokens` tokens on one TP rank. The three ops sum to
/// CostModel::linearFlops (the cost model's QKV + out-proj + SwiGLU terms).
double linearOpFlops(const model::CostModel& cost, LinearOp op, std::int64_t tokens, model::Phase phase);

/// One layer's weights (or weight gradients): views into a model-wide buffer.
struct LayerParams {
  Mat wq, wk, wv;  ///< [hidden][q/kv width]
  Mat wo;          ///< [q width][hidden]
  Mat w1, w3;      ///< [hidden][ffn]
  Mat w2;          ///< [ffn][hidden]
};

/// All layers' weights and gradients on one rank, each in one contiguous buffer (the
/// gradient buffer is what the DP/CP all-reduce sums).
class Model {
 public:
  /// Weights uniform in +-1/sqrt(fan_in) from a counter-based hash of (seed, layer,
  /// tp rank, index): identical on every DP/CP replica, different per TP slice, and the
  /// same for a layer whichever pipeline stage holds it.
  /// `layer_ids`: the global layer indices this rank holds (a pipeline stage's blocks),
  /// ascending; the buffers hold them in that order.
  Model(const LayerShape& shape, std::vector<int> layer_ids, std::uint64_t seed, int tp_rank);
  /// All `layers` layers (pp = 1).
  Model(const LayerShape& shape, int layers, std::uint64_t seed, int tp_rank);
  const LayerShape& shape() const { return shape_; }
  int layers() const { return static_cast<int>(weights_.size()); }
  const std::vector<int>& layerIds() const { return ids_; }
  /// Weights / gradients of global layer `l` (which this rank must hold).
  LayerParams& weights(int l) { return weights_[slot(l)]; }
  LayerParams& grads(int l) { return grads_[slot(l)]; }
  /// Gradient buffer slice of global layer `l` (paramCount() floats).
  Kokkos::View<float*, Mem> layerGrads(int l) const;
  Kokkos::View<float*, Mem> gradBuffer() const { return grad_buf_; }
  Kokkos::View<float*, Mem> weightBuffer() const { return weight_buf_; }
  void zeroGrads(const Space& space);

 private:
  std::size_t slot(int l) const;
  LayerShape shape_;
  std::vector<int> ids_;
  Kokkos::View<float*, Mem> weight_buf_, grad_buf_;
  std::vector<LayerParams> weights_, grads_;
};

/// Environment of a layer execution on one rank.
struct LayerEnv {
  const Space* space = nullptr;
  MPI_Comm cp_comm = MPI_COMM_NULL;  ///< the micro-batch's CP group
  MPI_Comm tp_comm = MPI_COMM_NULL;  ///< MPI_COMM_NULL or a 1-rank comm when tp == 1
  int tp = 1;
  const model::CostModel* cost = nullptr;  ///< FLOPs of recorded events (required)
  trace::Recorder* recorder = nullptr;     ///< optional
  attention::KernelConfig kernel{};        ///< its precision is the attention's
  Precision precision = Precision::Fp32;   ///< the GEMMs' (run.precision)
  /// Collectives of the CP / TP groups (run.comm_backend); null -> host-staged MPI over
  /// cp_comm / tp_comm.
  parallel::GroupComm* cp_group = nullptr;
  parallel::GroupComm* tp_group = nullptr;
};

/// What one layer keeps from forward to backward for a run of tokens (rows in packed or
/// local order): the input, the post-attention residual, Q/K/V/O and the LSE, the MLP's two
/// projections and gated product. Its bytes are model::executorLayerActivationBytes with
/// no KV buffer.
struct LayerActs {
  using Lse = Kokkos::View<float**, Kokkos::LayoutRight, Mem>;
  Mat x, h, a1, a3, s;
  Act3 q, k, v, o;
  Lse lse;
  std::int64_t rows() const { return static_cast<std::int64_t>(x.extent(0)); }
  std::int64_t bytes() const;
  /// A deep copy of rows [r0, r1) (a SlimPack slice's share of its forward MicroPack).
  LayerActs copyRows(const Space& space, std::int64_t r0, std::int64_t r1) const;
  /// The rows of `parts` one after another (deep copies; one part is returned as is).
  static LayerActs concat(const Space& space, const std::vector<const LayerActs*>& parts);
};

/// The linear parts of a layer, shared by LayerStep and the sliced executor
/// (runtime/sliced.hpp); each records its timed region and the TP all-reduces.
/// QKV projection: a.q, a.k, a.v from a.x.
void qkvForward(const LayerEnv& env, const LayerShape& s, const LayerParams& w, LayerActs& a);
/// Given a.o (and a.x): h = x + o Wo, y = h + SwiGLU(h); keeps h and the MLP activations.
Mat outMlpForward(const LayerEnv& env, const LayerParams& w, LayerActs& a);
/// Backward of outMlpForward: accumulates dWo, dW1..3, sets dh (dL/dh incl. the residual)
/// and returns dO. Drops the MLP activations (a.s is reused as scratch).
Act3 outMlpBackward(const LayerEnv& env, const LayerParams& w, const LayerParams& g, LayerActs& a, const Mat& dy,
                    Mat& dh);
/// Backward of qkvForward: accumulates dWq/dWk/dWv and returns dx = dh + dq Wq^T + ...
Mat qkvBackward(const LayerEnv& env, const LayerParams& w, const LayerParams& g, const LayerActs& a, const Act3& dq,
                const Act3& dk, const Act3& dv, const Mat& dh);

/// Forward/backward of one layer for one micro-batch (local tokens of this CP rank);
/// keeps the activations of forward for backward.
class LayerStep {
 public:
  LayerStep(const LayerEnv& env, Model& model, int layer, const cp::ShardPlan& plan, const cp::CommPlan& comm);
  /// y = h + MLP(h), h = x + OutProj(Attn(QKV(x))). x: [local tokens][hidden].
  Mat forward(const Mat& x);
  /// Given dL/dy, accumulate weight gradients and return dL/dx. Frees the activations.
  Mat backward(const Mat& dy);
  std::int64_t tokens() const { return n_; }
  /// Attention kernel seconds of the last forward + backward on this rank.
  double attnSeconds() const { return attn_seconds_; }
  /// KV communication seconds (incl. waiting for peers) of the last forward + backward.
  double kvCommSeconds() const { return kv_seconds_; }
  /// Bytes of the activations this layer keeps from forward to backward on this rank
  /// (inputs, projections, attention output and LSE, MLP activations, the KV buffer);
  /// 0 after backward. Predicted by model::executorLayerActivationBytes.
  std::int64_t savedBytes() const;

 private:
  LayerEnv env_;
  Model* model_;
  int layer_;
  std::int64_t n_;
  std::unique_ptr<cp::DistributedAttention> attn_;
  LayerActs acts_;  ///< saved activations
  double attn_seconds_ = 0, kv_seconds_ = 0;
};

/// Fill a matrix with deterministic pseudo-random values in [-scale, scale] from
/// (seed, stream, index).
void fillRandom(const Space& space, const Mat& m, std::uint64_t seed, std::uint64_t stream, float scale);
/// Row i of `m` gets the values fillRandom gives row `rows[i]` of a full matrix: a CP
/// rank filling its shard (rows = its packed positions) sees the same values as one rank
/// filling the whole micro-batch.
void fillRandomRows(const Space& space, const Mat& m, std::uint64_t seed, std::uint64_t stream, float scale,
                    const std::vector<std::int64_t>& rows);
/// Key of a document token for fillRandomRows: its row values depend on (document,
/// position in the document) only, so every packing, slicing, pipeline and CP sharding of
/// the same documents sees the same inputs.
inline std::int64_t tokenKey(DocId doc, std::int64_t pos) {
  return static_cast<std::int64_t>((static_cast<std::uint64_t>(doc) << 32) ^ static_cast<std::uint64_t>(pos));
}

}  // namespace wlb::runtime
