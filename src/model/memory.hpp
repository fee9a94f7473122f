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
/// product [ffn], and the KV buffer (K and V).
inline std::int64_t executorLayerActivationBytes(const ModelDims& d, std::int64_t tp, std::int64_t tokens,
                                                 std::int64_t kv_tokens) {
  const std::int64_t heads = d.heads / tp, kvw = d.kv_heads / tp * d.head_dim, qw = heads * d.head_dim,
                     ffn = d.ffn / tp;
  const std::int64_t per_token = 4 * d.hidden + 2 + 2 * qw + 2 * kvw + heads + 3 * ffn;
  return 4 * (tokens * per_token + kv_tokens * 2 * kvw);
}

/// What the last stage keeps of one unit of `tokens` rows from its forward to its backward:
/// the gradient of the last layer's output, computed with the loss (fp32 [tokens][hidden],
/// every TP rank).
inline std::int64_t executorHeadBytes(const ModelDims& d, std::int64_t tokens) {
  return 4 * tokens * d.hidden;
}

}  // namespace wlb::model
