#pragma once
/// \file bf16.hpp
/// \brief BF16 storage type of the attention kernels: 16 raw bits (the upper half of an
/// IEEE float), usable in Kokkos views on every backend (Kokkos 3.4 has no bhalf_t).
/// Conversions round to nearest even and keep NaN a NaN.

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <type_traits>

namespace wlb::attention {

struct bf16 {  // NOLINT(readability-identifier-naming): named as a built-in float type, like float and half
  std::uint16_t bits = 0;
};

KOKKOS_INLINE_FUNCTION float toFloat(bf16 x) {
  union {
    std::uint32_t u;
    float f;
  } c{};
  c.u = static_cast<std::uint32_t>(x.bits) << 16;
  return c.f;
}
KOKKOS_INLINE_FUNCTION float toFloat(float x) {
  return x;
}

KOKKOS_INLINE_FUNCTION bf16 toBf16(float f) {
  union {
    std::uint32_t u;
    float f;
  } c{};
  c.f = f;
  bf16 r;
  if ((c.u & 0x7f800000u) == 0x7f800000u && (c.u & 0x007fffffu) != 0u) {
    r.bits = static_cast<std::uint16_t>((c.u >> 16) | 0x0040u);  // quiet NaN stays NaN
    return r;
  }
  const std::uint32_t round = 0x7fffu + ((c.u >> 16) & 1u);
  r.bits = static_cast<std::uint16_t>((c.u + round) >> 16);
  return r;
}

/// A float as the storage type T (float or bf16).
template <class T>
KOKKOS_INLINE_FUNCTION T fromFloat(float x) {
  if constexpr (std::is_same<T, bf16>::value)
    return toBf16(x);
  else
    return x;
}

/// The value a float takes once stored as bf16.
KOKKOS_INLINE_FUNCTION float roundBf16(float f) {
  return toFloat(toBf16(f));
}

}  // namespace wlb::attention
