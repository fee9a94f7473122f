/// \file clock_sync.cpp
/// \brief alignedRecorder (see clock_sync.hpp).

#include "trace/clock_sync.hpp"

#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

namespace wlb::trace {

Recorder alignedRecorder(MPI_Comm comm, RankCoord coord) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const auto steadyNs = &Recorder::steadyNowNs;
  // offset = local - rank 0, from the round trip with the smallest RTT
  constexpr int kRounds = 8;
  constexpr int kTag = 7301;
  std::int64_t offset_ns = 0;
  MPI_Barrier(comm);
  if (rank == 0) {
    for (int r = 1; r < size; ++r) {
      std::int64_t best_rtt = std::numeric_limits<std::int64_t>::max();
      std::int64_t best_off = 0;
      for (int i = 0; i < kRounds; ++i) {
        std::int64_t t0 = steadyNs();
        std::int64_t tr = 0;
        MPI_Send(&t0, 1, MPI_INT64_T, r, kTag, comm);
        MPI_Recv(&tr, 1, MPI_INT64_T, r, kTag, comm, MPI_STATUS_IGNORE);
        std::int64_t t1 = steadyNs();
        if (t1 - t0 < best_rtt) {
          best_rtt = t1 - t0;
          best_off = tr - (t0 + (t1 - t0) / 2);
        }
      }
      MPI_Send(&best_off, 1, MPI_INT64_T, r, kTag + 1, comm);
    }
  } else {
    for (int i = 0; i < kRounds; ++i) {
      std::int64_t t0 = 0;
      MPI_Recv(&t0, 1, MPI_INT64_T, 0, kTag, comm, MPI_STATUS_IGNORE);
      std::int64_t tr = steadyNs();
      MPI_Send(&tr, 1, MPI_INT64_T, 0, kTag, comm);
    }
    MPI_Recv(&offset_ns, 1, MPI_INT64_T, 0, kTag + 1, comm, MPI_STATUS_IGNORE);
  }
  // Common epoch: rank 0's clock now, and rank 0's wall-clock time.
  std::int64_t epoch = steadyNs();
  MPI_Bcast(&epoch, 1, MPI_INT64_T, 0, comm);
  char buf[48] = {0};
  if (rank == 0) std::snprintf(buf, sizeof buf, "%s", Recorder::isoNowUtc().c_str());
  MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, comm);
  MPI_Barrier(comm);
  return Recorder(rank, coord, offset_ns, epoch, buf);
}

}  // namespace wlb::trace
