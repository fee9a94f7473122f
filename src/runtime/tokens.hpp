#pragma once
/// \file tokens.hpp
/// \brief The token rows of one unit of work (a micro-batch's CP share, a SlimPack
/// MicroPack) as the model consumes them: token ids, next-token targets and RoPE positions.
///
/// Contract (the one definition of what a row sees, for every packing, slicing, pipeline
/// and CP sharding of the same documents):
/// * A row is a document token (doc, pos). Its RoPE position is its index in its attention
///   span: q_offset + i for token i of a segment (positions restart at every segment; a
///   SlimPack slice continues its document's span).
/// * Its target is the token (doc, pos + 1) when that token is in the same span: inside the
///   segment, or at the start of the slice that continues it; otherwise none (-1), so no
///   loss crosses a document (or an `original` packer's piece) boundary.
/// * Token ids come from a TokenSource keyed by (doc, pos): a `wlb data prepare` dataset, or
///   synthetic ids hashed from (seed, doc, pos) for generated length streams.

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/deck.hpp"
#include "core/types.hpp"
#include "runtime/llama.hpp"

namespace wlb::data {
class IndexedDataset;
}

namespace wlb::runtime {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  /// Token `pos` of document `doc` (within the document's length).
  virtual std::int32_t token(DocId doc, std::int64_t pos) const = 0;
  /// Drop what was cached for the documents read so far (a step boundary).
  virtual void forget() const {}
};

/// mix64(mix64(seed ^ 0x746f6b656e73) + ((doc << 32) ^ pos)) mod vocab (unsigned 64-bit
/// arithmetic, mix64 = the splitmix64 finaliser): any document length, any vocabulary;
/// bench/torch_step.py computes the same ids.
class SyntheticTokens : public TokenSource {
 public:
  SyntheticTokens(std::uint64_t seed, int vocab);
  std::int32_t token(DocId doc, std::int64_t pos) const override;

 private:
  std::uint64_t base_;
  std::uint64_t vocab_;
};

/// Document `doc % documents` of a dataset (the length source numbers documents by stream
/// position; epochs repeat the dataset). Documents are read once and cached until
/// forget() (a step's documents are read by several units).
class DatasetTokens : public TokenSource {
 public:
  /// InputError naming the dataset when a document holds a token >= vocab.
  DatasetTokens(std::shared_ptr<const data::IndexedDataset> ds, int vocab, std::string name);
  std::int32_t token(DocId doc, std::int64_t pos) const override;
  void forget() const override { cache_.clear(); }
  /// Every id of the dataset against the vocabulary, before a run starts (the InputError
  /// token() would raise when the document is first read). Free when the dataset's token
  /// type cannot hold an id >= vocab; otherwise one pass over the .bin.
  void checkVocabulary() const;

 private:
  std::shared_ptr<const data::IndexedDataset> ds_;
  int vocab_;
  std::string name_;
  mutable std::unordered_map<std::int64_t, std::vector<std::int32_t>> cache_;
};

/// The ids of a deck's length stream in `wlb run`: a `data.source = "megatron"` stream whose
/// .idx has its .bin beside it reads the dataset (InputError when it holds empty documents,
/// which the stream skips, or ids >= model.vocab); every other source gets synthetic ids
/// from (data.seed, model.vocab).
std::unique_ptr<TokenSource> tokenSourceOf(const Deck& deck);

/// Documents given as token lists: document d is docs[d] (tests, small tools).
class ListTokens : public TokenSource {
 public:
  explicit ListTokens(std::vector<std::vector<std::int32_t>> docs) : docs_(std::move(docs)) {}
  std::int32_t token(DocId doc, std::int64_t pos) const override {
    return docs_.at(static_cast<std::size_t>(doc)).at(static_cast<std::size_t>(pos));
  }
  /// One micro-batch holding every document whole, in order.
  MicroBatch wholeDocuments() const;

 private:
  std::vector<std::vector<std::int32_t>> docs_;
};

/// One row: a document token and what the model needs of it.
struct TokenRef {
  DocId doc = 0;
  std::int64_t pos = 0;   ///< position in the document
  std::int32_t rope = 0;  ///< position in its attention span
  bool target = false;    ///< (doc, pos + 1) is its target
};

/// The rows of segment `s` in order; `continued`: a slice of its document starts where it
/// ends (its last token then has a target).
void appendSegmentRows(const Segment& s, bool continued, std::vector<TokenRef>& out);
/// The rows of tokens [q0, q0 + q) of segment `s` (a CP piece of it), as above.
void appendPieceRows(const Segment& s, bool continued, std::int64_t q0, std::int64_t q, std::vector<TokenRef>& out);

/// Read (and so check) the first token of every segment of `mbs`: a dataset's bad ids
/// raise here, before any collective of the step.
void touchTokens(const TokenSource& src, const std::vector<MicroBatch>& mbs);

/// Rows with a target in a step: per replica, every segment's length - 1, plus one for each
/// segment a slice of its document continues (the loss's normaliser).
std::int64_t predictedRows(const StepPlan& plan);

/// A unit's rows on the device.
struct TokenRows {
  IVec tokens, targets, positions;
  /// The rows grouped by token id (for the embedding's backward): by_token holds the row
  /// indices sorted by (token, row); rows by_token[token_begin[u] .. token_begin[u+1]) have
  /// id unique_tokens[u].
  IVec by_token, token_begin, unique_tokens;
  std::int64_t n = 0;
  std::int64_t predicted = 0;  ///< rows with a target
  /// Ids from `src`; std::invalid_argument for an id outside [0, vocab).
  static TokenRows make(const Space& space, const TokenSource& src, const std::vector<TokenRef>& rows, int vocab);
};

}  // namespace wlb::runtime
