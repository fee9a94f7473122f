/// \file recorder.cpp
/// \brief Recorder: event buffer, label table and cross-rank clock alignment.

#include "trace/recorder.hpp"

#include <chrono>
#include <ctime>
#include <limits>
#include <utility>

namespace wlb::trace {

const char* phaseName(Phase p) {
  switch (p) {
    case Phase::Fwd:
      return "fwd";
    case Phase::Bwd:
      return "bwd";
    default:
      return "none";
  }
}

namespace labels {
const std::vector<std::string>& standard() {
  static const std::vector<std::string> all = {
      kStep,        kEmbed,      kNorm,   kQkvProj, kAttn,          kOutProj,   kMlp,  kLoss,     kTpAllreduce,
      kKvAllgather, kKvExchange, kPpSend, kPpRecv,  kGradAllreduce, kOptimizer, kIdle, kRecompute};
  return all;
}
}  // namespace labels

namespace {

std::int64_t steadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string isoNow() {
  auto now = std::chrono::system_clock::now();
  auto secs = std::chrono::system_clock::to_time_t(now);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  char out[48];
  std::snprintf(out, sizeof out, "%s.%03lldZ", buf, static_cast<long long>(ms));
  return out;
}

}  // namespace

std::int64_t Recorder::steadyNowNs() {
  return steadyNs();
}
std::string Recorder::isoNowUtc() {
  return isoNow();
}

void Recorder::init() {
  for (const auto& l : labels::standard()) region(l);
  events_.reserve(4096);
}

Recorder::Recorder(int rank, RankCoord coord) : rank_(rank), coord_(coord) {
  init();
  epoch_ns_ = steadyNs();
  start_iso_ = isoNow();
}

Recorder::Recorder(int rank, RankCoord coord, std::int64_t offset_ns, std::int64_t epoch_ns, std::string start_iso)
    : rank_(rank), coord_(coord), offset_ns_(offset_ns), epoch_ns_(epoch_ns), start_iso_(std::move(start_iso)) {
  init();
}

std::int64_t Recorder::localNs() const {
  return steadyNs();
}

std::int64_t Recorder::now() const {
  return steadyNs() - offset_ns_ - epoch_ns_;
}

int Recorder::region(std::string_view label) {
  std::string key(label);
  auto it = region_ids_.find(key);
  if (it != region_ids_.end()) return it->second;
  int id = static_cast<int>(regions_.size());
  regions_.push_back(key);
  region_ids_.emplace(std::move(key), id);
  return id;
}

int Recorder::setStrategy(const std::string& name) {
  for (std::size_t i = 0; i < strategies_.size(); ++i) {
    if (strategies_[i] == name) return strategy_ = static_cast<int>(i);
  }
  strategies_.push_back(name);
  return strategy_ = static_cast<int>(strategies_.size() - 1);
}

void Recorder::record(int region, std::int64_t start_ns, std::int64_t end_ns, double flops, double bytes) {
  if (strategies_.empty()) strategies_.push_back("default");
  Event e;
  e.start_ns = start_ns;
  e.end_ns = end_ns;
  e.flops = flops;
  e.bytes = bytes;
  e.rank = rank_;
  e.strategy = strategy_;
  e.step = ctx_.step;
  e.micro_batch = ctx_.micro_batch;
  e.layer = ctx_.layer;
  e.chunk = ctx_.chunk;
  e.region = region;
  e.phase = ctx_.phase;
  events_.push_back(e);
}

void Recorder::record(const Event& e) {
  if (strategies_.empty()) strategies_.push_back("default");
  events_.push_back(e);
}

void Recorder::Scope::stop() {
  if (!rec_) return;
  if (fence_) fence_(space_);
  const std::int64_t end = rec_->now();
  Event e;
  e.start_ns = start_;
  e.end_ns = end;
  e.flops = flops_;
  e.bytes = bytes_;
  e.rank = rec_->rank_;
  e.strategy = rec_->strategy_;
  e.step = ctx_.step;
  e.micro_batch = ctx_.micro_batch;
  e.layer = ctx_.layer;
  e.chunk = ctx_.chunk;
  e.region = region_;
  e.phase = ctx_.phase;
  rec_->record(e);
  rec_ = nullptr;
}

}  // namespace wlb::trace
