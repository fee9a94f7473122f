#include "parallel/mesh.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace wlb::parallel {

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
                         " MPI ranks, but the job has " + std::to_string(size) + " (launch with mpirun -n " +
                         std::to_string(shape.size()) + " or change [mesh])",
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
