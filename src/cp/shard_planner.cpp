/// \file shard_planner.cpp
/// \brief CP shard planners (docs/cp.md) and the layout
/// finalisation shared by every strategy.

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "core/error.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"

namespace wlb::cp {

// ---- names --------------------------------------------------------------------------

const char* strategyName(Strategy s) {
  switch (s) {
    case Strategy::PerSequence:
      return "per_sequence";
    case Strategy::PerDocument:
      return "per_document";
    case Strategy::Adaptive:
      return "adaptive";
    case Strategy::WholeDocument:
      return "whole_document";
    case Strategy::Hybrid:
      return "hybrid";
  }
  return "?";
}

std::vector<Strategy> allStrategies() {
  return {Strategy::PerSequence, Strategy::PerDocument, Strategy::Adaptive, Strategy::WholeDocument, Strategy::Hybrid};
}

Strategy parseStrategy(const std::string& name) {
  for (Strategy s : allStrategies())
    if (name == strategyName(s)) return s;
  // collective: a name comes from the deck or the command line, the same on every rank
  throw InputError("unknown CP sharding strategy '" + name +
                       "' (allowed: per_sequence, per_document, adaptive, whole_document, hybrid)",
                   true);
}

const char* commModeName(CommMode m) {
  return m == CommMode::AllGather ? "allgather" : "sharding_aware";
}

CommMode parseCommMode(const std::string& name) {
  if (name == "allgather") return CommMode::AllGather;
  if (name == "sharding_aware") return CommMode::ShardingAware;
  throw InputError("unknown CP communication mode '" + name + "' (allowed: allgather, sharding_aware)", true);
}

namespace {

/// A query range before layout: rank r holds [q_offset, q_offset+q_len) of segment seg.
struct Raw {
  int rank;
  std::int32_t seg;
  std::int64_t q_offset, q_len;
};

struct SegInfo {
  std::vector<std::int64_t> begin, len;
  std::vector<std::int64_t> prefix;  ///< keys before the segment (a slice's q_offset)
  std::int64_t total = 0;
};

SegInfo segInfo(const MicroBatch& mb) {
  SegInfo s;
  s.begin.reserve(mb.segments.size());
  s.len.reserve(mb.segments.size());
  for (const auto& seg : mb.segments) {
    if (seg.length < 0) throw InputError("segment of document " + std::to_string(seg.doc) + " has negative length");
    if (seg.q_offset < 0) throw InputError("segment of document " + std::to_string(seg.doc) + " has negative q_offset");
    s.begin.push_back(s.total);
    s.len.push_back(seg.length);
    s.prefix.push_back(seg.q_offset);
    s.total += seg.length;
  }
  return s;
}

/// The cost model's figures of pieces and ranks, memoised for one planning call: hybrid's
/// search asks for the same (keys before, queries) pieces in most of its candidates, and
/// each answer is an interpolation in the profile's tables (a log and an exp per lookup).
/// The values are the model's own, so plans do not change.
class PieceCosts {
 public:
  explicit PieceCosts(const model::CostModel& cost) : cost_(cost) {}
  const model::CostModel& model() const { return cost_; }
  /// Forward and backward attention seconds of q queries after q0 keys.
  std::array<double, 2> attn(std::int64_t q0, std::int64_t q) {
    const auto [it, fresh] = attn_.try_emplace(Key{q0, q});
    if (fresh) it->second = {cost_.attnSeconds(q0, q, model::Phase::Fwd), cost_.attnSeconds(q0, q, model::Phase::Bwd)};
    return it->second;
  }
  /// Forward and backward linear seconds of `tokens` tokens.
  std::array<double, 2> linear(std::int64_t tokens) {
    const auto [it, fresh] = linear_.try_emplace(tokens);
    if (fresh)
      it->second = {cost_.linearSeconds(tokens, model::Phase::Fwd), cost_.linearSeconds(tokens, model::Phase::Bwd)};
    return it->second;
  }

 private:
  struct Key {
    std::int64_t q0, q;
    bool operator==(const Key& o) const { return q0 == o.q0 && q == o.q; }
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const {
      return std::hash<std::uint64_t>()(static_cast<std::uint64_t>(k.q0) * 0x9E3779B97F4A7C15ULL ^
                                        static_cast<std::uint64_t>(k.q));
    }
  };
  const model::CostModel& cost_;
  std::unordered_map<Key, std::array<double, 2>, KeyHash> attn_;
  std::unordered_map<std::int64_t, std::array<double, 2>> linear_;
};

/// The pieces of raw ranges: per rank, ranges in packed order with contiguous ranges of
/// one segment merged, laid out in the local buffer (pieces, tokens of `ranks`, size cp).
void layoutPieces(const MicroBatch& mb, const SegInfo& si, std::vector<Raw> raws, std::vector<RankShard>& ranks) {
  raws.erase(std::remove_if(raws.begin(), raws.end(), [](const Raw& r) { return r.q_len <= 0; }), raws.end());
  std::sort(raws.begin(), raws.end(), [&](const Raw& a, const Raw& b) {
    const auto pa = si.begin[a.seg] + a.q_offset, pb = si.begin[b.seg] + b.q_offset;
    if (a.rank != b.rank) return a.rank < b.rank;
    return pa < pb;
  });
  // Merge contiguous ranges of one segment on one rank; lay out local buffers.
  for (const Raw& r : raws) {
    RankShard& rs = ranks[r.rank];
    if (!rs.pieces.empty()) {
      Piece& last = rs.pieces.back();
      if (last.segment == r.seg && last.q_offset + last.q_len == r.q_offset) {
        last.q_len += r.q_len;
        rs.tokens += r.q_len;
        continue;
      }
    }
    Piece p;
    p.segment = r.seg;
    p.doc = mb.segments[r.seg].doc;
    p.seg_begin = si.begin[r.seg];
    p.seg_len = si.len[r.seg];
    p.q_offset = r.q_offset;
    p.q_len = r.q_len;
    p.seg_prefix = si.prefix[r.seg];
    p.local_begin = rs.tokens;
    rs.pieces.push_back(p);
    rs.tokens += r.q_len;
  }
}

/// Turn raw ranges into the full plan: merged pieces in packed order, local buffer
/// offsets, KV blocks and runs, and (optionally) the packed -> (rank, local) maps.
ShardPlan finalize(const MicroBatch& mb, const SegInfo& si, std::vector<Raw> raws, int cp, const std::string& strategy,
                   const std::string& requested, bool with_maps) {
  ShardPlan plan;
  plan.strategy = strategy;
  plan.requested = requested;
  plan.cp = cp;
  plan.total_tokens = si.total;
  plan.seg_begin = si.begin;
  plan.seg_len = si.len;
  plan.ranks.assign(static_cast<std::size_t>(cp), RankShard{});
  layoutPieces(mb, si, std::move(raws), plan.ranks);
  // Pieces of each segment across ranks, by q_offset (for KV runs and `whole`).
  struct Ref {
    int rank;
    std::size_t idx;
  };
  std::vector<std::vector<Ref>> by_seg(si.len.size());
  for (int r = 0; r < cp; ++r)
    for (std::size_t i = 0; i < plan.ranks[r].pieces.size(); ++i)
      by_seg[plan.ranks[r].pieces[i].segment].push_back({r, i});
  for (auto& v : by_seg)
    std::sort(v.begin(), v.end(), [&](const Ref& a, const Ref& b) {
      return plan.ranks[a.rank].pieces[a.idx].q_offset < plan.ranks[b.rank].pieces[b.idx].q_offset;
    });
  for (auto& v : by_seg)
    if (v.size() == 1) plan.ranks[v[0].rank].pieces[v[0].idx].whole = true;

  // KV blocks (one per segment with queries on the rank) and runs.
  for (int r = 0; r < cp; ++r) {
    RankShard& rs = plan.ranks[r];
    std::size_t i = 0;
    while (i < rs.pieces.size()) {
      const std::int32_t seg = rs.pieces[i].segment;
      std::size_t j = i;
      std::int64_t len = 0;
      while (j < rs.pieces.size() && rs.pieces[j].segment == seg) {
        len = std::max(len, rs.pieces[j].q_offset + rs.pieces[j].q_len);
        ++j;
      }
      KvBlock b{seg, si.begin[seg], len, rs.kv_tokens};
      for (std::size_t k = i; k < j; ++k) {
        rs.pieces[k].kv_begin = b.kv_begin;
        rs.pieces[k].kv_len = rs.pieces[k].q_offset + rs.pieces[k].q_len;
      }
      for (const Ref& ref : by_seg[seg]) {
        const Piece& src = plan.ranks[ref.rank].pieces[ref.idx];
        if (src.q_offset >= len) break;
        const std::int64_t n = std::min(src.q_offset + src.q_len, len) - src.q_offset;
        const std::int64_t kv_begin = b.kv_begin + src.q_offset;
        // maximal runs: one that continues the last (same source, contiguous on both
        // sides, e.g. across segments) extends it
        if (!rs.kv_runs.empty()) {
          KvRun& last = rs.kv_runs.back();
          if (last.src == ref.rank && last.src_local_begin + last.len == src.local_begin &&
              last.kv_begin + last.len == kv_begin) {
            last.len += n;
            continue;
          }
        }
        rs.kv_runs.push_back({ref.rank, src.local_begin, n, kv_begin});
      }
      rs.kv_blocks.push_back(b);
      rs.kv_tokens += len;
      i = j;
    }
  }
  if (with_maps) {
    plan.owner.assign(static_cast<std::size_t>(si.total), -1);
    plan.local_index.assign(static_cast<std::size_t>(si.total), -1);
    for (int r = 0; r < cp; ++r)
      for (const Piece& p : plan.ranks[r].pieces)
        for (std::int64_t t = 0; t < p.q_len; ++t) {
          plan.owner[p.packedBegin() + t] = r;
          plan.local_index[p.packedBegin() + t] = p.local_begin + t;
        }
  }
  return plan;
}

/// planCost on raw ranges (docs in shard_plan.hpp). Per segment, with its pieces in
/// offset order: rank r's KV block spans [0, L_r), L_r the end of r's last piece, and the
/// pieces starting before L_r tile it, so r receives L_r minus its own tokens of the
/// segment, from the owners of those pieces; the owner of a piece starting at a sends it
/// to every other holder with L > a. Message pairs are counted once across segments
/// (bit sets of senders per receiver), as planComm's (src, dst) transfers are.
PlanCost costRaws(const MicroBatch& mb, const SegInfo& si, std::vector<Raw> raws, int cp, CommMode mode,
                  PieceCosts& costs) {
  const model::CostModel& cost = costs.model();
  std::vector<RankShard> ranks(static_cast<std::size_t>(cp));
  layoutPieces(mb, si, std::move(raws), ranks);
  const std::size_t C = ranks.size();
  std::vector<std::int64_t> sent(C, 0), recv(C, 0);
  std::vector<int> in_msgs(C, 0), out_msgs(C, 0);
  if (mode == CommMode::ShardingAware && cp > 1) {
    struct P {
      std::int32_t seg;
      int owner;
      std::int64_t start, len;
    };
    std::vector<P> pieces;
    for (std::size_t r = 0; r < C; ++r)
      for (const Piece& p : ranks[r].pieces) pieces.push_back({p.segment, static_cast<int>(r), p.q_offset, p.q_len});
    std::sort(pieces.begin(), pieces.end(),
              [](const P& a, const P& b) { return a.seg != b.seg ? a.seg < b.seg : a.start < b.start; });
    const std::size_t W = (C + 63) / 64;
    std::vector<std::uint64_t> senders(C * W, 0), seen(W);
    std::vector<std::size_t> last(C);
    std::vector<std::int64_t> own(C, 0), ends;
    std::vector<int> holders;
    for (std::size_t b = 0; b < pieces.size();) {
      std::size_t e = b;
      while (e < pieces.size() && pieces[e].seg == pieces[b].seg) ++e;
      holders.clear();
      for (std::size_t j = b; j < e; ++j) {
        const int o = pieces[j].owner;
        if (own[o] == 0) holders.push_back(o);
        own[o] += pieces[j].len;
        last[o] = j;
      }
      if (holders.size() > 1) {
        ends.clear();
        for (int r : holders) {
          const std::int64_t L = pieces[last[r]].start + pieces[last[r]].len;
          recv[r] += L - own[r];
          ends.push_back(L);
        }
        std::sort(ends.begin(), ends.end());
        std::fill(seen.begin(), seen.end(), 0);
        std::size_t q = 0;  // ends[q..] > start of the current piece
        for (std::size_t j = b; j < e; ++j) {
          const P& p = pieces[j];
          while (q < ends.size() && ends[q] <= p.start) ++q;
          sent[p.owner] += p.len * static_cast<std::int64_t>(ends.size() - q - 1);
          seen[p.owner / 64] |= std::uint64_t{1} << (p.owner % 64);
          if (last[p.owner] == j)
            for (std::size_t w = 0; w < W; ++w) senders[p.owner * W + w] |= seen[w];
        }
      }
      for (int r : holders) own[r] = 0;
      b = e;
    }
    for (std::size_t r = 0; r < C; ++r) {
      senders[r * W + r / 64] &= ~(std::uint64_t{1} << (r % 64));
      for (std::size_t w = 0; w < W; ++w)
        for (std::uint64_t bits = senders[r * W + w]; bits != 0; bits &= bits - 1) {
          ++in_msgs[r];
          ++out_msgs[w * 64 + static_cast<std::size_t>(__builtin_ctzll(bits))];
        }
    }
  }
  // computeMetrics' sums in its order, and planComm's per-rank comm, so the doubles agree.
  PlanCost pc;
  for (std::size_t r = 0; r < C; ++r) {
    const RankShard& rs = ranks[r];
    RankMetrics rm;
    for (const Piece& p : rs.pieces) {
      const auto a = costs.attn(p.keysBefore(), p.q_len);
      rm.attn_seconds_fwd += a[0];
      rm.attn_seconds_bwd += a[1];
    }
    if (rs.tokens > 0) {
      const auto l = costs.linear(rs.tokens);
      rm.linear_seconds = l[0] + l[1];
    }
    rm.setComm(mode == CommMode::AllGather ? allGatherRankComm(cost, cp, rs.tokens, si.total)
                                           : pointToPointRankComm(cost, sent[r], recv[r], in_msgs[r], out_msgs[r]));
    pc.max_latency = std::max(pc.max_latency, rm.latency());
    pc.kv_bytes_total += rm.kv_bytes;
  }
  return pc;
}

// ---- strategies on raw ranges -------------------------------------------------------

std::vector<Raw> rawPerSequence(const SegInfo& si, int cp) {
  std::vector<Raw> out;
  const std::int64_t chunks = 2 * static_cast<std::int64_t>(cp);
  const std::int64_t q = si.total / chunks, rem = si.total % chunks;
  std::size_t seg = 0;
  std::int64_t pos = 0;
  for (std::int64_t c = 0; c < chunks; ++c) {
    // Extra tokens go first to every rank's first chunk, then to second chunks, so rank
    // token counts differ by at most one.
    const std::int64_t r = c < cp ? c : chunks - 1 - c;
    const bool extra = c < cp ? r < rem : r < rem - cp;
    std::int64_t left = q + (extra ? 1 : 0);
    while (left > 0) {
      while (seg < si.len.size() && pos >= si.begin[seg] + si.len[seg]) ++seg;
      const std::int64_t seg_end = si.begin[seg] + si.len[seg];
      const std::int64_t n = std::min(left, seg_end - pos);
      out.push_back({static_cast<int>(r), static_cast<std::int32_t>(seg), pos - si.begin[seg], n});
      pos += n;
      left -= n;
    }
  }
  return out;
}

/// Per-document split of one segment of length d over a group of g ranks `members`
/// (member i plays the role of rank i; the full CP group is members = 0..C-1): 2g floor
/// pieces of e = d/2g tokens (member i: pieces i and 2g-1-i) and R = d - 2g*e < 2g
/// remainder tokens dealt one each to members counter, counter+1, ... (mod g), the
/// counter carrying across segments. A member dealt one remainder token gets its first
/// piece (piece i) extended by one token; a member dealt two (possible when R > g) also
/// gets piece 2g-1-i extended. Pieces are laid out in piece order 0..2g-1, so every rank
/// keeps at most two contiguous query pieces per segment (no single-token pieces that a
/// tiled kernel would pad to a full tile) and needs no key beyond the end of its own last
/// piece. Ranks outside the group hold nothing of the segment and need none of its KV.
void rawGroupSegment(const SegInfo& si, std::int32_t s, const std::vector<int>& members, std::int64_t& counter,
                     std::vector<Raw>& out) {
  const int g = static_cast<int>(members.size());
  const std::int64_t d = si.len[s], chunks = 2 * static_cast<std::int64_t>(g);
  const std::int64_t e = d / chunks, rem = d - chunks * e;
  std::vector<int> extra(static_cast<std::size_t>(g), 0);
  for (std::int64_t t = 0; t < rem; ++t) {
    ++extra[static_cast<std::size_t>(counter % g)];
    ++counter;
  }
  std::int64_t off = 0;
  for (std::int64_t j = 0; j < chunks; ++j) {
    const int i = static_cast<int>(j < g ? j : chunks - 1 - j);
    const std::int64_t len = e + ((j < g ? extra[i] >= 1 : extra[i] >= 2) ? 1 : 0);
    if (len > 0) out.push_back({members[static_cast<std::size_t>(i)], s, off, len});
    off += len;
  }
}

std::vector<int> allRanks(int cp) {
  std::vector<int> m(static_cast<std::size_t>(cp));
  std::iota(m.begin(), m.end(), 0);
  return m;
}

/// Per-document split over the whole CP group (docs/cp.md, per_document).
void rawPerDocumentSegment(const SegInfo& si, std::int32_t s, int cp, std::int64_t& counter, std::vector<Raw>& out) {
  rawGroupSegment(si, s, allRanks(cp), counter, out);
}

std::vector<Raw> rawPerDocument(const SegInfo& si, int cp) {
  std::vector<Raw> out;
  std::int64_t counter = 0;
  for (std::size_t s = 0; s < si.len.size(); ++s)
    rawPerDocumentSegment(si, static_cast<std::int32_t>(s), cp, counter, out);
  return out;
}

/// Compute load of one query range (fwd+bwd attention + linear seconds); q0: keys before
/// its first query.
double rangeWork(PieceCosts& costs, std::int64_t q0, std::int64_t q) {
  const auto a = costs.attn(q0, q);
  const auto l = costs.linear(q);
  return a[0] + a[1] + l[0] + l[1];
}

/// Whole-document assignment of `segs` (LPT on fwd+bwd compute seconds, heaviest first,
/// each to the least-loaded rank with room under `cap` tokens). Segments that fit on no
/// rank are per-document sharded over all ranks (counter carried). `load`/`tokens` hold
/// the ranks' state on entry (e.g. from hybrid's sharded part) and are updated.
/// Returns the number of fallback segments.
int assignWhole(const SegInfo& si, std::vector<std::int32_t> segs, int cp, std::int64_t cap, PieceCosts& costs,
                std::vector<double>& load, std::vector<std::int64_t>& tokens, std::int64_t& counter,
                std::vector<Raw>& out) {
  std::vector<double> w(segs.size());
  for (std::size_t i = 0; i < segs.size(); ++i) w[i] = rangeWork(costs, si.prefix[segs[i]], si.len[segs[i]]);
  std::vector<std::size_t> order(segs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (w[a] != w[b]) return w[a] > w[b];
    return si.len[segs[a]] > si.len[segs[b]];
  });
  int fallback = 0;
  for (std::size_t oi : order) {
    const std::int32_t s = segs[oi];
    const std::int64_t d = si.len[s];
    if (d == 0) continue;
    int best = -1;
    for (int r = 0; r < cp; ++r)
      if (tokens[r] + d <= cap && (best < 0 || load[r] < load[best])) best = r;
    if (best >= 0) {
      out.push_back({best, s, 0, d});
      load[best] += w[oi];
      tokens[best] += d;
      continue;
    }
    ++fallback;
    std::vector<Raw> part;
    rawPerDocumentSegment(si, s, cp, counter, part);
    for (const Raw& r : part) {
      load[r.rank] += rangeWork(costs, si.prefix[r.seg] + r.q_offset, r.q_len);
      tokens[r.rank] += r.q_len;
      out.push_back(r);
    }
  }
  return fallback;
}

std::int64_t capacityTokens(const SegInfo& si, int cp, const CpConfig& cfg) {
  const double f = std::max(1.0, cfg.capacity_factor);
  return static_cast<std::int64_t>(std::ceil(f * static_cast<double>(si.total) / cp));
}

double maxAttnSeconds(const ShardPlan& plan, const model::CostModel& cost) {
  double m = 0;
  for (const RankShard& rs : plan.ranks) {
    double s = 0;
    for (const Piece& p : rs.pieces)
      s += cost.attnSeconds(p.keysBefore(), p.q_len, model::Phase::Fwd) +
           cost.attnSeconds(p.keysBefore(), p.q_len, model::Phase::Bwd);
    m = std::max(m, s);
  }
  return m;
}

/// Hybrid candidate counts k: every k up to 32, then geometric steps (x1.5) up to n.
std::vector<std::size_t> hybridCandidates(std::size_t n) {
  std::vector<std::size_t> ks;
  for (std::size_t k = 0; k <= std::min<std::size_t>(n, 32); ++k) ks.push_back(k);
  std::size_t k = 32;
  while (k < n) {
    k = std::min(n, std::max(k + 1, k * 3 / 2));
    ks.push_back(k);
  }
  return ks;
}

/// Among hybrid candidates whose predicted max-rank latency is within this fraction of the
/// best one, the one moving the fewest KV bytes wins (docs/cp.md). The choice is further
/// capped so hybrid never predicts worse than whole_document or per_document.
constexpr double kHybridLatencyTolerance = 0.01;

/// Subgroup-size rules of the hybrid search: a sharded segment with w_s of the micro-batch's
/// compute work W gets g = ceil(alpha * C * w_s / W) ranks, clamped to [2, C] (alpha = 0:
/// g = C, the whole CP group).
constexpr double kHybridAlphas[] = {0.0, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0};

/// The hybrid search refines the group sizes of at most this many (longest) segments.
constexpr std::size_t kHybridRefine = 16;

/// Up to this CP degree the coordinate descent tries every group size in [2, C].
constexpr int kHybridDenseSizes = 16;

/// Group sizes the coordinate descent tries for one segment now of size `current`: every g
/// in [2, C] up to kHybridDenseSizes ranks; beyond, a geometric ladder (x1.25) with C and
/// the neighbours of `current`, so that a step at C = 64 costs ~20 trials per segment, not
/// 63 (each trial is a full plan, comm plan and latency, O(C) or more).
std::vector<int> hybridGroupSizes(int cp, int current) {
  std::vector<int> gs;
  if (cp <= kHybridDenseSizes) {
    for (int g = 2; g <= cp; ++g) gs.push_back(g);
    return gs;
  }
  for (int g = 2; g < cp; g = std::max(g + 1, static_cast<int>(g * 1.25))) gs.push_back(g);
  for (int g : {cp, current - 1, current + 1})
    if (g >= 2 && g <= cp) gs.push_back(g);
  std::sort(gs.begin(), gs.end());
  gs.erase(std::unique(gs.begin(), gs.end()), gs.end());
  return gs;
}

/// A costed hybrid candidate; its raw ranges are rebuilt for the one picked (buildHybrid
/// is deterministic), so the search holds O(candidates) memory, not O(candidates x pieces).
struct HybridCandidate {
  double latency = 0, bytes = 0;
  int sharded = 0;
  std::vector<int> groups;  ///< group size of each sharded segment (empty: per_document)
  bool per_document = false;
};

/// One hybrid plan before layout: segment order[i] (i < groups.size()) is per-document
/// sharded over the groups[i] least-loaded ranks at that point (ties: fewer tokens, lower
/// rank; groups[i] == C is the whole CP group), the remaining segments are assigned whole
/// (LPT under `cap`, fallback over all ranks). The remainder counter carries across all
/// sharded segments. `sharded` = sharded segments including fallbacks.
std::vector<Raw> buildHybrid(const SegInfo& si, const std::vector<std::int32_t>& order, const std::vector<int>& groups,
                             int cp, std::int64_t cap, PieceCosts& costs, int& sharded) {
  std::vector<Raw> raws;
  std::vector<double> load(static_cast<std::size_t>(cp), 0.0);
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(cp), 0);
  std::int64_t counter = 0;
  std::vector<int> ranks = allRanks(cp);
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const int g = std::min(cp, std::max(1, groups[i]));
    std::vector<int> members;
    if (g == cp) {
      members = allRanks(cp);
    } else {
      std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
        if (load[a] != load[b]) return load[a] < load[b];
        if (tokens[a] != tokens[b]) return tokens[a] < tokens[b];
        return a < b;
      });
      members.assign(ranks.begin(), ranks.begin() + g);
      std::sort(members.begin(), members.end());
      std::sort(ranks.begin(), ranks.end());
    }
    std::vector<Raw> part;
    rawGroupSegment(si, order[i], members, counter, part);
    for (const Raw& r : part) {
      load[r.rank] += rangeWork(costs, si.prefix[r.seg] + r.q_offset, r.q_len);
      tokens[r.rank] += r.q_len;
      raws.push_back(r);
    }
  }
  std::vector<std::int32_t> rest(order.begin() + static_cast<std::ptrdiff_t>(groups.size()), order.end());
  const int fb = assignWhole(si, rest, cp, cap, costs, load, tokens, counter, raws);
  sharded = static_cast<int>(groups.size()) + fb;
  return raws;
}

}  // namespace

// ---- entry points ---------------------------------------------------------------------

namespace {
void requireDegree(int cp) {
  if (cp < 1) throw InputError("CP degree must be >= 1 (got " + std::to_string(cp) + ")");
}
}  // namespace

ShardPlan planShards(const MicroBatch& mb, Strategy strategy, int cp, const model::CostModel& cost,
                     const CpConfig& cfg) {
  requireDegree(cp);
  const SegInfo si = segInfo(mb);
  const std::string req = strategyName(strategy);
  switch (strategy) {
    case Strategy::PerSequence:
      return finalize(mb, si, rawPerSequence(si, cp), cp, "per_sequence", req, true);
    case Strategy::PerDocument:
      return finalize(mb, si, rawPerDocument(si, cp), cp, "per_document", req, true);
    case Strategy::Adaptive: {
      ShardPlan a = finalize(mb, si, rawPerSequence(si, cp), cp, "per_sequence", req, true);
      ShardPlan b = finalize(mb, si, rawPerDocument(si, cp), cp, "per_document", req, true);
      // Ties go to per_document (exactly balanced work, less KV to move).
      return maxAttnSeconds(a, cost) < maxAttnSeconds(b, cost) ? a : b;
    }
    case Strategy::WholeDocument: {
      std::vector<std::int32_t> segs(si.len.size());
      std::iota(segs.begin(), segs.end(), 0);
      std::vector<double> load(cp, 0.0);
      std::vector<std::int64_t> tokens(cp, 0);
      std::int64_t counter = 0;
      std::vector<Raw> raws;
      PieceCosts costs(cost);
      const int fb = assignWhole(si, segs, cp, capacityTokens(si, cp, cfg), costs, load, tokens, counter, raws);
      ShardPlan p = finalize(mb, si, std::move(raws), cp, "whole_document", req, true);
      p.sharded_segments = fb;
      return p;
    }
    case Strategy::Hybrid: {
      const CommMode mode = parseCommMode(cfg.comm);
      const std::int64_t cap = capacityTokens(si, cp, cfg);
      PieceCosts costs(cost);
      std::vector<std::int32_t> by_len(si.len.size());
      std::iota(by_len.begin(), by_len.end(), 0);
      std::stable_sort(by_len.begin(), by_len.end(),
                       [&](std::int32_t a, std::int32_t b) { return si.len[a] > si.len[b]; });
      // Empty segments carry no work; never count them as sharding candidates.
      std::size_t n = 0;
      while (n < by_len.size() && si.len[by_len[n]] > 0) ++n;
      std::vector<double> work(si.len.size(), 0.0);
      double total_work = 0;
      for (std::size_t s = 0; s < si.len.size(); ++s) {
        work[s] = si.len[s] > 0 ? rangeWork(costs, si.prefix[s], si.len[s]) : 0.0;
        total_work += work[s];
      }

      std::vector<HybridCandidate> pool;
      std::set<std::vector<int>> tried;  // group-size vectors already evaluated
      auto evaluate = [&](HybridCandidate c, std::vector<Raw> raws) {
        const PlanCost pc = costRaws(mb, si, std::move(raws), cp, mode, costs);
        c.latency = pc.max_latency;
        c.bytes = pc.kv_bytes_total;
        pool.push_back(std::move(c));
        return pool.size() - 1;
      };
      auto tryGroups = [&](const std::vector<int>& groups) -> std::ptrdiff_t {
        if (!tried.insert(groups).second) return -1;
        HybridCandidate c;
        c.groups = groups;
        std::vector<Raw> raws = buildHybrid(si, by_len, groups, cp, cap, costs, c.sharded);
        return static_cast<std::ptrdiff_t>(evaluate(std::move(c), std::move(raws)));
      };
      auto groupSize = [&](std::int32_t seg, double alpha) {
        if (alpha <= 0 || total_work <= 0) return cp;
        const double g = std::ceil(alpha * cp * work[seg] / total_work - 1e-9);
        return static_cast<int>(std::min<double>(cp, std::max(2.0, g)));
      };
      auto better = [&](std::size_t a, std::size_t b) {
        if (pool[a].latency != pool[b].latency) return pool[a].latency < pool[b].latency;
        return pool[a].bytes < pool[b].bytes;
      };

      // (1) per_document itself (so hybrid never predicts worse than it).
      HybridCandidate pd;
      pd.sharded = static_cast<int>(n);
      pd.per_document = true;
      const std::size_t pd_index = evaluate(std::move(pd), rawPerDocument(si, cp));
      // (2) for every k and every subgroup-size rule, shard the k longest segments (k = 0
      // is exactly whole_document; alpha = 0 shards over all C ranks).
      std::size_t wd_index = pd_index;
      for (std::size_t k : hybridCandidates(n))
        for (double alpha : kHybridAlphas) {
          std::vector<int> groups(k);
          for (std::size_t i = 0; i < k; ++i) groups[i] = groupSize(by_len[i], alpha);
          const std::ptrdiff_t idx = tryGroups(groups);
          if (k == 0 && idx >= 0) wd_index = static_cast<std::size_t>(idx);
        }
      // (3) coordinate descent on the group sizes of the best candidate (latency, ties to
      // fewer bytes): one sharded segment at a time (the first kHybridRefine), every size of
      // hybridGroupSizes, until no move improves.
      std::size_t best = 0;
      for (std::size_t i = 1; i < pool.size(); ++i)
        if (better(i, best)) best = i;
      for (int pass = 0; pass < 2 && !pool[best].per_document; ++pass) {
        bool improved = false;
        const std::size_t k = std::min(pool[best].groups.size(), kHybridRefine);
        for (std::size_t i = 0; i < k; ++i)
          for (int g : hybridGroupSizes(cp, pool[best].groups[i])) {
            std::vector<int> groups = pool[best].groups;
            if (groups[i] == g) continue;
            groups[i] = g;
            const std::ptrdiff_t idx = tryGroups(groups);
            if (idx >= 0 && better(static_cast<std::size_t>(idx), best)) {
              best = static_cast<std::size_t>(idx);
              improved = true;
            }
          }
        if (!improved) break;
      }

      // Selection: the fewest bytes among candidates within the latency tolerance of the
      // best, never above whole_document's or per_document's predicted latency.
      const double limit = std::min(
          {pool[best].latency * (1.0 + kHybridLatencyTolerance), pool[wd_index].latency, pool[pd_index].latency});
      // Byte counts equal up to rounding (allgather: always (C-1)·T) are ties, decided by
      // latency; the order of `pool` breaks exact ties (earlier = fewer sharded segments).
      std::size_t pick = best;
      for (std::size_t i = 0; i < pool.size(); ++i) {
        if (pool[i].latency > limit) continue;
        const double eps = 1e-9 * std::max(pool[i].bytes, pool[pick].bytes);
        if (pool[i].bytes < pool[pick].bytes - eps ||
            (pool[i].bytes <= pool[pick].bytes + eps && pool[i].latency < pool[pick].latency))
          pick = i;
      }
      int sharded = pool[pick].sharded;
      std::vector<Raw> raws = pool[pick].per_document
                                  ? rawPerDocument(si, cp)
                                  : buildHybrid(si, by_len, pool[pick].groups, cp, cap, costs, sharded);
      ShardPlan p = finalize(mb, si, std::move(raws), cp, "hybrid", req, true);
      p.sharded_segments = sharded;
      return p;
    }
  }
  throw std::logic_error("unreachable strategy");
}

ShardPlan planShards(const MicroBatch& mb, const std::string& strategy, int cp, const model::CostModel& cost,
                     const CpConfig& cfg) {
  return planShards(mb, parseStrategy(strategy), cp, cost, cfg);
}

namespace {
/// The raw ranges of an assignment planned elsewhere, checked: ranks in [0, cp), segments
/// in range, and every token of every segment on exactly one rank (InputError otherwise).
std::vector<Raw> checkedRanges(const SegInfo& si, const std::vector<QueryRange>& ranges, int cp) {
  const auto nseg = static_cast<std::int64_t>(si.len.size());
  std::vector<Raw> raws;
  raws.reserve(ranges.size());
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const QueryRange& q = ranges[i];
    const std::string at = "ranges[" + std::to_string(i) + "]: ";
    if (q.rank < 0 || q.rank >= cp)
      throw InputError(at + "rank " + std::to_string(q.rank) + " is out of range [0, " + std::to_string(cp) + ")");
    if (q.segment < 0 || q.segment >= nseg)
      throw InputError(at + "segment " + std::to_string(q.segment) + " is out of range [0, " + std::to_string(nseg) +
                       ")");
    // q_len is compared with what is left of the segment: q_offset + q_len could overflow
    if (q.q_len <= 0 || q.q_offset < 0 || q.q_offset > si.len[q.segment] || q.q_len > si.len[q.segment] - q.q_offset)
      throw InputError(at + "queries at " + std::to_string(q.q_offset) + ", " + std::to_string(q.q_len) +
                       " long, are empty or outside segment " + std::to_string(q.segment) + " of " +
                       std::to_string(si.len[q.segment]) + " tokens");
    raws.push_back({static_cast<int>(q.rank), static_cast<std::int32_t>(q.segment), q.q_offset, q.q_len});
  }
  // Every token on exactly one rank: per segment, the ranges sorted by offset tile [0, len).
  std::vector<Raw> by = raws;
  std::sort(by.begin(), by.end(),
            [](const Raw& a, const Raw& b) { return a.seg != b.seg ? a.seg < b.seg : a.q_offset < b.q_offset; });
  std::size_t k = 0;
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(nseg); ++s) {
    std::int64_t next = 0;
    for (; k < by.size() && by[k].seg == s; ++k) {
      if (by[k].q_offset != next)
        throw InputError("ranges: segment " + std::to_string(s) + " token " +
                         std::to_string(std::min(next, by[k].q_offset)) +
                         (by[k].q_offset > next ? " is on no rank" : " is on two ranks"));
      next += by[k].q_len;
    }
    if (next != si.len[s])
      throw InputError("ranges: segment " + std::to_string(s) + " token " + std::to_string(next) + " is on no rank");
  }
  return raws;
}
}  // namespace

ShardPlan planFromRanges(const MicroBatch& mb, const std::vector<QueryRange>& ranges, int cp, const std::string& name) {
  requireDegree(cp);
  const SegInfo si = segInfo(mb);
  return finalize(mb, si, checkedRanges(si, ranges, cp), cp, name, name, true);
}

PlanCost planCost(const MicroBatch& mb, const std::vector<QueryRange>& ranges, int cp, CommMode mode,
                  const model::CostModel& cost) {
  requireDegree(cp);
  const SegInfo si = segInfo(mb);
  PieceCosts costs(cost);
  return costRaws(mb, si, checkedRanges(si, ranges, cp), cp, mode, costs);
}

// ---- validation and layout helpers ------------------------------------------------------

namespace {
void check(bool ok, const std::string& what) {
  if (!ok) throw std::logic_error("invalid shard plan: " + what);
}
}  // namespace

void validatePlan(const ShardPlan& plan, const MicroBatch& mb) {
  const SegInfo si = segInfo(mb);
  check(plan.cp >= 1 && static_cast<int>(plan.ranks.size()) == plan.cp, "rank count");
  check(plan.total_tokens == si.total, "total tokens");
  check(plan.seg_begin == si.begin && plan.seg_len == si.len, "segment table");
  check(static_cast<std::int64_t>(plan.owner.size()) == si.total &&
            static_cast<std::int64_t>(plan.local_index.size()) == si.total,
        "map sizes");
  std::vector<int> seen(static_cast<std::size_t>(si.total), 0);
  for (int r = 0; r < plan.cp; ++r) {
    const RankShard& rs = plan.ranks[r];
    std::int64_t local = 0, prev_end = -1;
    for (const Piece& p : rs.pieces) {
      check(p.segment >= 0 && static_cast<std::size_t>(p.segment) < si.len.size(), "segment index");
      check(p.doc == mb.segments[p.segment].doc, "piece doc");
      check(p.seg_begin == si.begin[p.segment] && p.seg_len == si.len[p.segment], "piece segment");
      check(p.q_len > 0 && p.q_offset >= 0 && p.q_offset + p.q_len <= p.seg_len, "piece range");
      check(p.local_begin == local, "local buffer order");
      check(p.packedBegin() >= prev_end, "ascending packed order");
      check(p.kv_len == p.q_offset + p.q_len, "key range is the segment prefix");
      check(p.kv_begin >= 0 && p.kv_begin + p.kv_len <= rs.kv_tokens, "kv range in buffer");
      for (std::int64_t t = 0; t < p.q_len; ++t) {
        const std::int64_t pos = p.packedBegin() + t;
        ++seen[pos];
        check(plan.owner[pos] == r && plan.local_index[pos] == local + t, "owner/local_index");
      }
      local += p.q_len;
      prev_end = p.packedEnd();
    }
    check(local == rs.tokens, "rank token count");
    // KV runs tile the buffer; every slot holds the packed token the blocks say.
    std::int64_t kv = 0;
    for (const KvRun& run : rs.kv_runs) {
      check(run.kv_begin == kv && run.len > 0, "kv runs tile the buffer");
      check(run.src >= 0 && run.src < plan.cp, "run source");
      kv += run.len;
    }
    check(kv == rs.kv_tokens, "kv runs cover kv_tokens");
    const std::vector<std::int64_t> kvpos = kvPackedPositions(plan, r);
    for (const KvRun& run : rs.kv_runs)
      for (std::int64_t i = 0; i < run.len; ++i) {
        const std::int64_t pos = kvpos[run.kv_begin + i];
        check(plan.owner[pos] == run.src && plan.local_index[pos] == run.src_local_begin + i,
              "kv run source matches owner map");
      }
    for (const Piece& p : rs.pieces)
      for (std::int64_t i = 0; i < p.kv_len; ++i)
        check(kvpos[p.kv_begin + i] == p.seg_begin + i, "piece keys are the segment prefix");
  }
  for (std::int64_t t = 0; t < si.total; ++t) check(seen[t] == 1, "every token exactly once");
}

std::vector<std::int64_t> packedPositions(const ShardPlan& plan, int rank) {
  const RankShard& rs = plan.ranks.at(rank);
  std::vector<std::int64_t> out(static_cast<std::size_t>(rs.tokens));
  for (const Piece& p : rs.pieces)
    for (std::int64_t t = 0; t < p.q_len; ++t) out[p.local_begin + t] = p.packedBegin() + t;
  return out;
}

std::vector<std::int64_t> kvPackedPositions(const ShardPlan& plan, int rank) {
  const RankShard& rs = plan.ranks.at(rank);
  std::vector<std::int64_t> out(static_cast<std::size_t>(rs.kv_tokens));
  for (const KvBlock& b : rs.kv_blocks)
    for (std::int64_t i = 0; i < b.len; ++i) out[b.kv_begin + i] = b.seg_begin + i;
  return out;
}

std::vector<std::int64_t> allGatherKvIndex(const ShardPlan& plan, const CommPlan& comm, int rank) {
  const RankShard& rs = plan.ranks.at(rank);
  std::vector<std::int64_t> out(static_cast<std::size_t>(rs.kv_tokens));
  for (const KvRun& run : rs.kv_runs)
    for (std::int64_t i = 0; i < run.len; ++i)
      out[run.kv_begin + i] = comm.gather_displs[run.src] + run.src_local_begin + i;
  return out;
}

std::vector<MicroBatchShards> planReplicaShards(const std::vector<MicroBatch>& replica, Strategy strategy,
                                                CommMode mode, int cp, const model::CostModel& cost,
                                                const CpConfig& cfg) {
  std::vector<MicroBatchShards> out(replica.size());
  for (std::size_t m = 0; m < replica.size(); ++m) {
    if (replica[m].tokens() == 0) continue;
    out[m].shard = planShards(replica[m], strategy, cp, cost, cfg);
    out[m].comm = planComm(out[m].shard, mode, cost);
    out[m].empty = false;
  }
  return out;
}

std::vector<MicroBatchShards> planReplicaShards(const std::vector<MicroBatch>& replica, const std::string& strategy,
                                                int cp, const model::CostModel& cost, const CpConfig& cfg) {
  return planReplicaShards(replica, parseStrategy(strategy), parseCommMode(cfg.comm), cp, cost, cfg);
}

}  // namespace wlb::cp
