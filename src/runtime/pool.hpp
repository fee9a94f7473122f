#pragma once
/// \file pool.hpp
/// \brief The step's activation buffers without allocation inside a step (docs/runtime.md,
/// "Buffers"): a caching pool of device buffers that the layer, the loss and the stage
/// walker take their activations and temporaries from.
///
/// Contract:
/// * Blocks are untyped device memory. A request for [rows][...] of type T is served by the
///   smallest free cached block holding its bucket (rows rounded up to a granularity of 1/8
///   of their power of two, at least 64 rows, times the trailing extents and sizeof(T)),
///   whatever shape and type the block served before, and handed out as a view of the
///   request's shape over the block's first bytes. The view shares the block's allocation
///   record, so the block is free again as soon as no view of it is alive (its use count is
///   the pool's own). Nothing has to be returned by hand.
/// * A miss allocates a new block of the bucket's bytes (counted: misses()), replacing the
///   largest free block too small for it (the oldest of equal ones), so the same requests
///   in the next step are hits and the pool holds about one block per buffer alive at once.
///   When the allocation fails (or would take the pool past its capacity, when one is set),
///   the free block used longest ago is given back and it is tried again, block by block,
///   so a nearly full device keeps the rest of its cache; with no free block left the error
///   is the caller's. Nothing else gives blocks back (as PyTorch's caching allocator): the
///   shapes of SlimPack slices and KV messages change every step, and a step with the
///   longest slices, which needs the largest blocks, comes back after any number of steps,
///   and evicting blocks idle for 4 steps made it allocate them again (docs/runtime.md,
///   "Buffers").
/// * Uninitialised unless `zero` is asked for (zeroed on the pool's execution space).
/// * One pool per rank and execution-space instance; not thread-safe.

#include <cstdint>
#include <type_traits>
#include <vector>

#include "runtime/gemm.hpp"
#include "runtime/llama.hpp"

namespace wlb::runtime {

class BufferPool {
 public:
  /// `capacity_bytes`: the most the pool may hold (0: what the device gives; a capacity
  /// lets the host tests run the path a full GPU takes).
  explicit BufferPool(const Space& space, std::int64_t capacity_bytes = 0) : space_(space), capacity_(capacity_bytes) {}
  Vec vec(const char* label, std::int64_t n, bool zero = false);
  Mat mat(const char* label, std::int64_t rows, std::int64_t cols, bool zero = false);
  Act3 act3(const char* label, std::int64_t rows, int heads, int dim, bool zero = false);
  BMat bmat(const char* label, std::int64_t rows, std::int64_t cols);
  BAct3 bact3(const char* label, std::int64_t rows, int heads, int dim);
  /// Give back every block no view is using.
  void releaseFree();
  /// Give back the free block used longest ago; false when no block is free.
  bool releaseOldest();
  std::int64_t misses() const { return misses_; }  ///< blocks allocated so far
  std::int64_t hits() const { return hits_; }      ///< requests served from the cache
  std::int64_t cachedBytes() const;                ///< bytes of every block held
  /// Since the last resetPeaks(): the most bytes in blocks in use at once, and the most
  /// bytes the requests alive at once asked for (rows asked, not the block's rows). Their
  /// gap to cachedBytes() is what caching costs over allocating each buffer exactly.
  std::int64_t peakLiveBytes() const { return peak_live_; }
  std::int64_t peakRequestedBytes() const { return peak_requested_; }
  void resetPeaks() { peak_live_ = peak_requested_ = 0; }
  /// Rows a request of `rows` is served with.
  static std::int64_t bucketRows(std::int64_t rows);

 private:
  using Bytes = Kokkos::View<char*, Mem>;
  struct Block {
    Bytes mem;
    std::uint64_t used = 0;  ///< request count when it was last handed out
    std::int64_t asked = 0;  ///< bytes the last request asked for
    /// Use count 1: only the pool holds the block, every view handed out of it is gone.
    bool free() const { return mem.use_count() == 1; }
    std::int64_t bytes() const { return static_cast<std::int64_t>(mem.extent(0)); }
  };
  template <class V>
  V take(const char* label, std::int64_t rows, std::int64_t e1, std::int64_t e2, bool zero);
  Bytes allocateBlock(const char* label, std::int64_t bytes);
  void notePeaks();
  Space space_;
  std::vector<Block> blocks_;
  std::int64_t capacity_ = 0;
  std::uint64_t requests_ = 0;
  std::int64_t misses_ = 0, hits_ = 0;
  std::int64_t peak_live_ = 0, peak_requested_ = 0;
};

/// From `pool` when given, else a fresh allocation (tests and tools without a pool).
Vec newVec(BufferPool* pool, const char* label, std::int64_t n, bool zero = false);
Mat newMat(BufferPool* pool, const char* label, std::int64_t rows, std::int64_t cols, bool zero = false);
Act3 newAct3(BufferPool* pool, const char* label, std::int64_t rows, int heads, int dim, bool zero = false);
/// Uninitialised [rows][cols] / [rows][heads][dim] of storage type T (float or bf16).
template <class T>
MatT<T> newMatT(BufferPool* pool, const char* label, std::int64_t rows, std::int64_t cols);
template <class T>
Act3T<T> newAct3T(BufferPool* pool, const char* label, std::int64_t rows, int heads, int dim);

/// `m` in storage type T: `m` itself when T is float, else a rounded copy from `pool` (a
/// gradient that a BF16 GEMM reads).
template <class T>
MatT<T> storedAs(const Space& space, BufferPool* pool, const Mat& m, const char* label) {
  if constexpr (std::is_same_v<T, float>) {
    (void)space, (void)pool, (void)label;
    return m;
  } else {
    MatT<T> out =
        newMatT<T>(pool, label, static_cast<std::int64_t>(m.extent(0)), static_cast<std::int64_t>(m.extent(1)));
    convert<T>(space, m, out);
    return out;
  }
}

}  // namespace wlb::runtime
