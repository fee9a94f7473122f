#pragma once
/// \file progress_thread.hpp
/// \brief A thread that drives MPI's progress engine while its rank computes (the
/// pipeline executor's and the training pipeline's point-to-point transfers).

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace wlb::parallel {

/// Without single-copy transports a large message moves in fragments only while both sides
/// are inside MPI; a rank deep in a layer would hold its neighbour's receive until its next
/// MPI call. MPI_Iprobe on a private duplicate of `comm` (collective: every rank of `comm`
/// constructs one) makes progress without touching the caller's requests. Needs
/// MPI_THREAD_MULTIPLE; otherwise a no-op (transfers then move when the rank next calls
/// MPI: the executor polls between layers).
class ProgressThread {
 public:
  explicit ProgressThread(MPI_Comm comm) {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    if (level != MPI_THREAD_MULTIPLE) return;
    MPI_Comm_dup(comm, &comm_);
    thread_ = std::thread([this] {
      int flag = 0;
      while (!stop_.load(std::memory_order_relaxed)) {
        MPI_Iprobe(MPI_ANY_SOURCE, 0, comm_, &flag, MPI_STATUS_IGNORE);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    });
  }
  ~ProgressThread() {
    if (!thread_.joinable()) return;
    stop_.store(true);
    thread_.join();
    MPI_Comm_free(&comm_);
  }
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace wlb::parallel
