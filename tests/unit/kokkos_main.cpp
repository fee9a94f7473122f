// GoogleTest main for the unit tests that need Kokkos only (no MPI): the attention
// kernels, so that a GPU build of them runs on a machine without the MPI/HDF5 stack.
#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>

int main(int argc, char** argv) {
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    ::testing::InitGoogleTest(&argc, argv);
    rc = RUN_ALL_TESTS();
  }
  return rc;
}
