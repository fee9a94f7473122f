/// \file distributed_attention.cpp
/// \brief Context-parallel attention over MPI (see distributed_attention.hpp). All index
/// math comes from the shard/comm plan helpers of shard_plan.hpp; this file only moves
/// bytes and calls the kernels.

#include "runtime/distributed_attention.hpp"

#include <chrono>
#include <climits>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/flops.hpp"
#include "core/kokkos_compat.hpp"
#include "model/cost_model.hpp"
#include "runtime/pool.hpp"
#include "runtime/row_moves.hpp"
#include "trace/recorder.hpp"

namespace wlb::runtime {

// The plan types this executor runs (cp/shard_plan.hpp).
using cp::CommMode;
using cp::CommPlan;
using cp::Piece;
using cp::RankShard;
using cp::RowMap;
using cp::ShardPlan;
using cp::Transfer;

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int toCount(std::int64_t n, const char* what) {
  if (n < 0 || n > INT_MAX)
    throw std::invalid_argument(std::string("wlb::runtime::DistributedAttention: ") + what +
                                " exceeds the MPI int count range");
  return static_cast<int>(n);
}

// MPI message tags of the sharding-aware exchange (one message per ordered pair and
// direction, so a constant tag per direction is unambiguous).
constexpr int kTagKvFwd = 7301;
constexpr int kTagKvBwd = 7302;

using MaybeScope = trace::PhaseScope;  // no-op without a recorder

}  // namespace

DistributedAttention::DistributedAttention(const ShardPlan& plan, const CommPlan& comm_plan, MPI_Comm comm, int heads,
                                           int kv_heads, int head_dim, DistAttentionOptions opt,
                                           const DistributedAttention* like)
    : plan_(&plan),
      comm_plan_(&comm_plan),
      comm_(comm),
      heads_(heads),
      kv_heads_(kv_heads),
      head_dim_(head_dim),
      opt_(opt) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank_);
  if (size != plan.cp || comm_plan.cp != plan.cp)
    throw std::invalid_argument("wlb::runtime::DistributedAttention: communicator has " + std::to_string(size) +
                                " ranks but the plan has cp=" + std::to_string(plan.cp) +
                                " (comm plan cp=" + std::to_string(comm_plan.cp) + ")");
  if (heads <= 0 || kv_heads <= 0 || head_dim <= 0 || heads % kv_heads != 0)
    throw std::invalid_argument("wlb::runtime::DistributedAttention: bad heads/kv_heads/head_dim");
  const RankShard& rs = plan.ranks[rank_];
  local_tokens_ = rs.tokens;
  kv_tokens_ = rs.kv_tokens;
  const bool share = like && like->plan_ == &plan && like->comm_plan_ == &comm_plan && like->rank_ == rank_;
  if (share) {
    batch_ = like->batch_;
  } else {
    std::vector<attention::PieceRange> ranges;
    ranges.reserve(rs.pieces.size());
    for (const Piece& p : rs.pieces)
      ranges.push_back({p.local_begin, p.local_begin + p.q_len, p.kv_begin, p.kv_begin + p.kv_len});
    batch_ = std::make_shared<const attention::VarlenBatch>(attention::VarlenBatch::fromRanges(std::move(ranges)));
  }
  if (opt_.group) {
    if (opt_.group->size() != plan.cp)
      throw std::invalid_argument(
          "wlb::runtime::DistributedAttention: group communicator size differs from the plan's cp");
    group_ = opt_.group;
  } else {
    own_group_ = parallel::makeGroupComm(comm, parallel::CommBackend::Mpi);
    group_ = own_group_.get();
  }
  if (share)
    maps_ = like->maps_;
  else
    buildMaps();
}

DistributedAttention::~DistributedAttention() = default;

double DistributedAttention::attnFlops(bool backward) const {
  double f = 0;
  const RankShard& rs = plan_->ranks[rank_];
  if (opt_.cost) {
    const auto ph = backward ? model::Phase::Bwd : model::Phase::Fwd;
    for (const Piece& p : rs.pieces) f += opt_.cost->attnFlops(p.keysBefore(), p.q_len, ph);
  } else {
    f = attention::forwardFlops(batch_->usefulPairs(), heads_, head_dim_);
    if (backward) f *= model::kAttnBwdFactor;
  }
  return f;
}

void DistributedAttention::releaseKv() {
  kv_k_ = View3();
  kv_v_ = View3();
  kv_kb_ = BView3();
  kv_vb_ = BView3();
  have_kv_ = false;
}

// ---- row moves (device kernels; the maps come from shard_plan.hpp) ---------------------

namespace {

using Mem = DistViews::mem;
using IdxView = rows::IdxView;

using rows::upload;

using rows::moveRows;
using rows::scaled;
using rows::wordCount;
using rows::words;

}  // namespace

struct DistributedAttention::Maps {
  IdxView own_dst, own_src;  ///< own runs: KV slot <- local row
  std::int64_t own_rows = 0;
  IdxView ag_index;                   ///< AllGather: KV slot <- gathered row
  std::vector<std::size_t> from, to;  ///< ShardingAware transfers this rank sends / receives (forward)
  std::vector<IdxView> from_local;    ///< per `from` transfer: message row -> local row
  std::vector<IdxView> to_slots;      ///< per `to` transfer: message row -> KV slot
};

void DistributedAttention::buildMaps() {
  auto built = std::make_shared<Maps>();
  maps_ = built;
  Maps& m = *built;
  const RowMap own = ownRunRows(*plan_, rank_);
  m.own_dst = upload(own.dst);
  m.own_src = upload(own.src);
  m.own_rows = static_cast<std::int64_t>(own.dst.size());
  if (comm_plan_->mode == CommMode::AllGather) {
    if (plan_->cp > 1) m.ag_index = upload(allGatherKvIndex(*plan_, *comm_plan_, rank_));
    return;
  }
  m.from = transfersFrom(*comm_plan_, rank_);
  m.to = transfersTo(*comm_plan_, rank_);
  for (auto i : m.from) m.from_local.push_back(upload(transferLocalRows(comm_plan_->transfers[i])));
  for (auto i : m.to) m.to_slots.push_back(upload(transferKvSlots(comm_plan_->transfers[i])));
}

template <class T>
Kokkos::View<T***, Kokkos::LayoutRight, DistViews::mem> DistributedAttention::rowBuffer(const Space& space,
                                                                                        const char* label,
                                                                                        std::int64_t rows,
                                                                                        bool zero) const {
  // From the pool when there is one, else a fresh allocation (newAct3T decides).
  auto out = newAct3T<T>(opt_.pool, label, rows, kv_heads_, head_dim_);
  // Zeroed on this object's instance, which the kernels that accumulate into it run on.
  if (zero) Kokkos::deep_copy(space, out, T{});
  return out;
}

// ---- forward -------------------------------------------------------------------------

template <class T>
void DistributedAttention::exchangeKvForward(const Space& space, const T* k, const T* v, T* kv_k, T* kv_v) {
  const ShardPlan& plan = *plan_;
  const CommPlan& cpl = *comm_plan_;
  const Maps& m = *maps_;
  const std::int64_t width = static_cast<std::int64_t>(kv_heads_) * head_dim_;
  const IdxView none;
  double bytes = 0;
  const double eb = static_cast<double>(sizeof(T));
  if (cpl.mode == CommMode::AllGather) {
    const std::int64_t total = plan.total_tokens;
    MaybeScope sc(opt_.recorder, trace::labels::kKvAllgather, space, trace::Phase::Fwd, 0,
                  2.0 * eb * static_cast<double>((total - local_tokens_) * width));
    if (plan.cp > 1) {
      const std::int64_t ww = wordCount<T>(width);
      const auto counts = scaled(cpl.gather_counts, ww), displs = scaled(cpl.gather_displs, ww);
      const auto gk = rowBuffer<T>(space, "wlb::runtime::dist_attn::gathered_k", total);
      const auto gv = rowBuffer<T>(space, "wlb::runtime::dist_attn::gathered_v", total);
      group_->allgatherv(space, words(k), words(gk.data()), counts, displs);
      group_->allgatherv(space, words(v), words(gv.data()), counts, displs);
      moveRows(space, kv_k, none, gk.data(), m.ag_index, kv_tokens_, width, false);
      moveRows(space, kv_v, none, gv.data(), m.ag_index, kv_tokens_, width, false);
    } else {
      moveRows(space, kv_k, m.own_dst, k, m.own_src, m.own_rows, width, false);
      moveRows(space, kv_v, m.own_dst, v, m.own_src, m.own_rows, width, false);
    }
    bytes = 2.0 * eb * static_cast<double>((total - local_tokens_) * width);
  } else {
    std::int64_t recv_tokens = 0;
    for (auto i : m.to) recv_tokens += cpl.transfers[i].tokens;
    MaybeScope sc(opt_.recorder, trace::labels::kKvExchange, space, trace::Phase::Fwd, 0,
                  2.0 * eb * static_cast<double>(recv_tokens * width));
    // Messages: K rows of the transfer's runs, then V rows.
    std::vector<Kokkos::View<T***, Kokkos::LayoutRight, Mem>> rbuf, sbuf;
    std::vector<parallel::GroupComm::Msg> recvs, sends;
    for (std::size_t j = 0; j < m.to.size(); ++j) {
      const Transfer& t = cpl.transfers[m.to[j]];
      rbuf.push_back(rowBuffer<T>(space, "wlb::runtime::dist_attn::recv", 2 * t.tokens));
      recvs.push_back({t.src, words(rbuf.back().data()), wordCount<T>(2 * t.tokens * width)});
    }
    for (std::size_t j = 0; j < m.from.size(); ++j) {
      const Transfer& t = cpl.transfers[m.from[j]];
      sbuf.push_back(rowBuffer<T>(space, "wlb::runtime::dist_attn::send", 2 * t.tokens));
      moveRows(space, sbuf.back().data(), none, k, m.from_local[j], t.tokens, width, false);
      moveRows(space, sbuf.back().data() + t.tokens * width, none, v, m.from_local[j], t.tokens, width, false);
      sends.push_back({t.dst, words(sbuf.back().data()), wordCount<T>(2 * t.tokens * width)});
    }
    moveRows(space, kv_k, m.own_dst, k, m.own_src, m.own_rows, width, false);
    moveRows(space, kv_v, m.own_dst, v, m.own_src, m.own_rows, width, false);
    group_->exchange(space, sends, recvs, kTagKvFwd);
    for (std::size_t j = 0; j < m.to.size(); ++j) {
      const Transfer& t = cpl.transfers[m.to[j]];
      moveRows(space, kv_k, m.to_slots[j], rbuf[j].data(), none, t.tokens, width, false);
      moveRows(space, kv_v, m.to_slots[j], rbuf[j].data() + t.tokens * width, none, t.tokens, width, false);
    }
    bytes = 2.0 * eb * static_cast<double>(recv_tokens * width);
  }
  kk::fence(space, "wlb::runtime::dist_attn::fwd::kv");
  times_.bytes_fwd = bytes;
  have_kv_ = true;
}

template <class T>
void DistributedAttention::forwardT(const Space& space, Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> q,
                                    Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> k,
                                    Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> v,
                                    Kokkos::View<T***, Kokkos::LayoutRight, DistViews::mem> o, View2 lse) {
  if (static_cast<std::int64_t>(q.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(k.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(v.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(o.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(lse.extent(0)) != local_tokens_)
    throw std::invalid_argument("wlb::runtime::DistributedAttention::forward: buffers must have the rank's " +
                                std::to_string(local_tokens_) + " local tokens");
  if ((static_cast<std::int64_t>(kv_heads_) * head_dim_ * static_cast<std::int64_t>(sizeof(T))) % 4 != 0)
    throw std::invalid_argument("wlb::runtime::DistributedAttention: BF16 K/V need an even kv_heads * head_dim");
  times_ = DistAttentionTimes{};
  releaseKv();
  using V3 = Kokkos::View<T***, Kokkos::LayoutRight, DistViews::mem>;
  const V3 kv_k = rowBuffer<T>(space, "wlb::runtime::dist_attn::kv_k", kv_tokens_);
  const V3 kv_v = rowBuffer<T>(space, "wlb::runtime::dist_attn::kv_v", kv_tokens_);
  keptK<T>() = kv_k;
  keptV<T>() = kv_v;
  auto t0 = Clock::now();
  exchangeKvForward<T>(space, k.data(), v.data(), kv_k.data(), kv_v.data());
  times_.comm_fwd = since(t0);
  t0 = Clock::now();
  {
    MaybeScope sc(opt_.recorder, trace::labels::kAttn, space, trace::Phase::Fwd, attnFlops(false));
    if (!batch_->pieces.empty())
      attention::forward<Space>(space, q, kv_k, kv_v, *batch_, o, lse, opt_.kernel, opt_.softmax_scale);
    kk::fence(space, "wlb::runtime::dist_attn::fwd::attn");
  }
  times_.attn_fwd = since(t0);
}

void DistributedAttention::forward(const Space& space, Const3 q, Const3 k, Const3 v, View3 o, View2 lse) {
  forwardT<float>(space, q, k, v, o, lse);
}

void DistributedAttention::forward(const Space& space, BConst3 q, BConst3 k, BConst3 v, BView3 o, View2 lse) {
  forwardT<attention::bf16>(space, q, k, v, o, lse);
}

// ---- backward ------------------------------------------------------------------------

void DistributedAttention::returnKvGradBackward(const Space& space, View3 dk, View3 dv) {
  const ShardPlan& plan = *plan_;
  const CommPlan& cpl = *comm_plan_;
  const Maps& m = *maps_;
  const std::int64_t width = static_cast<std::int64_t>(kv_heads_) * head_dim_;
  // kv_k_/kv_v_ hold dK/dV of the KV buffer at this point (see backward()).
  const IdxView none;
  const double eb = 4.0;  // dK/dV travel in FP32
  double bytes = 0;
  if (cpl.mode == CommMode::AllGather) {
    const std::int64_t total = plan.total_tokens;
    MaybeScope sc(opt_.recorder, trace::labels::kKvAllgather, space, trace::Phase::Bwd, 0,
                  2.0 * eb * static_cast<double>(local_tokens_ * width) * (plan.cp - 1));
    if (plan.cp > 1) {
      const auto counts = scaled(cpl.gather_counts, width), displs = scaled(cpl.gather_displs, width);
      const View3 gk = rowBuffer<float>(space, "wlb::runtime::dist_attn::gathered_dk", total, true);
      const View3 gv = rowBuffer<float>(space, "wlb::runtime::dist_attn::gathered_dv", total, true);
      // A rank's KV slots map to distinct gathered rows: a plain scatter into zeros.
      moveRows(space, gk.data(), m.ag_index, kv_k_.data(), none, kv_tokens_, width, false);
      moveRows(space, gv.data(), m.ag_index, kv_v_.data(), none, kv_tokens_, width, false);
      group_->reduceScatterv(space, gk.data(), dk.data(), counts, displs);
      group_->reduceScatterv(space, gv.data(), dv.data(), counts, displs);
    } else {
      Kokkos::deep_copy(space, dk, 0.0f);
      Kokkos::deep_copy(space, dv, 0.0f);
      moveRows(space, dk.data(), m.own_src, kv_k_.data(), m.own_dst, m.own_rows, width, true);
      moveRows(space, dv.data(), m.own_src, kv_v_.data(), m.own_dst, m.own_rows, width, true);
    }
    bytes = 2.0 * eb * static_cast<double>(local_tokens_ * width) * (plan.cp - 1);
  } else {
    // Reverse direction: this rank sends dK/dV of the runs it received (transfers `to`
    // it) and receives, as owner, the runs it sent (transfers `from` it).
    std::int64_t recv_tokens = 0;
    for (auto i : m.from) recv_tokens += cpl.transfers[i].tokens;
    MaybeScope sc(opt_.recorder, trace::labels::kKvExchange, space, trace::Phase::Bwd, 0,
                  2.0 * eb * static_cast<double>(recv_tokens * width));
    std::vector<View3> rbuf, sbuf;
    std::vector<parallel::GroupComm::Msg> recvs, sends;
    for (std::size_t j = 0; j < m.from.size(); ++j) {
      const Transfer& t = cpl.transfers[m.from[j]];
      rbuf.push_back(rowBuffer<float>(space, "wlb::runtime::dist_attn::recv", 2 * t.tokens));
      recvs.push_back({t.dst, rbuf.back().data(), 2 * t.tokens * width});
    }
    for (std::size_t j = 0; j < m.to.size(); ++j) {
      const Transfer& t = cpl.transfers[m.to[j]];
      sbuf.push_back(rowBuffer<float>(space, "wlb::runtime::dist_attn::send", 2 * t.tokens));
      moveRows(space, sbuf.back().data(), none, kv_k_.data(), m.to_slots[j], t.tokens, width, false);
      moveRows(space, sbuf.back().data() + t.tokens * width, none, kv_v_.data(), m.to_slots[j], t.tokens, width, false);
      sends.push_back({t.src, sbuf.back().data(), 2 * t.tokens * width});
    }
    Kokkos::deep_copy(space, dk, 0.0f);
    Kokkos::deep_copy(space, dv, 0.0f);
    moveRows(space, dk.data(), m.own_src, kv_k_.data(), m.own_dst, m.own_rows, width, true);
    moveRows(space, dv.data(), m.own_src, kv_v_.data(), m.own_dst, m.own_rows, width, true);
    group_->exchange(space, sends, recvs, kTagKvBwd);
    // Fixed order of addition (ascending peer) keeps the result deterministic.
    for (std::size_t j = 0; j < m.from.size(); ++j) {
      const Transfer& t = cpl.transfers[m.from[j]];
      moveRows(space, dk.data(), m.from_local[j], rbuf[j].data(), none, t.tokens, width, true);
      moveRows(space, dv.data(), m.from_local[j], rbuf[j].data() + t.tokens * width, none, t.tokens, width, true);
    }
    bytes = 2.0 * eb * static_cast<double>(recv_tokens * width);
  }
  kk::fence(space, "wlb::runtime::dist_attn::bwd::kv");
  times_.bytes_bwd = bytes;
}

template <class T>
void DistributedAttention::backwardT(const Space& space,
                                     Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> q,
                                     Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> o, Const2 lse,
                                     Kokkos::View<const T***, Kokkos::LayoutRight, DistViews::mem> dO, View3 dq,
                                     View3 dk, View3 dv) {
  if (!have_kv_) throw std::logic_error("wlb::runtime::DistributedAttention::backward: no KV buffer (forward() first)");
  using V3 = Kokkos::View<T***, Kokkos::LayoutRight, DistViews::mem>;
  const V3 kv_k = keptK<T>(), kv_v = keptV<T>();
  if (kv_k.extent(0) != static_cast<std::size_t>(kv_tokens_))
    throw std::logic_error("wlb::runtime::DistributedAttention::backward: the forward ran in another storage type");
  if (static_cast<std::int64_t>(dq.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(dk.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(dv.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(dO.extent(0)) != local_tokens_)
    throw std::invalid_argument("wlb::runtime::DistributedAttention::backward: buffers must have the rank's " +
                                std::to_string(local_tokens_) + " local tokens");
  auto t0 = Clock::now();
  View3 dkv_k, dkv_v;
  {
    MaybeScope sc(opt_.recorder, trace::labels::kAttn, space, trace::Phase::Bwd, attnFlops(true));
    // The kernel accumulates into dq and the KV-buffer gradients: zeroing them is part of
    // the operator (and of times_.attn_bwd), so it lies inside the region too.
    dkv_k = rowBuffer<float>(space, "wlb::runtime::dist_attn::dkv_k", kv_tokens_, true);
    dkv_v = rowBuffer<float>(space, "wlb::runtime::dist_attn::dkv_v", kv_tokens_, true);
    Kokkos::deep_copy(space, dq, 0.0f);
    if (!batch_->pieces.empty())
      attention::backward<Space>(space, q, kv_k, kv_v, o, lse, dO, *batch_, dq, dkv_k, dkv_v, opt_.kernel,
                                 opt_.softmax_scale);
    kk::fence(space, "wlb::runtime::dist_attn::bwd::attn");
  }
  times_.attn_bwd = since(t0);
  t0 = Clock::now();
  // The KV buffer is no longer needed: its FP32 slots carry the gradients back.
  kv_kb_ = BView3();
  kv_vb_ = BView3();
  kv_k_ = dkv_k;
  kv_v_ = dkv_v;
  returnKvGradBackward(space, dk, dv);
  releaseKv();
  times_.comm_bwd = since(t0);
}

void DistributedAttention::backward(const Space& space, Const3 q, Const3 o, Const2 lse, Const3 dO, View3 dq, View3 dk,
                                    View3 dv) {
  backwardT<float>(space, q, o, lse, dO, dq, dk, dv);
}

void DistributedAttention::backward(const Space& space, BConst3 q, BConst3 o, Const2 lse, BConst3 dO, View3 dq,
                                    View3 dk, View3 dv) {
  backwardT<attention::bf16>(space, q, o, lse, dO, dq, dk, dv);
}

// ---- diagnostics ---------------------------------------------------------------------

std::vector<float> gatherToPacked(const ShardPlan& plan, const CommPlan& comm_plan, MPI_Comm comm, const float* local,
                                  std::int64_t width) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const std::int64_t total = plan.total_tokens;
  std::vector<int> counts(plan.cp), displs(plan.cp);
  for (int s = 0; s < plan.cp; ++s) {
    counts[s] = toCount(comm_plan.gather_counts[s] * width, "gather count");
    displs[s] = toCount(comm_plan.gather_displs[s] * width, "gather displacement");
  }
  std::vector<float> g(static_cast<std::size_t>(total * width)), out(g.size());
  MPI_Allgatherv(local, counts[rank], MPI_FLOAT, g.data(), counts.data(), displs.data(), MPI_FLOAT, comm);
  for (int s = 0; s < plan.cp; ++s) {
    const auto pos = packedPositions(plan, s);
    for (std::size_t i = 0; i < pos.size(); ++i) {
      const float* src = g.data() + (comm_plan.gather_displs[s] + static_cast<std::int64_t>(i)) * width;
      float* dst = out.data() + pos[i] * width;
      for (std::int64_t w = 0; w < width; ++w) dst[w] = src[w];
    }
  }
  return out;
}

}  // namespace wlb::runtime
