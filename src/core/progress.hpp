#pragma once
/// \file progress.hpp
/// \brief Rate-limited progress lines on stderr for commands that can run long
/// ("wlb simulate: 40/120 steps (7b-128k wlb), 12 steps/s, ETA 7 s"): at most one line
/// every WLB_PROGRESS_SECONDS (default 5 s), so a run that finishes sooner prints none and
/// stdout (tables, JSON) is never touched. Only the ranks that pass `enabled` print.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace wlb {

class Progress {
 public:
  using clock = std::chrono::steady_clock;
  Progress(std::string command, std::int64_t total, std::string unit = "steps", bool enabled = true)
      : command_(std::move(command)), unit_(std::move(unit)), total_(total), enabled_(enabled) {
    const char* e = std::getenv("WLB_PROGRESS_SECONDS");
    every_ = e ? std::atof(e) : 5.0;
    start_ = last_ = clock::now();
  }
  /// `done` of `total` units finished; `what` names the current item (case, strategy).
  void update(std::int64_t done, const std::string& what = {}) {
    if (!enabled_) return;
    const auto now = clock::now();
    if (std::chrono::duration<double>(now - last_).count() < every_) return;
    last_ = now;
    const double el = std::chrono::duration<double>(now - start_).count();
    const double rate = el > 0 ? static_cast<double>(done) / el : 0.0;
    const double eta = rate > 0 ? static_cast<double>(total_ - done) / rate : 0.0;
    std::fprintf(stderr, "%s: %lld/%lld %s%s%s%s, %.3g %s/s, ETA %.0f s\n", command_.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_), unit_.c_str(), what.empty() ? "" : " (",
                 what.c_str(), what.empty() ? "" : ")", rate, unit_.c_str(), eta);
    std::fflush(stderr);
  }
  /// Seconds since construction.
  double elapsed() const { return std::chrono::duration<double>(clock::now() - start_).count(); }

 private:
  std::string command_, unit_;
  std::int64_t total_;
  bool enabled_;
  double every_ = 5.0;
  clock::time_point start_, last_;
};

}  // namespace wlb
