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
#include "core/mesh_shape.hpp"
#include "parallel/comm.hpp"

namespace wlb::parallel {

// The pure shape lives in core/mesh_shape.hpp (no MPI); these names keep the
// communicator code short.
using Coord = MeshCoord;
using Axis = wlb::Axis;
using MeshShape = wlb::MeshShape;

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
