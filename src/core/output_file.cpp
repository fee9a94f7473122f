// The one temp-and-rename writer of whole text outputs (see output_file.hpp).
#include "core/output_file.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace wlb {

void writeFileAtomically(const std::string& path, const std::string& what, const std::string& text,
                         const TemporaryTracker& track, const std::function<void(const std::string& tmp)>& check) {
  namespace fs = std::filesystem;
  const auto fail = [&](const std::string& why) { throw InputError(what + " '" + path + "': " + why); };
  std::error_code ec;
  const fs::path parent = fs::path(path).parent_path();
  // The folders made for it go again, while empty, if the write fails or is interrupted.
  MadeFolders made(parent.empty() ? fs::path(".") : parent, ec, track);
  if (ec) fail("cannot make its folder (" + ec.message() + ")");
  if (detail::isDeviceOrPipe(path))  // a folder is left to the rename, which fails on it
    fail("exists and is not a regular file (a device or a pipe): name a file");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const TrackedTemporaries tracked(track, {tmp});  // whichever way this returns
  try {
    {
      std::ofstream f(tmp);
      if (!f) fail(std::string("cannot write (") + std::strerror(errno) + ")");
      f << text;
      f.close();
      if (!f) fail("write failed");
    }
    if (check) check(tmp);
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      fail(std::string("cannot rename into place (") + std::strerror(errno) + ")");
    made.keep();
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
}

}  // namespace wlb
