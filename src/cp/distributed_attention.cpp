/// \file distributed_attention.cpp
/// \brief Context-parallel attention over MPI (see distributed_attention.hpp). All index
/// math comes from the shard/comm plan helpers of shard_plan.hpp; this file only moves
/// bytes and calls the kernels.

#include "cp/distributed_attention.hpp"

#include <chrono>
#include <climits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/flops.hpp"
#include "core/kokkos_compat.hpp"
#include "model/cost_model.hpp"
#include "trace/recorder.hpp"

namespace wlb::cp {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int toCount(std::int64_t n, const char* what) {
  if (n < 0 || n > INT_MAX)
    throw std::invalid_argument(std::string("wlb::cp::DistributedAttention: ") + what +
                                " exceeds the MPI int count range");
  return static_cast<int>(n);
}

// MPI message tags of the sharding-aware exchange (one message per ordered pair and
// direction, so a constant tag per direction is unambiguous).
constexpr int kTagKvFwd = 7301;
constexpr int kTagKvBwd = 7302;

// Optional recorder scope with a phase override; no-op without a recorder.
struct MaybeScope {
  std::optional<trace::Recorder::Scope> scope;
  MaybeScope(trace::Recorder* rec, const char* label, const DistViews::Space& space, trace::Phase phase,
             double flops = 0, double bytes = 0) {
    if (!rec) return;
    scope.emplace(*rec, label, space, flops, bytes);
    scope->context().phase = phase;
  }
};

}  // namespace

DistributedAttention::DistributedAttention(const ShardPlan& plan, const CommPlan& comm_plan, MPI_Comm comm, int heads,
                                           int kv_heads, int head_dim, DistAttentionOptions opt)
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
    throw std::invalid_argument("wlb::cp::DistributedAttention: communicator has " + std::to_string(size) +
                                " ranks but the plan has cp=" + std::to_string(plan.cp) +
                                " (comm plan cp=" + std::to_string(comm_plan.cp) + ")");
  if (heads <= 0 || kv_heads <= 0 || head_dim <= 0 || heads % kv_heads != 0)
    throw std::invalid_argument("wlb::cp::DistributedAttention: bad heads/kv_heads/head_dim");
  const RankShard& rs = plan.ranks[rank_];
  local_tokens_ = rs.tokens;
  kv_tokens_ = rs.kv_tokens;
  std::vector<attention::PieceRange> ranges;
  ranges.reserve(rs.pieces.size());
  for (const Piece& p : rs.pieces)
    ranges.push_back({p.local_begin, p.local_begin + p.q_len, p.kv_begin, p.kv_begin + p.kv_len});
  batch_ = attention::VarlenBatch::fromRanges(std::move(ranges));
}

double DistributedAttention::attnFlops(bool backward) const {
  double f = 0;
  const RankShard& rs = plan_->ranks[rank_];
  if (opt_.cost) {
    const auto ph = backward ? model::Phase::Bwd : model::Phase::Fwd;
    for (const Piece& p : rs.pieces) f += opt_.cost->attnFlops(p.q_offset, p.q_len, ph);
  } else {
    f = attention::forwardFlops(batch_.usefulPairs(), heads_, head_dim_);
    if (backward) f *= model::kAttnBwdFactor;
  }
  return f;
}

void DistributedAttention::releaseKv() {
  kv_k_ = View3();
  kv_v_ = View3();
  have_kv_ = false;
}

// ---- forward -------------------------------------------------------------------------

void DistributedAttention::exchangeKvForward(const Space& space, Const3 k, Const3 v) {
  const ShardPlan& plan = *plan_;
  const CommPlan& cpl = *comm_plan_;
  const std::int64_t width = static_cast<std::int64_t>(kv_heads_) * head_dim_;
  const int r = rank_;
  kv_k_ = View3(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::cp::dist_attn::kv_k"), kv_tokens_, kv_heads_,
                head_dim_);
  kv_v_ = View3(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::cp::dist_attn::kv_v"), kv_tokens_, kv_heads_,
                head_dim_);
  // Host staging (no copies on host backends: mirrors alias the device views).
  auto hk = Kokkos::create_mirror_view(k);
  auto hv = Kokkos::create_mirror_view(v);
  Kokkos::deep_copy(hk, k);
  Kokkos::deep_copy(hv, v);
  auto hkv_k = Kokkos::create_mirror_view(kv_k_);
  auto hkv_v = Kokkos::create_mirror_view(kv_v_);
  kk::fence(space, "wlb::cp::dist_attn::fwd::before_mpi");

  double bytes = 0;
  const double eb = opt_.bytes_per_element;
  if (comm_plan_->mode == CommMode::AllGather) {
    const std::int64_t total = plan.total_tokens;
    std::vector<int> counts(plan.cp), displs(plan.cp);
    for (int s = 0; s < plan.cp; ++s) {
      counts[s] = toCount(cpl.gather_counts[s] * width, "all-gather count");
      displs[s] = toCount(cpl.gather_displs[s] * width, "all-gather displacement");
    }
    std::vector<float> gk(static_cast<std::size_t>(total * width)), gv(gk.size());
    MaybeScope sc(opt_.recorder, trace::labels::kKvAllgather, space, trace::Phase::Fwd, 0,
                  2.0 * eb * static_cast<double>((total - local_tokens_) * width));
    if (plan.cp > 1) {
      MPI_Allgatherv(hk.data(), counts[r], MPI_FLOAT, gk.data(), counts.data(), displs.data(), MPI_FLOAT, comm_);
      MPI_Allgatherv(hv.data(), counts[r], MPI_FLOAT, gv.data(), counts.data(), displs.data(), MPI_FLOAT, comm_);
      gatherKvFromAllGather(plan, cpl, r, gk.data(), hkv_k.data(), width);
      gatherKvFromAllGather(plan, cpl, r, gv.data(), hkv_v.data(), width);
    } else {
      copyLocalRuns(plan, r, hk.data(), hkv_k.data(), width);
      copyLocalRuns(plan, r, hv.data(), hkv_v.data(), width);
    }
    bytes = 2.0 * eb * static_cast<double>((total - local_tokens_) * width);
  } else {
    const auto from = transfersFrom(cpl, r), to = transfersTo(cpl, r);
    std::int64_t recv_tokens = 0;
    for (auto i : to) recv_tokens += cpl.transfers[i].tokens;
    MaybeScope sc(opt_.recorder, trace::labels::kKvExchange, space, trace::Phase::Fwd, 0,
                  2.0 * eb * static_cast<double>(recv_tokens * width));
    std::vector<std::vector<float>> rbuf(to.size()), sbuf(from.size());
    std::vector<MPI_Request> reqs;
    reqs.reserve(to.size() + from.size());
    for (std::size_t j = 0; j < to.size(); ++j) {
      const Transfer& t = cpl.transfers[to[j]];
      rbuf[j].resize(static_cast<std::size_t>(2 * t.tokens * width));
      reqs.emplace_back();
      MPI_Irecv(rbuf[j].data(), toCount(2 * t.tokens * width, "message"), MPI_FLOAT, t.src, kTagKvFwd, comm_,
                &reqs.back());
    }
    for (std::size_t j = 0; j < from.size(); ++j) {
      const Transfer& t = cpl.transfers[from[j]];
      sbuf[j].resize(static_cast<std::size_t>(2 * t.tokens * width));
      packRunsFromLocal(t, hk.data(), sbuf[j].data(), width);
      packRunsFromLocal(t, hv.data(), sbuf[j].data() + t.tokens * width, width);
      reqs.emplace_back();
      MPI_Isend(sbuf[j].data(), toCount(2 * t.tokens * width, "message"), MPI_FLOAT, t.dst, kTagKvFwd, comm_,
                &reqs.back());
    }
    // Own runs while messages are in flight.
    copyLocalRuns(plan, r, hk.data(), hkv_k.data(), width);
    copyLocalRuns(plan, r, hv.data(), hkv_v.data(), width);
    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    for (std::size_t j = 0; j < to.size(); ++j) {
      const Transfer& t = cpl.transfers[to[j]];
      unpackRunsToKv(t, rbuf[j].data(), hkv_k.data(), width);
      unpackRunsToKv(t, rbuf[j].data() + t.tokens * width, hkv_v.data(), width);
    }
    bytes = 2.0 * eb * static_cast<double>(recv_tokens * width);
  }
  Kokkos::deep_copy(kv_k_, hkv_k);
  Kokkos::deep_copy(kv_v_, hkv_v);
  times_.bytes_fwd = bytes;
  have_kv_ = true;
}

void DistributedAttention::forward(const Space& space, Const3 q, Const3 k, Const3 v, View3 o, View2 lse) {
  if (static_cast<std::int64_t>(q.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(k.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(v.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(o.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(lse.extent(0)) != local_tokens_)
    throw std::invalid_argument("wlb::cp::DistributedAttention::forward: buffers must have the rank's " +
                                std::to_string(local_tokens_) + " local tokens");
  times_ = DistAttentionTimes{};
  auto t0 = Clock::now();
  exchangeKvForward(space, k, v);
  times_.comm_fwd = since(t0);
  t0 = Clock::now();
  {
    MaybeScope sc(opt_.recorder, trace::labels::kAttn, space, trace::Phase::Fwd, attnFlops(false));
    if (!batch_.pieces.empty())
      attention::forward<Space>(space, q, kv_k_, kv_v_, batch_, o, lse, opt_.kernel, opt_.softmax_scale);
    kk::fence(space, "wlb::cp::dist_attn::fwd::attn");
  }
  times_.attn_fwd = since(t0);
}

// ---- backward ------------------------------------------------------------------------

void DistributedAttention::returnKvGradBackward(const Space& space, View3 dk, View3 dv) {
  const ShardPlan& plan = *plan_;
  const CommPlan& cpl = *comm_plan_;
  const std::int64_t width = static_cast<std::int64_t>(kv_heads_) * head_dim_;
  const int r = rank_;
  // kv_k_/kv_v_ hold dK/dV of the KV buffer at this point (see backward()).
  auto hdkv_k = Kokkos::create_mirror_view(kv_k_);
  auto hdkv_v = Kokkos::create_mirror_view(kv_v_);
  Kokkos::deep_copy(hdkv_k, kv_k_);
  Kokkos::deep_copy(hdkv_v, kv_v_);
  auto hdk = Kokkos::create_mirror_view(dk);
  auto hdv = Kokkos::create_mirror_view(dv);
  kk::fence(space, "wlb::cp::dist_attn::bwd::before_mpi");
  const double eb = opt_.bytes_per_element;
  double bytes = 0;

  if (cpl.mode == CommMode::AllGather) {
    const std::int64_t total = plan.total_tokens;
    MaybeScope sc(opt_.recorder, trace::labels::kKvAllgather, space, trace::Phase::Bwd, 0,
                  2.0 * eb * static_cast<double>(local_tokens_ * width) * (plan.cp - 1));
    if (plan.cp > 1) {
      std::vector<int> counts(plan.cp);
      for (int s = 0; s < plan.cp; ++s) counts[s] = toCount(cpl.gather_counts[s] * width, "reduce-scatter count");
      std::vector<float> gk(static_cast<std::size_t>(total * width), 0.0f), gv(gk.size(), 0.0f);
      scatterKvGradToAllGather(plan, cpl, r, hdkv_k.data(), gk.data(), width);
      scatterKvGradToAllGather(plan, cpl, r, hdkv_v.data(), gv.data(), width);
      MPI_Reduce_scatter(gk.data(), hdk.data(), counts.data(), MPI_FLOAT, MPI_SUM, comm_);
      MPI_Reduce_scatter(gv.data(), hdv.data(), counts.data(), MPI_FLOAT, MPI_SUM, comm_);
    } else {
      for (std::int64_t i = 0; i < local_tokens_ * width; ++i) hdk.data()[i] = hdv.data()[i] = 0.0f;
      accumulateLocalRuns(plan, r, hdkv_k.data(), hdk.data(), width);
      accumulateLocalRuns(plan, r, hdkv_v.data(), hdv.data(), width);
    }
    bytes = 2.0 * eb * static_cast<double>(local_tokens_ * width) * (plan.cp - 1);
  } else {
    const auto from = transfersFrom(cpl, r), to = transfersTo(cpl, r);
    // Reverse direction: this rank sends dK/dV of the runs it received (transfers `to`
    // it) and receives, as owner, the runs it sent (transfers `from` it).
    std::int64_t recv_tokens = 0;
    for (auto i : from) recv_tokens += cpl.transfers[i].tokens;
    MaybeScope sc(opt_.recorder, trace::labels::kKvExchange, space, trace::Phase::Bwd, 0,
                  2.0 * eb * static_cast<double>(recv_tokens * width));
    std::vector<std::vector<float>> rbuf(from.size()), sbuf(to.size());
    std::vector<MPI_Request> reqs;
    reqs.reserve(to.size() + from.size());
    for (std::size_t j = 0; j < from.size(); ++j) {
      const Transfer& t = cpl.transfers[from[j]];
      rbuf[j].resize(static_cast<std::size_t>(2 * t.tokens * width));
      reqs.emplace_back();
      MPI_Irecv(rbuf[j].data(), toCount(2 * t.tokens * width, "message"), MPI_FLOAT, t.dst, kTagKvBwd, comm_,
                &reqs.back());
    }
    for (std::size_t j = 0; j < to.size(); ++j) {
      const Transfer& t = cpl.transfers[to[j]];
      sbuf[j].resize(static_cast<std::size_t>(2 * t.tokens * width));
      packRunsFromKv(t, hdkv_k.data(), sbuf[j].data(), width);
      packRunsFromKv(t, hdkv_v.data(), sbuf[j].data() + t.tokens * width, width);
      reqs.emplace_back();
      MPI_Isend(sbuf[j].data(), toCount(2 * t.tokens * width, "message"), MPI_FLOAT, t.src, kTagKvBwd, comm_,
                &reqs.back());
    }
    for (std::int64_t i = 0; i < local_tokens_ * width; ++i) hdk.data()[i] = hdv.data()[i] = 0.0f;
    accumulateLocalRuns(plan, r, hdkv_k.data(), hdk.data(), width);
    accumulateLocalRuns(plan, r, hdkv_v.data(), hdv.data(), width);
    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    // Fixed order of addition (ascending peer) keeps the result deterministic.
    for (std::size_t j = 0; j < from.size(); ++j) {
      const Transfer& t = cpl.transfers[from[j]];
      accumulateRunsToLocal(t, rbuf[j].data(), hdk.data(), width);
      accumulateRunsToLocal(t, rbuf[j].data() + t.tokens * width, hdv.data(), width);
    }
    bytes = 2.0 * eb * static_cast<double>(recv_tokens * width);
  }
  Kokkos::deep_copy(dk, hdk);
  Kokkos::deep_copy(dv, hdv);
  times_.bytes_bwd = bytes;
}

void DistributedAttention::backward(const Space& space, Const3 q, Const3 o, Const2 lse, Const3 dO, View3 dq, View3 dk,
                                    View3 dv) {
  if (!have_kv_) throw std::logic_error("wlb::cp::DistributedAttention::backward: no KV buffer (forward() first)");
  if (static_cast<std::int64_t>(dq.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(dk.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(dv.extent(0)) != local_tokens_ ||
      static_cast<std::int64_t>(dO.extent(0)) != local_tokens_)
    throw std::invalid_argument("wlb::cp::DistributedAttention::backward: buffers must have the rank's " +
                                std::to_string(local_tokens_) + " local tokens");
  auto t0 = Clock::now();
  // KV-buffer gradients (zeroed: the kernel accumulates).
  View3 dkv_k("wlb::cp::dist_attn::dkv_k", kv_tokens_, kv_heads_, head_dim_);
  View3 dkv_v("wlb::cp::dist_attn::dkv_v", kv_tokens_, kv_heads_, head_dim_);
  Kokkos::deep_copy(space, dq, 0.0f);
  {
    MaybeScope sc(opt_.recorder, trace::labels::kAttn, space, trace::Phase::Bwd, attnFlops(true));
    if (!batch_.pieces.empty())
      attention::backward<Space>(space, q, kv_k_, kv_v_, o, lse, dO, batch_, dq, dkv_k, dkv_v, opt_.kernel,
                                 opt_.softmax_scale);
    kk::fence(space, "wlb::cp::dist_attn::bwd::attn");
  }
  times_.attn_bwd = since(t0);
  t0 = Clock::now();
  // The KV buffer is no longer needed: reuse its slots for the gradients.
  kv_k_ = dkv_k;
  kv_v_ = dkv_v;
  returnKvGradBackward(space, dk, dv);
  releaseKv();
  times_.comm_bwd = since(t0);
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

}  // namespace wlb::cp
