/// \file slice_shards.cpp
/// \brief The CP layout of SlimPack slices (see slice_shards.hpp).

#include "pp/slice_shards.hpp"

#include <algorithm>
#include <stdexcept>

#include "core/error.hpp"
#include "model/cost_model.hpp"

namespace wlb::pp {

SliceShards sliceShards(const ReplicaSlices& r, const std::string& strategy, int cp, const model::CostModel& cost,
                        const CpConfig& cfg) {
  if (cp < 1) throw InputError("CP degree must be >= 1 (got " + std::to_string(cp) + ")");
  SliceShards out;
  out.cp = cp;
  const std::size_t n = r.segments.size();
  out.parts.resize(n);
  out.rows.assign(static_cast<std::size_t>(cp), std::vector<std::int64_t>(n, 0));
  if (cp == 1) {
    out.strategy = "whole";
    for (std::size_t i = 0; i < n; ++i)
      if (r.segments[i].length > 0) {
        out.parts[i].push_back({0, 0, r.segments[i].length});
        out.rows[0][i] = r.segments[i].length;
      }
    return out;
  }
  (void)cp::parseStrategy(strategy);
  out.strategy = strategy;
  for (int k = 0; k < r.microPacks(); ++k) {
    const auto s0 = r.fwd_cuts[static_cast<std::size_t>(k)], s1 = r.fwd_cuts[static_cast<std::size_t>(k) + 1];
    MicroBatch mb;
    for (auto i = s0; i < s1; ++i) mb.segments.push_back(r.segments[static_cast<std::size_t>(i)]);
    if (mb.tokens() == 0) continue;
    const cp::ShardPlan plan = cp::planShards(mb, strategy, cp, cost, cfg);
    for (int rank = 0; rank < cp; ++rank)
      for (const cp::Piece& p : plan.ranks[static_cast<std::size_t>(rank)].pieces) {
        const auto i = static_cast<std::size_t>(s0 + p.segment);
        out.parts[i].push_back({rank, p.q_offset, p.q_len});
        out.rows[static_cast<std::size_t>(rank)][i] += p.q_len;
      }
  }
  for (auto& v : out.parts)  // by rank, then offset (the planners' local order)
    std::stable_sort(v.begin(), v.end(), [](const SliceShards::Part& a, const SliceShards::Part& b) {
      return a.rank != b.rank ? a.rank < b.rank : a.q_offset < b.q_offset;
    });
  return out;
}

std::int64_t SliceShards::unitRows(const std::vector<std::int64_t>& cuts, int k, int rank) const {
  std::int64_t t = 0;
  for (auto i = cuts[static_cast<std::size_t>(k)]; i < cuts[static_cast<std::size_t>(k) + 1]; ++i)
    t += rows[static_cast<std::size_t>(rank)][static_cast<std::size_t>(i)];
  return t;
}

std::vector<std::int64_t> unitOffsets(const std::vector<std::int64_t>& cuts,
                                      const std::vector<std::int64_t>& seg_rows) {
  std::vector<std::int64_t> first(seg_rows.size(), 0);
  for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
    std::int64_t row = 0;
    for (auto i = cuts[k]; i < cuts[k + 1]; ++i) {
      first[static_cast<std::size_t>(i)] = row;
      row += seg_rows[static_cast<std::size_t>(i)];
    }
  }
  return first;
}

std::vector<std::int64_t> SliceShards::gatherIndex(const std::vector<std::int64_t>& cuts, int k,
                                                   std::vector<std::int64_t>* counts,
                                                   std::vector<std::int64_t>* displs) const {
  const auto s0 = cuts[static_cast<std::size_t>(k)], s1 = cuts[static_cast<std::size_t>(k) + 1];
  std::vector<std::int64_t> displ(static_cast<std::size_t>(cp), 0), cnt(static_cast<std::size_t>(cp), 0);
  for (int r = 0; r < cp; ++r) cnt[static_cast<std::size_t>(r)] = unitRows(cuts, k, r);
  for (int r = 1; r < cp; ++r)
    displ[static_cast<std::size_t>(r)] = displ[static_cast<std::size_t>(r) - 1] + cnt[static_cast<std::size_t>(r) - 1];
  std::vector<std::int64_t> at = displ;  // next gathered row of each rank
  std::vector<std::int64_t> idx;
  for (auto i = s0; i < s1; ++i) {
    const auto& ps = parts[static_cast<std::size_t>(i)];
    // Rank r's rows of segment i are its parts in offset order: [at[r], at[r] + rows).
    std::vector<std::pair<std::int64_t, std::int64_t>> span;  // (q_offset, gathered row) per part
    for (const Part& p : ps) {
      span.push_back({p.q_offset, at[static_cast<std::size_t>(p.rank)]});
      at[static_cast<std::size_t>(p.rank)] += p.q_len;
    }
    std::vector<std::size_t> order(ps.size());
    for (std::size_t j = 0; j < order.size(); ++j) order[j] = j;
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return ps[a].q_offset < ps[b].q_offset; });
    std::int64_t next = 0;
    for (const std::size_t j : order) {
      if (ps[j].q_offset != next) throw std::logic_error("SliceShards: segment " + std::to_string(i) + " not tiled");
      for (std::int64_t t = 0; t < ps[j].q_len; ++t) idx.push_back(span[j].second + t);
      next += ps[j].q_len;
    }
  }
  if (counts) *counts = cnt;
  if (displs) *displs = displ;
  return idx;
}

}  // namespace wlb::pp
