#pragma once
/// \file kokkos_compat.hpp
/// \brief The one place where Kokkos 3.4 (Debian) and Kokkos 4.x differ for wlb.

#include <Kokkos_Core.hpp>

#include <cmath>
#include <string>

#if !defined(KOKKOS_VERSION)
#error "Kokkos_Core.hpp did not define KOKKOS_VERSION"
#endif

#if KOKKOS_VERSION >= 40000
#define WLB_KOKKOS4 1
#else
#define WLB_KOKKOS4 0
#endif

namespace wlb::kk {

/// exp/sqrt/log usable inside kernels on every backend.
#if WLB_KOKKOS4
KOKKOS_INLINE_FUNCTION float exp(float x) { return Kokkos::exp(x); }
KOKKOS_INLINE_FUNCTION double exp(double x) { return Kokkos::exp(x); }
KOKKOS_INLINE_FUNCTION float log(float x) { return Kokkos::log(x); }
KOKKOS_INLINE_FUNCTION double log(double x) { return Kokkos::log(x); }
KOKKOS_INLINE_FUNCTION float sqrt(float x) { return Kokkos::sqrt(x); }
KOKKOS_INLINE_FUNCTION double sqrt(double x) { return Kokkos::sqrt(x); }
#else
KOKKOS_INLINE_FUNCTION float exp(float x) { return Kokkos::Experimental::exp(x); }
KOKKOS_INLINE_FUNCTION double exp(double x) { return Kokkos::Experimental::exp(x); }
KOKKOS_INLINE_FUNCTION float log(float x) { return Kokkos::Experimental::log(x); }
KOKKOS_INLINE_FUNCTION double log(double x) { return Kokkos::Experimental::log(x); }
KOKKOS_INLINE_FUNCTION float sqrt(float x) { return Kokkos::Experimental::sqrt(x); }
KOKKOS_INLINE_FUNCTION double sqrt(double x) { return Kokkos::Experimental::sqrt(x); }
#endif

template <class T>
KOKKOS_INLINE_FUNCTION constexpr T min(T a, T b) { return b < a ? b : a; }
template <class T>
KOKKOS_INLINE_FUNCTION constexpr T max(T a, T b) { return a < b ? b : a; }

/// Labelled fence of an execution-space instance (3.4 has no labelled fence).
template <class ExecSpace>
inline void fence(const ExecSpace& space, const std::string& label) {
#if WLB_KOKKOS4
  space.fence(label);
#else
  (void)label;
  space.fence();
#endif
}

/// Name of the default execution space's backend, e.g. "Serial", "OpenMP", "Cuda".
inline std::string backendName() { return Kokkos::DefaultExecutionSpace::name(); }

/// "major.minor.patch" of the Kokkos in use.
inline std::string versionString() {
  return std::to_string(KOKKOS_VERSION / 10000) + "." + std::to_string(KOKKOS_VERSION / 100 % 100) +
         "." + std::to_string(KOKKOS_VERSION % 100);
}

}  // namespace wlb::kk
