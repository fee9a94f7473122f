#include "parallel/mesh.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace wlb::parallel {

MeshShape::MeshShape(int tp, int cp, int pp, int dp) : dims_{tp, cp, pp, dp} {
  static const char* names[] = {"tp", "cp", "pp", "dp"};
  for (int a = 0; a < 4; ++a)
    if (dims_[a] < 1) throw InputError(std::string("mesh.") + names[a] + " = " + std::to_string(dims_[a]) + " must be >= 1");
}

MeshShape MeshShape::fromDeck(const MeshConfig& m) {
  return MeshShape(static_cast<int>(m.tp), static_cast<int>(m.cp), static_cast<int>(m.pp), static_cast<int>(m.dp));
}

Coord MeshShape::coordOf(int rank) const {
  Coord c;
  c.tp = rank % tp();
  rank /= tp();
  c.cp = rank % cp();
  rank /= cp();
  c.pp = rank % pp();
  c.dp = rank / pp();
  return c;
}

int MeshShape::rankOf(const Coord& c) const { return c.tp + tp() * (c.cp + cp() * (c.pp + pp() * c.dp)); }

std::vector<int> MeshShape::groupOf(int rank, const std::vector<Axis>& axes) const {
  const Coord base = coordOf(rank);
  std::array<bool, 4> vary{false, false, false, false};
  for (Axis a : axes) vary[static_cast<int>(a)] = true;
  std::vector<int> out;
  std::array<int, 4> b{base.tp, base.cp, base.pp, base.dp};
  std::array<int, 4> lo, hi;
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

namespace {
// Ranks with the same colour form a group; key orders them by the varying coordinates.
Comm split(MPI_Comm world, const MeshShape& s, int rank, const std::vector<Axis>& axes) {
  const auto group = s.groupOf(rank, axes);
  const int colour = *std::min_element(group.begin(), group.end());
  const int key = static_cast<int>(std::find(group.begin(), group.end(), rank) - group.begin());
  MPI_Comm c = MPI_COMM_NULL;
  MPI_Comm_split(world, colour, key, &c);
  return Comm::adopt(c);
}
}  // namespace

Mesh::Mesh(const MeshShape& shape, MPI_Comm world) : shape_(shape) {
  int size = 0;
  MPI_Comm_size(world, &size);
  MPI_Comm_rank(world, &rank_);
  // Every rank sees the same sizes, so every rank throws the same error: no hang.
  if (size != shape.size())
    throw InputError("mesh " + shape.describe() + " needs " + std::to_string(shape.size()) +
                         " MPI ranks, but the job has " + std::to_string(size) +
                         " (launch with mpirun -n " + std::to_string(shape.size()) + " or change [mesh])",
                     /*collective=*/true);
  world_ = Comm::duplicate(world);
  coord_ = shape.coordOf(rank_);
  tp_ = split(world_, shape, rank_, {Axis::TP});
  cp_ = split(world_, shape, rank_, {Axis::CP});
  pp_ = split(world_, shape, rank_, {Axis::PP});
  dp_ = split(world_, shape, rank_, {Axis::DP});
  cp_tp_ = split(world_, shape, rank_, {Axis::TP, Axis::CP});
  if (coord_.pp > 0) {
    Coord c = coord_;
    c.pp -= 1;
    pp_prev_ = shape.rankOf(c);
  }
  if (coord_.pp + 1 < shape.pp()) {
    Coord c = coord_;
    c.pp += 1;
    pp_next_ = shape.rankOf(c);
  }
}

}  // namespace wlb::parallel
