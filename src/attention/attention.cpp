// Explicit instantiations of the attention kernels and the VarlenBatch helpers.
#include "attention/attention_impl.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace wlb::attention {

void validateConfig(const KernelConfig& cfg) {
  auto ok = [](int t) { return t >= 16 && t <= 256 && t % 16 == 0; };
  if (!ok(cfg.tile_q) || !ok(cfg.tile_k))
    throw std::invalid_argument("wlb::attention: tile_q/tile_k must be multiples of 16 in [16, 256] (got " +
                                std::to_string(cfg.tile_q) + ", " + std::to_string(cfg.tile_k) + ")");
  if (cfg.ws_bwd_rows != 0 && cfg.ws_bwd_rows != 64 && cfg.ws_bwd_rows != 128)
    throw std::invalid_argument("wlb::attention: ws_bwd_rows must be 0, 64 or 128 (got " +
                                std::to_string(cfg.ws_bwd_rows) + ")");
}

VarlenBatch VarlenBatch::fromRanges(std::vector<PieceRange> pieces) {
  VarlenBatch b;
  std::vector<std::pair<std::int64_t, std::int64_t>> qr;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const PieceRange& p = pieces[i];
    const std::string at = "wlb::attention: piece " + std::to_string(i) + ": ";
    if (p.q_begin < 0 || p.k_begin < 0 || p.q_end < p.q_begin || p.k_end < p.k_begin)
      throw std::invalid_argument(at + "negative or reversed range");
    if (p.nq() > p.nk())
      throw std::invalid_argument(at + "more queries (" + std::to_string(p.nq()) + ") than keys (" +
                                  std::to_string(p.nk()) + ")");
    if (p.q_end > (std::int64_t{1} << 31) || p.k_end > (std::int64_t{1} << 31))
      throw std::invalid_argument(at + "token index beyond 2^31");
    b.q_tokens = std::max(b.q_tokens, p.q_end);
    b.k_tokens = std::max(b.k_tokens, p.k_end);
    if (p.nq() > 0) qr.emplace_back(p.q_begin, p.q_end);
  }
  std::sort(qr.begin(), qr.end());
  for (std::size_t i = 1; i < qr.size(); ++i)
    if (qr[i].first < qr[i - 1].second)
      throw std::invalid_argument("wlb::attention: pieces have overlapping query ranges");
  b.pieces = std::move(pieces);
  b.ranges = decltype(b.ranges)("wlb::attention::batch::ranges", b.pieces.size());
  auto h = Kokkos::create_mirror_view(b.ranges);
  for (std::size_t i = 0; i < b.pieces.size(); ++i) {
    h(i, 0) = b.pieces[i].q_begin;
    h(i, 1) = b.pieces[i].q_end;
    h(i, 2) = b.pieces[i].k_begin;
    h(i, 3) = b.pieces[i].k_end;
  }
  Kokkos::deep_copy(b.ranges, h);
  return b;
}

VarlenBatch VarlenBatch::fromCuSeqlens(const std::vector<std::int64_t>& cu_q,
                                       const std::vector<std::int64_t>& cu_k) {
  if (cu_q.empty() || cu_q.size() != cu_k.size())
    throw std::invalid_argument("wlb::attention: cu_seqlens_q and cu_seqlens_k must be non-empty and of equal length");
  std::vector<PieceRange> pieces;
  for (std::size_t i = 0; i + 1 < cu_q.size(); ++i) {
    if (cu_q[i + 1] < cu_q[i] || cu_k[i + 1] < cu_k[i])
      throw std::invalid_argument("wlb::attention: cu_seqlens must be non-decreasing (entry " +
                                  std::to_string(i + 1) + ")");
    pieces.push_back(PieceRange{cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]});
  }
  return fromRanges(std::move(pieces));
}

VarlenBatch VarlenBatch::fromDocLengths(const std::vector<std::int64_t>& lengths) {
  std::vector<std::int64_t> cu{0};
  for (auto l : lengths) cu.push_back(cu.back() + l);
  return fromCuSeqlens(cu, cu);
}

double VarlenBatch::usefulPairs() const {
  double s = 0.0;
  for (const auto& p : pieces) s += wlb::attention::usefulPairs(p.nq(), p.nk());
  return s;
}

double VarlenBatch::paddedPairs(const KernelConfig& cfg) const {
  double s = 0.0;
  for (const auto& p : pieces) s += wlb::attention::paddedPairs(p.nq(), p.nk(), cfg);
  return s;
}

#define WLB_ATTN_INSTANTIATE(ES)                                                                  \
  template void forward<ES>(const ES&, Views<ES>::In3, Views<ES>::In3, Views<ES>::In3,            \
                            const VarlenBatch&, Views<ES>::Out3, Views<ES>::Out2,                 \
                            const KernelConfig&, float);                                          \
  template void backward<ES>(const ES&, Views<ES>::In3, Views<ES>::In3, Views<ES>::In3,           \
                             Views<ES>::In3, Views<ES>::In2, Views<ES>::In3, const VarlenBatch&,  \
                             Views<ES>::Out3, Views<ES>::Out3, Views<ES>::Out3,                   \
                             const KernelConfig&, float);                                         \
  template bool usesHostKernels<ES>(int, const KernelConfig&);                                   \
  template void forward<ES>(const ES&, Views<ES>::In3b, Views<ES>::In3b, Views<ES>::In3b,         \
                            const VarlenBatch&, Views<ES>::Out3b, Views<ES>::Out2,                \
                            const KernelConfig&, float);                                          \
  template void backward<ES>(const ES&, Views<ES>::In3b, Views<ES>::In3b, Views<ES>::In3b,        \
                             Views<ES>::In3b, Views<ES>::In2, Views<ES>::In3b, const VarlenBatch&, \
                             Views<ES>::Out3, Views<ES>::Out3, Views<ES>::Out3,                   \
                             const KernelConfig&, float);                                         \
  template const char* kernelName<ES>(int, const KernelConfig&, bool);

WLB_ATTN_INSTANTIATE(Kokkos::DefaultExecutionSpace)

}  // namespace wlb::attention
