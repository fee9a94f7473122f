#pragma once
/// \file prepare.hpp
/// \brief `wlb data prepare`: text documents -> Megatron-LM `.bin`/`.idx` token datasets
/// (byte-level tokens, uint16), with a held-out split chosen by a hash of each document's
/// path; plus the writer and a token reader for such datasets. See docs/data.md.

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <string_view>
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
  std::vector<std::string> temporaries() const { return {binPath() + ".tmp", idxPath() + ".tmp"}; }
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

/// 64-bit hash of a document path (FNV-1a, then the splitmix64 finaliser).
std::uint64_t documentHash(std::string_view path);
/// Whether the document at relative path `path` belongs to the held-out split:
/// (documentHash(path) >> 11) * 2^-53 < fraction.
bool inValidSplit(std::string_view path, double fraction);
/// Sort key of piece `piece` (0 for a file not cut by --max-bytes) of the file at relative
/// path `path` under `--shuffle SEED`: the splitmix64 finaliser of documentHash(path) +
/// 0x9e3779b97f4a7c15 * (seed + 1) + 0xd1b54a32d192ed03 * piece (mod 2^64). Ties, which
/// need a 64-bit collision, keep path order.
std::uint64_t shuffleKey(std::string_view path, std::int64_t piece, std::uint64_t seed);

struct PrepareOptions {
  std::string source;               ///< directory, or .tar / .tar.gz / .tgz / .tar.xz / .txz / .tar.bz2
  std::string out_prefix;           ///< writes OUT_train.{bin,idx} and OUT_valid.{bin,idx}
  double valid_fraction = 0.0;      ///< in [0, 1)
  std::int64_t min_bytes = 1;       ///< files shorter than this are skipped
  std::int64_t max_bytes = 0;       ///< longer files are split into documents of this size (0: no cap)
  std::int64_t max_file_bytes = 0;  ///< files longer than this are skipped (0: none)
  /// Document order: path order when unset (the pieces of a cut file in sequence); else
  /// every document (file, or piece of a cut file) sorted by shuffleKey: a deterministic
  /// shuffle, as Megatron-LM shuffles its samples.
  bool shuffle = false;
  std::uint64_t shuffle_seed = 0;
  /// Called with (path, true) when a temporary file is created and (path, false) when it
  /// is renamed or removed (the driver removes registered ones on SIGINT).
  std::function<void(const std::string&, bool)> track_temporary;
  bool progress = true;  ///< progress lines on stderr for a long run
};

struct SplitCounts {
  std::int64_t files = 0, documents = 0, tokens = 0;
};

struct PrepareResult {
  SplitCounts train, valid;
  std::int64_t regular_files = 0;  ///< regular files found
  std::int64_t skipped_small = 0;  ///< of them, shorter than min_bytes
  std::int64_t skipped_large = 0;  ///< of them, longer than max_file_bytes
  std::int64_t skipped_other = 0;  ///< symbolic links and other non-regular entries
  std::int64_t cut_files = 0;      ///< files split into several documents by max_bytes
  std::string train_prefix, valid_prefix;
};

/// Tokenise every regular file under `source` (recursively, sorted by relative path; a
/// tarball is unpacked with the system `tar` into a temporary directory first) and write
/// both splits. Bad input (missing source, unwritable output, no documents) -> InputError.
PrepareResult prepareDataset(const PrepareOptions& opt);

}  // namespace wlb::data
