#pragma once
/// \file optimizer.hpp
/// \brief AdamW over the model's flat buffers (runtime/llama.hpp): decoupled weight decay
/// on matrices, bias-corrected moments, linear warm-up + cosine learning rate, and
/// clipping by the global gradient norm of the whole model.

#include <mpi.h>

#include <cstdint>

#include "runtime/llama.hpp"

namespace wlb::parallel {
class GroupComm;
}

namespace wlb::train {

using runtime::Space;
using runtime::Vec;

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

class AdamW {
 public:
  /// `tp`: the TP group (null without TP); `pp`: the pipeline group (MPI_COMM_NULL
  /// without PP). Both only sum the gradient norm's squares.
  AdamW(const runtime::Llama& model, AdamWConfig cfg, parallel::GroupComm* tp = nullptr, MPI_Comm pp = MPI_COMM_NULL);
  /// One update with the model's current gradients; `step` is 0-based (it sets the
  /// learning rate; the moments' bias correction counts the updates made, which a step
  /// without tokens does not add to). Returns the
  /// gradient norm before clipping, of the whole model: under TP the slices' squares summed
  /// over the TP group and the replicated tensors counted once, under PP the stages'
  /// squares summed over the pipeline group.
  double step(const Space& space, runtime::Llama& model, std::int64_t step);
  /// Updates made so far (the bias correction's t); a checkpoint keeps it.
  std::int64_t updates() const { return updates_; }
  void setUpdates(std::int64_t n) { updates_ = n; }
  Vec m() const { return m_; }
  Vec v() const { return v_; }
  const AdamWConfig& config() const { return cfg_; }

 private:
  AdamWConfig cfg_;
  parallel::GroupComm* tp_;
  MPI_Comm pp_;
  std::int64_t updates_ = 0;
  Vec m_, v_;
  Vec decay_;   ///< 1 where weight decay applies, else 0
  Vec sliced_;  ///< TP: 1 in TP-sliced tensors, else 0 (empty without TP)
};

}  // namespace wlb::train
