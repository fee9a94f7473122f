#pragma once
/// \file output_file.hpp
/// \brief The check a command makes on each output path before it does any work, so that a
/// bad path fails at once (exit 2 naming the option) and not after the outputs before it
/// were written.

#include <filesystem>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace wlb {

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
  if (name.empty() || name == "." || name == "..") fail("names a folder, not a file");
  for (const auto& in : inputs)
    if (!in.empty() && fs::equivalent(path, in, ec)) fail("is also an input of this command (" + in + ")");
  fs::path up = fs::absolute(fs::path(path), ec).parent_path();
  while (!up.empty() && !fs::exists(up, ec) && up != up.root_path()) up = up.parent_path();
  if (!fs::is_directory(up, ec)) fail(up.string() + " is not a directory");
}

}  // namespace wlb
