// Signal-time removal of registered temporaries (see cleanup.hpp).
#include "app/cleanup.hpp"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <filesystem>

namespace wlb::app {
namespace {

constexpr int kSlots = 64;
constexpr std::size_t kPathMax = 4096;
char g_paths[kSlots][kPathMax];
std::atomic<bool> g_used[kSlots];
std::atomic<bool> g_installed{false};
constexpr int kFolderSlots = 16;
char g_dirs[kFolderSlots][kPathMax];
std::atomic<bool> g_dir_used[kFolderSlots];

extern "C" void onSignal(int sig) {
  for (int i = 0; i < kSlots; ++i)
    if (g_used[i].load()) ::unlink(g_paths[i]);
  // Only while empty (rmdir refuses otherwise); a pass per slot, so a parent whose slot
  // comes before its child's goes in a later pass.
  for (int pass = 0; pass < kFolderSlots; ++pass)
    for (int i = 0; i < kFolderSlots; ++i)
      if (g_dir_used[i].load() && ::rmdir(g_dirs[i]) == 0) g_dir_used[i].store(false);
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

void registerTemporaryFolder(const std::string& dir) {
  if (dir.size() >= kPathMax) return;
  install();
  for (int i = 0; i < kFolderSlots; ++i) {
    if (g_dir_used[i].load()) continue;
    std::memcpy(g_dirs[i], dir.c_str(), dir.size() + 1);
    g_dir_used[i].store(true);
    return;
  }
}

void forgetTemporaryFolder(const std::string& dir) {
  for (int i = 0; i < kFolderSlots; ++i)
    if (g_dir_used[i].load() && dir == g_dirs[i]) {
      g_dir_used[i].store(false);
      return;
    }
}

void trackTemporary(const std::string& path, bool made) {
  std::error_code ec;
  if (made && std::filesystem::is_directory(path, ec)) {  // a folder made for the outputs
    registerTemporaryFolder(path);
  } else if (made) {
    registerTemporary(path);
  } else {
    forgetTemporary(path);
    forgetTemporaryFolder(path);
  }
}

}  // namespace wlb::app
