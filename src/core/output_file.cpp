// The one temp-and-rename writer of whole text outputs (see output_file.hpp).
#include "core/output_file.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

namespace wlb {

void writeFilesAtomically(const std::vector<std::pair<std::string, std::string>>& files, const std::string& what,
                          const TemporaryTracker& track,
                          const std::function<void(const std::string& path, const std::string& tmp)>& check) {
  namespace fs = std::filesystem;
  std::vector<std::string> tmps;
  tmps.reserve(files.size());
  for (const auto& f : files) tmps.push_back(f.first + ".tmp." + std::to_string(::getpid()));
  const TrackedTemporaries tracked(track, tmps);  // whichever way this returns
  std::vector<std::unique_ptr<MadeFolders>> made;
  std::size_t placed = 0;
  try {
    // Every file complete under its temporary name first: one that cannot be written leaves
    // the others as they were.
    for (std::size_t i = 0; i < files.size(); ++i) {
      const std::string& path = files[i].first;
      const auto fail = [&](const std::string& why) { throw InputError(what + " '" + path + "': " + why); };
      std::error_code ec;
      const fs::path parent = fs::path(path).parent_path();
      // The folders made for it go again, while empty, if the write fails or is interrupted.
      made.push_back(std::make_unique<MadeFolders>(parent.empty() ? fs::path(".") : parent, ec, track));
      if (ec) fail("cannot make its folder (" + ec.message() + ")");
      if (detail::isDeviceOrPipe(path))  // a folder is left to the rename, which fails on it
        fail("exists and is not a regular file (a device or a pipe): name a file");
      std::ofstream f(tmps[i]);
      if (!f) fail(std::string("cannot write (") + std::strerror(errno) + ")");
      f << files[i].second;
      f.close();
      if (!f) fail(std::string("write failed (") + std::strerror(errno) + ")");
      if (check) check(path, tmps[i]);
    }
    for (; placed < files.size(); ++placed)
      if (std::rename(tmps[placed].c_str(), files[placed].first.c_str()) != 0)
        throw InputError(what + " '" + files[placed].first + "': cannot rename into place (" + std::strerror(errno) +
                         ")");
    for (auto& m : made) m->keep();
  } catch (...) {
    for (std::size_t i = placed; i < tmps.size(); ++i) std::remove(tmps[i].c_str());
    throw;
  }
}

void writeFileAtomically(const std::string& path, const std::string& what, const std::string& text,
                         const TemporaryTracker& track, const std::function<void(const std::string& tmp)>& check) {
  writeFilesAtomically({{path, text}}, what, track,
                       check ? [&](const std::string&, const std::string& tmp) { check(tmp); }
                             : std::function<void(const std::string&, const std::string&)>{});
}

}  // namespace wlb
