#pragma once
/// \file indexed_dataset.hpp
/// \brief Megatron-LM `.bin`/`.idx` token datasets (MMIDIDX version 1): the writer that
/// `wlb data prepare` streams documents into and the reader `wlb train` takes its tokens
/// from. See docs/data.md.

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "data/length_source.hpp"
#include "data/tokenizer.hpp"

namespace wlb::data {

/// Megatron DType code of `Token` (numpy uint16).
constexpr std::uint8_t kMegatronUint16 = 8;

/// Streams documents into PREFIX.bin / PREFIX.idx (MMIDIDX version 1, uint16 tokens, one
/// sequence per document). Everything goes to PREFIX.{bin,idx}.tmp; `commit()` renames;
/// a writer destroyed before that removes its temporaries.
class IndexedDatasetWriter {
 public:
  /// Opens PREFIX.bin.tmp now, so an unwritable output fails before any work
  /// (InputError naming the file).
  explicit IndexedDatasetWriter(std::string prefix);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  /// One document (at most 2^31 - 1 tokens: sizes are int32 in the index).
  void add(const Token* tokens, std::size_t n);
  void add(const std::vector<Token>& t) { add(t.data(), t.size()); }
  /// Close the `.bin` and write the `.idx`, both still under their temporary names.
  void finish();
  /// Rename the temporaries to PREFIX.bin and PREFIX.idx (after `finish`).
  void commit();

  const std::string& prefix() const { return prefix_; }
  std::string binPath() const { return prefix_ + ".bin"; }
  std::string idxPath() const { return prefix_ + ".idx"; }
  std::vector<std::string> temporaries() const { return temporariesOf(prefix_); }
  /// The temporaries a writer of `prefix` makes: known before it opens them, so that a
  /// Ctrl-C between the open and the registration cannot leave one behind.
  static std::vector<std::string> temporariesOf(const std::string& prefix) {
    return {prefix + ".bin.tmp", prefix + ".idx.tmp"};
  }
  std::int64_t documents() const { return static_cast<std::int64_t>(sizes_.size()); }
  std::int64_t tokens() const { return tokens_; }

 private:
  std::string prefix_;
  std::ofstream bin_;
  std::vector<std::int32_t> sizes_;
  std::int64_t tokens_ = 0;
  bool finished_ = false, committed_ = false;
};

/// Reads the documents of PREFIX.idx / PREFIX.bin (token dtype uint8 or uint16; every
/// sequence must lie inside the `.bin`, else InputError naming the file). Not thread-safe.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::string& prefix);
  std::int64_t documents() const { return static_cast<std::int64_t>(index_.doc_idx.size()) - 1; }
  std::int64_t length(std::int64_t doc) const;
  /// Tokens of document `doc` (its sequences concatenated).
  std::vector<Token> document(std::int64_t doc) const;
  std::uint8_t dtype() const { return index_.dtype; }

 private:
  std::string bin_path_;
  MegatronIndex index_;
  std::size_t item_ = 2;
  mutable std::ifstream bin_;
};

}  // namespace wlb::data
