// Reference attention: one query row at a time, doubles, explicit mask.
#include "attention/reference.hpp"

#include <algorithm>
#include <cmath>

namespace wlb::attention::reference {
namespace {
double scaleOf(const Dims& d) {
  return d.scale > 0.0f ? static_cast<double>(d.scale) : 1.0 / std::sqrt(static_cast<double>(d.head_dim));
}
}  // namespace

void forward(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
             const std::vector<PieceRange>& pieces, const Dims& dims, std::vector<float>& o,
             std::vector<float>& lse) {
  const int H = dims.heads, Hkv = dims.kv_heads, D = dims.head_dim, g = H / Hkv;
  const double sc = scaleOf(dims);
  std::vector<double> s, acc(D);
  for (const auto& p : pieces) {
    const std::int64_t nq = p.nq(), nk = p.nk();
    for (std::int64_t i = 0; i < nq; ++i) {
      const std::int64_t t = p.q_begin + i, nvis = nk - nq + i + 1;  // keys [0, nvis)
      for (int h = 0; h < H; ++h) {
        const int hk = h / g;
        s.assign(nvis, 0.0);
        double m = -INFINITY;
        for (std::int64_t j = 0; j < nvis; ++j) {
          double dot = 0.0;
          for (int d = 0; d < D; ++d)
            dot += static_cast<double>(q[(t * H + h) * D + d]) * k[((p.k_begin + j) * Hkv + hk) * D + d];
          s[j] = dot * sc;
          m = std::max(m, s[j]);
        }
        double l = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::int64_t j = 0; j < nvis; ++j) {
          const double e = std::exp(s[j] - m);
          l += e;
          for (int d = 0; d < D; ++d) acc[d] += e * v[((p.k_begin + j) * Hkv + hk) * D + d];
        }
        for (int d = 0; d < D; ++d) o[(t * H + h) * D + d] = static_cast<float>(acc[d] / l);
        lse[t * H + h] = static_cast<float>(m + std::log(l));
      }
    }
  }
}

void backward(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
              const std::vector<float>& dO, const std::vector<PieceRange>& pieces, const Dims& dims,
              std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv) {
  const int H = dims.heads, Hkv = dims.kv_heads, D = dims.head_dim, g = H / Hkv;
  const double sc = scaleOf(dims);
  std::vector<double> s, pr, dp, o(D), dqa(D);
  std::vector<double> dka(dk.size(), 0.0), dva(dv.size(), 0.0);  // double accumulation
  for (const auto& p : pieces) {
    const std::int64_t nq = p.nq(), nk = p.nk();
    for (std::int64_t i = 0; i < nq; ++i) {
      const std::int64_t t = p.q_begin + i, nvis = nk - nq + i + 1;
      for (int h = 0; h < H; ++h) {
        const int hk = h / g;
        auto K = [&](std::int64_t j, int d) { return static_cast<double>(k[((p.k_begin + j) * Hkv + hk) * D + d]); };
        auto V = [&](std::int64_t j, int d) { return static_cast<double>(v[((p.k_begin + j) * Hkv + hk) * D + d]); };
        const float* qr = &q[(t * H + h) * D];
        const float* gr = &dO[(t * H + h) * D];
        s.assign(nvis, 0.0);
        double m = -INFINITY;
        for (std::int64_t j = 0; j < nvis; ++j) {
          double dot = 0.0;
          for (int d = 0; d < D; ++d) dot += qr[d] * K(j, d);
          s[j] = dot * sc;
          m = std::max(m, s[j]);
        }
        double l = 0.0;
        pr.assign(nvis, 0.0);
        for (std::int64_t j = 0; j < nvis; ++j) l += (pr[j] = std::exp(s[j] - m));
        std::fill(o.begin(), o.end(), 0.0);
        for (std::int64_t j = 0; j < nvis; ++j) {
          pr[j] /= l;
          for (int d = 0; d < D; ++d) o[d] += pr[j] * V(j, d);
        }
        double delta = 0.0;
        for (int d = 0; d < D; ++d) delta += gr[d] * o[d];
        std::fill(dqa.begin(), dqa.end(), 0.0);
        for (std::int64_t j = 0; j < nvis; ++j) {
          double dpj = 0.0;
          for (int d = 0; d < D; ++d) dpj += gr[d] * V(j, d);
          const double ds = pr[j] * (dpj - delta) * sc;
          double* dkr = &dka[((p.k_begin + j) * Hkv + hk) * D];
          double* dvr = &dva[((p.k_begin + j) * Hkv + hk) * D];
          for (int d = 0; d < D; ++d) {
            dqa[d] += ds * K(j, d);
            dkr[d] += ds * qr[d];
            dvr[d] += pr[j] * gr[d];
          }
        }
        for (int d = 0; d < D; ++d) dq[(t * H + h) * D + d] += static_cast<float>(dqa[d]);
      }
    }
  }
  for (std::size_t i = 0; i < dk.size(); ++i) dk[i] += static_cast<float>(dka[i]);
  for (std::size_t i = 0; i < dv.size(); ++i) dv[i] += static_cast<float>(dva[i]);
}

}  // namespace wlb::attention::reference
