// `wlb kernel --in case.h5 --out result.h5`: run the attention kernels on a golden case so
// they can be cross-checked against any framework (format: docs/attention.md).
//
// Input datasets: q [Tq][H][D], k and v [Tk][Hkv][D] (float), cu_seqlens_q and
// cu_seqlens_k [P+1] (integers, start at 0, non-decreasing, end at Tq / Tk, every piece
// nq <= nk), optional dO [Tq][H][D]; optional attribute softmax_scale on the root.
// Output: o, lse and, given dO, dq, dk, dv (same layouts), plus attributes describing the
// run. Bad shapes or offsets -> InputError naming the dataset (exit 2, nothing written).
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "attention/attention.hpp"
#include "attention/reference.hpp"
#include "core/deck.hpp"
#include "core/error.hpp"
#include "core/h5.hpp"
#include "core/kokkos_compat.hpp"
#include "core/output_file.hpp"

namespace {

namespace att = wlb::attention;
using ES = Kokkos::DefaultExecutionSpace;
using V3 = Kokkos::View<float***, Kokkos::LayoutRight, ES::memory_space>;
using V2 = Kokkos::View<float**, Kokkos::LayoutRight, ES::memory_space>;
using V3b = Kokkos::View<att::bf16***, Kokkos::LayoutRight, ES::memory_space>;

struct Opts {
  std::string in, out;
  int tile_q = 64, tile_k = 64;
  bool reference = false, portable = false;
  std::string precision = "fp32";
  std::string attention = "auto";  ///< Hopper kernel variant (attention::setHopperVariant)
};

struct Case {
  std::vector<float> q, k, v, dO;
  std::vector<hsize_t> qd, kd;
  std::vector<att::PieceRange> pieces;
  bool has_dO = false;
  float scale = 0.0f;
};

Case readCase(const std::string& path) {
  auto f = wlb::h5::File::open(path);
  const std::string where = path + ":/";
  Case c;
  std::vector<hsize_t> vd, dd;
  // an unknown name is a misspelt dataset (e.g. "do" for "dO"): refuse it rather than
  // silently skip what the user asked for
  {
    const std::vector<std::string> known{"q", "k", "v", "dO", "cu_seqlens_q", "cu_seqlens_k"};
    for (const auto& name : f.children())
      if (std::find(known.begin(), known.end(), name) == known.end()) {
        throw wlb::InputError("wlb kernel: " + where + name + ": unknown dataset (did you mean '" +
                              wlb::nearest(name, known) +
                              "'? expected q, k, v, cu_seqlens_q, cu_seqlens_k and optionally dO)");
      }
  }
  c.q = f.readDataset<float>("q", &c.qd, 3);
  c.k = f.readDataset<float>("k", &c.kd, 3);
  c.v = f.readDataset<float>("v", &vd, 3);
  auto bad = [&](const std::string& ds, const std::string& why) {
    throw wlb::InputError("wlb kernel: " + where + ds + ": " + why);
  };
  if (c.qd[1] == 0 || c.qd[2] == 0) bad("q", "heads and head_dim must be positive");
  if (c.kd[1] == 0) bad("k", "kv_heads must be positive");
  if (c.kd[2] != c.qd[2])
    bad("k", "head_dim " + std::to_string(c.kd[2]) + " differs from q's " + std::to_string(c.qd[2]));
  if (c.qd[1] % c.kd[1] != 0)
    bad("k", "kv_heads " + std::to_string(c.kd[1]) + " does not divide q's heads " + std::to_string(c.qd[1]));
  if (c.qd[2] > 256) bad("q", "head_dim > 256 is not supported");
  // the kernels index heads with int
  constexpr hsize_t kMaxHeads = 1 << 16;
  if (c.qd[1] > kMaxHeads) bad("q", "more than " + std::to_string(kMaxHeads) + " heads");
  if (vd != c.kd) bad("v", "shape differs from k's");
  if (f.exists("dO")) {
    c.dO = f.readDataset<float>("dO", &dd, 3);
    if (dd != c.qd) bad("dO", "shape differs from q's");
    c.has_dO = true;
  }
  // A NaN, an infinity or a value past float's range (converted from float64 to inf)
  // would come out as NaN outputs with exit 0: refuse it, naming the tensor and element.
  for (const auto& [name, x] :
       {std::pair{"q", &c.q}, std::pair{"k", &c.k}, std::pair{"v", &c.v}, std::pair{"dO", &c.dO}})
    for (std::size_t i = 0; i < x->size(); ++i)
      if (!std::isfinite((*x)[i]))
        bad(name, "element " + std::to_string(i) + " is " + std::to_string((*x)[i]) +
                      " (NaN, infinite, or past float's range)");
  std::vector<hsize_t> cqd, ckd;
  const auto cq = f.readDataset<std::int64_t>("cu_seqlens_q", &cqd, 1);
  const auto ck = f.readDataset<std::int64_t>("cu_seqlens_k", &ckd, 1);
  if (cq.empty()) bad("cu_seqlens_q", "must have at least one entry");
  if (ck.size() != cq.size())
    bad("cu_seqlens_k", "has " + std::to_string(ck.size()) + " entries, cu_seqlens_q has " + std::to_string(cq.size()));
  auto checkCu = [&](const std::vector<std::int64_t>& cu, hsize_t tokens, const char* name) {
    if (cu.front() != 0) bad(name, "must start at 0");
    for (std::size_t i = 1; i < cu.size(); ++i)
      if (cu[i] < cu[i - 1]) bad(name, "decreases at entry " + std::to_string(i));
    if (static_cast<hsize_t>(cu.back()) != tokens)
      bad(name, "ends at " + std::to_string(cu.back()) + " but the tensor has " + std::to_string(tokens) + " tokens");
  };
  checkCu(cq, c.qd[0], "cu_seqlens_q");
  checkCu(ck, c.kd[0], "cu_seqlens_k");
  for (std::size_t i = 0; i + 1 < cq.size(); ++i) {
    att::PieceRange p{cq[i], cq[i + 1], ck[i], ck[i + 1]};
    if (p.nq() > p.nk())
      bad("cu_seqlens_k", "piece " + std::to_string(i) + " has " + std::to_string(p.nq()) + " queries but only " +
                              std::to_string(p.nk()) + " keys");
    c.pieces.push_back(p);
  }
  if (f.hasAttribute("softmax_scale")) {
    c.scale = f.attribute<float>("softmax_scale");
    if (!(c.scale > 0.0f) || !std::isfinite(c.scale)) bad("@softmax_scale", "must be a positive finite number");
  }
  return c;
}

V3 toView(const std::vector<float>& x, const std::vector<hsize_t>& d, const char* name) {
  V3 v(std::string("wlb::kernel::") + name, d[0], d[1], d[2]);
  auto h = Kokkos::create_mirror_view(v);
  std::copy(x.begin(), x.end(), h.data());
  Kokkos::deep_copy(v, h);
  return v;
}
template <class V>
std::vector<float> toVec(const V& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<float> out(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) out[i] = att::toFloat(h.data()[i]);
  return out;
}
V3b toBf16(const V3& x, const char* name) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  V3b y(std::string("wlb::kernel::") + name + "_bf16", x.extent(0), x.extent(1), x.extent(2));
  auto hy = Kokkos::create_mirror_view(y);
  for (std::size_t i = 0; i < h.size(); ++i) hy.data()[i] = att::toBf16(h.data()[i]);
  Kokkos::deep_copy(y, hy);
  return y;
}

int run(const Opts& o) {
  if (wlb::app::worldRank() != 0) return 0;  // single-process tool
  att::KernelConfig cfg;
  cfg.tile_q = o.tile_q;
  cfg.tile_k = o.tile_k;
  if (o.portable) cfg.path = att::KernelConfig::Path::Portable;
  if (!att::setHopperVariant(cfg, o.attention))
    throw wlb::InputError("wlb kernel: --attention: '" + o.attention + "' is not one of " + att::hopperVariantList());
  // fp32 / tf32: float storage; bf16: bf16 storage (inputs rounded once, O back to float)
  const bool bf16 = o.precision == "bf16";
  if (o.precision == "tf32")
    cfg.precision = att::KernelConfig::Precision::Tf32;
  else if (bf16)
    cfg.precision = att::KernelConfig::Precision::Bf16;
  else if (o.precision != "fp32")
    throw wlb::InputError("wlb kernel: --precision: '" + o.precision + "' is not one of fp32, tf32, bf16");
  try {
    att::validateConfig(cfg);
  } catch (const std::invalid_argument& e) {
    throw wlb::InputError(std::string("wlb kernel: --tile-q/--tile-k: ") + e.what());
  }
  wlb::checkOutputPath(o.out, "wlb kernel: --out", {o.in});
  const Case c = readCase(o.in);
  const int H = static_cast<int>(c.qd[1]), Hkv = static_cast<int>(c.kd[1]), D = static_cast<int>(c.qd[2]);
  std::vector<float> out_o(c.q.size()), out_lse(c.qd[0] * c.qd[1]), dq, dk, dv;
  if (o.reference) {
    att::reference::Dims dims{H, Hkv, D, c.scale};
    att::reference::forward(c.q, c.k, c.v, c.pieces, dims, out_o, out_lse);
    if (c.has_dO) {
      dq.assign(c.q.size(), 0.0f);
      dk.assign(c.k.size(), 0.0f);
      dv.assign(c.k.size(), 0.0f);
      att::reference::backward(c.q, c.k, c.v, c.dO, c.pieces, dims, dq, dk, dv);
    }
  } else {
    const auto batch = att::VarlenBatch::fromRanges(c.pieces);
    ES space;
    V3 q = toView(c.q, c.qd, "q"), k = toView(c.k, c.kd, "k"), v = toView(c.v, c.kd, "v");
    V3 ov("wlb::kernel::o", c.qd[0], c.qd[1], c.qd[2]);
    V2 lse("wlb::kernel::lse", c.qd[0], c.qd[1]);
    V3 dqv, dkv, dvv;
    if (c.has_dO) {
      dqv = V3("wlb::kernel::dq", c.qd[0], c.qd[1], c.qd[2]);
      dkv = V3("wlb::kernel::dk", c.kd[0], c.kd[1], c.kd[2]);
      dvv = V3("wlb::kernel::dv", c.kd[0], c.kd[1], c.kd[2]);
    }
    if (bf16) {
      const auto qb = toBf16(q, "q"), kb = toBf16(k, "k"), vb = toBf16(v, "v");
      V3b ob("wlb::kernel::o_bf16", c.qd[0], c.qd[1], c.qd[2]);
      att::forward(space, qb, kb, vb, batch, ob, lse, cfg, c.scale);
      out_o = toVec(ob);
      if (c.has_dO)
        att::backward(space, qb, kb, vb, ob, lse, toBf16(toView(c.dO, c.qd, "dO"), "dO"), batch, dqv, dkv, dvv, cfg,
                      c.scale);
    } else {
      att::forward(space, q, k, v, batch, ov, lse, cfg, c.scale);
      out_o = toVec(ov);
      if (c.has_dO)
        att::backward(space, q, k, v, ov, lse, toView(c.dO, c.qd, "dO"), batch, dqv, dkv, dvv, cfg, c.scale);
    }
    out_lse = toVec(lse);
    if (c.has_dO) {
      dq = toVec(dqv);
      dk = toVec(dkv);
      dv = toVec(dvv);
    }
  }
  // write to a temporary name, rename when complete
  const std::string tmp = o.out + ".tmp." + std::to_string(::getpid());
  const wlb::app::TemporaryGuard guard(tmp);  // removed if interrupted
  wlb::app::OutputFolders folders(o.out);     // and the folders made for it, while empty
  try {
    auto f = wlb::h5::File::create(tmp);
    f.writeDataset<float>("o", out_o.data(), c.qd);
    f.writeDataset<float>("lse", out_lse.data(), {c.qd[0], c.qd[1]});
    if (c.has_dO) {
      f.writeDataset<float>("dq", dq.data(), c.qd);
      f.writeDataset<float>("dk", dk.data(), c.kd);
      f.writeDataset<float>("dv", dv.data(), c.kd);
    }
    f.setAttribute("implementation", std::string(o.reference ? "reference" : att::kernelName<ES>(D, cfg, bf16)));
    f.setAttribute("precision", o.reference ? std::string("fp64") : o.precision);
    if (!o.reference) f.setAttribute("attention", std::string(att::hopperVariant(cfg)));
    f.setAttribute("backend", wlb::kk::backendName());
    f.setAttribute("tile_q", cfg.tile_q);
    f.setAttribute("tile_k", cfg.tile_k);
    f.setAttribute("softmax_scale", c.scale > 0.0f ? c.scale : 1.0f / std::sqrt(static_cast<float>(D)));
    f.setAttribute("source", o.in);
    f.close();
  } catch (const wlb::h5::Error& e) {
    std::remove(tmp.c_str());
    throw wlb::InputError("wlb kernel: --out '" + o.out + "': " + e.what());
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), o.out.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw wlb::InputError("wlb kernel: --out '" + o.out + "': cannot rename " + tmp + " into place");
  }
  folders.keep();
  std::printf("wlb kernel: %zu pieces, %llu query tokens, heads %d/%d, head_dim %d -> %s (%s)\n", c.pieces.size(),
              static_cast<unsigned long long>(c.qd[0]), H, Hkv, D, o.out.c_str(),
              c.has_dO ? "o, lse, dq, dk, dv" : "o, lse");
  return 0;
}

const bool registered = wlb::app::registerCommand(
    "kernel", "Run the attention kernels on a golden case (HDF5 in -> O, LSE[, dQ, dK, dV] out)", [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      sub.add_option("--in", o->in, "Input HDF5: q, k, v, cu_seqlens_q, cu_seqlens_k[, dO]")->required();
      sub.add_option("--out", o->out, "Output HDF5: o, lse[, dq, dk, dv]")->required();
      auto* tile_q = sub.add_option("--tile-q", o->tile_q, "Query tile (multiple of 16, 16..256)");
      auto* tile_k = sub.add_option("--tile-k", o->tile_k, "Key tile (multiple of 16, 16..256)");
      auto* precision =
          sub.add_option("--precision", o->precision,
                         "fp32 (default), tf32 (TF32 tensor cores on CUDA) or bf16 (BF16 storage and tensor cores)");
      auto* attention = sub.add_option("--attention", o->attention, att::hopperVariantHelp());
      // The reference has no tiles, precision or variant: naming one with it is refused, not ignored.
      auto* ref = sub.add_flag("--reference", o->reference, "Use the double-precision reference instead of the kernels")
                      ->excludes(tile_q)
                      ->excludes(tile_k)
                      ->excludes(precision)
                      ->excludes(attention);
      sub.add_flag("--portable", o->portable, "Force the portable (device) kernel path")->excludes(ref);
      return [o]() -> int { return run(*o); };
    });

}  // namespace
