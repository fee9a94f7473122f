#pragma once
/// \file split_kv.hpp
/// \brief Split-KV for the Hopper forward: a piece with few queries over a long key prefix
/// (what per-document CP and SlimPack slices make) gives the forward only a few query
/// tiles, so a few blocks per head walk the whole prefix while most SMs idle. Its key
/// tiles are cut into parts that run as separate work items; each writes its normalised
/// partial output and log-sum-exp, and a combine pass merges the parts by their LSE:
///   lse = log sum_s exp(lse_s),   o = sum_s exp(lse_s - lse) o_s.
/// Plain C++ (no Kokkos, no CUDA): the plan and the reference combine are tested on any
/// machine; cuda_hopper.cu runs them on the GPU.
///
/// Contract of a plan for tiles of `bq` queries and `bk` keys:
/// * every (piece, query tile) appears once as a whole item (`slot` < 0: keys from tile 0 to
///   its last visible tile, written straight to O) or as `parts` items with consecutive
///   slots covering those key tiles exactly once, in order;
/// * a part starts at a key tile whose first key every row of the query tile sees
///   (first * bk <= q0 + nk - nq), so no row of a part is masked out entirely;
/// * items are ordered longest first (cost = key tiles), as the unsplit work list is.

#include <cstdint>
#include <vector>

#include "attention/attention.hpp"

namespace wlb::attention::split_kv {

/// Which pieces are split and how finely.
struct Rule {
  std::int64_t max_queries = 256;  ///< pieces with at most this many queries...
  std::int64_t min_keys = 16384;   ///< ...and at least this many keys
  int min_tiles = 8;               ///< key tiles per part, at least
  int max_parts = 16;              ///< parts per query tile, at most
};

struct Item {
  int piece = 0, tile = 0;  ///< piece, query tile
  int first = 0, end = 0;   ///< key tiles [first, end)
  int slot = -1;            ///< partial-output slot; -1: the whole row range, written to O
  std::int64_t cost = 0;    ///< key tiles
};

/// The parts of one split (piece, query tile): slots [slot0, slot0 + parts).
struct Group {
  int piece = 0, tile = 0, slot0 = 0, parts = 0;
};

struct Plan {
  std::vector<Item> items;
  std::vector<Group> groups;
  int slots = 0;  ///< partial outputs to hold: slots x bq rows x heads x head_dim floats
};

/// Key tiles a query tile visits: up to the last key its last valid row sees (also the cost
/// of the unsplit work lists' query tiles, cuda_common.hpp).
std::int64_t visibleTiles(const PieceRange& p, std::int64_t tile, int bq, int bk);

/// The work list of a forward over `pieces` (see the contract above).
Plan plan(const std::vector<PieceRange>& pieces, int bq, int bk, const Rule& rule = {});

/// Reference combine of one (row, head): `parts` normalised outputs o_s ([parts][d]) and
/// their natural-log LSEs into o ([d]) and lse. What the GPU combine pass computes.
void combine(const float* lse_parts, const float* o_parts, int parts, int d, float* o, float* lse);

}  // namespace wlb::attention::split_kv
