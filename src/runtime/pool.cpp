/// \file pool.cpp
/// \brief The caching activation pool (see pool.hpp).

#include "runtime/pool.hpp"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace wlb::runtime {
namespace {

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
V leading(const V& block, std::int64_t rows) {
  const auto r = std::make_pair(std::int64_t{0}, rows);
  if constexpr (V::rank == 1)
    return Kokkos::subview(block, r);
  else if constexpr (V::rank == 2)
    return Kokkos::subview(block, r, Kokkos::ALL);
  else
    return Kokkos::subview(block, r, Kokkos::ALL, Kokkos::ALL);
}

template <class V>
std::int64_t blockBytes(std::int64_t rows, std::int64_t e1, std::int64_t e2) {
  std::int64_t n = rows;
  if constexpr (V::rank >= 2) n *= e1;
  if constexpr (V::rank >= 3) n *= e2;
  return n * static_cast<std::int64_t>(sizeof(typename V::value_type));
}

template <class V>
bool sameTrailing(const V& block, std::int64_t e1, std::int64_t e2) {
  if constexpr (V::rank == 1)
    return true;
  else if constexpr (V::rank == 2)
    return static_cast<std::int64_t>(block.extent(1)) == e1;
  else
    return static_cast<std::int64_t>(block.extent(1)) == e1 && static_cast<std::int64_t>(block.extent(2)) == e2;
}

}  // namespace

std::int64_t BufferPool::bucketRows(std::int64_t rows) {
  if (rows <= 64) return 64;
  std::int64_t p = 1;
  while (p < rows) p <<= 1;
  const std::int64_t g = std::max<std::int64_t>(8, p / 8);
  return (rows + g - 1) / g * g;
}

template <class V>
V BufferPool::take(std::vector<Entry<V>>& list, const char* label, std::int64_t rows, std::int64_t e1, std::int64_t e2,
                   bool zero) {
  if (rows == 0) return allocate<V>(label, 0, e1, e2);
  const std::int64_t cap = bucketRows(rows);
  // use_count 1: only the pool holds the block, every view handed out of it is gone
  const auto freeOfShape = [&](const Entry<V>& e) { return e.block.use_count() == 1 && sameTrailing(e.block, e1, e2); };
  const auto rowsOf = [](const Entry<V>& e) { return static_cast<std::int64_t>(e.block.extent(0)); };
  // Best fit among the free blocks of this shape holding at least cap rows. No upper bound:
  // the rows of SlimPack slices and KV messages vary by orders of magnitude from unit to
  // unit, and with one (2 cap) most of them missed (docs/runtime.md, "Buffers").
  Entry<V>* best = nullptr;
  for (auto& e : list)
    if (freeOfShape(e) && rowsOf(e) >= cap && (!best || rowsOf(e) < rowsOf(*best))) best = &e;
  V out;
  ++requests_;
  const std::int64_t asked = blockBytes<V>(rows, e1, e2);
  if (best) {
    best->used = requests_;
    best->bytes = asked;
    out = leading(best->block, rows);
    ++hits_;
  } else {
    // A free block of this shape too small for the request is replaced, not kept beside the
    // new one: the pool then holds as many blocks of a shape as are alive at once, each as
    // large as the largest request, instead of one set per row bucket (a 64K-token window
    // of varied micro-batches would otherwise cache several sets of activations).
    auto smaller = list.end();
    for (auto it = list.begin(); it != list.end(); ++it)
      if (freeOfShape(*it) && rowsOf(*it) < cap && (smaller == list.end() || rowsOf(*it) > rowsOf(*smaller)))
        smaller = it;
    if (smaller != list.end()) list.erase(smaller);
    // Out of memory (or past the capacity): give back the free blocks used longest ago, one
    // at a time, until the block fits; with none left to give, the failure is the caller's.
    const std::int64_t need = blockBytes<V>(cap, e1, e2);
    bool fenced = false;
    const auto giveBack = [&] {
      if (!fenced) Kokkos::fence();  // kernels still reading a free block's last contents
      fenced = true;
      return releaseOldest();
    };
    V block;
    for (;;) {
      if (capacity_ > 0 && cachedBytes() + need > capacity_) {
        if (giveBack()) continue;
        throw std::runtime_error("wlb::runtime::BufferPool: " + std::string(label) + " (" + std::to_string(need) +
                                 " bytes) does not fit the pool's capacity of " + std::to_string(capacity_) + " bytes");
      }
      try {
        block = allocate<V>(label, cap, e1, e2);
        break;
      } catch (const std::exception&) {
        if (!giveBack()) throw;
      }
    }
    list.push_back({block, requests_, asked});
    out = leading(list.back().block, rows);
    ++misses_;
  }
  notePeaks();
  if (zero) Kokkos::deep_copy(space_, out, typename V::non_const_value_type{});
  return out;
}

void BufferPool::notePeaks() {
  // Frees are implicit (a block is free when its last view dies), so what is alive is
  // counted at each request; the peak is reached at a request, since only requests add.
  std::int64_t live = 0, asked = 0;
  eachList([&](const auto& list) {
    for (const auto& e : list)
      if (e.block.use_count() > 1) {
        live +=
            static_cast<std::int64_t>(e.block.span() * sizeof(typename std::decay_t<decltype(e.block)>::value_type));
        asked += e.bytes;
      }
  });
  peak_live_ = std::max(peak_live_, live);
  peak_requested_ = std::max(peak_requested_, asked);
}

bool BufferPool::releaseOldest() {
  // The free block with the smallest `used` over every list (each request hands out one
  // block, so `used` names it), erased from its list.
  std::uint64_t oldest = 0;
  bool found = false;
  eachList([&](const auto& list) {
    for (const auto& e : list)
      if (e.block.use_count() == 1 && (!found || e.used < oldest)) {
        oldest = e.used;
        found = true;
      }
  });
  if (!found) return false;
  eachList([&](auto& list) {
    list.erase(std::remove_if(list.begin(), list.end(),
                              [&](const auto& e) { return e.block.use_count() == 1 && e.used == oldest; }),
               list.end());
  });
  return true;
}

void BufferPool::releaseFree() {
  eachList([](auto& list) {
    list.erase(std::remove_if(list.begin(), list.end(), [](const auto& e) { return e.block.use_count() == 1; }),
               list.end());
  });
}

Vec BufferPool::vec(const char* label, std::int64_t n, bool zero) {
  return take(vecs_, label, n, 0, 0, zero);
}

Mat BufferPool::mat(const char* label, std::int64_t rows, std::int64_t cols, bool zero) {
  return take(mats_, label, rows, cols, 0, zero);
}

Act3 BufferPool::act3(const char* label, std::int64_t rows, int heads, int dim, bool zero) {
  return take(acts_, label, rows, heads, dim, zero);
}

BMat BufferPool::bmat(const char* label, std::int64_t rows, std::int64_t cols) {
  return take(bmats_, label, rows, cols, 0, false);
}

BAct3 BufferPool::bact3(const char* label, std::int64_t rows, int heads, int dim) {
  return take(bacts_, label, rows, heads, dim, false);
}

std::int64_t BufferPool::cachedBytes() const {
  std::int64_t b = 0;
  eachList([&](const auto& list) {
    for (const auto& e : list)
      b += static_cast<std::int64_t>(e.block.span() * sizeof(typename std::decay_t<decltype(e.block)>::value_type));
  });
  return b;
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
