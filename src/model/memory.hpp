#pragma once
/// \file memory.hpp
/// \brief Activation memory of the measured executor: the bytes one layer keeps from
/// forward to backward on one rank (runtime::LayerStep, fp32), and what the last stage keeps
/// of the LM head (the gradient of its input, runtime/head.hpp), the single formulas behind
/// the executor's accounting check and `wlb simulate --as-run`'s per-stage prediction.

#include <cstdint>

#include "model/cost_model.hpp"

namespace wlb::model {

/// One layer on one TP rank (`tp` splits heads, KV heads and the MLP width) holding
/// `tokens` query tokens and a KV buffer of `kv_tokens` tokens: the layer input, the
/// post-attention residual and their RMSNorms [hidden], the norms' reciprocal RMS [1 each],
/// Q and O [heads*d], K and V [kv*d], the LSE [heads], the MLP's two projections and gated
/// product [ffn], and the KV buffer (K and V). `storage`: bytes per element of what the
/// GEMMs and the attention read (the norms' outputs, Q/K/V/O, the MLP's three; FP32 4, BF16
/// 2), the residual stream, RMS and LSE being FP32; `kv_bytes`: per element of the KV
/// buffer (its storage type; for SlimPack slices, FP32 dK/dV accumulators, plus their K/V
/// in the storage type under CP: runtime/sliced.hpp). `selective` (pipeline.recompute =
/// "selective"): the two norms' outputs and the gated product are not kept (the backward
/// computes them again), 2 * hidden + ffn stored elements less per token.
inline std::int64_t executorLayerActivationBytes(const ModelDims& d, std::int64_t tp, std::int64_t tokens,
                                                 std::int64_t kv_tokens, std::int64_t storage = 4,
                                                 std::int64_t kv_bytes = -1, bool selective = false) {
  const std::int64_t heads = d.heads / tp, kvw = d.kv_heads / tp * d.head_dim, qw = heads * d.head_dim,
                     ffn = d.ffn / tp;
  const std::int64_t fp32_per_token = 2 * d.hidden + 2 + heads;
  const std::int64_t stored_per_token = (selective ? 0 : 2 * d.hidden) + 2 * qw + 2 * kvw + (selective ? 2 : 3) * ffn;
  if (kv_bytes < 0) kv_bytes = storage;
  return tokens * (4 * fp32_per_token + storage * stored_per_token) + kv_bytes * kv_tokens * 2 * kvw;
}

/// What the last stage keeps of one unit of `tokens` rows from its forward to its backward:
/// the gradient of the last layer's output, computed with the loss (fp32 [tokens][hidden],
/// every TP rank).
inline std::int64_t executorHeadBytes(const ModelDims& d, std::int64_t tokens) {
  return 4 * tokens * d.hidden;
}

}  // namespace wlb::model
