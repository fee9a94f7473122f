#pragma once
/// \file row_moves.hpp
/// \brief The device kernels that move token rows between a rank's buffers and the wire:
/// what the CP attention's KV exchange (distributed_attention.cpp) and the sliced stage's KV
/// gather (runtime/sliced.cpp) run over the row maps their plans compute
/// (cp/shard_plan.hpp, pp/slice_shards.hpp). Rows are `width` elements, LayoutRight.

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace wlb::runtime::rows {

using Space = Kokkos::DefaultExecutionSpace;
using Mem = Space::memory_space;
using IdxView = Kokkos::View<const std::int64_t*, Mem>;

/// A row map in device memory.
inline IdxView upload(const std::vector<std::int64_t>& v, const char* label = "wlb::runtime::row_map") {
  Kokkos::View<std::int64_t*, Mem> d(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), v.size());
  Kokkos::deep_copy(d, Kokkos::View<const std::int64_t*, Kokkos::HostSpace>(v.data(), v.size()));
  return d;
}

/// d = s, or d += s with `add`; BF16 elements are only moved (sums are FP32: gradients).
template <class E>
KOKKOS_INLINE_FUNCTION void moveElement(E& d, const E& s, bool add) {
  if constexpr (std::is_same_v<E, float>) {
    if (add)
      d += s;
    else
      d = s;
  } else {
    (void)add;
    d = s;
  }
}

/// Device spaces: a work item per element, so a warp's accesses coalesce along a row. (The
/// constexpr-if lives in moveElement: nvcc's extended lambdas may not first capture a
/// variable inside one.)
template <class E>
void moveRowsByElement(const Space& space, E* dst, const IdxView& dmap, const E* src, const IdxView& smap,
                       std::int64_t n, std::int64_t width, bool add) {
  const bool hd = dmap.extent(0) > 0, hs = smap.extent(0) > 0;
  Kokkos::parallel_for(
      "wlb::runtime::move_rows", Kokkos::RangePolicy<Space>(space, 0, n * width), KOKKOS_LAMBDA(const std::int64_t e) {
        const std::int64_t i = e / width, c = e % width;
        const std::int64_t d = (hd ? dmap(i) : i) * width + c, s = (hs ? smap(i) : i) * width + c;
        moveElement(dst[d], src[s], add);
      });
}

/// Host spaces: a work item per row, copied or added along it (no division per element, and
/// the inner loop vectorises).
template <class E>
void moveRowsByRow(const Space& space, E* dst, const IdxView& dmap, const E* src, const IdxView& smap, std::int64_t n,
                   std::int64_t width, bool add) {
  const bool hd = dmap.extent(0) > 0, hs = smap.extent(0) > 0;
  Kokkos::parallel_for("wlb::runtime::move_rows", Kokkos::RangePolicy<Space>(space, 0, n), [=](const std::int64_t i) {
    E* d = dst + (hd ? dmap(i) : i) * width;
    const E* s = src + (hs ? smap(i) : i) * width;
    if constexpr (std::is_same_v<E, float>) {
      if (add) {
        for (std::int64_t c = 0; c < width; ++c) d[c] += s[c];
        return;
      }
    }
    std::copy(s, s + width, d);
  });
}

/// dst row dmap[i] (or i) = / += src row smap[i] (or i), for i < n; an empty map is the
/// identity.
template <class E>
void moveRows(const Space& space, E* dst, const IdxView& dmap, const E* src, const IdxView& smap, std::int64_t n,
              std::int64_t width, bool add) {
  if (n == 0 || width == 0) return;
  if constexpr (Kokkos::SpaceAccessibility<Space, Kokkos::HostSpace>::accessible)
    moveRowsByRow(space, dst, dmap, src, smap, n, width, add);
  else
    moveRowsByElement(space, dst, dmap, src, smap, n, width, add);
}

// GroupComm moves floats: BF16 rows travel as pairs in 32-bit words (bit-exact; the row
// width must be even).
template <class E>
float* words(E* p) {
  return reinterpret_cast<float*>(p);
}
template <class E>
const float* words(const E* p) {
  return reinterpret_cast<const float*>(p);
}
template <class E>
std::int64_t wordCount(std::int64_t elements) {
  return elements * static_cast<std::int64_t>(sizeof(E)) / 4;
}

/// Every entry of `v` times `f` (row counts to element or word counts).
inline std::vector<std::int64_t> scaled(const std::vector<std::int64_t>& v, std::int64_t f) {
  std::vector<std::int64_t> out(v);
  for (auto& x : out) x *= f;
  return out;
}

}  // namespace wlb::runtime::rows
