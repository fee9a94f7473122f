/// \file layer.cpp
/// \brief One transformer layer (attention block + SwiGLU MLP) forward/backward on one
/// rank, see layer.hpp.

#include "runtime/layer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "trace/recorder.hpp"

namespace wlb::runtime {
namespace {

using Clock = std::chrono::steady_clock;

// Optional timed region (no-op without a recorder).
struct Region {
  std::optional<trace::Recorder::Scope> scope;
  Region(trace::Recorder* rec, const char* label, const Space& space, trace::Phase phase, double flops = 0,
         double bytes = 0) {
    if (!rec) return;
    scope.emplace(*rec, label, space, flops, bytes);
    scope->context().phase = phase;
  }
};

KOKKOS_INLINE_FUNCTION std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

// ---- shape and FLOPs -------------------------------------------------------------------

LayerShape LayerShape::fromDims(const model::ModelDims& d, int tp) {
  if (tp < 1) throw InputError("mesh.tp must be >= 1");
  if (d.hidden != d.heads * d.head_dim)
    throw InputError("model.hidden (" + std::to_string(d.hidden) + ") must equal model.heads * head_dim");
  if (d.heads % tp != 0 || d.kv_heads % tp != 0)
    throw InputError("model.heads (" + std::to_string(d.heads) + ") and model.kv_heads (" + std::to_string(d.kv_heads) +
                     ") must be divisible by mesh.tp (" + std::to_string(tp) + ")");
  if (d.ffn % tp != 0)
    throw InputError("model.ffn (" + std::to_string(d.ffn) + ") must be divisible by mesh.tp (" + std::to_string(tp) +
                     ")");
  LayerShape s;
  s.hidden = static_cast<int>(d.hidden);
  s.heads = static_cast<int>(d.heads / tp);
  s.kv_heads = static_cast<int>(d.kv_heads / tp);
  s.head_dim = static_cast<int>(d.head_dim);
  s.ffn = static_cast<int>(d.ffn / tp);
  return s;
}

std::int64_t LayerShape::paramCount() const {
  const std::int64_t h = hidden;
  return h * qWidth() + 2 * h * kvWidth() + qWidth() * h + 3 * h * ffn;
}

double linearOpFlops(const model::CostModel& cost, LinearOp op, std::int64_t tokens, model::Phase phase) {
  return cost.linearOpFlops(op, tokens, phase);  // the cost model's formula, one place
}

// ---- model ---------------------------------------------------------------------------

void fillRandom(const Space& space, const Mat& m, std::uint64_t seed, std::uint64_t stream, float scale) {
  const std::int64_t cols = static_cast<std::int64_t>(m.extent(1));
  const std::uint64_t base = mix64(seed ^ mix64(stream));
  Kokkos::parallel_for(
      "wlb::runtime::fillRandom", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(m.size())),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const std::uint64_t r = mix64(base + static_cast<std::uint64_t>(i));
        const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        m(i / cols, i % cols) = scale * (2.0f * u - 1.0f);
      });
}

namespace {
std::vector<int> allLayers(int layers) {
  std::vector<int> ids(static_cast<std::size_t>(std::max(layers, 0)));
  for (int l = 0; l < layers; ++l) ids[static_cast<std::size_t>(l)] = l;
  return ids;
}
}  // namespace

void fillRandomRows(const Space& space, const Mat& m, std::uint64_t seed, std::uint64_t stream, float scale,
                    const std::vector<std::int64_t>& rows) {
  if (rows.size() != m.extent(0))
    throw std::logic_error("fillRandomRows: " + std::to_string(rows.size()) + " row ids for " +
                           std::to_string(m.extent(0)) + " rows");
  Kokkos::View<std::int64_t*, Mem> ids(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::rows"),
                                       rows.size());
  Kokkos::deep_copy(space, ids, Kokkos::View<const std::int64_t*, Kokkos::HostSpace>(rows.data(), rows.size()));
  const std::int64_t cols = static_cast<std::int64_t>(m.extent(1));
  const std::uint64_t base = mix64(seed ^ mix64(stream));
  Kokkos::parallel_for(
      "wlb::runtime::fillRandomRows", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(m.size())),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const std::int64_t r = i / cols, c = i % cols;
        const std::uint64_t h = mix64(base + static_cast<std::uint64_t>(ids(r) * cols + c));
        const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        m(r, c) = scale * (2.0f * u - 1.0f);
      });
  kk::fence(space, "wlb::runtime::fillRandomRows");  // `rows` may go out of scope
}

Model::Model(const LayerShape& shape, int layers, std::uint64_t seed, int tp_rank)
    : Model(shape, allLayers(layers), seed, tp_rank) {}

std::size_t Model::slot(int l) const {
  const auto it = std::lower_bound(ids_.begin(), ids_.end(), l);
  if (it == ids_.end() || *it != l)
    throw std::logic_error("runtime::Model: layer " + std::to_string(l) + " is not held by this rank");
  return static_cast<std::size_t>(it - ids_.begin());
}

Kokkos::View<float*, Mem> Model::layerGrads(int l) const {
  const std::int64_t per = shape_.paramCount(), i = static_cast<std::int64_t>(slot(l));
  return Kokkos::subview(grad_buf_, std::make_pair(per * i, per * (i + 1)));
}

Model::Model(const LayerShape& shape, std::vector<int> layer_ids, std::uint64_t seed, int tp_rank)
    : shape_(shape), ids_(std::move(layer_ids)) {
  if (!std::is_sorted(ids_.begin(), ids_.end())) throw std::logic_error("runtime::Model: layer ids must be ascending");
  const std::int64_t per = shape.paramCount();
  const std::int64_t layers = static_cast<std::int64_t>(ids_.size());
  weight_buf_ = Kokkos::View<float*, Mem>("wlb::runtime::weights", per * layers);
  grad_buf_ = Kokkos::View<float*, Mem>("wlb::runtime::grads", per * layers);
  const std::int64_t h = shape.hidden, qw = shape.qWidth(), kw = shape.kvWidth(), f = shape.ffn;
  Space space;
  for (std::int64_t i = 0; i < layers; ++i) {
    const int l = ids_[static_cast<std::size_t>(i)];
    for (int which = 0; which < 2; ++which) {
      float* p = (which == 0 ? weight_buf_ : grad_buf_).data() + per * i;
      auto take = [&p](std::int64_t r, std::int64_t c) {
        Mat m(p, r, c);
        p += r * c;
        return m;
      };
      LayerParams lp;
      lp.wq = take(h, qw);
      lp.wk = take(h, kw);
      lp.wv = take(h, kw);
      lp.wo = take(qw, h);
      lp.w1 = take(h, f);
      lp.w3 = take(h, f);
      lp.w2 = take(f, h);
      (which == 0 ? weights_ : grads_).push_back(lp);
    }
    const LayerParams& w = weights_.back();
    const std::uint64_t s =
        seed * 1000003ULL + static_cast<std::uint64_t>(l) * 131ULL + static_cast<std::uint64_t>(tp_rank) * 7919ULL;
    const float sh = 1.0f / std::sqrt(static_cast<float>(h));
    fillRandom(space, w.wq, s, 1, sh);
    fillRandom(space, w.wk, s, 2, sh);
    fillRandom(space, w.wv, s, 3, sh);
    fillRandom(space, w.wo, s, 4, sh);  // fan-in of the full out-proj = hidden
    fillRandom(space, w.w1, s, 5, sh);
    fillRandom(space, w.w3, s, 6, sh);
    fillRandom(space, w.w2, s, 7, 1.0f / std::sqrt(static_cast<float>(f)));
  }
  kk::fence(space, "wlb::runtime::Model::init");
}

std::int64_t LayerStep::savedBytes() const {
  std::int64_t b = 0;
  for (const Mat* m : {&x_, &h_, &a1_, &a3_, &s_}) b += static_cast<std::int64_t>(m->span());
  for (const Act3* a : {&q_, &k_, &v_, &o_}) b += static_cast<std::int64_t>(a->span());
  b += static_cast<std::int64_t>(lse_.span());
  b += attn_ ? attn_->heldKvElements() : 0;
  return 4 * b;
}

void Model::zeroGrads(const Space& space) {
  Kokkos::deep_copy(space, grad_buf_, 0.0f);
}

// ---- layer step ----------------------------------------------------------------------

LayerStep::LayerStep(const LayerEnv& env, Model& model, int layer, const cp::ShardPlan& plan, const cp::CommPlan& comm)
    : env_(env), model_(&model), layer_(layer) {
  int cp_rank = 0;
  MPI_Comm_rank(env.cp_comm, &cp_rank);
  n_ = plan.ranks[static_cast<std::size_t>(cp_rank)].tokens;
  cp::DistAttentionOptions opt;
  opt.kernel = env.kernel;
  opt.cost = env.cost;
  opt.recorder = env.recorder;
  opt.group = env.cp_group;
  const LayerShape& s = model.shape();
  attn_ = std::make_unique<cp::DistributedAttention>(plan, comm, env.cp_comm, s.heads, s.kv_heads, s.head_dim, opt);
}

void LayerStep::tpAllreduce(const Mat& m, bool backward) {
  if (env_.tp <= 1 || env_.tp_comm == MPI_COMM_NULL) return;
  const Space& space = *env_.space;
  const double bytes = 4.0 * static_cast<double>(m.size());
  Region r(env_.recorder, trace::labels::kTpAllreduce, space, backward ? trace::Phase::Bwd : trace::Phase::Fwd, 0,
           bytes);
  if (env_.tp_group)
    env_.tp_group->allreduceSum(space, m.data(), static_cast<std::int64_t>(m.size()));
  else
    parallel::makeGroupComm(env_.tp_comm, parallel::CommBackend::Mpi)
        ->allreduceSum(space, m.data(), static_cast<std::int64_t>(m.size()));
}

Mat LayerStep::forward(const Mat& x) {
  const Space& space = *env_.space;
  const LayerShape& s = model_->shape();
  const LayerParams& w = model_->weights(layer_);
  const std::int64_t n = n_;
  trace::Recorder* rec = env_.recorder;
  const auto F = model::Phase::Fwd;
  const auto P = trace::Phase::Fwd;
  x_ = x;
  // QKV projection.
  q_ = newAct3("wlb::runtime::q", n, s.heads, s.head_dim);
  k_ = newAct3("wlb::runtime::k", n, s.kv_heads, s.head_dim);
  v_ = newAct3("wlb::runtime::v", n, s.kv_heads, s.head_dim);
  {
    Region r(rec, trace::labels::kQkvProj, space, P, linearOpFlops(*env_.cost, LinearOp::QkvProj, n, F));
    gemm(space, Trans::N, Trans::N, 1.0f, x, w.wq, 0.0f, flat(q_), env_.precision);
    gemm(space, Trans::N, Trans::N, 1.0f, x, w.wk, 0.0f, flat(k_), env_.precision);
    gemm(space, Trans::N, Trans::N, 1.0f, x, w.wv, 0.0f, flat(v_), env_.precision);
  }
  // Attention (KV exchange inside).
  o_ = newAct3("wlb::runtime::o", n, s.heads, s.head_dim);
  lse_ = Kokkos::View<float**, Kokkos::LayoutRight, Mem>(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::lse"), n, s.heads);
  attn_->forward(space, q_, k_, v_, o_, lse_);
  attn_seconds_ = attn_->times().attn_fwd;
  kv_seconds_ = attn_->times().comm_fwd;
  // Output projection + residual: h = x + o Wo.
  h_ = newMat("wlb::runtime::h", n, s.hidden);
  {
    Region r(rec, trace::labels::kOutProj, space, P, linearOpFlops(*env_.cost, LinearOp::OutProj, n, F));
    gemm(space, Trans::N, Trans::N, 1.0f, flat(o_), w.wo, 0.0f, h_, env_.precision);
  }
  tpAllreduce(h_, false);
  Mat h = h_;
  Kokkos::parallel_for(
      "wlb::runtime::residual", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(h.size())),
      KOKKOS_LAMBDA(const std::int64_t i) { h.data()[i] += x.data()[i]; });
  // SwiGLU MLP + residual: y = h + (silu(h W1) * (h W3)) W2.
  Mat y = newMat("wlb::runtime::y", n, s.hidden);
  {
    Region r(rec, trace::labels::kMlp, space, P, linearOpFlops(*env_.cost, LinearOp::Mlp, n, F));
    a1_ = newMat("wlb::runtime::a1", n, s.ffn);
    a3_ = newMat("wlb::runtime::a3", n, s.ffn);
    s_ = newMat("wlb::runtime::s", n, s.ffn);
    gemm(space, Trans::N, Trans::N, 1.0f, h, w.w1, 0.0f, a1_, env_.precision);
    gemm(space, Trans::N, Trans::N, 1.0f, h, w.w3, 0.0f, a3_, env_.precision);
    Mat a1 = a1_, a3 = a3_, sv = s_;
    Kokkos::parallel_for(
        "wlb::runtime::swiglu", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(sv.size())),
        KOKKOS_LAMBDA(const std::int64_t i) {
          const float a = a1.data()[i];
          sv.data()[i] = a * sigmoid(a) * a3.data()[i];
        });
    gemm(space, Trans::N, Trans::N, 1.0f, sv, w.w2, 0.0f, y, env_.precision);
  }
  tpAllreduce(y, false);
  Kokkos::parallel_for(
      "wlb::runtime::residual", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(y.size())),
      KOKKOS_LAMBDA(const std::int64_t i) { y.data()[i] += h.data()[i]; });
  return y;
}

Mat LayerStep::backward(const Mat& dy) {
  const Space& space = *env_.space;
  const LayerShape& s = model_->shape();
  const LayerParams& w = model_->weights(layer_);
  const LayerParams& g = model_->grads(layer_);
  const std::int64_t n = n_;
  trace::Recorder* rec = env_.recorder;
  const auto B = model::Phase::Bwd;
  const auto P = trace::Phase::Bwd;
  // MLP backward: dh = dy + d(MLP)/dh.
  Mat dh = newMat("wlb::runtime::dh", n, s.hidden);
  {
    Region r(rec, trace::labels::kMlp, space, P, linearOpFlops(*env_.cost, LinearOp::Mlp, n, B));
    Mat ds = newMat("wlb::runtime::ds", n, s.ffn);
    gemm(space, Trans::T, Trans::N, 1.0f, s_, dy, 1.0f, g.w2, env_.precision);  // dW2 += s^T dy
    gemm(space, Trans::N, Trans::T, 1.0f, dy, w.w2, 0.0f, ds, env_.precision);  // ds = dy W2^T
    Mat a1 = a1_, a3 = a3_, da1 = s_;                                           // s_ no longer needed: reuse for d(a1)
    Kokkos::parallel_for(
        "wlb::runtime::swiglu_bwd", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(ds.size())),
        KOKKOS_LAMBDA(const std::int64_t i) {
          const float a = a1.data()[i], sg = sigmoid(a), d = ds.data()[i];
          da1.data()[i] = d * a3.data()[i] * sg * (1.0f + a * (1.0f - sg));
          ds.data()[i] = d * a * sg;  // d(a3)
        });
    gemm(space, Trans::T, Trans::N, 1.0f, h_, da1, 1.0f, g.w1, env_.precision);  // dW1 += h^T da1
    gemm(space, Trans::T, Trans::N, 1.0f, h_, ds, 1.0f, g.w3, env_.precision);   // dW3 += h^T da3
    gemm(space, Trans::N, Trans::T, 1.0f, da1, w.w1, 0.0f, dh, env_.precision);  // dh = da1 W1^T
    gemm(space, Trans::N, Trans::T, 1.0f, ds, w.w3, 1.0f, dh, env_.precision);   //    + da3 W3^T
  }
  a1_ = a3_ = s_ = Mat();
  tpAllreduce(dh, true);
  Kokkos::parallel_for(
      "wlb::runtime::residual_bwd", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(dh.size())),
      KOKKOS_LAMBDA(const std::int64_t i) { dh.data()[i] += dy.data()[i]; });
  // Output projection backward.
  Act3 d_o = newAct3("wlb::runtime::dO", n, s.heads, s.head_dim);
  {
    Region r(rec, trace::labels::kOutProj, space, P, linearOpFlops(*env_.cost, LinearOp::OutProj, n, B));
    gemm(space, Trans::T, Trans::N, 1.0f, flat(o_), dh, 1.0f, g.wo, env_.precision);   // dWo += o^T dh
    gemm(space, Trans::N, Trans::T, 1.0f, dh, w.wo, 0.0f, flat(d_o), env_.precision);  // dO = dh Wo^T
  }
  // Attention backward (dK/dV return inside).
  Act3 dq = newAct3("wlb::runtime::dq", n, s.heads, s.head_dim);
  Act3 dk = newAct3("wlb::runtime::dk", n, s.kv_heads, s.head_dim);
  Act3 dv = newAct3("wlb::runtime::dv", n, s.kv_heads, s.head_dim);
  attn_->backward(space, q_, o_, lse_, d_o, dq, dk, dv);
  attn_seconds_ += attn_->times().attn_bwd;
  kv_seconds_ += attn_->times().comm_bwd;
  o_ = Act3();
  lse_ = decltype(lse_)();
  // QKV projection backward: dx = dh + dq Wq^T + dk Wk^T + dv Wv^T.
  Mat dx = newMat("wlb::runtime::dx", n, s.hidden);
  {
    Region r(rec, trace::labels::kQkvProj, space, P, linearOpFlops(*env_.cost, LinearOp::QkvProj, n, B));
    gemm(space, Trans::T, Trans::N, 1.0f, x_, flat(dq), 1.0f, g.wq, env_.precision);
    gemm(space, Trans::T, Trans::N, 1.0f, x_, flat(dk), 1.0f, g.wk, env_.precision);
    gemm(space, Trans::T, Trans::N, 1.0f, x_, flat(dv), 1.0f, g.wv, env_.precision);
    gemm(space, Trans::N, Trans::T, 1.0f, flat(dq), w.wq, 0.0f, dx, env_.precision);
    gemm(space, Trans::N, Trans::T, 1.0f, flat(dk), w.wk, 1.0f, dx, env_.precision);
    gemm(space, Trans::N, Trans::T, 1.0f, flat(dv), w.wv, 1.0f, dx, env_.precision);
  }
  tpAllreduce(dx, true);
  Kokkos::parallel_for(
      "wlb::runtime::residual_bwd", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(dx.size())),
      KOKKOS_LAMBDA(const std::int64_t i) { dx.data()[i] += dh.data()[i]; });
  kk::fence(space, "wlb::runtime::layer::bwd");
  x_ = h_ = Mat();
  q_ = k_ = v_ = Act3();
  return dx;
}

}  // namespace wlb::runtime
