// The one model (src/runtime/llama.hpp) through the stage walker on one rank
// (runtime::runLocal): whole-model gradients against central finite differences, document
// masking with restarting positions, the learning-rate schedule, and AdamW lowering the loss
// on a fixed batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

#include "runtime/head.hpp"
#include "runtime/llama.hpp"
#include "runtime/pipeline.hpp"
#include "runtime/tokens.hpp"
#include "train/optimizer.hpp"

namespace {

using wlb::MicroBatch;
using wlb::Segment;
using wlb::runtime::ListTokens;
using wlb::runtime::Llama;
using wlb::runtime::LlamaConfig;
using wlb::runtime::runLocal;

// Predicted rows of whole documents: every token but the last.
std::int64_t predicted(const MicroBatch& mb) {
  std::int64_t n = 0;
  for (const auto& s : mb.segments) n += s.length - 1;
  return n;
}

LlamaConfig tinyConfig() {
  LlamaConfig c;
  c.vocab = 256;
  c.hidden = 16;
  c.heads = 2;
  c.kv_heads = 1;
  c.ffn = 24;
  c.layers = 2;
  return c;
}

std::vector<std::int32_t> doc(int n, int salt) {
  std::vector<std::int32_t> d;
  for (int i = 0; i < n; ++i) d.push_back((i * 37 + salt * 11 + 5) % 256);
  return d;
}

float getW(const Llama& m, std::int64_t i) {
  float v = 0;
  Kokkos::deep_copy(Kokkos::View<float, Kokkos::HostSpace>(&v), Kokkos::subview(m.weights(), i));
  return v;
}
void setW(const Llama& m, std::int64_t i, float v) {
  Kokkos::deep_copy(Kokkos::subview(m.weights(), i), Kokkos::View<const float, Kokkos::HostSpace>(&v));
}

// The tiny model (seed 11) and one micro-batch of two whole documents: the optimizer tests'.
struct TwoDocs {
  Llama model{tinyConfig(), 11};
  wlb::runtime::Space space;
  const ListTokens tokens{std::vector<std::vector<std::int32_t>>{doc(5, 1), doc(9, 2)}};
  const MicroBatch batch = tokens.wholeDocuments();
  /// The gradients of the batch's mean loss, which it returns.
  double gradients() {
    model.zeroGrads(space);
    const float scale = 1.0f / static_cast<float>(predicted(batch));
    return runLocal(model, tokens, {batch}, true, scale) / static_cast<double>(predicted(batch));
  }
};

TEST(Llama, GradientsMatchFiniteDifferences) {
  const LlamaConfig cfg = tinyConfig();
  Llama model(cfg, 7);
  wlb::runtime::Space space;
  const ListTokens tokens({doc(5, 1), doc(9, 2)});
  const MicroBatch batch = tokens.wholeDocuments();
  EXPECT_EQ(predicted(batch), 4 + 8);
  model.zeroGrads(space);
  runLocal(model, tokens, {batch}, true, 1.0f);
  auto g = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.grads());
  const float eps = 1e-2f;
  int checked = 0;
  double worst = 0;
  for (const auto& t : model.tensors()) {
    // The entries with the largest gradients of every tensor (FP32 differences of tiny
    // gradients are noise).
    std::vector<std::int64_t> idx(static_cast<std::size_t>(t.size));
    std::iota(idx.begin(), idx.end(), t.offset);
    std::partial_sort(idx.begin(), idx.begin() + 3, idx.end(),
                      [&](std::int64_t a, std::int64_t b) { return std::fabs(g(a)) > std::fabs(g(b)); });
    for (int k = 0; k < 3; ++k) {
      const std::int64_t i = idx[static_cast<std::size_t>(k)];
      const float w0 = getW(model, i);
      setW(model, i, w0 + eps);
      const double lp = runLocal(model, tokens, {batch}, false);
      setW(model, i, w0 - eps);
      const double lm = runLocal(model, tokens, {batch}, false);
      setW(model, i, w0);
      const double fd = (lp - lm) / (2.0 * eps);
      const double an = g(i);
      const double rel = std::fabs(fd - an) / std::max({std::fabs(fd), std::fabs(an), 1e-3});
      EXPECT_LT(rel, 1e-2) << t.name << "[" << i - t.offset << "]: analytic " << an << ", finite difference " << fd;
      worst = std::max(worst, rel);
      ++checked;
    }
  }
  std::printf("worst relative error of %d checked gradients: %.2e\n", checked, worst);
  EXPECT_EQ(checked, 3 * static_cast<int>(model.tensors().size()));
}

TEST(Llama, DocumentsDoNotSeeEachOther) {
  // Attention is document-masked and positions restart per document: packing two documents
  // together gives the sum of their separate losses.
  const LlamaConfig cfg = tinyConfig();
  Llama model(cfg, 3);
  const ListTokens tokens({doc(5, 1), doc(9, 2), {42}, {300}});
  const MicroBatch all = tokens.wholeDocuments();
  MicroBatch both, a, b, one, bad;
  both.segments = {all.segments[0], all.segments[1]};
  a.segments = {all.segments[0]};
  b.segments = {all.segments[1]};
  one.segments = {all.segments[2]};
  bad.segments = {all.segments[3]};
  const double sep = runLocal(model, tokens, {a}, false) + runLocal(model, tokens, {b}, false);
  EXPECT_NEAR(runLocal(model, tokens, {both}, false), sep, 1e-4 * std::fabs(sep));
  EXPECT_NEAR(runLocal(model, tokens, {a, b}, false), sep, 1e-4 * std::fabs(sep));  // two micro-batches
  // A 1-token document predicts nothing.
  EXPECT_EQ(runLocal(model, tokens, {one}, false), 0.0);
  EXPECT_THROW(runLocal(model, tokens, {bad}, false), std::invalid_argument);
}

TEST(Llama, LearningRateSchedule) {
  wlb::train::AdamWConfig c;
  c.lr = 1.0f;
  c.min_lr_ratio = 0.1f;
  c.warmup_steps = 4;
  c.total_steps = 14;
  EXPECT_NEAR(c.lrAt(0), 0.25, 1e-6);
  EXPECT_NEAR(c.lrAt(3), 1.0, 1e-6);
  EXPECT_NEAR(c.lrAt(4), 1.0, 1e-6);
  EXPECT_NEAR(c.lrAt(9), 0.55, 1e-6);  // half way down the cosine
  EXPECT_NEAR(c.lrAt(14), 0.1, 1e-6);
  EXPECT_NEAR(c.lrAt(100), 0.1, 1e-6);
}

TEST(Llama, AdamWLowersTheLoss) {
  TwoDocs t;
  wlb::train::AdamWConfig oc;
  oc.lr = 1e-2f;
  oc.warmup_steps = 3;
  oc.total_steps = 30;
  oc.clip = 1.0f;
  wlb::train::AdamW opt(t.model, oc);
  std::vector<double> losses;
  for (int s = 0; s < 30; ++s) {
    losses.push_back(t.gradients());
    const double norm = opt.step(t.space, t.model, s);
    EXPECT_TRUE(std::isfinite(norm));
  }
  EXPECT_NEAR(losses.front(), std::log(256.0), 1.0);  // starts near uniform
  EXPECT_LT(losses.back(), 0.5 * losses.front()) << "first " << losses.front() << ", last " << losses.back();
  // Mostly downhill.
  int up = 0;
  for (std::size_t i = 1; i < losses.size(); ++i) up += losses[i] > losses[i - 1];
  EXPECT_LE(up, 5);
}

// The bias correction counts the updates made, not the step index: the first update after
// steps that made none (a packer that held every document back) moves every weight by lr,
// as AdamW's first update does (m-hat / sqrt(v-hat) = g / |g|).
TEST(Llama, AdamWBiasCorrectionCountsUpdatesNotSteps) {
  TwoDocs t;
  wlb::train::AdamWConfig oc;
  oc.lr = 1e-3f;
  oc.min_lr_ratio = 1.0f;  // a constant rate
  oc.total_steps = 100;
  oc.weight_decay = 0.0f;
  oc.clip = 0.0f;
  wlb::train::AdamW opt(t.model, oc);
  (void)t.gradients();
  const auto copyOf = [](const auto& v) {  // a copy, not a view of the same memory
    auto h = Kokkos::create_mirror(Kokkos::HostSpace(), v);
    Kokkos::deep_copy(h, v);
    return h;
  };
  const auto before = copyOf(t.model.weights());
  const auto grads = copyOf(t.model.grads());
  (void)opt.step(t.space, t.model, 5);  // steps 0..4 made no update
  EXPECT_EQ(opt.updates(), 1);
  const auto after = copyOf(t.model.weights());
  std::int64_t checked = 0;
  for (std::size_t i = 0; i < before.size(); ++i) {
    if (std::abs(grads(i)) < 1e-4f) continue;  // where eps does not matter
    EXPECT_NEAR(std::abs(after(i) - before(i)) / oc.lr, 1.0, 1e-2) << i;
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

// BF16 storage (run.precision = "bf16"): the same model with its activations and working
// weights rounded to BF16 gives the FP32 loss and gradients to within BF16's precision, and
// AdamW updates the FP32 masters, which reach the kernels through the working copy.
TEST(Llama, Bf16StorageTracksFp32) {
  const LlamaConfig cfg = tinyConfig();
  Llama m32(cfg, 7);
  Llama m16(cfg, 7, wlb::runtime::Precision::Bf16);
  ASSERT_TRUE(m16.hasWorkingCopy());
  ASSERT_FALSE(m32.hasWorkingCopy());
  wlb::runtime::Space space;
  const ListTokens tokens({doc(5, 1), doc(9, 2), doc(23, 3)});
  const MicroBatch batch = tokens.wholeDocuments();
  m32.zeroGrads(space);
  m16.zeroGrads(space);
  const double l32 = runLocal(m32, tokens, {batch}, true, 1.0f);
  const double l16 = runLocal(m16, tokens, {batch}, true, 1.0f);
  EXPECT_NE(l32, l16);  // BF16 storage is not FP32
  EXPECT_NEAR(l16, l32, 1e-2 * std::fabs(l32));
  auto g32 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m32.grads());
  auto g16 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m16.grads());
  for (const auto& t : m32.tensors()) {
    double dot = 0, n32 = 0, n16 = 0;
    for (std::int64_t i = t.offset; i < t.offset + t.size; ++i) {
      dot += static_cast<double>(g32(i)) * g16(i);
      n32 += static_cast<double>(g32(i)) * g32(i);
      n16 += static_cast<double>(g16(i)) * g16(i);
    }
    EXPECT_GT(dot / std::sqrt(n32 * n16), 0.999) << t.name;
    EXPECT_NEAR(std::sqrt(n16), std::sqrt(n32), 0.02 * std::sqrt(n32)) << t.name;
  }
  // One AdamW step: the masters move, and the next forward sees it.
  wlb::train::AdamWConfig oc;
  oc.lr = 1e-2f;
  wlb::train::AdamW opt(m16, oc);
  opt.step(space, m16, 0);
  EXPECT_NE(runLocal(m16, tokens, {batch}, false), l16);
  // Master weights stay FP32: not every one of them is a BF16 value after a step.
  auto w = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m16.weights());
  std::int64_t off_grid = 0;
  for (std::size_t i = 0; i < w.size(); ++i) off_grid += wlb::attention::roundBf16(w(i)) != w(i);
  EXPECT_GT(off_grid, static_cast<std::int64_t>(w.size()) / 2);
}

// The loss head alone (final norm, LM head, cross-entropy; runtime::lossForward) over more
// rows than one chunk of logits (kLossChunkRows), some without a target, against a
// double-precision reference: the summed loss, and the head's weight gradient, which reads
// the logits' gradient as the GEMMs store it (in place in FP32, written in BF16 in BF16
// storage).
TEST(Llama, LossOverChunksMatchesReference) {
  using wlb::runtime::Precision;
  for (const Precision prec : {Precision::Fp32, Precision::Bf16}) {
    SCOPED_TRACE(prec == Precision::Bf16 ? "bf16" : "fp32");
    LlamaConfig cfg = tinyConfig();
    cfg.vocab = 300;
    Llama model(cfg, 11, prec);
    wlb::runtime::Space space;
    const std::int64_t n = 2 * wlb::runtime::kLossChunkRows + 37, h = cfg.hidden, V = cfg.vocab;
    wlb::runtime::Mat x("x", n, h);
    wlb::runtime::IVec targets("targets", n);
    auto xh = Kokkos::create_mirror_view(x);
    auto th = Kokkos::create_mirror_view(targets);
    for (std::int64_t i = 0; i < n; ++i) {
      th(i) = i % 7 == 3 ? -1 : static_cast<std::int32_t>((i * 31 + 5) % V);
      for (std::int64_t j = 0; j < h; ++j) xh(i, j) = static_cast<float>(std::sin(0.37 * i + 1.3 * j));
    }
    Kokkos::deep_copy(x, xh);
    Kokkos::deep_copy(targets, th);
    wlb::runtime::TokenRows rows;
    rows.n = n;
    rows.targets = targets;
    wlb::runtime::LayerEnv env;
    env.space = &space;
    env.precision = prec;
    env.norm_eps = cfg.norm_eps;
    model.zeroGrads(space);
    const float scale = 0.5f;
    const auto got = wlb::runtime::lossForward(env, model, rows, x, true, scale);
    ASSERT_EQ(got.dx.extent(0), static_cast<std::size_t>(n));

    // the reference, in double, from the FP32 masters
    auto g = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.normF());
    auto W = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.head());
    std::vector<double> dW(static_cast<std::size_t>(h * V), 0.0), xf(static_cast<std::size_t>(h)),
        z(static_cast<std::size_t>(V));
    double loss = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      if (th(i) < 0) continue;
      double ss = 0;
      for (std::int64_t j = 0; j < h; ++j) ss += static_cast<double>(xh(i, j)) * xh(i, j);
      const double r = 1.0 / std::sqrt(ss / static_cast<double>(h) + cfg.norm_eps);
      for (std::int64_t j = 0; j < h; ++j) xf[static_cast<std::size_t>(j)] = xh(i, j) * r * g(j);
      double mx = -1e300;
      for (std::int64_t v = 0; v < V; ++v) {
        double a = 0;
        for (std::int64_t j = 0; j < h; ++j) a += xf[static_cast<std::size_t>(j)] * W(j, v);
        z[static_cast<std::size_t>(v)] = a;
        mx = std::max(mx, a);
      }
      double se = 0;
      for (std::int64_t v = 0; v < V; ++v) se += std::exp(z[static_cast<std::size_t>(v)] - mx);
      const double lse = mx + std::log(se);
      loss += lse - z[static_cast<std::size_t>(th(i))];
      for (std::int64_t v = 0; v < V; ++v) {
        const double dz = (std::exp(z[static_cast<std::size_t>(v)] - lse) - (v == th(i) ? 1.0 : 0.0)) * scale;
        for (std::int64_t j = 0; j < h; ++j)
          dW[static_cast<std::size_t>(j * V + v)] += xf[static_cast<std::size_t>(j)] * dz;
      }
    }
    const double tol = prec == Precision::Bf16 ? 1e-4 : 1e-6;
    EXPECT_NEAR(got.loss, loss, tol * loss);
    auto gW = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.headGrad());
    double err = 0, norm = 0;
    for (std::int64_t j = 0; j < h; ++j)
      for (std::int64_t v = 0; v < V; ++v) {
        const double d = gW(j, v) - dW[static_cast<std::size_t>(j * V + v)];
        err += d * d;
        norm += dW[static_cast<std::size_t>(j * V + v)] * dW[static_cast<std::size_t>(j * V + v)];
      }
    std::printf("loss %.9g reference %.9g, head gradient relative error %.2e\n", got.loss, loss, std::sqrt(err / norm));
    EXPECT_LT(std::sqrt(err / norm), prec == Precision::Bf16 ? 5e-3 : 1e-5);
  }
}

}  // namespace
