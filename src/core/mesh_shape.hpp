#pragma once
/// \file mesh_shape.hpp
/// \brief The 4D (TP x CP x PP x DP) mesh as pure index math, no MPI: rank <-> coordinates
/// with TP innermost, then CP, PP, DP outermost (WLB-LLM's mapping: inner dimensions stay
/// on a node). The one place this math lives: the executor (`parallel::Mesh` adds the
/// communicators), the simulator (`pp::SimConfig::mesh()`) and the trace's rank
/// coordinates (`trace::RankCoord`) all use it.

#include <array>
#include <string>
#include <vector>

#include "core/deck.hpp"

namespace wlb {

struct MeshCoord {
  int tp = 0, cp = 0, pp = 0, dp = 0;
  bool operator==(const MeshCoord& o) const { return tp == o.tp && cp == o.cp && pp == o.pp && dp == o.dp; }
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

  MeshCoord coordOf(int rank) const;
  int rankOf(const MeshCoord& c) const;
  /// Ranks sharing every coordinate of `rank` except those on `axes`, ordered by the
  /// varying coordinates (innermost fastest). Its size is the product of those dims.
  std::vector<int> groupOf(int rank, const std::vector<Axis>& axes) const;
  std::string describe() const;  ///< "tp=2 cp=2 pp=1 dp=1 (4 ranks)"

 private:
  std::array<int, 4> dims_{};
};

}  // namespace wlb
