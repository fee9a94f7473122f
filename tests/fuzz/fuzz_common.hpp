#pragma once
// Shared by the harnesses: the readers take paths, so each input is written to one
// scratch file per process; a reader may throw wlb::InputError (bad input, exit 2 in the
// driver) and nothing else — any other exception is a bug and aborts the run.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>

#include "core/error.hpp"

namespace wlb::fuzz {

inline const std::string& scratch(const char* suffix) {
  static const std::string path = [&] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir && *dir ? dir : "/tmp") + "/wlb-fuzz-" + std::to_string(::getpid()) + suffix;
  }();
  return path;
}

inline void writeScratch(const std::string& path, const std::uint8_t* data, std::size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

template <class F>
void expectOnlyInputErrors(F&& f) {
  try {
    f();
  } catch (const wlb::InputError&) {
    // bad input, reported with a message: the expected outcome
  } catch (const std::exception& e) {
    std::fprintf(stderr, "wlb fuzz: exception other than InputError: %s\n", e.what());
    std::abort();
  }
}

}  // namespace wlb::fuzz
