/// \file optimizer.cpp
/// \brief AdamW (see optimizer.hpp).

#include "train/optimizer.hpp"

#include <cmath>
#include <stdexcept>

#include "core/kokkos_compat.hpp"
#include "parallel/group_comm.hpp"

namespace wlb::train {
namespace {
using Policy = Kokkos::RangePolicy<Space>;
}  // namespace

double AdamWConfig::lrAt(std::int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const double span = static_cast<double>(std::max<std::int64_t>(1, total_steps - warmup_steps));
  const double p = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  const double lo = lr * min_lr_ratio;
  return lo + 0.5 * (lr - lo) * (1.0 + std::cos(M_PI * p));
}

AdamW::AdamW(const runtime::Llama& model, AdamWConfig cfg, parallel::GroupComm* tp, MPI_Comm pp)
    : cfg_(cfg), tp_(model.config().tp > 1 ? tp : nullptr), pp_(model.config().pp > 1 ? pp : MPI_COMM_NULL) {
  if (model.config().tp > 1 && tp == nullptr) throw std::invalid_argument("AdamW: tp > 1 needs the TP group");
  if (model.config().pp > 1 && pp == MPI_COMM_NULL)
    throw std::invalid_argument("AdamW: pp > 1 needs the pipeline group");
  const std::int64_t n = model.paramCount();
  m_ = Vec("wlb::train::adam_m", n);
  v_ = Vec("wlb::train::adam_v", n);
  decay_ = Vec("wlb::train::decay_mask", n);
  Space space;
  for (const auto& t : model.tensors())
    if (t.decay) Kokkos::deep_copy(space, Kokkos::subview(decay_, std::make_pair(t.offset, t.offset + t.size)), 1.0f);
  if (tp_ != nullptr) {
    sliced_ = Vec("wlb::train::tp_sliced_mask", n);
    for (const auto& t : model.tensors())
      if (t.slice != 0)
        Kokkos::deep_copy(space, Kokkos::subview(sliced_, std::make_pair(t.offset, t.offset + t.size)), 1.0f);
  }
  kk::fence(space, "wlb::train::AdamW::init");
}

double AdamW::step(const Space& space, runtime::Llama& model, std::int64_t step) {
  Vec g = model.grads(), w = model.weights(), m = m_, v = v_, mask = decay_;
  const std::int64_t n = model.paramCount();
  double sq = 0;
  if (tp_ == nullptr) {
    Kokkos::parallel_reduce(
        "wlb::train::grad_norm", Policy(space, 0, n),
        KOKKOS_LAMBDA(const std::int64_t i, double& acc) { acc += static_cast<double>(g(i)) * g(i); }, sq);
  } else {
    // TP: the replicated tensors' squares once, the slices' summed over the group.
    Vec sl = sliced_;
    double rep = 0, part = 0, all = 0;
    Kokkos::parallel_reduce(
        "wlb::train::grad_norm_replicated", Policy(space, 0, n),
        KOKKOS_LAMBDA(const std::int64_t i, double& acc) { acc += (1.0f - sl(i)) * static_cast<double>(g(i)) * g(i); },
        rep);
    Kokkos::parallel_reduce(
        "wlb::train::grad_norm_sliced", Policy(space, 0, n),
        KOKKOS_LAMBDA(const std::int64_t i, double& acc) { acc += sl(i) * static_cast<double>(g(i)) * g(i); }, part);
    MPI_Allreduce(&part, &all, 1, MPI_DOUBLE, MPI_SUM, tp_->mpi());
    sq = rep + all;
  }
  // PP: every stage holds other tensors; their squares add up (stage order, every rank alike).
  if (pp_ != MPI_COMM_NULL) MPI_Allreduce(MPI_IN_PLACE, &sq, 1, MPI_DOUBLE, MPI_SUM, pp_);
  const double norm = std::sqrt(sq);
  const float coef = (cfg_.clip > 0 && norm > cfg_.clip) ? static_cast<float>(cfg_.clip / (norm + 1e-6)) : 1.0f;
  const float lr = static_cast<float>(cfg_.lrAt(step));
  const float b1 = cfg_.beta1, b2 = cfg_.beta2, eps = cfg_.eps, wd = cfg_.weight_decay;
  // t = this update's number: the moments have taken t updates, whatever the step index
  // (an empty step makes none).
  const double t = static_cast<double>(++updates_);
  const float c1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
  const float c2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), t));
  Kokkos::parallel_for(
      "wlb::train::adamw", Policy(space, 0, n), KOKKOS_LAMBDA(const std::int64_t i) {
        const float gi = g(i) * coef;
        const float mi = b1 * m(i) + (1.0f - b1) * gi;
        const float vi = b2 * v(i) + (1.0f - b2) * gi * gi;
        m(i) = mi;
        v(i) = vi;
        w(i) -= lr * ((mi / c1) / (kk::sqrt(vi / c2) + eps) + wd * mask(i) * w(i));
      });
  model.refreshWorking(space);  // the kernels read the new weights (BF16 storage)
  kk::fence(space, "wlb::train::adamw");
  return norm;
}

}  // namespace wlb::train
