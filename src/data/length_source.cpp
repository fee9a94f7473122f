// Length sources: generator presets, file readers, the original-dataloader step assembler.
#include "data/length_source.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/input_file.hpp"
#include "core/json_text.hpp"
#include "core/output_file.hpp"

namespace wlb::data {

// ---- RNG ---------------------------------------------------------------------------
namespace {
std::uint64_t splitmix64(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
inline std::uint64_t rotl(std::uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}
}  // namespace

Rng::Rng(std::uint64_t seed, std::uint64_t stream) {
  std::uint64_t x = seed ^ (stream * 0xd1b54a32d192ed03ULL + 0x632be59bd9b4e019ULL);
  for (auto& s : s_) s = splitmix64(x);
}

std::uint64_t Rng::nextU64() {
  const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const std::uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() {
  return static_cast<double>(nextU64() >> 11) * 0x1.0p-53;
}

double Rng::normal() {
  double u1 = uniform();
  while (u1 <= 0.0) u1 = uniform();
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

// ---- Presets ---------------------------------------------------------------------------
const std::vector<PresetSpec>& presets() {
  static const std::vector<PresetSpec> p = {
      {"long_context_128k",
       "long-context continued-pretraining mix for a 128K window: short web documents plus "
       "a log-uniform tail of books/repositories/papers reaching the window",
       {{0.93, "lognormal", 1000.0, 1.3}, {0.07, "loguniform", 8192.0, 163840.0}},
       131072,
       "shape of WLB-LLM (OSDI'25) Fig. 2/3 length distribution; per-source long-document "
       "upsampling of Fu et al. 2024 (data engineering for 128K context)"},
      {"pile",
       "Pile-like mix: web/papers/code body plus a rare book component",
       {{0.99824, "lognormal", 700.0, 1.1}, {0.00176, "lognormal", 100000.0, 0.7}},
       0,
       "Gao et al. 2020 (The Pile), Table 1: mean document size 5.91 KiB over the "
       "epoch-weighted mix (~1.5K tokens at ~4 bytes/token); Books3/PG-19/BookCorpus "
       "(mean 370-540 KiB per document) carry ~15% of the bytes"},
      {"code",
       "code-repository mix: single source files plus repository-level concatenations",
       {{0.85, "lognormal", 600.0, 1.4}, {0.15, "lognormal", 12000.0, 1.5}},
       0,
       "Pile GitHub mean file 5.25 KiB (~1.6K tokens at ~3.3 bytes/token); repository-level "
       "documents as in StarCoder2/DeepSeek-Coder repo-context training (assumed median 12K)"},
      {"wikipedia",
       "Wikipedia-like: many stubs, a heavy tail of long articles",
       {{1.0, "lognormal", 150.0, 1.15}},
       0,
       "Pile Wikipedia (en) mean document size 1.11 KiB (~285 tokens at ~4 bytes/token)"},
      {"sft_chat",
       "SFT/chat conversations with a small long-context QA tail",
       {{0.98, "lognormal", 600.0, 0.9}, {0.02, "loguniform", 4096.0, 32768.0}},
       0,
       "ShareGPT/Vicuna-style conversations average ~1K tokens (median ~600); "
       "long-document QA tail assumed 2%"},
  };
  return p;
}

std::vector<std::string> presetNames() {
  std::vector<std::string> n;
  for (const auto& p : presets()) n.push_back(p.name);
  return n;
}

const PresetSpec& presetByName(const std::string& name) {
  for (const auto& p : presets())
    if (p.name == name) return p;
  std::string valid;
  for (const auto& n : presetNames()) valid += (valid.empty() ? "" : ", ") + n;
  throw InputError(fmt::format("data.preset: unknown preset '{}' (valid: {})", name, valid), true);
}

std::int64_t sampleLength(const PresetSpec& p, Rng& rng, double scale, std::int64_t cap) {
  double u = rng.uniform();
  const PresetSpec::Component* c = &p.components.back();
  for (const auto& comp : p.components) {
    if (u < comp.weight) {
      c = &comp;
      break;
    }
    u -= comp.weight;
  }
  double x = 1.0;
  if (c->kind == "lognormal") {
    x = std::exp(std::log(c->p1) + c->p2 * rng.normal());
  } else if (c->kind == "loguniform") {
    x = std::exp(std::log(c->p1) + rng.uniform() * (std::log(c->p2) - std::log(c->p1)));
  } else {  // pareto
    x = c->p1 * std::pow(1.0 - rng.uniform(), -1.0 / c->p2);
  }
  if (p.max_length > 0) x = std::min(x, static_cast<double>(p.max_length));
  x *= scale;
  std::int64_t len = static_cast<std::int64_t>(std::llround(std::min(x, 1e15)));
  len = std::max<std::int64_t>(1, len);
  if (cap > 0) len = std::min(len, cap);
  return len;
}

// ---- LengthSource base --------------------------------------------------------------------
LengthSource::~LengthSource() = default;

LengthSource::LengthSource(std::int64_t sequences_per_step, std::int64_t context_window)
    : sequences_(sequences_per_step), window_(context_window) {
  if (sequences_ < 1 || window_ < 1) throw InputError("length source: need dp*M >= 1 and context_window >= 1", true);
}

std::vector<Document> LengthSource::next(std::int64_t step) {
  if (step != next_step_)
    throw InputError(fmt::format("length source: asked for step {} but the next step is {}", step, next_step_));
  beginStep(step);
  std::vector<Document> docs;
  std::int64_t used = 0, room = 0;
  for (;;) {
    const std::int64_t d = held_ > 0 ? held_ : draw();
    held_ = 0;
    if (d <= room) {
      room -= d;
    } else {
      const std::int64_t need = (d + window_ - 1) / window_;
      if (used + need > sequences_ && !docs.empty()) {
        held_ = d;
        break;
      }
      used += need;
      room = need * window_ - d;
    }
    docs.push_back(Document{next_id_++, d, step});
    if (used > sequences_ || (used == sequences_ && room == 0)) break;
  }
  ++next_step_;
  return docs;
}

nlohmann::json LengthSource::saveState() const {
  // "stream" identifies what the cursor points into: a resume on another stream (seed,
  // preset, file, window, batch shape) would silently mix two streams
  return {{"next_step", next_step_},
          {"next_id", next_id_},
          {"held", held_},
          {"extra", saveExtra()},
          {"stream", {{"source", describe()}, {"window", window_}, {"sequences", sequences_}}}};
}

void LengthSource::loadState(const nlohmann::json& s) {
  // Name what is missing: the JSON library's "key 'x' not found" does not say what was read.
  if (!s.is_object()) throw InputError("length source state: expected a JSON object (a state_dict of a length source)");
  for (const char* key : {"next_step", "next_id", "held", "extra"})
    if (!s.contains(key))
      throw InputError(fmt::format("length source state: no '{}' (not the state of a length source)", key));
  if (s.contains("stream")) {  // checkpoints before this key carry no identity
    const auto& st = s.at("stream");
    std::string diff;
    auto cmp = [&](const char* what, const std::string& was, const std::string& now) {
      if (was != now)
        diff += fmt::format("{}{} {} (checkpoint) vs {} (deck)", diff.empty() ? "" : "; ", what, was, now);
    };
    try {
      cmp("source", st.at("source").get<std::string>(), describe());
      cmp("window", std::to_string(st.at("window").get<std::int64_t>()), std::to_string(window_));
      cmp("sequences per step", std::to_string(st.at("sequences").get<std::int64_t>()), std::to_string(sequences_));
    } catch (const nlohmann::json::exception& e) {
      throw InputError(fmt::format("length source state: {}", e.what()));
    }
    if (!diff.empty())
      throw InputError("the checkpoint was taken on another document stream: " + diff +
                       "; resume with the deck that wrote it");
  }
  // All or nothing: a bad field leaves the source as it was.
  try {
    const auto next_step = s.at("next_step").get<std::int64_t>();
    const auto next_id = s.at("next_id").get<std::int64_t>();
    const auto held = s.at("held").get<std::int64_t>();
    // Ids are int64 and grow by one a document: a cursor near the top would wrap them.
    constexpr std::int64_t kMaxId = std::int64_t{1} << 53;
    if (next_step < 0 || next_id < 0 || next_id > kMaxId)
      throw InputError(fmt::format("length source state: next_step {} / next_id {} must be >= 0 (next_id <= 2^53)",
                                   next_step, next_id));
    // Every step draws at least one document, so a cursor past its ids was edited.
    if (next_step > next_id)
      throw InputError(
          fmt::format("length source state: next_step {} is past next_id {} (every step draws at least one document)",
                      next_step, next_id));
    if (held < 0 || held > kMaxDocTokens)
      throw InputError(
          fmt::format("length source state: held = {} is not a document length in [0, {}]", held, kMaxDocTokens));
    loadExtra(s.at("extra"), next_id, held);  // validates before it assigns
    next_step_ = next_step;
    next_id_ = next_id;
    held_ = held;
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("length source state: {}", e.what()));
  }
}

// ---- Concrete sources -------------------------------------------------------------------
namespace {

class GeneratorSource final : public LengthSource {
 public:
  GeneratorSource(const PresetSpec& p, std::uint64_t seed, double scale, std::int64_t seqs, std::int64_t window)
      : LengthSource(seqs, window), preset_(p), seed_(seed), scale_(scale), rng_(seed) {}
  std::string describe() const override {
    return fmt::format("generator:{} (seed {}, length_scale {})", preset_.name, seed_, scale_);
  }

 protected:
  void beginStep(std::int64_t step) override { rng_ = Rng(seed_, static_cast<std::uint64_t>(step) + 1); }
  std::int64_t draw() override { return sampleLength(preset_, rng_, scale_, contextWindow()); }

 private:
  PresetSpec preset_;
  std::uint64_t seed_;
  double scale_;
  Rng rng_;
};

class ArraySource final : public LengthSource {
 public:
  ArraySource(std::vector<std::int64_t> lengths, std::string desc, std::int64_t seqs, std::int64_t window)
      : LengthSource(seqs, window), lengths_(std::move(lengths)), desc_(std::move(desc)) {}
  std::string describe() const override { return desc_; }
  std::int64_t documentsPerEpoch() const override { return static_cast<std::int64_t>(lengths_.size()); }

 protected:
  void beginStep(std::int64_t) override {}
  std::int64_t draw() override {
    const auto n = static_cast<std::int64_t>(lengths_.size());
    return lengths_[static_cast<std::size_t>(cursor_++ % n)];
  }
  nlohmann::json saveExtra() const override { return {{"cursor", cursor_}}; }
  void loadExtra(const nlohmann::json& j, DocId next_id, std::int64_t held) override {
    const auto c = j.at("cursor").get<std::int64_t>();
    if (c < 0) throw InputError(fmt::format("length source state: extra.cursor = {} must be >= 0", c));
    // Every length drawn is a document with an id, or the one held back for the next step:
    // an edited cursor, id or held length would give documents other lengths or ids.
    if (c != next_id + (held > 0 ? 1 : 0) ||
        (held > 0 && held != lengths_[static_cast<std::size_t>((c - 1) % static_cast<std::int64_t>(lengths_.size()))]))
      throw InputError(
          fmt::format("length source state: extra.cursor = {}, next_id = {} and held = {} do not "
                      "belong together (a cursor is next_id, plus one while a length is held back, "
                      "and a held length is the one at the cursor before it)",
                      c, next_id, held));
    cursor_ = c;
  }

 private:
  std::vector<std::int64_t> lengths_;
  std::string desc_;
  std::int64_t cursor_ = 0;  ///< total documents drawn (file index = cursor % n)
};

}  // namespace

std::unique_ptr<LengthSource> makeArraySource(std::vector<std::int64_t> lengths, std::string desc,
                                              std::int64_t sequences_per_step, std::int64_t context_window) {
  return std::make_unique<ArraySource>(std::move(lengths), std::move(desc), sequences_per_step, context_window);
}

std::int64_t microBatchesPerReplica(const Deck& deck) {
  return deck.packing.micro_batches > 0 ? deck.packing.micro_batches : std::max<std::int64_t>(1, deck.mesh.pp);
}

std::int64_t resolvedSMax(const Deck& deck) {
  return deck.data.s_max > 0 ? deck.data.s_max : deck.data.context_window;
}

std::string resolvePath(const Deck& deck, const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  if (!deck.source_path.empty()) {
    const auto slash = deck.source_path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : deck.source_path.substr(0, slash);
    std::string cand = dir + "/" + path;
    std::ifstream f(cand);
    if (f.good()) return cand;
  }
  return path;
}

std::string resolveDatasetPrefix(const Deck& deck, const std::string& prefix) {
  namespace fs = std::filesystem;
  if (prefix.empty() || prefix[0] == '/' || deck.source_path.empty()) return prefix;
  const fs::path cand = fs::path(deck.source_path).parent_path() / prefix;
  std::error_code ec;
  if (fs::exists(cand.string() + "_train.idx", ec)) return cand.string();
  return prefix;
}

std::unique_ptr<LengthSource> makeLengthSource(const Deck& deck) {
  const std::int64_t seqs = deck.mesh.dp * microBatchesPerReplica(deck);
  const std::int64_t S = deck.data.context_window;
  const auto& src = deck.data.source;
  if (src == "generator") {
    if (!(deck.data.length_scale > 0)) throw InputError("data.length_scale: must be > 0", true);
    return std::make_unique<GeneratorSource>(presetByName(deck.data.preset), deck.data.seed, deck.data.length_scale,
                                             seqs, S);
  }
  if (deck.data.path.empty()) throw InputError(fmt::format("data.path: required when data.source = '{}'", src), true);
  const std::string path = resolvePath(deck, deck.data.path);
  std::vector<std::int64_t> lengths;
  if (src == "text")
    lengths = readTextLengths(path);
  else if (src == "jsonl")
    lengths = readJsonlLengths(path, deck.data.jsonl_field);
  else if (src == "megatron")
    lengths = readMegatronIdx(path);
  else
    throw InputError(fmt::format("data.source: unknown source '{}' (valid: generator, text, "
                                 "jsonl, megatron)",
                                 src),
                     true);
  return makeArraySource(std::move(lengths), src + ":" + deck.data.path, seqs, S);
}

// ---- Readers -----------------------------------------------------------------------------
namespace {
std::ifstream openOrThrow(const std::string& path, std::ios::openmode mode = std::ios::in) {
  return openInput(path, "length file", mode, true);
}
std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}
// A bad value as a message shows it: at most 60 bytes, other than printable ASCII as \xNN (a
// 10 MB line, invalid UTF-8 or a bare CR would otherwise go into the message as they are).
std::string excerpt(const std::string& s) {
  constexpr std::size_t kMax = 60;
  std::string out;
  for (std::size_t i = 0; i < s.size() && i < kMax; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    out += c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c)) : fmt::format("\\x{:02x}", c);
  }
  if (s.size() > kMax) out += fmt::format("... ({} bytes)", s.size());
  return out;
}
}  // namespace

std::vector<std::int64_t> readTextLengths(const std::string& path) {
  auto f = openOrThrow(path);
  std::vector<std::int64_t> out;
  std::string line;
  std::int64_t lineno = 0;
  while (std::getline(f, line)) {
    ++lineno;
    const auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    const std::string t = trim(line);
    if (t.empty()) continue;
    std::size_t pos = 0;
    long long v = 0;
    bool ok = true;
    try {
      v = std::stoll(t, &pos);
    } catch (...) {
      ok = false;
    }
    if (!ok || pos != t.size() || v <= 0)
      throw InputError(
          fmt::format("{}:{}: expected a positive integer document length, got '{}'", path, lineno, excerpt(t)), true);
    if (v > kMaxDocTokens)
      throw InputError(
          fmt::format("{}:{}: document length {} exceeds the limit of {} tokens", path, lineno, v, kMaxDocTokens),
          true);
    out.push_back(v);
  }
  if (out.empty()) throw InputError(fmt::format("{}: no document lengths found", path), true);
  return out;
}

std::vector<std::int64_t> readJsonlLengths(const std::string& path, const std::string& field) {
  auto f = openOrThrow(path);
  std::vector<std::int64_t> out;
  std::string line;
  std::int64_t lineno = 0;
  while (std::getline(f, line)) {
    ++lineno;
    if (trim(line).empty()) continue;
    nlohmann::json j;
    try {
      j = parseJsonText(line);
    } catch (const nlohmann::json::exception& e) {
      throw InputError(fmt::format("{}:{}: invalid JSON: {}", path, lineno, e.what()), true);
    }
    if (!j.is_object() || !j.contains(field))
      throw InputError(fmt::format("{}:{}: missing field '{}'", path, lineno, field), true);
    const auto& v = j[field];
    if (!v.is_number_integer() || v.get<std::int64_t>() <= 0)
      throw InputError(
          fmt::format("{}:{}: field '{}' must be a positive integer, got {}", path, lineno, field, excerpt(v.dump())),
          true);
    if (v.get<std::int64_t>() > kMaxDocTokens)
      throw InputError(fmt::format("{}:{}: field '{}' = {} exceeds the limit of {} tokens", path, lineno, field,
                                   v.dump(), kMaxDocTokens),
                       true);
    out.push_back(v.get<std::int64_t>());
  }
  if (out.empty()) throw InputError(fmt::format("{}: no document lengths found", path), true);
  return out;
}

namespace {

struct ByteReader {
  const std::string& path;
  const std::vector<char>& buf;
  std::size_t pos = 0;
  template <class T>
  T read(const char* what) {
    if (pos + sizeof(T) > buf.size())
      throw InputError(fmt::format("{}: truncated Megatron index at byte offset {} (reading {}, "
                                   "file has {} bytes)",
                                   path, pos, what, buf.size()),
                       true);
    T v;
    std::memcpy(&v, buf.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  /// `count` elements of `size` bytes must follow; checked by division so that a huge
  /// count (e.g. 2^62) cannot overflow the byte count into a small one.
  void need(std::uint64_t count, std::uint64_t size, const char* what) {
    const std::uint64_t left = pos <= buf.size() ? buf.size() - pos : 0;
    if (count > left / size)
      throw InputError(fmt::format("{}: truncated Megatron index at byte offset {} ({}: {} entries of "
                                   "{} bytes, {} bytes left in a file of {})",
                                   path, pos, what, count, size, left, buf.size()),
                       true);
  }
};
}  // namespace

bool isMegatronIndexFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char head[sizeof kMegatronIdxMagic] = {};
  return f.read(head, sizeof head) && std::memcmp(head, kMegatronIdxMagic, sizeof head) == 0;
}

MegatronIndex readMegatronIndex(const std::string& path) {
  auto f = openOrThrow(path, std::ios::binary);
  std::vector<char> buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ByteReader r{path, buf};
  r.need(9, 1, "magic");
  if (std::memcmp(buf.data(), kMegatronIdxMagic, sizeof kMegatronIdxMagic) != 0)
    throw InputError(fmt::format("{}: byte offset 0: not a Megatron MMIDIDX index (bad magic)", path), true);
  r.pos = 9;
  const auto version = r.read<std::uint64_t>("version");
  if (version != 1)
    throw InputError(fmt::format("{}: byte offset 9: unsupported index version {} (expected 1)", path, version), true);
  MegatronIndex idx;
  idx.dtype = r.read<std::uint8_t>("dtype code");
  if (idx.dtype < 1 || idx.dtype > 8)
    throw InputError(fmt::format("{}: byte offset 17: invalid dtype code {} (expected 1..8)", path, int(idx.dtype)),
                     true);
  const auto nseq = r.read<std::uint64_t>("sequence count");
  const auto ndoc = r.read<std::uint64_t>("document count");
  const std::size_t sizes_at = r.pos;
  r.need(nseq, 4, "sizes[]");
  idx.sizes.resize(nseq);
  if (nseq) std::memcpy(idx.sizes.data(), buf.data() + r.pos, nseq * 4);
  r.pos += nseq * 4;
  r.need(nseq, 8, "pointers[]");
  idx.pointers.resize(nseq);
  if (nseq) std::memcpy(idx.pointers.data(), buf.data() + r.pos, nseq * 8);
  r.pos += nseq * 8;
  const std::size_t doc_at = r.pos;
  r.need(ndoc, 8, "doc_idx[]");
  idx.doc_idx.resize(ndoc);
  if (ndoc) std::memcpy(idx.doc_idx.data(), buf.data() + r.pos, ndoc * 8);
  for (std::uint64_t i = 0; i < nseq; ++i)
    if (idx.sizes[i] < 0)
      throw InputError(
          fmt::format("{}: byte offset {}: negative sequence size {}", path, sizes_at + 4 * i, idx.sizes[i]), true);
  // Byte offsets into the .bin: a token reader (python/wlb/megatron.py) slices them, so one
  // that is negative or not a whole token would read other tokens without a word.
  static constexpr int kItemSize[] = {0, 1, 1, 2, 4, 8, 8, 4, 2};  // by dtype code 1..8
  const std::int64_t item = kItemSize[idx.dtype];
  for (std::uint64_t i = 0; i < nseq; ++i)
    if (idx.pointers[i] < 0 || idx.pointers[i] % item != 0)
      throw InputError(fmt::format("{}: byte offset {}: invalid pointers[{}] = {} (must be >= 0 and a multiple of "
                                   "the {}-byte token)",
                                   path, sizes_at + 4 * nseq + 8 * i, i, idx.pointers[i], item),
                       true);
  for (std::uint64_t i = 0; i < ndoc; ++i) {
    const auto b = idx.doc_idx[i];
    const bool bad =
        b < 0 || static_cast<std::uint64_t>(b) > nseq || (i == 0 && b != 0) || (i > 0 && b < idx.doc_idx[i - 1]);
    if (bad)
      throw InputError(fmt::format("{}: byte offset {}: invalid doc_idx[{}] = {} (must start at "
                                   "0, be non-decreasing and <= sequence count {})",
                                   path, doc_at + 8 * i, i, b, nseq),
                       true);
  }
  // Megatron's doc_idx always holds the leading 0 and ends at the sequence count: sequences
  // past its last entry belong to no document and would be dropped without a word.
  if (ndoc == 0)
    throw InputError(
        fmt::format("{}: byte offset {}: doc_idx is empty (expected at least the leading 0)", path, doc_at), true);
  if (static_cast<std::uint64_t>(idx.doc_idx.back()) != nseq)
    throw InputError(fmt::format("{}: byte offset {}: doc_idx ends at sequence {}, but the index holds {} sequences "
                                 "(the last {} belong to no document)",
                                 path, doc_at + 8 * (ndoc - 1), idx.doc_idx.back(), nseq,
                                 nseq - static_cast<std::uint64_t>(idx.doc_idx.back())),
                     true);
  idx.doc_idx_offset = doc_at;
  return idx;
}

std::vector<std::int64_t> readMegatronIdx(const std::string& path, bool allow_empty) {
  const auto idx = readMegatronIndex(path);
  std::vector<std::int64_t> out;
  for (std::size_t i = 1; i < idx.doc_idx.size(); ++i) {
    std::int64_t len = 0;
    for (auto s = idx.doc_idx[i - 1]; s < idx.doc_idx[i]; ++s) len += idx.sizes[static_cast<std::size_t>(s)];
    if (len > kMaxDocTokens)
      throw InputError(fmt::format("{}: byte offset {}: document {} has {} tokens, over the limit of {}", path,
                                   idx.doc_idx_offset + 8 * i, i - 1, len, kMaxDocTokens),
                       true);
    if (len > 0) out.push_back(len);  // empty documents are skipped (docs/data.md)
  }
  if (out.empty() && !allow_empty) throw InputError(fmt::format("{}: index holds no non-empty documents", path), true);
  return out;
}

void writeMegatronIdx(const std::string& path, const std::vector<std::int64_t>& lens) {
  std::string buf;
  auto put = [&](const void* p, std::size_t n) { buf.append(static_cast<const char*>(p), n); };
  put(kMegatronIdxMagic, sizeof kMegatronIdxMagic);
  const std::uint64_t version = 1, nseq = lens.size(), ndoc = lens.size() + 1;
  const std::uint8_t dtype = 4;  // int32 tokens
  put(&version, 8);
  put(&dtype, 1);
  put(&nseq, 8);
  put(&ndoc, 8);
  for (auto l : lens) {
    const std::int32_t s = static_cast<std::int32_t>(l);
    put(&s, 4);
  }
  std::int64_t ptr = 0;
  for (auto l : lens) {
    put(&ptr, 8);
    ptr += l * 4;
  }
  for (std::int64_t i = 0; i <= static_cast<std::int64_t>(lens.size()); ++i) put(&i, 8);
  // whole or not at all (a full disk, a file-size limit), and never over a device
  writeFileAtomically(path, "Megatron index", buf);
}

// ---- Stats ------------------------------------------------------------------------------
LengthStats computeLengthStats(std::vector<std::int64_t> v, std::int64_t window) {
  LengthStats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.count = static_cast<std::int64_t>(v.size());
  for (auto x : v) s.total_tokens += x;
  s.min = v.front();
  s.max = v.back();
  s.mean = static_cast<double>(s.total_tokens) / static_cast<double>(s.count);
  for (double p : {10.0, 25.0, 50.0, 75.0, 90.0, 99.0, 99.9}) {
    const auto idx =
        static_cast<std::size_t>(std::min<double>(static_cast<double>(v.size() - 1), std::floor(p / 100.0 * v.size())));
    s.percentiles.push_back({p, v[idx]});
  }
  // Buckets: [1, S/128), [S/128, S/64), ..., [S/2, S], (S, inf).
  std::vector<std::int64_t> edges = {1};
  for (int k = 7; k >= 1; --k)
    if ((window >> k) > edges.back()) edges.push_back(window >> k);
  edges.push_back(window + 1);
  edges.push_back(std::numeric_limits<std::int64_t>::max());
  for (std::size_t i = 0; i + 1 < edges.size(); ++i) s.buckets.push_back({edges[i], edges[i + 1], 0, 0});
  for (auto x : v) {
    for (auto& b : s.buckets)
      if (x >= b.lo && x < b.hi) {
        ++b.count;
        b.tokens += x;
        break;
      }
  }
  return s;
}

}  // namespace wlb::data
