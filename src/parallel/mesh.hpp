#pragma once
/// \file mesh.hpp
/// \brief The 4D (TP x CP x PP x DP) mesh: rank <-> coordinates with TP innermost, then
/// CP, PP, DP outermost (WLB-LLM's mapping: inner dimensions stay on a node), and the
/// owning communicators of every group.

#include <mpi.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "core/deck.hpp"
#include "parallel/comm.hpp"

namespace wlb::parallel {

struct Coord {
  int tp = 0, cp = 0, pp = 0, dp = 0;
  bool operator==(const Coord& o) const { return tp == o.tp && cp == o.cp && pp == o.pp && dp == o.dp; }
};

enum class Axis : int { TP = 0, CP = 1, PP = 2, DP = 3 };

/// Pure index math of the mesh; no MPI. The one place rank <-> coordinate lives.
class MeshShape {
 public:
  MeshShape(int tp, int cp, int pp, int dp);
  static MeshShape fromDeck(const MeshConfig& m);

  int tp() const { return dims_[0]; }
  int cp() const { return dims_[1]; }
  int pp() const { return dims_[2]; }
  int dp() const { return dims_[3]; }
  int dim(Axis a) const { return dims_[static_cast<int>(a)]; }
  int size() const { return dims_[0] * dims_[1] * dims_[2] * dims_[3]; }

  Coord coordOf(int rank) const;
  int rankOf(const Coord& c) const;
  /// Ranks sharing every coordinate of `rank` except those on `axes`, ordered by the
  /// varying coordinates (innermost fastest). Its size is the product of those dims.
  std::vector<int> groupOf(int rank, const std::vector<Axis>& axes) const;
  std::string describe() const;  ///< "tp=2 cp=2 pp=1 dp=1 (4 ranks)"

 private:
  std::array<int, 4> dims_;
};

/// The mesh on an MPI communicator: coordinates of this rank and owning group
/// communicators. Construction is collective; a world size that differs from
/// tp*cp*pp*dp throws the same collective InputError on every rank (no hang).
class Mesh {
 public:
  Mesh(const MeshShape& shape, MPI_Comm world);

  const MeshShape& shape() const { return shape_; }
  int rank() const { return rank_; }
  const Coord& coord() const { return coord_; }

  const Comm& world() const { return world_; }
  const Comm& tp() const { return tp_; }
  const Comm& cp() const { return cp_; }
  const Comm& pp() const { return pp_; }
  const Comm& dp() const { return dp_; }
  const Comm& cpTp() const { return cp_tp_; }  ///< the CP x TP group of one micro-batch

  /// Previous / next pipeline stage's world rank, or MPI_PROC_NULL at the ends.
  int ppPrev() const { return pp_prev_; }
  int ppNext() const { return pp_next_; }

 private:
  MeshShape shape_;
  int rank_ = 0;
  Coord coord_;
  Comm world_, tp_, cp_, pp_, dp_, cp_tp_;
  int pp_prev_ = MPI_PROC_NULL, pp_next_ = MPI_PROC_NULL;
};

}  // namespace wlb::parallel
