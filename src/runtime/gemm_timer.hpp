#pragma once
/// \file gemm_timer.hpp
/// \brief Per-GEMM timing inside the steps (`wlb run --gemm-timing`): what each of the
/// layer's and the head's products runs at in place, at the step's real shapes, next to the
/// trace's regions (which also hold norms, RoPE, SwiGLU and the cross-entropy). A timed
/// product is fenced before and after, so the step loses the overlap of one launch with the
/// previous kernel: the table is a per-product figure, a timed run's step time is not.
/// Pure bookkeeping (no MPI): runDeck gathers the ranks' tables.

#include <cstdint>
#include <string>
#include <vector>

namespace wlb::runtime {

class GemmTimer {
 public:
  /// One product of the model (by its name in layer.cpp / head.cpp) under one strategy.
  struct Row {
    std::string strategy, name;
    std::int64_t calls = 0;
    double seconds = 0, flops = 0;
  };
  /// Rows added from now on belong to `strategy`; inactive: add() ignores products (warm-up
  /// and drain steps).
  void setStrategy(const std::string& strategy) { strategy_ = strategy; }
  void setActive(bool on) { active_ = on; }
  bool active() const { return active_; }
  void add(const char* name, double seconds, double flops);
  /// In first-call order.
  const std::vector<Row>& rows() const { return rows_; }
  /// Rows of `other` added to the rows with the same strategy and name (appended when new).
  void merge(const std::vector<Row>& other);

  /// Tab-separated lines (strategy, name, calls, seconds, flops) and back: how ranks send
  /// their tables to rank 0.
  std::string serialize() const;
  static std::vector<Row> parse(const std::string& text);

 private:
  std::string strategy_;
  bool active_ = false;
  std::vector<Row> rows_;
};

}  // namespace wlb::runtime
