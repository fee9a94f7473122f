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
#include "runtime/pool.hpp"
#include "trace/recorder.hpp"

namespace wlb::runtime {
namespace {

using Clock = std::chrono::steady_clock;

template <class T>
Act3T<T> rowsOf(const Act3T<T>& a, std::int64_t r0, std::int64_t r1) {
  return Kokkos::subview(a, std::make_pair(r0, r1), Kokkos::ALL, Kokkos::ALL);
}

// dst (+)= src over rows of the same shape (contiguous LayoutRight row ranges) as one row
// of the row-move kernel; sums are FP32 (gradients), BF16 rows are only copied.
template <class T>
void copyRows(const Space& space, const Act3T<T>& dst, const Act3T<T>& src, bool add) {
  if (dst.size() != src.size()) throw std::logic_error("SlicedStage: row copy of different sizes");
  const rows::IdxView identity;
  rows::moveRows(space, dst.data(), identity, src.data(), identity, 1, static_cast<std::int64_t>(dst.size()), add);
}

}  // namespace

SlicedStage::SlicedStage(const LayerEnv& env, const Llama& model, const pp::ReplicaSlices& slices,
                         const pp::SliceShards& shards)
    : env_(env), model_(&model), slices_(&slices), shards_(&shards) {
  const auto n = static_cast<std::int64_t>(slices.segments.size());
  MPI_Comm_rank(env.cp_comm, &rank_);
  MPI_Comm_size(env.cp_comm, &cp_);
  if (shards.cp != cp_ || shards.parts.size() != slices.segments.size())
    throw std::logic_error("SlicedStage: slice layout for cp " + std::to_string(shards.cp) + ", CP group of " +
                           std::to_string(cp_));
  if (cp_ > 1) {
    const LayerShape sh = LayerShape::of(model.config());
    if (env.bf16Storage() && (sh.kv_heads * sh.head_dim) % 2 != 0)
      throw InputError("bf16 storage with cp > 1 needs an even kv_heads x head_dim per TP rank (got " +
                       std::to_string(sh.kv_heads * sh.head_dim) + ")");
    group_ = env.cp_group;
    if (!group_) {
      own_group_ = parallel::makeGroupComm(env.cp_comm, parallel::CommBackend::Mpi);
      group_ = own_group_.get();
    }
  }
  fwd_row_ = shards.firstRows(slices.fwd_cuts, rank_);
  bwd_row_ = shards.firstRows(slices.bwd_cuts, rank_);
  std::vector<std::int64_t> lengths;
  for (const Segment& s : slices.segments) lengths.push_back(s.length);
  fwd_packed_ = pp::unitOffsets(slices.fwd_cuts, lengths);
  bwd_packed_ = pp::unitOffsets(slices.bwd_cuts, lengths);
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

SlicedStage::Unit SlicedStage::unit(bool bwd, int k) const {
  const auto& cuts = bwd ? slices_->bwd_cuts : slices_->fwd_cuts;
  Unit u;
  u.bwd = bwd;
  u.k = k;
  u.s0 = cuts[static_cast<std::size_t>(k)];
  u.s1 = cuts[static_cast<std::size_t>(k) + 1];
  u.rows = shards_->unitRows(cuts, k, rank_);
  u.total = tokens(cuts, k);
  u.local = bwd ? &bwd_row_ : &fwd_row_;
  u.packed = bwd ? &bwd_packed_ : &fwd_packed_;
  return u;
}

double SlicedStage::attnFlops(const Unit& u, model::Phase phase) const {
  double flops = 0;
  for (auto i = u.s0; i < u.s1; ++i) {
    const Segment& s = slices_->segments[static_cast<std::size_t>(i)];
    for (const auto& p : shards_->parts[static_cast<std::size_t>(i)])
      if (p.rank == rank_) flops += env_.cost->attnFlops(s.q_offset + p.q_offset, p.q_len, phase);
  }
  return flops;
}

std::vector<TokenRef> SlicedStage::rows(bool bwd, int k) const {
  const Unit u = unit(bwd, k);
  std::vector<TokenRef> out;
  for (auto i = u.s0; i < u.s1; ++i)
    for (const auto& p : shards_->parts[static_cast<std::size_t>(i)])
      if (p.rank == rank_)
        appendPieceRows(slices_->segments[static_cast<std::size_t>(i)], slices_->continued[static_cast<std::size_t>(i)],
                        p.q_offset, p.q_len, out);
  return out;
}

bool SlicedStage::empty() const {
  for (const auto& [l, sv] : saved_)
    if (!sv.runs.empty() || !sv.acc.empty() || !sv.cache.empty()) return false;
  for (const auto& [l, sv] : bsaved_)
    if (!sv.runs.empty() || !sv.acc.empty() || !sv.cache.empty()) return false;
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

SlicedStage::Keys SlicedStage::keyLayout(const Unit& u) const {
  Keys keys;
  for (auto i = u.s0; i < u.s1; ++i)
    if (slices_->segments[static_cast<std::size_t>(i)].q_offset > 0) keys.own = false;
  for (auto i = u.s0; i < u.s1; ++i) {
    const Segment& s = slices_->segments[static_cast<std::size_t>(i)];
    const std::int64_t packed = (*u.packed)[static_cast<std::size_t>(i)];
    std::int64_t q = (*u.local)[static_cast<std::size_t>(i)], len = 0;
    for (const auto& p : shards_->parts[static_cast<std::size_t>(i)])
      if (p.rank == rank_) len = std::max(len, p.q_offset + p.q_len);
    if (len == 0) continue;
    // own: the packed rows themselves; else a block of the chain and the segment's rows.
    const std::int64_t kb = keys.own ? packed : keys.rows, chain = keys.own ? 0 : s.q_offset;
    if (!keys.own) {
      keys.blocks.push_back({i, len, kb});
      keys.rows += chain + len;
    }
    for (const auto& p : shards_->parts[static_cast<std::size_t>(i)])
      if (p.rank == rank_) {
        keys.pieces.push_back({q, q + p.q_len, kb, kb + chain + p.q_offset + p.q_len});
        q += p.q_len;
      }
  }
  if (keys.own) keys.rows = u.total;
  return keys;
}

template <class T>
Act3T<T> SlicedStage::chainRows(int l, std::int64_t c, bool value, const Unit& u, const Act3T<T>& p) const {
  const auto len = slices_->segments[static_cast<std::size_t>(c)].length;
  if (c >= u.s0 && c < u.s1) {
    const std::int64_t r = (*u.packed)[static_cast<std::size_t>(c)];
    return rowsOf<T>(p, r, r + len);
  }
  const auto& all = saved<T>();
  const auto sv = all.find(l);
  if (sv != all.end()) {
    if (cp_ > 1) {
      const auto it = sv->second.cache.find(c);
      if (it != sv->second.cache.end()) return value ? it->second.second : it->second.first;
    } else {
      auto it = sv->second.runs.upper_bound(c);
      if (it != sv->second.runs.begin()) {
        --it;
        const Run<T>& run = it->second;
        if (c < run.s1) {
          const std::int64_t r = fwd_row_[static_cast<std::size_t>(c)] - fwd_row_[static_cast<std::size_t>(run.s0)];
          return rowsOf<T>(value ? run.acts.v : run.acts.k, r, r + len);
        }
      }
    }
  }
  throw std::logic_error("SlicedStage: the K/V of segment " + std::to_string(c) + " at layer " + std::to_string(l) +
                         " are gone (backward out of order)");
}

template <class T>
void SlicedStage::buildKv(const Unit& u, int l, const Keys& keys, const Act3T<T>& pk, const Act3T<T>& pv,
                          Act3T<T>& kbuf, Act3T<T>& vbuf) const {
  const Space& space = *env_.space;
  const LayerShape sh = LayerShape::of(model_->config());
  kbuf = newAct3T<T>(env_.pool, "wlb::runtime::sliced::kv_k", keys.rows, sh.kv_heads, sh.head_dim);
  vbuf = newAct3T<T>(env_.pool, "wlb::runtime::sliced::kv_v", keys.rows, sh.kv_heads, sh.head_dim);
  for (const auto& b : keys.blocks) {
    std::int64_t at = b.k_begin;
    for (const std::int64_t c : chain_[static_cast<std::size_t>(b.seg)]) {
      const Act3T<T> ks = chainRows<T>(l, c, false, u, pk), vs = chainRows<T>(l, c, true, u, pv);
      const auto len = static_cast<std::int64_t>(ks.extent(0));
      copyRows<T>(space, rowsOf<T>(kbuf, at, at + len), ks, false);
      copyRows<T>(space, rowsOf<T>(vbuf, at, at + len), vs, false);
      at += len;
    }
    const std::int64_t r = (*u.packed)[static_cast<std::size_t>(b.seg)];
    copyRows<T>(space, rowsOf<T>(kbuf, at, at + b.len), rowsOf<T>(pk, r, r + b.len), false);
    copyRows<T>(space, rowsOf<T>(vbuf, at, at + b.len), rowsOf<T>(pv, r, r + b.len), false);
    if (at - b.k_begin != slices_->segments[static_cast<std::size_t>(b.seg)].q_offset)
      throw std::logic_error("SlicedStage: key layout mismatch");
  }
}

const SlicedStage::GatherMap& SlicedStage::gatherMap(const Unit& u) {
  const auto key = std::make_pair(u.bwd, u.k);
  auto it = gather_.find(key);
  if (it != gather_.end()) return it->second;
  GatherMap g;
  g.index = rows::upload(shards_->gatherIndex(u.bwd ? slices_->bwd_cuts : slices_->fwd_cuts, u.k, &g.counts, &g.displs),
                         "wlb::runtime::sliced::gather_map");
  return gather_.emplace(key, std::move(g)).first->second;
}

template <class T>
void SlicedStage::packedKv(const Unit& u, const Act3T<T>& k, const Act3T<T>& v, Act3T<T>& pk, Act3T<T>& pv) {
  if (cp_ == 1) {
    pk = k;
    pv = v;
    return;
  }
  namespace rw = wlb::runtime::rows;
  const Space& space = *env_.space;
  const LayerShape sh = LayerShape::of(model_->config());
  const std::int64_t width = static_cast<std::int64_t>(sh.kv_heads) * sh.head_dim, ww = rw::wordCount<T>(width);
  const GatherMap& g = gatherMap(u);
  const auto counts = rw::scaled(g.counts, ww), displs = rw::scaled(g.displs, ww);
  pk = newAct3T<T>(env_.pool, "wlb::runtime::sliced::packed_k", u.total, sh.kv_heads, sh.head_dim);
  pv = newAct3T<T>(env_.pool, "wlb::runtime::sliced::packed_v", u.total, sh.kv_heads, sh.head_dim);
  Act3T<T> gk = newAct3T<T>(env_.pool, "wlb::runtime::sliced::gathered", u.total, sh.kv_heads, sh.head_dim);
  const rw::IdxView none;
  kk::fence(space, "wlb::runtime::sliced::gather");
  group_->allgatherv(space, rw::words(k.data()), rw::words(gk.data()), counts, displs);
  rw::moveRows(space, pk.data(), none, gk.data(), g.index, u.total, width, false);
  kk::fence(space, "wlb::runtime::sliced::gather_k");
  group_->allgatherv(space, rw::words(v.data()), rw::words(gk.data()), counts, displs);
  rw::moveRows(space, pv.data(), none, gk.data(), g.index, u.total, width, false);
  kk::fence(space, "wlb::runtime::sliced::gather_v");
}

Act3 SlicedStage::ownKvGrad(const Unit& u, const Act3& dpacked) {
  if (cp_ == 1) return dpacked;
  namespace rw = wlb::runtime::rows;
  const Space& space = *env_.space;
  const LayerShape sh = LayerShape::of(model_->config());
  const std::int64_t width = static_cast<std::int64_t>(sh.kv_heads) * sh.head_dim;
  const GatherMap& g = gatherMap(u);
  // Each packed row is one gathered row: a plain scatter, then the sum over the group.
  Act3 gathered = newAct3(env_.pool, "wlb::runtime::sliced::gathered_dkv", u.total, sh.kv_heads, sh.head_dim);
  Act3 own = newAct3(env_.pool, "wlb::runtime::sliced::dkv", u.rows, sh.kv_heads, sh.head_dim);
  const rw::IdxView none;
  rw::moveRows(space, gathered.data(), g.index, dpacked.data(), none, u.total, width, false);
  kk::fence(space, "wlb::runtime::sliced::scatter_dkv");
  group_->reduceScatterv(space, gathered.data(), own.data(), rw::scaled(g.counts, width), rw::scaled(g.displs, width));
  return own;
}

template <class T>
Mat SlicedStage::forwardT(int k, int l, const Mat& x, const IVec& pos) {
  const Space& space = *env_.space;
  const LayerShape sh = LayerShape::of(model_->config());
  const LayerParamsT<T>& w = model_->working<T>(l);
  const Unit u = unit(false, k);
  const std::int64_t n = u.rows;
  if (static_cast<std::int64_t>(x.extent(0)) != n)
    throw std::logic_error("SlicedStage::forward: input rows " + std::to_string(x.extent(0)) + ", MicroPack rows " +
                           std::to_string(n));
  LayerActsT<T> a;
  a.x = x;
  qkvForward(env_, sh, w, a, pos);
  // Attention of each piece over its segment's chain and own keys.
  Act3T<T> pk, pv, kbuf, vbuf;
  const Keys keys = keyLayout(u);
  {
    trace::PhaseScope r(env_.recorder, trace::labels::kKvAllgather, space, trace::Phase::Fwd, 0, gatherBytes<T>(u));
    packedKv<T>(u, a.k, a.v, pk, pv);
    kbuf = pk, vbuf = pv;
    if (!keys.own) buildKv<T>(u, l, keys, pk, pv, kbuf, vbuf);
  }
  a.o = newAct3T<T>(env_.pool, "wlb::runtime::o", n, sh.heads, sh.head_dim);
  a.lse = newMat(env_.pool, "wlb::runtime::lse", n, sh.heads);
  {
    const double flops = attnFlops(u, model::Phase::Fwd);
    const auto t = Clock::now();
    trace::PhaseScope r(env_.recorder, trace::labels::kAttn, space, trace::Phase::Fwd, flops);
    const auto batch = attention::VarlenBatch::fromRanges(keys.pieces);
    attention::forward<Space>(space, a.q, kbuf, vbuf, batch, a.o, a.lse, env_.kernel);
    kk::fence(space, "wlb::runtime::sliced::attn_fwd");
    attn_seconds_ = std::chrono::duration<double>(Clock::now() - t).count();
  }
  kbuf = vbuf = Act3T<T>();
  Mat y = outMlpForward(env_, w, a);
  // Save: one run per backward MicroPack the forward MicroPack feeds.
  Saved<T>& sv = saved<T>()[l];
  const auto& bc = slices_->bwd_cuts;
  for (std::size_t j = 0; j + 1 < bc.size(); ++j) {
    const auto r0 = std::max(u.s0, bc[j]), r1 = std::min(u.s1, bc[j + 1]);
    if (r0 >= r1) continue;
    Run<T> run;
    run.s0 = r0;
    run.s1 = r1;
    if (r0 == u.s0 && r1 == u.s1) {
      run.acts = a;
    } else {
      const std::int64_t end = r1 < u.s1 ? fwd_row_[static_cast<std::size_t>(r1)] : n;
      run.acts = a.copyRows(space, env_.pool, fwd_row_[static_cast<std::size_t>(r0)], end);
    }
    run.bytes = run.acts.bytes();
    held_ += run.bytes;
    sv.runs[r0] = std::move(run);
  }
  for (auto i = u.s0; i < u.s1; ++i)
    if (slices_->continued[static_cast<std::size_t>(i)]) {
      const auto len = slices_->segments[static_cast<std::size_t>(i)].length;
      Act3 dk = newAct3(env_.pool, "wlb::runtime::sliced::dk_acc", len, sh.kv_heads, sh.head_dim, true);
      Act3 dv = newAct3(env_.pool, "wlb::runtime::sliced::dv_acc", len, sh.kv_heads, sh.head_dim, true);
      held_ += 4 * static_cast<std::int64_t>(dk.span() + dv.span());
      sv.acc[i] = {dk, dv};
      if (cp_ > 1) {  // the KV cache: every rank holds the segment's whole K/V
        const std::int64_t r = fwd_packed_[static_cast<std::size_t>(i)];
        Act3T<T> ck = newAct3T<T>(env_.pool, "wlb::runtime::sliced::kv_cache", len, sh.kv_heads, sh.head_dim);
        Act3T<T> cv = newAct3T<T>(env_.pool, "wlb::runtime::sliced::kv_cache", len, sh.kv_heads, sh.head_dim);
        copyRows<T>(space, ck, rowsOf<T>(pk, r, r + len), false);
        copyRows<T>(space, cv, rowsOf<T>(pv, r, r + len), false);
        held_ += static_cast<std::int64_t>(sizeof(T) * (ck.span() + cv.span()));
        sv.cache[i] = {ck, cv};
      }
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
  const Unit u = unit(true, j);
  const std::int64_t n = u.rows;
  if (static_cast<std::int64_t>(dy.extent(0)) != n)
    throw std::logic_error("SlicedStage::backward: gradient rows " + std::to_string(dy.extent(0)) +
                           ", MicroPack rows " + std::to_string(n));
  Saved<T>& sv = saved<T>().at(l);
  std::vector<const LayerActsT<T>*> parts;
  for (auto it = sv.runs.lower_bound(u.s0); it != sv.runs.end() && it->first < u.s1; ++it)
    parts.push_back(&it->second.acts);
  LayerActsT<T> A = LayerActsT<T>::concat(space, env_.pool, parts);
  if (A.rows() != n) throw std::logic_error("SlicedStage::backward: saved rows do not cover the MicroPack");
  Mat dh;
  const Act3T<T> d_o = outMlpBackward(env_, w, g, A, dy, dh);
  // Attention backward into a key-gradient buffer of the forward's layout.
  Act3T<T> kbuf, vbuf;
  const Keys keys = keyLayout(u);
  {
    trace::PhaseScope r(env_.recorder, trace::labels::kKvAllgather, space, trace::Phase::Bwd, 0, gatherBytes<T>(u));
    Act3T<T> pk, pv;
    packedKv<T>(u, A.k, A.v, pk, pv);
    kbuf = pk, vbuf = pv;
    if (!keys.own) buildKv<T>(u, l, keys, pk, pv, kbuf, vbuf);
  }
  Act3 dq, dkb, dvb;
  {
    const double flops = attnFlops(u, model::Phase::Bwd);
    const auto t = Clock::now();
    trace::PhaseScope r(env_.recorder, trace::labels::kAttn, space, trace::Phase::Bwd, flops);
    // zeroed inside the region, as DistributedAttention does: the kernel accumulates
    dq = newAct3(env_.pool, "wlb::runtime::dq", n, sh.heads, sh.head_dim, true);
    dkb = newAct3(env_.pool, "wlb::runtime::sliced::dkv_k", keys.rows, sh.kv_heads, sh.head_dim, true);
    dvb = newAct3(env_.pool, "wlb::runtime::sliced::dkv_v", keys.rows, sh.kv_heads, sh.head_dim, true);
    const auto batch = attention::VarlenBatch::fromRanges(keys.pieces);
    attention::backward<Space>(space, A.q, kbuf, vbuf, A.o, A.lse, d_o, batch, dq, dkb, dvb, env_.kernel);
    kk::fence(space, "wlb::runtime::sliced::attn_bwd");
    attn_seconds_ = std::chrono::duration<double>(Clock::now() - t).count();
  }
  kbuf = vbuf = Act3T<T>();
  A.o = Act3T<T>();
  A.lse = typename LayerActsT<T>::Lse();
  // The key gradient of the unit's packed rows: each block's chain rows go to the chain's
  // accumulators, its own rows to the segment; then each segment's accumulator (what its
  // later slices sent back, all added by now) joins its rows.
  Act3 dk, dv;
  {
    trace::PhaseScope kv_scope(env_.recorder, trace::labels::kKvAllgather, space, trace::Phase::Bwd, 0,
                               4.0 * static_cast<double>(n * sh.kv_heads * sh.head_dim) * 2 * (cp_ - 1));
    Act3 dpk = dkb, dpv = dvb;
    if (!keys.own) {
      dpk = newAct3(env_.pool, "wlb::runtime::sliced::dpacked_k", u.total, sh.kv_heads, sh.head_dim, true);
      dpv = newAct3(env_.pool, "wlb::runtime::sliced::dpacked_v", u.total, sh.kv_heads, sh.head_dim, true);
      for (const auto& b : keys.blocks) {
        std::int64_t at = b.k_begin;
        for (const std::int64_t c : chain_[static_cast<std::size_t>(b.seg)]) {
          const auto len = slices_->segments[static_cast<std::size_t>(c)].length;
          auto& ca = sv.acc.at(c);
          copyRows<float>(space, ca.first, rowsOf<float>(dkb, at, at + len), true);
          copyRows<float>(space, ca.second, rowsOf<float>(dvb, at, at + len), true);
          at += len;
        }
        const std::int64_t r = bwd_packed_[static_cast<std::size_t>(b.seg)];
        copyRows<float>(space, rowsOf<float>(dpk, r, r + b.len), rowsOf<float>(dkb, at, at + b.len), true);
        copyRows<float>(space, rowsOf<float>(dpv, r, r + b.len), rowsOf<float>(dvb, at, at + b.len), true);
      }
    }
    dkb = dvb = Act3();
    for (auto i = u.s0; i < u.s1; ++i) {
      const auto acc = sv.acc.find(i);
      if (acc == sv.acc.end()) continue;
      const std::int64_t r = bwd_packed_[static_cast<std::size_t>(i)];
      const auto len = slices_->segments[static_cast<std::size_t>(i)].length;
      copyRows<float>(space, rowsOf<float>(dpk, r, r + len), acc->second.first, true);
      copyRows<float>(space, rowsOf<float>(dpv, r, r + len), acc->second.second, true);
    }
    dk = ownKvGrad(u, dpk);
    dv = ownKvGrad(u, dpv);
  }
  Mat dx = qkvBackward(env_, w, g, A, dq, dk, dv, dh, pos);
  kk::fence(space, "wlb::runtime::sliced::bwd");
  // Free the MicroPack's slices.
  for (auto it = sv.runs.lower_bound(u.s0); it != sv.runs.end() && it->first < u.s1;) {
    held_ -= it->second.bytes;
    it = sv.runs.erase(it);
  }
  for (auto i = u.s0; i < u.s1; ++i) {
    const auto acc = sv.acc.find(i);
    if (acc != sv.acc.end()) {
      held_ -= 4 * static_cast<std::int64_t>(acc->second.first.span() + acc->second.second.span());
      sv.acc.erase(acc);
    }
    const auto ca = sv.cache.find(i);
    if (ca != sv.cache.end()) {
      held_ -= static_cast<std::int64_t>(sizeof(T) * (ca->second.first.span() + ca->second.second.span()));
      sv.cache.erase(ca);
    }
  }
  return dx;
}

}  // namespace wlb::runtime
