#pragma once
/// \file head.hpp
/// \brief The two ends of the model (llama.hpp): the token embedding on the first virtual
/// stage, and the final RMSNorm, LM head and cross-entropy on the last.
///
/// The loss is row-wise, so forward and backward of the head run together: for rows with a
/// target, loss += CE(logits, target) and, when gradients are wanted, the head's and final
/// norm's weight gradients accumulate and the gradient of the last layer's output is
/// returned at once. The stage keeps that [rows][hidden] gradient for its backward task
/// instead of [rows][vocab] logits, and the logits exist one row chunk at a time
/// (kLossChunkRows), so a large vocabulary never needs rows x vocab floats.

#include <cstdint>

#include "model/cost_model.hpp"
#include "runtime/layer.hpp"
#include "runtime/tokens.hpp"

namespace wlb::runtime {

/// Rows of logits alive at once in lossForward.
inline constexpr std::int64_t kLossChunkRows = 2048;

/// x [rows][hidden] = embedding rows of the tokens (an `embed` event).
Mat embedForward(const LayerEnv& env, const Llama& model, const TokenRows& rows);
/// dE[token] += dx[row]: per distinct token and column, its rows summed in row order
/// (TokenRows::by_token; deterministic without atomics; an `embed` event).
void embedBackward(const LayerEnv& env, const Llama& model, const TokenRows& rows, const Mat& dx);

struct LossResult {
  double loss = 0;  ///< sum of the rows' cross-entropies (nats)
  Mat dx;           ///< d(scale * loss)/dx when asked for, else empty
};
/// Final norm, head and cross-entropy of x [rows][hidden] against the rows' targets (a
/// `loss` event with the head's FLOPs). With `backward`, accumulates dHead and dNorm_f of
/// scale * loss and returns dx.
LossResult lossForward(const LayerEnv& env, const Llama& model, const TokenRows& rows, const Mat& x, bool backward,
                       float scale);

/// FLOPs of the LM head for `tokens` rows (2 * hidden * vocab per row forward, backward 2x).
double headFlops(const model::ModelDims& d, std::int64_t tokens, model::Phase phase);

}  // namespace wlb::runtime
