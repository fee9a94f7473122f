#pragma once
/// \file llama.hpp
/// \brief The parameters of the one model that `wlb run` measures and `wlb train` trains
/// (docs/runtime.md, "The model"): a LLaMA-style decoder — token embedding; per layer
/// RMSNorm, Q/K/V, RoPE restarting at every document, causal GQA attention, out-projection,
/// residual, RMSNorm, SwiGLU MLP, residual; final RMSNorm, untied LM head,
/// document-masked cross-entropy. The layer's ops are in layer.hpp, the embedding and the
/// loss in head.hpp, the walk of a pipeline stage's schedule in pipeline.hpp.
///
/// Contract:
/// * A rank holds the tensors of its pipeline stage and TP slice: the layers of its virtual
///   stages c*pp + stage (pp::layerBlock, one block per chunk), the embedding on stage 0
///   (virtual stage 0), the final norm and head on stage pp - 1 (the last virtual stage).
///   Heads, KV heads (whole GQA groups) and MLP columns are split over TP (Megatron style:
///   Wq/Wk/Wv/W1/W3 by columns, Wo/W2 by rows); norms, embedding and head are replicated.
/// * Weights come from a counter-based hash of (seed, the tensor's index in the whole
///   model): every mesh, pipeline split and TP slicing starts from the same numbers.
/// * Weights and gradients are two flat FP32 buffers (the gradient buffer is what the
///   DP x CP all-reduce sums, the checkpoint stores, the optimizer walks). With BF16
///   storage (run.precision = "bf16") a third flat buffer holds the working copy the
///   kernels read: the FP32 master weights rounded to BF16, refreshed by refreshWorking()
///   whenever the masters change (initialisation, optimizer step, checkpoint load).

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "core/deck.hpp"
#include "model/cost_model.hpp"
#include "runtime/gemm.hpp"

namespace wlb::runtime {

using Vec = Kokkos::View<float*, Mem>;
using IVec = Kokkos::View<std::int32_t*, Mem>;

/// The model's dimensions and this rank's place in the mesh.
struct LlamaConfig {
  int vocab = 256;
  int hidden = 64;
  int heads = 4;
  int kv_heads = 4;  ///< GQA: divides heads
  int ffn = 172;
  int layers = 2;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  int tp = 1, tp_rank = 0;
  /// Pipeline stages, this rank's stage, and model chunks per stage (interleaved 1F1B).
  int pp = 1, stage = 0, chunks = 1;
  int headDim() const { return hidden / heads; }
  int localHeads() const { return heads / tp; }
  int localKvHeads() const { return kv_heads / tp; }
  int localFfn() const { return ffn / tp; }
  bool holdsEmbedding() const { return stage == 0; }
  bool holdsHead() const { return stage == pp - 1; }
  /// Global ids of this stage's layers, ascending (its chunks' blocks).
  std::vector<int> layerIds() const;
  /// From the deck's [model] (and train.rope_theta) for this rank; InputError naming the
  /// keys when the shape cannot be built (validate()'s conditions).
  static LlamaConfig fromDeck(const Deck& deck, int tp, int tp_rank, int pp, int stage, int chunks);
  /// The whole model of `d` (head_dim = hidden / heads) on TP rank 0 of `tp`, one stage.
  static LlamaConfig of(const model::ModelDims& d, int tp = 1);
  /// The cost model's dims of this model (the whole model's, not this rank's slice).
  model::ModelDims dims() const;
  /// std::invalid_argument unless hidden = heads * an even head_dim, kv_heads divides
  /// heads, tp divides heads, kv_heads and ffn, and every virtual stage has a layer.
  void validate() const;
};

/// Global ids of the layers of `stage`: the blocks of virtual stages c*stages + stage.
std::vector<int> stageLayers(int layers, int stages, int chunks, int stage);

/// Parameter tensors of one layer (views into a flat buffer), matrices of storage type T:
/// FP32 for the master weights and gradients, BF16 for the working copy (whose norm gains
/// are the masters': the norms compute in FP32).
template <class T>
struct LayerParamsT {
  Vec norm1, norm2;    ///< RMSNorm gains [hidden]
  MatT<T> wq, wk, wv;  ///< [hidden][q / kv width]
  MatT<T> wo;          ///< [q width][hidden]
  MatT<T> w1, w3;      ///< [hidden][ffn]
  MatT<T> w2;          ///< [ffn][hidden]
};
using LayerParams = LayerParamsT<float>;

/// A named tensor in the flat buffer (checkpoints, weight decay, tests).
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

/// Where element i of a TP rank's slice of a tensor sits in the whole row-major tensor: the
/// one statement of the TP slicing rule, for the initialisation (a slice holds the same
/// numbers as its block of the whole tensor) and the whole-tensor gradient gather.
struct SliceIndex {
  bool by_cols = false;  ///< TensorInfo::slice == 1: a block of columns of every row
  std::int64_t cols = 0, local_cols = 0;
  std::int64_t first = 0;  ///< the slice's first column (by_cols) or element
  SliceIndex(const TensorInfo& t, int tp_rank)
      : by_cols(t.slice == 1),
        cols(t.cols),
        local_cols(by_cols ? t.size / t.rows : t.cols),
        first(t.slice == 0 ? 0
              : by_cols    ? tp_rank * local_cols
                           : tp_rank * t.size) {}
  KOKKOS_INLINE_FUNCTION std::int64_t operator()(std::int64_t i) const {
    return by_cols ? (i / local_cols) * cols + first + i % local_cols : first + i;
  }
};

class Llama {
 public:
  /// Weights from (seed, tensor index): embedding uniform in +-1, projections
  /// +-1/sqrt(fan_in) (Wo and W2 further / sqrt(2 layers): residual branches add up), gains 1.
  /// `working`: Bf16 keeps a BF16 working copy of the weights (other values: none).
  Llama(const LlamaConfig& cfg, std::uint64_t seed, Precision working = Precision::Fp32);
  /// The tensors of cfg's stage and TP rank, with their offsets in its flat buffer.
  static std::vector<TensorInfo> layout(const LlamaConfig& cfg);
  const LlamaConfig& config() const { return cfg_; }
  const std::vector<int>& layerIds() const { return ids_; }
  bool holds(int layer) const;
  /// Weights / gradients of global layer `l` (held by this rank).
  const LayerParams& weights(int l) const { return w_layers_[slot(l)]; }
  const LayerParams& grads(int l) const { return g_layers_[slot(l)]; }
  /// The weights the kernels read at storage type T: the masters (float) or the BF16
  /// working copy (bf16; needs a model built with working = Bf16).
  template <class T>
  const LayerParamsT<T>& working(int l) const {
    if constexpr (std::is_same_v<T, bf16>)
      return b_layers_.at(slot(l));
    else
      return w_layers_[slot(l)];
  }
  template <class T>
  MatT<T> embedWorking() const {
    if constexpr (std::is_same_v<T, bf16>)
      return b_embed_;
    else
      return w_embed_;
  }
  template <class T>
  MatT<T> headWorking() const {
    if constexpr (std::is_same_v<T, bf16>)
      return b_head_;
    else
      return w_head_;
  }
  /// Whether a BF16 working copy is kept.
  bool hasWorkingCopy() const { return bf16_; }
  /// Round the masters into the working copy (no-op without one). Call after every change
  /// of the masters.
  void refreshWorking(const Space& space);
  /// Stage 0: [vocab][hidden]; last stage: gain [hidden] and head [hidden][vocab].
  Mat embed() const { return w_embed_; }
  Mat embedGrad() const { return g_embed_; }
  Vec normF() const { return w_norm_f_; }
  Vec normFGrad() const { return g_norm_f_; }
  Mat head() const { return w_head_; }
  Mat headGrad() const { return g_head_; }
  std::int64_t paramCount() const { return static_cast<std::int64_t>(w_buf_.extent(0)); }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  Vec weights() const { return w_buf_; }
  Vec grads() const { return g_buf_; }
  void zeroGrads(const Space& space);

 private:
  std::size_t slot(int l) const;
  /// Views of the tensors of a flat buffer in layout order: matrices of element type E at
  /// `base`, norm gains (always FP32) at `gains` (the same buffer, or the masters for the
  /// BF16 working copy).
  template <class E>
  void viewTensors(E* base, float* gains, MatT<E>& embed, std::vector<LayerParamsT<E>>& layers, Vec& norm_f,
                   MatT<E>& head) const;
  LlamaConfig cfg_;
  std::vector<int> ids_;
  Vec w_buf_, g_buf_;
  std::vector<LayerParams> w_layers_, g_layers_;
  Mat w_embed_, g_embed_, w_head_, g_head_;
  bool bf16_ = false;
  Kokkos::View<bf16*, Mem> b_buf_;
  std::vector<LayerParamsT<bf16>> b_layers_;
  BMat b_embed_, b_head_;
  Vec w_norm_f_, g_norm_f_;
  std::vector<TensorInfo> tensors_;
};

/// The splitmix64 finaliser: the counter-based hash behind the weights (fillRandom) and the
/// synthetic token ids (tokens.hpp), on the host and in kernels.
KOKKOS_INLINE_FUNCTION std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// Fill a matrix with deterministic pseudo-random values in [-scale, scale] from
/// (seed, stream, index).
void fillRandom(const Space& space, const Mat& m, std::uint64_t seed, std::uint64_t stream, float scale);

}  // namespace wlb::runtime
