/// \file head.cpp
/// \brief Embedding, final norm, LM head and cross-entropy (see head.hpp).

#include "runtime/head.hpp"

#include <algorithm>
#include <string>
#include <type_traits>

#include "core/kokkos_compat.hpp"
#include "runtime/host_kernels.hpp"
#include "trace/recorder.hpp"

namespace wlb::runtime {
namespace {

using Policy = Kokkos::RangePolicy<Space>;
using Team = Kokkos::TeamPolicy<Space>;
using Region = trace::PhaseScope;

}  // namespace

double headFlops(const model::ModelDims& d, std::int64_t tokens, model::Phase phase) {
  const double f = 2.0 * static_cast<double>(tokens) * static_cast<double>(d.hidden) * static_cast<double>(d.vocab);
  return phase == model::Phase::Fwd ? f : model::kLinearBwdFactor * f;
}

namespace {

// The embedding rows of the working copy (storage T) into the FP32 residual stream.
template <class T>
Mat embedRows(const LayerEnv& env, const Llama& model, const TokenRows& rows) {
  const Space& space = *env.space;
  const std::int64_t n = rows.n, h = model.config().hidden;
  Mat x = newMat(env.pool, "wlb::runtime::x", n, h);
  Region r(env.recorder, trace::labels::kEmbed, space, trace::Phase::Fwd);
  const MatT<T> E = model.embedWorking<T>();
  const IVec tok = rows.tokens;
#if WLB_ATTN_HOST_SIMD
  if constexpr (simd::kOnHost) {  // a row per work item: no division per element
    Kokkos::parallel_for("wlb::runtime::embed", Policy(space, 0, n), [=](const std::int64_t i) {
      const T* e = &E(tok(i), 0);
      float* y = &x(i, 0);
      for (std::int64_t j = 0; j < h; ++j) y[j] = attention::toFloat(e[j]);
    });
    return x;
  }
#endif
  Kokkos::parallel_for(
      "wlb::runtime::embed", Policy(space, 0, n * h),
      KOKKOS_LAMBDA(const std::int64_t i) { x(i / h, i % h) = attention::toFloat(E(tok(i / h), i % h)); });
  return x;
}

}  // namespace

Mat embedForward(const LayerEnv& env, const Llama& model, const TokenRows& rows) {
  return env.bf16Storage() ? embedRows<bf16>(env, model, rows) : embedRows<float>(env, model, rows);
}

void embedBackward(const LayerEnv& env, const Llama& model, const TokenRows& rows, const Mat& dx) {
  const Space& space = *env.space;
  const std::int64_t h = model.config().hidden;
  Region r(env.recorder, trace::labels::kEmbed, space, trace::Phase::Bwd);
  const Mat dE = model.embedGrad();
  // per (distinct token, column): its rows' gradients in row order, parallel over both and
  // deterministic without atomics (each token's row of dE has one writer)
  const IVec by = rows.by_token, begin = rows.token_begin, uniq = rows.unique_tokens;
  const std::int64_t U = static_cast<std::int64_t>(uniq.extent(0));
#if WLB_ATTN_HOST_SIMD
  if constexpr (simd::kOnHost) {  // a distinct token per work item, its rows streamed in order
    const float* x = dx.data();
    const std::int64_t ld = static_cast<std::int64_t>(dx.stride(0));
    Kokkos::parallel_for("wlb::runtime::embed_bwd", Policy(space, 0, U), [=](const std::int64_t u) {
      simd::sumRowsInto(x, ld, by.data(), begin(u), begin(u + 1), h, &dE(uniq(u), 0));
    });
    return;
  }
#endif
  Kokkos::parallel_for(
      "wlb::runtime::embed_bwd", Policy(space, 0, U * h), KOKKOS_LAMBDA(const std::int64_t idx) {
        const std::int64_t u = idx / h, j = idx % h;
        float s = 0;
        for (std::int32_t k = begin(u); k < begin(u + 1); ++k) s += dx(by(k), j);
        dE(uniq(u), j) += s;
      });
}

namespace {

/// Per row of logits lc: lossc = lse - the target's logit, and with dlc (not null) dL/dlogits
/// = (softmax - one-hot) * scale; rows whose target is < 0 get 0 and a zero gradient. dlc may
/// be lc itself (FP32 storage).
template <class T>
void crossEntropy(const Space& space, const Mat& lc, const MatT<T>& dlc, const IVec& tgt, const Vec& lossc,
                  float scale) {
  const std::int64_t m = static_cast<std::int64_t>(lc.extent(0)), V = static_cast<std::int64_t>(lc.extent(1));
  const bool bwd = dlc.data() != nullptr;
#if WLB_ATTN_HOST_SIMD
  if constexpr (simd::kOnHost) {  // a row per work item, vectorised (host_kernels.hpp)
    Kokkos::parallel_for("wlb::runtime::cross_entropy", Policy(space, 0, m), [=](const std::int64_t i) {
      const int target = tgt(i);
      T* dl = bwd ? &dlc(i, 0) : nullptr;
      if (target < 0) {
        lossc(i) = 0;
        if (bwd) std::fill(dl, dl + V, attention::fromFloat<T>(0.0f));
        return;
      }
      lossc(i) = simd::crossEntropyRow(&lc(i, 0), V, target, scale, dl);
    });
    return;
  }
#endif
  // device: a team per row, reading the logits twice (memory-bound at a large vocabulary:
  // every pass over them costs): once for the maximum and the sum of exponentials
  // together (per thread online, then combined over the team), once, with backward, to
  // write scale * dL/dlogits
  Kokkos::parallel_for(
      "wlb::runtime::cross_entropy", Team(space, m, Kokkos::AUTO), KOKKOS_LAMBDA(const Team::member_type& t) {
        const std::int64_t i = t.league_rank();
        const int target = tgt(i);
        if (target < 0) {
          Kokkos::single(Kokkos::PerTeam(t), [&]() { lossc(i) = 0; });
          if (bwd)
            Kokkos::parallel_for(Kokkos::TeamThreadRange(t, V),
                                 [&](const std::int64_t j) { dlc(i, j) = attention::fromFloat<T>(0.0f); });
          return;
        }
        float mk = Kokkos::reduction_identity<float>::max(), sk = 0;
        for (std::int64_t j = t.team_rank(); j < V; j += t.team_size()) {
          const float z = lc(i, j);
          if (z > mk) {
            sk = sk * kk::exp(mk - z) + 1.0f;
            mk = z;
          } else {
            sk += kk::exp(z - mk);
          }
        }
        float mx = mk;
        t.team_reduce(Kokkos::Max<float>(mx));
        float s = sk * kk::exp(mk - mx);
        t.team_reduce(Kokkos::Sum<float>(s));
        const float lse = mx + kk::log(s);
        const float lt = lc(i, target);
        t.team_barrier();  // every thread has read the logits before they may be overwritten
        Kokkos::single(Kokkos::PerTeam(t), [&]() { lossc(i) = lse - lt; });
        if (bwd)
          Kokkos::parallel_for(Kokkos::TeamThreadRange(t, V), [&](const std::int64_t j) {
            dlc(i, j) = attention::fromFloat<T>((kk::exp(lc(i, j) - lse) - (j == target ? 1.0f : 0.0f)) * scale);
          });
      });
}

// The final norm's output and the head in storage T; logits, loss and gradients in FP32.
template <class T>
LossResult lossRows(const LayerEnv& env, const Llama& model, const TokenRows& rows, const Mat& x, bool backward,
                    float scale) {
  const Space& space = *env.space;
  const LlamaConfig& c = model.config();
  const std::int64_t n = rows.n, h = c.hidden, V = c.vocab;
  const model::ModelDims dims = c.dims();
  // Replicated over the TP group: each rank records its 1/tp share of the useful FLOPs, so a
  // sum over ranks counts the head once.
  const double flops =
      (headFlops(dims, n, model::Phase::Fwd) + (backward ? headFlops(dims, n, model::Phase::Bwd) : 0.0)) /
      static_cast<double>(std::max(env.tp, 1));
  Region r(env.recorder, trace::labels::kLoss, space, trace::Phase::Fwd, flops);
  LossResult out;
  if (backward) out.dx = newMat(env.pool, "wlb::runtime::dx_head", n, h, true);  // zeroed: the norm's backward adds
  if (n == 0) return out;
  const std::int64_t C = std::min(n, kLossChunkRows);
  MatT<T> xf = newMatT<T>(env.pool, "wlb::runtime::xf", C, h);
  Mat logits = newMat(env.pool, "wlb::runtime::logits", C, V);
  // dL/dlogits as the head's GEMMs read it: in place of the FP32 logits, or in storage T
  // (written once, not rounded from an FP32 copy in a second pass)
  MatT<T> dlogits;
  if constexpr (std::is_same_v<T, float>)
    dlogits = logits;
  else if (backward)
    dlogits = newMatT<T>(env.pool, "wlb::runtime::dlogits", C, V);
  Mat dxf = backward ? newMat(env.pool, "wlb::runtime::dxf", C, h) : Mat();
  Vec rstd = newVec(env.pool, "wlb::runtime::rstd_f", C);
  Vec row_loss = newVec(env.pool, "wlb::runtime::row_loss", n);
  const Vec g = model.normF(), dg = model.normFGrad();
  const MatT<T> W = model.headWorking<T>();
  const Mat dW = model.headGrad();
  const float eps = env.norm_eps;
  for (std::int64_t c0 = 0; c0 < n; c0 += C) {
    const std::int64_t m = std::min(C, n - c0);
    const auto rr = std::make_pair(c0, c0 + m);
    const auto first = std::make_pair(std::int64_t{0}, m);
    const Mat xc = Kokkos::subview(x, rr, Kokkos::ALL);
    const MatT<T> xfc = Kokkos::subview(xf, first, Kokkos::ALL);
    const Mat lc = Kokkos::subview(logits, first, Kokkos::ALL);
    const MatT<T> dlc = backward ? MatT<T>(Kokkos::subview(dlogits, first, Kokkos::ALL)) : MatT<T>();
    const Vec rc = Kokkos::subview(rstd, first);
    const Vec lossc = Kokkos::subview(row_loss, rr);
    const auto tgt = Kokkos::subview(rows.targets, rr);
    rmsNorm<T>(space, xc, g, eps, xfc, rc);  // final norm
    layerGemm(env, "head.fwd", Trans::N, Trans::N, 1.0f, xfc, W, 0.0f, lc);
    crossEntropy<T>(space, lc, dlc, tgt, lossc, scale);
    if (!backward) continue;
    const Mat dxfc = Kokkos::subview(dxf, first, Kokkos::ALL), dxc = Kokkos::subview(out.dx, rr, Kokkos::ALL);
    layerGemm(env, "head.wgrad", Trans::T, Trans::N, 1.0f, xfc, dlc, 1.0f, dW);  // dHead += xf^T dlogits
    layerGemm(env, "head.dgrad", Trans::N, Trans::T, 1.0f, dlc, W, 0.0f, dxfc);  // dxf = dlogits Head^T
    rmsNormBackward(space, env.pool, xc, g, rc, dxfc, dxc, dg);
  }
  // the rows' losses summed once, after every chunk (a reduction into a host value waits
  // for the device, which per chunk would drain its queue between chunks)
  double total = 0;
  Kokkos::parallel_reduce(
      "wlb::runtime::loss_sum", Policy(space, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i, double& acc) { acc += static_cast<double>(row_loss(i)); }, total);
  kk::fence(space, "wlb::runtime::loss");  // the chunk buffers go out of scope
  out.loss = total;
  return out;
}

}  // namespace

LossResult lossForward(const LayerEnv& env, const Llama& model, const TokenRows& rows, const Mat& x, bool backward,
                       float scale) {
  return env.bf16Storage() ? lossRows<bf16>(env, model, rows, x, backward, scale)
                           : lossRows<float>(env, model, rows, x, backward, scale);
}

}  // namespace wlb::runtime
