#pragma once
/// \file cleanup.hpp
/// \brief Temporaries removed on SIGINT/SIGTERM: a command that streams output under a
/// temporary name registers it, so an interrupted run leaves neither a partial file under
/// the final name (writes go to the temporary) nor the temporary itself. The handler uses
/// only async-signal-safe calls (unlink, signal, raise) on a fixed table.

#include <functional>
#include <string>
#include <utility>

namespace wlb::app {

/// Remove `path` if the process is interrupted (until `forgetTemporary`). At most 64 at once;
/// beyond that the extra ones are simply not protected.
void registerTemporary(const std::string& path);
/// The file was renamed or removed by the command itself.
void forgetTemporary(const std::string& path);

/// Registers `path` for its lifetime (forgotten on scope exit, renamed or not).
class TemporaryGuard {
 public:
  explicit TemporaryGuard(std::string path) : path_(std::move(path)) { registerTemporary(path_); }
  ~TemporaryGuard() { forgetTemporary(path_); }
  TemporaryGuard(const TemporaryGuard&) = delete;
  TemporaryGuard& operator=(const TemporaryGuard&) = delete;

 private:
  std::string path_;
};

/// Writes `text` to `path`, the output `what` names in errors ("--out", "--json", ...): under
/// a registered temporary name, renamed into place when complete (missing folders made
/// first). `check`, when given, runs on the complete temporary before the rename (a profile
/// must load, say). Throws InputError naming `what`; a failure leaves neither file behind.
void writeAtomically(const std::string& path, const std::string& what, const std::string& text,
                     const std::function<void(const std::string& tmp)>& check = {});

}  // namespace wlb::app
