// Byte-level tokenizer (docs/data.md).
#include "data/tokenizer.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace wlb::data {

void ByteTokenizer::encode(std::string_view text, std::vector<Token>& out) {
  out.reserve(out.size() + text.size());
  for (const char c : text) out.push_back(static_cast<unsigned char>(c));
}

std::string ByteTokenizer::decode(const Token* tokens, std::size_t n) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) {
    if (tokens[i] >= kVocabSize)
      throw InputError(fmt::format("token {} at position {} is outside the byte vocabulary (0..255)", tokens[i], i));
    s[i] = static_cast<char>(tokens[i]);
  }
  return s;
}

}  // namespace wlb::data
