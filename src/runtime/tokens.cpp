/// \file tokens.cpp
/// \brief Token rows of a unit of work (see tokens.hpp).

#include "runtime/tokens.hpp"

#include <algorithm>
#include <filesystem>
#include <set>
#include <stdexcept>
#include <string>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "data/length_source.hpp"
#include "data/prepare.hpp"

namespace wlb::runtime {
SyntheticTokens::SyntheticTokens(std::uint64_t seed, int vocab)
    : base_(mix64(seed ^ 0x746f6b656e73ULL)), vocab_(static_cast<std::uint64_t>(vocab)) {
  if (vocab < 1) throw std::invalid_argument("SyntheticTokens: vocabulary must be >= 1");
}

std::int32_t SyntheticTokens::token(DocId doc, std::int64_t pos) const {
  const std::uint64_t key = (static_cast<std::uint64_t>(doc) << 32) ^ static_cast<std::uint64_t>(pos);
  return static_cast<std::int32_t>(mix64(base_ + key) % vocab_);
}

DatasetTokens::DatasetTokens(std::shared_ptr<const data::IndexedDataset> ds, int vocab, std::string name)
    : ds_(std::move(ds)), vocab_(vocab), name_(std::move(name)) {
  if (ds_->documents() < 1) throw InputError(name_ + ": the dataset holds no document");
}

std::unique_ptr<TokenSource> tokenSourceOf(const Deck& deck) {
  const int vocab = static_cast<int>(deck.model.vocab);
  if (deck.data.source == "megatron") {
    const std::string idx = data::resolvePath(deck, deck.data.path);
    const std::string prefix =
        idx.size() > 4 && idx.compare(idx.size() - 4, 4, ".idx") == 0 ? idx.substr(0, idx.size() - 4) : idx;
    if (std::filesystem::exists(prefix + ".bin")) {
      auto ds = std::make_shared<const data::IndexedDataset>(prefix);
      for (std::int64_t d = 0; d < ds->documents(); ++d)
        if (ds->length(d) == 0)
          throw InputError("data.path: " + idx + " holds empty documents (document " + std::to_string(d) +
                           "), which the length stream skips: its tokens could not be matched; prepare the "
                           "dataset with `wlb data prepare`");
      return std::make_unique<DatasetTokens>(std::move(ds), vocab, idx);
    }
  }
  return std::make_unique<SyntheticTokens>(deck.data.seed, vocab);
}

namespace {
[[noreturn]] void outsideVocabulary(std::int64_t id, std::size_t pos, std::int64_t doc, const std::string& name,
                                    int vocab) {
  throw InputError("model.vocab: token " + std::to_string(id) + " at position " + std::to_string(pos) +
                   " of document " + std::to_string(doc) + " of " + name + " is outside the vocabulary of " +
                   std::to_string(vocab));
}
}  // namespace

void DatasetTokens::checkVocabulary() const {
  const std::int64_t type_max = ds_->dtype() == 1 ? 255 : 65535;  // uint8 or uint16 ids
  if (type_max < vocab_) return;
  for (std::int64_t d = 0; d < ds_->documents(); ++d) {
    const auto t = ds_->document(d);
    for (std::size_t i = 0; i < t.size(); ++i)
      if (static_cast<std::int64_t>(t[i]) >= vocab_) outsideVocabulary(t[i], i, d, name_, vocab_);
  }
}

std::int32_t DatasetTokens::token(DocId doc, std::int64_t pos) const {
  const std::int64_t d = doc % ds_->documents();
  auto it = cache_.find(d);
  if (it == cache_.end()) {
    const auto t = ds_->document(d);
    std::vector<std::int32_t> ids(t.begin(), t.end());
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (ids[i] >= vocab_) outsideVocabulary(ids[i], i, d, name_, vocab_);
    it = cache_.emplace(d, std::move(ids)).first;
  }
  if (pos < 0 || pos >= static_cast<std::int64_t>(it->second.size()))
    throw InputError(name_ + ": position " + std::to_string(pos) + " is past the end of document " + std::to_string(d) +
                     " (" + std::to_string(it->second.size()) +
                     " tokens): a plan or checkpoint made over another dataset");
  return it->second[static_cast<std::size_t>(pos)];
}

MicroBatch ListTokens::wholeDocuments() const {
  MicroBatch mb;
  for (std::size_t d = 0; d < docs_.size(); ++d) {
    Segment s;
    s.doc = static_cast<DocId>(d);
    s.length = static_cast<std::int64_t>(docs_[d].size());
    mb.segments.push_back(s);
  }
  return mb;
}

void appendPieceRows(const Segment& s, bool continued, std::int64_t q0, std::int64_t q, std::vector<TokenRef>& out) {
  for (std::int64_t i = q0; i < q0 + q; ++i)
    out.push_back(
        TokenRef{s.doc, s.offset + i, static_cast<std::int32_t>(s.q_offset + i), i + 1 < s.length || continued});
}

void appendSegmentRows(const Segment& s, bool continued, std::vector<TokenRef>& out) {
  appendPieceRows(s, continued, 0, s.length, out);
}

void touchTokens(const TokenSource& src, const std::vector<MicroBatch>& mbs) {
  for (const auto& mb : mbs)
    for (const auto& s : mb.segments)
      if (s.length > 0) (void)src.token(s.doc, s.offset);
}

std::int64_t predictedRows(const StepPlan& plan) {
  std::int64_t n = 0;
  for (const auto& replica : plan.replicas) {
    std::set<std::pair<DocId, std::int64_t>> slice_starts;
    for (const auto& mb : replica)
      for (const auto& s : mb.segments)
        if (s.q_offset > 0) slice_starts.insert({s.doc, s.offset});
    for (const auto& mb : replica)
      for (const auto& s : mb.segments) n += s.length - 1 + (slice_starts.count({s.doc, s.offset + s.length}) ? 1 : 0);
  }
  return n;
}

TokenRows TokenRows::make(const Space& space, const TokenSource& src, const std::vector<TokenRef>& rows, int vocab) {
  TokenRows r;
  r.n = static_cast<std::int64_t>(rows.size());
  const auto n = rows.size();
  std::vector<std::int32_t> tok(n), tgt(n), pos(n);
  for (std::size_t i = 0; i < n; ++i) {
    const TokenRef& t = rows[i];
    tok[i] = src.token(t.doc, t.pos);
    tgt[i] = t.target ? src.token(t.doc, t.pos + 1) : -1;
    pos[i] = t.rope;
    if (tok[i] < 0 || tok[i] >= vocab || tgt[i] < -1 || tgt[i] >= vocab)
      throw std::invalid_argument("token " + std::to_string(tok[i] < 0 || tok[i] >= vocab ? tok[i] : tgt[i]) +
                                  " outside the vocabulary of " + std::to_string(vocab));
    if (t.target) ++r.predicted;
  }
  auto up = [&](const std::vector<std::int32_t>& v, const char* label) {
    IVec d(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), v.size());
    Kokkos::deep_copy(space, d, Kokkos::View<const std::int32_t*, Kokkos::HostSpace>(v.data(), v.size()));
    return d;
  };
  std::vector<std::int32_t> order(n), begin, uniq;
  for (std::size_t i = 0; i < n; ++i) order[i] = static_cast<std::int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return tok[static_cast<std::size_t>(a)] < tok[static_cast<std::size_t>(b)];
  });
  for (std::size_t i = 0; i < n; ++i)
    if (i == 0 || tok[static_cast<std::size_t>(order[i])] != tok[static_cast<std::size_t>(order[i - 1])]) {
      begin.push_back(static_cast<std::int32_t>(i));
      uniq.push_back(tok[static_cast<std::size_t>(order[i])]);
    }
  begin.push_back(static_cast<std::int32_t>(n));
  r.by_token = up(order, "wlb::runtime::rows_by_token");
  r.token_begin = up(begin, "wlb::runtime::token_begin");
  r.unique_tokens = up(uniq, "wlb::runtime::unique_tokens");
  r.tokens = up(tok, "wlb::runtime::tokens");
  r.targets = up(tgt, "wlb::runtime::targets");
  r.positions = up(pos, "wlb::runtime::positions");
  kk::fence(space, "wlb::runtime::rows");  // the host vectors go out of scope
  return r;
}

}  // namespace wlb::runtime
