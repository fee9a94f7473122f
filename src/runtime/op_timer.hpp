#pragma once
/// \file op_timer.hpp
/// \brief Operations timed one by one inside the measured steps of `wlb run`:
/// `--gemm-timing`, every product of the layer and the head by its name in layer.cpp /
/// head.cpp, with its FLOPs; `--kernel-timing`, every labelled Kokkos kernel and deep copy
/// (norms, RoPE, SwiGLU, residuals, the cross-entropy, the KV moves; `KernelHooks`), the
/// work the trace's regions hold around the GEMMs and the attention. A timed operation is
/// fenced before and after, so the step loses the overlap of one launch with the previous
/// kernel: the tables are per-operation figures; a timed run's step time is not.
/// Bookkeeping without MPI: runDeck gathers the ranks' tables.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace wlb::runtime {

class OpTimer {
 public:
  /// One operation (a product's name, a kernel's label) under one strategy.
  struct Row {
    std::string strategy, name;
    std::int64_t calls = 0;
    double seconds = 0, flops = 0;
  };
  /// Rows added from now on belong to `strategy`; inactive: add() ignores operations
  /// (warm-up and drain steps).
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

/// While alive, every Kokkos parallel_for, parallel_reduce, parallel_scan and deep_copy of
/// this process is fenced before and after and added to `timer` under its label (a deep
/// copy as "deep_copy DST"), whenever the timer is active: Kokkos' tool callbacks, the same
/// hooks a Kokkos Tools kernel timer uses, installed in process. Work outside Kokkos is not
/// in it: cuBLAS products (--gemm-timing), the raw Hopper attention launches and
/// communication. Kokkos' callbacks are process-wide, so one KernelHooks at a time
/// (std::logic_error on a second); the callbacks that were set before come back on
/// destruction.
class KernelHooks {
 public:
  explicit KernelHooks(OpTimer& timer);
  ~KernelHooks();
  KernelHooks(const KernelHooks&) = delete;
  KernelHooks& operator=(const KernelHooks&) = delete;
};

}  // namespace wlb::runtime
