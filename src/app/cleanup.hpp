#pragma once
/// \file cleanup.hpp
/// \brief Temporaries removed on SIGINT/SIGTERM (and SIGHUP, SIGPIPE): a command that streams output under a
/// temporary name registers it, so an interrupted run leaves neither a partial file under
/// the final name (writes go to the temporary) nor the temporary itself. The handler uses
/// only async-signal-safe calls (unlink, signal, raise) on a fixed table.

#include <csignal>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>

#include "core/output_file.hpp"

namespace wlb::app {

/// Remove `path` if the process is interrupted (until `forgetTemporary`). At most 64 at once;
/// beyond that the extra ones are simply not protected.
void registerTemporary(const std::string& path);
/// The file was renamed or removed by the command itself.
void forgetTemporary(const std::string& path);

/// The ChildTracker (core/output_file.hpp) the driver hands to library code: a running
/// child gets SIGINT/SIGTERM when this process does. At most 16 at once.
void trackChild(int pid, bool running);

/// The TemporaryTracker (core/output_file.hpp) the driver hands to library code:
/// registers on (path, true), forgets on (path, false). A folder (MadeFolders tracks the
/// ones it made) is removed after the files, only while empty; at most 16 at once.
void trackTemporary(const std::string& path, bool made);

/// SIGUSR1 sets the flag stopRequest() points to instead of ending the process. main()
/// installs it for `wlb train` before anything else runs: Slurm's `--signal=USR1@SECONDS`
/// reaches the ranks whenever it comes, and one that came while MPI or Kokkos started would
/// otherwise have killed the rank.
void catchStopSignal();
volatile std::sig_atomic_t* stopRequest();

/// Registers `path` for its lifetime (forgotten on scope exit, renamed or not).
class TemporaryGuard : TrackedTemporaries {
 public:
  explicit TemporaryGuard(std::string path) : TrackedTemporaries(trackTemporary, {std::move(path)}) {}
};

/// The folders of an output file, made as MadeFolders makes them and tracked for a signal:
/// an interrupted or failed command leaves no empty folder. keep() once the file is in place.
class OutputFolders {
 public:
  explicit OutputFolders(const std::string& file) : made_(parentOf(file), ec_, trackTemporary) {}
  void keep() { made_.keep(); }
  /// Why the folders could not be made (empty when they were).
  const std::error_code& error() const { return ec_; }

 private:
  static std::filesystem::path parentOf(const std::string& file) {
    const auto dir = std::filesystem::path(file).parent_path();
    return dir.empty() ? std::filesystem::path(".") : dir;
  }
  std::error_code ec_;  // a failure to make is left to the open that follows, which names the output
  MadeFolders made_;
};

/// wlb::writeFileAtomically with the temporary registered for removal on a signal.
inline void writeAtomically(const std::string& path, const std::string& what, const std::string& text,
                            const std::function<void(const std::string& tmp)>& check = {}) {
  writeFileAtomically(path, what, text, trackTemporary, check);
}

}  // namespace wlb::app
