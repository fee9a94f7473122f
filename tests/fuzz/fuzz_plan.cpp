// Plan reader: the JSONL plan format (header line, step lines, summary).
#include <cstdint>

#include "fuzz_common.hpp"
#include "packing/plan_io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = wlb::fuzz::scratch(".jsonl");
  wlb::fuzz::writeScratch(path, data, size);
  wlb::fuzz::expectOnlyInputErrors([&] { (void)wlb::packing::readPlanFile(path); });
  return 0;
}
