// `wlb data prepare`: text documents -> Megatron-LM .bin/.idx (docs/data.md).
#include "data/prepare.hpp"

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/output_file.hpp"
#include "core/progress.hpp"

extern char** environ;

namespace wlb::data {

namespace fs = std::filesystem;

namespace {

// Another preparation's outputs (or any Megatron dataset): an index that parses whole, not
// just the magic (a text file that happens to start with it is a document).
bool isTokenDataset(const std::string& idx) {
  if (!isMegatronIndexFile(idx)) return false;
  try {
    (void)readMegatronIndex(idx);
    return true;
  } catch (const InputError&) {
    return false;
  }
}
// a document longer than this is cut: sizes are int32 in the index
constexpr std::int64_t kMaxSequence = std::numeric_limits<std::int32_t>::max();
}  // namespace

// ---- Split -------------------------------------------------------------------------
std::uint64_t documentHash(std::string_view path) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : path) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  // FNV-1a alone puts similar names close together; the finaliser spreads them
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

bool inValidSplit(std::string_view path, double fraction) {
  return static_cast<double>(documentHash(path) >> 11) * 0x1p-53 < fraction;
}

std::uint64_t shuffleKey(std::string_view path, std::int64_t piece, std::uint64_t seed) {
  std::uint64_t h = documentHash(path) + 0x9e3779b97f4a7c15ULL * (seed + 1) +
                    0xd1b54a32d192ed03ULL * static_cast<std::uint64_t>(piece);
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

// ---- Prepare -----------------------------------------------------------------------
namespace {

bool isTarball(const std::string& name) {
  auto ends = [&](std::string_view s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  for (const char* s : {".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2"})
    if (ends(s)) return true;
  return false;
}

/// A directory under $TMPDIR, removed with everything in it on scope exit.
class TempDir {
 public:
  TempDir() {
    std::error_code ec;
    auto base = fs::temp_directory_path(ec);
    if (ec) base = "/tmp";
    std::string templ = (base / "wlb-prepare-XXXXXX").string();
    if (!::mkdtemp(templ.data()))
      throw InputError(fmt::format("{}: cannot create a temporary directory ({})", templ, std::strerror(errno)));
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

/// Unpack with GNU tar (Debian's `tar`, which picks the decompressor from the file).
void untar(const std::string& tarball, const fs::path& into) {
  std::vector<std::string> args = {
      "tar", "-x", "-f", tarball, "-C", into.string(), "--no-same-owner", "--no-same-permissions"};
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, "tar", nullptr, nullptr, argv.data(), environ);
  if (rc != 0)
    throw InputError(fmt::format("{}: unpacking a tarball needs the system `tar` (Debian package tar): {}", tarball,
                                 std::strerror(rc)));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw InputError(fmt::format("{}: waiting for tar failed ({})", tarball, std::strerror(errno)));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw InputError(fmt::format("{}: `tar -x` failed (status {}): not a readable tarball", tarball,
                                 WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status)));
}

struct FileEntry {
  std::string rel;  ///< relative path with '/' separators: the sort and split key
  fs::path path;
};

std::string canonicalOf(const fs::path& p) {
  std::error_code ec;
  auto c = fs::weakly_canonical(p, ec);
  return ec ? fs::absolute(p).lexically_normal().string() : c.string();
}

std::vector<FileEntry> listFiles(const fs::path& root, const std::string& shown, const std::set<std::string>& exclude,
                                 PrepareResult& r) {
  std::vector<FileEntry> out;
  std::error_code ec;
  fs::recursive_directory_iterator it(root, fs::directory_options::none, ec), end;
  if (ec) throw InputError(fmt::format("{}: cannot list ({})", shown, ec.message()));
  for (; it != end; it.increment(ec)) {
    if (ec) throw InputError(fmt::format("{}: cannot list ({})", shown, ec.message()));
    const auto st = it->symlink_status(ec);
    if (ec) throw InputError(fmt::format("{}: cannot stat ({})", it->path().string(), ec.message()));
    if (fs::is_directory(st)) continue;  // the iterator descends (it never follows links)
    if (!fs::is_regular_file(st)) {
      ++r.skipped_other;  // symbolic links (duplicates, or outside the tree), devices, sockets
      continue;
    }
    if (!exclude.empty() && exclude.count(canonicalOf(it->path()))) continue;  // our own outputs
    // another preparation's outputs (or any Megatron dataset): tokens, not text
    const fs::path& p = it->path();
    fs::path idx = p;
    if (p.extension() == ".bin") idx.replace_extension(".idx");
    if ((p.extension() == ".idx" || p.extension() == ".bin") && isTokenDataset(idx.string())) {
      ++r.skipped_datasets;
      continue;
    }
    out.push_back({it->path().lexically_relative(root).generic_string(), it->path()});
  }
  if (ec) throw InputError(fmt::format("{}: cannot list ({})", shown, ec.message()));
  std::sort(out.begin(), out.end(), [](const FileEntry& a, const FileEntry& b) { return a.rel < b.rel; });
  // A hard link is the same text under a second name (a tarball's link entries unpack as
  // such): one document, at its first path, or it would be duplicated, perhaps into both
  // splits.
  std::set<std::pair<dev_t, ino_t>> seen;
  std::vector<FileEntry> kept;
  kept.reserve(out.size());
  for (auto& f : out) {
    struct stat sb {};
    if (::lstat(f.path.c_str(), &sb) != 0)
      throw InputError(fmt::format("{}: cannot stat ({})", f.path.string(), std::strerror(errno)));
    if (sb.st_nlink > 1 && !seen.emplace(sb.st_dev, sb.st_ino).second) {
      ++r.skipped_hard_links;
      continue;
    }
    kept.push_back(std::move(f));
  }
  return kept;
}

}  // namespace

PrepareResult prepareDataset(const PrepareOptions& o) {
  if (!(o.valid_fraction >= 0.0 && o.valid_fraction < 1.0))
    throw InputError(fmt::format("--valid-fraction: must be in [0, 1) (got {})", o.valid_fraction));
  if (o.min_bytes < 1) throw InputError(fmt::format("--min-bytes: must be >= 1 (got {})", o.min_bytes));
  if (o.max_bytes < 0) throw InputError(fmt::format("--max-bytes: must be >= 0 (got {})", o.max_bytes));
  if (o.max_file_bytes < 0) throw InputError(fmt::format("--max-file-bytes: must be >= 0 (got {})", o.max_file_bytes));
  if (o.out_prefix.empty()) throw InputError("--out: an output prefix is required");

  std::error_code ec;
  const auto st = fs::status(o.source, ec);
  if (!fs::exists(st)) throw InputError(fmt::format("{}: source not found", o.source));
  const bool dir = fs::is_directory(st);
  if (!dir && !(fs::is_regular_file(st) && isTarball(o.source)))
    throw InputError(
        fmt::format("{}: not a directory or a .tar / .tar.gz / .tgz / .tar.xz / .txz / .tar.bz2 tarball", o.source));

  PrepareResult r;
  r.train_prefix = o.out_prefix + "_train";
  r.valid_prefix = o.out_prefix + "_valid";
  // The output's directory is made as needed; the writers are opened first so that an
  // unwritable output fails before a long scan.
  // Folders made here go again, if still empty, when the preparation fails.
  const fs::path parent = fs::path(o.out_prefix).parent_path();
  std::error_code mk;
  MadeFolders made(parent.empty() ? fs::path(".") : parent, mk, o.track_temporary);  // and on Ctrl-C
  if (mk) throw InputError(fmt::format("--out: cannot create the directory {} ({})", parent.string(), mk.message()));
  // All four outputs can be renamed into place, checked before the scan: a folder or a device
  // under one of the names failed the commit after the first files were in place.
  for (const auto* pre : {&r.train_prefix, &r.valid_prefix})
    for (const char* ext : {".bin", ".idx"}) checkOutputPath(*pre + ext, "--out");
  // tracked before the writers open them: a Ctrl-C in between would leave them behind
  std::vector<std::string> tmps = IndexedDatasetWriter::temporariesOf(r.train_prefix);
  for (auto& t : IndexedDatasetWriter::temporariesOf(r.valid_prefix)) tmps.push_back(t);
  const TrackedTemporaries tracked(o.track_temporary, tmps);
  IndexedDatasetWriter train_out(r.train_prefix), valid_out(r.valid_prefix);

  std::vector<FileEntry> files;
  std::unique_ptr<TempDir> unpacked;
  if (dir) {
    std::set<std::string> exclude;
    for (const auto* w : {&train_out, &valid_out}) {
      for (const auto& t : w->temporaries()) exclude.insert(canonicalOf(t));
      exclude.insert(canonicalOf(w->binPath()));
      exclude.insert(canonicalOf(w->idxPath()));
    }
    files = listFiles(o.source, o.source, exclude, r);
  } else {
    unpacked = std::make_unique<TempDir>();
    untar(o.source, unpacked->path());
    files = listFiles(unpacked->path(), o.source, {}, r);
  }
  r.regular_files = static_cast<std::int64_t>(files.size());

  const std::int64_t cap = o.max_bytes > 0 ? std::min(o.max_bytes, kMaxSequence) : kMaxSequence;
  // 1. Sizes, splits and pieces: a file of n bytes is ceil(n / cap) documents.
  struct Piece {
    std::uint64_t key;
    std::size_t file;
    std::int64_t index;
  };
  std::vector<std::int64_t> sizes(files.size(), 0);
  std::vector<char> held(files.size(), 0);
  std::vector<Piece> pieces;
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::error_code fe;
    const auto n = static_cast<std::int64_t>(fs::file_size(files[i].path, fe));
    if (fe) throw InputError(fmt::format("{}: cannot stat ({})", files[i].path.string(), fe.message()));
    sizes[i] = n;
    if (n < o.min_bytes) {
      ++r.skipped_small;
      continue;
    }
    if (o.max_file_bytes > 0 && n > o.max_file_bytes) {
      ++r.skipped_large;
      continue;
    }
    // all pieces of a file go to one split: no text shared between train and valid
    held[i] = inValidSplit(files[i].rel, o.valid_fraction) ? 1 : 0;
    ++(held[i] ? r.valid : r.train).files;
    if (n > cap) ++r.cut_files;
    for (std::int64_t k = 0; k * cap < n; ++k)
      pieces.push_back({o.shuffle ? shuffleKey(files[i].rel, k, o.shuffle_seed) : 0, i, k});
  }
  // 2. Order: path order (the pieces of a file in sequence), or by the shuffle key (a tie
  //    needs a 64-bit collision and keeps path order).
  if (o.shuffle)
    std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.key < b.key; });
  // 3. Tokens of every piece, read from its file.
  Progress progress("wlb data prepare", static_cast<std::int64_t>(pieces.size()), "documents", o.progress);
  std::vector<Token> tokens;
  std::string text;
  std::size_t open_file = files.size();
  std::ifstream in;
  for (std::size_t j = 0; j < pieces.size(); ++j) {
    const Piece& pc = pieces[j];
    const FileEntry& f = files[pc.file];
    progress.update(static_cast<std::int64_t>(j), f.rel);
    if (open_file != pc.file) {
      in.close();
      in.clear();
      in.open(f.path, std::ios::binary);
      if (!in) throw InputError(fmt::format("{}: cannot read ({})", f.path.string(), std::strerror(errno)));
      open_file = pc.file;
    }
    const std::int64_t off = pc.index * cap, len = std::min(cap, sizes[pc.file] - off);
    text.resize(static_cast<std::size_t>(len));
    in.seekg(off);
    in.read(text.data(), len);
    if (!in || in.gcount() != len)
      throw InputError(fmt::format("{}: read failed at byte {} (changed while reading?)", f.path.string(), off));
    tokens.clear();
    ByteTokenizer::encode(text, tokens);
    auto& w = held[pc.file] ? valid_out : train_out;
    auto& c = held[pc.file] ? r.valid : r.train;
    w.add(tokens);
    ++c.documents;
    c.tokens += static_cast<std::int64_t>(tokens.size());
  }
  if (r.train.documents + r.valid.documents == 0)
    throw InputError(
        fmt::format("{}: no documents ({} regular files, {} of them shorter than --min-bytes {}, {} longer "
                    "than --max-file-bytes; {} symbolic links or other entries skipped)",
                    o.source, r.regular_files, r.skipped_small, o.min_bytes, r.skipped_large, r.skipped_other));
  if (r.train.documents == 0)
    throw InputError(
        fmt::format("{}: every document fell into the held-out split (--valid-fraction {}); nothing to "
                    "train on",
                    o.source, o.valid_fraction));
  train_out.finish();
  valid_out.finish();
  train_out.commit();
  valid_out.commit();
  made.keep();
  return r;
}

}  // namespace wlb::data
