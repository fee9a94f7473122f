#pragma once
/// \file reference.hpp
/// \brief Plain, obviously-correct attention (double accumulation, no tiling) on host
/// vectors, used by tests and by `wlb kernel --reference` to cross-check the kernels.
/// Same layout and piece semantics as attention.hpp: q/o/dO/dq are [q_tokens][heads][D],
/// k/v/dk/dv are [k_tokens][kv_heads][D], lse is [q_tokens][heads] (all row-major).

#include <cstdint>
#include <vector>

#include "attention/attention.hpp"

namespace wlb::attention::reference {

struct Dims {
  int heads = 1, kv_heads = 1, head_dim = 64;
  float scale = 0.0f;  ///< <= 0 -> 1/sqrt(head_dim)
};

/// Overwrites o and lse rows of every piece (o, lse must be sized already).
void forward(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
             const std::vector<PieceRange>& pieces, const Dims& dims, std::vector<float>& o,
             std::vector<float>& lse);

/// Accumulates (+=) into dq, dk, dv (sized already).
void backward(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
              const std::vector<float>& dO, const std::vector<PieceRange>& pieces, const Dims& dims,
              std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv);

}  // namespace wlb::attention::reference
