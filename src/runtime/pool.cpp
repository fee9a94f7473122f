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
std::int64_t viewBytes(std::int64_t rows, std::int64_t e1, std::int64_t e2) {
  std::int64_t n = rows;
  if constexpr (V::rank >= 2) n *= e1;
  if constexpr (V::rank >= 3) n *= e2;
  return n * static_cast<std::int64_t>(sizeof(typename V::value_type));
}

/// A V of [rows][e1][e2] over the first bytes of `mem` that shares its allocation record:
/// the block stays alive, and counted as used, while the view does. Built from an unmanaged
/// view's mapping and the block's tracker (View's constructor from a tracker and a mapping,
/// in Kokkos 3.4 and 4.x alike); Kokkos allocations are aligned for any element type.
template <class V, class B>
V carve(const B& mem, std::int64_t rows, std::int64_t e1, std::int64_t e2) {
  using T = typename V::value_type;
  using U = Kokkos::View<typename V::data_type, typename V::array_layout, typename V::memory_space,
                         Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  T* p = reinterpret_cast<T*>(mem.data());
  U u;
  if constexpr (V::rank == 1)
    u = U(p, rows);
  else if constexpr (V::rank == 2)
    u = U(p, rows, e1);
  else
    u = U(p, rows, e1, e2);
  return V(mem.impl_track(), u.impl_map());
}

}  // namespace

std::int64_t BufferPool::bucketRows(std::int64_t rows) {
  if (rows <= 64) return 64;
  std::int64_t p = 1;
  while (p < rows) p <<= 1;
  const std::int64_t g = std::max<std::int64_t>(8, p / 8);
  return (rows + g - 1) / g * g;
}

BufferPool::Bytes BufferPool::allocateBlock(const char* label, std::int64_t bytes) {
  // Out of memory (or past the capacity): give back the free blocks used longest ago, one
  // at a time, until the block fits; with none left to give, the failure is the caller's.
  bool fenced = false;
  const auto giveBack = [&] {
    if (!fenced) Kokkos::fence();  // kernels still reading a free block's last contents
    fenced = true;
    return releaseOldest();
  };
  for (;;) {
    if (capacity_ > 0 && cachedBytes() + bytes > capacity_) {
      if (giveBack()) continue;
      throw std::runtime_error("wlb::runtime::BufferPool: " + std::string(label) + " (" + std::to_string(bytes) +
                               " bytes) does not fit the pool's capacity of " + std::to_string(capacity_) + " bytes");
    }
    try {
      return Bytes(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), bytes);
    } catch (const std::exception&) {
      if (!giveBack()) throw;
    }
  }
}

template <class V>
V BufferPool::take(const char* label, std::int64_t rows, std::int64_t e1, std::int64_t e2, bool zero) {
  if (rows == 0) return allocate<V>(label, 0, e1, e2);
  const std::int64_t need = viewBytes<V>(bucketRows(rows), e1, e2), asked = viewBytes<V>(rows, e1, e2);
  // Best fit among the free blocks holding the bucket, whatever they held before. No upper
  // bound: the rows of SlimPack slices and KV messages vary by orders of magnitude from
  // unit to unit, and with one (2 buckets) most of them missed (docs/runtime.md, "Buffers").
  Block* best = nullptr;
  for (auto& b : blocks_)
    if (b.free() && b.bytes() >= need && (!best || b.bytes() < best->bytes())) best = &b;
  ++requests_;
  if (!best) {
    // A free block too small for the request is replaced, not kept beside the new one: the
    // pool then holds as many blocks as buffers are alive at once, each as large as the
    // largest request, instead of one set per bucket (a 64K-token window of varied
    // micro-batches would otherwise cache several sets of activations).
    auto smaller = blocks_.end();
    for (auto it = blocks_.begin(); it != blocks_.end(); ++it)
      if (it->free() && it->bytes() < need &&
          (smaller == blocks_.end() || it->bytes() > smaller->bytes() ||
           (it->bytes() == smaller->bytes() && it->used < smaller->used)))
        smaller = it;
    if (smaller != blocks_.end()) blocks_.erase(smaller);
    Bytes mem = allocateBlock(label, need);
    blocks_.push_back({mem, 0, 0});
    best = &blocks_.back();
    ++misses_;
  } else {
    ++hits_;
  }
  best->used = requests_;
  best->asked = asked;
  V out = carve<V>(best->mem, rows, e1, e2);
  notePeaks();
  if (zero) Kokkos::deep_copy(space_, out, typename V::non_const_value_type{});
  return out;
}

void BufferPool::notePeaks() {
  // Frees are implicit (a block is free when its last view dies), so what is alive is
  // counted at each request; the peak is reached at a request, since only requests add.
  std::int64_t live = 0, asked = 0;
  for (const auto& b : blocks_)
    if (!b.free()) {
      live += b.bytes();
      asked += b.asked;
    }
  peak_live_ = std::max(peak_live_, live);
  peak_requested_ = std::max(peak_requested_, asked);
}

bool BufferPool::releaseOldest() {
  auto oldest = blocks_.end();
  for (auto it = blocks_.begin(); it != blocks_.end(); ++it)
    if (it->free() && (oldest == blocks_.end() || it->used < oldest->used)) oldest = it;
  if (oldest == blocks_.end()) return false;
  blocks_.erase(oldest);
  return true;
}

void BufferPool::releaseFree() {
  blocks_.erase(std::remove_if(blocks_.begin(), blocks_.end(), [](const Block& b) { return b.free(); }), blocks_.end());
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
  for (const auto& b : blocks_) n += b.bytes();
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
