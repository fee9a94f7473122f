#pragma once
/// \file attention_impl.hpp
/// \brief Internal: template definitions of attention::forward/backward. Include only from
/// attention.cpp (explicit instantiations) or from a translation unit that needs another
/// execution space.

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/attention.hpp"
#include "attention/attention_host.hpp"
#include "core/kokkos_compat.hpp"

#if defined(KOKKOS_ENABLE_CUDA)
#include "attention/cuda_mma.hpp"
#include "attention/cuda_simt.hpp"
#endif

namespace wlb::attention {
namespace detail {

template <class View>
void requireShape(const View& v, std::int64_t rows, std::int64_t d1, std::int64_t d2, const char* name) {
  if (static_cast<std::int64_t>(v.extent(0)) < rows || static_cast<std::int64_t>(v.extent(1)) != d1 ||
      (View::rank == 3 && static_cast<std::int64_t>(v.extent(2)) != d2))
    throw std::invalid_argument(std::string("wlb::attention: view '") + v.label() + "' (" + name +
                                ") has a shape inconsistent with the batch");
}

struct Shape {
  int heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 1.0f;
  /// The scale in the kernels' exp2 units (scale * log2(e)).
  float scaleLog2() const { return scale * 1.4426950408889634f; }
};

/// The argument fields the host and CUDA argument blocks share (host::Args, cuda::Args):
/// Q, K, V with their row strides, and the shape.
template <class A, class V>
void setInputs(A& a, const V& q, const V& k, const V& v, Shape s) {
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.q_s0 = q.stride(0);
  a.k_s0 = k.stride(0);
  a.v_s0 = v.stride(0);
  a.heads = s.heads;
  a.kv_heads = s.kv_heads;
  a.head_dim = s.head_dim;
  a.scale = s.scale;
}

template <class In3>
Shape checkCommon(const In3& q, const In3& k, const In3& v, const VarlenBatch& b, const KernelConfig& cfg,
                  float softmax_scale) {
  validateConfig(cfg);
  Shape s;
  s.heads = static_cast<int>(q.extent(1));
  s.kv_heads = static_cast<int>(k.extent(1));
  s.head_dim = static_cast<int>(q.extent(2));
  if (s.heads <= 0 || s.kv_heads <= 0 || s.head_dim <= 0 || s.heads % s.kv_heads != 0)
    throw std::invalid_argument("wlb::attention: heads must be a positive multiple of kv_heads");
  if (s.head_dim > 256) throw std::invalid_argument("wlb::attention: head_dim > 256 unsupported");
  requireShape(q, b.q_tokens, s.heads, s.head_dim, "q");
  requireShape(k, b.k_tokens, s.kv_heads, s.head_dim, "k");
  requireShape(v, b.k_tokens, s.kv_heads, s.head_dim, "v");
  s.scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  return s;
}

template <class ExecSpace>
using RangeI64 = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;

/// Piece ranges [P][4] in the execution space's memory.
template <class ExecSpace>
Kokkos::View<std::int64_t* [4], Kokkos::LayoutRight, typename ExecSpace::memory_space> deviceRanges(
    const VarlenBatch& b) {
  Kokkos::View<std::int64_t* [4], Kokkos::LayoutRight, typename ExecSpace::memory_space> r("wlb::attention::ranges",
                                                                                           b.pieces.size());
  auto h = Kokkos::create_mirror_view(r);
  for (std::size_t i = 0; i < b.pieces.size(); ++i) {
    h(i, 0) = b.pieces[i].q_begin;
    h(i, 1) = b.pieces[i].q_end;
    h(i, 2) = b.pieces[i].k_begin;
    h(i, 3) = b.pieces[i].k_end;
  }
  Kokkos::deep_copy(r, h);
  return r;
}

/// (piece, tile) work list in the execution space's memory.
template <class ExecSpace>
Kokkos::View<std::int64_t* [2], Kokkos::LayoutRight, typename ExecSpace::memory_space> tileList(const VarlenBatch& b,
                                                                                                int tile, bool keys) {
  std::vector<std::int64_t> flat;
  for (std::size_t p = 0; p < b.pieces.size(); ++p) {
    const std::int64_t n = keys ? (b.pieces[p].nq() > 0 ? b.pieces[p].nk() : 0) : b.pieces[p].nq();
    for (std::int64_t t = 0; t * tile < n; ++t) {
      flat.push_back(static_cast<std::int64_t>(p));
      flat.push_back(t);
    }
  }
  Kokkos::View<std::int64_t* [2], Kokkos::LayoutRight, typename ExecSpace::memory_space> l("wlb::attention::tiles",
                                                                                           flat.size() / 2);
  auto h = Kokkos::create_mirror_view(l);
  for (std::size_t i = 0; i < flat.size() / 2; ++i) {
    h(i, 0) = flat[2 * i];
    h(i, 1) = flat[2 * i + 1];
  }
  Kokkos::deep_copy(l, h);
  return l;
}

// ---------------- portable (team) path: what device backends run ----------------------

/// QV/OV: float or bf16 views ([tokens][heads][D]); accumulation in FP32.
template <class ExecSpace, class QV, class OV>
void forwardPortable(const ExecSpace& space, QV q, QV k, QV v, const VarlenBatch& b, OV o,
                     typename Views<ExecSpace>::Out2 lse, const KernelConfig& cfg, Shape s) {
  using TO = typename OV::non_const_value_type;
  const auto ranges = deviceRanges<ExecSpace>(b);
  const auto tiles = tileList<ExecSpace>(b, cfg.tile_q, false);
  const int H = s.heads, D = s.head_dim, group = s.heads / s.kv_heads, TQ = cfg.tile_q;
  const float scale = s.scale;
  const std::int64_t ntiles = static_cast<std::int64_t>(tiles.extent(0));
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  using Member = typename Policy::member_type;
  Kokkos::parallel_for(
      "wlb::attention::fwd::portable", Policy(space, static_cast<int>(ntiles * H), Kokkos::AUTO),
      KOKKOS_LAMBDA(const Member& team) {
        const std::int64_t item = team.league_rank() / H;
        const int h = team.league_rank() % H, hk = h / group;
        const std::int64_t p = tiles(item, 0), q0 = tiles(item, 1) * TQ;
        const std::int64_t qb = ranges(p, 0), nq = ranges(p, 1) - qb, kb = ranges(p, 2), nk = ranges(p, 3) - kb,
                           off = nk - nq;
        const std::int64_t rows = wlb::kk::min<std::int64_t>(TQ, nq - q0);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, static_cast<int>(rows)), [&](const int r) {
          const std::int64_t t = qb + q0 + r, L = off + q0 + r;
          float m = -3.0e38f;
          for (std::int64_t j = 0; j <= L; ++j) {
            float sdot = 0.0f;
            for (int d = 0; d < D; ++d) sdot += toFloat(q(t, h, d)) * toFloat(k(kb + j, hk, d));
            m = wlb::kk::max(m, sdot * scale);
          }
          float l = 0.0f;
          float acc[256];
          for (int d = 0; d < D; ++d) acc[d] = 0.0f;
          for (std::int64_t j = 0; j <= L; ++j) {
            float sdot = 0.0f;
            for (int d = 0; d < D; ++d) sdot += toFloat(q(t, h, d)) * toFloat(k(kb + j, hk, d));
            const float pj = wlb::kk::exp(sdot * scale - m);
            l += pj;
            for (int d = 0; d < D; ++d) acc[d] += pj * toFloat(v(kb + j, hk, d));
          }
          const float inv = 1.0f / l;
          for (int d = 0; d < D; ++d) o(t, h, d) = fromFloat<TO>(acc[d] * inv);
          lse(t, h) = m + wlb::kk::log(l);
        });
      });
}

template <class ExecSpace, class QV>
void backwardPortable(const ExecSpace& space, QV q, QV k, QV v, QV o, typename Views<ExecSpace>::In2 lse, QV dO,
                      const VarlenBatch& b, typename Views<ExecSpace>::Out3 dq, typename Views<ExecSpace>::Out3 dk,
                      typename Views<ExecSpace>::Out3 dv, const KernelConfig& cfg, Shape s) {
  const auto ranges = deviceRanges<ExecSpace>(b);
  const auto qtiles = tileList<ExecSpace>(b, cfg.tile_q, false);
  const auto ktiles = tileList<ExecSpace>(b, cfg.tile_k, true);
  const int H = s.heads, Hkv = s.kv_heads, D = s.head_dim, group = s.heads / s.kv_heads, TQ = cfg.tile_q,
            TK = cfg.tile_k;
  const float scale = s.scale;
  using mem = typename ExecSpace::memory_space;
  Kokkos::View<float**, Kokkos::LayoutRight, mem> delta("wlb::attention::bwd::delta", q.extent(0), H);
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  using Member = typename Policy::member_type;

  // dq (and delta): one thread per query row, no races (query ranges are disjoint).
  Kokkos::parallel_for(
      "wlb::attention::bwd::dq::portable", Policy(space, static_cast<int>(qtiles.extent(0) * H), Kokkos::AUTO),
      KOKKOS_LAMBDA(const Member& team) {
        const std::int64_t item = team.league_rank() / H;
        const int h = team.league_rank() % H, hk = h / group;
        const std::int64_t p = qtiles(item, 0), q0 = qtiles(item, 1) * TQ;
        const std::int64_t qb = ranges(p, 0), nq = ranges(p, 1) - qb, kb = ranges(p, 2), nk = ranges(p, 3) - kb,
                           off = nk - nq;
        const std::int64_t rows = wlb::kk::min<std::int64_t>(TQ, nq - q0);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, static_cast<int>(rows)), [&](const int r) {
          const std::int64_t t = qb + q0 + r, L = off + q0 + r;
          float dl = 0.0f;
          for (int d = 0; d < D; ++d) dl += toFloat(dO(t, h, d)) * toFloat(o(t, h, d));
          delta(t, h) = dl;
          const float ls = lse(t, h);
          for (std::int64_t j = 0; j <= L; ++j) {
            float sdot = 0.0f, dp = 0.0f;
            for (int d = 0; d < D; ++d) {
              sdot += toFloat(q(t, h, d)) * toFloat(k(kb + j, hk, d));
              dp += toFloat(dO(t, h, d)) * toFloat(v(kb + j, hk, d));
            }
            const float ds = wlb::kk::exp(sdot * scale - ls) * (dp - dl) * scale;
            for (int d = 0; d < D; ++d) dq(t, h, d) += ds * toFloat(k(kb + j, hk, d));
          }
        });
      });
  // dk, dv: one thread per key row; atomics because pieces may share keys.
  Kokkos::parallel_for(
      "wlb::attention::bwd::dkdv::portable", Policy(space, static_cast<int>(ktiles.extent(0) * Hkv), Kokkos::AUTO),
      KOKKOS_LAMBDA(const Member& team) {
        const std::int64_t item = team.league_rank() / Hkv;
        const int hk = team.league_rank() % Hkv;
        const std::int64_t p = ktiles(item, 0), k0 = ktiles(item, 1) * TK;
        const std::int64_t qb = ranges(p, 0), nq = ranges(p, 1) - qb, kb = ranges(p, 2), nk = ranges(p, 3) - kb,
                           off = nk - nq;
        const std::int64_t rows = wlb::kk::min<std::int64_t>(TK, nk - k0);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, static_cast<int>(rows)), [&](const int r) {
          const std::int64_t j = k0 + r;
          float adk[256], adv[256];
          for (int d = 0; d < D; ++d) adk[d] = adv[d] = 0.0f;
          for (int h = hk * group; h < (hk + 1) * group; ++h) {
            for (std::int64_t i = wlb::kk::max<std::int64_t>(0, j - off); i < nq; ++i) {
              const std::int64_t t = qb + i;
              float sdot = 0.0f, dp = 0.0f;
              for (int d = 0; d < D; ++d) {
                sdot += toFloat(q(t, h, d)) * toFloat(k(kb + j, hk, d));
                dp += toFloat(dO(t, h, d)) * toFloat(v(kb + j, hk, d));
              }
              const float pj = wlb::kk::exp(sdot * scale - lse(t, h));
              const float ds = pj * (dp - delta(t, h)) * scale;
              for (int d = 0; d < D; ++d) {
                adv[d] += pj * toFloat(dO(t, h, d));
                adk[d] += ds * toFloat(q(t, h, d));
              }
            }
          }
          for (int d = 0; d < D; ++d) {
            Kokkos::atomic_add(&dk(kb + j, hk, d), adk[d]);
            Kokkos::atomic_add(&dv(kb + j, hk, d), adv[d]);
          }
        });
      });
}

// ---------------- host SIMD path --------------------------------------------------------

template <class ExecSpace>
constexpr bool hostAccessible() {
  return Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible;
}

template <class V>
bool innerContiguous(const V& x, int D) {
  return x.stride(V::rank - 1) == 1 && (V::rank < 3 || static_cast<int>(x.stride(1)) == D);
}

#if WLB_ATTN_HOST_SIMD
struct HostOffsets {
  std::vector<std::int64_t> qb_off, kb_off;
  std::int64_t nqblk = 0, nkblk = 0;
  HostOffsets(const VarlenBatch& b, const KernelConfig& cfg) {
    for (const auto& p : b.pieces) {
      qb_off.push_back(nqblk);
      kb_off.push_back(nkblk);
      nqblk += (p.nq() + cfg.tile_q - 1) / cfg.tile_q;
      nkblk += p.nq() > 0 ? (p.nk() + cfg.tile_k - 1) / cfg.tile_k : 0;
    }
  }
};

/// The fields forward and backward share: the inputs and shape (setInputs), the tiles, the
/// pieces and their tile offsets (which `offs` must outlive the call).
template <class In3>
host::Args hostArgs(const In3& q, const In3& k, const In3& v, const VarlenBatch& b, const HostOffsets& offs,
                    const KernelConfig& cfg, Shape s) {
  host::Args a;
  setInputs(a, q, k, v, s);
  a.scale2 = s.scaleLog2();
  a.tile_q = cfg.tile_q;
  a.tile_k = cfg.tile_k;
  a.pieces = b.pieces.data();
  a.num_pieces = static_cast<std::int64_t>(b.pieces.size());
  a.kb_off = offs.kb_off.data();
  a.nkblk = offs.nkblk;
  a.qb_off = offs.qb_off.data();
  a.nqblk = offs.nqblk;
  return a;
}

template <class ExecSpace>
void packKeys(const ExecSpace& space, const host::Args& a, const VarlenBatch& b) {
  std::vector<std::int64_t> items;  // piece, key tile
  for (std::size_t p = 0; p < b.pieces.size(); ++p)
    if (b.pieces[p].nq() > 0)
      for (std::int64_t t = 0; t * a.tile_k < b.pieces[p].nk(); ++t) {
        items.push_back(static_cast<std::int64_t>(p));
        items.push_back(t);
      }
  const std::int64_t n = static_cast<std::int64_t>(items.size() / 2);
  const int Hkv = a.kv_heads;
  const std::int64_t* it = items.data();
  Kokkos::parallel_for("wlb::attention::pack_k", RangeI64<ExecSpace>(space, 0, n * Hkv), [=](const std::int64_t i) {
    const std::int64_t j = i / Hkv;
    host::packKeyTile(a, it[2 * j], it[2 * j + 1], static_cast<int>(i % Hkv));
  });
  space.fence();
}

template <class ExecSpace>
std::vector<std::int64_t> queryItems(const VarlenBatch& b, int TQ) {
  std::vector<std::int64_t> items;
  for (std::size_t p = 0; p < b.pieces.size(); ++p)
    for (std::int64_t t = 0; t * TQ < b.pieces[p].nq(); ++t) {
      items.push_back(static_cast<std::int64_t>(p));
      items.push_back(t);
    }
  return items;
}

/// Query tiles per forward work item: 4 (the group shares each K^T / V block read),
/// reduced while that would leave fewer than 4 work items per thread.
template <class ExecSpace>
int hostQueryGroup(const ExecSpace& space, const VarlenBatch& b, int TQ, int heads) {
  std::int64_t tiles = 0;
  for (const auto& p : b.pieces) tiles += (p.nq() + TQ - 1) / TQ;
  const std::int64_t want = 4 * static_cast<std::int64_t>(space.concurrency());
  int g = 4;
  while (g > 1 && tiles * heads / g < want) g /= 2;
  return g;
}

template <class ExecSpace>
void forwardHost(const ExecSpace& space, typename Views<ExecSpace>::In3 q, typename Views<ExecSpace>::In3 k,
                 typename Views<ExecSpace>::In3 v, const VarlenBatch& b, typename Views<ExecSpace>::Out3 o,
                 typename Views<ExecSpace>::Out2 lse, const KernelConfig& cfg, Shape s) {
  const HostOffsets offs(b, cfg);
  // host workspaces: cached per calling thread, uninitialised (the packers write every
  // element, padding included)
  float* KT = host::workspace(0, static_cast<std::size_t>(offs.nkblk * s.kv_heads * s.head_dim * cfg.tile_k));
  host::Args a = hostArgs(q, k, v, b, offs, cfg, s);
  a.o_out = o.data();
  a.lse_out = lse.data();
  a.o_s0 = o.stride(0);
  a.lse_s0 = lse.stride(0);
  a.KT = KT;
  packKeys(space, a, b);
  // work items of q_group query tiles (fewer, shorter groups when a thread would idle)
  a.q_group = hostQueryGroup<ExecSpace>(space, b, cfg.tile_q, s.heads);
  const auto items = queryItems<ExecSpace>(b, cfg.tile_q * a.q_group);
  const std::int64_t n = static_cast<std::int64_t>(items.size() / 2);
  const std::int64_t* it = items.data();
  // head-major order: consecutive items share the kv head's packed keys
  Kokkos::parallel_for("wlb::attention::fwd", RangeI64<ExecSpace>(space, 0, n * s.heads), [=](const std::int64_t i) {
    const std::int64_t j = i % n;
    host::forwardTile(a, it[2 * j], it[2 * j + 1], static_cast<int>(i / n));
  });
  wlb::kk::fence(space, "wlb::attention::fwd");
}

template <class ExecSpace>
void backwardHost(const ExecSpace& space, typename Views<ExecSpace>::In3 q, typename Views<ExecSpace>::In3 k,
                  typename Views<ExecSpace>::In3 v, typename Views<ExecSpace>::In3 o,
                  typename Views<ExecSpace>::In2 lse, typename Views<ExecSpace>::In3 dO, const VarlenBatch& b,
                  typename Views<ExecSpace>::Out3 dq, typename Views<ExecSpace>::Out3 dk,
                  typename Views<ExecSpace>::Out3 dv, const KernelConfig& cfg, Shape s) {
  const HostOffsets offs(b, cfg);
  const std::size_t D = static_cast<std::size_t>(s.head_dim);
  const std::size_t nq_el = static_cast<std::size_t>(offs.nqblk) * s.heads * cfg.tile_q;
  // cached, uninitialised host workspaces (packers write every element; each dQT block is
  // written by its first key tile, tile 0, which every query sees)
  float* KT = host::workspace(0, static_cast<std::size_t>(offs.nkblk * s.kv_heads) * D * cfg.tile_k);
  float* QT = host::workspace(1, nq_el * D);
  float* dOT = host::workspace(2, nq_el * D);
  float* dQT = host::workspace(3, nq_el * D);
  float* LSE2 = host::workspace(4, nq_el);
  float* DLT = host::workspace(5, nq_el);
  host::Args a = hostArgs(q, k, v, b, offs, cfg, s);
  a.o = o.data();
  a.lse = lse.data();
  a.dO = dO.data();
  a.dq = dq.data();
  a.dk = dk.data();
  a.dv = dv.data();
  a.o_s0 = o.stride(0);
  a.lse_s0 = lse.stride(0);
  a.dO_s0 = dO.stride(0);
  a.dq_s0 = dq.stride(0);
  a.dk_s0 = dk.stride(0);
  a.dv_s0 = dv.stride(0);
  a.KT = KT;
  a.QT = QT;
  a.dOT = dOT;
  a.dQT = dQT;
  a.LSE2 = LSE2;
  a.DLT = DLT;
  packKeys(space, a, b);
  const auto items = queryItems<ExecSpace>(b, cfg.tile_q);
  const std::int64_t n = static_cast<std::int64_t>(items.size() / 2);
  const std::int64_t* it = items.data();
  const int H = s.heads;
  // tile-major: consecutive items read (and unpack_dq writes) the other heads' parts of the
  // same token rows, which are then in cache, instead of a quarter of each row per pass
  Kokkos::parallel_for("wlb::attention::bwd::pack_q", RangeI64<ExecSpace>(space, 0, n * H), [=](const std::int64_t i) {
    const std::int64_t j = i / H;
    host::packQueryTile(a, it[2 * j], it[2 * j + 1], static_cast<int>(i % H));
  });
  space.fence();
  // one work item per kv head: pieces run in order, so shared keys accumulate race-free
  Kokkos::parallel_for("wlb::attention::bwd", RangeI64<ExecSpace>(space, 0, s.kv_heads),
                       [=](const std::int64_t i) { host::backwardKvHead(a, static_cast<int>(i)); });
  space.fence();
  Kokkos::parallel_for("wlb::attention::bwd::unpack_dq", RangeI64<ExecSpace>(space, 0, n * H),
                       [=](const std::int64_t i) {
                         const std::int64_t j = i / H;
                         host::unpackDq(a, it[2 * j], it[2 * j + 1], static_cast<int>(i % H));
                       });
  wlb::kk::fence(space, "wlb::attention::bwd");
}
#endif  // WLB_ATTN_HOST_SIMD

// ---------------- CUDA paths (tensor-core and FP32 SIMT kernels) ----------------------
#if defined(KOKKOS_ENABLE_CUDA)
/// Rows [heads][D] contiguous, 16-byte aligned: what the cp.async staging needs.
template <class V>
bool cudaRowsOk(const V& x, int D) {
  using T = typename V::non_const_value_type;
  return innerContiguous(x, D) && reinterpret_cast<std::uintptr_t>(x.data()) % 16 == 0 &&
         (static_cast<std::size_t>(x.stride(0)) * sizeof(T)) % 16 == 0;
}

inline bool cudaFastPath(const KernelConfig& cfg, int D, bool bf16_storage) {
  if (cfg.path == KernelConfig::Path::Portable) return false;
  if (bf16_storage || cfg.precision != KernelConfig::Precision::Fp32) return cuda::mmaSupports(D);
  return cuda::simtSupports(D);
}

inline const char* cudaKernelName(int D, const KernelConfig& cfg, bool bf16_storage) {
  if (!cudaFastPath(cfg, D, bf16_storage)) return "portable";
  const bool wg = cuda::useHopper(D, cfg.path != KernelConfig::Path::Sm80);
  if (bf16_storage || cfg.precision == KernelConfig::Precision::Bf16)
    return !wg                     ? "cuda-mma-bf16"
           : !cfg.warp_specialized ? "cuda-wgmma-bf16"
           : cfg.ws_backward       ? "cuda-wgmma-ws-bf16"
                                   : "cuda-wgmma-wsfwd-bf16";  // warp-specialised forward only
  if (cfg.precision == KernelConfig::Precision::Tf32) return wg ? "cuda-wgmma-tf32" : "cuda-mma-tf32";
  return "cuda-simt-fp32";
}

using CudaBf16View = Kokkos::View<bf16***, Kokkos::LayoutRight, Kokkos::CudaSpace>;

/// FP32 -> BF16 copy (for Precision::Bf16 on FP32 storage).
template <class V>
CudaBf16View toBf16View(const Kokkos::Cuda& space, const V& x, const char* label) {
  CudaBf16View y(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), x.extent(0), x.extent(1),
                 x.extent(2));
  const std::int64_t n1 = x.extent(1), n2 = x.extent(2);
  Kokkos::parallel_for(
      "wlb::attention::cuda::to_bf16",
      Kokkos::RangePolicy<Kokkos::Cuda, Kokkos::IndexType<std::int64_t>>(space, 0, static_cast<std::int64_t>(y.size())),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const std::int64_t t = i / (n1 * n2), r = i % (n1 * n2);
        y(t, r / n2, r % n2) = toBf16(x(t, r / n2, r % n2));
      });
  return y;
}

template <class QV, class OV>
cuda::Args cudaArgs(const QV& q, const QV& k, const QV& v, const OV& o, Shape s) {
  cuda::Args a;
  setInputs(a, q, k, v, s);
  a.scale_log2 = s.scaleLog2();
  a.o_s0 = o.stride(0);
  return a;
}

/// Runs the CUDA kernels; false when they do not apply (the caller runs the portable path).
template <class QV, class OV, class LV>
bool forwardCuda(const Kokkos::Cuda& space, QV q, QV k, QV v, const VarlenBatch& b, OV o, LV lse,
                 const KernelConfig& cfg, Shape s) {
  using T = typename QV::non_const_value_type;
  constexpr bool bfs = std::is_same<T, bf16>::value;
  const int D = s.head_dim;
  if (!cudaFastPath(cfg, D, bfs) || !cudaRowsOk(q, D) || !cudaRowsOk(k, D) || !cudaRowsOk(v, D) || !cudaRowsOk(o, D) ||
      lse.stride(1) != 1)
    return false;
  const auto lease = cuda::DeviceScratch::lease();
  // BF16 copies of FP32 storage: declared before `done`, so they are freed only after the
  // fence that the kernels reading them end with
  CudaBf16View qb, kb, vb, ob;
  Kokkos::View<std::uint8_t*, Kokkos::CudaSpace> owned;
  const cuda::FenceOnExit done{space, "wlb::attention::cuda::fwd_done"};  // before the lease ends
  const auto rng = cuda::ranges(space, b);
  cuda::Args a = cudaArgs(q, k, v, o, s);
  a.ranges = rng.data();
  a.o_out = o.data();
  a.lse_out = lse.data();
  a.lse_s0 = lse.stride(0);
  if constexpr (bfs) {
    return cuda::mmaForward<bf16>(space, a, b, cfg);
  } else {
    if (cfg.precision == KernelConfig::Precision::Tf32) return cuda::mmaForward<float>(space, a, b, cfg);
    if (cfg.precision == KernelConfig::Precision::Fp32) return cuda::simtForward(space, a, b);
    // BF16 arithmetic on FP32 storage: round the inputs once, run the BF16 kernels
    qb = toBf16View(space, q, "wlb::attention::q_bf16");
    kb = toBf16View(space, k, "wlb::attention::k_bf16");
    vb = toBf16View(space, v, "wlb::attention::v_bf16");
    ob = CudaBf16View(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("wlb::attention::o_bf16")),
                      o.extent(0), o.extent(1), o.extent(2));
    cuda::Args ab = cudaArgs(qb, kb, vb, ob, s);
    ab.ranges = rng.data();
    ab.o_out = ob.data();
    ab.lse_out = lse.data();
    ab.lse_s0 = lse.stride(0);
    cuda::mmaForward<bf16>(space, ab, b, cfg);
    // copy back only the rows the pieces own (forward overwrites those rows alone): mark
    // them, then one flat kernel over every element (a team per piece would leave a long
    // document's copy to one block)
    const std::int64_t per = static_cast<std::int64_t>(o.extent(1) * o.extent(2));
    const std::int64_t n2 = o.extent(2);
    owned = Kokkos::View<std::uint8_t*, Kokkos::CudaSpace>("wlb::attention::cuda::owned_rows", o.extent(0));
    Kokkos::parallel_for(
        "wlb::attention::cuda::mark_rows",
        Kokkos::TeamPolicy<Kokkos::Cuda>(space, static_cast<int>(rng.extent(0)), Kokkos::AUTO),
        KOKKOS_LAMBDA(const Kokkos::TeamPolicy<Kokkos::Cuda>::member_type& team) {
          const int p = team.league_rank();
          const std::int64_t q0 = rng(p, 0), q1 = rng(p, 1);
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, q0, q1), [&](const std::int64_t t) { owned(t) = 1; });
        });
    Kokkos::parallel_for(
        "wlb::attention::cuda::o_from_bf16",
        Kokkos::RangePolicy<Kokkos::Cuda, Kokkos::IndexType<std::int64_t>>(
            space, 0, static_cast<std::int64_t>(o.extent(0)) * per),
        KOKKOS_LAMBDA(const std::int64_t i) {
          const std::int64_t t = i / per, r = i % per;
          if (owned(t)) o(t, r / n2, r % n2) = toFloat(ob(t, r / n2, r % n2));
        });
    return true;
  }
}

template <class QV, class LV, class GV>
bool backwardCuda(const Kokkos::Cuda& space, QV q, QV k, QV v, QV o, LV lse, QV dO, const VarlenBatch& b, GV dq, GV dk,
                  GV dv, const KernelConfig& cfg, Shape s) {
  using T = typename QV::non_const_value_type;
  constexpr bool bfs = std::is_same<T, bf16>::value;
  const int D = s.head_dim;
  if (!cudaFastPath(cfg, D, bfs) || !cudaRowsOk(q, D) || !cudaRowsOk(k, D) || !cudaRowsOk(v, D) || !cudaRowsOk(o, D) ||
      !cudaRowsOk(dO, D) || !innerContiguous(dq, D) || !innerContiguous(dk, D) || !innerContiguous(dv, D) ||
      lse.stride(1) != 1)
    return false;
  const auto lease = cuda::DeviceScratch::lease();
  CudaBf16View qb, kb, vb, dOb;                                           // as in forwardCuda: freed after the fence
  const cuda::FenceOnExit done{space, "wlb::attention::cuda::bwd_done"};  // before the lease ends
  const auto rng = cuda::ranges(space, b);
  cuda::Args a = cudaArgs(q, k, v, o, s);
  a.ranges = rng.data();
  a.o = o.data();
  a.dO = dO.data();
  a.dO_s0 = dO.stride(0);
  a.lse = lse.data();
  a.lse_s0 = lse.stride(0);
  a.dq = dq.data();
  a.dk = dk.data();
  a.dv = dv.data();
  a.dq_s0 = dq.stride(0);
  a.dk_s0 = dk.stride(0);
  a.dv_s0 = dv.stride(0);
  float* delta =
      cuda::DeviceScratch::get<float>(cuda::DeviceScratch::kDelta, static_cast<std::size_t>(b.q_tokens) * s.heads);
  cuda::computeDelta<T>(space, a, b.q_tokens, delta);
  a.delta = delta;
  bool ok = false;
  if constexpr (bfs) {
    ok = cuda::mmaBackward(space, a, b, cfg);
  } else {
    if (cfg.precision != KernelConfig::Precision::Bf16) {
      ok = cuda::simtBackward(space, a, b);
    } else {
      qb = toBf16View(space, q, "wlb::attention::q_bf16");
      kb = toBf16View(space, k, "wlb::attention::k_bf16");
      vb = toBf16View(space, v, "wlb::attention::v_bf16");
      dOb = toBf16View(space, dO, "wlb::attention::dO_bf16");
      cuda::Args ab = a;
      ab.q = qb.data();
      ab.k = kb.data();
      ab.v = vb.data();
      ab.dO = dOb.data();
      ab.q_s0 = qb.stride(0);
      ab.k_s0 = kb.stride(0);
      ab.v_s0 = vb.stride(0);
      ab.dO_s0 = dOb.stride(0);
      ok = cuda::mmaBackward(space, ab, b, cfg);
    }
  }
  return ok;
}
#endif  // KOKKOS_ENABLE_CUDA
}  // namespace detail

template <class ExecSpace>
bool usesHostKernels(int head_dim, const KernelConfig& cfg) {
#if WLB_ATTN_HOST_SIMD
  if constexpr (detail::hostAccessible<ExecSpace>())
    return cfg.path != KernelConfig::Path::Portable && head_dim % 16 == 0;
#endif
  (void)head_dim;
  (void)cfg;
  return false;
}

namespace detail {
#if WLB_ATTN_HOST_SIMD
/// BF16 storage on a host space: the operands widened to FP32 (exact), for the host SIMD
/// kernels; the BF16 results are rounded back once.
template <class ExecSpace, class V>
typename Views<ExecSpace>::Out3 widenedHost(const V& x) {
  typename Views<ExecSpace>::Out3 y(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::attention::host_widened"),
                                    x.extent(0), x.extent(1), x.extent(2));
  for (std::size_t t = 0; t < x.extent(0); ++t)
    for (std::size_t h = 0; h < x.extent(1); ++h)
      for (std::size_t d = 0; d < x.extent(2); ++d) y(t, h, d) = toFloat(x(t, h, d));
  return y;
}
template <class V, class W>
void narrowHost(const V& from, const W& to) {
  for (std::size_t t = 0; t < to.extent(0); ++t)
    for (std::size_t h = 0; h < to.extent(1); ++h)
      for (std::size_t d = 0; d < to.extent(2); ++d) to(t, h, d) = toBf16(from(t, h, d));
}
#endif

/// forward/backward for either storage type (QV: float or bf16 views): shape checks, then
/// the fastest path that applies (host SIMD on host spaces — BF16 storage widened to FP32
/// around it —, CUDA kernels on a Cuda instance), else the portable path.
template <class ExecSpace, class QV, class OV>
void forwardAny(const ExecSpace& space, QV q, QV k, QV v, const VarlenBatch& batch, OV o,
                typename Views<ExecSpace>::Out2 lse, const KernelConfig& cfg, float softmax_scale) {
  const Shape s = checkCommon(q, k, v, batch, cfg, softmax_scale);
  requireShape(o, batch.q_tokens, s.heads, s.head_dim, "o");
  requireShape(lse, batch.q_tokens, s.heads, 1, "lse");
  if (batch.pieces.empty()) return;
  constexpr bool fp32 = std::is_same<typename QV::non_const_value_type, float>::value;
#if WLB_ATTN_HOST_SIMD
  if constexpr (fp32 && hostAccessible<ExecSpace>()) {
    if (usesHostKernels<ExecSpace>(s.head_dim, cfg) && innerContiguous(q, s.head_dim) &&
        innerContiguous(k, s.head_dim) && innerContiguous(v, s.head_dim) && innerContiguous(o, s.head_dim) &&
        innerContiguous(lse, s.head_dim)) {
      forwardHost(space, q, k, v, batch, o, lse, cfg, s);
      return;
    }
  }
  if constexpr (!fp32 && hostAccessible<ExecSpace>()) {
    if (usesHostKernels<ExecSpace>(s.head_dim, cfg) && innerContiguous(lse, s.head_dim)) {
      wlb::kk::fence(space, "wlb::attention::fwd::widen");
      const auto of = widenedHost<ExecSpace>(o);  // rows outside the pieces stay as they were
      forwardHost(space, widenedHost<ExecSpace>(q), widenedHost<ExecSpace>(k), widenedHost<ExecSpace>(v), batch, of,
                  lse, cfg, s);
      narrowHost(of, o);
      return;
    }
  }
#endif
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) {
    if (forwardCuda(space, q, k, v, batch, o, lse, cfg, s)) return;
  }
#endif
  (void)fp32;
  forwardPortable<ExecSpace>(space, q, k, v, batch, o, lse, cfg, s);
  wlb::kk::fence(space, "wlb::attention::fwd");
}

template <class ExecSpace, class QV>
void backwardAny(const ExecSpace& space, QV q, QV k, QV v, QV o, typename Views<ExecSpace>::In2 lse, QV dO,
                 const VarlenBatch& batch, typename Views<ExecSpace>::Out3 dq, typename Views<ExecSpace>::Out3 dk,
                 typename Views<ExecSpace>::Out3 dv, const KernelConfig& cfg, float softmax_scale) {
  const Shape s = checkCommon(q, k, v, batch, cfg, softmax_scale);
  requireShape(o, batch.q_tokens, s.heads, s.head_dim, "o");
  requireShape(dO, batch.q_tokens, s.heads, s.head_dim, "dO");
  requireShape(dq, batch.q_tokens, s.heads, s.head_dim, "dq");
  requireShape(dk, batch.k_tokens, s.kv_heads, s.head_dim, "dk");
  requireShape(dv, batch.k_tokens, s.kv_heads, s.head_dim, "dv");
  requireShape(lse, batch.q_tokens, s.heads, 1, "lse");
  if (batch.pieces.empty()) return;
  constexpr bool fp32 = std::is_same<typename QV::non_const_value_type, float>::value;
#if WLB_ATTN_HOST_SIMD
  if constexpr (fp32 && hostAccessible<ExecSpace>()) {
    const int D = s.head_dim;
    if (usesHostKernels<ExecSpace>(D, cfg) && innerContiguous(q, D) && innerContiguous(k, D) && innerContiguous(v, D) &&
        innerContiguous(o, D) && innerContiguous(dO, D) && innerContiguous(dq, D) && innerContiguous(dk, D) &&
        innerContiguous(dv, D) && innerContiguous(lse, D)) {
      backwardHost(space, q, k, v, o, lse, dO, batch, dq, dk, dv, cfg, s);
      return;
    }
  }
  if constexpr (!fp32 && hostAccessible<ExecSpace>()) {
    const int D = s.head_dim;
    if (usesHostKernels<ExecSpace>(D, cfg) && innerContiguous(dq, D) && innerContiguous(dk, D) &&
        innerContiguous(dv, D) && innerContiguous(lse, D)) {
      wlb::kk::fence(space, "wlb::attention::bwd::widen");
      backwardHost(space, widenedHost<ExecSpace>(q), widenedHost<ExecSpace>(k), widenedHost<ExecSpace>(v),
                   widenedHost<ExecSpace>(o), lse, widenedHost<ExecSpace>(dO), batch, dq, dk, dv, cfg, s);
      return;
    }
  }
#endif
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) {
    if (backwardCuda(space, q, k, v, o, lse, dO, batch, dq, dk, dv, cfg, s)) return;
  }
#endif
  (void)fp32;
  backwardPortable<ExecSpace>(space, q, k, v, o, lse, dO, batch, dq, dk, dv, cfg, s);
  wlb::kk::fence(space, "wlb::attention::bwd");
}
}  // namespace detail

template <class ExecSpace>
void forward(const ExecSpace& space, typename Views<ExecSpace>::In3 q, typename Views<ExecSpace>::In3 k,
             typename Views<ExecSpace>::In3 v, const VarlenBatch& batch, typename Views<ExecSpace>::Out3 o,
             typename Views<ExecSpace>::Out2 lse, const KernelConfig& cfg, float softmax_scale) {
  detail::forwardAny<ExecSpace>(space, q, k, v, batch, o, lse, cfg, softmax_scale);
}

template <class ExecSpace>
void backward(const ExecSpace& space, typename Views<ExecSpace>::In3 q, typename Views<ExecSpace>::In3 k,
              typename Views<ExecSpace>::In3 v, typename Views<ExecSpace>::In3 o, typename Views<ExecSpace>::In2 lse,
              typename Views<ExecSpace>::In3 dO, const VarlenBatch& batch, typename Views<ExecSpace>::Out3 dq,
              typename Views<ExecSpace>::Out3 dk, typename Views<ExecSpace>::Out3 dv, const KernelConfig& cfg,
              float softmax_scale) {
  detail::backwardAny<ExecSpace>(space, q, k, v, o, lse, dO, batch, dq, dk, dv, cfg, softmax_scale);
}

template <class ExecSpace>
void forward(const ExecSpace& space, typename Views<ExecSpace>::In3b q, typename Views<ExecSpace>::In3b k,
             typename Views<ExecSpace>::In3b v, const VarlenBatch& batch, typename Views<ExecSpace>::Out3b o,
             typename Views<ExecSpace>::Out2 lse, const KernelConfig& cfg, float softmax_scale) {
  detail::forwardAny<ExecSpace>(space, q, k, v, batch, o, lse, cfg, softmax_scale);
}

template <class ExecSpace>
void backward(const ExecSpace& space, typename Views<ExecSpace>::In3b q, typename Views<ExecSpace>::In3b k,
              typename Views<ExecSpace>::In3b v, typename Views<ExecSpace>::In3b o, typename Views<ExecSpace>::In2 lse,
              typename Views<ExecSpace>::In3b dO, const VarlenBatch& batch, typename Views<ExecSpace>::Out3 dq,
              typename Views<ExecSpace>::Out3 dk, typename Views<ExecSpace>::Out3 dv, const KernelConfig& cfg,
              float softmax_scale) {
  detail::backwardAny<ExecSpace>(space, q, k, v, o, lse, dO, batch, dq, dk, dv, cfg, softmax_scale);
}

template <class ExecSpace>
const char* kernelName(int head_dim, const KernelConfig& cfg, bool bf16_storage) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value)
    return detail::cudaKernelName(head_dim, cfg, bf16_storage);
#endif
  if (usesHostKernels<ExecSpace>(head_dim, cfg)) return "host-simd";  // BF16 storage widened around it
  return "portable";
}

}  // namespace wlb::attention
