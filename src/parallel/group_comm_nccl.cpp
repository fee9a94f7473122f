/// \file group_comm_nccl.cpp
/// \brief The NCCL group communicator (group_comm.hpp): device buffers straight to NCCL on
/// the execution-space instance's stream. Built only with WLB_ENABLE_NCCL; a no-op file
/// unless the Kokkos CUDA backend is enabled too.

#include "parallel/group_comm.hpp"

#if defined(WLB_HAVE_NCCL) && defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#include <nccl.h>

#include <stdexcept>
#include <string>

#include "core/kokkos_compat.hpp"
#include "parallel/nccl_comm.hpp"

namespace wlb::parallel {
namespace {

void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("NCCL ") + what + ": " + ncclGetErrorString(r));
}
void check(cudaError_t r, const char* what) {
  if (r != cudaSuccess) throw std::runtime_error(std::string("CUDA ") + what + ": " + cudaGetErrorString(r));
}

class NcclGroupComm final : public GroupComm {
 public:
  explicit NcclGroupComm(MPI_Comm comm) : GroupComm(comm), nccl_(comm) {}
  CommBackend backend() const override { return CommBackend::Nccl; }

  void allreduceSum(const Space& space, float* data, std::int64_t n) override {
    if (n > 0) nccl_.allReduceSum(data, static_cast<std::size_t>(n), space.cuda_stream());
    kk::fence(space, "wlb::parallel::NcclGroupComm::allreduce");
  }

  void allgatherv(const Space& space, const float* send, float* recv, const std::vector<std::int64_t>& counts,
                  const std::vector<std::int64_t>& displs) override {
    const cudaStream_t st = space.cuda_stream();
    const auto me = static_cast<std::size_t>(rank_);
    if (counts[me] > 0)
      check(cudaMemcpyAsync(recv + displs[me], send, sizeof(float) * static_cast<std::size_t>(counts[me]),
                            cudaMemcpyDeviceToDevice, st),
            "cudaMemcpyAsync");
    check(ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const auto pp = static_cast<std::size_t>(p);
      if (counts[me] > 0) check(ncclSend(send, counts[me], ncclFloat, p, nccl_.get(), st), "ncclSend");
      if (counts[pp] > 0) check(ncclRecv(recv + displs[pp], counts[pp], ncclFloat, p, nccl_.get(), st), "ncclRecv");
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
    kk::fence(space, "wlb::parallel::NcclGroupComm::allgatherv");
  }

  void reduceScatterv(const Space& space, const float* send, float* recv, const std::vector<std::int64_t>& counts,
                      const std::vector<std::int64_t>& displs) override {
    const cudaStream_t st = space.cuda_stream();
    const auto me = static_cast<std::size_t>(rank_);
    const std::int64_t c = counts[me];
    // Every peer's copy of this rank's block lands in its own slot; the sum then runs in
    // ascending rank order (deterministic).
    Kokkos::View<float**, Kokkos::LayoutRight, Space::memory_space> parts(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::parallel::nccl::reduce_scatter"),
        static_cast<std::size_t>(size_), static_cast<std::size_t>(c));
    check(ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const auto pp = static_cast<std::size_t>(p);
      if (counts[pp] > 0) check(ncclSend(send + displs[pp], counts[pp], ncclFloat, p, nccl_.get(), st), "ncclSend");
      if (c > 0) check(ncclRecv(&parts(pp, 0), c, ncclFloat, p, nccl_.get(), st), "ncclRecv");
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
    const float* own = send + displs[me];
    const int P = size_, R = rank_;
    Kokkos::parallel_for(
        "wlb::parallel::nccl::reduce_scatter_sum", Kokkos::RangePolicy<Space>(space, 0, c),
        KOKKOS_LAMBDA(const std::int64_t i) {
          float s = 0.0f;
          for (int p = 0; p < P; ++p) s += p == R ? own[i] : parts(p, i);
          recv[i] = s;
        });
    kk::fence(space, "wlb::parallel::NcclGroupComm::reduce_scatterv");
  }

  void exchange(const Space& space, const std::vector<Msg>& sends, const std::vector<Msg>& recvs, int) override {
    const cudaStream_t st = space.cuda_stream();
    check(ncclGroupStart(), "ncclGroupStart");
    for (const Msg& m : recvs)
      if (m.count > 0) check(ncclRecv(m.data, m.count, ncclFloat, m.peer, nccl_.get(), st), "ncclRecv");
    for (const Msg& m : sends)
      if (m.count > 0) check(ncclSend(m.data, m.count, ncclFloat, m.peer, nccl_.get(), st), "ncclSend");
    check(ncclGroupEnd(), "ncclGroupEnd");
    kk::fence(space, "wlb::parallel::NcclGroupComm::exchange");
  }

 private:
  NcclComm nccl_;
};

}  // namespace

std::unique_ptr<GroupComm> makeNcclGroupComm(MPI_Comm comm) {
  return std::make_unique<NcclGroupComm>(comm);
}

}  // namespace wlb::parallel
#endif
