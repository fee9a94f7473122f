#pragma once
/// \file length_source.hpp
/// \brief Document-length sources (docs/data.md): named generator presets and readers
/// for plain-text, JSONL and Megatron-LM `.idx` length files. See docs/data.md.
///
/// A source plays the role of the *original* dataloader: step `t` receives exactly the
/// documents that fill `dp * M` sequences of `S = context_window` tokens under the
/// `original` sequential packing (docs/data.md): documents are taken in
/// stream order; a document that does not fit in the current sequence's remaining space
/// starts the next sequence; a document longer than S occupies ceil(d/S) fresh sequences
/// (its last piece leaves room for more documents). The first document that would need
/// sequence `dp*M + 1` is held back and becomes the first document of step `t+1`
/// (its arrival_step is t+1). So every packer sees the same global batches, the `original`
/// packer never has to carry anything, and the fixed-length packers always have a
/// feasible packing. (A single document longer than `dp*M*S` forms a step on its own.)
///
/// Determinism: the documents of step t are a pure function of (seed, source state at
/// the start of t). Generators seed a counter-based RNG with (seed, t), so the state is
/// tiny: next document id, the held-back length and the next step. File sources wrap
/// around at the end of the file (epoch e+1 starts over; ids keep increasing, the file
/// index of document `id` is `id % documents_per_epoch`).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/deck.hpp"
#include "core/types.hpp"

namespace wlb::data {

/// Portable, seedable RNG (splitmix64-seeded xoshiro256**). Identical streams on every
/// platform and standard library (std::*_distribution are not portable).
class Rng {
 public:
  explicit Rng(std::uint64_t seed, std::uint64_t stream = 0);
  std::uint64_t nextU64();
  double uniform();  ///< [0, 1)
  double normal();   ///< standard normal (Box-Muller, no cached spare)

 private:
  std::uint64_t s_[4]{};
};

/// A document-length distribution (one generator preset), in tokens before scaling.
struct PresetSpec {
  std::string name;
  std::string description;
  /// Mixture components: weight, kind ("lognormal": p1=median, p2=sigma;
  /// "loguniform": p1=lo, p2=hi; "pareto": p1=x_min, p2=alpha), all in tokens.
  struct Component {
    double weight;
    std::string kind;
    double p1, p2;
  };
  std::vector<Component> components;
  std::int64_t max_length = 0;  ///< preset's own cap in tokens (before scaling); 0 = none
  std::string sources;          ///< published statistics it was fitted to
};

/// All generator presets (name order is stable).
const std::vector<PresetSpec>& presets();
std::vector<std::string> presetNames();
/// InputError listing the valid names when `name` is unknown.
const PresetSpec& presetByName(const std::string& name);

/// Draw one raw length from a preset, scaled by `scale` and clamped to [1, cap].
std::int64_t sampleLength(const PresetSpec& p, Rng& rng, double scale, std::int64_t cap);

/// Abstract source of documents, one global batch per step.
class LengthSource {
 public:
  virtual ~LengthSource();

  /// Documents arriving at step `step` (ids increasing and contiguous across steps,
  /// arrival_step = step). Call with consecutive steps starting at the source's next
  /// step (0 for a fresh source, or the restored one); InputError otherwise.
  std::vector<Document> next(std::int64_t step);

  /// Human-readable description (preset or file, window, dp*M).
  virtual std::string describe() const = 0;
  /// Number of distinct documents per epoch for file sources, 0 for generators.
  virtual std::int64_t documentsPerEpoch() const { return 0; }

  /// Position for checkpoint/restart; loadState(saveState()) reproduces the stream.
  nlohmann::json saveState() const;
  void loadState(const nlohmann::json& state);

  std::int64_t sequencesPerStep() const { return sequences_; }
  std::int64_t contextWindow() const { return window_; }
  std::int64_t nextStep() const { return next_step_; }
  /// Id the next document drawn gets (every document drawn so far has a smaller one).
  DocId nextId() const { return next_id_; }

 protected:
  LengthSource(std::int64_t sequences_per_step, std::int64_t context_window);
  /// Prepare to draw the documents of `step` (generators reseed here).
  virtual void beginStep(std::int64_t step) = 0;
  /// Next raw document length of the stream (>= 1).
  virtual std::int64_t draw() = 0;
  virtual nlohmann::json saveExtra() const { return nlohmann::json::object(); }
  /// Validates, then assigns; `next_id` and `held` are the state's, about to be restored.
  virtual void loadExtra(const nlohmann::json&, DocId /*next_id*/, std::int64_t /*held*/) {}

 private:
  std::int64_t sequences_, window_;
  std::int64_t next_step_ = 0;
  DocId next_id_ = 0;
  std::int64_t held_ = 0;  ///< held-back length for the next step (0 = none)
};

/// Source from a deck: [data] source = generator | text | jsonl | megatron.
/// Sequences per step = mesh.dp * M (M = packing.micro_batches, or mesh.pp when 0).
/// InputError naming the file and line / byte offset on bad files.
std::unique_ptr<LengthSource> makeLengthSource(const Deck& deck);

/// Micro-batches per DP replica resolved from the deck (packing.micro_batches or pp).
std::int64_t microBatchesPerReplica(const Deck& deck);
/// s_max resolved from the deck (data.s_max, or context_window when 0).
std::int64_t resolvedSMax(const Deck& deck);
/// A deck's relative data path: against the deck's directory when the file is there, else
/// as given.
std::string resolvePath(const Deck& deck, const std::string& path);
/// `train.dataset`'s prefix: relative to the deck's folder when PREFIX_train.idx is there,
/// else as given (relative to the working directory).
std::string resolveDatasetPrefix(const Deck& deck, const std::string& prefix);

// ---- Readers (each returns the document lengths of the file, in file order) ----------

/// Longest document a length file may hold (core/types.hpp).
using wlb::kMaxDocTokens;

/// A source over lengths held in memory (a file's, or an array a caller passes), drawn in
/// order and wrapped around; `desc` names the stream in plans and checkpoints. The caller
/// has validated `lengths` (non-empty, each in [1, kMaxDocTokens]), as the readers below and
/// the Python module's array check do, each naming its own file or argument.
std::unique_ptr<LengthSource> makeArraySource(std::vector<std::int64_t> lengths, std::string desc,
                                              std::int64_t sequences_per_step, std::int64_t context_window);

/// Plain text: one positive integer per line; blank lines and `#` comments ignored.
std::vector<std::int64_t> readTextLengths(const std::string& path);
/// JSONL: one JSON object per line with an integer field `field` (> 0).
std::vector<std::int64_t> readJsonlLengths(const std::string& path, const std::string& field);
/// A parsed Megatron-LM MMIDIDX index: header checked, doc_idx validated (starts at 0,
/// non-decreasing, <= sequence count); the `.bin` is not opened.
struct MegatronIndex {
  std::uint8_t dtype = 0;              ///< Megatron DType code (1 uint8 ... 8 uint16)
  std::vector<std::int32_t> sizes;     ///< tokens per sequence
  std::vector<std::int64_t> pointers;  ///< byte offset of each sequence in the `.bin`
  std::vector<std::int64_t> doc_idx;   ///< document i = sequences [doc_idx[i], doc_idx[i+1])
  std::size_t doc_idx_offset = 0;      ///< byte offset of doc_idx[] (for messages)
};
/// The first 9 bytes of every MMIDIDX `.idx`.
inline constexpr char kMegatronIdxMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
/// Whether `path` is a file that begins with kMegatronIdxMagic (false if unreadable).
bool isMegatronIndexFile(const std::string& path);
/// Parse an `.idx`. Truncated / malformed -> InputError naming the file and byte offset.
MegatronIndex readMegatronIndex(const std::string& path);
/// Megatron-LM MMIDIDX index (`.idx`): document lengths = sum of sequence sizes between
/// consecutive doc_idx boundaries. Truncated / malformed -> InputError with byte offset;
/// so is an index without a non-empty document, unless `allow_empty`.
std::vector<std::int64_t> readMegatronIdx(const std::string& path, bool allow_empty = false);
/// Write a Megatron `.idx` (used by tests and `wlb data`): one sequence per document.
void writeMegatronIdx(const std::string& path, const std::vector<std::int64_t>& doc_lengths);

/// Summary statistics of a set of lengths (for `wlb data stats`).
struct LengthStats {
  std::int64_t count = 0, total_tokens = 0, min = 0, max = 0;
  double mean = 0;
  std::vector<std::pair<double, std::int64_t>> percentiles;  ///< (p, value), p in [0,100]
  struct Bucket {
    std::int64_t lo, hi;  ///< [lo, hi)
    std::int64_t count, tokens;
  };
  std::vector<Bucket> buckets;  ///< power-of-two buckets relative to `window`
};
LengthStats computeLengthStats(std::vector<std::int64_t> lengths, std::int64_t window);

}  // namespace wlb::data
