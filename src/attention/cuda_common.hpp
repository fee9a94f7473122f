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
#include <array>
#include <cstdint>
#include <exception>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "attention/attention.hpp"
#include "attention/bf16.hpp"
#include "attention/cuda_args.hpp"
#include "attention/cuda_ptx.hpp"
#include "attention/split_kv.hpp"

namespace wlb::attention::cuda {

/// Device memory that a call's bookkeeping reuses from call to call: the piece ranges, the
/// work lists, split-KV's plan and partial outputs, rowsum(dO∘O). Allocated per call, they
/// cost a cudaMalloc and a cudaFree each (the free synchronises the device; the partial
/// outputs are tens of MB), against kernels of 10 µs to 1 ms on CP pieces. A slot grows and
/// never shrinks; Kokkos' finalize hook gives the memory back. A call holds the lease for
/// as long as it uses the slots and fences its instance before it returns, so the next call
/// finds them free; calls from other host threads wait for the lease.
class DeviceScratch {
 public:
  enum Slot : int { kRanges, kWork, kSplit, kGroups, kOPart, kLsePart, kDelta, kSlots };
  [[nodiscard]] static std::unique_lock<std::mutex> lease() { return std::unique_lock<std::mutex>(instance().mutex_); }
  /// At least `n` elements of T in `slot`, contents undefined (the caller holds the lease).
  template <class T>
  static T* get(Slot slot, std::size_t n) {
    Buf& b = instance().bufs_[slot];
    const std::size_t bytes = std::max<std::size_t>(n, 1) * sizeof(T);
    if (b.extent(0) < bytes) {
      b = Buf();  // give the old block back first: the new one may reuse its memory
      b = Buf(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("wlb::attention::cuda::scratch")),
              bytes + bytes / 4);  // headroom: the next batch is rarely the same size
    }
    return reinterpret_cast<T*>(b.data());
  }

 private:
  using Buf = Kokkos::View<unsigned char*, Kokkos::CudaSpace>;
  static DeviceScratch& instance() {
    // never destroyed: device memory must go before Kokkos::finalize, not at exit
    static DeviceScratch* const s = [] {
      auto* p = new DeviceScratch;
      Kokkos::push_finalize_hook([p] {
        const std::lock_guard<std::mutex> g(p->mutex_);
        for (Buf& b : p->bufs_) b = Buf();
      });
      return p;
    }();
    return *s;
  }
  std::mutex mutex_;
  std::array<Buf, kSlots> bufs_;
};

/// Fences its instance when it goes out of scope: a call's last kernels and copies are done
/// before its lease on the scratch ends, on every return path. The one fence of a CUDA
/// attention call: the launchers below it queue their kernels and return. (A fence with nothing queued
/// costs a few microseconds; the cudaFree calls it replaces synchronised the whole device.)
/// A fence that fails on a normal return throws (an error the caller can report, not
/// std::terminate); while another exception unwinds the call, its error is dropped.
struct FenceOnExit {
  const Kokkos::Cuda& space;
  const char* label;
  int unwinding = std::uncaught_exceptions();
  FenceOnExit(const Kokkos::Cuda& s, const char* l) : space(s), label(l) {}
  FenceOnExit(const FenceOnExit&) = delete;
  FenceOnExit& operator=(const FenceOnExit&) = delete;
  ~FenceOnExit() noexcept(false) {
    try {
      space.fence(label);
    } catch (...) {
      if (std::uncaught_exceptions() == unwinding) throw;  // else the exception in flight is the one to report
    }
  }
};

/// Views over DeviceScratch slots (unmanaged: the slot owns the memory).
using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
using WorkView = Kokkos::View<int* [2], Kokkos::LayoutRight, Kokkos::CudaSpace, Unmanaged>;
using RangeView = Kokkos::View<int* [4], Kokkos::LayoutRight, Kokkos::CudaSpace, Unmanaged>;

/// `n` rows of C ints from the host into `slot`, ordered on `space` (a pageable source is
/// staged before the copy returns, so `host` may go right after).
template <int C>
Kokkos::View<int* [C], Kokkos::LayoutRight, Kokkos::CudaSpace, Unmanaged> uploadInts(const Kokkos::Cuda& space,
                                                                                     DeviceScratch::Slot slot,
                                                                                     const std::vector<int>& host) {
  const std::size_t n = host.size() / C;
  Kokkos::View<int* [C], Kokkos::LayoutRight, Kokkos::CudaSpace, Unmanaged> d(
      DeviceScratch::get<int>(slot, host.size()), n);
  if (n > 0)
    Kokkos::deep_copy(space, d,
                      Kokkos::View<const int* [C], Kokkos::LayoutRight, Kokkos::HostSpace, Unmanaged>(host.data(), n));
  return d;
}

inline RangeView ranges(const Kokkos::Cuda& space, const VarlenBatch& b) {
  std::vector<int> h;
  h.reserve(4 * b.pieces.size());
  for (const PieceRange& p : b.pieces)
    for (std::int64_t x : {p.q_begin, p.q_end, p.k_begin, p.k_end}) h.push_back(static_cast<int>(x));
  return uploadInts<4>(space, DeviceScratch::kRanges, h);
}

namespace detail {
struct WorkItem {
  int p, t;
  std::int64_t cost;
};
/// Longest first (stable: equal costs keep piece order, so heads of one piece stay close),
/// then to the device.
inline WorkView uploadWork(const Kokkos::Cuda& space, std::vector<WorkItem> items) {
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& c) { return a.cost > c.cost; });
  std::vector<int> h;
  h.reserve(2 * items.size());
  for (const WorkItem& it : items) h.insert(h.end(), {it.p, it.t});
  return uploadInts<2>(space, DeviceScratch::kWork, h);
}
}  // namespace detail

/// Query tiles of `bq` rows; cost = key tiles of `bk` the tile visits. Longest first, so the
/// long diagonal tiles start early and the short ones fill the tail (no idle SMs at the end).
inline WorkView queryWork(const Kokkos::Cuda& space, const VarlenBatch& b, int bq, int bk) {
  std::vector<detail::WorkItem> items;
  for (std::size_t p = 0; p < b.pieces.size(); ++p)
    for (std::int64_t t = 0; t * bq < b.pieces[p].nq(); ++t)
      items.push_back({static_cast<int>(p), static_cast<int>(t), split_kv::visibleTiles(b.pieces[p], t, bq, bk)});
  return detail::uploadWork(space, std::move(items));
}

/// A split-KV plan (split_kv.hpp) on the device: the work list and its key-tile ranges and
/// slots, the combine groups, and the partial outputs (`per_slot` floats of O and
/// `lse_per_slot` of LSE per slot), all in DeviceScratch slots.
struct SplitWork {
  WorkView work;
  Kokkos::View<int* [3], Kokkos::LayoutRight, Kokkos::CudaSpace, Unmanaged> split;
  Kokkos::View<int* [4], Kokkos::LayoutRight, Kokkos::CudaSpace, Unmanaged> groups;
  float* o_part = nullptr;
  float* lse_part = nullptr;
  SplitWork(const Kokkos::Cuda& space, const split_kv::Plan& plan, std::int64_t per_slot, std::int64_t lse_per_slot) {
    std::vector<int> hw, hs, hg;
    for (const split_kv::Item& it : plan.items) {
      hw.insert(hw.end(), {it.piece, it.tile});
      hs.insert(hs.end(), {it.first, it.end, it.slot});
    }
    for (const split_kv::Group& g : plan.groups) hg.insert(hg.end(), {g.piece, g.tile, g.slot0, g.parts});
    work = uploadInts<2>(space, DeviceScratch::kWork, hw);
    split = uploadInts<3>(space, DeviceScratch::kSplit, hs);
    groups = uploadInts<4>(space, DeviceScratch::kGroups, hg);
    o_part = DeviceScratch::get<float>(DeviceScratch::kOPart, static_cast<std::size_t>(plan.slots * per_slot));
    lse_part = DeviceScratch::get<float>(DeviceScratch::kLsePart, static_cast<std::size_t>(plan.slots * lse_per_slot));
  }
};

/// Key tiles of `bk` keys (pieces with queries only); cost = query rows that see the tile.
inline WorkView keyWork(const Kokkos::Cuda& space, const VarlenBatch& b, int bk) {
  std::vector<detail::WorkItem> items;
  for (std::size_t p = 0; p < b.pieces.size(); ++p) {
    const std::int64_t nq = b.pieces[p].nq(), nk = b.pieces[p].nk(), off = nk - nq;
    if (nq == 0) continue;
    for (std::int64_t t = 0; t * bk < nk; ++t) {
      const std::int64_t first = std::max<std::int64_t>(0, t * bk - off);
      items.push_back({static_cast<int>(p), static_cast<int>(t), nq - first});
    }
  }
  return detail::uploadWork(space, std::move(items));
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
