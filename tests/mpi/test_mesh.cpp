// wlb-mpi-ranks: 1 2 3 4
// wlb-timeout: 60
// The mesh on real MPI ranks: group membership, a collective on every group, and the
// collective mismatch error.
#include <gtest/gtest.h>
#include <mpi.h>

#include "core/error.hpp"
#include "mpi_world.hpp"
#include "parallel/mesh.hpp"

using wlb::parallel::Mesh;
using wlb::parallel::MeshShape;

namespace {
using wlb::test::worldRank;
using wlb::test::worldSize;

// All shapes with tp*cp*pp*dp == n.
std::vector<MeshShape> shapesOf(int n) {
  std::vector<MeshShape> out;
  for (int tp = 1; tp <= n; ++tp)
    for (int cp = 1; cp <= n; ++cp)
      for (int pp = 1; pp <= n; ++pp)
        if (n % (tp * cp * pp) == 0) out.emplace_back(tp, cp, pp, n / (tp * cp * pp));
  return out;
}
}  // namespace

TEST(MeshMpi, GroupsMatchIndexMathAndCollectivesWork) {
  for (const auto& shape : shapesOf(worldSize())) {
    Mesh mesh(shape, MPI_COMM_WORLD);
    const int r = mesh.rank();
    EXPECT_EQ(mesh.coord(), shape.coordOf(r));
    struct G {
      const wlb::parallel::Comm* comm;
      std::vector<wlb::parallel::Axis> axes;
    };
    using A = wlb::parallel::Axis;
    for (const G& g : {G{&mesh.tp(), {A::TP}}, G{&mesh.cp(), {A::CP}}, G{&mesh.pp(), {A::PP}}, G{&mesh.dp(), {A::DP}},
                       G{&mesh.cpTp(), {A::TP, A::CP}}}) {
      const auto expected = shape.groupOf(r, g.axes);
      ASSERT_EQ(g.comm->size(), static_cast<int>(expected.size())) << shape.describe();
      // Gather world ranks over the group: must be exactly the expected members in order.
      std::vector<int> members(expected.size());
      MPI_Allgather(&r, 1, MPI_INT, members.data(), 1, MPI_INT, *g.comm);
      EXPECT_EQ(members, expected) << shape.describe();
      int sum = 0, one = 1;
      MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, *g.comm);
      EXPECT_EQ(sum, g.comm->size());
    }
    // Pipeline neighbours: a ring-free chain along pp.
    if (mesh.coord().pp == 0) {
      EXPECT_EQ(mesh.ppPrev(), MPI_PROC_NULL);
    }
    if (mesh.coord().pp == shape.pp() - 1) {
      EXPECT_EQ(mesh.ppNext(), MPI_PROC_NULL);
    }
    int token = r, got = -1;
    MPI_Sendrecv(&token, 1, MPI_INT, mesh.ppNext(), 7, &got, 1, MPI_INT, mesh.ppPrev(), 7, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    if (mesh.ppPrev() != MPI_PROC_NULL) {
      EXPECT_EQ(got, mesh.ppPrev());
    }
  }
}

TEST(MeshMpi, MismatchThrowsSameCollectiveErrorOnEveryRank) {
  const MeshShape wrong(1, worldSize() + 1, 1, 1);
  try {
    Mesh mesh(wrong, MPI_COMM_WORLD);
    FAIL() << "expected InputError";
  } catch (const wlb::InputError& e) {
    EXPECT_TRUE(e.collective());
    EXPECT_NE(std::string(e.what()).find("needs " + std::to_string(worldSize() + 1) + " MPI ranks"), std::string::npos);
  }
  // Still able to communicate afterwards: nobody is stuck.
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MeshMpi, ThrowIfAnyFailedReachesEveryRank) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const int bad = worldSize() - 1;
  try {
    wlb::parallel::throwIfAnyFailed(MPI_COMM_WORLD, rank == bad ? "file x.txt line 3: bad" : "");
    FAIL() << "expected InputError";
  } catch (const wlb::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(bad)), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("x.txt line 3"), std::string::npos);
  }
  EXPECT_NO_THROW(wlb::parallel::throwIfAnyFailed(MPI_COMM_WORLD, ""));
}
