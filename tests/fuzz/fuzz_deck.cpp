// Deck parser: TOML text -> validated Deck, sweep expansion and strategy resolution.
#include <cstdint>
#include <string>

#include "core/deck.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  wlb::fuzz::expectOnlyInputErrors([&] {
    const wlb::Deck deck = wlb::parseDeck(text, "fuzz.toml");
    const auto cases = wlb::expandSweep(deck);
    for (const auto& c : cases) (void)wlb::resolveStrategies(c);
    (void)wlb::parseDeck(deck.toToml(), "fuzz-roundtrip.toml");  // what a trace stores reads back
  });
  return 0;
}
