/// \file split_kv.cpp
/// \brief The split-KV work plan and the reference combine (see split_kv.hpp).

#include "attention/split_kv.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace wlb::attention::split_kv {

std::int64_t visibleTiles(const PieceRange& p, std::int64_t tile, int bq, int bk) {
  const std::int64_t nq = p.nq(), nk = p.nk(), off = nk - nq;
  const std::int64_t lim = std::min(nk, off + std::min(nq, (tile + 1) * bq));  // keys seen by the last row, +1
  return (lim + bk - 1) / bk;
}

Plan plan(const std::vector<PieceRange>& pieces, int bq, int bk, const Rule& rule) {
  if (bq <= 0 || bk <= 0) throw std::invalid_argument("split_kv::plan: tile sizes must be positive");
  Plan out;
  for (std::size_t pi = 0; pi < pieces.size(); ++pi) {
    const PieceRange& p = pieces[pi];
    const std::int64_t nq = p.nq(), nk = p.nk(), off = nk - nq;
    const bool eligible = nq > 0 && nq <= rule.max_queries && nk >= rule.min_keys;
    for (std::int64_t t = 0; t * bq < nq; ++t) {
      const std::int64_t tiles = visibleTiles(p, t, bq, bk);
      // a part may start at any tile whose first key the tile's first row sees
      const std::int64_t starts = (t * bq + off) / bk + 1;
      // part boundaries: evenly spaced, dropped where a part could not start
      std::vector<std::int64_t> cuts{0};
      if (eligible) {
        const std::int64_t want = tiles / std::max(1, rule.min_tiles);
        const auto parts = std::clamp<std::int64_t>(want, 1, std::max(1, rule.max_parts));
        for (std::int64_t s = 1; s < parts; ++s) {
          const std::int64_t c = tiles * s / parts;
          if (c > cuts.back() && c < starts) cuts.push_back(c);
        }
      }
      cuts.push_back(tiles);
      Group g{static_cast<int>(pi), static_cast<int>(t), out.slots, static_cast<int>(cuts.size()) - 1};
      if (g.parts == 1) {
        out.items.push_back({static_cast<int>(pi), static_cast<int>(t), 0, static_cast<int>(tiles), -1, tiles});
        continue;
      }
      for (int s = 0; s < g.parts; ++s)
        out.items.push_back({static_cast<int>(pi), static_cast<int>(t), static_cast<int>(cuts[s]),
                             static_cast<int>(cuts[s + 1]), g.slot0 + s, cuts[s + 1] - cuts[s]});
      out.slots += g.parts;
      out.groups.push_back(g);
    }
  }
  std::stable_sort(out.items.begin(), out.items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return out;
}

void combine(const float* lse_parts, const float* o_parts, int parts, int d, float* o, float* lse) {
  float mx = -INFINITY;
  for (int s = 0; s < parts; ++s) mx = std::max(mx, lse_parts[s]);
  double sum = 0.0;
  for (int s = 0; s < parts; ++s) sum += std::exp(static_cast<double>(lse_parts[s]) - mx);
  const double l = mx + std::log(sum);
  for (int i = 0; i < d; ++i) o[i] = 0.0f;
  for (int s = 0; s < parts; ++s) {
    const double w = std::exp(static_cast<double>(lse_parts[s]) - l);
    for (int i = 0; i < d; ++i) o[i] += static_cast<float>(w * o_parts[static_cast<std::int64_t>(s) * d + i]);
  }
  *lse = static_cast<float>(l);
}

}  // namespace wlb::attention::split_kv
