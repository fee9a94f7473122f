// GoogleTest main for MPI tests: every rank runs every test; only rank 0 prints, and the
// exit code is the OR of all ranks' results so one failing rank fails the test.
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>

namespace {
// Prints the failures of non-root ranks (prefixed with the rank) so they are not lost.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(),
                   r.summary());
  }

 private:
  int rank_;
};
}  // namespace

int main(int argc, char** argv) {
  // THREAD_MULTIPLE where the library has it: the pipeline executor drives transfers from a
  // progress thread (runtime/pipeline.cpp); with less it polls between layers instead.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int global_rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    ::testing::InitGoogleTest(&argc, argv);
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    if (rank != 0) {
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(rank));
    }
    int rc = RUN_ALL_TESTS();
    MPI_Allreduce(&rc, &global_rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0 && global_rc != rc) std::fprintf(stderr, "a test failed on another rank\n");
  }
  MPI_Finalize();
  return global_rc;
}
