#pragma once
/// \file group_comm.hpp
/// \brief Collectives of one mesh group (CP, TP or DP x CP) on buffers in the default
/// memory space: what the executor's KV exchange, TP all-reduce and gradient all-reduce
/// call, whichever library moves the bytes.
///
/// Two backends (docs/runtime.md § Communication backends):
///   * mpi  — host-staged: device buffers are copied to host, moved by MPI, copied back
///            (no copies on host memory spaces). Works everywhere, including several
///            ranks sharing one GPU and MPI libraries that are not CUDA-aware.
///   * nccl — device buffers straight to NCCL on the execution-space instance's stream
///            (grouped ncclSend/ncclRecv, ncclAllReduce). Needs a CUDA build with
///            WLB_ENABLE_NCCL and one GPU per rank (NCCL refuses two ranks on one GPU).
/// Every call is collective over the group and completes before returning (the data
/// are ready in `space` order on return).

#include <mpi.h>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace wlb::parallel {

enum class CommBackend : int { Mpi, Nccl };
/// "mpi" | "nccl".
const char* commBackendName(CommBackend b);
/// Whether this build can run the NCCL backend (CUDA backend + WLB_ENABLE_NCCL).
bool ncclAvailable();

/// The backend a deck's `run.comm_backend` ("auto" | "mpi" | "nccl") selects on this
/// machine. auto: nccl when ncclAvailable() and every rank of each node has its own GPU,
/// else mpi. Collective over `world` (all ranks agree); throws InputError naming the key
/// when nccl is asked for and cannot run (no NCCL in the build, or GPUs shared).
CommBackend resolveCommBackend(const std::string& name, MPI_Comm world);

class GroupComm {
 public:
  using Space = Kokkos::DefaultExecutionSpace;
  virtual ~GroupComm() = default;
  virtual CommBackend backend() const = 0;
  MPI_Comm mpi() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  /// In-place sum over the group of `n` floats.
  virtual void allreduceSum(const Space& space, float* data, std::int64_t n) = 0;
  /// Rank r contributes counts[r] floats (`send`); every rank receives all of them in
  /// `recv` at displs[r]. counts/displs in floats, identical on every rank.
  virtual void allgatherv(const Space& space, const float* send, float* recv, const std::vector<std::int64_t>& counts,
                          const std::vector<std::int64_t>& displs) = 0;
  /// `send` holds a block for every rank r at displs[r] (counts[r] floats); `recv`
  /// (counts[rank] floats) gets the sum over the group of this rank's block.
  virtual void reduceScatterv(const Space& space, const float* send, float* recv,
                              const std::vector<std::int64_t>& counts, const std::vector<std::int64_t>& displs) = 0;
  /// One message to or from a peer of the group.
  struct Msg {
    int peer = 0;
    float* data = nullptr;
    std::int64_t count = 0;
  };
  /// Point-to-point exchange: every receive and send posted together, all complete on
  /// return. At most one message per (peer, direction) per call; `tag` separates calls.
  virtual void exchange(const Space& space, const std::vector<Msg>& sends, const std::vector<Msg>& recvs, int tag) = 0;

 protected:
  explicit GroupComm(MPI_Comm comm);
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

/// A group communicator over `comm` (not owned; must outlive the object). Collective
/// over `comm` for nccl (it creates the NCCL communicator).
std::unique_ptr<GroupComm> makeGroupComm(MPI_Comm comm, CommBackend backend);

}  // namespace wlb::parallel
