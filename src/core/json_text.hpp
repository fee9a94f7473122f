#pragma once

#include <cstddef>
#include <istream>
#include <iterator>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace wlb {

/// JSON text read from a file: nlohmann's parser takes a NUL byte for the end of its input,
/// so whatever followed one (the rest of a line, a whole document) would be dropped without
/// a word. A NUL is refused as the parse error of its byte; everything else is
/// nlohmann::json::parse, whose exceptions the callers already turn into file:line errors.
inline nlohmann::json parseJsonText(std::string_view text) {
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw nlohmann::json::parse_error::create(101, nul + 1, "syntax error: a NUL byte in JSON text", nullptr);
  return nlohmann::json::parse(text);
}

/// The rest of a stream as JSON text (the same NUL check).
inline nlohmann::json parseJsonText(std::istream& in) {
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return parseJsonText(std::string_view(text));
}

}  // namespace wlb
