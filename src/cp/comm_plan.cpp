/// \file comm_plan.cpp
/// \brief KV communication plans (allgather, sharding_aware), plan metrics and JSON
/// (docs/cp.md).

#include <algorithm>

#include <nlohmann/json.hpp>

#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"

namespace wlb::cp {

double CommPlan::totalBytes() const {
  double t = 0;
  for (const RankComm& r : ranks) t += r.fwd_bytes_recv + r.bwd_bytes_recv;
  return t;
}

namespace {
double bytesPerSecond(const model::CostModel& cost) {
  return std::max(1e-9, cost.hardware().cp_bandwidth_gbps) * 1e9;  // per direction
}
}  // namespace

RankComm allGatherRankComm(const model::CostModel& cost, int cp, std::int64_t own, std::int64_t total) {
  RankComm rc;
  if (cp == 1 || total == 0) return rc;  // an empty micro-batch exchanges nothing (nor waits)
  const std::int64_t others = total - own;
  // Forward all-gather: the rank receives every other rank's K/V and its own tokens reach
  // cp-1 peers. Backward reduce-scatter: the mirror image for dK/dV.
  rc.fwd_bytes_recv = cost.kvBytes(others);
  rc.fwd_bytes_sent = cost.kvBytes(own) * (cp - 1);
  rc.bwd_bytes_sent = cost.kvBytes(others);
  rc.bwd_bytes_recv = cost.kvBytes(own) * (cp - 1);
  rc.fwd_tokens_recv = others;
  rc.peers = rc.out_peers = cp - 1;
  // Ring: cp-1 steps, the rank's link carries the other ranks' data.
  rc.fwd_seconds = (cp - 1) * (cost.hardware().link_latency_us * 1e-6) + rc.fwd_bytes_recv / bytesPerSecond(cost);
  rc.bwd_seconds = rc.fwd_seconds;
  return rc;
}

RankComm pointToPointRankComm(const model::CostModel& cost, std::int64_t sent, std::int64_t recv, int in_msgs,
                              int out_msgs) {
  RankComm rc;
  rc.fwd_bytes_sent = cost.kvBytes(sent);
  rc.fwd_bytes_recv = cost.kvBytes(recv);
  rc.bwd_bytes_sent = rc.fwd_bytes_recv;  // gradients go back to the owners
  rc.bwd_bytes_recv = rc.fwd_bytes_sent;
  rc.fwd_tokens_recv = recv;
  rc.peers = in_msgs;
  rc.out_peers = out_msgs;
  rc.fwd_seconds = std::max(in_msgs, out_msgs) * (cost.hardware().link_latency_us * 1e-6) +
                   std::max(rc.fwd_bytes_sent, rc.fwd_bytes_recv) / bytesPerSecond(cost);
  rc.bwd_seconds = rc.fwd_seconds;
  return rc;
}

CommPlan planComm(const ShardPlan& plan, CommMode mode, const model::CostModel& cost) {
  CommPlan c;
  c.mode = mode;
  c.cp = plan.cp;
  const int cp = plan.cp;
  c.gather_counts.resize(cp);
  c.gather_displs.resize(cp);
  std::int64_t off = 0;
  for (int r = 0; r < cp; ++r) {
    c.gather_counts[r] = plan.ranks[r].tokens;
    c.gather_displs[r] = off;
    off += plan.ranks[r].tokens;
  }
  c.ranks.assign(cp, RankComm{});
  const std::int64_t T = plan.total_tokens;

  if (mode == CommMode::AllGather) {
    for (int r = 0; r < cp; ++r) c.ranks[r] = allGatherRankComm(cost, cp, plan.ranks[r].tokens, T);
    return c;
  }

  // Sharding-aware: one message per (src, dst) pair holding the src-owned runs of dst's
  // KV buffer, in dst's run order. The runs are gathered by (src, dst) with a stable sort
  // (a map of pairs cost 5x the planning at cp 1024, where the pairs number ~cp^2).
  struct Tagged {
    int src, dst;
    const KvRun* run;
  };
  std::vector<Tagged> runs;
  for (int dst = 0; dst < cp; ++dst)
    for (const KvRun& run : plan.ranks[dst].kv_runs)
      if (run.src != dst) runs.push_back({run.src, dst, &run});
  std::stable_sort(runs.begin(), runs.end(),
                   [](const Tagged& a, const Tagged& b) { return a.src != b.src ? a.src < b.src : a.dst < b.dst; });
  std::vector<std::int64_t> sent(cp, 0), recv(cp, 0);
  std::vector<int> out_msgs(cp, 0), in_msgs(cp, 0);
  for (std::size_t i = 0; i < runs.size();) {
    Transfer t;
    t.src = runs[i].src;
    t.dst = runs[i].dst;
    for (; i < runs.size() && runs[i].src == t.src && runs[i].dst == t.dst; ++i) {
      t.runs.push_back(*runs[i].run);
      t.tokens += runs[i].run->len;
    }
    sent[t.src] += t.tokens;
    recv[t.dst] += t.tokens;
    ++out_msgs[t.src];
    ++in_msgs[t.dst];
    c.transfers.push_back(std::move(t));
  }
  for (int r = 0; r < cp; ++r) c.ranks[r] = pointToPointRankComm(cost, sent[r], recv[r], in_msgs[r], out_msgs[r]);
  return c;
}

RowMap ownRunRows(const ShardPlan& plan, int rank) {
  RowMap m;
  for (const KvRun& run : plan.ranks.at(rank).kv_runs) {
    if (run.src != rank) continue;
    for (std::int64_t i = 0; i < run.len; ++i) {
      m.dst.push_back(run.kv_begin + i);
      m.src.push_back(run.src_local_begin + i);
    }
  }
  return m;
}

std::vector<std::int64_t> transferLocalRows(const Transfer& t) {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(t.tokens));
  for (const KvRun& run : t.runs)
    for (std::int64_t i = 0; i < run.len; ++i) out.push_back(run.src_local_begin + i);
  return out;
}

std::vector<std::int64_t> transferKvSlots(const Transfer& t) {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(t.tokens));
  for (const KvRun& run : t.runs)
    for (std::int64_t i = 0; i < run.len; ++i) out.push_back(run.kv_begin + i);
  return out;
}

std::vector<std::size_t> transfersFrom(const CommPlan& comm, int rank) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < comm.transfers.size(); ++i)
    if (comm.transfers[i].src == rank) out.push_back(i);
  return out;  // sorted by (src, dst) -> ascending dst
}

std::vector<std::size_t> transfersTo(const CommPlan& comm, int rank) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < comm.transfers.size(); ++i)
    if (comm.transfers[i].dst == rank) out.push_back(i);
  return out;  // ascending src
}

namespace {
double ratio(const std::vector<double>& v) {
  if (v.empty()) return 1.0;
  double mx = 0, sum = 0;
  for (double x : v) {
    mx = std::max(mx, x);
    sum += x;
  }
  return sum > 0 ? mx / (sum / static_cast<double>(v.size())) : 1.0;
}
}  // namespace

ShardMetrics computeMetrics(const ShardPlan& plan, const CommPlan& comm, const model::CostModel& cost) {
  using model::Phase;
  ShardMetrics m;
  m.strategy = plan.strategy;
  m.requested = plan.requested;
  m.comm = commModeName(comm.mode);
  m.cp = plan.cp;
  m.total_tokens = plan.total_tokens;
  m.ranks.resize(plan.ranks.size());
  std::vector<double> attn, tok, lat;
  for (std::size_t r = 0; r < plan.ranks.size(); ++r) {
    const RankShard& rs = plan.ranks[r];
    RankMetrics& rm = m.ranks[r];
    rm.tokens = rs.tokens;
    rm.kv_tokens = rs.kv_tokens;
    for (const Piece& p : rs.pieces) {
      rm.attn_flops_fwd += cost.attnFlops(p.keysBefore(), p.q_len, Phase::Fwd);
      rm.attn_flops_bwd += cost.attnFlops(p.keysBefore(), p.q_len, Phase::Bwd);
      rm.attn_seconds_fwd += cost.attnSeconds(p.keysBefore(), p.q_len, Phase::Fwd);
      rm.attn_seconds_bwd += cost.attnSeconds(p.keysBefore(), p.q_len, Phase::Bwd);
    }
    if (rs.tokens > 0)
      rm.linear_seconds = cost.linearSeconds(rs.tokens, Phase::Fwd) + cost.linearSeconds(rs.tokens, Phase::Bwd);
    if (r < comm.ranks.size()) rm.setComm(comm.ranks[r]);
    attn.push_back(rm.attn_flops_fwd);
    tok.push_back(static_cast<double>(rm.tokens));
    lat.push_back(rm.latency());
    m.max_attn_seconds = std::max(m.max_attn_seconds, rm.attnSeconds());
    m.max_latency = std::max(m.max_latency, rm.latency());
    m.kv_bytes_total += rm.kv_bytes;
    m.kv_bytes_max = std::max(m.kv_bytes_max, rm.kv_bytes);
  }
  m.imbalance_attn = ratio(attn);
  m.imbalance_tokens = ratio(tok);
  m.imbalance_latency = ratio(lat);
  return m;
}

// ---- JSON ----------------------------------------------------------------------------

nlohmann::json toJson(const ShardPlan& plan) {
  using nlohmann::json;
  json ranks = json::array();
  for (const RankShard& rs : plan.ranks) {
    json pieces = json::array();
    for (const Piece& p : rs.pieces)
      pieces.push_back({{"segment", p.segment},
                        {"doc", p.doc},
                        {"seg_begin", p.seg_begin},
                        {"seg_len", p.seg_len},
                        {"q_offset", p.q_offset},
                        {"q_len", p.q_len},
                        {"seg_prefix", p.seg_prefix},
                        {"local_begin", p.local_begin},
                        {"kv_begin", p.kv_begin},
                        {"kv_len", p.kv_len},
                        {"whole", p.whole}});
    json blocks = json::array();
    for (const KvBlock& b : rs.kv_blocks) blocks.push_back({b.segment, b.seg_begin, b.len, b.kv_begin});
    json runs = json::array();
    for (const KvRun& r : rs.kv_runs) runs.push_back({r.src, r.src_local_begin, r.len, r.kv_begin});
    ranks.push_back({{"tokens", rs.tokens},
                     {"kv_tokens", rs.kv_tokens},
                     {"pieces", pieces},
                     {"kv_blocks", blocks},
                     {"kv_runs", runs}});
  }
  return {{"strategy", plan.strategy},
          {"requested", plan.requested},
          {"cp", plan.cp},
          {"total_tokens", plan.total_tokens},
          {"sharded_segments", plan.sharded_segments},
          {"ranks", ranks}};
}

nlohmann::json toJson(const CommPlan& comm) {
  using nlohmann::json;
  json ranks = json::array();
  for (const RankComm& r : comm.ranks)
    ranks.push_back({{"fwd_bytes_sent", r.fwd_bytes_sent},
                     {"fwd_bytes_recv", r.fwd_bytes_recv},
                     {"bwd_bytes_sent", r.bwd_bytes_sent},
                     {"bwd_bytes_recv", r.bwd_bytes_recv},
                     {"fwd_tokens_recv", r.fwd_tokens_recv},
                     {"peers", r.peers},
                     {"out_peers", r.out_peers},
                     {"fwd_seconds", r.fwd_seconds},
                     {"bwd_seconds", r.bwd_seconds}});
  json transfers = json::array();
  for (const Transfer& t : comm.transfers) {
    json runs = json::array();
    for (const KvRun& r : t.runs) runs.push_back({r.src_local_begin, r.len, r.kv_begin});
    transfers.push_back({{"src", t.src}, {"dst", t.dst}, {"tokens", t.tokens}, {"runs", runs}});
  }
  return {{"mode", commModeName(comm.mode)},     {"cp", comm.cp},          {"gather_counts", comm.gather_counts},
          {"gather_displs", comm.gather_displs}, {"transfers", transfers}, {"ranks", ranks},
          {"total_bytes", comm.totalBytes()}};
}

nlohmann::json toJson(const ShardMetrics& m) {
  using nlohmann::json;
  json ranks = json::array();
  for (const RankMetrics& r : m.ranks)
    ranks.push_back({{"tokens", r.tokens},
                     {"kv_tokens", r.kv_tokens},
                     {"attn_flops_fwd", r.attn_flops_fwd},
                     {"attn_flops_bwd", r.attn_flops_bwd},
                     {"attn_seconds_fwd", r.attn_seconds_fwd},
                     {"attn_seconds_bwd", r.attn_seconds_bwd},
                     {"linear_seconds", r.linear_seconds},
                     {"comm_seconds", r.comm_seconds},
                     {"kv_bytes", r.kv_bytes},
                     {"latency", r.latency()}});
  return {{"strategy", m.strategy},
          {"requested", m.requested},
          {"comm", m.comm},
          {"cp", m.cp},
          {"total_tokens", m.total_tokens},
          {"imbalance_attn", m.imbalance_attn},
          {"imbalance_tokens", m.imbalance_tokens},
          {"imbalance_latency", m.imbalance_latency},
          {"max_attn_seconds", m.max_attn_seconds},
          {"max_latency", m.max_latency},
          {"kv_bytes_total", m.kv_bytes_total},
          {"kv_bytes_max", m.kv_bytes_max},
          {"ranks", ranks}};
}

}  // namespace wlb::cp
