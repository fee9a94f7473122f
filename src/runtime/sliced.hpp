#pragma once
/// \file sliced.hpp
/// \brief SlimPack plans on one pipeline stage (docs/runtime.md, "Sliced execution"): the
/// forward of a forward MicroPack and the backward of a backward MicroPack (the asymmetric
/// partition) through the stage's layers, with a per-sample KV cache.
///
/// Contract (cp = 1; TP splits heads as LayerStep does; RoPE positions continue over a
/// document's slices, tokens.hpp):
/// * Segments are numbered in the replica's forward order (pp::ReplicaSlices). A slice
///   (q_offset > 0) continues the segments of its document that end where it starts: its
///   *chain*, which holds the document tokens [offset - q_offset, offset), all in this step.
/// * Forward of MicroPack k, per layer: QKV of its tokens; a slice's keys are its chain's
///   K/V followed by its own (the KV cache is the chain's saved K and V: nothing is kept
///   twice); attention; out-projection and MLP. The layer's saved activations are cut into
///   runs of segments at the backward cut points, so each backward MicroPack frees exactly
///   its own slices. A segment that a later slice continues also keeps a zeroed dK/dV
///   accumulator of its length from its forward to its backward.
/// * Backward of MicroPack j, per layer: its runs concatenated; MLP and out-projection
///   backward; attention backward over the forward's key layout. Slices are finished in
///   decreasing offset: a slice's dK/dV is its own rows of the key gradient plus its
///   accumulator (what its later slices sent back), and the rows of its prefix are added to
///   its chain's accumulators; then the QKV backward. PackFlow runs a sample's slices
///   last-in-first-out (pp::packFlowDeps), so every later slice has finished by then.
/// * heldBytes(): per layer, model::executorLayerActivationBytes(tokens, kv_tokens) with
///   kv_tokens = the tokens of continued segments (their accumulators), summed over the
///   saved forward MicroPacks, as the simulator's `--as-run` memory model predicts it.

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "pp/schedule.hpp"
#include "runtime/layer.hpp"
#include "runtime/tokens.hpp"

namespace wlb::runtime {

class SlicedStage {
 public:
  /// `slices`: the replica's slices (outlives the object). InputError when a slice's chain
  /// is not in the step.
  SlicedStage(const LayerEnv& env, const Llama& model, const pp::ReplicaSlices& slices);

  /// Forward of MicroPack k through global layer l: x [tokens of k][hidden] -> y; `pos`:
  /// the rows' RoPE positions.
  Mat forward(int k, int l, const Mat& x, const IVec& pos);
  /// Backward of backward MicroPack j through layer l: dL/dy -> dL/dx; frees j's slices.
  Mat backward(int j, int l, const Mat& dy, const IVec& pos);

  std::int64_t fwdTokens(int k) const { return tokens(slices_->fwd_cuts, k); }
  std::int64_t bwdTokens(int j) const { return tokens(slices_->bwd_cuts, j); }
  /// The rows (tokens.hpp) of forward (bwd = false) or backward MicroPack k.
  std::vector<TokenRef> rows(bool bwd, int k) const;
  /// First row of segment i in its forward / backward MicroPack.
  std::int64_t fwdRow(std::int64_t i) const { return fwd_row_[static_cast<std::size_t>(i)]; }
  std::int64_t bwdRow(std::int64_t i) const { return bwd_row_[static_cast<std::size_t>(i)]; }
  const pp::ReplicaSlices& slices() const { return *slices_; }
  /// Bytes kept from forwards for backwards (see the file comment).
  std::int64_t heldBytes() const { return held_; }
  /// Attention kernel seconds of the last forward / backward call.
  double attnSeconds() const { return attn_seconds_; }
  /// Nothing saved any more (every backward ran).
  bool empty() const;

 private:
  template <class T>
  struct Run {
    std::int64_t s0 = 0, s1 = 0;  ///< segments [s0, s1)
    LayerActsT<T> acts;
    std::int64_t bytes = 0;
  };
  template <class T>
  struct Saved {
    std::map<std::int64_t, Run<T>> runs;                ///< by first segment
    std::map<std::int64_t, std::pair<Act3, Act3>> acc;  ///< segment -> dK, dV accumulators (FP32)
  };
  template <class T>
  std::map<int, Saved<T>>& saved();
  template <class T>
  const std::map<int, Saved<T>>& saved() const;
  template <class T>
  Mat forwardT(int k, int l, const Mat& x, const IVec& pos);
  template <class T>
  Mat backwardT(int j, int l, const Mat& dy, const IVec& pos);
  /// The keys of a unit's segments: where each segment's K/V rows come from and the pieces.
  struct Keys {
    std::vector<attention::PieceRange> pieces;
    std::int64_t rows = 0;
    bool own = true;  ///< no slice: the unit's own K/V are the keys
  };
  std::int64_t tokens(const std::vector<std::int64_t>& cuts, int k) const;
  /// Useful attention FLOPs of unit k (cut points `cuts`): each slice against its key prefix.
  double attnFlops(const std::vector<std::int64_t>& cuts, int k, model::Phase phase) const;
  Keys keyLayout(const std::vector<std::int64_t>& cuts, int k) const;
  /// K (or V) rows of segment i at layer l: from `cur` (the forward MicroPack being run,
  /// segments [cur_s0, cur_s1)) when it holds i, else from the saved runs.
  template <class T>
  Act3T<T> kvRows(int l, std::int64_t i, bool value, const LayerActsT<T>* cur, std::int64_t cur_s0,
                  std::int64_t cur_s1) const;
  /// The key buffers of unit k (cut points `cuts`) at layer l; `cur` as for kvRows.
  template <class T>
  void buildKv(const std::vector<std::int64_t>& cuts, int k, int l, const Keys& keys, const LayerActsT<T>* cur,
               Act3T<T>& kbuf, Act3T<T>& vbuf) const;

  LayerEnv env_;
  const Llama* model_;
  const pp::ReplicaSlices* slices_;
  std::vector<std::int64_t> fwd_row_, bwd_row_;   ///< per segment: first row in its MicroPack
  std::vector<std::vector<std::int64_t>> chain_;  ///< per segment: the chain, by offset
  std::map<int, Saved<float>> saved_;             ///< per global layer
  std::map<int, Saved<bf16>> bsaved_;             ///< the same with BF16 storage
  std::int64_t held_ = 0;
  double attn_seconds_ = 0;
};

}  // namespace wlb::runtime
