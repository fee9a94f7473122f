// Length files: the text reader (one length per line, comments) and the JSONL reader
// (a numeric field per object). The first byte picks the reader.
#include <cstdint>

#include "data/length_source.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string& path = wlb::fuzz::scratch(".lengths");
  wlb::fuzz::writeScratch(path, data + 1, size - 1);
  wlb::fuzz::expectOnlyInputErrors([&] {
    const auto lengths = (data[0] & 1) ? wlb::data::readJsonlLengths(path, "length") : wlb::data::readTextLengths(path);
    for (auto l : lengths)
      if (l <= 0 || l > wlb::data::kMaxDocTokens) std::abort();  // the reader's own contract
    if (!lengths.empty()) (void)wlb::data::computeLengthStats(lengths, 8192);
  });
  return 0;
}
