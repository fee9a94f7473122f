/// \file llama.cpp
/// \brief The LLaMA-style model's forward/backward and AdamW, see llama.hpp.

#include "train/llama.hpp"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "attention/attention.hpp"
#include "core/kokkos_compat.hpp"
#include "parallel/group_comm.hpp"
#include "pp/schedule.hpp"
#include "runtime/layer.hpp"
#include "trace/recorder.hpp"

namespace wlb::train {
namespace {

using runtime::Trans;
using Policy = Kokkos::RangePolicy<Space>;

using runtime::newAct3;
using runtime::newMat;
using runtime::sigmoid;

Vec newVec(const char* label, std::int64_t n) {
  return Vec(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), n);
}

// Uniform in [-scale, scale] (scale 0: constant 1, the norm gains) from (seed, stream,
// index): the executor's counter-based fill over the tensor's slice of the buffer. A TP
// slice holds the same numbers as that block of the whole tensor.
void fillTensor(const Space& space, Vec buf, const TensorInfo& t, std::uint64_t seed, std::uint64_t stream, float scale,
                int tp_rank) {
  const auto slice = Kokkos::subview(buf, std::make_pair(t.offset, t.offset + t.size));
  if (scale == 0.0f) {
    Kokkos::deep_copy(space, slice, 1.0f);
  } else if (t.slice == 0) {
    runtime::fillRandom(space, Mat(slice.data(), 1, t.size), seed, stream, scale);
  } else {
    Mat full = newMat("wlb::train::init_full", 1, t.rows * t.cols);
    runtime::fillRandom(space, full, seed, stream, scale);
    const std::int64_t cols = t.cols;
    const std::int64_t local_cols = t.slice == 1 ? t.size / t.rows : cols;
    // columns: [tp_rank * local_cols, +local_cols) of every row; rows: a contiguous block
    const std::int64_t first = t.slice == 1 ? tp_rank * local_cols : tp_rank * t.size;
    float* dst = slice.data();
    const float* src = full.data();
    const int by_cols = t.slice == 1;
    Kokkos::parallel_for(
        "wlb::train::init_slice", Policy(space, 0, t.size), KOKKOS_LAMBDA(const std::int64_t i) {
          dst[i] = by_cols ? src[(i / local_cols) * cols + first + i % local_cols] : src[first + i];
        });
    kk::fence(space, "wlb::train::init_slice");  // `full` goes out of scope
  }
}

// In-place sum over the TP group (nothing without one), a `tp_allreduce` event of layer
// `layer` when a recorder is given.
void tpSum(parallel::GroupComm* tp, trace::Recorder* rec, const Space& space, Mat m, int layer, bool bwd) {
  if (!tp) return;
  const std::int64_t n = static_cast<std::int64_t>(m.size());
  if (rec) {
    trace::Recorder::Scope s(*rec, trace::labels::kTpAllreduce, space, 0, 4.0 * static_cast<double>(n));
    s.context().layer = layer;
    s.context().phase = bwd ? trace::Phase::Bwd : trace::Phase::Fwd;
    tp->allreduceSum(space, m.data(), n);
  } else {
    tp->allreduceSum(space, m.data(), n);
  }
}

// y = x * rstd * g, rstd = 1/sqrt(mean(x^2) + eps), per row.
void rmsnormFwd(const Space& space, Mat x, Vec g, float eps, Mat y, Vec rstd) {
  const std::int64_t h = static_cast<std::int64_t>(x.extent(1));
  Kokkos::parallel_for(
      "wlb::train::rmsnorm_fwd", Policy(space, 0, static_cast<std::int64_t>(x.extent(0))),
      KOKKOS_LAMBDA(const std::int64_t i) {
        float ss = 0;
        for (std::int64_t j = 0; j < h; ++j) ss += x(i, j) * x(i, j);
        const float r = 1.0f / kk::sqrt(ss / static_cast<float>(h) + eps);
        rstd(i) = r;
        for (std::int64_t j = 0; j < h; ++j) y(i, j) = x(i, j) * r * g(j);
      });
}

// dx += rstd * (g*dy - xhat * mean(g*dy*xhat)), dg += sum_rows dy * xhat (column-wise, in
// row order: deterministic without atomics).
void rmsnormBwd(const Space& space, Mat x, Vec g, Vec rstd, Mat dy, Mat dx, Vec dg) {
  const std::int64_t n = static_cast<std::int64_t>(x.extent(0)), h = static_cast<std::int64_t>(x.extent(1));
  Kokkos::parallel_for(
      "wlb::train::rmsnorm_bwd_x", Policy(space, 0, n), KOKKOS_LAMBDA(const std::int64_t i) {
        const float r = rstd(i);
        float dot = 0;
        for (std::int64_t j = 0; j < h; ++j) dot += g(j) * dy(i, j) * x(i, j) * r;
        dot /= static_cast<float>(h);
        for (std::int64_t j = 0; j < h; ++j) dx(i, j) += r * (g(j) * dy(i, j) - x(i, j) * r * dot);
      });
  Kokkos::parallel_for(
      "wlb::train::rmsnorm_bwd_g", Policy(space, 0, h), KOKKOS_LAMBDA(const std::int64_t j) {
        float s = 0;
        for (std::int64_t i = 0; i < n; ++i) s += dy(i, j) * x(i, j) * rstd(i);
        dg(j) += s;
      });
}

// Rotate pairs (d, d + D/2) of every head by +-angle(position, d) (sign -1: the transpose,
// for the backward pass).
void rope(const Space& space, Act3 t, IVec pos, Mat cos_t, Mat sin_t, float sign) {
  const std::int64_t n = static_cast<std::int64_t>(t.extent(0));
  const int H = static_cast<int>(t.extent(1)), half = static_cast<int>(t.extent(2)) / 2;
  Kokkos::parallel_for(
      "wlb::train::rope", Policy(space, 0, n * H * half), KOKKOS_LAMBDA(const std::int64_t idx) {
        const std::int64_t i = idx / (H * half);
        const int hh = static_cast<int>(idx / half % H), d = static_cast<int>(idx % half);
        const float c = cos_t(pos(i), d), s = sign * sin_t(pos(i), d);
        const float a = t(i, hh, d), b = t(i, hh, d + half);
        t(i, hh, d) = a * c - b * s;
        t(i, hh, d + half) = a * s + b * c;
      });
}

struct LayerSaved {
  Mat x, xn1, h, hn, a1, a3, s;
  Vec rstd1, rstd2;
  Act3 q, k, v, o;
  Lse lse;
};

}  // namespace

void LlamaConfig::validate() const {
  if (vocab < 1 || hidden < 1 || heads < 1 || kv_heads < 1 || ffn < 1 || layers < 1)
    throw std::invalid_argument("llama: every dimension must be >= 1");
  if (hidden % heads != 0 || (hidden / heads) % 2 != 0)
    throw std::invalid_argument("llama: hidden must be heads * an even head_dim (RoPE rotates pairs)");
  if (heads % kv_heads != 0) throw std::invalid_argument("llama: kv_heads must divide heads");
  if (tp < 1 || tp_rank < 0 || tp_rank >= tp) throw std::invalid_argument("llama: bad tp / tp_rank");
  if (heads % tp != 0 || kv_heads % tp != 0 || ffn % tp != 0)
    throw std::invalid_argument("llama: tensor parallelism needs heads, kv_heads and ffn divisible by tp = " +
                                std::to_string(tp));
  if (pp < 1 || pp_rank < 0 || pp_rank >= pp) throw std::invalid_argument("llama: bad pp / pp_rank");
  if (pp > layers)
    throw std::invalid_argument("llama: pipeline parallelism needs at least one layer per stage (pp = " +
                                std::to_string(pp) + ", layers = " + std::to_string(layers) + ")");
}

TokenBatch TokenBatch::fromSegments(const std::vector<std::vector<std::int32_t>>& segments, int vocab) {
  TokenBatch b;
  std::vector<std::int32_t> tok, tgt, pos;
  for (const auto& s : segments) {
    if (s.empty()) throw std::invalid_argument("TokenBatch: empty segment");
    b.segment_lengths.push_back(static_cast<std::int64_t>(s.size()));
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] < 0 || s[i] >= vocab)
        throw std::invalid_argument("TokenBatch: token " + std::to_string(s[i]) + " outside the vocabulary of " +
                                    std::to_string(vocab));
      tok.push_back(s[i]);
      pos.push_back(static_cast<std::int32_t>(i));
      tgt.push_back(i + 1 < s.size() ? s[i + 1] : -1);
    }
    b.predicted += static_cast<std::int64_t>(s.size()) - 1;
  }
  std::vector<std::int64_t> lengths = std::move(b.segment_lengths);
  b = fromTokens(tok, tgt, pos, vocab);
  b.segment_lengths = std::move(lengths);
  return b;
}

TokenBatch TokenBatch::fromTokens(const std::vector<std::int32_t>& tok, const std::vector<std::int32_t>& tgt,
                                  const std::vector<std::int32_t>& pos, int vocab) {
  if (tgt.size() != tok.size() || pos.size() != tok.size())
    throw std::invalid_argument("TokenBatch: tokens, targets and positions differ in length");
  TokenBatch b;
  for (std::size_t i = 0; i < tok.size(); ++i) {
    for (const std::int32_t t : {tok[i], tgt[i] == -1 ? 0 : tgt[i]})
      if (t < 0 || t >= vocab)
        throw std::invalid_argument("TokenBatch: token " + std::to_string(t) + " outside the vocabulary of " +
                                    std::to_string(vocab));
    if (pos[i] < 0) throw std::invalid_argument("TokenBatch: negative position");
    if (tgt[i] >= 0) ++b.predicted;
    b.max_position = std::max<std::int64_t>(b.max_position, pos[i]);
  }
  b.n = static_cast<std::int64_t>(tok.size());
  auto up = [](const std::vector<std::int32_t>& v, const char* label) {
    IVec d(std::string(label), v.size());
    Kokkos::deep_copy(d, Kokkos::View<const std::int32_t*, Kokkos::HostSpace>(v.data(), v.size()));
    return d;
  };
  b.tokens = up(tok, "wlb::train::tokens");
  b.targets = up(tgt, "wlb::train::targets");
  b.positions = up(pos, "wlb::train::positions");
  return b;
}

std::vector<TensorInfo> Llama::layout(const LlamaConfig& cfg) {
  // This rank's widths (the whole model's without TP).
  const std::int64_t h = cfg.hidden, V = cfg.vocab, D = cfg.headDim(), T = cfg.tp,
                     qw = static_cast<std::int64_t>(cfg.localHeads()) * D,
                     kw = static_cast<std::int64_t>(cfg.localKvHeads()) * D, f = cfg.localFfn();
  const pp::LayerBlock blk = pp::layerBlock(cfg.layers, cfg.pp, cfg.pp_rank);
  std::vector<TensorInfo> out;
  std::int64_t off = 0;
  int index = 0;  // every tensor of the whole model counts, held here or not
  // slice: 0 replicated, 1 column block, 2 row block of the whole [rows][cols] tensor
  auto add = [&](const std::string& name, std::int64_t rows, std::int64_t cols, bool decay, int slice, bool here) {
    if (here) {
      const std::int64_t size = T > 1 && slice != 0 ? rows * cols / T : rows * cols;
      out.push_back(TensorInfo{name, off, size, decay, T > 1 ? slice : 0, rows, cols, index});
      off += size;
    }
    ++index;
  };
  add("embed", V, h, true, 0, cfg.firstStage());
  for (int l = 0; l < cfg.layers; ++l) {
    const bool here = l >= blk.first && l < blk.first + blk.count;
    const std::string p = "layer" + std::to_string(l) + ".";
    add(p + "norm1", 1, h, false, 0, here);
    add(p + "wq", h, qw * T, true, 1, here);
    add(p + "wk", h, kw * T, true, 1, here);
    add(p + "wv", h, kw * T, true, 1, here);
    add(p + "wo", qw * T, h, true, 2, here);
    add(p + "norm2", 1, h, false, 0, here);
    add(p + "w1", h, f * T, true, 1, here);
    add(p + "w3", h, f * T, true, 1, here);
    add(p + "w2", f * T, h, true, 2, here);
  }
  add("norm_f", 1, h, false, 0, cfg.lastStage());
  add("head", h, V, true, 0, cfg.lastStage());
  return out;
}

Llama::Llama(const LlamaConfig& cfg, std::uint64_t seed, parallel::GroupComm* tp, MPI_Comm pp)
    : cfg_(cfg), tp_(tp), pp_(pp) {
  cfg.validate();
  if (cfg.tp > 1 && tp == nullptr) throw std::invalid_argument("llama: tp > 1 needs the TP group");
  if (cfg.pp > 1 && pp == MPI_COMM_NULL) throw std::invalid_argument("llama: pp > 1 needs the pipeline group");
  if (cfg.tp == 1) tp_ = nullptr;
  if (cfg.pp == 1) pp_ = MPI_COMM_NULL;
  const pp::LayerBlock blk = pp::layerBlock(cfg.layers, cfg.pp, cfg.pp_rank);
  first_layer_ = blk.first;
  const std::int64_t h = cfg.hidden, V = cfg.vocab, D = cfg.headDim(),
                     qw = static_cast<std::int64_t>(cfg.localHeads()) * D,
                     kw = static_cast<std::int64_t>(cfg.localKvHeads()) * D, f = cfg.localFfn();
  tensors_ = layout(cfg);
  const std::int64_t off = tensors_.empty() ? 0 : tensors_.back().offset + tensors_.back().size;
  w_buf_ = Vec("wlb::train::weights", off);
  g_buf_ = Vec("wlb::train::grads", off);
  for (int which = 0; which < 2; ++which) {
    float* base = (which == 0 ? w_buf_ : g_buf_).data();
    std::size_t t = 0;
    auto mat = [&](std::int64_t r, std::int64_t c) { return Mat(base + tensors_[t++].offset, r, c); };
    auto vec = [&](std::int64_t n) { return Vec(base + tensors_[t++].offset, n); };
    LlamaParams& p = which == 0 ? w_ : g_;
    if (cfg.firstStage()) p.embed = mat(V, h);
    for (int l = 0; l < blk.count; ++l) {
      LlamaLayer L;
      L.norm1 = vec(h);
      L.wq = mat(h, qw);
      L.wk = mat(h, kw);
      L.wv = mat(h, kw);
      L.wo = mat(qw, h);
      L.norm2 = vec(h);
      L.w1 = mat(h, f);
      L.w3 = mat(h, f);
      L.w2 = mat(f, h);
      p.layers.push_back(L);
    }
    if (cfg.lastStage()) {
      p.norm_f = vec(h);
      p.head = mat(h, V);
    }
  }
  Space space;
  const float sh = 1.0f / std::sqrt(static_cast<float>(h)), sf = 1.0f / std::sqrt(static_cast<float>(cfg.ffn));
  const float depth = 1.0f / std::sqrt(2.0f * static_cast<float>(cfg.layers));  // residual branches add up
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const std::string& n = tensors_[i].name;
    float scale = sh;
    if (n == "embed")
      scale = 1.0f;
    else if (!tensors_[i].decay)
      scale = 0.0f;  // norm gains = 1
    else if (n.size() > 2 && n.compare(n.size() - 2, 2, "wo") == 0)
      scale = sh * depth;
    else if (n.size() > 2 && n.compare(n.size() - 2, 2, "w2") == 0)
      scale = sf * depth;
    fillTensor(space, w_buf_, tensors_[i], seed, static_cast<std::uint64_t>(tensors_[i].index) + 1, scale, cfg.tp_rank);
  }
  kk::fence(space, "wlb::train::Llama::init");
}

void Llama::zeroGrads(const Space& space) {
  Kokkos::deep_copy(space, g_buf_, 0.0f);
}

double Llama::forwardBackward(const Space& space, const TokenBatch& batch, float loss_scale, AttentionOp* attn) {
  return run(space, batch, true, loss_scale, attn);
}

double Llama::lossSum(const Space& space, const TokenBatch& batch) {
  return run(space, batch, false, 0.0f);
}

struct StagePass::State {
  Llama* model = nullptr;
  Space space;
  TokenBatch batch;
  AttentionOp* attn = nullptr;
  attention::VarlenBatch varlen;  ///< without an op: the attention over the batch's segments
  Mat cos_t, sin_t;               ///< RoPE tables up to the largest position
  std::vector<LayerSaved> saved;  ///< per layer of the stage
  // Last stage: the final norm's input and output, and the logits (dL/dlogits after a
  // forward that keeps them).
  Mat x_last, xf, logits;
  Vec rstd_f;
  double loss = 0;
  bool forward_done = false, keep = false;
};

StagePass::StagePass(Llama& model, const Space& space, const TokenBatch& batch, AttentionOp* attn)
    : s_(std::make_unique<State>()) {
  State& S = *s_;
  S.model = &model;
  S.space = space;
  S.batch = batch;
  S.attn = attn;
  const LlamaConfig& c = model.cfg_;
  const int D = c.headDim(), half = D / 2;
  if (!attn) S.varlen = attention::VarlenBatch::fromDocLengths(batch.segment_lengths);
  // RoPE table up to the largest position (host constants, uploaded once per batch).
  const std::int64_t max_len = std::max<std::int64_t>(1, batch.max_position + 1);
  S.cos_t = newMat("wlb::train::rope_cos", max_len, half);
  S.sin_t = newMat("wlb::train::rope_sin", max_len, half);
  auto hc = Kokkos::create_mirror_view(S.cos_t);
  auto hs = Kokkos::create_mirror_view(S.sin_t);
  for (std::int64_t p = 0; p < max_len; ++p)
    for (int d = 0; d < half; ++d) {
      const double ang = static_cast<double>(p) * std::pow(static_cast<double>(c.rope_theta), -2.0 * d / D);
      hc(p, d) = static_cast<float>(std::cos(ang));
      hs(p, d) = static_cast<float>(std::sin(ang));
    }
  Kokkos::deep_copy(space, S.cos_t, hc);
  Kokkos::deep_copy(space, S.sin_t, hs);
  kk::fence(space, "wlb::train::rope_table");  // the host mirrors go out of scope
}

StagePass::~StagePass() = default;

double StagePass::loss() const {
  return s_->loss;
}

Mat StagePass::forward(Mat x, bool backward, float loss_scale) {
  State& S = *s_;
  if (S.forward_done) throw std::logic_error("StagePass::forward: called twice");
  S.forward_done = true;
  S.keep = backward;
  const Llama& M = *S.model;
  const LlamaConfig& c = M.cfg_;
  const Space& space = S.space;
  const TokenBatch& batch = S.batch;
  const std::int64_t n = batch.n, h = c.hidden, V = c.vocab;
  // This rank's heads and MLP width (its TP slice; the whole model's without TP).
  const int D = c.headDim(), H = c.localHeads(), KV = c.localKvHeads();
  const std::int64_t F = c.localFfn();
  const bool residual_here = M.tp_ == nullptr || c.tp_rank == 0;  // TP: rank 0 adds the residual before the sum
  Mat cos_t = S.cos_t, sin_t = S.sin_t;
  IVec tok = batch.tokens, tgt = batch.targets, pos = batch.positions;

  if (c.firstStage()) {  // embedding
    x = newMat("wlb::train::x", n, h);
    Mat E = M.w_.embed;
    Kokkos::parallel_for(
        "wlb::train::embed", Policy(space, 0, n * h),
        KOKKOS_LAMBDA(const std::int64_t i) { x(i / h, i % h) = E(tok(i / h), i % h); });
  } else if (static_cast<std::int64_t>(x.extent(0)) != n || static_cast<std::int64_t>(x.extent(1)) != h) {
    throw std::logic_error("StagePass::forward: input of " + std::to_string(x.extent(0)) + " rows for " +
                           std::to_string(n) + " tokens");
  }
  const int count = static_cast<int>(M.w_.layers.size());
  S.saved.assign(static_cast<std::size_t>(count), LayerSaved());
  for (int li = 0; li < count; ++li) {
    const int l = M.first_layer_ + li;  // global layer: the op's and the trace's index
    const LlamaLayer& w = M.w_.layers[static_cast<std::size_t>(li)];
    LayerSaved& L = S.saved[static_cast<std::size_t>(li)];
    L.x = x;
    L.xn1 = newMat("wlb::train::xn1", n, h);
    L.rstd1 = newVec("wlb::train::rstd1", n);
    rmsnormFwd(space, x, w.norm1, c.norm_eps, L.xn1, L.rstd1);
    L.q = newAct3("wlb::train::q", n, H, D);
    L.k = newAct3("wlb::train::k", n, KV, D);
    L.v = newAct3("wlb::train::v", n, KV, D);
    runtime::gemm(space, Trans::N, Trans::N, 1.0f, L.xn1, w.wq, 0.0f, runtime::flat(L.q));
    runtime::gemm(space, Trans::N, Trans::N, 1.0f, L.xn1, w.wk, 0.0f, runtime::flat(L.k));
    runtime::gemm(space, Trans::N, Trans::N, 1.0f, L.xn1, w.wv, 0.0f, runtime::flat(L.v));
    rope(space, L.q, pos, cos_t, sin_t, 1.0f);
    rope(space, L.k, pos, cos_t, sin_t, 1.0f);
    L.o = newAct3("wlb::train::o", n, H, D);
    L.lse = Lse(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::train::lse"), n, H);
    if (S.attn)
      S.attn->forward(space, l, L.q, L.k, L.v, L.o, L.lse);
    else
      attention::forward(space, L.q, L.k, L.v, S.varlen, L.o, L.lse);
    L.h = newMat("wlb::train::h", n, h);
    if (residual_here) Kokkos::deep_copy(space, L.h, x);
    runtime::gemm(space, Trans::N, Trans::N, 1.0f, runtime::flat(L.o), w.wo, residual_here ? 1.0f : 0.0f,
                  L.h);                          // h = x + o Wo
    tpSum(M.tp_, M.rec_, space, L.h, l, false);  // TP: the heads' partial products summed
    L.hn = newMat("wlb::train::hn", n, h);
    L.rstd2 = newVec("wlb::train::rstd2", n);
    rmsnormFwd(space, L.h, w.norm2, c.norm_eps, L.hn, L.rstd2);
    L.a1 = newMat("wlb::train::a1", n, F);
    L.a3 = newMat("wlb::train::a3", n, F);
    L.s = newMat("wlb::train::s", n, F);
    runtime::gemm(space, Trans::N, Trans::N, 1.0f, L.hn, w.w1, 0.0f, L.a1);
    runtime::gemm(space, Trans::N, Trans::N, 1.0f, L.hn, w.w3, 0.0f, L.a3);
    {
      Mat a1 = L.a1, a3 = L.a3, sv = L.s;
      Kokkos::parallel_for(
          "wlb::train::swiglu", Policy(space, 0, static_cast<std::int64_t>(sv.size())),
          KOKKOS_LAMBDA(const std::int64_t i) {
            const float a = a1.data()[i];
            sv.data()[i] = a * sigmoid(a) * a3.data()[i];
          });
    }
    Mat y = newMat("wlb::train::y", n, h);
    if (residual_here) Kokkos::deep_copy(space, y, L.h);
    runtime::gemm(space, Trans::N, Trans::N, 1.0f, L.s, w.w2, residual_here ? 1.0f : 0.0f, y);  // y = h + s W2
    tpSum(M.tp_, M.rec_, space, y, l, false);
    x = y;
  }
  if (!c.lastStage()) {
    kk::fence(space, "wlb::train::StagePass::forward");  // the output leaves the stage
    return x;
  }
  // Final norm, LM head, cross-entropy (rows without a target contribute nothing).
  S.x_last = x;
  Mat xf = S.xf = newMat("wlb::train::xf", n, h);
  S.rstd_f = newVec("wlb::train::rstd_f", n);
  rmsnormFwd(space, x, M.w_.norm_f, c.norm_eps, xf, S.rstd_f);
  Mat logits = S.logits = newMat("wlb::train::logits", n, V);
  runtime::gemm(space, Trans::N, Trans::N, 1.0f, xf, M.w_.head, 0.0f, logits);
  Vec row_loss = newVec("wlb::train::row_loss", n);
  {
    const bool bwd = backward;
    const float scale = loss_scale;
    Kokkos::parallel_for(
        "wlb::train::cross_entropy", Policy(space, 0, n), KOKKOS_LAMBDA(const std::int64_t i) {
          const int t = tgt(i);
          if (t < 0) {
            row_loss(i) = 0;
            if (bwd)
              for (std::int64_t j = 0; j < V; ++j) logits(i, j) = 0;  // becomes dL/dlogits
            return;
          }
          float m = logits(i, 0);
          for (std::int64_t j = 1; j < V; ++j) m = kk::max(m, logits(i, j));
          float s = 0;
          for (std::int64_t j = 0; j < V; ++j) s += kk::exp(logits(i, j) - m);
          const float lse = m + kk::log(s);
          row_loss(i) = lse - logits(i, t);
          if (bwd)
            for (std::int64_t j = 0; j < V; ++j)
              logits(i, j) = (kk::exp(logits(i, j) - lse) - (j == t ? 1.0f : 0.0f)) * scale;
        });
  }
  double loss = 0;
  Kokkos::parallel_reduce(
      "wlb::train::loss_sum", Policy(space, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i, double& acc) { acc += static_cast<double>(row_loss(i)); }, loss);
  S.loss = loss;
  return Mat();
}

Mat StagePass::backward(Mat dy_out) {
  State& S = *s_;
  if (!S.forward_done || !S.keep) throw std::logic_error("StagePass::backward: no forward kept for it");
  S.keep = false;
  const Llama& M = *S.model;
  const LlamaConfig& c = M.cfg_;
  const Space& space = S.space;
  const std::int64_t n = S.batch.n, h = c.hidden;
  const int D = c.headDim(), H = c.localHeads(), KV = c.localKvHeads();
  const std::int64_t F = c.localFfn();
  Mat cos_t = S.cos_t, sin_t = S.sin_t;
  IVec tok = S.batch.tokens, pos = S.batch.positions;
  Mat dx;
  if (c.lastStage()) {
    Mat dlogits = S.logits;
    runtime::gemm(space, Trans::T, Trans::N, 1.0f, S.xf, dlogits, 1.0f, M.g_.head);  // dHead += xf^T dlogits
    Mat dxf = newMat("wlb::train::dxf", n, h);
    runtime::gemm(space, Trans::N, Trans::T, 1.0f, dlogits, M.w_.head, 0.0f, dxf);
    dx = Mat("wlb::train::dx", n, h);
    rmsnormBwd(space, S.x_last, M.w_.norm_f, S.rstd_f, dxf, dx, M.g_.norm_f);
    S.logits = S.xf = S.x_last = Mat();
  } else {
    if (static_cast<std::int64_t>(dy_out.extent(0)) != n || static_cast<std::int64_t>(dy_out.extent(1)) != h)
      throw std::logic_error("StagePass::backward: output gradient of " + std::to_string(dy_out.extent(0)) +
                             " rows for " + std::to_string(n) + " tokens");
    dx = dy_out;
  }
  for (int li = static_cast<int>(M.w_.layers.size()) - 1; li >= 0; --li) {
    const int l = M.first_layer_ + li;
    const LlamaLayer& w = M.w_.layers[static_cast<std::size_t>(li)];
    const LlamaLayer& g = M.g_.layers[static_cast<std::size_t>(li)];
    LayerSaved& L = S.saved[static_cast<std::size_t>(li)];
    Mat dy = dx;  // gradient of the layer output y = h + MLP(h)
    // MLP.
    Mat ds = newMat("wlb::train::ds", n, F);
    runtime::gemm(space, Trans::T, Trans::N, 1.0f, L.s, dy, 1.0f, g.w2);  // dW2 += s^T dy
    runtime::gemm(space, Trans::N, Trans::T, 1.0f, dy, w.w2, 0.0f, ds);   // ds = dy W2^T
    {
      Mat a1 = L.a1, a3 = L.a3, da1 = L.s;  // s no longer needed: holds d(a1)
      Kokkos::parallel_for(
          "wlb::train::swiglu_bwd", Policy(space, 0, static_cast<std::int64_t>(ds.size())),
          KOKKOS_LAMBDA(const std::int64_t i) {
            const float a = a1.data()[i], sg = sigmoid(a), d = ds.data()[i];
            da1.data()[i] = d * a3.data()[i] * sg * (1.0f + a * (1.0f - sg));
            ds.data()[i] = d * a * sg;  // d(a3)
          });
    }
    runtime::gemm(space, Trans::T, Trans::N, 1.0f, L.hn, L.s, 1.0f, g.w1);  // dW1 += hn^T da1
    runtime::gemm(space, Trans::T, Trans::N, 1.0f, L.hn, ds, 1.0f, g.w3);   // dW3 += hn^T da3
    Mat dhn = newMat("wlb::train::dhn", n, h);
    runtime::gemm(space, Trans::N, Trans::T, 1.0f, L.s, w.w1, 0.0f, dhn);
    runtime::gemm(space, Trans::N, Trans::T, 1.0f, ds, w.w3, 1.0f, dhn);
    tpSum(M.tp_, M.rec_, space, dhn, l, true);  // TP: the MLP slices' partial input gradients
    Mat dh = newMat("wlb::train::dh", n, h);
    Kokkos::deep_copy(space, dh, dy);  // residual
    rmsnormBwd(space, L.h, w.norm2, L.rstd2, dhn, dh, g.norm2);
    // Out-proj and attention.
    runtime::gemm(space, Trans::T, Trans::N, 1.0f, runtime::flat(L.o), dh, 1.0f, g.wo);  // dWo += o^T dh
    Act3 d_o = newAct3("wlb::train::dO", n, H, D);
    runtime::gemm(space, Trans::N, Trans::T, 1.0f, dh, w.wo, 0.0f, runtime::flat(d_o));
    Act3 dq = Act3("wlb::train::dq", n, H, D), dk = Act3("wlb::train::dk", n, KV, D),
         dv = Act3("wlb::train::dv", n, KV, D);  // zeroed: backward accumulates
    if (S.attn)
      S.attn->backward(space, l, L.q, L.k, L.v, L.o, L.lse, d_o, dq, dk, dv);
    else
      attention::backward(space, L.q, L.k, L.v, L.o, L.lse, d_o, S.varlen, dq, dk, dv);
    rope(space, dq, pos, cos_t, sin_t, -1.0f);
    rope(space, dk, pos, cos_t, sin_t, -1.0f);
    runtime::gemm(space, Trans::T, Trans::N, 1.0f, L.xn1, runtime::flat(dq), 1.0f, g.wq);
    runtime::gemm(space, Trans::T, Trans::N, 1.0f, L.xn1, runtime::flat(dk), 1.0f, g.wk);
    runtime::gemm(space, Trans::T, Trans::N, 1.0f, L.xn1, runtime::flat(dv), 1.0f, g.wv);
    Mat dxn1 = newMat("wlb::train::dxn1", n, h);
    runtime::gemm(space, Trans::N, Trans::T, 1.0f, runtime::flat(dq), w.wq, 0.0f, dxn1);
    runtime::gemm(space, Trans::N, Trans::T, 1.0f, runtime::flat(dk), w.wk, 1.0f, dxn1);
    runtime::gemm(space, Trans::N, Trans::T, 1.0f, runtime::flat(dv), w.wv, 1.0f, dxn1);
    tpSum(M.tp_, M.rec_, space, dxn1, l, true);  // TP: the heads' partial input gradients
    Mat dxl = newMat("wlb::train::dx", n, h);
    Kokkos::deep_copy(space, dxl, dh);  // residual
    rmsnormBwd(space, L.x, w.norm1, L.rstd1, dxn1, dxl, g.norm1);
    dx = dxl;
    L = LayerSaved();
  }
  if (!c.firstStage()) {
    kk::fence(space, "wlb::train::StagePass::backward");  // the input gradient leaves the stage
    return dx;
  }
  {
    Mat dE = M.g_.embed;
    Kokkos::parallel_for(
        "wlb::train::embed_bwd", Policy(space, 0, h), KOKKOS_LAMBDA(const std::int64_t j) {
          for (std::int64_t i = 0; i < n; ++i) dE(tok(i), j) += dx(i, j);  // rows in order: no atomics
        });
  }
  kk::fence(space, "wlb::train::Llama::backward");
  return Mat();
}

double Llama::run(const Space& space, const TokenBatch& batch, bool backward, float loss_scale, AttentionOp* attn) {
  if (cfg_.pp != 1) throw std::logic_error("Llama::run: a pipeline stage runs through StagePass");
  // Without an op the attention is this rank's alone: nothing to do for no tokens. An op
  // (CP) is collective, so a rank without tokens still walks every layer with it.
  if (batch.n == 0 && attn == nullptr) return 0.0;
  StagePass pass(*this, space, batch, attn);
  pass.forward(Mat(), backward, loss_scale);
  if (backward) pass.backward(Mat());
  return pass.loss();
}

// ---- AdamW ----------------------------------------------------------------------------

double AdamWConfig::lrAt(std::int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const double span = static_cast<double>(std::max<std::int64_t>(1, total_steps - warmup_steps));
  const double p = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  const double lo = lr * min_lr_ratio;
  return lo + 0.5 * (lr - lo) * (1.0 + std::cos(M_PI * p));
}

AdamW::AdamW(const Llama& model, AdamWConfig cfg) : cfg_(cfg) {
  const std::int64_t n = model.paramCount();
  m_ = Vec("wlb::train::adam_m", n);
  v_ = Vec("wlb::train::adam_v", n);
  decay_ = Vec("wlb::train::decay_mask", n);
  Space space;
  for (const auto& t : model.tensors())
    if (t.decay) Kokkos::deep_copy(space, Kokkos::subview(decay_, std::make_pair(t.offset, t.offset + t.size)), 1.0f);
  if (model.tpGroup() != nullptr) {
    sliced_ = Vec("wlb::train::tp_sliced_mask", n);
    for (const auto& t : model.tensors())
      if (t.slice != 0)
        Kokkos::deep_copy(space, Kokkos::subview(sliced_, std::make_pair(t.offset, t.offset + t.size)), 1.0f);
  }
  kk::fence(space, "wlb::train::AdamW::init");
}

double AdamW::step(const Space& space, Llama& model, std::int64_t step) {
  Vec g = model.grads(), w = model.weights(), m = m_, v = v_, mask = decay_;
  const std::int64_t n = model.paramCount();
  double sq = 0;
  if (model.tpGroup() == nullptr) {
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
    MPI_Allreduce(&part, &all, 1, MPI_DOUBLE, MPI_SUM, model.tpGroup()->mpi());
    sq = rep + all;
  }
  // PP: every stage holds other tensors; their squares add up (stage order, every rank alike).
  if (model.ppComm() != MPI_COMM_NULL) MPI_Allreduce(MPI_IN_PLACE, &sq, 1, MPI_DOUBLE, MPI_SUM, model.ppComm());
  const double norm = std::sqrt(sq);
  const float coef = (cfg_.clip > 0 && norm > cfg_.clip) ? static_cast<float>(cfg_.clip / (norm + 1e-6)) : 1.0f;
  const float lr = static_cast<float>(cfg_.lrAt(step));
  const float b1 = cfg_.beta1, b2 = cfg_.beta2, eps = cfg_.eps, wd = cfg_.weight_decay;
  const float c1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), static_cast<double>(step + 1)));
  const float c2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), static_cast<double>(step + 1)));
  Kokkos::parallel_for(
      "wlb::train::adamw", Policy(space, 0, n), KOKKOS_LAMBDA(const std::int64_t i) {
        const float gi = g(i) * coef;
        const float mi = b1 * m(i) + (1.0f - b1) * gi;
        const float vi = b2 * v(i) + (1.0f - b2) * gi * gi;
        m(i) = mi;
        v(i) = vi;
        w(i) -= lr * ((mi / c1) / (kk::sqrt(vi / c2) + eps) + wd * mask(i) * w(i));
      });
  kk::fence(space, "wlb::train::adamw");
  return norm;
}

}  // namespace wlb::train
