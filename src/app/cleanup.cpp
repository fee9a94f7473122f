// Signal-time removal of registered temporaries (see cleanup.hpp).
#include "app/cleanup.hpp"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"

namespace wlb::app {
namespace {

constexpr int kSlots = 64;
constexpr std::size_t kPathMax = 4096;
char g_paths[kSlots][kPathMax];
std::atomic<bool> g_used[kSlots];
std::atomic<bool> g_installed{false};

extern "C" void onSignal(int sig) {
  for (int i = 0; i < kSlots; ++i)
    if (g_used[i].load()) ::unlink(g_paths[i]);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void install() {
  bool expected = false;
  if (!g_installed.compare_exchange_strong(expected, true)) return;
  std::signal(SIGINT, onSignal);
  std::signal(SIGTERM, onSignal);
}

}  // namespace

void registerTemporary(const std::string& path) {
  if (path.size() >= kPathMax) return;
  install();
  for (int i = 0; i < kSlots; ++i) {
    if (g_used[i].load()) continue;
    std::memcpy(g_paths[i], path.c_str(), path.size() + 1);
    g_used[i].store(true);
    return;
  }
}

void forgetTemporary(const std::string& path) {
  for (int i = 0; i < kSlots; ++i)
    if (g_used[i].load() && path == g_paths[i]) {
      g_used[i].store(false);
      return;
    }
}

void writeAtomically(const std::string& path, const std::string& what, const std::string& text,
                     const std::function<void(const std::string& tmp)>& check) {
  namespace fs = std::filesystem;
  const auto fail = [&](const std::string& why) { throw InputError(what + " '" + path + "': " + why); };
  std::error_code ec;
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec) && !fs::create_directories(parent, ec))
    fail("cannot make its folder (" + ec.message() + ")");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const TemporaryGuard guard(tmp);
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
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
}

}  // namespace wlb::app
