#pragma once
/// \file pool.hpp
/// \brief The step's activation buffers without allocation inside a step (docs/runtime.md,
/// "Buffers"): a caching pool of device buffers that the layer, the loss and the stage
/// walker take their activations and temporaries from.
///
/// Contract:
/// * The pool holds segments of untyped device memory. A request for [rows][...] of type T
///   needs its bucket's bytes (rows rounded up to a granularity of 1/8 of their power of
///   two, at least 64 rows, times the trailing extents and sizeof(T), rounded up to 256
///   bytes) and takes them from the front of the smallest free piece of any segment that
///   holds them; the rest of the piece stays free. It is handed out as a view of the
///   request's shape over those bytes, whatever shape and type they served before.
/// * Each piece handed out gets an allocation record of its own (a host-side tag that
///   holds its segment): the piece is free again as soon as no view of it is alive, and is
///   merged with free neighbours. Nothing has to be returned by hand, and a view that
///   outlives the pool keeps its segment alive.
/// * A miss allocates a new segment of the bucket's bytes (counted: misses()), replacing
///   the largest wholly free segment too small for it (the oldest of equal ones), so the
///   same requests in the next step are hits.
///   When the allocation fails (or would take the pool past its capacity, when one is set),
///   the wholly free segment used longest ago is given back and it is tried again, one by
///   one, so a nearly full device keeps the rest of its cache; with none left to give the
///   error is the caller's. Nothing else gives segments back (as PyTorch's caching
///   allocator): the shapes of SlimPack slices and KV messages change every step, and a
///   step with the longest slices comes back after any number of steps, and evicting
///   blocks idle for 4 steps made it allocate them again (docs/runtime.md, "Buffers").
/// * Uninitialised unless `zero` is asked for (zeroed on the pool's execution space).
/// * One pool per rank and execution-space instance (a freed piece is handed out again
///   in the instance's order); not thread-safe.

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
  /// Give back every wholly free segment.
  void releaseFree();
  /// Give back the wholly free segment used longest ago; false when none is.
  bool releaseOldest();
  std::int64_t misses() const { return misses_; }  ///< segments allocated so far
  std::int64_t hits() const { return hits_; }      ///< requests served from the cache
  std::int64_t cachedBytes() const;                ///< bytes of every segment held
  std::int64_t segments() const { return static_cast<std::int64_t>(segments_.size()); }
  /// Since the last resetPeaks(): the most bytes of pieces in use at once, and the most
  /// bytes the requests alive at once asked for (rows asked, not the bucket's rows). Their
  /// gap to cachedBytes() is what caching costs over allocating each buffer exactly.
  std::int64_t peakLiveBytes() const { return peak_live_; }
  std::int64_t peakRequestedBytes() const { return peak_requested_; }
  void resetPeaks() { peak_live_ = peak_requested_ = 0; }
  /// Rows a request of `rows` is served with.
  static std::int64_t bucketRows(std::int64_t rows);
  /// Pieces start at multiples of this many bytes of their segment.
  static constexpr std::int64_t kAlign = 256;

 private:
  using Bytes = Kokkos::View<char*, Mem>;
  using Tag = Kokkos::Impl::SharedAllocationTracker;
  struct Piece {
    std::int64_t offset = 0, bytes = 0;
    std::int64_t asked = 0;  ///< bytes its request asked for
    std::uint64_t used = 0;  ///< request count when it was last handed out
    Tag tag;                 ///< the record its views share; none while free
    /// No tag: collect() drops a tag once only the pool holds it (use count 1).
    bool free() const { return tag.use_count() == 0; }
  };
  struct Segment {
    Bytes mem;
    std::vector<Piece> pieces;  ///< by offset, covering mem
    std::uint64_t used = 0;     ///< request count when a piece of it was last handed out
    bool free() const { return pieces.size() == 1 && pieces[0].free(); }
    std::int64_t bytes() const { return static_cast<std::int64_t>(mem.extent(0)); }
  };
  template <class V>
  V take(const char* label, std::int64_t rows, std::int64_t e1, std::int64_t e2, bool zero);
  Bytes allocateSegment(const char* label, std::int64_t bytes);
  /// Pieces whose views are gone become free and merge with free neighbours.
  void collect();
  void notePeaks();
  Space space_;
  std::vector<Segment> segments_;
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
