// Megatron-LM .bin/.idx token datasets: writer and reader (docs/data.md).
#include "data/indexed_dataset.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

#include "core/error.hpp"

namespace wlb::data {

namespace fs = std::filesystem;

namespace {
constexpr std::int64_t kMaxSequence = std::numeric_limits<std::int32_t>::max();

void removeQuietly(const std::string& p) {
  std::error_code ec;
  fs::remove(p, ec);
}

void renameOrThrow(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) throw InputError(fmt::format("{}: cannot rename to {}: {}", from, to, ec.message()));
}
}  // namespace

// ---- Writer ------------------------------------------------------------------------
IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix) : prefix_(std::move(prefix)) {
  const auto tmp = binPath() + ".tmp";
  bin_.open(tmp, std::ios::binary | std::ios::trunc);
  if (!bin_) throw InputError(fmt::format("{}: cannot write ({})", tmp, std::strerror(errno)));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (committed_) return;
  if (bin_.is_open()) bin_.close();
  for (const auto& t : temporaries()) removeQuietly(t);
}

void IndexedDatasetWriter::add(const Token* tokens, std::size_t n) {
  if (finished_) throw std::logic_error("IndexedDatasetWriter::add after finish");
  if (n > static_cast<std::size_t>(kMaxSequence))
    throw std::length_error(fmt::format("{}: document of {} tokens exceeds the int32 size field", prefix_, n));
  // Host byte order: Megatron reads the index and tokens with numpy in native (little-endian) order.
  bin_.write(reinterpret_cast<const char*>(tokens), static_cast<std::streamsize>(n * sizeof(Token)));
  if (!bin_) throw InputError(fmt::format("{}.tmp: write failed ({})", binPath(), std::strerror(errno)));
  sizes_.push_back(static_cast<std::int32_t>(n));
  tokens_ += static_cast<std::int64_t>(n);
}

void IndexedDatasetWriter::finish() {
  if (finished_) return;
  bin_.close();
  if (!bin_) throw InputError(fmt::format("{}.tmp: write failed ({})", binPath(), std::strerror(errno)));
  const auto tmp = idxPath() + ".tmp";
  std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
  if (!f) throw InputError(fmt::format("{}: cannot write ({})", tmp, std::strerror(errno)));
  auto put = [&](const void* p, std::size_t n) {
    f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
  };
  const std::uint64_t version = 1, nseq = sizes_.size(), ndoc = sizes_.size() + 1;
  const std::uint8_t dtype = kMegatronUint16;
  put(kMegatronIdxMagic, sizeof kMegatronIdxMagic);
  put(&version, 8);
  put(&dtype, 1);
  put(&nseq, 8);
  put(&ndoc, 8);
  put(sizes_.data(), sizes_.size() * 4);
  std::vector<std::int64_t> buf(sizes_.size());
  std::int64_t ptr = 0;
  for (std::size_t i = 0; i < sizes_.size(); ++i) {
    buf[i] = ptr;
    ptr += static_cast<std::int64_t>(sizes_[i]) * static_cast<std::int64_t>(sizeof(Token));
  }
  put(buf.data(), buf.size() * 8);
  // One sequence per document: doc_idx = 0, 1, ..., n (Megatron's document boundaries).
  buf.resize(sizes_.size() + 1);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<std::int64_t>(i);
  put(buf.data(), buf.size() * 8);
  f.close();
  if (!f) throw InputError(fmt::format("{}: write failed ({})", tmp, std::strerror(errno)));
  finished_ = true;
}

void IndexedDatasetWriter::commit() {
  finish();
  // .bin first: whoever sees the .idx also finds its .bin
  renameOrThrow(binPath() + ".tmp", binPath());
  renameOrThrow(idxPath() + ".tmp", idxPath());
  committed_ = true;
}

// ---- Reader ------------------------------------------------------------------------
IndexedDataset::IndexedDataset(const std::string& prefix)
    : bin_path_(prefix + ".bin"), index_(readMegatronIndex(prefix + ".idx")) {
  const std::string idx_path = prefix + ".idx";
  if (index_.dtype == 1)
    item_ = 1;
  else if (index_.dtype == kMegatronUint16)
    item_ = 2;
  else
    throw InputError(
        fmt::format("{}: byte offset 17: token dtype code {} is not supported for reading tokens "
                    "(1 = uint8 or 8 = uint16)",
                    idx_path, int(index_.dtype)));
  std::error_code ec;
  const auto bytes = fs::file_size(bin_path_, ec);
  if (ec) throw InputError(fmt::format("{}: cannot read ({})", bin_path_, ec.message()));
  for (std::size_t i = 0; i < index_.sizes.size(); ++i) {
    const auto p = index_.pointers[i];
    const auto end = static_cast<std::uint64_t>(index_.sizes[i]) * item_;
    if (p < 0 || static_cast<std::uint64_t>(p) > bytes || end > bytes - static_cast<std::uint64_t>(p))
      throw InputError(fmt::format("{}: sequence {} (byte {}, {} tokens) lies outside {} ({} bytes)", idx_path, i, p,
                                   index_.sizes[i], bin_path_, bytes));
  }
  bin_.open(bin_path_, std::ios::binary);
  if (!bin_) throw InputError(fmt::format("{}: cannot read ({})", bin_path_, std::strerror(errno)));
}

std::int64_t IndexedDataset::length(std::int64_t doc) const {
  if (doc < 0 || doc >= documents()) throw std::out_of_range("IndexedDataset: document index");
  std::int64_t n = 0;
  for (auto s = index_.doc_idx[doc]; s < index_.doc_idx[doc + 1]; ++s) n += index_.sizes[static_cast<std::size_t>(s)];
  return n;
}

std::vector<Token> IndexedDataset::document(std::int64_t doc) const {
  std::vector<Token> out;
  out.reserve(static_cast<std::size_t>(length(doc)));
  std::vector<unsigned char> raw;
  for (auto s = index_.doc_idx[doc]; s < index_.doc_idx[doc + 1]; ++s) {
    const auto i = static_cast<std::size_t>(s);
    raw.resize(static_cast<std::size_t>(index_.sizes[i]) * item_);
    bin_.clear();
    bin_.seekg(index_.pointers[i]);
    bin_.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size()));
    if (!bin_) throw InputError(fmt::format("{}: read failed at byte {}", bin_path_, index_.pointers[i]));
    if (item_ == 1)
      out.insert(out.end(), raw.begin(), raw.end());
    else
      for (std::size_t k = 0; k < raw.size(); k += 2) {
        Token t;
        std::memcpy(&t, raw.data() + k, 2);
        out.push_back(t);
      }
  }
  return out;
}

}  // namespace wlb::data
