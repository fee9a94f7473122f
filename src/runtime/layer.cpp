/// \file layer.cpp
/// \brief One layer of the model forward/backward on one rank (see layer.hpp).

#include "runtime/layer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <type_traits>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "runtime/host_kernels.hpp"
#include "runtime/pool.hpp"
#include "trace/recorder.hpp"

namespace wlb::runtime {
namespace {

using Policy = Kokkos::RangePolicy<Space>;
using Team = Kokkos::TeamPolicy<Space>;
using Region = trace::PhaseScope;  // timed region, no-op without a recorder

}  // namespace

// ---- shape, FLOPs, RoPE table ----------------------------------------------------------

LayerShape LayerShape::fromDims(const model::ModelDims& d, int tp) {
  if (tp < 1) throw InputError("mesh.tp must be >= 1");
  if (d.hidden != d.heads * d.head_dim)
    throw InputError("model.hidden (" + std::to_string(d.hidden) + ") must equal model.heads * head_dim");
  if (d.head_dim % 2 != 0)
    throw InputError("model.hidden / model.heads = " + std::to_string(d.head_dim) +
                     ": the head dimension must be even (RoPE rotates pairs)");
  if (d.heads % tp != 0 || d.kv_heads % tp != 0)
    throw InputError("model.heads (" + std::to_string(d.heads) + ") and model.kv_heads (" + std::to_string(d.kv_heads) +
                     ") must be divisible by mesh.tp (" + std::to_string(tp) +
                     "): wlb run and wlb train give each TP rank whole KV heads (no replication)");
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

LayerShape LayerShape::of(const LlamaConfig& c) {
  LayerShape s;
  s.hidden = c.hidden;
  s.heads = c.localHeads();
  s.kv_heads = c.localKvHeads();
  s.head_dim = c.headDim();
  s.ffn = c.localFfn();
  return s;
}

LayerEnv LayerEnv::onMesh(const Space& space, const parallel::Mesh& mesh, const model::CostModel& cost,
                          trace::Recorder* recorder, Precision precision, parallel::GroupComm* cp_group,
                          parallel::GroupComm* tp_group) {
  LayerEnv env;
  env.space = &space;
  env.cp_comm = mesh.cp();
  env.tp_comm = mesh.tp();
  env.tp = mesh.shape().tp();
  env.cost = &cost;
  env.recorder = recorder;
  env.precision = precision;
  env.kernel.precision = precision;
  env.cp_group = cp_group;
  env.tp_group = tp_group;
  return env;
}

double linearOpFlops(const model::CostModel& cost, LinearOp op, std::int64_t tokens, model::Phase phase) {
  return cost.linearOpFlops(op, tokens, phase);  // the cost model's formula, one place
}

void RopeTable::ensure(const Space& space, std::int64_t n) {
  if (static_cast<std::int64_t>(cos_.extent(0)) >= n) return;
  const std::int64_t cap = std::max<std::int64_t>(n, 2 * static_cast<std::int64_t>(cos_.extent(0)));
  cos_ = newMat("wlb::runtime::rope_cos", cap, half_);
  sin_ = newMat("wlb::runtime::rope_sin", cap, half_);
  auto hc = Kokkos::create_mirror_view(cos_);
  auto hs = Kokkos::create_mirror_view(sin_);
  for (int d = 0; d < half_; ++d) {
    const double inv = std::pow(theta_, -2.0 * d / (2.0 * half_));
    for (std::int64_t p = 0; p < cap; ++p) {
      hc(p, d) = static_cast<float>(std::cos(static_cast<double>(p) * inv));
      hs(p, d) = static_cast<float>(std::sin(static_cast<double>(p) * inv));
    }
  }
  Kokkos::deep_copy(space, cos_, hc);
  Kokkos::deep_copy(space, sin_, hs);
  kk::fence(space, "wlb::runtime::rope_table");  // the host mirrors go out of scope
}

// ---- elementwise kernels ---------------------------------------------------------------

namespace {

// An RMSNorm gain's gradient, dg(j) += sum over rows i of dy(i, j) * x(i, j) * rstd(i):
// partial sums over blocks of kGainGradRows rows (parallel over blocks and columns), then
// the blocks' sums in block order. Deterministic without atomics, and a GPU is not left
// with one thread per column walking every row.
constexpr std::int64_t kGainGradRows = 256;
void gainGrad(const Space& space, BufferPool* pool, const Mat& x, const Vec& rstd, const Mat& dy, const Vec& dg) {
  const std::int64_t n = static_cast<std::int64_t>(x.extent(0)), h = static_cast<std::int64_t>(x.extent(1));
  if (n == 0) return;
  const std::int64_t R = kGainGradRows, B = (n + R - 1) / R;
  const Mat part = newMat(pool, "wlb::runtime::gain_grad_part", B, h);
#if WLB_ATTN_HOST_SIMD
  if constexpr (simd::kOnHost) {  // a block's rows in order, its columns as vectors
    Kokkos::parallel_for("wlb::runtime::rmsnorm_gain_part", Policy(space, 0, B), [=](const std::int64_t b) {
      simd::gainGradRows(x.data(), static_cast<std::int64_t>(x.stride(0)), dy.data(),
                         static_cast<std::int64_t>(dy.stride(0)), rstd.data(), b * R, std::min(n, (b + 1) * R), h,
                         &part(b, 0));
    });
  } else
#endif
    Kokkos::parallel_for(
        "wlb::runtime::rmsnorm_gain_part", Policy(space, 0, B * h), KOKKOS_LAMBDA(const std::int64_t idx) {
          const std::int64_t b = idx / h, j = idx % h;
          const std::int64_t i1 = kk::min(n, (b + 1) * R);
          float s = 0;
          for (std::int64_t i = b * R; i < i1; ++i) s += dy(i, j) * x(i, j) * rstd(i);
          part(b, j) = s;
        });
  Kokkos::parallel_for(
      "wlb::runtime::rmsnorm_gain_sum", Policy(space, 0, h), KOKKOS_LAMBDA(const std::int64_t j) {
        float s = 0;
        for (std::int64_t b = 0; b < B; ++b) s += part(b, j);
        dg(j) += s;
      });
}

}  // namespace

// y = x * rstd * g, rstd = 1/sqrt(mean(x^2) + eps); one team per row. y in its storage type.
template <class T>
void rmsNorm(const Space& space, const Mat& x, const Vec& g, float eps, const MatT<T>& y, const Vec& rstd) {
  const std::int64_t n = static_cast<std::int64_t>(x.extent(0)), h = static_cast<std::int64_t>(x.extent(1));
  if (n == 0) return;
#if WLB_ATTN_HOST_SIMD
  if constexpr (simd::kOnHost) {  // a row per work item, its sum in vector lanes
    Kokkos::parallel_for("wlb::runtime::rmsnorm_fwd", Policy(space, 0, n), [=](const std::int64_t i) {
      rstd(i) = simd::rmsNormRow(&x(i, 0), g.data(), eps, h, &y(i, 0));
    });
    return;
  }
#endif
  Kokkos::parallel_for(
      "wlb::runtime::rmsnorm_fwd", Team(space, n, Kokkos::AUTO), KOKKOS_LAMBDA(const Team::member_type& t) {
        const std::int64_t i = t.league_rank();
        float ss = 0;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(t, h), [&](const std::int64_t j, float& acc) { acc += x(i, j) * x(i, j); }, ss);
        const float r = 1.0f / kk::sqrt(ss / static_cast<float>(h) + eps);
        Kokkos::single(Kokkos::PerTeam(t), [&]() { rstd(i) = r; });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(t, h),
                             [&](const std::int64_t j) { y(i, j) = attention::fromFloat<T>(x(i, j) * r * g(j)); });
      });
}
template void rmsNorm<float>(const Space&, const Mat&, const Vec&, float, const MatT<float>&, const Vec&);
template void rmsNorm<bf16>(const Space&, const Mat&, const Vec&, float, const MatT<bf16>&, const Vec&);

// dx += rstd * (g*dy - xhat * mean(g*dy*xhat)); dg += sum over rows of dy * xhat.
void rmsNormBackward(const Space& space, BufferPool* pool, const Mat& x, const Vec& g, const Vec& rstd, const Mat& dy,
                     const Mat& dx, const Vec& dg) {
  const std::int64_t n = static_cast<std::int64_t>(x.extent(0)), h = static_cast<std::int64_t>(x.extent(1));
  if (n == 0) return;
#if WLB_ATTN_HOST_SIMD
  if constexpr (simd::kOnHost) {
    Kokkos::parallel_for("wlb::runtime::rmsnorm_bwd_x", Policy(space, 0, n), [=](const std::int64_t i) {
      simd::rmsNormBackwardRow(&x(i, 0), g.data(), &dy(i, 0), rstd(i), h, &dx(i, 0));
    });
  } else
#endif
    Kokkos::parallel_for(
        "wlb::runtime::rmsnorm_bwd_x", Team(space, n, Kokkos::AUTO), KOKKOS_LAMBDA(const Team::member_type& t) {
          const std::int64_t i = t.league_rank();
          const float r = rstd(i);
          float dot = 0;
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(t, h),
              [&](const std::int64_t j, float& acc) { acc += g(j) * dy(i, j) * x(i, j) * r; }, dot);
          dot /= static_cast<float>(h);
          Kokkos::parallel_for(Kokkos::TeamThreadRange(t, h),
                               [&](const std::int64_t j) { dx(i, j) += r * (g(j) * dy(i, j) - x(i, j) * r * dot); });
        });
  gainGrad(space, pool, x, rstd, dy, dg);
}

namespace {

// Rotate pairs (d, d + D/2) of every head by +-angle(position, d) (sign -1: the transpose),
// in place, computing in FP32 whatever the storage.
template <class T>
void rope(const Space& space, const Act3T<T>& t, const IVec& pos, const RopeTable& table, float sign) {
  const std::int64_t n = static_cast<std::int64_t>(t.extent(0));
  const int H = static_cast<int>(t.extent(1)), half = static_cast<int>(t.extent(2)) / 2;
  const Mat c = table.cos(), s = table.sin();
  // (token, head, d) as a 3-D range: no index division per element (a flat index cost three
  // 64-bit divisions per element), and d, the rightmost index, runs fastest on every
  // backend (a GPU's default order is the leftmost first), so a warp reads consecutive d.
  using Range3 = Kokkos::MDRangePolicy<Space, Kokkos::Rank<3, Kokkos::Iterate::Right, Kokkos::Iterate::Right>,
                                       Kokkos::IndexType<std::int64_t>>;
  Kokkos::parallel_for(
      "wlb::runtime::rope", Range3(space, {0, 0, 0}, {n, H, half}),
      KOKKOS_LAMBDA(const std::int64_t i, const std::int64_t hh, const std::int64_t d) {
        const float cv = c(pos(i), d), sv = sign * s(pos(i), d);
        const float a = attention::toFloat(t(i, hh, d)), b = attention::toFloat(t(i, hh, d + half));
        t(i, hh, d) = attention::fromFloat<T>(a * cv - b * sv);
        t(i, hh, d + half) = attention::fromFloat<T>(a * sv + b * cv);
      });
}

// a += b, elementwise
void addInto(const Space& space, const Mat& a, const Mat& b) {
  Kokkos::parallel_for(
      "wlb::runtime::residual", Policy(space, 0, static_cast<std::int64_t>(a.size())),
      KOKKOS_LAMBDA(const std::int64_t i) { a.data()[i] += b.data()[i]; });
}

// `m` in storage type T (pool.hpp's storedAs), for a GEMM that reads it.
template <class T>
MatT<T> stored(const LayerEnv& env, const Mat& m, const char* label) {
  return storedAs<T>(*env.space, env.pool, m, label);
}

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

}  // namespace

// ---- activations ---------------------------------------------------------------------

template <class T>
std::int64_t LayerActsT<T>::bytes() const {
  std::int64_t f = 0, t = 0;
  for (const Mat* m : {&x, &h}) f += static_cast<std::int64_t>(m->span());
  for (const MatT<T>* m : {&xn1, &hn, &a1, &a3, &s}) t += static_cast<std::int64_t>(m->span());
  for (const Vec* v : {&rstd1, &rstd2}) f += static_cast<std::int64_t>(v->span());
  for (const Act3T<T>* a : {&q, &k, &v, &o}) t += static_cast<std::int64_t>(a->span());
  f += static_cast<std::int64_t>(lse.span());
  return 4 * f + static_cast<std::int64_t>(sizeof(T)) * t;
}

namespace {
// Rows [r0, r1) of a LayoutRight view: contiguous.
template <class V>
auto rowsOf(const V& v, std::int64_t r0, std::int64_t r1) {
  if constexpr (V::rank == 1)
    return Kokkos::subview(v, std::make_pair(r0, r1));
  else if constexpr (V::rank == 2)
    return Kokkos::subview(v, std::make_pair(r0, r1), Kokkos::ALL);
  else
    return Kokkos::subview(v, std::make_pair(r0, r1), Kokkos::ALL, Kokkos::ALL);
}
// From the pool (tokens of a SlimPack slice change every step: docs/runtime.md, "Buffers").
template <class V>
V alloc(BufferPool* pool, const char* label, std::int64_t rows, const V& like) {
  using T = typename V::non_const_value_type;
  if constexpr (V::rank == 1) {
    static_assert(std::is_same_v<V, Vec>, "alloc: a rank-1 field is a Vec");
    return newVec(pool, label, rows);
  } else if constexpr (V::rank == 2) {
    return newMatT<T>(pool, label, rows, static_cast<std::int64_t>(like.extent(1)));
  } else {
    return newAct3T<T>(pool, label, rows, static_cast<int>(like.extent(1)), static_cast<int>(like.extent(2)));
  }
}
template <class V>
V copyOf(const Space& space, BufferPool* pool, const V& v, std::int64_t r0, std::int64_t r1, const char* label) {
  if (v.extent(0) == 0) return V();
  V out = alloc(pool, label, r1 - r0, v);
  Kokkos::deep_copy(space, out, rowsOf(v, r0, r1));
  return out;
}
template <class A, class V>
V concatOf(const Space& space, BufferPool* pool, const std::vector<const A*>& parts, V A::*field, const char* label) {
  std::int64_t n = 0;
  const V& first = parts.front()->*field;
  if (first.extent(0) == 0 && parts.front()->rows() > 0) return V();  // not kept
  for (const A* p : parts) n += static_cast<std::int64_t>((p->*field).extent(0));
  V out = alloc(pool, label, n, first);
  std::int64_t at = 0;
  for (const A* p : parts) {
    const V& src = p->*field;
    const auto r = static_cast<std::int64_t>(src.extent(0));
    if (r > 0) Kokkos::deep_copy(space, rowsOf(out, at, at + r), src);
    at += r;
  }
  return out;
}
// Every field of LayerActsT, once: copyRows and concat walk the same list.
template <class T, class F>
void eachField(F&& f) {
  using A = LayerActsT<T>;
  f(&A::x, "wlb::runtime::x");
  f(&A::xn1, "wlb::runtime::xn1");
  f(&A::h, "wlb::runtime::h");
  f(&A::hn, "wlb::runtime::hn");
  f(&A::a1, "wlb::runtime::a1");
  f(&A::a3, "wlb::runtime::a3");
  f(&A::s, "wlb::runtime::s");
  f(&A::rstd1, "wlb::runtime::rstd1");
  f(&A::rstd2, "wlb::runtime::rstd2");
  f(&A::q, "wlb::runtime::q");
  f(&A::k, "wlb::runtime::k");
  f(&A::v, "wlb::runtime::v");
  f(&A::o, "wlb::runtime::o");
  f(&A::lse, "wlb::runtime::lse");
}
}  // namespace

template <class T>
LayerActsT<T> LayerActsT<T>::copyRows(const Space& space, BufferPool* pool, std::int64_t r0, std::int64_t r1) const {
  LayerActsT c;
  eachField<T>([&](auto field, const char* label) { c.*field = copyOf(space, pool, this->*field, r0, r1, label); });
  return c;
}

template <class T>
LayerActsT<T> LayerActsT<T>::concat(const Space& space, BufferPool* pool, const std::vector<const LayerActsT*>& parts) {
  if (parts.empty()) return {};
  if (parts.size() == 1) return *parts.front();
  LayerActsT c;
  eachField<T>([&](auto field, const char* label) { c.*field = concatOf(space, pool, parts, field, label); });
  return c;
}

template struct LayerActsT<float>;
template struct LayerActsT<bf16>;

// ---- SwiGLU ------------------------------------------------------------------------------
// On a host space the vectorised bodies (host_kernels.hpp) run over chunks: the scalar
// lambda's libm expf kept it from vectorising. Same labels either way.
namespace {

#if WLB_ATTN_HOST_SIMD
/// body(b, e) over [0, n) in chunks of simd::kChunk elements, a chunk per work item.
template <class Body>
void hostChunks(const Space& space, const char* label, std::int64_t n, Body body) {
  Kokkos::parallel_for(label, Policy(space, 0, (n + simd::kChunk - 1) / simd::kChunk),
                       [=](const std::int64_t c) { body(c * simd::kChunk, std::min(n, (c + 1) * simd::kChunk)); });
}
#endif

template <class T>
void swigluForward(const Space& space, const MatT<T>& a1, const MatT<T>& a3, const MatT<T>& s) {
  const std::int64_t n = static_cast<std::int64_t>(s.size());
#if WLB_ATTN_HOST_SIMD
  if constexpr (simd::kOnHost) {
    const T *x1 = a1.data(), *x3 = a3.data();
    T* y = s.data();
    hostChunks(space, "wlb::runtime::swiglu", n,
               [=](std::int64_t b, std::int64_t e) { simd::swiglu(x1, x3, y, b, e); });
    return;
  }
#endif
  Kokkos::parallel_for(
      "wlb::runtime::swiglu", Policy(space, 0, n), KOKKOS_LAMBDA(const std::int64_t i) {
        const float v = attention::toFloat(a1.data()[i]);
        s.data()[i] = attention::fromFloat<T>(v * sigmoid(v) * attention::toFloat(a3.data()[i]));
      });
}

/// da3 may be a3 (the backward writes d(a3) over a3, read for the last time).
template <class T>
void swigluBackward(const Space& space, const MatT<T>& a1, const MatT<T>& ds, const MatT<T>& da1, const MatT<T>& da3) {
  const std::int64_t n = static_cast<std::int64_t>(ds.size());
#if WLB_ATTN_HOST_SIMD
  if constexpr (simd::kOnHost) {
    const T *x1 = a1.data(), *d = ds.data();
    T *y1 = da1.data(), *y3 = da3.data();
    hostChunks(space, "wlb::runtime::swiglu_bwd", n,
               [=](std::int64_t b, std::int64_t e) { simd::swigluBackward(x1, y3, d, y1, y3, b, e); });
    return;
  }
#endif
  Kokkos::parallel_for(
      "wlb::runtime::swiglu_bwd", Policy(space, 0, n), KOKKOS_LAMBDA(const std::int64_t i) {
        const float v = attention::toFloat(a1.data()[i]), sg = sigmoid(v), d = attention::toFloat(ds.data()[i]);
        const float a3v = attention::toFloat(da3.data()[i]);
        da1.data()[i] = attention::fromFloat<T>(d * a3v * sg * (1.0f + v * (1.0f - sg)));
        da3.data()[i] = attention::fromFloat<T>(d * v * sg);
      });
}

}  // namespace

// ---- the parts around the attention ----------------------------------------------------
// With BF16 storage the residual stream (x, h, y) and the gradients outside the MLP stay
// FP32; what the GEMMs and the attention read is BF16 (norm outputs, Q/K/V/O, the MLP's
// activations and their gradients, and rounded copies of dy, dh, dQ/dK/dV), their products
// accumulate in FP32.

// Selective recomputation (pipeline.recompute = "selective"): the forward drops the norms'
// outputs and the SwiGLU product, the backward computes them again from what it kept. The
// same kernels on the same inputs give the same bits, so gradients equal the kept ones'.
namespace {
/// rmsNorm(x) in storage type T from the pool; its rstd (the kept one's bits) is dropped.
template <class T>
MatT<T> normAgain(const LayerEnv& env, const Mat& x, const Vec& gain, const char* label) {
  const auto n = static_cast<std::int64_t>(x.extent(0));
  MatT<T> y = newMatT<T>(env.pool, label, n, static_cast<std::int64_t>(x.extent(1)));
  const Vec rstd = newVec(env.pool, "wlb::runtime::rstd_again", n);
  rmsNorm<T>(*env.space, x, gain, env.norm_eps, y, rstd);
  return y;
}
/// hn and s of the MLP, as its forward made them.
template <class T>
void recomputeMlpInputs(const LayerEnv& env, const LayerParamsT<T>& w, LayerActsT<T>& a) {
  a.hn = normAgain<T>(env, a.h, w.norm2, "wlb::runtime::hn");
  a.s = newMatT<T>(env.pool, "wlb::runtime::s", a.rows(), static_cast<std::int64_t>(a.a1.extent(1)));
  swigluForward(*env.space, a.a1, a.a3, a.s);
}
}  // namespace

template <class T>
void qkvForward(const LayerEnv& env, const LayerShape& s, const LayerParamsT<T>& w, LayerActsT<T>& a, const IVec& pos) {
  const Space& space = *env.space;
  const std::int64_t n = a.rows();
  a.xn1 = newMatT<T>(env.pool, "wlb::runtime::xn1", n, s.hidden);
  a.rstd1 = newVec(env.pool, "wlb::runtime::rstd1", n);
  a.q = newAct3T<T>(env.pool, "wlb::runtime::q", n, s.heads, s.head_dim);
  a.k = newAct3T<T>(env.pool, "wlb::runtime::k", n, s.kv_heads, s.head_dim);
  a.v = newAct3T<T>(env.pool, "wlb::runtime::v", n, s.kv_heads, s.head_dim);
  Region r(env.recorder, trace::labels::kQkvProj, space, trace::Phase::Fwd,
           linearOpFlops(*env.cost, LinearOp::QkvProj, n, model::Phase::Fwd));
  rmsNorm<T>(space, a.x, w.norm1, env.norm_eps, a.xn1, a.rstd1);
  layerGemm(env, "qkv_proj.q.fwd", Trans::N, Trans::N, 1.0f, a.xn1, w.wq, 0.0f, flat(a.q));
  layerGemm(env, "qkv_proj.k.fwd", Trans::N, Trans::N, 1.0f, a.xn1, w.wk, 0.0f, flat(a.k));
  layerGemm(env, "qkv_proj.v.fwd", Trans::N, Trans::N, 1.0f, a.xn1, w.wv, 0.0f, flat(a.v));
  rope<T>(space, a.q, pos, *env.rope, 1.0f);
  rope<T>(space, a.k, pos, *env.rope, 1.0f);
  if (env.recompute_selective) a.xn1 = MatT<T>();  // the backward normalises x again
}

template <class T>
Mat outMlpForward(const LayerEnv& env, const LayerParamsT<T>& w, LayerActsT<T>& a) {
  const Space& space = *env.space;
  trace::Recorder* rec = env.recorder;
  const std::int64_t n = a.rows(), hidden = static_cast<std::int64_t>(w.wo.extent(1)),
                     ffn = static_cast<std::int64_t>(w.w1.extent(1));
  const auto F = model::Phase::Fwd;
  const auto P = trace::Phase::Fwd;
  // Output projection + residual: h = x + O Wo (the TP ranks' partial products summed).
  a.h = newMat(env.pool, "wlb::runtime::h", n, hidden);
  {
    Region r(rec, trace::labels::kOutProj, space, P, linearOpFlops(*env.cost, LinearOp::OutProj, n, F));
    layerGemm(env, "out_proj.fwd", Trans::N, Trans::N, 1.0f, flat(a.o), w.wo, 0.0f, a.h);
  }
  tpAllreduce(env, a.h, false);
  {
    Region r(rec, trace::labels::kOutProj, space, P);  // the residual, after the TP sum
    addInto(space, a.h, a.x);
  }
  // SwiGLU MLP + residual: y = h + (silu(hn W1) * (hn W3)) W2, hn = norm2(h).
  Mat y = newMat(env.pool, "wlb::runtime::y", n, hidden);
  {
    Region r(rec, trace::labels::kMlp, space, P, linearOpFlops(*env.cost, LinearOp::Mlp, n, F));
    a.hn = newMatT<T>(env.pool, "wlb::runtime::hn", n, hidden);
    a.rstd2 = newVec(env.pool, "wlb::runtime::rstd2", n);
    rmsNorm<T>(space, a.h, w.norm2, env.norm_eps, a.hn, a.rstd2);
    a.a1 = newMatT<T>(env.pool, "wlb::runtime::a1", n, ffn);
    a.a3 = newMatT<T>(env.pool, "wlb::runtime::a3", n, ffn);
    a.s = newMatT<T>(env.pool, "wlb::runtime::s", n, ffn);
    layerGemm(env, "mlp.w1.fwd", Trans::N, Trans::N, 1.0f, a.hn, w.w1, 0.0f, a.a1);
    layerGemm(env, "mlp.w3.fwd", Trans::N, Trans::N, 1.0f, a.hn, w.w3, 0.0f, a.a3);
    swigluForward(space, a.a1, a.a3, a.s);
    layerGemm(env, "mlp.w2.fwd", Trans::N, Trans::N, 1.0f, a.s, w.w2, 0.0f, y);
    if (env.recompute_selective) a.hn = a.s = MatT<T>();  // the backward computes them again
  }
  tpAllreduce(env, y, false);
  {
    Region r(rec, trace::labels::kMlp, space, P);  // the residual, after the TP sum
    addInto(space, y, a.h);
  }
  return y;
}

template <class T>
Act3T<T> outMlpBackward(const LayerEnv& env, const LayerParamsT<T>& w, const LayerParams& g, LayerActsT<T>& a,
                        const Mat& dy, Mat& dh) {
  const Space& space = *env.space;
  trace::Recorder* rec = env.recorder;
  const std::int64_t n = a.rows(), hidden = static_cast<std::int64_t>(w.wo.extent(1)),
                     ffn = static_cast<std::int64_t>(w.w1.extent(1));
  const auto B = model::Phase::Bwd;
  const auto P = trace::Phase::Bwd;
  // MLP backward: dhn = d(MLP)/dhn (summed over TP), then dh = dy + norm2'(dhn).
  if (env.recompute_selective) {
    Region r(rec, trace::labels::kRecompute, space, P);
    recomputeMlpInputs(env, w, a);
  }
  Mat dhn = newMat(env.pool, "wlb::runtime::dhn", n, hidden);
  {
    Region r(rec, trace::labels::kMlp, space, P, linearOpFlops(*env.cost, LinearOp::Mlp, n, B));
    const MatT<T> dyt = stored<T>(env, dy, "wlb::runtime::dy_bf16");
    // ds in the storage type, as the forward's a1 and a3: with BF16 it is the GEMM's FP32
    // sum rounded once, read once by the SwiGLU backward (an FP32 ds would be the step's
    // largest temporary, [tokens][ffn]: 3.8 GB at 64K tokens of Llama-3-8B).
    const MatT<T> ds = newMatT<T>(env.pool, "wlb::runtime::ds", n, ffn);
    layerGemm(env, "mlp.w2.wgrad", Trans::T, Trans::N, 1.0f, a.s, dyt, 1.0f, g.w2);  // dW2 += s^T dy
    layerGemm(env, "mlp.w2.dgrad", Trans::N, Trans::T, 1.0f, dyt, w.w2, 0.0f, ds);   // ds = dy W2^T
    // s and a3 are read here for the last time: their storage takes d(a1) and d(a3)
    MatT<T> da3 = a.a3, da1 = a.s;
    swigluBackward(space, a.a1, ds, da1, da3);
    layerGemm(env, "mlp.w1.wgrad", Trans::T, Trans::N, 1.0f, a.hn, da1, 1.0f, g.w1);  // dW1 += hn^T da1
    layerGemm(env, "mlp.w3.wgrad", Trans::T, Trans::N, 1.0f, a.hn, da3, 1.0f, g.w3);  // dW3 += hn^T da3
    layerGemm(env, "mlp.w1.dgrad", Trans::N, Trans::T, 1.0f, da1, w.w1, 0.0f, dhn);   // dhn = da1 W1^T
    layerGemm(env, "mlp.w3.dgrad", Trans::N, Trans::T, 1.0f, da3, w.w3, 1.0f, dhn);   //     + da3 W3^T
  }
  a.a1 = a.a3 = a.s = MatT<T>();
  tpAllreduce(env, dhn, true);
  dh = newMat(env.pool, "wlb::runtime::dh", n, hidden);
  {
    Region r(rec, trace::labels::kMlp, space, P);
    Kokkos::deep_copy(space, dh, dy);  // residual
    rmsNormBackward(space, env.pool, a.h, w.norm2, a.rstd2, dhn, dh, g.norm2);
  }
  a.hn = MatT<T>();
  a.rstd2 = Vec();
  // Output projection backward.
  Act3T<T> d_o =
      newAct3T<T>(env.pool, "wlb::runtime::dO", n, static_cast<int>(a.o.extent(1)), static_cast<int>(a.o.extent(2)));
  {
    Region r(rec, trace::labels::kOutProj, space, P, linearOpFlops(*env.cost, LinearOp::OutProj, n, B));
    const MatT<T> dht = stored<T>(env, dh, "wlb::runtime::dh_bf16");
    layerGemm(env, "out_proj.wgrad", Trans::T, Trans::N, 1.0f, flat(a.o), dht, 1.0f, g.wo);  // dWo += O^T dh
    layerGemm(env, "out_proj.dgrad", Trans::N, Trans::T, 1.0f, dht, w.wo, 0.0f, flat(d_o));  // dO = dh Wo^T
  }
  return d_o;
}

template <class T>
Mat qkvBackward(const LayerEnv& env, const LayerParamsT<T>& w, const LayerParams& g, const LayerActsT<T>& a,
                const Act3& dq, const Act3& dk, const Act3& dv, const Mat& dh, const IVec& pos) {
  const Space& space = *env.space;
  const std::int64_t n = a.rows(), hidden = static_cast<std::int64_t>(w.wq.extent(0));
  // dx = dh + norm1'(dq Wq^T + dk Wk^T + dv Wv^T), with RoPE undone on dq and dk first.
  MatT<T> xn1 = a.xn1;
  if (env.recompute_selective) {
    Region r(env.recorder, trace::labels::kRecompute, space, trace::Phase::Bwd);
    xn1 = normAgain<T>(env, a.x, w.norm1, "wlb::runtime::xn1");
  }
  Mat dxn = newMat(env.pool, "wlb::runtime::dxn1", n, hidden);
  {
    Region r(env.recorder, trace::labels::kQkvProj, space, trace::Phase::Bwd,
             linearOpFlops(*env.cost, LinearOp::QkvProj, n, model::Phase::Bwd));
    rope<float>(space, dq, pos, *env.rope, -1.0f);
    rope<float>(space, dk, pos, *env.rope, -1.0f);
    // [tokens][heads * head_dim] views of the gradients, in storage type T
    const MatT<T> dqt = stored<T>(env, flat(dq), "wlb::runtime::dq_bf16"),
                  dkt = stored<T>(env, flat(dk), "wlb::runtime::dk_bf16"),
                  dvt = stored<T>(env, flat(dv), "wlb::runtime::dv_bf16");
    layerGemm(env, "qkv_proj.q.wgrad", Trans::T, Trans::N, 1.0f, xn1, dqt, 1.0f, g.wq);
    layerGemm(env, "qkv_proj.k.wgrad", Trans::T, Trans::N, 1.0f, xn1, dkt, 1.0f, g.wk);
    layerGemm(env, "qkv_proj.v.wgrad", Trans::T, Trans::N, 1.0f, xn1, dvt, 1.0f, g.wv);
    layerGemm(env, "qkv_proj.q.dgrad", Trans::N, Trans::T, 1.0f, dqt, w.wq, 0.0f, dxn);
    layerGemm(env, "qkv_proj.k.dgrad", Trans::N, Trans::T, 1.0f, dkt, w.wk, 1.0f, dxn);
    layerGemm(env, "qkv_proj.v.dgrad", Trans::N, Trans::T, 1.0f, dvt, w.wv, 1.0f, dxn);
  }
  xn1 = MatT<T>();  // a recomputed copy goes back to the pool here, as it did inside the region
  tpAllreduce(env, dxn, true);
  Mat dx = newMat(env.pool, "wlb::runtime::dx", n, hidden);
  {
    Region r(env.recorder, trace::labels::kQkvProj, space, trace::Phase::Bwd);
    Kokkos::deep_copy(space, dx, dh);  // residual
    rmsNormBackward(space, env.pool, a.x, w.norm1, a.rstd1, dxn, dx, g.norm1);
  }
  return dx;
}

#define WLB_LAYER_PARTS(T)                                                                                         \
  template void qkvForward<T>(const LayerEnv&, const LayerShape&, const LayerParamsT<T>&, LayerActsT<T>&,          \
                              const IVec&);                                                                        \
  template Mat outMlpForward<T>(const LayerEnv&, const LayerParamsT<T>&, LayerActsT<T>&);                          \
  template Act3T<T> outMlpBackward<T>(const LayerEnv&, const LayerParamsT<T>&, const LayerParams&, LayerActsT<T>&, \
                                      const Mat&, Mat&);                                                           \
  template Mat qkvBackward<T>(const LayerEnv&, const LayerParamsT<T>&, const LayerParams&, const LayerActsT<T>&,   \
                              const Act3&, const Act3&, const Act3&, const Mat&, const IVec&);
WLB_LAYER_PARTS(float)
WLB_LAYER_PARTS(bf16)
#undef WLB_LAYER_PARTS

// ---- layer step ----------------------------------------------------------------------

LayerStep::LayerStep(const LayerEnv& env, const Llama& model, int layer, const cp::ShardPlan& plan,
                     const cp::CommPlan& comm, const LayerStep* like)
    : env_(env), model_(&model), layer_(layer) {
  if (env.bf16Storage() && !model.hasWorkingCopy())
    throw std::logic_error("runtime::LayerStep: BF16 storage needs a model with a BF16 working copy");
  int cp_rank = 0;
  MPI_Comm_rank(env.cp_comm, &cp_rank);
  n_ = plan.ranks[static_cast<std::size_t>(cp_rank)].tokens;
  DistAttentionOptions opt;
  opt.kernel = env.kernel;
  opt.cost = env.cost;
  opt.recorder = env.recorder;
  opt.group = env.cp_group;
  opt.pool = env.pool;
  const LayerShape s = LayerShape::of(model.config());
  attn_ = std::make_unique<DistributedAttention>(plan, comm, env.cp_comm, s.heads, s.kv_heads, s.head_dim, opt,
                                                 like && like->attn_ ? like->attn_.get() : nullptr);
}

std::int64_t LayerStep::savedBytes() const {
  return acts_.bytes() + bacts_.bytes() + (attn_ ? attn_->heldKvBytes() : 0);
}

template <class T>
LayerActsT<T>& LayerStep::acts() {
  if constexpr (std::is_same_v<T, bf16>)
    return bacts_;
  else
    return acts_;
}

Mat LayerStep::forward(const Mat& x, const IVec& pos, bool keep) {
  return env_.bf16Storage() ? forwardT<bf16>(x, pos, keep) : forwardT<float>(x, pos, keep);
}

Mat LayerStep::backward(const Mat& dy, const IVec& pos) {
  return env_.bf16Storage() ? backwardT<bf16>(dy, pos) : backwardT<float>(dy, pos);
}

template <class T>
Mat LayerStep::forwardT(const Mat& x, const IVec& pos, bool keep) {
  const Space& space = *env_.space;
  const LayerShape s = LayerShape::of(model_->config());
  const LayerParamsT<T>& w = model_->working<T>(layer_);
  LayerActsT<T>& a = acts<T>();
  a.x = x;
  qkvForward(env_, s, w, a, pos);
  // Attention (KV exchange inside).
  a.o = newAct3T<T>(env_.pool, "wlb::runtime::o", n_, s.heads, s.head_dim);
  a.lse = newMat(env_.pool, "wlb::runtime::lse", n_, s.heads);
  attn_->forward(space, a.q, a.k, a.v, a.o, a.lse);
  attn_seconds_ = attn_->times().attn_fwd;
  Mat y = outMlpForward(env_, w, a);
  if (!keep) {
    kk::fence(space, "wlb::runtime::layer::fwd");
    a = LayerActsT<T>();
    attn_->releaseKv();  // keeps only the maps a later layer may share
  }
  return y;
}

template <class T>
Mat LayerStep::backwardT(const Mat& dy, const IVec& pos) {
  const Space& space = *env_.space;
  const LayerShape s = LayerShape::of(model_->config());
  const LayerParamsT<T>& w = model_->working<T>(layer_);
  const LayerParams& g = model_->grads(layer_);
  LayerActsT<T>& a = acts<T>();
  Mat dh;
  const Act3T<T> d_o = outMlpBackward(env_, w, g, a, dy, dh);
  // Attention backward (dK/dV return inside).
  Act3 dq = newAct3(env_.pool, "wlb::runtime::dq", n_, s.heads, s.head_dim);
  Act3 dk = newAct3(env_.pool, "wlb::runtime::dk", n_, s.kv_heads, s.head_dim);
  Act3 dv = newAct3(env_.pool, "wlb::runtime::dv", n_, s.kv_heads, s.head_dim);
  attn_->backward(space, a.q, a.o, a.lse, d_o, dq, dk, dv);
  attn_seconds_ += attn_->times().attn_bwd;
  a.o = Act3T<T>();
  a.lse = typename LayerActsT<T>::Lse();
  Mat dx = qkvBackward(env_, w, g, a, dq, dk, dv, dh, pos);
  kk::fence(space, "wlb::runtime::layer::bwd");
  a = LayerActsT<T>();
  return dx;
}

}  // namespace wlb::runtime
