#pragma once
/// \file output_file.hpp
/// \brief The check a command makes on each output path before it does any work, so that a
/// bad path fails at once (exit 2 naming the option) and not after the outputs before it
/// were written.

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace wlb {

namespace detail {
// Outputs are renamed into place, which over an existing device or pipe (/dev/null, as
// root) would replace the node itself.
inline bool isDeviceOrPipe(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // one stat: three (exists, then not regular, then not a folder) took a file that another
  // rank renamed over or removed between them for a device
  const fs::file_type t = fs::status(path, ec).type();
  return t != fs::file_type::none && t != fs::file_type::not_found && t != fs::file_type::regular &&
         t != fs::file_type::directory;
}

// One file under two spellings: the same existing file, or the same path once symbolic
// links and `..` are resolved (a folder on the way may not exist yet: "out/../deck.toml").
inline bool sameFile(const std::string& a, const std::string& b) {
  namespace fs = std::filesystem;
  std::error_code ec, ea, eb;
  if (fs::equivalent(a, b, ec)) return true;
  const auto ca = fs::weakly_canonical(fs::absolute(a, ea), ea), cb = fs::weakly_canonical(fs::absolute(b, eb), eb);
  return !ea && !eb && ca == cb;
}

// `dir` is a folder this process may create entries in (a read-only mount, a folder of
// another user): found before the work, not when the output is written after it.
inline void requireWritableFolder(const std::filesystem::path& dir, const std::string& path, const std::string& what,
                                  bool collective) {
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw InputError(what + " '" + path + "': cannot write in " + dir.string() + " (" + std::strerror(errno) + ")",
                     collective);
}

// The nearest existing folder above `path` is a folder (not a file) this process can write
// in, so the missing ones below it can be made when the output is written.
inline void requireWritableAncestor(const std::string& path, const std::string& what, bool collective) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path up = fs::absolute(fs::path(path), ec).parent_path();
  while (!up.empty() && !fs::exists(up, ec) && up != up.root_path()) up = up.parent_path();
  if (!fs::is_directory(up, ec))
    throw InputError(what + " '" + path + "': " + up.string() + " is not a directory", collective);
  requireWritableFolder(up, path, what, collective);
}
}  // namespace detail

/// `path` (named `what` in the error: "--out", "output.trace", ...) can be written: it is not
/// empty, not a directory, not one of `inputs`, and its nearest existing ancestor is a
/// directory (missing folders below it are created when the output is written).
inline void checkOutputPath(const std::string& path, const std::string& what,
                            const std::vector<std::string>& inputs = {}, bool collective = false) {
  namespace fs = std::filesystem;
  auto fail = [&](const std::string& why) { throw InputError(what + " '" + path + "': " + why, collective); };
  if (path.empty()) throw InputError(what + ": the output path is empty", collective);
  std::error_code ec;
  const auto name = fs::path(path).filename();
  if (fs::is_directory(path, ec)) fail("is a directory; name a file");
  if (detail::isDeviceOrPipe(path))
    fail(
        "exists and is not a regular file (a device or a pipe); outputs are written under a temporary name and "
        "renamed over it: name a file");
  if (name.empty() || name == "." || name == "..") fail("names a folder, not a file");
  for (const auto& in : inputs)
    if (!in.empty() && detail::sameFile(path, in)) fail("is also an input of this command (" + in + ")");
  detail::requireWritableAncestor(path, what, collective);
}

/// A folder a command writes its files into (`--gradients DIR`, `simulate --out DIR`): not
/// an existing file, and makeable where it does not exist yet.
inline void checkOutputFolder(const std::string& dir, const std::string& what, bool collective = false) {
  namespace fs = std::filesystem;
  if (dir.empty()) throw InputError(what + ": the output folder is empty", collective);
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw InputError(what + " '" + dir + "': is a file; name a folder", collective);
  if (!fs::exists(dir, ec))
    detail::requireWritableAncestor(dir, what, collective);
  else
    detail::requireWritableFolder(dir, dir, what, collective);
}

/// Outputs of one command (name, path) must be different files: two that name one file
/// (`output.trace = "plan.jsonl"` beside the plan file) would leave only the last written.
inline void checkDistinctOutputs(const std::vector<std::pair<std::string, std::string>>& outputs,
                                 bool collective = false) {
  for (std::size_t i = 0; i < outputs.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (detail::sameFile(outputs[i].second, outputs[j].second))
        throw InputError(
            outputs[i].first + " and " + outputs[j].first + " name the same file '" + outputs[i].second + "'",
            collective);
}

/// The driver's hook for temporaries: called with (path, true) when a temporary file (or a
/// folder made for the outputs) is made and (path, false) when it is renamed, removed or
/// kept; the driver removes the tracked ones on SIGINT/SIGTERM, folders only while empty.
/// Library code takes one and installs no signal handler of its own.
using TemporaryTracker = std::function<void(const std::string& path, bool made)>;

/// Makes the missing folders of `dir`; unless keep() is called, the ones it made are
/// removed again on scope exit where still empty (deepest first), so a command that fails
/// before writing anything leaves no empty folder behind. `ec` reports a failure to make.
/// With a tracker, the folders made are tracked until then too, so that a signal (whose
/// handler the driver owns) removes them as well.
class MadeFolders {
 public:
  MadeFolders(const std::filesystem::path& dir, std::error_code& ec, TemporaryTracker track = {})
      : track_(std::move(track)) {
    namespace fs = std::filesystem;
    if (dir.empty()) return;  // the working directory ("" as output.dir)
    std::error_code q;
    for (fs::path p = fs::absolute(dir, q); !q && !p.empty() && p != p.root_path() && !fs::exists(p, q);
         p = p.parent_path())
      made_.push_back(p);
    fs::create_directories(dir, ec);
    if (ec) track_ = {};  // nothing made to track
    if (track_)
      for (const auto& p : made_) track_(p.string(), true);
  }
  MadeFolders(const MadeFolders&) = delete;
  MadeFolders& operator=(const MadeFolders&) = delete;
  ~MadeFolders() {
    if (!kept_)
      for (const auto& p : made_) {
        std::error_code e;
        std::filesystem::remove(p, e);  // a folder is removed only while empty
      }
    untrack();
  }
  void keep() {
    kept_ = true;
    untrack();
  }

 private:
  void untrack() {
    if (track_)
      for (const auto& p : made_) track_(p.string(), false);
    track_ = {};
  }
  std::vector<std::filesystem::path> made_;
  TemporaryTracker track_;
  bool kept_ = false;
};

/// The driver's hook for child processes a command starts (validate-sim's stages): called
/// with (pid, true) once started and (pid, false) once reaped; the driver passes SIGINT and
/// SIGTERM on to the running ones, so that no child outlives an interrupted command.
using ChildTracker = std::function<void(int pid, bool running)>;

/// The temporaries `paths` tracked for the guard's lifetime: (path, true) when it is made,
/// (path, false) on scope exit, renamed or not. An empty tracker tracks nothing.
class TrackedTemporaries {
 public:
  TrackedTemporaries(TemporaryTracker track, std::vector<std::string> paths)
      : track_(std::move(track)), paths_(std::move(paths)) {
    if (track_)
      for (const auto& p : paths_) track_(p, true);
  }
  ~TrackedTemporaries() {
    if (track_)
      for (const auto& p : paths_) track_(p, false);
  }
  TrackedTemporaries(const TrackedTemporaries&) = delete;
  TrackedTemporaries& operator=(const TrackedTemporaries&) = delete;

 private:
  TemporaryTracker track_;
  std::vector<std::string> paths_;
};

/// Writes `text` to `path` (named `what` in errors: "--out", "--json", ...) under a temporary
/// name, renamed into place when complete (missing folders made first). `check`, when given,
/// runs on the complete temporary before the rename (a profile must load, say). Throws
/// InputError naming `what`; a failure leaves neither file behind.
void writeFileAtomically(const std::string& path, const std::string& what, const std::string& text,
                         const TemporaryTracker& track = {},
                         const std::function<void(const std::string& tmp)>& check = {});

/// writeFileAtomically for a set of (path, text) written together (`simulate --out`'s CSV and
/// JSON): every file is complete under its temporary name before the first rename, so a
/// file that cannot be written (no room) leaves every path as it was. `check` runs on each
/// complete temporary.
void writeFilesAtomically(const std::vector<std::pair<std::string, std::string>>& files, const std::string& what,
                          const TemporaryTracker& track = {},
                          const std::function<void(const std::string& path, const std::string& tmp)>& check = {});

/// Makes the missing folders above the file `path`; a failure is left to the open that
/// follows, which names the output.
inline void makeParentFolders(const std::string& path) {
  std::error_code ec;
  if (const auto dir = std::filesystem::path(path).parent_path(); !dir.empty())
    std::filesystem::create_directories(dir, ec);
}

}  // namespace wlb
