#pragma once
/// \file mpi_world.hpp
/// \brief Size and rank of MPI_COMM_WORLD for the MPI tests (one copy for every test file).

#include <mpi.h>

namespace wlb::test {

inline int worldSize() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}
inline int worldRank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

}  // namespace wlb::test
