#pragma once
/// \file heap.hpp
/// \brief The drivers' heap policy (glibc): large buffers come from the heap and freed
/// memory stays with the process.
///
/// With glibc's defaults (dynamic mmap threshold, heap trimming) buffers of a few MB go back
/// to the kernel when freed and are first-touch faulted again when the next ones are made.
/// The planners build and drop such buffers for every candidate plan (slimpack simulates
/// several per step): at 128K/64 in bench_packing about 940 page faults per global batch,
/// a fifth of its time on a loaded VM (docs/performance.md § Planning time). `wlb` and the
/// benchmarks call this first thing: the mmap threshold `wlb validate-sim` gives its stages
/// (docs/simulator.md), and a 1 GiB trim threshold where the stages get 4 GiB through
/// GLIBC_TUNABLES (mallopt takes an int). A GLIBC_TUNABLES in the environment wins. The
/// Python module leaves its host process's allocator alone.

#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace wlb {

inline void keepFreedHeap() {
#if defined(__GLIBC__)
  if (std::getenv("GLIBC_TUNABLES")) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest: buffers up to 32 MiB from the heap
  mallopt(M_TRIM_THRESHOLD, 1 << 30);   // keep up to 1 GiB of freed heap
#endif
}

}  // namespace wlb
