#pragma once
/// \file tokenizer.hpp
/// \brief Byte-level tokenizer: token = byte value, vocabulary 256. Needs no download and
/// no training, decodes every input exactly (any bytes, not only UTF-8). See docs/data.md.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace wlb::data {

/// Token type of the datasets the project writes (Megatron DType code 8, numpy uint16):
/// what Megatron-LM's own preprocessing picks for a vocabulary under 65500, with room for
/// a trained BPE or special tokens beyond the 256 bytes.
using Token = std::uint16_t;

class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;
  static const char* name() { return "byte"; }
  /// Append the tokens of `text` to `out`.
  static void encode(std::string_view text, std::vector<Token>& out);
  /// Bytes of `n` tokens; a token >= 256 -> InputError (not a byte-level dataset).
  static std::string decode(const Token* tokens, std::size_t n);
};

}  // namespace wlb::data
