#pragma once
/// \file cost_model.hpp
/// \brief The one workload cost model (docs/architecture.md, "One cost model") used by packers, shard planners
/// and the simulator: attention and linear FLOPs per phase, and predicted seconds from a
/// kernel/hardware profile (docs/profile-format.md).

#include <cstdint>
#include <string>
#include <vector>

#include "core/deck.hpp"

namespace wlb::model {

enum class Phase : int { Fwd = 0, Bwd = 1 };
inline const char* phaseName(Phase p) { return p == Phase::Fwd ? "fwd" : "bwd"; }

/// Query-key pairs of the query range [q0, q0+q) of a document attending causally to its
/// keys from the document start: q*q0 + q*(q+1)/2.
inline double attnPairs(std::int64_t q0, std::int64_t q) {
  const double qd = static_cast<double>(q);
  return qd * static_cast<double>(q0) + qd * (qd + 1.0) / 2.0;
}

/// Backward/forward FLOP ratios (flash-attention recomputes scores; GEMM backward = 2 GEMMs).
inline constexpr double kAttnBwdFactor = 2.5;
inline constexpr double kLinearBwdFactor = 2.0;

struct ModelDims {
  std::int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0, layers = 1,
               vocab = 0, dtype_bytes = 2;
  static ModelDims fromDeck(const ModelConfig& m);
};

/// A 2D table of achieved throughput (GFLOP/s on tile-padded FLOPs) over query length x
/// key length, interpolated bilinearly in log-log space and clamped at the edges.
struct ThroughputTable {
  std::vector<double> q_lens, k_lens;     ///< ascending
  std::vector<std::vector<double>> gflops; ///< [q][k]
  double at(double q, double k) const;
  bool empty() const { return q_lens.empty(); }
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
  double tp_bandwidth_gbps = 100.0, cp_bandwidth_gbps = 100.0, pp_bandwidth_gbps = 25.0,
         dp_bandwidth_gbps = 25.0, link_latency_us = 5.0;
  double memory_gb = 80.0;

  /// Analytic default: efficiency rises with the query length towards peak*0.7.
  static HardwareProfile analytic();
  /// Read a profile JSON file; InputError naming the file and key on bad content.
  static HardwareProfile load(const std::string& path);
  /// Profile named by the deck ("analytic" or a path, relative paths resolved against
  /// the deck's directory then the working directory), with the deck's link overrides.
  static HardwareProfile fromDeck(const Deck& deck);
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
  double linearSeconds(std::int64_t tokens, Phase p) const;

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
};

}  // namespace wlb::model
