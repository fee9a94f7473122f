// Megatron .idx reader: header, version, dtype, counts and the sizes array.
#include <cstdint>

#include "data/length_source.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = wlb::fuzz::scratch(".idx");
  wlb::fuzz::writeScratch(path, data, size);
  wlb::fuzz::expectOnlyInputErrors([&] {
    const auto lengths = wlb::data::readMegatronIdx(path);
    for (auto l : lengths)
      if (l <= 0 || l > wlb::data::kMaxDocTokens) std::abort();
  });
  return 0;
}
