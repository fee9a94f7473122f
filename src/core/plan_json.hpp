#pragma once
/// \file plan_json.hpp
/// \brief A StepPlan's JSON form, in one place: the step lines of plan files
/// (packing/plan_io.hpp, docs/plan-format.md) and the plan rows of a trace
/// (trace/writer.hpp, docs/trace-schema.md) write it, and every reader parses it here.
///
/// {"type":"step","step":t,"replicas":[[[[doc,offset,length,arrival(,q_offset)],...],..],..],
///  "delayed":[ids]} plus SlimPack's "backward", "merged" and "memory" where the plan has
/// them. Readers check every field and throw InputError naming it; integers are read only
/// from JSON integers in range (nlohmann's get<> on a float such as 1e23 is undefined
/// behaviour, found by fuzz_plan, and a silent wrap would turn a corrupt plan into a
/// plausible one).

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/types.hpp"

namespace wlb {

nlohmann::json planToJson(const StepPlan& plan);
StepPlan planFromJson(const nlohmann::json& j);

/// `v` as an integer of type T, or InputError naming `what`.
template <class T>
T jsonInteger(const nlohmann::json& v, const char* what) {
  static_assert(std::is_integral_v<T>);
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u <= static_cast<std::uint64_t>(std::numeric_limits<T>::max())) return static_cast<T>(u);
  } else if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if constexpr (std::is_signed_v<T>) {
      if (i >= std::numeric_limits<T>::min() && i <= std::numeric_limits<T>::max()) return static_cast<T>(i);
    } else if (i >= 0) {
      return static_cast<T>(i);
    }
  }
  std::string shown = v.dump();
  if (shown.size() > 40) shown = shown.substr(0, 40) + "...";
  throw InputError(fmt::format("'{}' must be an integer in [{}, {}], got {}", what, std::numeric_limits<T>::min(),
                               std::numeric_limits<T>::max(), shown));
}
template <class T>
T jsonIntegerAt(const nlohmann::json& j, const char* key) {
  return jsonInteger<T>(j.at(key), key);
}
template <class T>
T jsonIntegerOr(const nlohmann::json& j, const char* key, T fallback) {
  const auto it = j.find(key);
  return it == j.end() ? fallback : jsonInteger<T>(*it, key);
}

}  // namespace wlb
