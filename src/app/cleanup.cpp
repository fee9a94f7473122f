// Signal-time removal of registered temporaries (see cleanup.hpp).
#include "app/cleanup.hpp"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>

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

void trackTemporary(const std::string& path, bool made) {
  if (made)
    registerTemporary(path);
  else
    forgetTemporary(path);
}

}  // namespace wlb::app
