// wlb-timeout: 600
// Attention kernels vs the double-precision reference: forward O/LSE, backward dQ/dK/dV,
// on random document mixes, CP-style pieces (key prefix longer than the queries), shared
// keys, GQA, head_dim 64/128, several tile shapes, both the host SIMD and portable paths;
// plus a finite-difference gradient check on tiny cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "attention/attention.hpp"
#include "attention/reference.hpp"
#include "attention/split_kv.hpp"

namespace att = wlb::attention;
using ES = Kokkos::DefaultExecutionSpace;
using V3 = Kokkos::View<float***, Kokkos::LayoutRight, ES::memory_space>;
using V2 = Kokkos::View<float**, Kokkos::LayoutRight, ES::memory_space>;

namespace {

struct Case {
  std::vector<att::PieceRange> pieces;
  std::int64_t q_tokens = 0, k_tokens = 0;
  int heads = 2, kv_heads = 1, head_dim = 64;
};

std::vector<float> randomVec(std::size_t n, std::mt19937& rng, float amp = 1.0f) {
  std::normal_distribution<float> nd(0.0f, amp);
  std::vector<float> x(n);
  for (auto& e : x) e = nd(rng);
  return x;
}

V3 toView(const std::vector<float>& x, std::int64_t t, int h, int d, const char* name) {
  V3 v(std::string(name), static_cast<std::size_t>(t), static_cast<std::size_t>(h), static_cast<std::size_t>(d));
  auto hv = Kokkos::create_mirror_view(v);
  std::copy(x.begin(), x.end(), hv.data());
  Kokkos::deep_copy(v, hv);
  return v;
}
template <class V>
std::vector<float> toVec(const V& v) {
  auto hv = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(hv.data(), hv.data() + hv.size());
}
/// max |a - b| / max |b| (tensor-wise relative error; elementwise is ill-posed near 0)
double relErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return den > 0 ? num / den : num;
}

/// Whole documents packed back to back (queries = keys).
Case docsCase(const std::vector<std::int64_t>& lens, int heads, int kv, int d) {
  Case c;
  c.heads = heads;
  c.kv_heads = kv;
  c.head_dim = d;
  std::int64_t off = 0;
  for (auto l : lens) {
    c.pieces.push_back({off, off + l, off, off + l});
    off += l;
  }
  c.q_tokens = c.k_tokens = off;
  return c;
}

/// CP-style pieces: each document is split into pieces of its query range; each piece's
/// keys are the document prefix up to its last query, stored in its own key buffer range
/// (so keys are duplicated across pieces) — or shared when `share` (one copy per document).
Case cpCase(const std::vector<std::int64_t>& lens, int chunks, bool share, int heads, int kv, int d) {
  Case c;
  c.heads = heads;
  c.kv_heads = kv;
  c.head_dim = d;
  std::int64_t qoff = 0, koff = 0;
  for (auto l : lens) {
    for (int i = 0; i < chunks; ++i) {
      const std::int64_t a = l * i / chunks, b = l * (i + 1) / chunks;
      if (b == a) continue;
      const std::int64_t kb = share ? koff : koff;
      c.pieces.push_back({qoff, qoff + (b - a), kb, kb + b});
      qoff += b - a;
      if (!share) koff += b;
    }
    if (share) koff += l;
  }
  c.q_tokens = qoff;
  c.k_tokens = koff;
  return c;
}

struct Result {
  std::vector<float> o, lse, dq, dk, dv;
};

struct Inputs {
  std::vector<float> q, k, v, dO;
};

Inputs makeInputs(const Case& c, unsigned seed) {
  std::mt19937 rng(seed);
  Inputs in;
  const std::size_t nq = c.q_tokens * c.heads * c.head_dim, nk = c.k_tokens * c.kv_heads * c.head_dim;
  in.q = randomVec(nq, rng, 1.0f);
  in.k = randomVec(nk, rng, 1.0f);
  in.v = randomVec(nk, rng, 1.0f);
  in.dO = randomVec(nq, rng, 1.0f);
  return in;
}

Result runKernel(const Case& c, const Inputs& in, const att::KernelConfig& cfg, bool bwd = true, int bwd_calls = 1) {
  const auto batch = att::VarlenBatch::fromRanges(c.pieces);
  const int H = c.heads, Hk = c.kv_heads, D = c.head_dim;
  V3 q = toView(in.q, c.q_tokens, H, D, "q"), k = toView(in.k, c.k_tokens, Hk, D, "k"),
     v = toView(in.v, c.k_tokens, Hk, D, "v"), dO = toView(in.dO, c.q_tokens, H, D, "dO");
  const std::size_t tq = c.q_tokens, tk = c.k_tokens, h = H, hk = Hk, d = D;
  V3 o("o", tq, h, d), dq("dq", tq, h, d), dk("dk", tk, hk, d), dv("dv", tk, hk, d);
  V2 lse("lse", tq, h);
  ES space;
  att::forward(space, q, k, v, batch, o, lse, cfg);
  Result r;
  r.o = toVec(o);
  r.lse = toVec(lse);
  if (bwd) {
    for (int i = 0; i < bwd_calls; ++i) att::backward(space, q, k, v, o, lse, dO, batch, dq, dk, dv, cfg);
    r.dq = toVec(dq);
    r.dk = toVec(dk);
    r.dv = toVec(dv);
  }
  return r;
}

Result runReference(const Case& c, const Inputs& in, bool bwd = true) {
  att::reference::Dims dims{c.heads, c.kv_heads, c.head_dim, 0.0f};
  Result r;
  r.o.assign(in.q.size(), 0.0f);
  r.lse.assign(c.q_tokens * c.heads, 0.0f);
  att::reference::forward(in.q, in.k, in.v, c.pieces, dims, r.o, r.lse);
  if (bwd) {
    r.dq.assign(in.q.size(), 0.0f);
    r.dk.assign(in.k.size(), 0.0f);
    r.dv.assign(in.k.size(), 0.0f);
    att::reference::backward(in.q, in.k, in.v, in.dO, c.pieces, dims, r.dq, r.dk, r.dv);
  }
  return r;
}

void expectClose(const Case& c, const att::KernelConfig& cfg, unsigned seed, const char* what) {
  SCOPED_TRACE(what);
  SCOPED_TRACE("tile_q=" + std::to_string(cfg.tile_q) + " tile_k=" + std::to_string(cfg.tile_k) +
               " portable=" + std::to_string(cfg.path == att::KernelConfig::Path::Portable) +
               " D=" + std::to_string(c.head_dim) + " H=" + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads));
  const Inputs in = makeInputs(c, seed);
  const Result ref = runReference(c, in), got = runKernel(c, in, cfg);
  EXPECT_LE(relErr(got.o, ref.o), 1e-5);
  EXPECT_LE(relErr(got.lse, ref.lse), 1e-5);
  EXPECT_LE(relErr(got.dq, ref.dq), 1e-4);
  EXPECT_LE(relErr(got.dk, ref.dk), 1e-4);
  EXPECT_LE(relErr(got.dv, ref.dv), 1e-4);
}

std::vector<att::KernelConfig> configs() {
  std::vector<att::KernelConfig> v;
  for (auto [tq, tk] : {std::pair{64, 64}, {16, 16}, {32, 128}, {128, 32}}) {
    att::KernelConfig c;
    c.tile_q = tq;
    c.tile_k = tk;
    v.push_back(c);
  }
  att::KernelConfig p;
  p.path = att::KernelConfig::Path::Portable;
  v.push_back(p);
  return v;
}

}  // namespace

TEST(Attention, FlopAccounting) {
  EXPECT_DOUBLE_EQ(att::usefulPairs(4, 4), 10.0);
  EXPECT_DOUBLE_EQ(att::usefulPairs(2, 5), 2 * 3 + 3.0);
  att::KernelConfig cfg;  // 64 x 64
  EXPECT_DOUBLE_EQ(att::paddedPairs(1, 1, cfg), 64.0 * 64.0);
  EXPECT_DOUBLE_EQ(att::paddedPairs(128, 128, cfg), 3 * 64.0 * 64.0);
  EXPECT_DOUBLE_EQ(att::paddedPairs(64, 128, cfg), 2 * 64.0 * 64.0);
  EXPECT_DOUBLE_EQ(att::paddedPairs(10, 70, cfg), 2 * 64.0 * 64.0);
  const bool host = Kokkos::SpaceAccessibility<ES, Kokkos::HostSpace>::accessible;
  EXPECT_TRUE(att::usesHostKernels<ES>(64, cfg) || !host);
}

TEST(Attention, RejectsBadBatchesAndShapes) {
  EXPECT_THROW(att::VarlenBatch::fromRanges({{0, 5, 0, 3}}), std::invalid_argument);  // nq > nk
  EXPECT_THROW(att::VarlenBatch::fromRanges({{0, 5, 0, 5}, {4, 6, 5, 9}}), std::invalid_argument);
  EXPECT_THROW(att::VarlenBatch::fromCuSeqlens({0, 5, 3}, {0, 5, 9}), std::invalid_argument);
  EXPECT_THROW(att::VarlenBatch::fromCuSeqlens({0, 5}, {0, 5, 9}), std::invalid_argument);
  att::KernelConfig bad;
  bad.tile_q = 24;
  EXPECT_THROW(att::validateConfig(bad), std::invalid_argument);
  att::KernelConfig rows;
  rows.ws_bwd_rows = 96;
  EXPECT_THROW(att::validateConfig(rows), std::invalid_argument);
  rows.ws_bwd_rows = 64;
  EXPECT_NO_THROW(att::validateConfig(rows));
  const auto b = att::VarlenBatch::fromDocLengths({10});
  V3 q("q", 10, 2, 16), k("k", 10, 2, 16), v("v", 9, 2, 16), o("o", 10, 2, 16);
  V2 lse("lse", 10, 2);
  EXPECT_THROW(att::forward(ES(), q, k, v, b, o, lse), std::invalid_argument);
  V3 k3("k3", 10, 3, 16);
  EXPECT_THROW(att::forward(ES(), q, k3, k3, b, o, lse), std::invalid_argument);
}

TEST(Attention, RandomDocumentMixes) {
  std::mt19937 rng(7);
  std::vector<std::int64_t> lens{1, 1, 97, 3, 64, 17, 130, 1, 65, 200, 2};
  for (int d : {64, 128}) {
    for (auto hk : {std::pair{2, 1}, {4, 2}, {3, 3}}) {
      const Case c = docsCase(lens, hk.first, hk.second, d);
      for (const auto& cfg : configs()) expectClose(c, cfg, 11 + d, "docs");
      std::shuffle(lens.begin(), lens.end(), rng);
    }
  }
}

TEST(Attention, ContextParallelPiecesWithLongerKeyPrefix) {
  const std::vector<std::int64_t> lens{300, 1, 77, 150};
  for (int d : {64, 128}) {
    for (int chunks : {2, 3, 8}) {
      const Case c = cpCase(lens, chunks, false, 4, 2, d);
      for (const auto& cfg : configs()) expectClose(c, cfg, 5 + chunks, "cp pieces");
    }
  }
}

TEST(Attention, SharedKeysAccumulate) {
  // Pieces of one document share the same key buffer: dK/dV sum over pieces.
  const Case c = cpCase({257, 40, 129}, 4, true, 4, 1, 64);
  for (const auto& cfg : configs()) expectClose(c, cfg, 3, "shared keys");
}

TEST(Attention, BackwardAccumulatesAcrossCalls) {
  const Case c = docsCase({70, 33}, 2, 1, 64);
  const Inputs in = makeInputs(c, 21);
  for (const auto& cfg : configs()) {
    const Result one = runKernel(c, in, cfg, true, 1), two = runKernel(c, in, cfg, true, 2);
    std::vector<float> twice(one.dk.size());
    for (std::size_t i = 0; i < twice.size(); ++i) twice[i] = 2.0f * one.dk[i];
    EXPECT_LE(relErr(two.dk, twice), 1e-6);
  }
}

TEST(Attention, OtherHeadDimsUsePortablePath) {
  const Case c = docsCase({5, 40, 1}, 2, 1, 24);  // head_dim not a multiple of 16
  EXPECT_FALSE(att::usesHostKernels<ES>(24, att::KernelConfig{}));
  expectClose(c, att::KernelConfig{}, 9, "head_dim 24");
  const Case c32 = docsCase({5, 40, 1, 90}, 2, 2, 32);
  expectClose(c32, att::KernelConfig{}, 9, "head_dim 32");
}

TEST(Attention, EmptyAndZeroQueryPieces) {
  Case c;
  c.heads = 2;
  c.kv_heads = 1;
  c.head_dim = 64;
  c.pieces = {{0, 0, 0, 10}, {0, 5, 10, 20}, {5, 5, 20, 20}};
  c.q_tokens = 5;
  c.k_tokens = 20;
  for (const auto& cfg : configs()) expectClose(c, cfg, 4, "zero-query pieces");
}

TEST(Attention, LargeScoresStayFinite) {
  // Large-magnitude inputs exercise the running-max rescaling and exp underflow.
  const Case c = docsCase({150, 70}, 2, 1, 64);
  Inputs in = makeInputs(c, 8);
  for (auto& x : in.q) x *= 6.0f;
  for (auto& x : in.k) x *= 6.0f;
  const Result ref = runReference(c, in);
  for (const auto& cfg : configs()) {
    const Result got = runKernel(c, in, cfg);
    EXPECT_LE(relErr(got.o, ref.o), 1e-5);
    EXPECT_LE(relErr(got.lse, ref.lse), 1e-5);
    EXPECT_LE(relErr(got.dq, ref.dq), 1e-4);
    EXPECT_LE(relErr(got.dk, ref.dk), 1e-4);
    EXPECT_LE(relErr(got.dv, ref.dv), 1e-4);
  }
}

TEST(Attention, FiniteDifferenceGradients) {
  // L = sum(o * G): dL/dx by central differences of the kernel forward vs backward.
  for (const auto& cfg : configs()) {
    Case c = cpCase({6, 3}, 2, false, 2, 1, 16);
    Inputs in = makeInputs(c, 31);
    const Result base = runKernel(c, in, cfg);
    auto loss = [&](const Inputs& x) {
      const Result r = runKernel(c, x, cfg, false);
      double s = 0.0;
      for (std::size_t i = 0; i < r.o.size(); ++i) s += static_cast<double>(r.o[i]) * x.dO[i];
      return s;
    };
    const float eps = 2e-3f;
    auto check = [&](std::vector<float> Inputs::*field, const std::vector<float>& grad, const char* name) {
      for (std::size_t i = 0; i < grad.size(); i += 7) {
        Inputs p = in, m = in;
        (p.*field)[i] += eps;
        (m.*field)[i] -= eps;
        const double fd = (loss(p) - loss(m)) / (2.0 * eps);
        EXPECT_NEAR(fd, grad[i], 5e-3 + 1e-2 * std::fabs(fd)) << name << "[" << i << "]";
      }
    };
    check(&Inputs::q, base.dq, "dq");
    check(&Inputs::k, base.dk, "dk");
    check(&Inputs::v, base.dv, "dv");
  }
}

namespace {

using V3b = Kokkos::View<att::bf16***, Kokkos::LayoutRight, ES::memory_space>;

double modeTolerance(att::KernelConfig::Precision p) {
  using P = att::KernelConfig::Precision;
  return p == P::Fp32 ? 1e-4 : p == P::Tf32 ? 2e-3 : 1e-2;
}

/// BF16 storage: inputs rounded to bf16, outputs O in bf16, LSE and gradients in FP32.
Result runKernelBf16(const Case& c, const Inputs& in, const att::KernelConfig& cfg) {
  const auto batch = att::VarlenBatch::fromRanges(c.pieces);
  auto up = [](const std::vector<float>& x, std::int64_t t, int h, int d, const char* name) {
    V3b v(std::string(name), static_cast<std::size_t>(t), static_cast<std::size_t>(h), static_cast<std::size_t>(d));
    auto hv = Kokkos::create_mirror_view(v);
    for (std::size_t i = 0; i < x.size(); ++i) hv.data()[i] = att::toBf16(x[i]);
    Kokkos::deep_copy(v, hv);
    return v;
  };
  const int H = c.heads, Hk = c.kv_heads, D = c.head_dim;
  V3b q = up(in.q, c.q_tokens, H, D, "q"), k = up(in.k, c.k_tokens, Hk, D, "k"), v = up(in.v, c.k_tokens, Hk, D, "v"),
      dO = up(in.dO, c.q_tokens, H, D, "dO");
  const std::size_t tq = c.q_tokens, tk = c.k_tokens, h = H, hk = Hk, d = D;
  V3b o("o", tq, h, d);
  V3 dq("dq", tq, h, d), dk("dk", tk, hk, d), dv("dv", tk, hk, d);
  V2 lse("lse", tq, h);
  ES space;
  att::forward(space, q, k, v, batch, o, lse, cfg);
  att::backward(space, q, k, v, o, lse, dO, batch, dq, dk, dv, cfg);
  Result r;
  auto ho = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
  for (std::size_t i = 0; i < ho.size(); ++i) r.o.push_back(att::toFloat(ho.data()[i]));
  r.lse = toVec(lse);
  r.dq = toVec(dq);
  r.dk = toVec(dk);
  r.dv = toVec(dv);
  return r;
}

std::vector<Case> precisionCases() {
  return {docsCase({1, 17, 300, 100, 129}, 8, 2, 64), docsCase({1, 17, 300, 100}, 8, 2, 128),
          cpCase({300, 1, 77, 150}, 3, false, 4, 2, 64), cpCase({257, 40, 129}, 4, true, 4, 1, 128)};
}

}  // namespace

TEST(Attention, PrecisionModesOnFp32Storage) {
  // On a CUDA device these take the TF32 / BF16 tensor-core kernels; host and portable
  // paths compute in FP32 and pass the same bounds with room to spare.
  using P = att::KernelConfig::Precision;
  for (const auto& c : precisionCases())
    for (P p : {P::Fp32, P::Tf32, P::Bf16}) {
      att::KernelConfig cfg;
      cfg.precision = p;
      SCOPED_TRACE(std::string("precision ") + std::to_string(static_cast<int>(p)) + " kernel " +
                   att::kernelName<ES>(c.head_dim, cfg));
      const Inputs in = makeInputs(c, 17);
      const Result ref = runReference(c, in), got = runKernel(c, in, cfg);
      const double tol = modeTolerance(p);
      // gradients here follow the same mode's forward: a TF32 forward's O/LSE carry ~3e-4
      // error that the backward's rowsum(dO∘O) amplifies to ~2e-3 (bench_attention_gpu
      // also checks the backward alone, on exact O/LSE)
      const double gtol = p == P::Tf32 ? 5e-3 : tol;
      EXPECT_LE(relErr(got.o, ref.o), tol);
      EXPECT_LE(relErr(got.lse, ref.lse), tol);
      EXPECT_LE(relErr(got.dq, ref.dq), gtol);
      EXPECT_LE(relErr(got.dk, ref.dk), gtol);
      EXPECT_LE(relErr(got.dv, ref.dv), gtol);
    }
}

TEST(Attention, Bf16StorageMatchesReferenceOnRoundedInputs) {
  for (const auto& c : precisionCases()) {
    Inputs in = makeInputs(c, 23);
    for (auto* x : {&in.q, &in.k, &in.v, &in.dO})
      for (auto& e : *x) e = att::roundBf16(e);
    const Result ref = runReference(c, in);
    att::KernelConfig cfg;
    SCOPED_TRACE(std::string("kernel ") + att::kernelName<ES>(c.head_dim, cfg, true));
    const Result got = runKernelBf16(c, in, cfg);
    EXPECT_LE(relErr(got.o, ref.o), 1e-2);
    EXPECT_LE(relErr(got.lse, ref.lse), 1e-2);
    EXPECT_LE(relErr(got.dq, ref.dq), 1e-2);
    EXPECT_LE(relErr(got.dk, ref.dk), 1e-2);
    EXPECT_LE(relErr(got.dv, ref.dv), 1e-2);
  }
}

bool allFinite(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float e) { return std::isfinite(e); });
}

// Rows of the key and value buffers that no piece owns may hold anything (a pool's stale
// bytes, another call's data): no kernel may let them into O, the LSE or a gradient. The
// TMA kernel loads whole tiles past a piece's end, so this is its masking and V-zeroing
// contract; the others never read those rows.
TEST(Attention, NonFiniteKeysOutsidePiecesNeverReachTheOutputs) {
  Case c;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 64;
  c.pieces = {{0, 100, 0, 100}, {100, 150, 200, 250}, {150, 170, 300, 340}};
  c.q_tokens = 170;
  c.k_tokens = 400;
  Inputs in = makeInputs(c, 41);
  const std::size_t row = static_cast<std::size_t>(c.kv_heads) * c.head_dim;
  const std::vector<std::pair<std::int64_t, std::int64_t>> gaps = {{100, 200}, {250, 300}, {340, 400}};
  for (const auto& [r0, r1] : gaps)  // the rows no piece owns
    for (std::int64_t r = r0; r < r1; ++r)
      for (std::size_t e = 0; e < row; ++e) {
        in.k[r * row + e] = std::numeric_limits<float>::quiet_NaN();
        in.v[r * row + e] = std::numeric_limits<float>::infinity();
      }
  const Result ref = runReference(c, in);
  att::KernelConfig sync, ws;
  ASSERT_TRUE(att::setHopperVariant(sync, "sync"));
  ASSERT_TRUE(att::setHopperVariant(ws, "ws"));
  for (const att::KernelConfig& cfg : {sync, att::KernelConfig{}, ws}) {
    SCOPED_TRACE(std::string("kernel ") + att::kernelName<ES>(c.head_dim, cfg, true));
    const Result got = runKernelBf16(c, in, cfg);
    for (const auto* x : {&got.o, &got.lse, &got.dq, &got.dk, &got.dv}) EXPECT_TRUE(allFinite(*x));
    EXPECT_LE(relErr(got.o, ref.o), 1e-2);
    EXPECT_LE(relErr(got.lse, ref.lse), 1e-2);
  }
  const Result f32 = runKernel(c, in, att::KernelConfig{});
  for (const auto* x : {&f32.o, &f32.lse, &f32.dq, &f32.dk, &f32.dv}) EXPECT_TRUE(allFinite(*x));
  EXPECT_LE(relErr(f32.o, ref.o), 1e-5);
}

// The warp-specialised Hopper kernels (KernelConfig::warp_specialized, the forward, alone
// and with split-KV, and ws_backward with both its step heights at D = 64), on whole documents long enough to wrap its
// stage ring, short ones that leave consumer warpgroups without rows, CP pieces, a piece of few queries over long keys,
// and more work units (query tiles x heads) than an H100 has SMs, so that its persistent blocks walk several units
// each. Where the config selects no other kernel (every machine but a Hopper GPU) the tests above cover what runs.
TEST(Attention, WarpSpecializedMatchesReference) {
  att::KernelConfig ws, sync;
  ASSERT_TRUE(att::setHopperVariant(ws, "ws"));
  ASSERT_TRUE(att::setHopperVariant(sync, "sync"));
  if (std::string(att::kernelName<ES>(64, ws, true)) == att::kernelName<ES>(64, sync, true))
    GTEST_SKIP() << "the warp-specialised forward runs only on a Hopper GPU";
  std::vector<Case> cases = precisionCases();
  for (int d : {64, 128}) {
    cases.push_back(docsCase({1000, 513, 2, 700, 64, 129}, 8, 2, d));
    cases.push_back(docsCase({3000, 1000, 700, 129, 64, 2, 1}, 16, 4, d));  // 480 (D 64) / 688 (D 128) units
    cases.push_back(cpCase({3000, 260}, 4, true, 4, 1, d));
    Case longKeys;
    longKeys.heads = 4;
    longKeys.kv_heads = 1;
    longKeys.head_dim = d;
    longKeys.pieces = {{0, 100, 0, 17000}, {100, 356, 17000, 34000}};
    longKeys.q_tokens = 356;
    longKeys.k_tokens = 34000;
    cases.push_back(longKeys);
  }
  // The double-precision reference of these cases takes minutes on one core (most of it the
  // 3000-token mixes): each case's runs on a thread of its own, once for both configs.
  std::vector<Inputs> inputs;
  std::vector<std::future<Result>> refs;
  for (const auto& c : cases) {
    Inputs in = makeInputs(c, 29);
    for (auto* x : {&in.q, &in.k, &in.v, &in.dO})
      for (auto& e : *x) e = att::roundBf16(e);
    inputs.push_back(std::move(in));
  }
  for (std::size_t i = 0; i < cases.size(); ++i)
    refs.push_back(std::async(std::launch::async, [&, i] { return runReference(cases[i], inputs[i]); }));
  for (std::size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    const Inputs& in = inputs[ci];
    const Result ref = refs[ci].get();
    // the default backward tile, split-KV, and at D = 64 the backward's 64-row step
    for (int variant = 0; variant < (c.head_dim == 64 ? 3 : 2); ++variant) {
      att::KernelConfig cfg = ws;
      cfg.split_kv = variant == 1;
      cfg.ws_bwd_rows = variant == 2 ? 64 : 0;
      SCOPED_TRACE("D=" + std::to_string(c.head_dim) + " pieces=" + std::to_string(c.pieces.size()) +
                   " split=" + std::to_string(cfg.split_kv) + " bwd_rows=" + std::to_string(cfg.ws_bwd_rows));
      const Result got = runKernelBf16(c, in, cfg);
      for (const auto* x : {&got.o, &got.lse, &got.dq, &got.dk, &got.dv}) EXPECT_TRUE(allFinite(*x));
      EXPECT_LE(relErr(got.o, ref.o), 1e-2);
      EXPECT_LE(relErr(got.lse, ref.lse), 1e-2);
      EXPECT_LE(relErr(got.dq, ref.dq), 1e-2);
      EXPECT_LE(relErr(got.dk, ref.dk), 1e-2);
      EXPECT_LE(relErr(got.dv, ref.dv), 1e-2);
    }
  }
}

// The Hopper variants by name: each name round-trips, the default configuration is "auto"
// (the warp-specialised forward, the synchronous backward, no split-KV), and an unknown
// name leaves the configuration as it was.
TEST(Attention, HopperVariantsRoundTrip) {
  EXPECT_STREQ(att::hopperVariant(att::KernelConfig{}), "auto");
  EXPECT_TRUE(att::KernelConfig{}.warp_specialized);
  EXPECT_FALSE(att::KernelConfig{}.ws_backward);
  EXPECT_FALSE(att::KernelConfig{}.split_kv);
  for (const std::string& name : att::hopperVariants()) {
    att::KernelConfig cfg;
    ASSERT_TRUE(att::setHopperVariant(cfg, name));
    EXPECT_EQ(att::hopperVariant(cfg), name);
  }
  att::KernelConfig cfg;
  ASSERT_TRUE(att::setHopperVariant(cfg, "sync-split"));
  EXPECT_FALSE(att::setHopperVariant(cfg, "fast"));
  EXPECT_STREQ(att::hopperVariant(cfg), "sync-split");
  cfg.ws_backward = true;  // after the synchronous forward: no name gives it
  EXPECT_STREQ(att::hopperVariant(cfg), "custom");
}

TEST(Attention, Bf16Conversions) {
  EXPECT_EQ(att::toFloat(att::toBf16(1.0f)), 1.0f);
  EXPECT_EQ(att::toFloat(att::toBf16(-2.5f)), -2.5f);
  EXPECT_EQ(att::roundBf16(1.0f + 1.0f / 256.0f), 1.0f);                 // tie: to even (down)
  EXPECT_EQ(att::roundBf16(1.0f + 3.0f / 256.0f), 1.0f + 1.0f / 64.0f);  // tie: to even (up)
  EXPECT_TRUE(std::isnan(att::toFloat(att::toBf16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(att::toFloat(att::toBf16(std::numeric_limits<float>::infinity()))));
}

// Split-KV plan (the Hopper forward's work list): every visible key tile of every query
// tile exactly once, parts only for pieces with few queries over long keys, each part
// starting where every row of its tile sees a key, slots consecutive, longest first.
TEST(SplitKv, PlanCoversEveryVisibleKeyTileOnce) {
  const std::vector<att::PieceRange> pieces = {{0, 5000, 0, 5000},         // whole document: not split
                                               {5000, 5200, 5000, 45000},  // CP piece, 200 queries over 40K keys: split
                                               {5200, 5456, 0, 16384},     // 256 over 16K: the rule's edge, split
                                               {5456, 5713, 0, 20000},     // 257 queries: not split
                                               {5713, 5777, 20000, 120000}};  // 64 over 100K: split into the most parts
  const int bq = 128, bk = 128;
  const att::split_kv::Rule rule;
  const att::split_kv::Plan plan = att::split_kv::plan(pieces, bq, bk, rule);
  for (std::size_t i = 1; i < plan.items.size(); ++i) EXPECT_GE(plan.items[i - 1].cost, plan.items[i].cost);
  std::vector<int> slot_seen(plan.slots, 0);
  for (std::size_t pi = 0; pi < pieces.size(); ++pi) {
    const auto& p = pieces[pi];
    const bool eligible = p.nq() <= rule.max_queries && p.nk() >= rule.min_keys;
    for (std::int64_t t = 0; t * bq < p.nq(); ++t) {
      std::vector<att::split_kv::Item> mine;
      for (const auto& it : plan.items)
        if (it.piece == static_cast<int>(pi) && it.tile == t) mine.push_back(it);
      ASSERT_FALSE(mine.empty()) << pi << " " << t;
      std::sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      const std::int64_t tiles = att::split_kv::visibleTiles(p, t, bq, bk);
      EXPECT_EQ(mine.front().first, 0);
      EXPECT_EQ(mine.back().end, tiles);
      for (std::size_t s = 0; s < mine.size(); ++s) {
        if (s > 0) {
          EXPECT_EQ(mine[s].first, mine[s - 1].end);
        }
        EXPECT_LT(mine[s].first, mine[s].end);
        EXPECT_EQ(mine[s].cost, mine[s].end - mine[s].first);
        EXPECT_LE(static_cast<std::int64_t>(mine[s].first) * bk, t * bq + p.nk() - p.nq());
      }
      if (!eligible) {
        ASSERT_EQ(mine.size(), 1u);
        EXPECT_EQ(mine[0].slot, -1);
        continue;
      }
      EXPECT_GT(mine.size(), 1u) << "piece " << pi;
      EXPECT_LE(mine.size(), static_cast<std::size_t>(rule.max_parts));
      const auto g = std::find_if(plan.groups.begin(), plan.groups.end(),
                                  [&](const auto& x) { return x.piece == static_cast<int>(pi) && x.tile == t; });
      ASSERT_NE(g, plan.groups.end());
      ASSERT_EQ(g->parts, static_cast<int>(mine.size()));
      for (std::size_t s = 0; s < mine.size(); ++s) {
        EXPECT_EQ(mine[s].slot, g->slot0 + static_cast<int>(s));
        ++slot_seen[mine[s].slot];
        if (s + 1 < mine.size()) {
          EXPECT_GE(mine[s].cost, rule.min_tiles);
        }
      }
    }
  }
  for (int c : slot_seen) EXPECT_EQ(c, 1);
  EXPECT_EQ(att::split_kv::plan(pieces, bq, bk, {0, 0, 8, 16}).slots, 0);  // max_queries 0: nothing split
}

// The combine by LSE: the attention of one query row over its keys, computed in parts of
// the key range and merged, equals the whole row's (output and LSE).
TEST(SplitKv, CombinedPartsEqualTheWholeRow) {
  const int H = 2, Hkv = 1, D = 64, nk = 1000;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(H * D), k(static_cast<std::size_t>(nk) * Hkv * D), v(k.size());
  for (auto& x : q) x = 2.0f * nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  att::reference::Dims dims{H, Hkv, D, 0.0f};
  std::vector<float> o(H * D), lse(H);
  att::reference::forward(q, k, v, {{0, 1, 0, nk}}, dims, o, lse);  // one query: sees every key
  const std::vector<int> cuts = {0, 130, 131, 600, 1000};
  const int parts = static_cast<int>(cuts.size()) - 1;
  std::vector<float> op(static_cast<std::size_t>(parts) * H * D), lp(static_cast<std::size_t>(parts) * H);
  for (int s = 0; s < parts; ++s) {
    std::vector<float> os(H * D), ls(H);
    att::reference::forward(q, k, v, {{0, 1, cuts[s], cuts[s + 1]}}, dims, os, ls);
    for (int h = 0; h < H; ++h) {
      lp[h * parts + s] = ls[h];
      std::copy(os.begin() + h * D, os.begin() + (h + 1) * D,
                op.begin() + (static_cast<std::size_t>(h) * parts + s) * D);
    }
  }
  for (int h = 0; h < H; ++h) {
    std::vector<float> oc(D);
    float lc = 0.0f;
    att::split_kv::combine(&lp[h * parts], &op[static_cast<std::size_t>(h) * parts * D], parts, D, oc.data(), &lc);
    EXPECT_NEAR(lc, lse[h], 1e-5f * std::abs(lse[h]) + 1e-6f);
    for (int d = 0; d < D; ++d) EXPECT_NEAR(oc[d], o[h * D + d], 1e-5f) << h << " " << d;
  }
}
