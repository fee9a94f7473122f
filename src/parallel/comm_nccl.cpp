// Built only with WLB_ENABLE_NCCL (see src/CMakeLists.txt: *_nccl.cpp).
#include <stdexcept>
#include <string>

#include "parallel/nccl_comm.hpp"

namespace wlb::parallel {
namespace {
void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("NCCL ") + what + ": " + ncclGetErrorString(r));
}
}  // namespace

NcclComm::NcclComm(MPI_Comm comm) {
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm_size(comm, &size_);
  ncclUniqueId id;
  if (rank_ == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm);
  check(ncclCommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
}

NcclComm::~NcclComm() {
  if (comm_) ncclCommDestroy(comm_);
}

void NcclComm::allReduceSum(float* data, std::size_t count, cudaStream_t stream) const {
  check(ncclAllReduce(data, data, count, ncclFloat, ncclSum, comm_, stream), "ncclAllReduce");
}

void NcclComm::allGather(const float* send, float* recv, std::size_t count, cudaStream_t stream) const {
  check(ncclAllGather(send, recv, count, ncclFloat, comm_, stream), "ncclAllGather");
}

void NcclComm::reduceScatterSum(const float* send, float* recv, std::size_t count, cudaStream_t stream) const {
  check(ncclReduceScatter(send, recv, count, ncclFloat, ncclSum, comm_, stream), "ncclReduceScatter");
}

}  // namespace wlb::parallel
