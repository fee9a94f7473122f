#pragma once
/// \file llama.hpp
/// \brief A small LLaMA-style language model that really trains (docs/training.md):
/// token embedding; per layer RMSNorm -> Q/K/V -> RoPE (positions restart at every
/// segment) -> varlen causal GQA attention (attention::forward/backward) -> out-proj ->
/// residual, RMSNorm -> SwiGLU MLP -> residual; final RMSNorm, LM head, cross-entropy over
/// the document-masked sequence. Full backward pass; AdamW with warm-up + cosine decay and
/// global gradient-norm clipping. FP32, every tensor a Kokkos View on the default
/// execution space, every op a labelled kernel (or runtime::gemm) on the instance passed in.
/// Under pipeline parallelism a rank holds one stage (StagePass): its block of layers, the
/// embedding on the first stage, the final norm and LM head on the last.

#include <Kokkos_Core.hpp>

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/gemm.hpp"

namespace wlb::parallel {
class GroupComm;
}
namespace wlb::trace {
class Recorder;
}

namespace wlb::train {

using runtime::Mat;
using runtime::Mem;
using runtime::Space;
using Vec = Kokkos::View<float*, Mem>;
using IVec = Kokkos::View<std::int32_t*, Mem>;
using runtime::Act3;
using Lse = Kokkos::View<float**, Kokkos::LayoutRight, Mem>;  ///< [tokens][heads]

struct LlamaConfig {
  int vocab = 256;
  int hidden = 64;
  int heads = 4;
  int kv_heads = 4;  ///< GQA: divides heads
  int ffn = 172;
  int layers = 2;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  /// Tensor parallelism (Megatron-style): this rank holds heads / tp query heads,
  /// kv_heads / tp KV heads and ffn / tp MLP columns (slice tp_rank); embedding, norms and
  /// LM head are replicated.
  int tp = 1, tp_rank = 0;
  /// Pipeline parallelism: this rank holds stage pp_rank of pp, the layers
  /// pp::layerBlock(layers, pp, pp_rank) gives (the executor's split).
  int pp = 1, pp_rank = 0;
  bool firstStage() const { return pp_rank == 0; }
  bool lastStage() const { return pp_rank == pp - 1; }
  int headDim() const { return hidden / heads; }
  int localHeads() const { return heads / tp; }
  int localKvHeads() const { return kv_heads / tp; }
  int localFfn() const { return ffn / tp; }
  /// std::invalid_argument unless hidden = heads * head_dim with an even head_dim,
  /// kv_heads divides heads, tp divides heads, kv_heads and ffn, and pp <= layers.
  void validate() const;
};

/// One packed micro-batch: tokens of independent segments back to back. Positions restart
/// at 0 in every segment; target of token i = token i+1 of the same segment, none (-1)
/// for the last token of a segment (no loss across a document boundary).
struct TokenBatch {
  IVec tokens, targets, positions;
  std::vector<std::int64_t> segment_lengths;  ///< host copy (the attention pieces); empty for a CP shard
  std::int64_t n = 0;                         ///< tokens
  std::int64_t predicted = 0;                 ///< tokens with a target
  std::int64_t max_position = -1;             ///< largest RoPE position (-1: no tokens)
  /// From the segments' tokens on the host (each non-empty; tokens < vocab, else
  /// std::invalid_argument).
  static TokenBatch fromSegments(const std::vector<std::vector<std::int32_t>>& segments, int vocab);
  /// Any tokens with their targets (-1: none) and RoPE positions, e.g. one CP rank's share
  /// of a micro-batch in its local order; the attention over them is an AttentionOp's.
  /// Tokens and targets must be < vocab (else std::invalid_argument).
  static TokenBatch fromTokens(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& targets,
                               const std::vector<std::int32_t>& positions, int vocab);
};

/// The attention of every layer of one forward/backward (Llama::run): the default is the
/// varlen kernels over the batch's segments on this rank; `wlb train` under context
/// parallelism passes one that runs cp::DistributedAttention over the CP group (the batch
/// then holds this rank's tokens only, and the op is collective over the group: it is
/// called for every layer even when the rank holds no token of the micro-batch).
class AttentionOp {
 public:
  virtual ~AttentionOp() = default;
  /// o and lse are overwritten.
  virtual void forward(const Space& space, int layer, Act3 q, Act3 k, Act3 v, Act3 o, Lse lse) = 0;
  /// Called in reverse layer order after every forward; dq, dk, dv arrive zeroed and
  /// receive the gradients.
  virtual void backward(const Space& space, int layer, Act3 q, Act3 k, Act3 v, Act3 o, Lse lse, Act3 d_o, Act3 dq,
                        Act3 dk, Act3 dv) = 0;
};

/// Parameter tensors of one layer (views into the flat buffers).
struct LlamaLayer {
  Vec norm1, norm2;  ///< RMSNorm gains [hidden]
  Mat wq, wk, wv;    ///< [hidden][q / kv width]
  Mat wo;            ///< [q width][hidden]
  Mat w1, w3;        ///< [hidden][ffn]
  Mat w2;            ///< [ffn][hidden]
};

/// This rank's parameters: its stage's layers (layers[i] is global layer first_layer + i);
/// embed only on the first stage, norm_f and head only on the last (empty views elsewhere).
struct LlamaParams {
  Mat embed;  ///< [vocab][hidden]
  std::vector<LlamaLayer> layers;
  Vec norm_f;  ///< [hidden]
  Mat head;    ///< [hidden][vocab]
};

class Llama;

/// One micro-batch through this rank's pipeline stage: forward keeps what backward needs.
/// The first stage embeds the tokens, the last computes the cross-entropy (its dlogits,
/// scaled by loss_scale, when forward is asked to keep them). Llama::run is a StagePass on
/// a one-stage model; `wlb train` with mesh.pp > 1 moves forward's output and backward's
/// input gradient between the stages. The batch and the attention op outlive the pass.
class StagePass {
 public:
  StagePass(Llama& model, const Space& space, const TokenBatch& batch, AttentionOp* attn);
  ~StagePass();
  StagePass(const StagePass&) = delete;
  StagePass& operator=(const StagePass&) = delete;
  /// x: the previous stage's output [n][hidden] (ignored on the first stage). Returns this
  /// stage's output, or an empty view on the last stage, whose loss() it sets.
  Mat forward(Mat x, bool backward, float loss_scale);
  /// Sum of the cross-entropies of the batch's predicted tokens (last stage; else 0).
  double loss() const;
  /// dy: the gradient of this stage's output (ignored on the last stage). Accumulates the
  /// stage's weight gradients; returns the gradient of its input (empty on the first stage).
  Mat backward(Mat dy);
  /// Public only because nvcc's extended device lambdas may not live in a private type.
  struct State;

 private:
  std::unique_ptr<State> s_;
};

/// A named tensor in the flat buffer (for tests, checkpoints and weight decay).
struct TensorInfo {
  std::string name;
  std::int64_t offset = 0, size = 0;  ///< this rank's part (its TP slice)
  bool decay = true;                  ///< AdamW weight decay applies (matrices; not norm gains)
  /// Tensor parallelism: 0 replicated, 1 this rank holds a block of columns, 2 a block of
  /// rows of the [rows][cols] tensor (rows, cols: the whole tensor's).
  int slice = 0;
  std::int64_t rows = 0, cols = 0;
  int index = 0;  ///< position in the whole model's tensor list (its initialisation stream)
};

class Llama {
 public:
  /// Weights from a counter-based hash of (seed, tensor): embedding uniform in +-1,
  /// projections +-1/sqrt(fan_in) (out-proj and W2 further / sqrt(2 layers)), gains 1.
  /// With cfg.tp > 1 a rank holds its slices of the same weights, and `tp` (the TP group,
  /// cfg.tp ranks in tp_rank order) sums the partial outputs of the out-projection and W2
  /// and the partial input gradients of the QKV and W1/W3 projections.
  /// With cfg.pp > 1 the rank holds stage cfg.pp_rank's tensors, with the same numbers as
  /// in the one-stage model, and `pp` (the pipeline group, ranks in stage order) sums the
  /// gradient norm's squares.
  Llama(const LlamaConfig& cfg, std::uint64_t seed, parallel::GroupComm* tp = nullptr, MPI_Comm pp = MPI_COMM_NULL);
  /// The tensors of cfg's stage and TP rank, offsets in its flat buffer (what a Llama of
  /// cfg holds; the checkpoint sizes every stage with it).
  static std::vector<TensorInfo> layout(const LlamaConfig& cfg);
  parallel::GroupComm* tpGroup() const { return tp_; }
  MPI_Comm ppComm() const { return pp_; }
  /// Global index of this stage's first layer.
  int firstLayer() const { return first_layer_; }
  /// Record the TP sums as `tp_allreduce` events (null: none; the recorder's step and
  /// micro-batch context are kept, layer and phase set per sum).
  void setRecorder(trace::Recorder* rec) { rec_ = rec; }
  const LlamaConfig& config() const { return cfg_; }
  std::int64_t paramCount() const { return static_cast<std::int64_t>(w_buf_.extent(0)); }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  Vec weights() const { return w_buf_; }
  Vec grads() const { return g_buf_; }
  const LlamaParams& params() const { return w_; }
  void zeroGrads(const Space& space);

  /// Forward + backward of one micro-batch: ACCUMULATES d(loss_scale * sum of CE)/dw into
  /// grads(); returns the sum of the cross-entropies of its predicted tokens (nats).
  /// `attn`: null -> the varlen kernels over batch.segment_lengths.
  double forwardBackward(const Space& space, const TokenBatch& batch, float loss_scale, AttentionOp* attn = nullptr);
  /// Sum of the cross-entropies of the predicted tokens (no gradients).
  double lossSum(const Space& space, const TokenBatch& batch);
  /// What both of the above run. Public only because nvcc's extended device lambdas may
  /// not live in a private member function.
  double run(const Space& space, const TokenBatch& batch, bool backward, float loss_scale, AttentionOp* attn = nullptr);

 private:
  friend class StagePass;
  LlamaConfig cfg_;
  parallel::GroupComm* tp_ = nullptr;
  MPI_Comm pp_ = MPI_COMM_NULL;
  int first_layer_ = 0;
  trace::Recorder* rec_ = nullptr;
  Vec w_buf_, g_buf_;
  LlamaParams w_, g_;
  std::vector<TensorInfo> tensors_;
};

struct AdamWConfig {
  float lr = 1e-3f;
  float min_lr_ratio = 0.1f;  ///< cosine decays to lr * min_lr_ratio
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;  ///< end of the cosine
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0.1f;
  float clip = 1.0f;  ///< global gradient-norm limit; 0 = no clipping
  /// Learning rate of step `step` (0-based): linear warm-up to lr over warmup_steps, then
  /// cosine to lr * min_lr_ratio at total_steps (held there after).
  double lrAt(std::int64_t step) const;
};

/// AdamW (decoupled weight decay, bias-corrected moments) over a model's flat buffers.
class AdamW {
 public:
  AdamW(const Llama& model, AdamWConfig cfg);
  /// One update with the model's current gradients; `step` is 0-based. Returns the
  /// gradient norm before clipping (of the whole model: under TP the slices' squares
  /// summed over the TP group, the replicated tensors counted once; under PP the stages'
  /// squares summed over the pipeline group).
  double step(const Space& space, Llama& model, std::int64_t step);
  Vec m() const { return m_; }
  Vec v() const { return v_; }
  const AdamWConfig& config() const { return cfg_; }

 private:
  AdamWConfig cfg_;
  Vec m_, v_;
  Kokkos::View<float*, Mem> decay_;   ///< 1 where weight decay applies, else 0
  Kokkos::View<float*, Mem> sliced_;  ///< TP: 1 in TP-sliced tensors, else 0 (empty without TP)
};

}  // namespace wlb::train
