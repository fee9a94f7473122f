#pragma once
/// \file shard_plan.hpp
/// \brief Context-parallel (CP) shard plans and KV communication plans (docs/cp.md,
/// docs/cp.md). One plan type for every strategy, consumed unchanged by the distributed
/// CP executor, the DAG simulator and the trace writer. Pure C++ (no MPI).
///
/// ## Vocabulary
/// * **packed position** p in [0, T): token index in the micro-batch's packed sequence
///   (segments concatenated in order; T = MicroBatch::tokens()).
/// * **piece**: a contiguous query range [q_offset, q_offset+q_len) of one segment held
///   by one rank. Its keys are the segment prefix, packed [seg_begin, seg_begin +
///   q_offset + q_len) — causal, bottom-right aligned (the last query sees all keys).
/// * **local buffer** of rank r (Q, K, V, O, dQ, dK, dV of the rank's own tokens): the
///   rank's pieces concatenated in ascending packed order; piece i occupies
///   [local_begin, local_begin + q_len). Hence local order == ascending packed order.
///   `ShardPlan::owner[p]` / `local_index[p]` map a packed position to (rank, local idx);
///   `RankShard::packed` (via packedPositions()) is the inverse.
/// * **KV buffer** of rank r: what its attention kernel reads keys/values from. It is a
///   concatenation of **KV blocks**, one per segment in which r has queries, in
///   ascending segment order. The block of segment s holds the packed range
///   [seg_begin, seg_begin + len) in packed order, where len = max over r's pieces of s
///   of (q_offset + q_len). Every piece of s on r uses the same block:
///   `kv_begin = block.kv_begin`, `kv_len = q_offset + q_len`. The attention call of a
///   piece is therefore: queries local[local_begin, +q_len), keys/values
///   kv[kv_begin, +kv_len), causal mask aligned bottom-right (query j of the piece sees
///   keys [0, kv_len - q_len + j] of that range) — a cu_seqlens-style varlen call.
/// * **KV runs** (`RankShard::kv_runs`): the KV buffer of rank r described as maximal
///   runs {src, src_local_begin, len, kv_begin}: kv[kv_begin + i] = local K/V of rank
///   `src` at index src_local_begin + i, for i < len. Runs are sorted by kv_begin and
///   tile [0, kv_tokens) exactly once. src == r runs are the rank's own tokens (copied
///   locally, never communicated).
///
/// ## How the executor builds the KV buffer (forward) and returns dK/dV (backward)
/// * **AllGather**: MPI_Allgatherv of every rank's local K/V (counts =
///   CommPlan::gather_counts, displs = CommPlan::gather_displs, in tokens) into a
///   gathered buffer G. Then for each run of rank r: kv[kv_begin+i] =
///   G[gather_displs[src] + src_local_begin + i] (use gatherKvFromAllGather()).
///   Backward: scatter the KV-buffer gradient into a zeroed G-shaped buffer at the same
///   indices (scatterKvGradToAllGather()), then MPI_Reduce_scatter (recvcounts =
///   gather_counts) sums every rank's contribution into the owner's local dK/dV.
/// * **ShardingAware**: point-to-point. CommPlan::transfers holds, for each ordered pair
///   (src, dst) with something to move, the runs of dst's KV buffer owned by src (the
///   src != dst runs of RankShard::kv_runs, same order). src packs
///   local[src_local_begin, +len) of each run consecutively into one message
///   (packRunsFromLocal()); dst receives it and unpacks run by run into
///   kv[kv_begin, +len) (unpackRunsToKv()). Local runs (src == dst) are copied from the
///   rank's own K/V (copyLocalRuns()). Backward is the exact reverse: dst packs
///   dkv[kv_begin, +len) in the same run order (packRunsFromKv()), sends to src, which
///   *adds* them into its local dK/dV at src_local_begin (accumulateRunsToLocal()); local
///   runs are added in place (accumulateLocalRuns()).
/// Both modes yield the same KV buffer (same kv_begin/kv_len per piece); only the
/// bytes moved differ. `width` in the helpers = elements per token (e.g. kv_heads *
/// head_dim for K alone; call once for K and once for V).

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/deck.hpp"
#include "core/types.hpp"

namespace wlb::model {
class CostModel;
}

namespace wlb::cp {

/// Sharding strategies of docs/cp.md.
enum class Strategy : int { PerSequence, PerDocument, Adaptive, WholeDocument, Hybrid };
/// "per_sequence" | "per_document" | "adaptive" | "whole_document" | "hybrid".
const char* strategyName(Strategy s);
/// Parse a strategy name; throws InputError naming the allowed values.
Strategy parseStrategy(const std::string& name);
/// All strategies, in the order above (for comparison tables).
std::vector<Strategy> allStrategies();

/// KV communication modes.
enum class CommMode : int { AllGather, ShardingAware };
/// "allgather" | "sharding_aware".
const char* commModeName(CommMode m);
/// Parse a comm-mode name; throws InputError naming the allowed values.
CommMode parseCommMode(const std::string& name);

/// One query range of one segment on one rank.
struct Piece {
  std::int32_t segment = 0;    ///< index into the micro-batch's segments
  DocId doc = 0;               ///< document of that segment
  std::int64_t seg_begin = 0;  ///< packed position of the segment's first token
  std::int64_t seg_len = 0;    ///< segment length (tokens)
  std::int64_t q_offset = 0;   ///< first query token within the segment
  std::int64_t q_len = 0;      ///< queries (> 0)
  /// Keys of the segment's document before the segment: a SlimPack slice's q_offset, whose
  /// tokens lie in earlier MicroPacks and reach the executor through its KV cache
  /// (runtime/sliced.hpp), not through this plan's KV buffer; 0 for a whole span.
  std::int64_t seg_prefix = 0;
  std::int64_t local_begin = 0;  ///< first query in the rank's local buffer
  std::int64_t kv_begin = 0;     ///< first key in the rank's KV buffer (= its block's start)
  std::int64_t kv_len = 0;       ///< keys = q_offset + q_len (the segment prefix)
  bool whole = false;            ///< the segment is entirely on this rank (no KV crosses ranks)

  std::int64_t packedBegin() const { return seg_begin + q_offset; }
  /// Keys before the piece's first query (its cost: CostModel::attn*(keysBefore(), q_len)).
  std::int64_t keysBefore() const { return seg_prefix + q_offset; }
  std::int64_t packedEnd() const { return seg_begin + q_offset + q_len; }
};

/// A segment prefix held in a rank's KV buffer: packed [seg_begin, seg_begin+len) at
/// kv[kv_begin, kv_begin+len).
struct KvBlock {
  std::int32_t segment = 0;
  std::int64_t seg_begin = 0;
  std::int64_t len = 0;
  std::int64_t kv_begin = 0;
};

/// kv[kv_begin + i] = local K/V of rank `src` at src_local_begin + i, i in [0, len).
struct KvRun {
  int src = 0;
  std::int64_t src_local_begin = 0;
  std::int64_t len = 0;
  std::int64_t kv_begin = 0;
};

/// Everything one CP rank holds and reads.
struct RankShard {
  std::vector<Piece> pieces;       ///< ascending packed order; local buffers back to back
  std::int64_t tokens = 0;         ///< local buffer length = sum of q_len
  std::vector<KvBlock> kv_blocks;  ///< ascending segment order
  std::vector<KvRun> kv_runs;      ///< ascending kv_begin, tiling [0, kv_tokens)
  std::int64_t kv_tokens = 0;      ///< KV buffer length
};

/// The CP sharding of one micro-batch.
struct ShardPlan {
  std::string strategy;   ///< strategy actually applied ("per_document", ...)
  std::string requested;  ///< strategy asked for ("adaptive" may yield "per_sequence")
  int cp = 1;
  std::int64_t total_tokens = 0;
  std::vector<std::int64_t> seg_begin;    ///< packed start of each segment (size = segments)
  std::vector<std::int64_t> seg_len;      ///< length of each segment
  std::vector<RankShard> ranks;           ///< size cp
  std::vector<std::int32_t> owner;        ///< packed position -> rank
  std::vector<std::int64_t> local_index;  ///< packed position -> index in owner's local buffer
  /// hybrid: number of segments per-document sharded (the longest ones); whole_document:
  /// number of segments that fitted nowhere and fell back to per-document sharding.
  std::int32_t sharded_segments = 0;
};

/// One point-to-point message of the sharding-aware plan (forward KV src -> dst;
/// backward dK/dV dst -> src with the same runs).
struct Transfer {
  int src = 0, dst = 0;
  std::vector<KvRun> runs;  ///< the src-owned runs of dst's KV buffer, ascending kv_begin
  std::int64_t tokens = 0;  ///< sum of run lengths
};

/// Bytes and modelled time of one rank's KV communication (one layer, one TP rank).
struct RankComm {
  double fwd_bytes_sent = 0, fwd_bytes_recv = 0;  ///< K and V
  double bwd_bytes_sent = 0, bwd_bytes_recv = 0;  ///< dK and dV
  std::int64_t fwd_tokens_recv = 0;               ///< KV tokens received in forward
  int peers = 0;                                  ///< messages received in forward
  int out_peers = 0;                              ///< messages sent in forward (backward: received)
  double fwd_seconds = 0, bwd_seconds = 0;        ///< modelled (docs/cp.md)
};

struct CommPlan {
  CommMode mode = CommMode::AllGather;
  int cp = 1;
  std::vector<std::int64_t> gather_counts;  ///< tokens per rank (= ranks[r].tokens)
  std::vector<std::int64_t> gather_displs;  ///< exclusive prefix sum of gather_counts
  std::vector<Transfer> transfers;          ///< ShardingAware only; sorted by (src, dst)
  std::vector<RankComm> ranks;              ///< size cp
  double totalBytes() const;                ///< sum over ranks of fwd+bwd bytes received
};

/// Per-rank planning metrics (one layer, one TP rank).
struct RankMetrics {
  std::int64_t tokens = 0;
  std::int64_t kv_tokens = 0;
  double attn_flops_fwd = 0, attn_flops_bwd = 0;
  double attn_seconds_fwd = 0, attn_seconds_bwd = 0;  ///< sum over pieces of attnSeconds
  double linear_seconds = 0;                          ///< fwd + bwd linear work of the rank's tokens
  double comm_seconds = 0;                            ///< fwd + bwd KV communication (modelled)
  double kv_bytes = 0;                                ///< fwd+bwd bytes received by this rank
  double attnSeconds() const { return attn_seconds_fwd + attn_seconds_bwd; }
  /// Communication seconds and bytes received, fwd + bwd, from the rank's RankComm.
  void setComm(const RankComm& rc) {
    comm_seconds = rc.fwd_seconds + rc.bwd_seconds;
    kv_bytes = rc.fwd_bytes_recv + rc.bwd_bytes_recv;
  }
  /// Predicted rank latency: attention + linear + communication (no overlap assumed).
  double latency() const { return attnSeconds() + linear_seconds + comm_seconds; }
};

struct ShardMetrics {
  std::string strategy, requested, comm;
  int cp = 1;
  std::int64_t total_tokens = 0;
  std::vector<RankMetrics> ranks;
  double imbalance_attn = 1;     ///< max/mean of attention FLOPs (fwd; bwd is 2.5x)
  double imbalance_tokens = 1;   ///< max/mean of tokens
  double imbalance_latency = 1;  ///< max/mean of RankMetrics::latency()
  double max_attn_seconds = 0;   ///< max over ranks of fwd+bwd attention seconds
  double max_latency = 0;        ///< max over ranks of latency()
  double kv_bytes_total = 0;     ///< fwd+bwd bytes received, summed over ranks
  double kv_bytes_max = 0;       ///< max over ranks of fwd+bwd bytes received
};

/// Plan the CP sharding of one micro-batch. cp >= 1; cfg supplies capacity_factor and
/// (for hybrid's cost) the comm mode. Throws InputError on cp < 1 or bad names. A segment
/// with q_offset > 0 (a SlimPack slice) is sharded like any other; its pieces carry the
/// keys before it (Piece::seg_prefix), which weigh in their cost.
ShardPlan planShards(const MicroBatch& mb, Strategy strategy, int cp, const model::CostModel& cost,
                     const CpConfig& cfg);
ShardPlan planShards(const MicroBatch& mb, const std::string& strategy, int cp, const model::CostModel& cost,
                     const CpConfig& cfg);

/// A query range {rank, segment, q_offset, q_len} of an assignment planned elsewhere.
struct QueryRange {
  std::int64_t rank = 0, segment = 0, q_offset = 0, q_len = 0;
};
/// The plan of an explicit assignment (another balancer's, e.g. PyTorch's head-tail in
/// bench/cp_balancers.py), laid out exactly as the strategies' plans are: ranges merged
/// into pieces in packed order, KV blocks and runs, owner maps. `strategy` and `requested`
/// are `name`. Throws InputError naming the range or the token when the ranges do not put
/// every token of every segment on exactly one rank.
ShardPlan planFromRanges(const MicroBatch& mb, const std::vector<QueryRange>& ranges, int cp, const std::string& name);

/// The KV communication plan of a shard plan (bytes via CostModel::kvBytes).
CommPlan planComm(const ShardPlan& plan, CommMode mode, const model::CostModel& cost);
/// One rank's bytes and modelled time (docs/cp.md), as planComm fills CommPlan::ranks:
/// all-gather over cp ranks of `total` tokens, the rank holding `own`; point-to-point
/// (sharding-aware) moving `sent` and `recv` KV tokens in `in_msgs` / `out_msgs` messages.
RankComm allGatherRankComm(const model::CostModel& cost, int cp, std::int64_t own, std::int64_t total);
RankComm pointToPointRankComm(const model::CostModel& cost, std::int64_t sent, std::int64_t recv, int in_msgs,
                              int out_msgs);

/// What the hybrid search compares a candidate by, equal to computeMetrics'
/// max_latency and kv_bytes_total for planFromRanges(ranges) and planComm(mode).
struct PlanCost {
  double max_latency = 0, kv_bytes_total = 0;
};
/// The PlanCost of an assignment without building KV runs or transfers: O(P log P +
/// (P + C) C/64) for P pieces on C ranks, where planComm walks every run (O(g^2) per
/// segment split over g ranks). It uses that the pieces of a segment tile it, so a rank's
/// KV block of the segment is exactly the pieces before its last piece's end. Throws
/// InputError, as planFromRanges does, when the ranges do not put every token of every
/// segment on exactly one rank.
PlanCost planCost(const MicroBatch& mb, const std::vector<QueryRange>& ranges, int cp, CommMode mode,
                  const model::CostModel& cost);

/// One micro-batch's CP plans. `empty` micro-batches (no tokens) get default plans.
struct MicroBatchShards {
  ShardPlan shard;
  CommPlan comm;
  bool empty = true;
};
/// The CP plans of one DP replica's micro-batches: planShards + planComm for each. The
/// one function `wlb run`, `wlb shard` and `wlb simulate` plan a step's sharding with.
std::vector<MicroBatchShards> planReplicaShards(const std::vector<MicroBatch>& replica, Strategy strategy,
                                                CommMode mode, int cp, const model::CostModel& cost,
                                                const CpConfig& cfg);
/// As above, naming the strategy and taking the comm mode from cfg.comm.
std::vector<MicroBatchShards> planReplicaShards(const std::vector<MicroBatch>& replica, const std::string& strategy,
                                                int cp, const model::CostModel& cost, const CpConfig& cfg);

/// Metrics of a plan with its communication plan.
ShardMetrics computeMetrics(const ShardPlan& plan, const CommPlan& comm, const model::CostModel& cost);

/// Check every invariant (each token on exactly one rank, local order, key ranges are
/// segment prefixes, KV runs consistent with owner/local_index). Throws std::logic_error.
void validatePlan(const ShardPlan& plan, const MicroBatch& mb);

// ---- Layout helpers (the only place the index math lives) ---------------------------

/// Packed position of each local-buffer slot of `rank` (inverse of owner/local_index).
std::vector<std::int64_t> packedPositions(const ShardPlan& plan, int rank);
/// Packed position of each KV-buffer slot of `rank`.
std::vector<std::int64_t> kvPackedPositions(const ShardPlan& plan, int rank);
/// For each KV-buffer slot of `rank`, its index in the all-gathered buffer.
std::vector<std::int64_t> allGatherKvIndex(const ShardPlan& plan, const CommPlan& comm, int rank);

/// The same moves as row maps, for device kernels (distributed_attention.cpp): a move
/// copies (or adds) row src[i] of one buffer into row dst[i] of another, `width` elements
/// per row. Own runs of `rank` (src == rank): dst = KV-buffer slot, src = local row.
struct RowMap {
  std::vector<std::int64_t> dst, src;
};
RowMap ownRunRows(const ShardPlan& plan, int rank);
/// Message of transfer `t`, row i (K rows, then V rows with the same map): the sender's
/// local row and the receiver's KV-buffer slot.
std::vector<std::int64_t> transferLocalRows(const Transfer& t);
std::vector<std::int64_t> transferKvSlots(const Transfer& t);

/// AllGather forward: kv[slot] = gathered[allGatherKvIndex(slot)] (width elements per token).
template <class T>
void gatherKvFromAllGather(const ShardPlan& plan, const CommPlan& comm, int rank, const T* gathered, T* kv,
                           std::int64_t width) {
  for (const KvRun& run : plan.ranks[rank].kv_runs) {
    const T* s = gathered + (comm.gather_displs[run.src] + run.src_local_begin) * width;
    T* d = kv + run.kv_begin * width;
    for (std::int64_t i = 0; i < run.len * width; ++i) d[i] = s[i];
  }
}
/// AllGather backward: gathered_grad[idx] += dkv[slot] (gathered_grad zeroed by caller),
/// followed by MPI_Reduce_scatter with recvcounts = gather_counts * width.
template <class T>
void scatterKvGradToAllGather(const ShardPlan& plan, const CommPlan& comm, int rank, const T* dkv, T* gathered_grad,
                              std::int64_t width) {
  for (const KvRun& run : plan.ranks[rank].kv_runs) {
    T* d = gathered_grad + (comm.gather_displs[run.src] + run.src_local_begin) * width;
    const T* s = dkv + run.kv_begin * width;
    for (std::int64_t i = 0; i < run.len * width; ++i) d[i] += s[i];
  }
}
/// ShardingAware forward, sender side: message = local[src_local_begin, +len) per run.
template <class T>
void packRunsFromLocal(const Transfer& t, const T* local, T* msg, std::int64_t width) {
  for (const KvRun& run : t.runs) {
    const T* s = local + run.src_local_begin * width;
    for (std::int64_t i = 0; i < run.len * width; ++i) *msg++ = s[i];
  }
}
/// ShardingAware forward, receiver side: kv[kv_begin, +len) = message, run by run.
template <class T>
void unpackRunsToKv(const Transfer& t, const T* msg, T* kv, std::int64_t width) {
  for (const KvRun& run : t.runs) {
    T* d = kv + run.kv_begin * width;
    for (std::int64_t i = 0; i < run.len * width; ++i) d[i] = *msg++;
  }
}
/// ShardingAware backward, receiver of KV (now sender of dK/dV): message = dkv runs.
template <class T>
void packRunsFromKv(const Transfer& t, const T* dkv, T* msg, std::int64_t width) {
  for (const KvRun& run : t.runs) {
    const T* s = dkv + run.kv_begin * width;
    for (std::int64_t i = 0; i < run.len * width; ++i) *msg++ = s[i];
  }
}
/// ShardingAware backward, owner side: dlocal[src_local_begin, +len) += message.
template <class T>
void accumulateRunsToLocal(const Transfer& t, const T* msg, T* dlocal, std::int64_t width) {
  for (const KvRun& run : t.runs) {
    T* d = dlocal + run.src_local_begin * width;
    for (std::int64_t i = 0; i < run.len * width; ++i) d[i] += *msg++;
  }
}
/// Both modes may use these for the rank's own runs (src == rank): kv = local ...
template <class T>
void copyLocalRuns(const ShardPlan& plan, int rank, const T* local, T* kv, std::int64_t width) {
  for (const KvRun& run : plan.ranks[rank].kv_runs) {
    if (run.src != rank) continue;
    const T* s = local + run.src_local_begin * width;
    T* d = kv + run.kv_begin * width;
    for (std::int64_t i = 0; i < run.len * width; ++i) d[i] = s[i];
  }
}
/// ... and dlocal += dkv for the rank's own runs.
template <class T>
void accumulateLocalRuns(const ShardPlan& plan, int rank, const T* dkv, T* dlocal, std::int64_t width) {
  for (const KvRun& run : plan.ranks[rank].kv_runs) {
    if (run.src != rank) continue;
    const T* s = dkv + run.kv_begin * width;
    T* d = dlocal + run.src_local_begin * width;
    for (std::int64_t i = 0; i < run.len * width; ++i) d[i] += s[i];
  }
}
/// Indices into CommPlan::transfers of the messages `rank` sends / receives in forward
/// (ascending peer rank).
std::vector<std::size_t> transfersFrom(const CommPlan& comm, int rank);
std::vector<std::size_t> transfersTo(const CommPlan& comm, int rank);

// ---- JSON (docs/cp.md) -------------------------------------------------------------
nlohmann::json toJson(const ShardPlan& plan);
nlohmann::json toJson(const CommPlan& comm);
nlohmann::json toJson(const ShardMetrics& metrics);

}  // namespace wlb::cp
