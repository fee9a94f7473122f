#pragma once
/// \file cleanup.hpp
/// \brief Temporaries removed on SIGINT/SIGTERM: a command that streams output under a
/// temporary name registers it, so an interrupted run leaves neither a partial file under
/// the final name (writes go to the temporary) nor the temporary itself. The handler uses
/// only async-signal-safe calls (unlink, signal, raise) on a fixed table.

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

/// The TemporaryTracker (core/output_file.hpp) the driver hands to library code:
/// registers on (path, true), forgets on (path, false).
void trackTemporary(const std::string& path, bool made);

/// Registers `path` for its lifetime (forgotten on scope exit, renamed or not).
class TemporaryGuard : TrackedTemporaries {
 public:
  explicit TemporaryGuard(std::string path) : TrackedTemporaries(trackTemporary, {std::move(path)}) {}
};

/// wlb::writeFileAtomically with the temporary registered for removal on a signal.
inline void writeAtomically(const std::string& path, const std::string& what, const std::string& text,
                            const std::function<void(const std::string& tmp)>& check = {}) {
  writeFileAtomically(path, what, text, trackTemporary, check);
}

}  // namespace wlb::app
