// Signal-time removal of registered temporaries (see cleanup.hpp).
#include "app/cleanup.hpp"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <filesystem>

namespace wlb::app {
namespace {

constexpr std::size_t kPathMax = 4096;

/// A fixed table of paths the signal handler can read without allocating.
template <int N>
struct Slots {
  char path[N][kPathMax];
  std::atomic<bool> used[N];

  void add(const std::string& p) {
    if (p.size() >= kPathMax) return;
    for (int i = 0; i < N; ++i) {
      if (used[i].load()) continue;
      std::memcpy(path[i], p.c_str(), p.size() + 1);
      used[i].store(true);
      return;
    }
  }
  void remove(const std::string& p) {
    for (int i = 0; i < N; ++i)
      if (used[i].load() && p == path[i]) {
        used[i].store(false);
        return;
      }
  }
};

constexpr int kFiles = 64, kDirs = 128;  // kDirs: every level of a deep new output path
Slots<kFiles> g_files;
Slots<kDirs> g_dirs;
std::atomic<int> g_children[16];  // 0: a free slot
std::atomic<bool> g_installed{false};

extern "C" void onSignal(int sig) {
  for (auto& c : g_children)  // children first: they clean up after themselves
    if (const int pid = c.load(); pid > 0) ::kill(pid, sig);
  for (int i = 0; i < kFiles; ++i)
    if (g_files.used[i].load()) ::unlink(g_files.path[i]);
  // Only while empty (rmdir refuses otherwise); passes until one removes nothing, so a
  // parent whose slot comes before its child's goes in a later pass.
  for (bool removed = true; removed;) {
    removed = false;
    for (int i = 0; i < kDirs; ++i)
      if (g_dirs.used[i].load() && ::rmdir(g_dirs.path[i]) == 0) {
        g_dirs.used[i].store(false);
        removed = true;
      }
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void install() {
  bool expected = false;
  if (!g_installed.compare_exchange_strong(expected, true)) return;
  std::signal(SIGINT, onSignal);
  std::signal(SIGTERM, onSignal);
  std::signal(SIGHUP, onSignal);   // the terminal went away
  std::signal(SIGPIPE, onSignal);  // `wlb run ... | head`: the reader left
}

volatile std::sig_atomic_t g_stop_requested = 0;
extern "C" void onStopSignal(int) {
  g_stop_requested = 1;
}

void registerTemporaryFolder(const std::string& dir) {
  install();
  g_dirs.add(dir);
}

}  // namespace

void registerTemporary(const std::string& path) {
  install();
  g_files.add(path);
}

void catchStopSignal() {
  std::signal(SIGUSR1, onStopSignal);
}

volatile std::sig_atomic_t* stopRequest() {
  return &g_stop_requested;
}

void forgetTemporary(const std::string& path) {
  g_files.remove(path);
}

void trackChild(int pid, bool running) {
  if (pid <= 0) return;
  if (running) install();
  for (auto& c : g_children) {
    int expected = running ? 0 : pid;
    if (c.compare_exchange_strong(expected, running ? pid : 0)) return;
  }
}

void trackTemporary(const std::string& path, bool made) {
  std::error_code ec;
  if (made && std::filesystem::is_directory(path, ec)) {  // a folder made for the outputs
    registerTemporaryFolder(path);
  } else if (made) {
    registerTemporary(path);
  } else {
    g_files.remove(path);
    g_dirs.remove(path);
  }
}

}  // namespace wlb::app
