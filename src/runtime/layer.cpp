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

using Region = trace::PhaseScope;  // timed region, no-op without a recorder

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
  return acts_.bytes() + 4 * (attn_ ? attn_->heldKvElements() : 0);
}

void Model::zeroGrads(const Space& space) {
  Kokkos::deep_copy(space, grad_buf_, 0.0f);
}

// ---- activations ---------------------------------------------------------------------

std::int64_t LayerActs::bytes() const {
  std::int64_t b = 0;
  for (const Mat* m : {&x, &h, &a1, &a3, &s}) b += static_cast<std::int64_t>(m->span());
  for (const Act3* a : {&q, &k, &v, &o}) b += static_cast<std::int64_t>(a->span());
  b += static_cast<std::int64_t>(lse.span());
  return 4 * b;
}

namespace {
// Rows [r0, r1) of a LayoutRight view: contiguous.
template <class V>
auto rowsOf(const V& v, std::int64_t r0, std::int64_t r1) {
  if constexpr (V::rank == 2)
    return Kokkos::subview(v, std::make_pair(r0, r1), Kokkos::ALL);
  else
    return Kokkos::subview(v, std::make_pair(r0, r1), Kokkos::ALL, Kokkos::ALL);
}
template <class V>
V copyOf(const Space& space, const V& v, std::int64_t r0, std::int64_t r1, const char* label) {
  if (v.extent(0) == 0) return V();
  V out;
  if constexpr (V::rank == 2)
    out = V(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), r1 - r0, v.extent(1));
  else
    out = V(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), r1 - r0, v.extent(1), v.extent(2));
  Kokkos::deep_copy(space, out, rowsOf(v, r0, r1));
  return out;
}
template <class V>
V concatOf(const Space& space, const std::vector<const LayerActs*>& parts, V LayerActs::*field, const char* label) {
  std::int64_t n = 0;
  const V& first = parts.front()->*field;
  if (first.extent(0) == 0 && parts.front()->rows() > 0) return V();  // not kept
  for (const LayerActs* p : parts) n += static_cast<std::int64_t>((p->*field).extent(0));
  V out;
  if constexpr (V::rank == 2)
    out = V(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), n, first.extent(1));
  else
    out = V(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), n, first.extent(1), first.extent(2));
  std::int64_t at = 0;
  for (const LayerActs* p : parts) {
    const V& src = p->*field;
    const auto r = static_cast<std::int64_t>(src.extent(0));
    if (r > 0) Kokkos::deep_copy(space, rowsOf(out, at, at + r), src);
    at += r;
  }
  return out;
}
}  // namespace

LayerActs LayerActs::copyRows(const Space& space, std::int64_t r0, std::int64_t r1) const {
  LayerActs c;
  c.x = copyOf(space, x, r0, r1, "wlb::runtime::x");
  c.h = copyOf(space, h, r0, r1, "wlb::runtime::h");
  c.a1 = copyOf(space, a1, r0, r1, "wlb::runtime::a1");
  c.a3 = copyOf(space, a3, r0, r1, "wlb::runtime::a3");
  c.s = copyOf(space, s, r0, r1, "wlb::runtime::s");
  c.q = copyOf(space, q, r0, r1, "wlb::runtime::q");
  c.k = copyOf(space, k, r0, r1, "wlb::runtime::k");
  c.v = copyOf(space, v, r0, r1, "wlb::runtime::v");
  c.o = copyOf(space, o, r0, r1, "wlb::runtime::o");
  c.lse = copyOf(space, lse, r0, r1, "wlb::runtime::lse");
  return c;
}

LayerActs LayerActs::concat(const Space& space, const std::vector<const LayerActs*>& parts) {
  if (parts.empty()) return {};
  if (parts.size() == 1) return *parts.front();
  LayerActs c;
  c.x = concatOf(space, parts, &LayerActs::x, "wlb::runtime::x");
  c.h = concatOf(space, parts, &LayerActs::h, "wlb::runtime::h");
  c.a1 = concatOf(space, parts, &LayerActs::a1, "wlb::runtime::a1");
  c.a3 = concatOf(space, parts, &LayerActs::a3, "wlb::runtime::a3");
  c.s = concatOf(space, parts, &LayerActs::s, "wlb::runtime::s");
  c.q = concatOf(space, parts, &LayerActs::q, "wlb::runtime::q");
  c.k = concatOf(space, parts, &LayerActs::k, "wlb::runtime::k");
  c.v = concatOf(space, parts, &LayerActs::v, "wlb::runtime::v");
  c.o = concatOf(space, parts, &LayerActs::o, "wlb::runtime::o");
  c.lse = concatOf(space, parts, &LayerActs::lse, "wlb::runtime::lse");
  return c;
}

// ---- the linear parts ------------------------------------------------------------------

namespace {
void tpAllreduce(const LayerEnv& env, const Mat& m, bool backward) {
  if (env.tp <= 1 || env.tp_comm == MPI_COMM_NULL) return;
  const Space& space = *env.space;
  const double bytes = 4.0 * static_cast<double>(m.size());
  Region r(env.recorder, trace::labels::kTpAllreduce, space, backward ? trace::Phase::Bwd : trace::Phase::Fwd, 0,
           bytes);
  if (env.tp_group)
    env.tp_group->allreduceSum(space, m.data(), static_cast<std::int64_t>(m.size()));
  else
    parallel::makeGroupComm(env.tp_comm, parallel::CommBackend::Mpi)
        ->allreduceSum(space, m.data(), static_cast<std::int64_t>(m.size()));
}

// a += b, elementwise
void addInto(const Space& space, const Mat& a, const Mat& b) {
  Kokkos::parallel_for(
      "wlb::runtime::residual", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(a.size())),
      KOKKOS_LAMBDA(const std::int64_t i) { a.data()[i] += b.data()[i]; });
}
}  // namespace

void qkvForward(const LayerEnv& env, const LayerShape& s, const LayerParams& w, LayerActs& a) {
  const Space& space = *env.space;
  const std::int64_t n = a.rows();
  a.q = newAct3("wlb::runtime::q", n, s.heads, s.head_dim);
  a.k = newAct3("wlb::runtime::k", n, s.kv_heads, s.head_dim);
  a.v = newAct3("wlb::runtime::v", n, s.kv_heads, s.head_dim);
  Region r(env.recorder, trace::labels::kQkvProj, space, trace::Phase::Fwd,
           linearOpFlops(*env.cost, LinearOp::QkvProj, n, model::Phase::Fwd));
  gemm(space, Trans::N, Trans::N, 1.0f, a.x, w.wq, 0.0f, flat(a.q), env.precision);
  gemm(space, Trans::N, Trans::N, 1.0f, a.x, w.wk, 0.0f, flat(a.k), env.precision);
  gemm(space, Trans::N, Trans::N, 1.0f, a.x, w.wv, 0.0f, flat(a.v), env.precision);
}

Mat outMlpForward(const LayerEnv& env, const LayerParams& w, LayerActs& a) {
  const Space& space = *env.space;
  trace::Recorder* rec = env.recorder;
  const std::int64_t n = a.rows(), hidden = static_cast<std::int64_t>(w.wo.extent(1)),
                     ffn = static_cast<std::int64_t>(w.w1.extent(1));
  const auto F = model::Phase::Fwd;
  const auto P = trace::Phase::Fwd;
  // Output projection + residual: h = x + o Wo.
  a.h = newMat("wlb::runtime::h", n, hidden);
  {
    Region r(rec, trace::labels::kOutProj, space, P, linearOpFlops(*env.cost, LinearOp::OutProj, n, F));
    gemm(space, Trans::N, Trans::N, 1.0f, flat(a.o), w.wo, 0.0f, a.h, env.precision);
  }
  tpAllreduce(env, a.h, false);
  Mat h = a.h;
  addInto(space, h, a.x);
  // SwiGLU MLP + residual: y = h + (silu(h W1) * (h W3)) W2.
  Mat y = newMat("wlb::runtime::y", n, hidden);
  {
    Region r(rec, trace::labels::kMlp, space, P, linearOpFlops(*env.cost, LinearOp::Mlp, n, F));
    a.a1 = newMat("wlb::runtime::a1", n, ffn);
    a.a3 = newMat("wlb::runtime::a3", n, ffn);
    a.s = newMat("wlb::runtime::s", n, ffn);
    gemm(space, Trans::N, Trans::N, 1.0f, h, w.w1, 0.0f, a.a1, env.precision);
    gemm(space, Trans::N, Trans::N, 1.0f, h, w.w3, 0.0f, a.a3, env.precision);
    Mat a1 = a.a1, a3 = a.a3, sv = a.s;
    Kokkos::parallel_for(
        "wlb::runtime::swiglu", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(sv.size())),
        KOKKOS_LAMBDA(const std::int64_t i) {
          const float v = a1.data()[i];
          sv.data()[i] = v * sigmoid(v) * a3.data()[i];
        });
    gemm(space, Trans::N, Trans::N, 1.0f, sv, w.w2, 0.0f, y, env.precision);
  }
  tpAllreduce(env, y, false);
  addInto(space, y, h);
  return y;
}

Act3 outMlpBackward(const LayerEnv& env, const LayerParams& w, const LayerParams& g, LayerActs& a, const Mat& dy,
                    Mat& dh) {
  const Space& space = *env.space;
  trace::Recorder* rec = env.recorder;
  const std::int64_t n = a.rows(), hidden = static_cast<std::int64_t>(w.wo.extent(1)),
                     ffn = static_cast<std::int64_t>(w.w1.extent(1));
  const auto B = model::Phase::Bwd;
  const auto P = trace::Phase::Bwd;
  // MLP backward: dh = dy + d(MLP)/dh.
  dh = newMat("wlb::runtime::dh", n, hidden);
  {
    Region r(rec, trace::labels::kMlp, space, P, linearOpFlops(*env.cost, LinearOp::Mlp, n, B));
    Mat ds = newMat("wlb::runtime::ds", n, ffn);
    gemm(space, Trans::T, Trans::N, 1.0f, a.s, dy, 1.0f, g.w2, env.precision);  // dW2 += s^T dy
    gemm(space, Trans::N, Trans::T, 1.0f, dy, w.w2, 0.0f, ds, env.precision);   // ds = dy W2^T
    Mat a1 = a.a1, a3 = a.a3, da1 = a.s;  // s no longer needed: reuse for d(a1)
    Kokkos::parallel_for(
        "wlb::runtime::swiglu_bwd", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(ds.size())),
        KOKKOS_LAMBDA(const std::int64_t i) {
          const float v = a1.data()[i], sg = sigmoid(v), d = ds.data()[i];
          da1.data()[i] = d * a3.data()[i] * sg * (1.0f + v * (1.0f - sg));
          ds.data()[i] = d * v * sg;  // d(a3)
        });
    gemm(space, Trans::T, Trans::N, 1.0f, a.h, da1, 1.0f, g.w1, env.precision);  // dW1 += h^T da1
    gemm(space, Trans::T, Trans::N, 1.0f, a.h, ds, 1.0f, g.w3, env.precision);   // dW3 += h^T da3
    gemm(space, Trans::N, Trans::T, 1.0f, da1, w.w1, 0.0f, dh, env.precision);   // dh = da1 W1^T
    gemm(space, Trans::N, Trans::T, 1.0f, ds, w.w3, 1.0f, dh, env.precision);    //    + da3 W3^T
  }
  a.a1 = a.a3 = a.s = Mat();
  tpAllreduce(env, dh, true);
  addInto(space, dh, dy);
  // Output projection backward.
  Act3 d_o = newAct3("wlb::runtime::dO", n, static_cast<int>(a.o.extent(1)), static_cast<int>(a.o.extent(2)));
  {
    Region r(rec, trace::labels::kOutProj, space, P, linearOpFlops(*env.cost, LinearOp::OutProj, n, B));
    gemm(space, Trans::T, Trans::N, 1.0f, flat(a.o), dh, 1.0f, g.wo, env.precision);   // dWo += o^T dh
    gemm(space, Trans::N, Trans::T, 1.0f, dh, w.wo, 0.0f, flat(d_o), env.precision);  // dO = dh Wo^T
  }
  return d_o;
}

Mat qkvBackward(const LayerEnv& env, const LayerParams& w, const LayerParams& g, const LayerActs& a, const Act3& dq,
                const Act3& dk, const Act3& dv, const Mat& dh) {
  const Space& space = *env.space;
  const std::int64_t n = a.rows();
  // QKV projection backward: dx = dh + dq Wq^T + dk Wk^T + dv Wv^T.
  Mat dx = newMat("wlb::runtime::dx", n, static_cast<std::int64_t>(w.wq.extent(0)));
  {
    Region r(env.recorder, trace::labels::kQkvProj, space, trace::Phase::Bwd,
             linearOpFlops(*env.cost, LinearOp::QkvProj, n, model::Phase::Bwd));
    gemm(space, Trans::T, Trans::N, 1.0f, a.x, flat(dq), 1.0f, g.wq, env.precision);
    gemm(space, Trans::T, Trans::N, 1.0f, a.x, flat(dk), 1.0f, g.wk, env.precision);
    gemm(space, Trans::T, Trans::N, 1.0f, a.x, flat(dv), 1.0f, g.wv, env.precision);
    gemm(space, Trans::N, Trans::T, 1.0f, flat(dq), w.wq, 0.0f, dx, env.precision);
    gemm(space, Trans::N, Trans::T, 1.0f, flat(dk), w.wk, 1.0f, dx, env.precision);
    gemm(space, Trans::N, Trans::T, 1.0f, flat(dv), w.wv, 1.0f, dx, env.precision);
  }
  tpAllreduce(env, dx, true);
  addInto(space, dx, dh);
  return dx;
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

Mat LayerStep::forward(const Mat& x) {
  const Space& space = *env_.space;
  const LayerShape& s = model_->shape();
  const LayerParams& w = model_->weights(layer_);
  acts_.x = x;
  qkvForward(env_, s, w, acts_);
  // Attention (KV exchange inside).
  acts_.o = newAct3("wlb::runtime::o", n_, s.heads, s.head_dim);
  acts_.lse = LayerActs::Lse(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::lse"), n_, s.heads);
  attn_->forward(space, acts_.q, acts_.k, acts_.v, acts_.o, acts_.lse);
  attn_seconds_ = attn_->times().attn_fwd;
  kv_seconds_ = attn_->times().comm_fwd;
  return outMlpForward(env_, w, acts_);
}

Mat LayerStep::backward(const Mat& dy) {
  const Space& space = *env_.space;
  const LayerShape& s = model_->shape();
  const LayerParams& w = model_->weights(layer_);
  const LayerParams& g = model_->grads(layer_);
  Mat dh;
  const Act3 d_o = outMlpBackward(env_, w, g, acts_, dy, dh);
  // Attention backward (dK/dV return inside).
  Act3 dq = newAct3("wlb::runtime::dq", n_, s.heads, s.head_dim);
  Act3 dk = newAct3("wlb::runtime::dk", n_, s.kv_heads, s.head_dim);
  Act3 dv = newAct3("wlb::runtime::dv", n_, s.kv_heads, s.head_dim);
  attn_->backward(space, acts_.q, acts_.o, acts_.lse, d_o, dq, dk, dv);
  attn_seconds_ += attn_->times().attn_bwd;
  kv_seconds_ += attn_->times().comm_bwd;
  acts_.o = Act3();
  acts_.lse = LayerActs::Lse();
  Mat dx = qkvBackward(env_, w, g, acts_, dq, dk, dv, dh);
  kk::fence(space, "wlb::runtime::layer::bwd");
  acts_ = LayerActs();
  return dx;
}

}  // namespace wlb::runtime
