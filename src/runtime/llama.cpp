/// \file llama.cpp
/// \brief The model's parameters: layout, initialisation, views (see llama.hpp).

#include "runtime/llama.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "pp/schedule.hpp"

namespace wlb::runtime {
namespace {

using Policy = Kokkos::RangePolicy<Space>;

// Uniform in [-scale, scale] (scale 0: constant 1, the norm gains) over the tensor's slice
// of the buffer. A TP slice holds the same numbers as that block of the whole tensor.
void fillTensor(const Space& space, Vec buf, const TensorInfo& t, std::uint64_t seed, float scale, int tp_rank) {
  const auto slice = Kokkos::subview(buf, std::make_pair(t.offset, t.offset + t.size));
  const std::uint64_t stream = static_cast<std::uint64_t>(t.index) + 1;
  if (scale == 0.0f) {
    Kokkos::deep_copy(space, slice, 1.0f);
    return;
  }
  if (t.slice == 0) {
    fillRandom(space, Mat(slice.data(), 1, t.size), seed, stream, scale);
    return;
  }
  Mat full = newMat("wlb::runtime::init_full", 1, t.rows * t.cols);
  fillRandom(space, full, seed, stream, scale);
  const SliceIndex whole(t, tp_rank);
  float* dst = slice.data();
  const float* src = full.data();
  Kokkos::parallel_for(
      "wlb::runtime::init_slice", Policy(space, 0, t.size),
      KOKKOS_LAMBDA(const std::int64_t i) { dst[i] = src[whole(i)]; });
  kk::fence(space, "wlb::runtime::init_slice");  // `full` goes out of scope
}

bool endsWith(const std::string& s, const char* tail) {
  const std::string t(tail);
  return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

}  // namespace

void fillRandom(const Space& space, const Mat& m, std::uint64_t seed, std::uint64_t stream, float scale) {
  const std::int64_t cols = static_cast<std::int64_t>(m.extent(1));
  const std::uint64_t base = mix64(seed ^ mix64(stream));
  Kokkos::parallel_for(
      "wlb::runtime::fillRandom", Policy(space, 0, static_cast<std::int64_t>(m.size())),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const std::uint64_t r = mix64(base + static_cast<std::uint64_t>(i));
        const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        m(i / cols, i % cols) = scale * (2.0f * u - 1.0f);
      });
}

std::vector<int> stageLayers(int layers, int stages, int chunks, int stage) {
  std::vector<int> ids;
  for (int c = 0; c < chunks; ++c) {
    const auto b = pp::layerBlock(layers, stages * chunks, c * stages + stage);
    for (int l = b.first; l < b.first + b.count; ++l) ids.push_back(l);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<int> LlamaConfig::layerIds() const {
  return stageLayers(layers, pp, chunks, stage);
}

void LlamaConfig::validate() const {
  if (vocab < 1 || hidden < 1 || heads < 1 || kv_heads < 1 || ffn < 1 || layers < 1)
    throw std::invalid_argument("every model dimension must be >= 1");
  if (hidden % heads != 0 || (hidden / heads) % 2 != 0)
    throw std::invalid_argument("hidden must be heads * an even head_dim (RoPE rotates pairs)");
  if (heads % kv_heads != 0) throw std::invalid_argument("kv_heads must divide heads");
  if (tp < 1 || tp_rank < 0 || tp_rank >= tp) throw std::invalid_argument("bad tp / tp_rank");
  if (heads % tp != 0 || kv_heads % tp != 0 || ffn % tp != 0)
    throw std::invalid_argument("tensor parallelism needs heads, kv_heads and ffn divisible by tp = " +
                                std::to_string(tp));
  if (pp < 1 || stage < 0 || stage >= pp || chunks < 1) throw std::invalid_argument("bad pp / stage / chunks");
  if (pp * chunks > layers)
    throw std::invalid_argument("the pipeline needs at least one layer per virtual stage (" + std::to_string(pp) +
                                " x " + std::to_string(chunks) + " virtual stages, " + std::to_string(layers) +
                                " layers)");
}

LlamaConfig LlamaConfig::fromDeck(const Deck& deck, int tp, int tp_rank, int pp, int stage, int chunks) {
  const auto& m = deck.model;
  LlamaConfig c;
  c.vocab = static_cast<int>(m.vocab);
  c.hidden = static_cast<int>(m.hidden);
  c.heads = static_cast<int>(m.heads);
  c.kv_heads = static_cast<int>(m.kv_heads);
  c.ffn = static_cast<int>(m.ffn);
  c.layers = static_cast<int>(m.layers);
  c.rope_theta = static_cast<float>(deck.train.rope_theta);
  c.tp = tp;
  c.tp_rank = tp_rank;
  c.pp = pp;
  c.stage = stage;
  c.chunks = chunks;
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw InputError("model.hidden / heads / kv_heads / ffn / vocab / layers (" + std::to_string(m.hidden) + " / " +
                     std::to_string(m.heads) + " / " + std::to_string(m.kv_heads) + " / " + std::to_string(m.ffn) +
                     " / " + std::to_string(m.vocab) + " / " + std::to_string(m.layers) +
                     ") with mesh.tp = " + std::to_string(tp) + ", mesh.pp = " + std::to_string(pp) + ": " + e.what());
  }
  return c;
}

LlamaConfig LlamaConfig::of(const model::ModelDims& d, int tp) {
  LlamaConfig c;
  c.vocab = static_cast<int>(d.vocab);
  c.hidden = static_cast<int>(d.hidden);
  c.heads = static_cast<int>(d.heads);
  c.kv_heads = static_cast<int>(d.kv_heads);
  c.ffn = static_cast<int>(d.ffn);
  c.layers = static_cast<int>(d.layers);
  c.tp = tp;
  return c;
}

model::ModelDims LlamaConfig::dims() const {
  model::ModelDims d;
  d.hidden = hidden;
  d.heads = heads;
  d.kv_heads = kv_heads;
  d.head_dim = headDim();
  d.ffn = ffn;
  d.layers = layers;
  d.vocab = vocab;
  return d;
}

std::vector<TensorInfo> Llama::layout(const LlamaConfig& cfg) {
  // This rank's widths (the whole model's without TP).
  const std::int64_t h = cfg.hidden, V = cfg.vocab, D = cfg.headDim(), T = cfg.tp,
                     qw = static_cast<std::int64_t>(cfg.localHeads()) * D,
                     kw = static_cast<std::int64_t>(cfg.localKvHeads()) * D, f = cfg.localFfn();
  const std::vector<int> ids = cfg.layerIds();
  std::vector<TensorInfo> out;
  std::int64_t off = 0;
  int index = 0;  // every tensor of the whole model counts, held here or not
  auto add = [&](const std::string& name, std::int64_t rows, std::int64_t cols, bool decay, int slice, bool here) {
    if (here) {
      const std::int64_t size = T > 1 && slice != 0 ? rows * cols / T : rows * cols;
      out.push_back(TensorInfo{name, off, size, decay, T > 1 ? slice : 0, rows, cols, index});
      off += size;
    }
    ++index;
  };
  add("embed", V, h, true, 0, cfg.holdsEmbedding());
  for (int l = 0; l < cfg.layers; ++l) {
    const bool here = std::binary_search(ids.begin(), ids.end(), l);
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
  add("norm_f", 1, h, false, 0, cfg.holdsHead());
  add("head", h, V, true, 0, cfg.holdsHead());
  return out;
}

template <class E>
void Llama::viewTensors(E* base, float* gains, MatT<E>& embed, std::vector<LayerParamsT<E>>& layers, Vec& norm_f,
                        MatT<E>& head) const {
  const std::int64_t h = cfg_.hidden, V = cfg_.vocab, D = cfg_.headDim(),
                     qw = static_cast<std::int64_t>(cfg_.localHeads()) * D,
                     kw = static_cast<std::int64_t>(cfg_.localKvHeads()) * D, f = cfg_.localFfn();
  std::size_t t = 0;
  auto mat = [&](std::int64_t r, std::int64_t c) { return MatT<E>(base + tensors_[t++].offset, r, c); };
  auto vec = [&](std::int64_t k) { return Vec(gains + tensors_[t++].offset, k); };
  if (cfg_.holdsEmbedding()) embed = mat(V, h);
  for (std::size_t i = 0; i < ids_.size(); ++i) {
    LayerParamsT<E> L;
    L.norm1 = vec(h);
    L.wq = mat(h, qw);
    L.wk = mat(h, kw);
    L.wv = mat(h, kw);
    L.wo = mat(qw, h);
    L.norm2 = vec(h);
    L.w1 = mat(h, f);
    L.w3 = mat(h, f);
    L.w2 = mat(f, h);
    layers.push_back(L);
  }
  if (cfg_.holdsHead()) {
    norm_f = vec(h);
    head = mat(h, V);
  }
}

Llama::Llama(const LlamaConfig& cfg, std::uint64_t seed, Precision working)
    : cfg_(cfg), ids_(cfg.layerIds()), bf16_(working == Precision::Bf16) {
  cfg.validate();
  tensors_ = layout(cfg);
  const std::int64_t n = tensors_.empty() ? 0 : tensors_.back().offset + tensors_.back().size;
  w_buf_ = Vec("wlb::runtime::weights", n);
  g_buf_ = Vec("wlb::runtime::grads", n);
  viewTensors(w_buf_.data(), w_buf_.data(), w_embed_, w_layers_, w_norm_f_, w_head_);
  viewTensors(g_buf_.data(), g_buf_.data(), g_embed_, g_layers_, g_norm_f_, g_head_);
  Space space;
  const float sh = 1.0f / std::sqrt(static_cast<float>(cfg.hidden)), sf = 1.0f / std::sqrt(static_cast<float>(cfg.ffn));
  const float depth = 1.0f / std::sqrt(2.0f * static_cast<float>(cfg.layers));
  for (const TensorInfo& t : tensors_) {
    float scale = sh;
    if (t.name == "embed")
      scale = 1.0f;
    else if (!t.decay)
      scale = 0.0f;  // norm gains = 1
    else if (endsWith(t.name, ".wo"))
      scale = sh * depth;
    else if (endsWith(t.name, ".w2"))
      scale = sf * depth;
    fillTensor(space, w_buf_, t, seed, scale, cfg.tp_rank);
  }
  if (bf16_) {
    // The working copy: the masters' layout, matrices in BF16, the gains the masters'.
    b_buf_ = Kokkos::View<bf16*, Mem>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::weights_bf16"), n);
    Vec norm_f;
    viewTensors(b_buf_.data(), w_buf_.data(), b_embed_, b_layers_, norm_f, b_head_);
    refreshWorking(space);
  }
  kk::fence(space, "wlb::runtime::Llama::init");
}

void Llama::refreshWorking(const Space& space) {
  if (!bf16_) return;
  const float* src = w_buf_.data();
  bf16* dst = b_buf_.data();
  Kokkos::parallel_for(
      "wlb::runtime::refresh_working", Policy(space, 0, static_cast<std::int64_t>(b_buf_.extent(0))),
      KOKKOS_LAMBDA(const std::int64_t i) { dst[i] = attention::toBf16(src[i]); });
}

bool Llama::holds(int l) const {
  return std::binary_search(ids_.begin(), ids_.end(), l);
}

std::size_t Llama::slot(int l) const {
  const auto it = std::lower_bound(ids_.begin(), ids_.end(), l);
  if (it == ids_.end() || *it != l)
    throw std::logic_error("runtime::Llama: layer " + std::to_string(l) + " is not held by this rank");
  return static_cast<std::size_t>(it - ids_.begin());
}

void Llama::zeroGrads(const Space& space) {
  Kokkos::deep_copy(space, g_buf_, 0.0f);
}

}  // namespace wlb::runtime
