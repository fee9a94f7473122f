#pragma once
/// \file clock_sync.hpp
/// \brief The measured recorder: clocks of every rank aligned to rank 0 over MPI.

#include <mpi.h>

#include "trace/recorder.hpp"

namespace wlb::trace {

/// Collective over `comm`: measures each rank's clock offset to rank 0 (ping-pong, the
/// round trip with the smallest RTT wins: Cristian's algorithm) and agrees on a common
/// epoch. `comm` is only used here; the writer takes its own communicator.
Recorder alignedRecorder(MPI_Comm comm, RankCoord coord);

}  // namespace wlb::trace
