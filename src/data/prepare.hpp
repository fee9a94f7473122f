#pragma once
/// \file prepare.hpp
/// \brief `wlb data prepare`: text documents -> Megatron-LM `.bin`/`.idx` token datasets
/// (byte-level tokens, uint16), with a held-out split chosen by a hash of each document's
/// path. The dataset writer and reader are data/indexed_dataset.hpp. See docs/data.md.

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/output_file.hpp"
#include "data/indexed_dataset.hpp"
#include "data/tokenizer.hpp"

namespace wlb::data {

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
  TemporaryTracker track_temporary;  ///< the driver's hook for temporaries (core/output_file.hpp)
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
  /// token datasets (an MMIDIDX `.idx` and the `.bin` beside it, another run's outputs
  /// say), not counted in regular_files
  std::int64_t skipped_datasets = 0;
  /// hard links to a file already taken (the first path in byte order is the document),
  /// not counted in regular_files
  std::int64_t skipped_hard_links = 0;
  std::int64_t cut_files = 0;      ///< files split into several documents by max_bytes
  std::string train_prefix, valid_prefix;
};

/// Tokenise every regular file under `source` (recursively, sorted by relative path; a
/// tarball is unpacked with the system `tar` into a temporary directory first) and write
/// both splits. Bad input (missing source, unwritable output, no documents) -> InputError.
PrepareResult prepareDataset(const PrepareOptions& opt);

}  // namespace wlb::data
