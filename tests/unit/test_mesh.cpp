// Mesh index math: rank <-> coordinates with TP innermost, groups for many shapes.
#include <gtest/gtest.h>

#include <set>

#include "core/error.hpp"
#include "parallel/mesh.hpp"

using wlb::parallel::Axis;
using wlb::parallel::Coord;
using wlb::parallel::MeshShape;

TEST(MeshShape, TpInnermostDpOutermost) {
  const MeshShape s(2, 2, 4, 2);
  EXPECT_EQ(s.size(), 32);
  EXPECT_EQ(s.coordOf(1), (Coord{1, 0, 0, 0}));
  EXPECT_EQ(s.coordOf(2), (Coord{0, 1, 0, 0}));
  EXPECT_EQ(s.coordOf(4), (Coord{0, 0, 1, 0}));
  EXPECT_EQ(s.coordOf(16), (Coord{0, 0, 0, 1}));
  EXPECT_EQ(s.coordOf(31), (Coord{1, 1, 3, 1}));
}

TEST(MeshShape, RoundTripAndGroupsForManyShapes) {
  for (int tp : {1, 2, 3, 8})
    for (int cp : {1, 2, 4})
      for (int pp : {1, 3, 4})
        for (int dp : {1, 2, 5}) {
          const MeshShape s(tp, cp, pp, dp);
          std::set<std::vector<int>> tp_groups;
          for (int r = 0; r < s.size(); ++r) {
            const Coord c = s.coordOf(r);
            ASSERT_EQ(s.rankOf(c), r);
            ASSERT_LT(c.tp, tp);
            ASSERT_LT(c.dp, dp);
            const auto g_tp = s.groupOf(r, {Axis::TP});
            const auto g_cp = s.groupOf(r, {Axis::CP});
            const auto g_pp = s.groupOf(r, {Axis::PP});
            const auto g_dp = s.groupOf(r, {Axis::DP});
            const auto g_ct = s.groupOf(r, {Axis::TP, Axis::CP});
            ASSERT_EQ(static_cast<int>(g_tp.size()), tp);
            ASSERT_EQ(static_cast<int>(g_cp.size()), cp);
            ASSERT_EQ(static_cast<int>(g_pp.size()), pp);
            ASSERT_EQ(static_cast<int>(g_dp.size()), dp);
            ASSERT_EQ(static_cast<int>(g_ct.size()), tp * cp);
            // A member's position in its group is its coordinate on that axis.
            EXPECT_EQ(g_cp[static_cast<std::size_t>(c.cp)], r);
            EXPECT_EQ(g_pp[static_cast<std::size_t>(c.pp)], r);
            // TP groups are contiguous rank blocks (inner dimension on a node).
            EXPECT_EQ(g_tp.back() - g_tp.front(), tp - 1);
            tp_groups.insert(g_tp);
          }
          EXPECT_EQ(static_cast<int>(tp_groups.size()), cp * pp * dp);
        }
}

TEST(MeshShape, RejectsNonPositiveDims) {
  EXPECT_THROW(MeshShape(0, 1, 1, 1), wlb::InputError);
  EXPECT_THROW(MeshShape(1, 1, -2, 1), wlb::InputError);
}
