/// \file pool.cpp
/// \brief The caching activation pool (see pool.hpp).

#include "runtime/pool.hpp"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/error.hpp"

namespace wlb::runtime {
namespace {

std::string gib(std::int64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return b;
}

template <class V>
V allocate(const char* label, std::int64_t rows, std::int64_t e1, std::int64_t e2) {
  const auto a = Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label));
  if constexpr (V::rank == 1)
    return V(a, rows);
  else if constexpr (V::rank == 2)
    return V(a, rows, e1);
  else
    return V(a, rows, e1, e2);
}

template <class V>
std::int64_t viewBytes(std::int64_t rows, std::int64_t e1, std::int64_t e2) {
  std::int64_t n = rows;
  if constexpr (V::rank >= 2) n *= e1;
  if constexpr (V::rank >= 3) n *= e2;
  return n * static_cast<std::int64_t>(sizeof(typename V::value_type));
}

/// What a piece's record holds: its segment, so that a view outliving the pool (or a
/// segment the pool gave back) still has its memory. Runs on the host when the piece's
/// last view dies.
template <class B>
struct HoldSegment {
  B segment;
  void destroy_shared_allocation() { segment = B(); }
};

/// A V of [rows][e1][e2] at `p` whose views share the record behind `tag`. Built from an
/// unmanaged view's mapping and the tag: the legacy View (Kokkos 3.4 to 4.6, or later ones
/// built with Kokkos_ENABLE_IMPL_VIEW_LEGACY) takes a tracker and a mapping, the mdspan
/// View (the default from 4.7) a reference-counted data handle and a mapping. Pieces start
/// at multiples of kAlign bytes of a Kokkos allocation, aligned for any element type.
template <class V>
V carve(char* at, const Kokkos::Impl::SharedAllocationTracker& tag, std::int64_t rows, std::int64_t e1,
        std::int64_t e2) {
  using T = typename V::value_type;
  using U = Kokkos::View<typename V::data_type, typename V::array_layout, typename V::memory_space,
                         Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  T* p = reinterpret_cast<T*>(at);
  U u;
  if constexpr (V::rank == 1)
    u = U(p, rows);
  else if constexpr (V::rank == 2)
    u = U(p, rows, e1);
  else
    u = U(p, rows, e1, e2);
#if defined(KOKKOS_ENABLE_IMPL_VIEW_LEGACY) || KOKKOS_VERSION < 40699
  return V(tag, u.impl_map());
#else
  return V(typename V::data_handle_type(tag, p), u.mapping());
#endif
}

}  // namespace

std::int64_t BufferPool::bucketRows(std::int64_t rows) {
  if (rows <= 64) return 64;
  std::int64_t p = 1;
  while (p < rows) p <<= 1;
  const std::int64_t g = std::max<std::int64_t>(8, p / 8);
  return (rows + g - 1) / g * g;
}

BufferPool::Bytes BufferPool::allocateSegment(const char* label, std::int64_t bytes) {
  // Out of memory (or past the capacity): give back the free segments used longest ago,
  // one at a time, until the new one fits; with none left to give, the failure is the
  // caller's.
  bool fenced = false;
  const auto giveBack = [&] {
    if (!fenced) Kokkos::fence();  // kernels still reading a free piece's last contents
    fenced = true;
    return releaseOldest();
  };
  // what the pool holds, all of it in use by now
  const auto held = [&] { return gib(cachedBytes()) + " held by the activation pool, all in use"; };
  for (;;) {
    if (capacity_ > 0 && cachedBytes() + bytes > capacity_) {
      if (giveBack()) continue;
      throw OutOfMemory(std::string(label) + " (" + std::to_string(bytes) +
                        " bytes) does not fit the pool's capacity of " + std::to_string(capacity_) + " bytes; " +
                        held());
    }
    try {
      return Bytes(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), bytes);
    } catch (const std::exception& e) {
      if (giveBack()) continue;
      if (!isOutOfMemory(e)) throw;
      throw OutOfMemory(std::string(label) + " (" + gib(bytes) + "): " + oneLine(e) + "; " + held());
    }
  }
}

void BufferPool::collect() {
  for (auto& s : segments_) {
    bool freed = false;
    for (auto& p : s.pieces)
      if (p.tag.use_count() == 1) {
        p.tag = Tag();
        freed = true;
      }
    if (!freed) continue;
    std::vector<Piece> merged;
    merged.reserve(s.pieces.size());
    for (auto& p : s.pieces) {
      if (!merged.empty() && merged.back().free() && p.free()) {
        merged.back().bytes += p.bytes;
        merged.back().used = std::max(merged.back().used, p.used);
      } else {
        merged.push_back(std::move(p));
      }
    }
    s.pieces = std::move(merged);
  }
}

template <class V>
V BufferPool::take(const char* label, std::int64_t rows, std::int64_t e1, std::int64_t e2, bool zero) {
  if (rows == 0) return allocate<V>(label, 0, e1, e2);
  const std::int64_t need = (viewBytes<V>(bucketRows(rows), e1, e2) + kAlign - 1) / kAlign * kAlign;
  const std::int64_t asked = viewBytes<V>(rows, e1, e2);
  collect();
  // Best fit among the free pieces, whatever they held before; the rest of the piece stays
  // free, so short SlimPack slices alive at once share the space a long slice used.
  std::size_t si = 0, pi = 0;
  bool found = false;
  for (std::size_t i = 0; i < segments_.size(); ++i)
    for (std::size_t j = 0; j < segments_[i].pieces.size(); ++j) {
      const Piece& p = segments_[i].pieces[j];
      if (p.free() && p.bytes >= need && (!found || p.bytes < segments_[si].pieces[pi].bytes)) {
        si = i, pi = j;
        found = true;
      }
    }
  ++requests_;
  if (!found) {
    // A wholly free segment too small for the request is replaced, not kept beside the
    // new one: the pool then grows to the largest working set instead of caching one set
    // per shape (a 64K-token window of varied micro-batches would otherwise cache several).
    auto smaller = segments_.end();
    for (auto it = segments_.begin(); it != segments_.end(); ++it)
      if (it->free() && it->bytes() < need &&
          (smaller == segments_.end() || it->bytes() > smaller->bytes() ||
           (it->bytes() == smaller->bytes() && it->used < smaller->used)))
        smaller = it;
    if (smaller != segments_.end()) segments_.erase(smaller);
    Segment s;
    s.mem = allocateSegment(label, need);
    s.pieces.push_back(Piece{0, need, 0, 0, Tag()});
    segments_.push_back(std::move(s));
    si = segments_.size() - 1, pi = 0;
    ++misses_;
  } else {
    ++hits_;
  }
  Segment& s = segments_[si];
  if (s.pieces[pi].bytes > need) {
    Piece rest{s.pieces[pi].offset + need, s.pieces[pi].bytes - need, 0, s.pieces[pi].used, Tag()};
    s.pieces[pi].bytes = need;
    s.pieces.insert(s.pieces.begin() + static_cast<std::ptrdiff_t>(pi) + 1, std::move(rest));
  }
  Piece& p = s.pieces[pi];
  using Record = Kokkos::Impl::SharedAllocationRecord<Kokkos::HostSpace, HoldSegment<Bytes>>;
  Record* record = Record::allocate(Kokkos::HostSpace(), label, 1);
  record->m_destroy.segment = s.mem;
  p.tag.assign_allocated_record_to_uninitialized(record);
  p.used = s.used = requests_;
  p.asked = asked;
  V out = carve<V>(s.mem.data() + p.offset, p.tag, rows, e1, e2);
  notePeaks();
  if (zero) Kokkos::deep_copy(space_, out, typename V::non_const_value_type{});
  return out;
}

void BufferPool::notePeaks() {
  // Frees are implicit (a piece is free when its last view dies), so what is alive is
  // counted at each request; the peak is reached at a request, since only requests add.
  std::int64_t live = 0, asked = 0;
  for (const auto& s : segments_)
    for (const auto& p : s.pieces)
      if (!p.free()) {
        live += p.bytes;
        asked += p.asked;
      }
  peak_live_ = std::max(peak_live_, live);
  peak_requested_ = std::max(peak_requested_, asked);
}

bool BufferPool::releaseOldest() {
  collect();
  auto oldest = segments_.end();
  for (auto it = segments_.begin(); it != segments_.end(); ++it)
    if (it->free() && (oldest == segments_.end() || it->used < oldest->used)) oldest = it;
  if (oldest == segments_.end()) return false;
  segments_.erase(oldest);
  return true;
}

void BufferPool::releaseFree() {
  collect();
  segments_.erase(std::remove_if(segments_.begin(), segments_.end(), [](const Segment& s) { return s.free(); }),
                  segments_.end());
}

Vec BufferPool::vec(const char* label, std::int64_t n, bool zero) {
  return take<Vec>(label, n, 0, 0, zero);
}

Mat BufferPool::mat(const char* label, std::int64_t rows, std::int64_t cols, bool zero) {
  return take<Mat>(label, rows, cols, 0, zero);
}

Act3 BufferPool::act3(const char* label, std::int64_t rows, int heads, int dim, bool zero) {
  return take<Act3>(label, rows, heads, dim, zero);
}

BMat BufferPool::bmat(const char* label, std::int64_t rows, std::int64_t cols) {
  return take<BMat>(label, rows, cols, 0, false);
}

BAct3 BufferPool::bact3(const char* label, std::int64_t rows, int heads, int dim) {
  return take<BAct3>(label, rows, heads, dim, false);
}

std::int64_t BufferPool::cachedBytes() const {
  std::int64_t n = 0;
  for (const auto& s : segments_) n += s.bytes();
  return n;
}

Vec newVec(BufferPool* pool, const char* label, std::int64_t n, bool zero) {
  if (pool) return pool->vec(label, n, zero);
  return zero ? Vec(std::string(label), n)
              : Vec(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), n);
}

Mat newMat(BufferPool* pool, const char* label, std::int64_t rows, std::int64_t cols, bool zero) {
  if (pool) return pool->mat(label, rows, cols, zero);
  return zero ? Mat(std::string(label), rows, cols) : newMat(label, rows, cols);
}

Act3 newAct3(BufferPool* pool, const char* label, std::int64_t rows, int heads, int dim, bool zero) {
  if (pool) return pool->act3(label, rows, heads, dim, zero);
  return zero ? Act3(std::string(label), rows, heads, dim) : newAct3(label, rows, heads, dim);
}

template <class T>
MatT<T> newMatT(BufferPool* pool, const char* label, std::int64_t rows, std::int64_t cols) {
  if constexpr (std::is_same_v<T, bf16>)
    return pool ? pool->bmat(label, rows, cols)
                : BMat(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), rows, cols);
  else
    return newMat(pool, label, rows, cols);
}
template <class T>
Act3T<T> newAct3T(BufferPool* pool, const char* label, std::int64_t rows, int heads, int dim) {
  if constexpr (std::is_same_v<T, bf16>)
    return pool ? pool->bact3(label, rows, heads, dim)
                : BAct3(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), rows, heads, dim);
  else
    return newAct3(pool, label, rows, heads, dim);
}
template MatT<float> newMatT<float>(BufferPool*, const char*, std::int64_t, std::int64_t);
template MatT<bf16> newMatT<bf16>(BufferPool*, const char*, std::int64_t, std::int64_t);
template Act3T<float> newAct3T<float>(BufferPool*, const char*, std::int64_t, int, int);
template Act3T<bf16> newAct3T<bf16>(BufferPool*, const char*, std::int64_t, int, int);

}  // namespace wlb::runtime
