#pragma once
/// \file nccl_comm.hpp
/// \brief Owning NCCL communicator over the ranks of an MPI communicator (built only with
/// -DWLB_ENABLE_NCCL=ON; needs the CUDA toolkit). On a GPU cluster the CP/TP/DP groups of
/// the mesh get one each, so device buffers are reduced without staging through the host.

#if defined(WLB_HAVE_NCCL)
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <cstddef>

namespace wlb::parallel {

class NcclComm {
 public:
  /// Collective over `comm`: rank 0 creates the unique id, MPI broadcasts it.
  explicit NcclComm(MPI_Comm comm);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  ncclComm_t get() const { return comm_; }

  /// In-place sum all-reduce of `count` floats in device memory on `stream`.
  void allReduceSum(float* data, std::size_t count, cudaStream_t stream) const;
  /// All-gather `count` floats per rank (send -> recv of size*count) on `stream`.
  void allGather(const float* send, float* recv, std::size_t count, cudaStream_t stream) const;
  /// Reduce-scatter (sum) `count` floats per rank on `stream`.
  void reduceScatterSum(const float* send, float* recv, std::size_t count, cudaStream_t stream) const;

 private:
  ncclComm_t comm_ = nullptr;
  int rank_ = 0, size_ = 1;
};

}  // namespace wlb::parallel
#endif
