/// \file mesh_shape.cpp
/// \brief Rank <-> coordinate math of the 4D mesh (see mesh_shape.hpp).

#include "core/mesh_shape.hpp"

#include <algorithm>
#include <string>

#include "core/error.hpp"

namespace wlb {

MeshShape::MeshShape(int tp, int cp, int pp, int dp) : dims_{tp, cp, pp, dp} {
  static const char* names[] = {"tp", "cp", "pp", "dp"};
  for (int a = 0; a < 4; ++a)
    if (dims_[a] < 1)
      throw InputError(std::string("mesh.") + names[a] + " = " + std::to_string(dims_[a]) + " must be >= 1");
}

MeshShape MeshShape::fromDeck(const MeshConfig& m) {
  return MeshShape(static_cast<int>(m.tp), static_cast<int>(m.cp), static_cast<int>(m.pp), static_cast<int>(m.dp));
}

MeshCoord MeshShape::coordOf(int rank) const {
  MeshCoord c;
  c.tp = rank % tp();
  rank /= tp();
  c.cp = rank % cp();
  rank /= cp();
  c.pp = rank % pp();
  c.dp = rank / pp();
  return c;
}

int MeshShape::rankOf(const MeshCoord& c) const {
  return c.tp + tp() * (c.cp + cp() * (c.pp + pp() * c.dp));
}

std::vector<int> MeshShape::groupOf(int rank, const std::vector<Axis>& axes) const {
  const MeshCoord base = coordOf(rank);
  std::array<bool, 4> vary{false, false, false, false};
  for (Axis a : axes) vary[static_cast<int>(a)] = true;
  std::vector<int> out;
  std::array<int, 4> b{base.tp, base.cp, base.pp, base.dp};
  std::array<int, 4> lo{}, hi{};
  for (int a = 0; a < 4; ++a) {
    lo[a] = vary[a] ? 0 : b[a];
    hi[a] = vary[a] ? dims_[a] : b[a] + 1;
  }
  for (int d = lo[3]; d < hi[3]; ++d)
    for (int p = lo[2]; p < hi[2]; ++p)
      for (int c = lo[1]; c < hi[1]; ++c)
        for (int t = lo[0]; t < hi[0]; ++t) out.push_back(rankOf({t, c, p, d}));
  return out;
}

std::string MeshShape::describe() const {
  return "tp=" + std::to_string(tp()) + " cp=" + std::to_string(cp()) + " pp=" + std::to_string(pp()) +
         " dp=" + std::to_string(dp()) + " (" + std::to_string(size()) + " ranks)";
}

}  // namespace wlb
