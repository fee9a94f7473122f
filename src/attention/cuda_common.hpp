#pragma once
/// \file cuda_common.hpp
/// \brief Internal: what the CUDA attention kernels share — the raw argument block, the
/// longest-first work lists, the rowsum(dO∘O) pre-pass and the PTX helpers. Included only
/// under KOKKOS_ENABLE_CUDA (from attention_impl.hpp).
///
/// Every kernel is a Kokkos TeamPolicy launch on the caller's Cuda instance. Team scratch
/// level 0 (shared memory) is capped by Kokkos 4.x at sharedMemPerBlock (48 KiB), which
/// sets the tile sizes: K/V tiles are staged in scratch, Q and the accumulators live in
/// registers.

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "attention/attention.hpp"
#include "attention/bf16.hpp"
#include "attention/cuda_args.hpp"
#include "attention/cuda_ptx.hpp"
#include "attention/split_kv.hpp"

namespace wlb::attention::cuda {

using WorkView = Kokkos::View<int* [2], Kokkos::LayoutRight, Kokkos::CudaSpace>;
using RangeView = Kokkos::View<int* [4], Kokkos::LayoutRight, Kokkos::CudaSpace>;

inline RangeView ranges(const VarlenBatch& b) {
  RangeView r("wlb::attention::cuda::ranges", b.pieces.size());
  auto h = Kokkos::create_mirror_view(r);
  for (std::size_t i = 0; i < b.pieces.size(); ++i) {
    h(i, 0) = static_cast<int>(b.pieces[i].q_begin);
    h(i, 1) = static_cast<int>(b.pieces[i].q_end);
    h(i, 2) = static_cast<int>(b.pieces[i].k_begin);
    h(i, 3) = static_cast<int>(b.pieces[i].k_end);
  }
  Kokkos::deep_copy(r, h);
  return r;
}

namespace detail {
struct WorkItem {
  int p, t;
  std::int64_t cost;
};
/// Longest first (stable: equal costs keep piece order, so heads of one piece stay close),
/// then to the device.
inline WorkView uploadWork(std::vector<WorkItem> items, const char* label) {
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& c) { return a.cost > c.cost; });
  WorkView w(std::string(label), items.size());
  auto h = Kokkos::create_mirror_view(w);
  for (std::size_t i = 0; i < items.size(); ++i) {
    h(i, 0) = items[i].p;
    h(i, 1) = items[i].t;
  }
  Kokkos::deep_copy(w, h);
  return w;
}
}  // namespace detail

/// Query tiles of `bq` rows; cost = key tiles of `bk` the tile visits. Longest first, so the
/// long diagonal tiles start early and the short ones fill the tail (no idle SMs at the end).
inline WorkView queryWork(const VarlenBatch& b, int bq, int bk) {
  std::vector<detail::WorkItem> items;
  for (std::size_t p = 0; p < b.pieces.size(); ++p)
    for (std::int64_t t = 0; t * bq < b.pieces[p].nq(); ++t)
      items.push_back({static_cast<int>(p), static_cast<int>(t), split_kv::visibleTiles(b.pieces[p], t, bq, bk)});
  return detail::uploadWork(std::move(items), "wlb::attention::cuda::qwork");
}

/// A split-KV plan (split_kv.hpp) on the device: the work list and its key-tile ranges and
/// slots, the combine groups, and the partial outputs (`per_slot` floats of O and
/// `lse_per_slot` of LSE per slot).
struct SplitWork {
  WorkView work;
  Kokkos::View<int* [3], Kokkos::LayoutRight, Kokkos::CudaSpace> split;
  Kokkos::View<int* [4], Kokkos::LayoutRight, Kokkos::CudaSpace> groups;
  Kokkos::View<float*, Kokkos::CudaSpace> o_part, lse_part;
  SplitWork(const split_kv::Plan& plan, std::int64_t per_slot, std::int64_t lse_per_slot)
      : work("wlb::attention::cuda::split_work", plan.items.size()),
        split("wlb::attention::cuda::split_ranges", plan.items.size()),
        groups("wlb::attention::cuda::split_groups", plan.groups.size()),
        o_part(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("wlb::attention::cuda::o_part")),
               plan.slots * per_slot),
        lse_part(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("wlb::attention::cuda::lse_part")),
                 plan.slots * lse_per_slot) {
    auto hw = Kokkos::create_mirror_view(work);
    auto hs = Kokkos::create_mirror_view(split);
    auto hg = Kokkos::create_mirror_view(groups);
    for (std::size_t i = 0; i < plan.items.size(); ++i) {
      const split_kv::Item& it = plan.items[i];
      hw(i, 0) = it.piece;
      hw(i, 1) = it.tile;
      hs(i, 0) = it.first;
      hs(i, 1) = it.end;
      hs(i, 2) = it.slot;
    }
    for (std::size_t i = 0; i < plan.groups.size(); ++i) {
      hg(i, 0) = plan.groups[i].piece;
      hg(i, 1) = plan.groups[i].tile;
      hg(i, 2) = plan.groups[i].slot0;
      hg(i, 3) = plan.groups[i].parts;
    }
    Kokkos::deep_copy(work, hw);
    Kokkos::deep_copy(split, hs);
    Kokkos::deep_copy(groups, hg);
  }
};

/// Key tiles of `bk` keys (pieces with queries only); cost = query rows that see the tile.
inline WorkView keyWork(const VarlenBatch& b, int bk) {
  std::vector<detail::WorkItem> items;
  for (std::size_t p = 0; p < b.pieces.size(); ++p) {
    const std::int64_t nq = b.pieces[p].nq(), nk = b.pieces[p].nk(), off = nk - nq;
    if (nq == 0) continue;
    for (std::int64_t t = 0; t * bk < nk; ++t) {
      const std::int64_t first = std::max<std::int64_t>(0, t * bk - off);
      items.push_back({static_cast<int>(p), static_cast<int>(t), nq - first});
    }
  }
  return detail::uploadWork(std::move(items), "wlb::attention::cuda::kwork");
}

/// delta[t][h] = sum_d dO(t,h,d) * O(t,h,d) for every query row of every piece: one warp
/// per (row, head) would waste lanes at D = 64, so 8 lanes per row.
template <class T>
void computeDelta(const Kokkos::Cuda& space, const Args& a, std::int64_t q_tokens, float* delta) {
  const T* O = static_cast<const T*>(a.o);
  const T* dO = static_cast<const T*>(a.dO);
  const int H = a.heads, D = a.head_dim;
  const std::int64_t os0 = a.o_s0, ds0 = a.dO_s0;
  // rows not covered by a piece are never read; computing all rows is simpler and cheap
  Kokkos::parallel_for(
      "wlb::attention::cuda::bwd::delta",
      Kokkos::TeamPolicy<Kokkos::Cuda>(space, static_cast<int>((q_tokens * H + 15) / 16), 16, 8),
      KOKKOS_LAMBDA(const Kokkos::TeamPolicy<Kokkos::Cuda>::member_type& team) {
        const std::int64_t row = static_cast<std::int64_t>(team.league_rank()) * 16 + team.team_rank();
        if (row >= q_tokens * H) return;
        const std::int64_t t = row / H;
        const int h = static_cast<int>(row % H);
        float s = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, D),
            [&](const int d, float& acc) { acc += toFloat(dO[t * ds0 + h * D + d]) * toFloat(O[t * os0 + h * D + d]); },
            s);
        Kokkos::single(Kokkos::PerThread(team), [&]() { delta[row] = s; });
      });
}

}  // namespace wlb::attention::cuda
