#pragma once
/// \file sliced.hpp
/// \brief SlimPack plans on one pipeline stage (docs/runtime.md, "Sliced execution"): the
/// forward of a forward MicroPack and the backward of a backward MicroPack (the asymmetric
/// partition) through the stage's layers, with a per-sample KV cache.
///
/// Contract (TP splits heads as LayerStep does; RoPE positions continue over a document's
/// slices, tokens.hpp; the CP layout is pp::SliceShards):
/// * Segments are numbered in the replica's forward order (pp::ReplicaSlices). A slice
///   (q_offset > 0) continues the segments of its document that end where it starts: its
///   *chain*, which holds the document tokens [offset - q_offset, offset), all in this step.
/// * A unit's rows on this rank are its pieces of the unit's segments (pp::SliceShards);
///   at cp = 1 every segment is whole.
/// * Forward of MicroPack k, per layer: QKV of its rows; with cp > 1 the MicroPack's K/V are
///   all-gathered over the CP group into its packed rows. A piece's keys are its segment's
///   chain followed by the segment's tokens up to the piece's last query; one key block per
///   segment serves all the rank's pieces of it. The chain's K/V come from the MicroPack
///   itself or, at cp = 1, from the saved K and V (nothing is kept twice); with cp > 1 every
///   rank keeps the whole K/V of each continued segment (the KV cache) until that segment's
///   backward. Attention; out-projection and MLP. The saved activations are cut into runs of
///   segments at the backward cut points, so each backward MicroPack frees exactly its own
///   slices. A continued segment also keeps a zeroed dK/dV accumulator of its length from
///   its forward to its backward.
/// * Backward of MicroPack j, per layer: its runs concatenated; MLP and out-projection
///   backward; with cp > 1 the MicroPack's K/V gathered again; attention backward over the
///   forward's key layout. The rows of each key block's chain are added to the chain's
///   accumulators; the segment's own rows, plus its accumulator, form the key gradient of
///   the MicroPack's packed rows, which (cp > 1) a reduce-scatter over the CP group sums
///   into each rank's own rows; then the QKV backward. PackFlow runs a sample's slices
///   last-in-first-out (pp::packFlowDeps), so every later slice has finished by then.
/// * heldBytes(): per layer, model::executorLayerActivationBytes(tokens, kv_tokens) with
///   kv_tokens = the tokens of continued segments (their FP32 accumulators and, cp > 1,
///   their cached K/V), summed over the saved forward MicroPacks, as the simulator's
///   `--as-run` memory model predicts it.
/// * Trace: the gather and the key blocks' assembly (forward and backward), and the key
///   gradient's accumulation and reduce-scatter, are `kv_allgather` events at every cp
///   (0 bytes at cp = 1, as LayerStep's copy of its own K/V), so no KV work is unrecorded.

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "pp/schedule.hpp"
#include "pp/slice_shards.hpp"
#include "runtime/layer.hpp"
#include "runtime/row_moves.hpp"
#include "runtime/tokens.hpp"

namespace wlb::runtime {

class SlicedStage {
 public:
  /// `slices`: the replica's slices, `shards` their layout over env.cp_comm (both outlive
  /// the object). InputError when a slice's chain is not in the step.
  SlicedStage(const LayerEnv& env, const Llama& model, const pp::ReplicaSlices& slices, const pp::SliceShards& shards);

  /// Forward of MicroPack k through global layer l: x [tokens of k][hidden] -> y; `pos`:
  /// the rows' RoPE positions.
  Mat forward(int k, int l, const Mat& x, const IVec& pos);
  /// Backward of backward MicroPack j through layer l: dL/dy -> dL/dx; frees j's slices.
  Mat backward(int j, int l, const Mat& dy, const IVec& pos);

  /// This rank's rows of forward MicroPack k / backward MicroPack j.
  std::int64_t fwdTokens(int k) const { return shards_->unitRows(slices_->fwd_cuts, k, rank_); }
  std::int64_t bwdTokens(int j) const { return shards_->unitRows(slices_->bwd_cuts, j, rank_); }
  /// Tokens of the forward (bwd = false) or backward MicroPack k over the CP group (the same
  /// on every rank: 0 = an empty unit that every rank skips).
  std::int64_t unitTokens(bool bwd, int k) const { return tokens(bwd ? slices_->bwd_cuts : slices_->fwd_cuts, k); }
  /// This rank's rows (tokens.hpp) of forward (bwd = false) or backward MicroPack k.
  std::vector<TokenRef> rows(bool bwd, int k) const;
  /// First row of segment i in this rank's rows of its forward / backward MicroPack, and
  /// its rows on this rank.
  std::int64_t fwdRow(std::int64_t i) const { return fwd_row_[static_cast<std::size_t>(i)]; }
  std::int64_t bwdRow(std::int64_t i) const { return bwd_row_[static_cast<std::size_t>(i)]; }
  std::int64_t ownRows(std::int64_t i) const {
    return shards_->rows[static_cast<std::size_t>(rank_)][static_cast<std::size_t>(i)];
  }
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
    std::map<std::int64_t, Run<T>> runs;                          ///< by first segment
    std::map<std::int64_t, std::pair<Act3, Act3>> acc;            ///< segment -> dK, dV accumulators (FP32)
    std::map<std::int64_t, std::pair<Act3T<T>, Act3T<T>>> cache;  ///< cp > 1: segment -> its whole K, V
  };
  template <class T>
  std::map<int, Saved<T>>& saved();
  template <class T>
  const std::map<int, Saved<T>>& saved() const;
  template <class T>
  Mat forwardT(int k, int l, const Mat& x, const IVec& pos);
  template <class T>
  Mat backwardT(int j, int l, const Mat& dy, const IVec& pos);
  /// A unit: forward (bwd = false) or backward MicroPack k.
  struct Unit {
    bool bwd = false;
    int k = 0;
    std::int64_t s0 = 0, s1 = 0;                        ///< segments [s0, s1)
    std::int64_t rows = 0;                              ///< this rank's
    std::int64_t total = 0;                             ///< the group's (packed rows)
    const std::vector<std::int64_t>* local = nullptr;   ///< per segment: first row on this rank
    const std::vector<std::int64_t>* packed = nullptr;  ///< per segment: first packed row
  };
  Unit unit(bool bwd, int k) const;
  /// The keys of a unit on this rank: one block per segment with queries here (its chain,
  /// then the segment's packed rows [0, len)), and the pieces reading them.
  struct Keys {
    struct Block {
      std::int64_t seg = 0, len = 0, k_begin = 0;
    };
    std::vector<attention::PieceRange> pieces;
    std::vector<Block> blocks;
    std::int64_t rows = 0;
    bool own = true;  ///< no slice: the unit's packed K/V are the keys
  };
  Keys keyLayout(const Unit& u) const;
  std::int64_t tokens(const std::vector<std::int64_t>& cuts, int k) const;
  /// Useful attention FLOPs of this rank's pieces of unit u.
  double attnFlops(const Unit& u, model::Phase phase) const;
  /// cp > 1: the unit's K and V over the group in packed order (an all-gather of every
  /// rank's rows); cp = 1: the rows themselves.
  template <class T>
  void packedKv(const Unit& u, const Act3T<T>& k, const Act3T<T>& v, Act3T<T>& pk, Act3T<T>& pv);
  /// cp > 1: the sum over the group of the packed key gradient, each rank's own rows.
  Act3 ownKvGrad(const Unit& u, const Act3& dpacked);
  /// Bytes this rank receives in the all-gather of unit u's K and V.
  template <class T>
  double gatherBytes(const Unit& u) const {
    const LayerShape sh = LayerShape::of(model_->config());
    return 2.0 * sizeof(T) * static_cast<double>((u.total - u.rows) * sh.kv_heads * sh.head_dim);
  }
  /// K (or V) rows of segment c at layer l: from the unit's packed rows `p` when the unit
  /// holds c, else from the saved runs (cp = 1) or the KV cache (cp > 1).
  template <class T>
  Act3T<T> chainRows(int l, std::int64_t c, bool value, const Unit& u, const Act3T<T>& p) const;
  /// The key buffers of unit u at layer l from its packed K/V.
  template <class T>
  void buildKv(const Unit& u, int l, const Keys& keys, const Act3T<T>& pk, const Act3T<T>& pv, Act3T<T>& kbuf,
               Act3T<T>& vbuf) const;
  /// The gather map of a unit (cp > 1), built once: packed row -> gathered row, and the
  /// rows of every rank.
  struct GatherMap {
    rows::IdxView index;
    std::vector<std::int64_t> counts, displs;
  };
  const GatherMap& gatherMap(const Unit& u);

  LayerEnv env_;
  const Llama* model_;
  const pp::ReplicaSlices* slices_;
  const pp::SliceShards* shards_;
  int rank_ = 0, cp_ = 1;
  std::unique_ptr<parallel::GroupComm> own_group_;
  parallel::GroupComm* group_ = nullptr;
  std::vector<std::int64_t> fwd_row_, bwd_row_;        ///< per segment: first row on this rank in its MicroPack
  std::vector<std::int64_t> fwd_packed_, bwd_packed_;  ///< per segment: first packed row in its MicroPack
  std::vector<std::vector<std::int64_t>> chain_;       ///< per segment: the chain, by offset
  std::map<std::pair<bool, int>, GatherMap> gather_;
  std::map<int, Saved<float>> saved_;  ///< per global layer
  std::map<int, Saved<bf16>> bsaved_;  ///< the same with BF16 storage
  std::int64_t held_ = 0;
  double attn_seconds_ = 0;
};

}  // namespace wlb::runtime
