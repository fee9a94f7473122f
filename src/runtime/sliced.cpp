/// \file sliced.cpp
/// \brief SlimPack's sliced execution on one pipeline stage (see sliced.hpp).

#include "runtime/sliced.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "model/memory.hpp"
#include "trace/recorder.hpp"

namespace wlb::runtime {
namespace {

using Clock = std::chrono::steady_clock;

template <class T>
Act3T<T> rowsOf(const Act3T<T>& a, std::int64_t r0, std::int64_t r1) {
  return Kokkos::subview(a, std::make_pair(r0, r1), Kokkos::ALL, Kokkos::ALL);
}

// dst (+)= src over rows of the same shape (contiguous LayoutRight row ranges); sums are
// FP32 (gradients), BF16 rows are only copied.
template <class T>
void copyRows(const Space& space, const Act3T<T>& dst, const Act3T<T>& src, bool add) {
  if (dst.size() != src.size()) throw std::logic_error("SlicedStage: row copy of different sizes");
  T* d = dst.data();
  const T* s = src.data();
  Kokkos::parallel_for(
      add ? "wlb::runtime::sliced::add_rows" : "wlb::runtime::sliced::copy_rows",
      Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(dst.size())), KOKKOS_LAMBDA(const std::int64_t e) {
        if constexpr (std::is_same_v<T, float>) {
          if (add)
            d[e] += s[e];
          else
            d[e] = s[e];
        } else {
          d[e] = s[e];
        }
      });
}

}  // namespace

SlicedStage::SlicedStage(const LayerEnv& env, const Llama& model, const pp::ReplicaSlices& slices)
    : env_(env), model_(&model), slices_(&slices) {
  const auto n = static_cast<std::int64_t>(slices.segments.size());
  fwd_row_.assign(static_cast<std::size_t>(n), 0);
  bwd_row_ = fwd_row_;
  for (const auto* cuts : {&slices.fwd_cuts, &slices.bwd_cuts}) {
    auto& row = cuts == &slices.fwd_cuts ? fwd_row_ : bwd_row_;
    for (std::size_t k = 0; k + 1 < cuts->size(); ++k) {
      std::int64_t r = 0;
      for (auto i = (*cuts)[k]; i < (*cuts)[k + 1]; ++i) {
        row[static_cast<std::size_t>(i)] = r;
        r += slices.segments[static_cast<std::size_t>(i)].length;
      }
    }
  }
  // Chains: the segments of a slice's document before it, back to its first key.
  chain_.resize(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const Segment& s = slices.segments[static_cast<std::size_t>(i)];
    auto& ch = chain_[static_cast<std::size_t>(i)];
    std::int64_t at = s.offset, j = i;
    while (at > s.offset - s.q_offset) {
      j = slices.prev[static_cast<std::size_t>(j)];
      if (j < 0)
        throw InputError("plan: the slice of document " + std::to_string(s.doc) + " at offset " +
                         std::to_string(s.offset) + " attends to tokens [" + std::to_string(s.offset - s.q_offset) +
                         ", " + std::to_string(s.offset) + ") that no segment of its step holds up to " +
                         std::to_string(at) + " (sliced execution needs a sample's slices in one step)");
      const Segment& p = slices.segments[static_cast<std::size_t>(j)];
      if (p.offset < s.offset - s.q_offset)
        throw InputError("plan: the slice of document " + std::to_string(s.doc) + " at offset " +
                         std::to_string(s.offset) + " has q_offset " + std::to_string(s.q_offset) +
                         " inside the segment at offset " + std::to_string(p.offset));
      ch.push_back(j);
      at = p.offset;
    }
    std::reverse(ch.begin(), ch.end());
  }
}

std::int64_t SlicedStage::tokens(const std::vector<std::int64_t>& cuts, int k) const {
  std::int64_t t = 0;
  for (auto i = cuts[static_cast<std::size_t>(k)]; i < cuts[static_cast<std::size_t>(k) + 1]; ++i)
    t += slices_->segments[static_cast<std::size_t>(i)].length;
  return t;
}

double SlicedStage::attnFlops(const std::vector<std::int64_t>& cuts, int k, model::Phase phase) const {
  double flops = 0;
  for (auto i = cuts[static_cast<std::size_t>(k)]; i < cuts[static_cast<std::size_t>(k) + 1]; ++i) {
    const Segment& s = slices_->segments[static_cast<std::size_t>(i)];
    flops += env_.cost->attnFlops(s.q_offset, s.length, phase);
  }
  return flops;
}

std::vector<TokenRef> SlicedStage::rows(bool bwd, int k) const {
  const auto& cuts = bwd ? slices_->bwd_cuts : slices_->fwd_cuts;
  std::vector<TokenRef> out;
  for (auto i = cuts[static_cast<std::size_t>(k)]; i < cuts[static_cast<std::size_t>(k) + 1]; ++i)
    appendSegmentRows(slices_->segments[static_cast<std::size_t>(i)], slices_->continued[static_cast<std::size_t>(i)],
                      out);
  return out;
}

bool SlicedStage::empty() const {
  for (const auto& [l, sv] : saved_)
    if (!sv.runs.empty() || !sv.acc.empty()) return false;
  for (const auto& [l, sv] : bsaved_)
    if (!sv.runs.empty() || !sv.acc.empty()) return false;
  return true;
}

template <class T>
std::map<int, SlicedStage::Saved<T>>& SlicedStage::saved() {
  if constexpr (std::is_same_v<T, bf16>)
    return bsaved_;
  else
    return saved_;
}
template <class T>
const std::map<int, SlicedStage::Saved<T>>& SlicedStage::saved() const {
  if constexpr (std::is_same_v<T, bf16>)
    return bsaved_;
  else
    return saved_;
}

Mat SlicedStage::forward(int k, int l, const Mat& x, const IVec& pos) {
  return env_.bf16Storage() ? forwardT<bf16>(k, l, x, pos) : forwardT<float>(k, l, x, pos);
}

Mat SlicedStage::backward(int j, int l, const Mat& dy, const IVec& pos) {
  return env_.bf16Storage() ? backwardT<bf16>(j, l, dy, pos) : backwardT<float>(j, l, dy, pos);
}

SlicedStage::Keys SlicedStage::keyLayout(const std::vector<std::int64_t>& cuts, int k) const {
  Keys keys;
  const auto s0 = cuts[static_cast<std::size_t>(k)], s1 = cuts[static_cast<std::size_t>(k) + 1];
  const auto& rows = &cuts == &slices_->fwd_cuts ? fwd_row_ : bwd_row_;
  for (auto i = s0; i < s1; ++i)
    if (slices_->segments[static_cast<std::size_t>(i)].q_offset > 0) keys.own = false;
  for (auto i = s0; i < s1; ++i) {
    const Segment& s = slices_->segments[static_cast<std::size_t>(i)];
    const std::int64_t q0 = rows[static_cast<std::size_t>(i)];
    attention::PieceRange p{q0, q0 + s.length, q0, q0 + s.length};
    if (!keys.own) {
      p.k_begin = keys.rows;
      p.k_end = keys.rows + s.q_offset + s.length;
      keys.rows = p.k_end;
    }
    keys.pieces.push_back(p);
  }
  if (keys.own) keys.rows = tokens(cuts, k);
  return keys;
}

template <class T>
Act3T<T> SlicedStage::kvRows(int l, std::int64_t i, bool value, const LayerActsT<T>* cur, std::int64_t cur_s0,
                             std::int64_t cur_s1) const {
  const auto len = slices_->segments[static_cast<std::size_t>(i)].length;
  if (cur && i >= cur_s0 && i < cur_s1) {
    const std::int64_t r = fwd_row_[static_cast<std::size_t>(i)];
    return rowsOf<T>(value ? cur->v : cur->k, r, r + len);
  }
  const auto& all = saved<T>();
  const auto sv = all.find(l);
  if (sv != all.end()) {
    auto it = sv->second.runs.upper_bound(i);
    if (it != sv->second.runs.begin()) {
      --it;
      const Run<T>& run = it->second;
      if (i < run.s1) {
        const std::int64_t r = fwd_row_[static_cast<std::size_t>(i)] - fwd_row_[static_cast<std::size_t>(run.s0)];
        return rowsOf<T>(value ? run.acts.v : run.acts.k, r, r + len);
      }
    }
  }
  throw std::logic_error("SlicedStage: the K/V of segment " + std::to_string(i) + " at layer " + std::to_string(l) +
                         " are gone (backward out of order)");
}

template <class T>
void SlicedStage::buildKv(const std::vector<std::int64_t>& cuts, int k, int l, const Keys& keys,
                          const LayerActsT<T>* cur, Act3T<T>& kbuf, Act3T<T>& vbuf) const {
  const Space& space = *env_.space;
  const LayerShape sh = LayerShape::of(model_->config());
  kbuf = newAct3T<T>(env_.pool, "wlb::runtime::sliced::kv_k", keys.rows, sh.kv_heads, sh.head_dim);
  vbuf = newAct3T<T>(env_.pool, "wlb::runtime::sliced::kv_v", keys.rows, sh.kv_heads, sh.head_dim);
  const auto s0 = cuts[static_cast<std::size_t>(k)];
  const std::int64_t cs0 = cur ? slices_->fwd_cuts[static_cast<std::size_t>(k)] : 0;
  const std::int64_t cs1 = cur ? slices_->fwd_cuts[static_cast<std::size_t>(k) + 1] : 0;
  for (std::size_t p = 0; p < keys.pieces.size(); ++p) {
    const std::int64_t i = s0 + static_cast<std::int64_t>(p);
    std::int64_t at = keys.pieces[p].k_begin;
    std::vector<std::int64_t> parts = chain_[static_cast<std::size_t>(i)];
    parts.push_back(i);
    for (const std::int64_t j : parts) {
      const Act3T<T> ks = kvRows<T>(l, j, false, cur, cs0, cs1), vs = kvRows<T>(l, j, true, cur, cs0, cs1);
      const auto len = static_cast<std::int64_t>(ks.extent(0));
      copyRows<T>(space, rowsOf<T>(kbuf, at, at + len), ks, false);
      copyRows<T>(space, rowsOf<T>(vbuf, at, at + len), vs, false);
      at += len;
    }
    if (at != keys.pieces[p].k_end) throw std::logic_error("SlicedStage: key layout mismatch");
  }
}

template <class T>
Mat SlicedStage::forwardT(int k, int l, const Mat& x, const IVec& pos) {
  const Space& space = *env_.space;
  const LayerShape sh = LayerShape::of(model_->config());
  const LayerParamsT<T>& w = model_->working<T>(l);
  const auto& fc = slices_->fwd_cuts;
  const auto s0 = fc[static_cast<std::size_t>(k)], s1 = fc[static_cast<std::size_t>(k) + 1];
  const std::int64_t n = fwdTokens(k);
  if (static_cast<std::int64_t>(x.extent(0)) != n)
    throw std::logic_error("SlicedStage::forward: input rows " + std::to_string(x.extent(0)) + ", MicroPack tokens " +
                           std::to_string(n));
  LayerActsT<T> a;
  a.x = x;
  qkvForward(env_, sh, w, a, pos);
  // Attention over each segment's chain and own keys.
  const Keys keys = keyLayout(fc, k);
  Act3T<T> kbuf = a.k, vbuf = a.v;
  if (!keys.own) buildKv<T>(fc, k, l, keys, &a, kbuf, vbuf);
  a.o = newAct3T<T>(env_.pool, "wlb::runtime::o", n, sh.heads, sh.head_dim);
  a.lse = newMat(env_.pool, "wlb::runtime::lse", n, sh.heads);
  {
    const double flops = attnFlops(fc, k, model::Phase::Fwd);
    const auto t = Clock::now();
    trace::PhaseScope r(env_.recorder, trace::labels::kAttn, space, trace::Phase::Fwd, flops);
    const auto batch = attention::VarlenBatch::fromRanges(keys.pieces);
    attention::forward<Space>(space, a.q, kbuf, vbuf, batch, a.o, a.lse, env_.kernel);
    kk::fence(space, "wlb::runtime::sliced::attn_fwd");
    attn_seconds_ = std::chrono::duration<double>(Clock::now() - t).count();
  }
  kbuf = vbuf = Act3T<T>();
  const Mat y = outMlpForward(env_, w, a);
  // Save: one run per backward MicroPack the forward MicroPack feeds.
  Saved<T>& sv = saved<T>()[l];
  const auto& bc = slices_->bwd_cuts;
  for (std::size_t j = 0; j + 1 < bc.size(); ++j) {
    const auto r0 = std::max(s0, bc[j]), r1 = std::min(s1, bc[j + 1]);
    if (r0 >= r1) continue;
    Run<T> run;
    run.s0 = r0;
    run.s1 = r1;
    if (r0 == s0 && r1 == s1) {
      run.acts = a;
    } else {
      const std::int64_t end = r1 < s1 ? fwd_row_[static_cast<std::size_t>(r1)] : n;
      run.acts = a.copyRows(space, fwd_row_[static_cast<std::size_t>(r0)], end);
    }
    run.bytes = run.acts.bytes();
    held_ += run.bytes;
    sv.runs[r0] = std::move(run);
  }
  for (auto i = s0; i < s1; ++i)
    if (slices_->continued[static_cast<std::size_t>(i)]) {
      const auto len = slices_->segments[static_cast<std::size_t>(i)].length;
      Act3 dk("wlb::runtime::sliced::dk_acc", len, sh.kv_heads, sh.head_dim);
      Act3 dv("wlb::runtime::sliced::dv_acc", len, sh.kv_heads, sh.head_dim);
      held_ += 4 * static_cast<std::int64_t>(dk.span() + dv.span());
      sv.acc[i] = {dk, dv};
    }
  kk::fence(space, "wlb::runtime::sliced::fwd");
  return y;
}

template <class T>
Mat SlicedStage::backwardT(int j, int l, const Mat& dy, const IVec& pos) {
  const Space& space = *env_.space;
  const LayerShape sh = LayerShape::of(model_->config());
  const LayerParamsT<T>& w = model_->working<T>(l);
  const LayerParams& g = model_->grads(l);
  const auto& bc = slices_->bwd_cuts;
  const auto s0 = bc[static_cast<std::size_t>(j)], s1 = bc[static_cast<std::size_t>(j) + 1];
  const std::int64_t n = bwdTokens(j);
  if (static_cast<std::int64_t>(dy.extent(0)) != n)
    throw std::logic_error("SlicedStage::backward: gradient rows " + std::to_string(dy.extent(0)) +
                           ", MicroPack tokens " + std::to_string(n));
  Saved<T>& sv = saved<T>().at(l);
  std::vector<const LayerActsT<T>*> parts;
  for (auto it = sv.runs.lower_bound(s0); it != sv.runs.end() && it->first < s1; ++it)
    parts.push_back(&it->second.acts);
  LayerActsT<T> A = LayerActsT<T>::concat(space, parts);
  if (A.rows() != n) throw std::logic_error("SlicedStage::backward: saved rows do not cover the MicroPack");
  Mat dh;
  const Act3T<T> d_o = outMlpBackward(env_, w, g, A, dy, dh);
  // Attention backward into a key-gradient buffer of the forward's layout.
  const Keys keys = keyLayout(bc, j);
  Act3T<T> kbuf = A.k, vbuf = A.v;
  if (!keys.own) buildKv<T>(bc, j, l, keys, static_cast<const LayerActsT<T>*>(nullptr), kbuf, vbuf);
  Act3 dq("wlb::runtime::dq", n, sh.heads, sh.head_dim);
  Act3 dkb("wlb::runtime::sliced::dkv_k", keys.rows, sh.kv_heads, sh.head_dim);
  Act3 dvb("wlb::runtime::sliced::dkv_v", keys.rows, sh.kv_heads, sh.head_dim);
  {
    const double flops = attnFlops(bc, j, model::Phase::Bwd);
    const auto t = Clock::now();
    trace::PhaseScope r(env_.recorder, trace::labels::kAttn, space, trace::Phase::Bwd, flops);
    const auto batch = attention::VarlenBatch::fromRanges(keys.pieces);
    attention::backward<Space>(space, A.q, kbuf, vbuf, A.o, A.lse, d_o, batch, dq, dkb, dvb, env_.kernel);
    kk::fence(space, "wlb::runtime::sliced::attn_bwd");
    attn_seconds_ = std::chrono::duration<double>(Clock::now() - t).count();
  }
  kbuf = vbuf = Act3T<T>();
  A.o = Act3T<T>();
  A.lse = typename LayerActsT<T>::Lse();
  // Finish the slices latest first: own rows + accumulator; the prefix rows go to the chain.
  Act3 dk = keys.own ? dkb : newAct3("wlb::runtime::dk", n, sh.kv_heads, sh.head_dim);
  Act3 dv = keys.own ? dvb : newAct3("wlb::runtime::dv", n, sh.kv_heads, sh.head_dim);
  std::vector<std::int64_t> order;
  for (auto i = s0; i < s1; ++i) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return slices_->segments[static_cast<std::size_t>(a)].offset >
           slices_->segments[static_cast<std::size_t>(b)].offset;
  });
  for (const std::int64_t i : order) {
    const Segment& s = slices_->segments[static_cast<std::size_t>(i)];
    const auto& piece = keys.pieces[static_cast<std::size_t>(i - s0)];
    const std::int64_t r = bwd_row_[static_cast<std::size_t>(i)];
    const std::int64_t own = piece.k_end - s.length;  // own key rows in the buffer
    if (!keys.own) {
      copyRows<float>(space, rowsOf<float>(dk, r, r + s.length), rowsOf<float>(dkb, own, own + s.length), false);
      copyRows<float>(space, rowsOf<float>(dv, r, r + s.length), rowsOf<float>(dvb, own, own + s.length), false);
    }
    const auto acc = sv.acc.find(i);
    if (acc != sv.acc.end()) {
      copyRows<float>(space, rowsOf<float>(dk, r, r + s.length), acc->second.first, true);
      copyRows<float>(space, rowsOf<float>(dv, r, r + s.length), acc->second.second, true);
    }
    std::int64_t at = piece.k_begin;
    for (const std::int64_t c : chain_[static_cast<std::size_t>(i)]) {
      const auto len = slices_->segments[static_cast<std::size_t>(c)].length;
      auto& ca = sv.acc.at(c);
      copyRows<float>(space, ca.first, rowsOf<float>(dkb, at, at + len), true);
      copyRows<float>(space, ca.second, rowsOf<float>(dvb, at, at + len), true);
      at += len;
    }
  }
  dkb = dvb = Act3();
  Mat dx = qkvBackward(env_, w, g, A, dq, dk, dv, dh, pos);
  kk::fence(space, "wlb::runtime::sliced::bwd");
  // Free the MicroPack's slices.
  for (auto it = sv.runs.lower_bound(s0); it != sv.runs.end() && it->first < s1;) {
    held_ -= it->second.bytes;
    it = sv.runs.erase(it);
  }
  for (auto i = s0; i < s1; ++i) {
    const auto acc = sv.acc.find(i);
    if (acc == sv.acc.end()) continue;
    held_ -= 4 * static_cast<std::int64_t>(acc->second.first.span() + acc->second.second.span());
    sv.acc.erase(acc);
  }
  return dx;
}

}  // namespace wlb::runtime
