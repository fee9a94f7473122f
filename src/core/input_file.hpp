#pragma once
/// \file input_file.hpp
/// \brief Opening a file the user named, as bad input when it cannot be read.

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"

namespace wlb {

/// Opens `path` for reading; `what` names it in the error ("--resume", "plan file", ...).
/// A directory opens as a stream on Linux and its first read throws std::ios_base::failure
/// from inside libstdc++ (an internal error, exit 1), so it is refused here by name.
inline std::ifstream openInput(const std::string& path, const std::string& what, std::ios::openmode mode = std::ios::in,
                               bool collective = false) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(what + " '" + path + "' is a directory, not a file", collective);
  std::ifstream f(path, mode);
  if (!f) throw InputError(what + " '" + path + "': cannot open (" + std::strerror(errno) + ")", collective);
  return f;
}

}  // namespace wlb
