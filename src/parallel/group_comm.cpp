/// \file group_comm.cpp
/// \brief The host-staged MPI group communicator and the backend choice (group_comm.hpp).
/// The NCCL communicator is group_comm_nccl.cpp (built with WLB_ENABLE_NCCL).

#include "parallel/group_comm.hpp"

#include <unistd.h>
#include <algorithm>
#include <climits>
#include <functional>
#include <stdexcept>
#include <string>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"

namespace wlb::parallel {

#if defined(WLB_HAVE_NCCL) && defined(KOKKOS_ENABLE_CUDA)
std::unique_ptr<GroupComm> makeNcclGroupComm(MPI_Comm comm);  // group_comm_nccl.cpp
#define WLB_NCCL_GROUPS 1
#else
#define WLB_NCCL_GROUPS 0
#endif

namespace {

using Space = GroupComm::Space;
using Mem = Space::memory_space;
constexpr bool kHostMem = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;
using DevU = Kokkos::View<float*, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using HostU = Kokkos::View<float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

int toInt(std::int64_t n, const char* what) {
  if (n < 0 || n > INT_MAX)
    throw std::invalid_argument(std::string("wlb::parallel::GroupComm: ") + what + " exceeds the MPI int range");
  return static_cast<int>(n);
}

// A host view of a buffer in the default memory space: the buffer itself on host
// memory spaces, else a staging copy (filled from the device when `in`).
class Staged {
 public:
  Staged(float* dev, std::int64_t n, bool in) : dev_(dev), n_(n) {
    if (kHostMem || n == 0) {
      host_ = dev;
      return;
    }
    buf_.resize(static_cast<std::size_t>(n));
    host_ = buf_.data();
    if (in) Kokkos::deep_copy(HostU(host_, n_), DevU(dev_, n_));
  }
  float* host() const { return host_; }
  /// Copy the host data back to the device buffer (no-op on host memory spaces).
  void out() const {
    if (!kHostMem && n_ > 0) Kokkos::deep_copy(DevU(dev_, n_), HostU(host_, n_));
  }

 private:
  float* dev_;
  std::int64_t n_;
  float* host_ = nullptr;
  std::vector<float> buf_;
};

class MpiGroupComm final : public GroupComm {
 public:
  explicit MpiGroupComm(MPI_Comm comm) : GroupComm(comm) {}
  CommBackend backend() const override { return CommBackend::Mpi; }

  void allreduceSum(const Space& space, float* data, std::int64_t n) override {
    kk::fence(space, "wlb::parallel::GroupComm::allreduce");
    Staged h(data, n, true);
    MPI_Allreduce(MPI_IN_PLACE, h.host(), toInt(n, "all-reduce count"), MPI_FLOAT, MPI_SUM, comm_);
    h.out();
  }

  void allgatherv(const Space& space, const float* send, float* recv, const std::vector<std::int64_t>& counts,
                  const std::vector<std::int64_t>& displs) override {
    kk::fence(space, "wlb::parallel::GroupComm::allgatherv");
    std::vector<int> c(counts.size()), d(displs.size());
    std::int64_t total = 0;
    for (std::size_t s = 0; s < counts.size(); ++s) {
      c[s] = toInt(counts[s], "all-gather count");
      d[s] = toInt(displs[s], "all-gather displacement");
      total = std::max(total, displs[s] + counts[s]);
    }
    Staged in(const_cast<float*>(send), counts[static_cast<std::size_t>(rank_)], true);
    Staged out(recv, total, false);
    MPI_Allgatherv(in.host(), c[static_cast<std::size_t>(rank_)], MPI_FLOAT, out.host(), c.data(), d.data(), MPI_FLOAT,
                   comm_);
    out.out();
  }

  void reduceScatterv(const Space& space, const float* send, float* recv, const std::vector<std::int64_t>& counts,
                      const std::vector<std::int64_t>& displs) override {
    kk::fence(space, "wlb::parallel::GroupComm::reduce_scatterv");
    std::vector<int> c(counts.size());
    std::int64_t total = 0;
    for (std::size_t s = 0; s < counts.size(); ++s) {
      c[s] = toInt(counts[s], "reduce-scatter count");
      // MPI_Reduce_scatter takes the blocks back to back in rank order.
      if (displs[s] != total) throw std::invalid_argument("wlb::parallel::GroupComm: reduce-scatter blocks not dense");
      total += counts[s];
    }
    Staged in(const_cast<float*>(send), total, true);
    Staged out(recv, counts[static_cast<std::size_t>(rank_)], false);
    MPI_Reduce_scatter(in.host(), out.host(), c.data(), MPI_FLOAT, MPI_SUM, comm_);
    out.out();
  }

  void exchange(const Space& space, const std::vector<Msg>& sends, const std::vector<Msg>& recvs, int tag) override {
    kk::fence(space, "wlb::parallel::GroupComm::exchange");
    std::vector<Staged> rs, ss;
    rs.reserve(recvs.size());
    ss.reserve(sends.size());
    std::vector<MPI_Request> reqs;
    reqs.reserve(recvs.size() + sends.size());
    for (const Msg& m : recvs) {
      rs.emplace_back(m.data, m.count, false);
      reqs.emplace_back();
      MPI_Irecv(rs.back().host(), toInt(m.count, "message"), MPI_FLOAT, m.peer, tag, comm_, &reqs.back());
    }
    for (const Msg& m : sends) {
      ss.emplace_back(m.data, m.count, true);
      reqs.emplace_back();
      MPI_Isend(ss.back().host(), toInt(m.count, "message"), MPI_FLOAT, m.peer, tag, comm_, &reqs.back());
    }
    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    for (const Staged& r : rs) r.out();
  }
};

// This rank's GPU (-1 on host backends).
int localDevice() {
#if defined(KOKKOS_ENABLE_CUDA)
  return Kokkos::Cuda().cuda_device();
#else
  return -1;
#endif
}

}  // namespace

GroupComm::GroupComm(MPI_Comm comm) : comm_(comm) {
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm_size(comm, &size_);
}

const char* commBackendName(CommBackend b) {
  return b == CommBackend::Nccl ? "nccl" : "mpi";
}

bool ncclAvailable() {
  return WLB_NCCL_GROUPS != 0;
}

CommBackend resolveCommBackend(const std::string& name, MPI_Comm world) {
  if (name != "auto" && name != "mpi" && name != "nccl")
    throw InputError("key 'run.comm_backend': unknown backend \"" + name + "\" (expected auto, mpi or nccl)");
  if (name == "mpi") return CommBackend::Mpi;
  if (!ncclAvailable()) {
    if (name == "auto") return CommBackend::Mpi;
    throw InputError(
        "key 'run.comm_backend': nccl needs a build with the Kokkos CUDA backend and -DWLB_ENABLE_NCCL=ON, which this "
        "build is not (use mpi or auto)");
  }
  // One GPU per rank on every node: (node, device) pairs must be distinct.
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const long long key[2] = {static_cast<long long>(std::hash<std::string>{}(host)&0x7fffffffffffffffLL),
                            static_cast<long long>(localDevice())};
  int size = 1;
  MPI_Comm_size(world, &size);
  std::vector<long long> all(static_cast<std::size_t>(2 * size));
  MPI_Allgather(key, 2, MPI_LONG_LONG, all.data(), 2, MPI_LONG_LONG, world);
  std::vector<std::pair<long long, long long>> pairs;
  pairs.reserve(static_cast<std::size_t>(size));
  for (std::size_t r = 0; r < static_cast<std::size_t>(size); ++r) pairs.emplace_back(all[2 * r], all[2 * r + 1]);
  std::sort(pairs.begin(), pairs.end());
  const bool shared = std::adjacent_find(pairs.begin(), pairs.end()) != pairs.end();
  if (!shared) return CommBackend::Nccl;
  if (name == "auto") return CommBackend::Mpi;
  throw InputError(
      "key 'run.comm_backend': nccl needs one GPU per rank, but ranks share a GPU on a node (NCCL refuses duplicate "
      "GPUs); use mpi or auto");
}

std::unique_ptr<GroupComm> makeGroupComm(MPI_Comm comm, CommBackend backend) {
  if (backend == CommBackend::Nccl) {
#if WLB_NCCL_GROUPS
    return makeNcclGroupComm(comm);
#else
    throw InputError("key 'run.comm_backend': this build has no NCCL");
#endif
  }
  return std::make_unique<MpiGroupComm>(comm);
}

}  // namespace wlb::parallel
