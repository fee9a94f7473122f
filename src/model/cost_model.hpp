#pragma once
/// \file cost_model.hpp
/// \brief The one workload cost model (docs/architecture.md, "One cost model") used by packers, shard planners
/// and the simulator: attention and linear FLOPs per phase, and predicted seconds from a
/// kernel/hardware profile (docs/profile-format.md).

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "attention/flops.hpp"
#include "core/deck.hpp"

namespace wlb::model {

enum class Phase : int { Fwd = 0, Bwd = 1 };
inline const char* phaseName(Phase p) {
  return p == Phase::Fwd ? "fwd" : "bwd";
}

/// Query-key pairs of the query range [q0, q0+q) of a document attending causally to its
/// keys from the document start: a piece of q queries over q0 + q keys, whose pairs the
/// kernels' own accounting counts (attention/flops.hpp).
inline double attnPairs(std::int64_t q0, std::int64_t q) {
  return attention::usefulPairs(q, q0 + q);
}

/// Backward/forward FLOP ratios (the attention's, as its kernels count it; a GEMM's
/// backward is 2 GEMMs).
inline constexpr double kAttnBwdFactor = attention::kBackwardFactor;
inline constexpr double kLinearBwdFactor = 2.0;

struct ModelDims {
  std::int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0, layers = 1, vocab = 0, dtype_bytes = 2;
  static ModelDims fromDeck(const ModelConfig& m);
};

/// A 2D table of achieved throughput (GFLOP/s on tile-padded FLOPs) over query length x
/// key length, interpolated bilinearly in log-log space and clamped at the edges.
struct ThroughputTable {
  std::vector<double> q_lens, k_lens;       ///< ascending
  std::vector<std::vector<double>> gflops;  ///< [q][k]
  double at(double q, double k) const;
  bool empty() const { return q_lens.empty(); }
};

/// The linear ops of one layer, named like the executor's trace labels.
enum class LinearOp : int { QkvProj = 0, OutProj = 1, Mlp = 2 };
inline constexpr int kLinearOpCount = 3;
/// "qkv_proj" | "out_proj" | "mlp".
const char* linearOpName(LinearOp op);

/// Deck-shaped linear-op profile (`wlb profile --deck`, profile version 2, key `linear_ops`;
/// docs/profile-format.md): the layer's ops timed as `wlb run` executes them, on one rank,
/// at the per-rank token counts of the deck's micro-batches, for one layer shape. Values
/// are interpolated linearly in (log tokens, log value) and clamped outside the grid; the
/// cost model reads them at one reference token count (CostModel::linearReferenceTokens).
struct LinearOpsTable {
  std::int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0, tp = 1;  ///< shape measured
  std::int64_t vocab = 0;      ///< the LM head's vocabulary in fill_ns (0: not recorded, any matches)
  std::vector<double> tokens;  ///< ascending per-rank token counts
  /// [op][phase][i]: GFLOP/s of the op (its CostModel::linearOpFlops over its time).
  std::array<std::array<std::vector<double>, 2>, kLinearOpCount> gflops;
  /// [phase][i]: ns per token per layer of the layer's work outside the three ops
  /// (allocations, host work between kernels), the executor's unlabelled time.
  std::array<std::vector<double>, 2> elementwise_ns;
  /// [phase][i]: ns per token per micro-batch of the model's ends: the embedding and the
  /// fused loss (final norm, LM head, cross-entropy and their backward) in the forward, the
  /// embedding's backward in the backward (`embed` / `loss` events); the cost model charges
  /// 1/layers of it to each layer.
  std::array<std::vector<double>, 2> fill_ns;
  /// [i]: ns per token per layer of the backward's selective recomputation (the two norms
  /// and the SwiGLU product, `recompute` events); empty in profiles written before it.
  std::vector<double> recompute_ns;
  bool empty() const { return tokens.empty(); }
  /// True when the table was measured at these model dims and TP degree.
  bool matches(const ModelDims& d, std::int64_t tp) const;
  double gflopsAt(LinearOp op, Phase p, double tokens) const;
  double elementwiseNsAt(Phase p, double tokens) const;
  double fillNsAt(Phase p, double tokens) const;
  double recomputeNsAt(double tokens) const;  ///< 0 when not measured
};

/// Multipliers on the profiled throughputs (time = profiled time / factor), key
/// `factors` of a version-2 profile. `wlb profile --deck` sets attn.* from whole per-rank
/// batches of the deck's plans; `wlb calibrate` refits every factor from measured traces.
/// All 1 = as profiled (a version-1 profile).
struct Factors {
  std::array<double, 2> attn{1.0, 1.0};                                                            ///< [phase]
  std::array<std::array<double, 2>, kLinearOpCount> linear{{{1.0, 1.0}, {1.0, 1.0}, {1.0, 1.0}}};  ///< [op][phase]
  double elementwise = 1.0;  ///< elementwise_ns and fill_ns
  /// Keys in file order: attn.fwd, attn.bwd, qkv_proj.fwd, ..., mlp.bwd, elementwise.
  static const std::vector<std::string>& keys();
  /// The factor of a key; std::out_of_range for an unknown key.
  double& at(const std::string& key);
  double at(const std::string& key) const;
  bool linearIsUnit() const;
};

/// Kernel and hardware profile: measured (`wlb profile`) or a GPU description.
struct HardwareProfile {
  std::string name = "analytic";
  std::int64_t tile_q = 64, tile_k = 64;  ///< attention kernel tiles (padding granularity)
  double peak_gflops = 220.0;             ///< per device FP32/BF16 peak
  double linear_gflops = 150.0;           ///< achieved GEMM throughput
  ThroughputTable fwd, bwd;               ///< attention; empty -> analytic curve
  /// Factor on the attention throughput for kernels inside a full step (caches cold after
  /// the layer's GEMMs), where the table was timed on isolated, repeated calls; 1 = as
  /// measured. Calibrated from run traces like linear_gflops (docs/profile-format.md).
  double attention_efficiency = 1.0;
  // Links (GB/s, per direction) and latency for collectives and P2P.
  double tp_bandwidth_gbps = 100.0, cp_bandwidth_gbps = 100.0, pp_bandwidth_gbps = 25.0, dp_bandwidth_gbps = 25.0,
         link_latency_us = 5.0;
  double memory_gb = 80.0;
  /// Speed spread of ranks given equal work (profile key `rank_speed`, fitted by `wlb
  /// calibrate` from a multi-rank trace; 0 = every rank at the profile's speed): `spread`, the
  /// standard deviation of a rank's time over a run relative to the ranks' mean,
  /// `step_spread`, that of its time in one step around its run's mean (the log), and
  /// `task_spread`, that of one layer task around its rank's time in that step. The simulator
  /// draws the slow ranks from them and makes every sync group wait for its slowest member.
  double rank_spread = 0, step_spread = 0, task_spread = 0;
  /// Format version read (1, or 2 with `linear_ops` / `factors`); both load.
  int version = 1;
  /// Deck-shaped linear ops (version 2); empty -> linear_gflops for every op.
  LinearOpsTable linear_ops;
  /// Calibration multipliers (version 2); all 1 by default.
  Factors factors;

  /// Analytic default: efficiency rises with the query length towards peak*0.7.
  static HardwareProfile analytic();
  /// Read a profile JSON file; InputError naming the file and key on bad content.
  static HardwareProfile load(const std::string& path);
  /// The checks and fields of load() on JSON already read; `name` stands for the file in
  /// the errors (`wlb profile --base`'s carried keys are checked this way before timing).
  static HardwareProfile fromJson(const nlohmann::json& j, const std::string& name);
  /// Profile named by the deck ("analytic" or a path, relative paths resolved against
  /// the deck's directory then the working directory), with the deck's link overrides.
  static HardwareProfile fromDeck(const Deck& deck);
  /// The file `hardware.profile` names, found as fromDeck finds it ("" for "analytic" or a
  /// file not found).
  static std::string pathOf(const Deck& deck);
  /// Attention throughput (GFLOP/s on padded FLOPs) for a piece of q queries, k keys.
  double attnGflops(Phase p, double q, double k) const;
};

/// Cost of work on one rank of a TP group (heads and GEMMs divided by tp).
class CostModel {
 public:
  CostModel(const ModelDims& dims, HardwareProfile hw, std::int64_t tp = 1);
  static CostModel fromDeck(const Deck& deck);

  const ModelDims& dims() const { return dims_; }
  const HardwareProfile& hardware() const { return hw_; }
  std::int64_t tp() const { return tp_; }

  /// Attention FLOPs of one layer for queries [q0, q0+q) of a document (keys from the
  /// document start). Forward = 4*pairs*head_dim*heads/tp; backward = 2.5x forward.
  double attnFlops(std::int64_t q0, std::int64_t q, Phase p) const;
  /// Same, counting the tile-padded work a tiled kernel actually visits.
  double attnPaddedFlops(std::int64_t q0, std::int64_t q, Phase p) const;
  /// Predicted seconds of one layer's attention for that piece.
  double attnSeconds(std::int64_t q0, std::int64_t q, Phase p) const;

  /// Linear-op FLOPs of one layer for `tokens` tokens (QKV, out-proj, SwiGLU MLP).
  double linearFlops(std::int64_t tokens, Phase p) const;
  /// Seconds of one layer's linear work for `tokens` tokens on one rank: the three ops
  /// (linearOpSeconds) plus elementwiseSeconds. Without a matching deck-shaped table and
  /// with unit factors this is linearFlops / linear_gflops, as in a version-1 profile.
  double linearSeconds(std::int64_t tokens, Phase p) const;
  /// FLOPs of one linear op (QKV 2h(h+2kv), out-proj 2h^2, MLP 6h*ffn per token, / tp;
  /// backward 2x); the three sum to linearFlops.
  double linearOpFlops(LinearOp op, std::int64_t tokens, Phase p) const;
  /// Seconds of one op: its FLOPs over the deck-shaped table's GFLOP/s at
  /// linearReferenceTokens() (or linear_gflops without a matching table), / its factor.
  double linearOpSeconds(LinearOp op, std::int64_t tokens, Phase p) const;
  /// Seconds of one layer's elementwise work outside the ops (plus 1/layers of the
  /// micro-batch's embedding and loss, fill_ns) from the deck-shaped table at
  /// linearReferenceTokens() per token; 0 without a table.
  double elementwiseSeconds(std::int64_t tokens, Phase p) const;
  /// Seconds one layer's backward spends recomputing what pipeline.recompute = "selective"
  /// dropped, from the table at linearReferenceTokens() (elementwise work: its factor
  /// applies); 0 without a table or where the profile did not measure it.
  double recomputeSeconds(std::int64_t tokens) const;
  /// Whether recomputeSeconds has a measured figure to price (a matching table that has
  /// recompute_ns_per_token), not 0 for want of one.
  bool recomputeTimed() const { return linear_table_ && !hw_.linear_ops.recompute_ns.empty(); }
  /// Whether linear work is timed from a deck-shaped table (its shape matches dims and tp).
  bool linearTableUsed() const { return linear_table_; }
  /// Per-rank micro-batch tokens at which the table's per-token costs are read. Linear work
  /// stays linear in tokens (a packer's per-document W_l sums to its micro-batch's), at the
  /// rate of the micro-batch size the deck runs: fromDeck sets data.context_window / mesh.cp;
  /// otherwise the geometric middle of the table's token range.
  double linearReferenceTokens() const { return linear_ref_tokens_; }
  void setLinearReferenceTokens(double tokens);

  /// Whole-document (segment) workload of one layer, seconds: W_a + W_l.
  double segmentSeconds(std::int64_t length, Phase p) const {
    return attnSeconds(0, length, p) + linearSeconds(length, p);
  }
  /// Fwd+bwd workload of a segment — the packers' W(d).
  double segmentWork(std::int64_t length) const {
    return segmentSeconds(length, Phase::Fwd) + segmentSeconds(length, Phase::Bwd);
  }

  /// Bytes of K and V for `tokens` tokens of one layer on one TP rank.
  double kvBytes(std::int64_t tokens) const;

 private:
  ModelDims dims_;
  HardwareProfile hw_;
  std::int64_t tp_;
  bool linear_table_ = false;  ///< hw_.linear_ops matches dims_ and tp_
  double linear_ref_tokens_ = 0;
};

}  // namespace wlb::model
