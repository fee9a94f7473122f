// wlb-timeout: 120
// Runtime building blocks: the GEMM wrapper against a naive product, per-op linear FLOPs
// against the cost model, layer-shape validation, the transformer layer's backward
// (RMSNorm, RoPE, GQA attention, SwiGLU) against finite differences (single rank, cp = 1),
// and the vectorised host kernels (SwiGLU, cross-entropy, RMSNorm) against double.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/bf16.hpp"
#include "core/error.hpp"
#include "core/types.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"
#include "model/memory.hpp"
#include "pp/schedule.hpp"
#include "runtime/gemm.hpp"
#include "runtime/host_kernels.hpp"
#include "runtime/layer.hpp"
#include "runtime/llama.hpp"
#include "runtime/op_timer.hpp"
#include "runtime/pipeline.hpp"
#include "runtime/pool.hpp"
#include "runtime/tokens.hpp"
#include "trace/recorder.hpp"

using namespace wlb;
using namespace wlb::runtime;

namespace {

model::ModelDims dims(int hidden, int heads, int kv_heads, int ffn) {
  model::ModelDims d;
  d.hidden = hidden;
  d.heads = heads;
  d.kv_heads = kv_heads;
  d.head_dim = hidden / heads;
  d.ffn = ffn;
  d.layers = 1;
  d.vocab = 100;
  d.dtype_bytes = 4;
  return d;
}

Mat randomMat(std::int64_t r, std::int64_t c, unsigned seed) {
  Mat m("m", r, c);
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  auto h = Kokkos::create_mirror_view(m);
  for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = u(g);
  Kokkos::deep_copy(m, h);
  return m;
}

template <class V>  // a float Mat or Vec
std::vector<float> host(const V& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.size());
}

// Labelled kernels for the kernel-timing test (a device lambda may not live in a test body).
void fill(const Vec& v, const char* label) {
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<Space>(0, static_cast<std::int64_t>(v.extent(0))),
      KOKKOS_LAMBDA(const std::int64_t i) { v(i) = static_cast<float>(i); });
}
double sum(const Vec& v) {
  double s = 0;
  Kokkos::parallel_reduce(
      "wlb::test::sum", Kokkos::RangePolicy<Space>(0, static_cast<std::int64_t>(v.extent(0))),
      KOKKOS_LAMBDA(const std::int64_t i, double& a) { a += v(i); }, s);
  return s;
}

}  // namespace

// --kernel-timing: while the timer is active the hooks time every labelled kernel and deep
// copy under its label, nothing while it is not, one hook set at a time, and once they are
// gone nothing reaches the timer.
TEST(RuntimeOpTimer, KernelHooksTimeLabelledKernelsWhileActive) {
  OpTimer timer;
  const Vec v("wlb::test::v", 1000), w("wlb::test::w", 1000);
  {
    KernelHooks hooks(timer);
    EXPECT_THROW(KernelHooks second(timer), std::logic_error);
    fill(v, "wlb::test::before");  // inactive
    timer.setStrategy("s");
    timer.setActive(true);
    for (int i = 0; i < 3; ++i) fill(v, "wlb::test::fill");
    EXPECT_EQ(sum(v), 499500.0);
    Kokkos::deep_copy(w, v);
    timer.setActive(false);
    fill(v, "wlb::test::fill");
  }
  timer.setActive(true);
  fill(v, "wlb::test::after");
  std::map<std::string, std::int64_t> calls;
  for (const auto& r : timer.rows()) {
    EXPECT_EQ(r.strategy, "s");
    EXPECT_GE(r.seconds, 0.0);
    calls[r.name] = r.calls;
  }
  const std::map<std::string, std::int64_t> want{
      {"wlb::test::fill", 3}, {"wlb::test::sum", 1}, {"deep_copy wlb::test::w", 1}};
  EXPECT_EQ(calls, want);
  KernelHooks again(timer);  // the first one is gone
}

TEST(RuntimeGemm, AllTransposeCombinationsMatchNaive) {
  Space space;
  const int m = 13, n = 7, k = 21;
  for (Trans ta : {Trans::N, Trans::T})
    for (Trans tb : {Trans::N, Trans::T}) {
      Mat a = ta == Trans::N ? randomMat(m, k, 1) : randomMat(k, m, 1);
      Mat b = tb == Trans::N ? randomMat(k, n, 2) : randomMat(n, k, 2);
      Mat c = randomMat(m, n, 3);
      const auto c0 = host(c), ha = host(a), hb = host(b);
      gemm(space, ta, tb, 0.5f, a, b, 2.0f, c);
      const auto hc = host(c);
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
          double s = 0;
          for (int l = 0; l < k; ++l) {
            const float av = ta == Trans::N ? ha[i * k + l] : ha[l * m + i];
            const float bv = tb == Trans::N ? hb[l * n + j] : hb[j * k + l];
            s += static_cast<double>(av) * bv;
          }
          EXPECT_NEAR(hc[i * n + j], 0.5 * s + 2.0 * c0[i * n + j], 1e-4);
        }
    }
  Mat bad("bad", 3, 3);
  EXPECT_THROW(gemm(space, Trans::N, Trans::N, 1, randomMat(2, 4, 1), randomMat(3, 3, 1), 0, bad),
               std::invalid_argument);
}

// BF16 storage: the products of BF16 operands equal the FP32 products of the rounded
// operands (the host widens them: bit for bit; cuBLAS accumulates the BF16 products in FP32
// on tensor cores in another order than its FP32 GEMM: within FP32 rounding, which the
// H100 showed in the last bits), a BF16 C is that result rounded once.
TEST(RuntimeGemm, Bf16OperandsMatchTheirFp32Products) {
  Space space;
  const int m = 9, n = 11, k = 37;
  auto rounded = [&](const Mat& f) {
    BMat b("b", f.extent(0), f.extent(1));
    convert<bf16>(space, f, b);
    Mat w("w", f.extent(0), f.extent(1));
    widen(space, b, w);
    return std::make_pair(b, w);
  };
  for (Trans ta : {Trans::N, Trans::T})
    for (Trans tb : {Trans::N, Trans::T}) {
      const auto [ab, af] = rounded(ta == Trans::N ? randomMat(m, k, 4) : randomMat(k, m, 4));
      const auto [bb, bf] = rounded(tb == Trans::N ? randomMat(k, n, 5) : randomMat(n, k, 5));
      Mat c32 = randomMat(m, n, 6), c = randomMat(m, n, 6);
      gemm(space, ta, tb, 0.5f, af, bf, 2.0f, c32);
      gemm(space, ta, tb, 0.5f, ab, bb, 2.0f, c);
      if constexpr (std::is_same_v<Space, Kokkos::DefaultHostExecutionSpace>) {
        EXPECT_EQ(host(c), host(c32));
      } else {
        const auto h = host(c), h32 = host(c32);
        for (std::size_t i = 0; i < h.size(); ++i)
          EXPECT_NEAR(h[i], h32[i], 1e-5 * std::max(1.0f, std::fabs(h32[i]))) << i;
      }
      // BF16 C, beta = 0: the FP32 result rounded once.
      BMat cb("cb", m, n);
      gemm(space, ta, tb, 1.0f, ab, bb, 0.0f, cb);
      Mat ref("ref", m, n), back("back", m, n);
      gemm(space, ta, tb, 1.0f, af, bf, 0.0f, ref);
      widen(space, cb, back);
      const auto hr = host(ref), hb = host(back);
      for (std::size_t i = 0; i < hr.size(); ++i) EXPECT_EQ(hb[i], attention::roundBf16(hr[i])) << i;
    }
  BMat bad("bad", 3, 3);
  EXPECT_THROW(gemm(space, Trans::N, Trans::N, 1, BMat("a", 2, 4), BMat("b", 3, 3), 0, bad), std::invalid_argument);
}

#if WLB_ATTN_HOST_SIMD
// The vectorised host SwiGLU (host_kernels.hpp) against the scalar formula in double, FP32
// and BF16 storage, every ragged length up to a few vectors and chunk boundaries inside the
// array: each element the same whatever the range it was computed in, NaN kept, arguments
// far into the saturated tails of the sigmoid, and the backward writing d(a3) over a3.
TEST(RuntimeHostKernels, SwigluMatchesTheScalarFormula) {
  namespace att = wlb::attention;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-12.0f, 12.0f);
  const int n = 301;
  std::vector<float> a1(n), a3(n), ds(n);
  for (int i = 0; i < n; ++i) a1[i] = u(rng), a3[i] = u(rng) / 4, ds[i] = u(rng) / 8;
  a1[0] = -100.0f, a1[1] = 100.0f, a1[2] = 0.0f, a1[3] = std::nanf("");
  const auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  std::vector<float> s(n), whole(n);
  simd::swiglu(a1.data(), a3.data(), whole.data(), 0, n);
  for (int i = 0; i < n; ++i) {
    if (i == 3) {
      EXPECT_TRUE(std::isnan(whole[i]));
      continue;
    }
    const double ref = a1[i] * sig(a1[i]) * a3[i];
    EXPECT_NEAR(whole[i], ref, 4e-7 * std::abs(ref) + 1e-30) << "element " << i << " a1 " << a1[i];
  }
  for (int len = 1; len <= 40; ++len)  // ragged ends through the padded copy: the same bits
    for (int b = 0; b + len <= n; b += 37) {
      std::fill(s.begin(), s.end(), -1.0f);
      simd::swiglu(a1.data(), a3.data(), s.data(), b, b + len);
      for (int i = 0; i < n; ++i) {
        if (i < b || i >= b + len) {
          ASSERT_EQ(s[i], -1.0f) << "written outside [" << b << ", " << b + len << ")";
        } else if (i != 3) {
          ASSERT_EQ(s[i], whole[i]) << "element " << i << " of [" << b << ", " << b + len << ")";
        }
      }
    }
  // backward, d(a3) over a3
  std::vector<float> da1(n), a3w = a3;
  simd::swigluBackward(a1.data(), a3w.data(), ds.data(), da1.data(), a3w.data(), 0, n);
  for (int i = 4; i < n; ++i) {
    const double sg = sig(a1[i]), r1 = ds[i] * a3[i] * sg * (1.0 + a1[i] * (1.0 - sg)), r3 = ds[i] * a1[i] * sg;
    // 1 + a1 (1 - sg) cancels near a1 = -1.28: the error scales with its terms, not its sum
    const double scale1 = std::abs(ds[i] * a3[i] * sg) * (1.0 + std::abs(a1[i] * (1.0 - sg)));
    EXPECT_NEAR(da1[i], r1, 1e-6 * scale1 + 1e-30) << "element " << i;
    EXPECT_NEAR(a3w[i], r3, 1e-6 * std::abs(r3) + 1e-30) << "element " << i;
  }
  EXPECT_TRUE(std::isnan(da1[3]) && std::isnan(a3w[3]));
  // BF16 storage: the float result rounded once (inputs exact in BF16)
  std::vector<att::bf16> h1(n), h3(n), hs(n);
  for (int i = 0; i < n; ++i) h1[i] = att::toBf16(a1[i]), h3[i] = att::toBf16(a3[i]);
  std::vector<float> r1(n), r3(n), rs(n);
  for (int i = 0; i < n; ++i) r1[i] = att::toFloat(h1[i]), r3[i] = att::toFloat(h3[i]);
  simd::swiglu(r1.data(), r3.data(), rs.data(), 0, n);
  simd::swiglu(h1.data(), h3.data(), hs.data(), 0, n);
  for (int i = 0; i < n; ++i) {
    if (i == 3) {
      EXPECT_TRUE(std::isnan(att::toFloat(hs[i])));
    } else {
      EXPECT_EQ(hs[i].bits, att::toBf16(rs[i]).bits) << "element " << i;
    }
  }
}

// The vectorised host cross-entropy of one row against double: rows shorter than a vector,
// ragged and whole, the target anywhere (first, last, in the ragged end), the gradient in
// place over FP32 logits and in BF16, and the loss alone.
TEST(RuntimeHostKernels, CrossEntropyRowMatchesDouble) {
  namespace att = wlb::attention;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-30.0f, 30.0f);
  for (std::int64_t V : {1, 3, 8, 9, 17, 256, 1001}) {
    std::vector<float> z(V);
    for (auto& x : z) x = u(rng);
    for (std::int64_t target : {std::int64_t{0}, V / 2, V - 1}) {
      double mx = -1e300, sum = 0;
      for (float x : z) mx = std::max(mx, static_cast<double>(x));
      for (float x : z) sum += std::exp(x - mx);
      const double lse = mx + std::log(sum), scale = 0.25;
      SCOPED_TRACE("V=" + std::to_string(V) + " target=" + std::to_string(target));
      std::vector<float> zz = z;
      EXPECT_NEAR(simd::crossEntropyRow<float>(zz.data(), V, target, 0.25f, nullptr), lse - z[target],
                  1e-6 * std::abs(lse) + 1e-6);
      EXPECT_EQ(zz, z);  // the loss alone writes nothing
      std::vector<att::bf16> dl(V);
      const float l2 = simd::crossEntropyRow(zz.data(), V, target, 0.25f, dl.data());
      const float l1 = simd::crossEntropyRow(zz.data(), V, target, 0.25f, zz.data());  // in place
      EXPECT_EQ(l1, l2);
      for (std::int64_t j = 0; j < V; ++j) {
        const double p = std::exp(z[j] - lse), g = (p - (j == target ? 1.0 : 0.0)) * scale;
        // z - lse in float (a few ulp of |lse| in the exponent), then the float result rounded
        EXPECT_NEAR(zz[j], g, 4e-7 * (std::abs(lse) + 1.0) * p * scale + 1.2e-7 * std::abs(g) + 1e-12) << "j=" << j;
        EXPECT_EQ(dl[j].bits, att::toBf16(zz[j]).bits) << "j=" << j;
      }
    }
  }
}

// The vectorised host RMSNorm rows against double: every row length class (shorter than a
// vector, ragged, whole), the forward's rstd and output (FP32 and BF16), the backward adding
// into dx, and the gain gradient over a block of rows.
TEST(RuntimeHostKernels, RmsNormRowsMatchDouble) {
  namespace att = wlb::attention;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const float eps = 1e-5f;
  for (std::int64_t h : {1, 5, 8, 13, 16, 37, 256}) {
    SCOPED_TRACE("h=" + std::to_string(h));
    const std::int64_t rows = 5, ld = h + 3;  // padded row stride
    std::vector<float> x(rows * ld), dy(rows * ld), g(h), rstd(rows);
    for (auto& v : x) v = u(rng);
    for (auto& v : dy) v = u(rng);
    for (auto& v : g) v = u(rng);
    for (std::int64_t i = 0; i < rows; ++i) {
      const float* xi = x.data() + i * ld;
      double ss = 0;
      for (std::int64_t j = 0; j < h; ++j) ss += static_cast<double>(xi[j]) * xi[j];
      const double r = 1.0 / std::sqrt(ss / h + eps);
      std::vector<float> y(h);
      std::vector<att::bf16> yb(h);
      rstd[i] = simd::rmsNormRow(xi, g.data(), eps, h, y.data());
      EXPECT_EQ(simd::rmsNormRow(xi, g.data(), eps, h, yb.data()), rstd[i]);
      EXPECT_NEAR(rstd[i], r, 1e-6 * r);
      for (std::int64_t j = 0; j < h; ++j) {
        EXPECT_NEAR(y[j], xi[j] * r * g[j], 1e-6 * std::abs(xi[j] * r * g[j]) + 1e-7) << "j=" << j;
        EXPECT_EQ(yb[j].bits, att::toBf16(y[j]).bits) << "j=" << j;
      }
      // backward: dx += r (g dy - x r mean(g dy x r)), into a dx that already holds 1
      const float* dyi = dy.data() + i * ld;
      double dot = 0;
      for (std::int64_t j = 0; j < h; ++j) dot += static_cast<double>(g[j]) * dyi[j] * xi[j] * rstd[i];
      dot /= h;
      std::vector<float> dx(h, 1.0f);
      simd::rmsNormBackwardRow(xi, g.data(), dyi, rstd[i], h, dx.data());
      for (std::int64_t j = 0; j < h; ++j) {
        const double ref = 1.0 + rstd[i] * (g[j] * dyi[j] - xi[j] * rstd[i] * dot);
        EXPECT_NEAR(dx[j], ref, 1e-5 * (1.0 + std::abs(ref))) << "j=" << j;
      }
    }
    // gain gradient over rows [1, 4)
    std::vector<float> part(h, -7.0f);
    simd::gainGradRows(x.data(), ld, dy.data(), ld, rstd.data(), 1, 4, h, part.data());
    for (std::int64_t j = 0; j < h; ++j) {
      double ref = 0, mag = 0;
      for (std::int64_t i = 1; i < 4; ++i) {
        ref += static_cast<double>(dy[i * ld + j]) * x[i * ld + j] * rstd[i];
        mag += std::abs(static_cast<double>(dy[i * ld + j]) * x[i * ld + j] * rstd[i]);
      }
      EXPECT_NEAR(part[j], ref, 1e-6 * mag + 1e-12) << "j=" << j;
    }
  }
}

// The embedding gradient's host body: each column's rows summed from 0 in the order given and
// then added, the same bits as the device kernel's loop, for widths with and without a
// ragged tail of the vector blocks, repeated and unsorted rows and an empty row range.
TEST(RuntimeHostKernels, SumRowsIsTheOrderedSum) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  const std::int64_t ld = 300, nrows = 40;
  std::vector<float> x(nrows * ld);
  for (auto& v : x) v = u(rng);
  const std::vector<std::int32_t> rows = {7, 3, 3, 39, 0, 12, 25, 7, 18, 31, 2};
  for (std::int64_t h : {1, 5, 8, 37, 64, 129, 256, 300})
    for (std::int64_t b : {0, 4})
      for (std::int64_t e : {b, b + 1, static_cast<std::int64_t>(rows.size())}) {
        std::vector<float> out(h), ref(h);
        for (std::int64_t j = 0; j < h; ++j) out[j] = ref[j] = u(rng);
        simd::sumRowsInto(x.data(), ld, rows.data(), b, e, h, out.data());
        for (std::int64_t j = 0; j < h; ++j) {
          float acc = 0.0f;
          for (std::int64_t k = b; k < e; ++k) acc += x[rows[k] * ld + j];
          ref[j] += acc;
        }
        EXPECT_EQ(out, ref) << "h=" << h << " rows [" << b << ", " << e << ")";
      }
}
#endif

TEST(RuntimeFlops, LinearOpsSumToCostModel) {
  for (int tp : {1, 2}) {
    model::CostModel cost(dims(256, 4, 2, 704), model::HardwareProfile::analytic(), tp);
    for (auto ph : {model::Phase::Fwd, model::Phase::Bwd}) {
      const double sum = linearOpFlops(cost, LinearOp::QkvProj, 1000, ph) +
                         linearOpFlops(cost, LinearOp::OutProj, 1000, ph) +
                         linearOpFlops(cost, LinearOp::Mlp, 1000, ph);
      EXPECT_NEAR(sum / cost.linearFlops(1000, ph), 1.0, 1e-12);
    }
  }
}

TEST(RuntimeLayerShape, SplitsOverTpAndRejectsIndivisible) {
  const auto s = LayerShape::fromDims(dims(256, 4, 2, 704), 2);
  EXPECT_EQ(s.heads, 2);
  EXPECT_EQ(s.kv_heads, 1);
  EXPECT_EQ(s.ffn, 352);
  EXPECT_THROW(LayerShape::fromDims(dims(256, 4, 2, 704), 4), InputError);  // kv_heads 2 % 4
  EXPECT_THROW(LayerShape::fromDims(dims(256, 4, 2, 702), 4), InputError);
}

// dL/dx and dL/dw (every weight of the layer: norms, projections, MLP) of L = sum(y * g)
// against central differences in random directions.
TEST(RuntimeLayer, BackwardMatchesFiniteDifferences) {
  const auto d = dims(32, 2, 1, 48);
  model::CostModel cost(d, model::HardwareProfile::analytic(), 1);
  const LlamaConfig mc = LlamaConfig::of(d);
  Llama model(mc, 7);
  MicroBatch mb;
  mb.segments = {Segment{1, 0, 9, 0}, Segment{2, 0, 14, 0}};
  CpConfig cfg;
  const cp::ShardPlan plan = cp::planShards(mb, "per_document", 1, cost, cfg);
  const cp::CommPlan comm = cp::planComm(plan, cp::CommMode::AllGather, cost);
  Space space;
  RopeTable rope(mc.headDim(), 10000.0);
  rope.ensure(space, 16);
  LayerEnv env;
  env.space = &space;
  env.cp_comm = MPI_COMM_SELF;
  env.cost = &cost;
  env.rope = &rope;
  std::vector<TokenRef> refs;
  for (const auto& s : mb.segments) appendSegmentRows(s, false, refs);
  const TokenRows rows = TokenRows::make(space, SyntheticTokens(1, mc.vocab), refs, mc.vocab);
  const std::int64_t T = mb.tokens();
  Mat x = randomMat(T, d.hidden, 11), g = randomMat(T, d.hidden, 12), dir = randomMat(T, d.hidden, 13);

  auto loss = [&](const Mat& xin) {
    LayerStep st(env, model, 0, plan, comm);
    const auto y = host(st.forward(xin, rows.positions));
    const auto hg = host(g);
    double l = 0;
    for (std::size_t i = 0; i < y.size(); ++i) l += static_cast<double>(y[i]) * hg[i];
    return l;
  };
  model.zeroGrads(space);
  LayerStep st(env, model, 0, plan, comm);
  st.forward(x, rows.positions);
  const auto dx = host(st.backward(g, rows.positions));
  const auto hdir = host(dir);
  double analytic = 0;
  for (std::size_t i = 0; i < dx.size(); ++i) analytic += static_cast<double>(dx[i]) * hdir[i];
  const float eps = 1e-2f;
  auto shifted = [&](float s) {
    Mat xs("xs", T, d.hidden);
    auto hx = host(x);
    auto h = Kokkos::create_mirror_view(xs);
    for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = hx[i] + s * hdir[i];
    Kokkos::deep_copy(xs, h);
    return xs;
  };
  const double numeric = (loss(shifted(eps)) - loss(shifted(-eps))) / (2.0 * eps);
  EXPECT_NEAR(analytic, numeric, 2e-2 * std::max(1.0, std::abs(numeric)));

  // Weight gradients, tensor by tensor, in a random direction.
  const Mat wflat(model.weights().data(), 1, model.paramCount());
  const auto w0 = host(Mat(wflat));
  const Mat gflat(model.grads().data(), 1, model.paramCount());
  const auto grad = host(gflat);
  const auto wdir = host(randomMat(1, model.paramCount(), 14));
  for (const auto& t : model.tensors()) {
    if (t.name == "embed" || t.name == "norm_f" || t.name == "head") continue;  // not the layer's
    double an_w = 0;
    for (std::int64_t i = t.offset; i < t.offset + t.size; ++i)
      an_w += static_cast<double>(grad[static_cast<std::size_t>(i)]) * wdir[static_cast<std::size_t>(i)];
    auto setW = [&](float s) {
      auto h = Kokkos::create_mirror_view(wflat);
      for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = w0[i];
      for (std::int64_t i = t.offset; i < t.offset + t.size; ++i) h.data()[i] += s * wdir[static_cast<std::size_t>(i)];
      Kokkos::deep_copy(wflat, h);
    };
    setW(eps);
    const double lp = loss(x);
    setW(-eps);
    const double lm = loss(x);
    setW(0);
    const double num_w = (lp - lm) / (2.0 * eps);
    EXPECT_NEAR(an_w, num_w, 2e-2 * std::max(1.0, std::abs(num_w))) << t.name;
  }
}

// The activation pool: a segment's piece comes back once no view of it is alive, requests
// of the same row bucket share it, zeroing on request; free segments stay cached until
// released; a piece serves requests of any shape and type it holds.
TEST(RuntimePool, ReusesFreedBlocksByRowBucket) {
  Space space;
  BufferPool pool(space);
  EXPECT_EQ(BufferPool::bucketRows(1), 64);
  EXPECT_EQ(BufferPool::bucketRows(1000), 1024);
  EXPECT_EQ(BufferPool::bucketRows(1025), 1280);  // granularity 2048 / 8
  const float* first = nullptr;
  {
    Mat a = pool.mat("a", 1000, 16);
    EXPECT_EQ(a.extent(0), 1000u);
    first = a.data();
    Mat b = pool.mat("b", 1000, 16);  // a is alive: a second block
    EXPECT_NE(b.data(), first);
    EXPECT_EQ(pool.misses(), 2);
  }
  Mat c = pool.mat("c", 990, 16, true);  // same bucket, both free again
  EXPECT_EQ(pool.misses(), 2);
  EXPECT_EQ(pool.hits(), 1);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), c);
  for (std::size_t i = 0; i < h.size(); ++i) ASSERT_EQ(h.data()[i], 0.0f);
  {
    BAct3 e = pool.bact3("e", 2000, 4, 4);  // 2000 x 16 BF16 fit the free 1024 x 16 floats
    EXPECT_EQ(pool.misses(), 2);
    EXPECT_EQ(e.extent(0), 2000u);
    EXPECT_EQ(e.extent(2), 4u);
    EXPECT_NE(static_cast<const void*>(e.data()), static_cast<const void*>(c.data()));
    EXPECT_EQ(e.use_count(), 2);  // the view and the pool: the piece's own record
  }
  EXPECT_EQ(pool.mat("d", 1000, 17).extent(1), 17u);    // larger than the free block: a miss,
  EXPECT_EQ(pool.misses(), 3);                          // which replaces that block
  EXPECT_EQ(pool.cachedBytes(), 4 * 1024 * (16 + 17));  // the free blocks stay cached
  pool.releaseFree();                                   // until released; c's is held
  EXPECT_EQ(pool.cachedBytes(), 4 * 1024 * 16);
  EXPECT_EQ(pool.act3("e", 0, 2, 4).extent(0), 0u);
}

// The pool's peaks: bytes of the pieces in use at once, and what their requests asked for
// (a piece holds the request's row bucket, so the two differ), from one reset to the next.
TEST(RuntimePool, CountsPeakBytesInUseAndAsked) {
  Space space;
  BufferPool pool(space);
  const std::int64_t row = 4 * 16;  // one row of 16 floats
  {
    Mat a = pool.mat("a", 1000, 16), b = pool.mat("b", 100, 16);
    EXPECT_EQ(pool.peakLiveBytes(), row * (1024 + BufferPool::bucketRows(100)));
    EXPECT_EQ(pool.peakRequestedBytes(), row * 1100);
  }
  { Mat c = pool.mat("c", 1000, 16); }  // the peak stays until reset
  EXPECT_EQ(pool.peakRequestedBytes(), row * 1100);
  pool.resetPeaks();
  {
    Mat d = pool.mat("d", 300, 16);  // 320 rows from the front of a's 1024
    EXPECT_EQ(pool.peakLiveBytes(), row * 320);
    EXPECT_EQ(pool.peakRequestedBytes(), row * 300);
  }
  EXPECT_EQ(pool.cachedBytes(), row * (1024 + BufferPool::bucketRows(100)));
}

// Requests alive at once are carved from one free segment, front first; a freed piece
// merges with its free neighbours, so the whole segment serves a whole-segment request
// again; a free piece between pieces in use serves only what it holds.
TEST(RuntimePool, SplitsSegmentsAndMergesFreedPieces) {
  Space space;
  BufferPool pool(space);
  const std::int64_t row = 4 * 16;
  const float* base = nullptr;
  {
    Mat a = pool.mat("a", 2048, 16);
    base = a.data();
  }
  {
    Mat b = pool.mat("b", 1000, 16), c = pool.mat("c", 1000, 16);  // buckets of 1024 rows
    EXPECT_EQ(pool.misses(), 1);
    EXPECT_EQ(pool.segments(), 1);
    EXPECT_EQ(b.data(), base);
    EXPECT_EQ(c.data(), base + 1024 * 16);
    EXPECT_EQ(pool.peakLiveBytes(), row * 2048);
  }
  {
    Mat d = pool.mat("d", 2048, 16);  // b's and c's pieces merged back
    EXPECT_EQ(d.data(), base);
    EXPECT_EQ(pool.misses(), 1);
  }
  {
    Mat e = pool.mat("e", 512, 16), f = pool.mat("f", 512, 16), g = pool.mat("g", 512, 16);
    EXPECT_EQ(g.data(), base + 1024 * 16);
    f = Mat();  // free: rows 512-1023 and 1536-2047, not adjacent
    Mat h = pool.mat("h", 1024, 16);
    EXPECT_EQ(pool.misses(), 2);  // no free piece of 1024 rows: a segment of its own
    EXPECT_EQ(pool.segments(), 2);
    g = Mat();  // rows 512-2047 merge into one free piece
    Mat i = pool.mat("i", 1536, 16);
    EXPECT_EQ(i.data(), base + 512 * 16);
    EXPECT_EQ(pool.misses(), 2);
  }
  EXPECT_EQ(pool.cachedBytes(), row * (2048 + 1024));
  pool.releaseFree();
  EXPECT_EQ(pool.cachedBytes(), 0);
}

// A view that outlives its pool keeps its memory: its piece's record holds the segment.
TEST(RuntimePool, ViewOutlivesThePool) {
  Space space;
  Mat kept;
  {
    BufferPool pool(space);
    kept = pool.mat("kept", 100, 16, true);
    Mat other = pool.mat("other", 100, 16);
    EXPECT_EQ(kept.use_count(), 2);
  }
  EXPECT_EQ(kept.use_count(), 1);
  Kokkos::deep_copy(kept, 1.5f);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), kept);
  for (std::size_t i = 0; i < h.size(); ++i) ASSERT_EQ(h.data()[i], 1.5f);
}

// A larger request replaces a wholly free segment too small for it instead of caching a
// second set; smaller requests are carved from the smallest free piece that holds them; a
// failed allocation gives back every wholly free segment before it fails.
TEST(RuntimePool, GrowsSegmentsInsteadOfKeepingOnePerBucket) {
  Space space;
  BufferPool pool(space);
  { Mat a = pool.mat("a", 1000, 16); }  // bucket 1024
  const float* grown = nullptr;
  {
    Mat b = pool.mat("b", 2000, 16);  // bucket 2048: replaces a's free segment
    grown = b.data();
    EXPECT_EQ(pool.misses(), 2);
    EXPECT_EQ(pool.cachedBytes(), 4 * 2048 * 16);
  }
  {
    Mat c = pool.mat("c", 1000, 16), d = pool.mat("d", 128, 16);  // both from the grown one
    EXPECT_EQ(c.data(), grown);
    EXPECT_EQ(d.data(), grown + 1024 * 16);
    EXPECT_EQ(pool.misses(), 2);
    EXPECT_EQ(pool.hits(), 2);
  }
  {
    Mat big = pool.mat("big", 2048, 16);  // holds the whole segment
    Mat e = pool.mat("e", 120, 16);       // a segment of its own (128 rows)
    EXPECT_EQ(pool.misses(), 3);
  }
  {
    Mat f = pool.mat("f", 100, 16);  // best fit: the 128-row segment, not the 2048
    EXPECT_NE(f.data(), grown);
    EXPECT_EQ(pool.misses(), 3);
  }
  Mat held = pool.mat("held", 64, 8);  // best fit of any shape: the 128 x 16 segment
  EXPECT_EQ(pool.misses(), 3);
#if !defined(__SANITIZE_ADDRESS__)
  // 2^40 rows of 16 floats cannot be allocated: the free segments go, the error stays.
  EXPECT_THROW(pool.mat("huge", std::int64_t{1} << 40, 16), std::exception);
  EXPECT_EQ(pool.cachedBytes(), 4 * 128 * 16);
#endif
  pool.releaseFree();
  EXPECT_EQ(pool.cachedBytes(), 4 * 128 * 16);  // held is alive
}

// A full pool (here a capacity; on a GPU a failed allocation) gives back only the free
// blocks it must, the one used longest ago first, and keeps the rest of its cache; with
// nothing free left to give the request fails, naming its label.
TEST(RuntimePool, GivesBackTheOldestFreeBlocksOnlyAsFarAsNeeded) {
  Space space;
  const std::int64_t block = 4 * 64 * 16, wide = 4 * 64 * 17;  // 64-row buckets of 16 / 17 floats
  BufferPool pool(space, 2 * block + wide);
  const float *a = nullptr, *c = nullptr;
  {
    Mat ma = pool.mat("a", 64, 16), mb = pool.mat("b", 64, 16), mc = pool.mat("c", 64, 16);
    a = ma.data();
    c = mc.data();
  }
  EXPECT_EQ(pool.cachedBytes(), 3 * block);
  { Mat again = pool.mat("a again", 64, 16); }  // a hit on a's block (the first that fits)
  EXPECT_EQ(pool.misses(), 3);
  EXPECT_EQ(pool.mat("e", 64, 17).extent(1), 17u);  // another shape: one block must go, b's
  EXPECT_EQ(pool.misses(), 4);
  EXPECT_EQ(pool.cachedBytes(), 2 * block + wide);
  Mat x = pool.mat("x", 64, 16), y = pool.mat("y", 64, 16);
  EXPECT_EQ(pool.misses(), 4);  // both served from the cache: a's and c's blocks
  EXPECT_TRUE((x.data() == a && y.data() == c) || (x.data() == c && y.data() == a));
  Mat z = pool.mat("z", 64, 16);  // the free 64 x 17 block holds it
  EXPECT_EQ(pool.misses(), 4);
  EXPECT_EQ(pool.cachedBytes(), 2 * block + wide);
  // Everything alive and too little room: the request fails and names itself.
  try {
    pool.mat("w", 64, 16);
    ADD_FAILURE() << "a request past the capacity with nothing free must fail";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("w ("), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.cachedBytes(), 2 * block + wide);  // nothing alive was given back
}

// The stage walker over a two-layer model on one rank: units a (two documents) and b, each
// whole (per-sequence shards, no CP).
struct SmallStage : ::testing::Test {
  model::ModelDims d = [] {
    model::ModelDims m = dims(32, 2, 1, 48);
    m.vocab = 50;
    m.layers = 2;
    return m;
  }();
  LlamaConfig mc = LlamaConfig::of(d);
  model::CostModel cost{d, model::HardwareProfile::analytic(), 1};
  Space space;
  SyntheticTokens tokens{3, mc.vocab};
  MicroBatch a{{Segment{1, 0, 90, 0}, Segment{2, 0, 17, 0}}}, b{{Segment{3, 0, 40, 0}}};

  LayerEnv env(Precision p = Precision::Fp32, bool selective = false) {
    LayerEnv e;
    e.space = &space;
    e.cp_comm = MPI_COMM_SELF;
    e.cost = &cost;
    e.precision = e.kernel.precision = p;
    e.recompute_selective = selective;
    return e;
  }
  StageStepInput input(const std::vector<MicroBatch>& mbs) const {
    StageStepInput in;
    in.tokens = &tokens;
    in.mbs = mbs;
    for (auto& pl :
         cp::planReplicaShards(in.mbs, cp::Strategy::PerSequence, cp::CommMode::AllGather, 1, cost, CpConfig{})) {
      in.shards.push_back(pl.shard);
      in.comms.push_back(pl.comm);
    }
    for (const MicroBatch& m : mbs) in.mb_tokens.push_back(m.tokens());
    return in;
  }
};

// A step walked twice over the same units allocates nothing the second time.
TEST_F(SmallStage, RepeatedStepAllocatesNothing) {
  Llama model(mc, 5);
  const LayerEnv e = env();
  const pp::Schedule sched = pp::makeOneFOneB(1, 2);  // the stage keeps a pointer
  PipelineStage stage(e, model, sched, MPI_COMM_SELF);
  const StageStepInput in = input({a, b});
  const StageStepResult r1 = stage.run(in, 0);
  const StageStepResult r2 = stage.run(in, 0);
  EXPECT_GT(r1.allocations, 0);
  EXPECT_EQ(r2.allocations, 0);
  EXPECT_EQ(r1.loss, r2.loss);  // the gradients accumulate, the weights do not move
}

// BF16 storage through the stage walker: no allocation in a repeated step either, and the
// activations kept from forward to backward are what the memory model says for 2-byte
// storage (about half of FP32's).
TEST_F(SmallStage, Bf16StepAllocatesNothingAndHalvesTheActivations) {
  std::int64_t peak[2] = {0, 0};
  for (int bf = 0; bf < 2; ++bf) {
    Llama model(mc, 5, bf ? Precision::Bf16 : Precision::Fp32);
    const LayerEnv e = env(bf ? Precision::Bf16 : Precision::Fp32);
    const pp::Schedule sched = pp::makeOneFOneB(1, 1);  // the stage keeps a pointer
    PipelineStage stage(e, model, sched, MPI_COMM_SELF);
    const StageStepInput in = input({a});
    const StageStepResult r1 = stage.run(in, 0);
    const StageStepResult r2 = stage.run(in, 0);
    EXPECT_GT(r1.allocations, 0);
    EXPECT_EQ(r2.allocations, 0);
    EXPECT_EQ(r1.loss, r2.loss);
    peak[bf] = r1.peak_activation_bytes;
    const std::int64_t layers =
        d.layers * model::executorLayerActivationBytes(d, 1, a.tokens(), a.tokens(), bf ? 2 : 4);
    EXPECT_EQ(r1.peak_activation_bytes, layers + model::executorHeadBytes(d, a.tokens())) << (bf ? "bf16" : "fp32");
  }
  EXPECT_LT(peak[1], 0.65 * peak[0]);
}

// pipeline.recompute = "selective": the norms' outputs and the SwiGLU product are computed
// again in the backward, from the same inputs by the same kernels, so the loss and every
// gradient equal the kept ones' bit for bit (FP32 and BF16 storage), and the activations
// kept from forward to backward shrink by what the memory model says. The recomputation is
// recorded as `recompute` events of its own (one before the MLP's backward, one before the
// QKV projection's, per layer and micro-batch), outside the ops `wlb profile` times.
TEST_F(SmallStage, SelectiveRecomputeKeepsTheGradientsAndDropsItsActivations) {
  for (int bf = 0; bf < 2; ++bf) {
    const Precision prec = bf ? Precision::Bf16 : Precision::Fp32;
    std::vector<float> grads[2];
    double loss[2] = {0, 0};
    std::int64_t peak[2] = {0, 0};
    for (int sel = 0; sel < 2; ++sel) {
      Llama model(mc, 5, prec);
      trace::Recorder rec;
      LayerEnv e = env(prec, sel == 1);
      e.recorder = &rec;
      const pp::Schedule sched = pp::makeOneFOneB(1, 2);  // the stage keeps a pointer
      PipelineStage stage(e, model, sched, MPI_COMM_SELF);
      const StageStepResult r = stage.run(input({a, b}), 0);
      loss[sel] = r.loss;
      peak[sel] = r.peak_activation_bytes;
      grads[sel] = host(model.grads());
      std::map<std::string, int> events;
      for (const auto& ev : rec.events()) {
        const std::string& l = rec.regions()[static_cast<std::size_t>(ev.region)];
        ++events[l];
        if (l == trace::labels::kRecompute) {
          EXPECT_EQ(ev.phase, trace::Phase::Bwd);
          EXPECT_EQ(ev.flops, 0.0);
        }
      }
      EXPECT_EQ(events[trace::labels::kRecompute], sel ? 2 * 2 * 2 : 0);  // 2 per layer and unit
      EXPECT_GT(events[trace::labels::kMlp], 0);
    }
    EXPECT_EQ(loss[0], loss[1]);
    EXPECT_EQ(grads[0], grads[1]) << (bf ? "bf16" : "fp32");
    const std::int64_t storage = bf ? 2 : 4, n = a.tokens();  // a is the larger micro-batch
    const std::int64_t dropped = d.layers * (model::executorLayerActivationBytes(d, 1, n, n, storage) -
                                             model::executorLayerActivationBytes(d, 1, n, n, storage, -1, true));
    EXPECT_EQ(dropped, d.layers * n * storage * (2 * d.hidden + d.ffn));
    EXPECT_EQ(peak[0] - peak[1], dropped) << (bf ? "bf16" : "fp32");
  }
}

// The synthetic token ids of generated length streams (tokens.hpp), pinned: the PyTorch
// peer (bench/torch_step.py) computes the same numbers.
TEST(RuntimeTokens, SyntheticIdsArePinned) {
  EXPECT_EQ(SyntheticTokens(2026, 128256).token(0, 0), 91126);
  EXPECT_EQ(SyntheticTokens(1234, 256).token(7, 100), 76);
  EXPECT_EQ(SyntheticTokens((std::uint64_t{1} << 40) + 3, 32000).token((DocId{1} << 31) + 5, 123456), 3095);
}
