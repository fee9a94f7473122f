// wlb: WLB-LLM's variable-length packing with outlier-delay queues (Algorithm 1;
// docs/packing.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"
#include "packing/packer.hpp"
#include "packing/packer_internal.hpp"

namespace wlb::packing {
namespace detail {
namespace {

/// Tournament tree over n values: argmin (ties -> lowest index, as a linear scan would
/// pick) in O(1), set() in O(log n) without data-dependent branches.
template <class T>
class MinTree {
 public:
  void reset(std::size_t n, T init) {
    P_ = 1;
    while (P_ < n) P_ *= 2;
    // Padding leaves lose to every real value; they sit right of all real leaves, and the
    // left side wins ties, so they never win even against an equal value.
    v_.assign(2 * P_, std::numeric_limits<T>::has_infinity ? std::numeric_limits<T>::infinity()
                                                           : std::numeric_limits<T>::max());
    j_.resize(2 * P_);
    for (std::size_t j = 0; j < P_; ++j) {
      j_[P_ + j] = j;
      if (j < n) v_[P_ + j] = init;
    }
    for (std::size_t i = P_; i-- > 1;) {
      const bool right = v_[2 * i + 1] < v_[2 * i];
      v_[i] = right ? v_[2 * i + 1] : v_[2 * i];
      j_[i] = right ? j_[2 * i + 1] : j_[2 * i];
    }
  }
  std::size_t argmin() const { return j_[1]; }
  /// Leaf j = x: replay its path to the root, carrying the winner in registers and reading
  /// only siblings (which this update does not write).
  void set(std::size_t j, T x) {
    T cv = x;
    std::size_t cj = j;
    v_[P_ + j] = x;
    for (std::size_t i = P_ + j; i > 1; i /= 2) {
      const T sv = v_[i ^ 1];
      const std::size_t sj = j_[i ^ 1];
      // A left sibling (i odd) also wins ties. Bitwise, so it compiles without branches.
      const bool sib = (sv < cv) | (((i & 1) != 0) & (sv == cv));
      const std::size_t mask = 0 - static_cast<std::size_t>(sib);
      cj = (sj & mask) | (cj & ~mask);
      cv = std::min(cv, sv);  // equal on ties
      v_[i / 2] = cv;
      j_[i / 2] = cj;
    }
  }

 private:
  std::size_t P_ = 1;
  std::vector<T> v_;
  std::vector<std::size_t> j_;
};

// ---- wlb: variable-length packing + outlier-delay queues (Algorithm 1) -------------------
class WlbPacker final : public Packer {
 public:
  WlbPacker(PackerOptions o, const model::CostModel& c) : Packer(std::move(o), c), table_(c, opt_.s_max) {
    queues_.resize(opt_.outlier_thresholds.size());
    w_memo_.assign(static_cast<std::size_t>(std::min(kMemoLengths, opt_.s_max + 1)),
                   std::numeric_limits<double>::quiet_NaN());
  }
  std::string name() const override { return "wlb"; }

  /// Local-search rounds after the greedy placement (each moves or swaps one segment).
  static constexpr int kRefineIterations = 32;
  /// ... each trying the heaviest micro-batch against this many lightest ones ...
  static constexpr std::size_t kRefineLights = 8;
  /// ... and stops once max/mean work <= 1 + this.
  static constexpr double kRefineTolerance = 2e-3;
  /// The delay controller aims the running mean delay at this fraction of the budget.
  static constexpr double kDelayTarget = 0.97;

  /// W of segments shorter than this is memoised (most segments are short).
  static constexpr std::int64_t kMemoLengths = 8192;

  double work(std::int64_t len) const { return table_.work(len); }
  /// work(len), memoised for short lengths: the same value, computed once.
  double memoWork(std::int64_t len) {
    if (len < 0 || len >= static_cast<std::int64_t>(w_memo_.size())) return work(len);
    double& m = w_memo_[static_cast<std::size_t>(len)];
    if (std::isnan(m)) m = work(len);
    return m;
  }

  StepPlan pack(std::int64_t step, const std::vector<Document>& incoming) override {
    const auto Smax = opt_.s_max;
    const auto N = static_cast<std::size_t>(opt_.N());
    const auto& L = opt_.outlier_thresholds;
    auto& fresh = fresh_;
    fresh.clear();
    fresh.reserve(incoming.size());
    for (const auto& d : incoming) {
      for (std::int64_t off = 0; off < d.length; off += Smax) {
        const Segment s{d.id, off, std::min(Smax, d.length - off), d.arrival_step};
        const Item it{s, memoWork(s.length)};
        const auto lvl = static_cast<std::size_t>(std::upper_bound(L.begin(), L.end(), s.length) - L.begin());
        if (lvl == 0)
          fresh.push_back(it);
        else
          queues_[lvl - 1].push_back(it);
      }
    }
    // Priority: carried-over documents and queue entries released by age go first.
    auto& prio = prio_;
    prio.clear();
    prio.swap(carry_);
    const std::size_t n_carried = prio.size();  // prio = [carry-over..., forced...]
    std::int64_t planned = tokensOf(prio) + tokensOf(fresh);
    // Delay control: while the running mean per-token delay exceeds kDelayTarget x budget,
    // queues are force-released one step earlier (never later than max_queue_wait).
    std::int64_t wait = opt_.max_queue_wait;
    if (opt_.delay_budget > 0 && delay_tokens_ > 0 && delay_sum_ / delay_tokens_ > kDelayTarget * opt_.delay_budget)
      wait = std::max<std::int64_t>(1, wait - 1);
    for (auto& q : queues_) {
      if (wait > 0 && !q.empty() && step - q.front().s.arrival_step >= wait) {
        planned += tokensOf(q);
        prio.insert(prio.end(), q.begin(), q.end());
        q.clear();
      }
    }
    const std::int64_t capacity = static_cast<std::int64_t>(N) * Smax;
    bool popped = false;
    for (;;) {
      std::size_t pick = queues_.size();
      for (std::size_t i = queues_.size(); i-- > 0;) {
        const auto& q = queues_[i];
        if (q.size() < N) continue;
        if (pick == queues_.size() || q.front().s.arrival_step < queues_[pick].front().s.arrival_step) pick = i;
      }
      if (pick == queues_.size()) break;
      auto& q = queues_[pick];
      std::int64_t t = 0;
      for (std::size_t k = 0; k < N; ++k) t += q[k].s.length;
      if (popped && planned + t > capacity) break;
      if (popped && q.size() < 2 * N) break;
      planned += t;
      fresh.insert(fresh.end(), q.begin(), q.begin() + static_cast<std::ptrdiff_t>(N));
      q.erase(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(N));
      popped = true;
    }
    // Fill-up release ("pull"): the step's target is T = W of its heaviest released item.
    // Queued outliers with W <= T are pulled, heaviest first, while the step's total work
    // stays <= N*T and its tokens <= N*s_max, so the micro-batches that got no long
    // document this step get comparable work from shorter outliers (instead of waiting
    // for their own queue to fill, which also lowers their delay).
    {
      double wmax = 0, wsum = 0;
      for (const auto* v : {&prio, &fresh})
        for (const auto& it : *v) {
          wmax = std::max(wmax, it.w);
          wsum += it.w;
        }
      double budget = static_cast<double>(N) * wmax - wsum;
      if (budget > 0) {
        auto& cands = cands_;
        cands.clear();
        std::size_t base = 0;
        for (std::size_t qi = 0; qi < queues_.size(); ++qi) {
          for (std::size_t i = 0; i < queues_[qi].size(); ++i) {
            const double ws = queues_[qi][i].w;
            if (ws <= wmax) cands.push_back({qi, i, base, ws});
          }
          base += queues_[qi].size();
        }
        // Heaviest first, ties in queue order (cands are built in (q, i) order).
        std::sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) {
          if (a.w != b.w) return a.w > b.w;
          return a.q != b.q ? a.q < b.q : a.i < b.i;
        });
        // take_[c.base + c.i] marks a pulled entry (base = entries in earlier queues).
        take_.assign(base, 0);
        bool any = false;
        for (const auto& c : cands) {
          const auto len = queues_[c.q][c.i].s.length;
          if (c.w > budget || planned + len > capacity) continue;
          budget -= c.w;
          planned += len;
          take_[c.base + c.i] = 1;
          any = true;
        }
        if (any) {
          std::size_t off = 0;
          for (auto& q : queues_) {
            std::size_t keep = 0;
            for (std::size_t i = 0; i < q.size(); ++i) {
              if (take_[off + i])
                fresh.push_back(q[i]);
              else
                q[keep++] = q[i];
            }
            off += q.size();
            q.resize(keep);
          }
        }
      }
    }
    // Placement order: last step's carry-over first (so it is not carried twice), then
    // everything else — forced, popped, pulled and new items — in one longest-first (LPT)
    // order.
    fresh.insert(fresh.end(), prio.begin() + static_cast<std::ptrdiff_t>(n_carried), prio.end());
    prio.resize(n_carried);
    sortLongerFirst(prio);
    sortLongerFirst(fresh);
    bins_.resize(N);
    for (auto& b : bins_) b.clear();
    w_.assign(N, 0.0);
    len_.assign(N, 0);
    // The least-loaded micro-batch, and the one with the fewest tokens (ties -> lowest
    // index, as a linear scan would pick).
    by_w_.reset(N, 0.0);
    by_len_.reset(N, 0);
    auto place = [&](const Item& it) {
      const std::size_t bw = by_w_.argmin();
      std::size_t t = N;
      if (len_[bw] + it.s.length <= Smax) {
        t = bw;
      } else {
        const std::size_t bl = by_len_.argmin();
        if (len_[bl] + it.s.length <= Smax) t = bl;
      }
      if (t == N) {
        carry_.push_back(it);
        return;
      }
      bins_[t].push_back(it);
      len_[t] += it.s.length;
      w_[t] += it.w;
      by_w_.set(t, w_[t]);
      by_len_.set(t, len_[t]);
    };
    for (const auto& it : prio) place(it);
    for (const auto& it : fresh) place(it);
    refine(kRefineIterations, kRefineLights);
    std::vector<MicroBatch> mbs(N);
    double delay_sum = delay_sum_, delay_tokens = delay_tokens_;  // same sums, in registers
    for (std::size_t j = 0; j < N; ++j) {
      auto& segs = mbs[j].segments;
      segs.reserve(bins_[j].size());
      for (const auto& it : bins_[j]) {
        delay_sum += static_cast<double>(step - it.s.arrival_step) * static_cast<double>(it.s.length);
        delay_tokens += static_cast<double>(it.s.length);
        segs.push_back(it.s);
      }
    }
    delay_sum_ = delay_sum;
    delay_tokens_ = delay_tokens;
    StepPlan plan;
    plan.step = step;
    distribute(plan, mbs, opt_, &w_);
    // Held back: carry-over and queues, each document once, sorted (as fillDelayed).
    auto& docs = docs_;
    docs.clear();
    for (const auto& it : carry_) docs.push_back(it.s.doc);
    for (const auto& q : queues_)
      for (const auto& it : q) docs.push_back(it.s.doc);
    sortDocs(docs);
    plan.delayed.reserve(docs.size());
    std::unique_copy(docs.begin(), docs.end(), std::back_inserter(plan.delayed));
    return plan;
  }

  // Local search after the greedy: move one segment from the heaviest micro-batch to a
  // lighter one, or swap a pair, whenever that lowers the larger of the two below the
  // current maximum (s_max respected). Works on bins_, w_ and len_.
  void refine(int iters, std::size_t lights) {
    const auto Smax = opt_.s_max;
    auto& w = w_;
    auto& len = len_;
    const std::size_t N = bins_.size();
    auto& order = order_;
    byw_.resize(N);
    for (auto& sb : byw_) sb.ok = false;
    order.resize(N);
    for (std::size_t j = 0; j < N; ++j) order[j] = j;
    double total = 0;
    for (double x : w) total += x;
    const double good = (1.0 + kRefineTolerance) * total / static_cast<double>(N);
    for (int it = 0; it < iters; ++it) {
      // (w, index) is a total order, so insertion-sorting last round's order (two entries
      // changed) gives the same permutation as a full sort.
      for (std::size_t i = 1; i < N; ++i) {
        const std::size_t v = order[i];
        std::size_t k = i;
        for (; k > 0 && (w[v] < w[order[k - 1]] || (w[v] == w[order[k - 1]] && v < order[k - 1])); --k)
          order[k] = order[k - 1];
        order[k] = v;
      }
      const std::size_t h = order[N - 1];
      if (w[h] <= good) break;  // already balanced to within the tolerance
      double best = w[h];
      std::size_t bl = N, bx = 0, by = 0;
      bool swap = false;
      auto& H = bins_[h];
      for (std::size_t k = 0; k < std::min(lights, N - 1); ++k) {
        const std::size_t l = order[k];
        // Any move or swap with l leaves max >= (w[h] + w[l]) / 2; lights come in
        // increasing w, so once that cannot beat `best` (with the acceptance margin to
        // spare) no later light can either.
        if (0.5 * (w[h] + w[l]) >= best * (1.0 - 0.5e-9)) break;
        const auto& Lb = bins_[l];
        for (std::size_t x = 0; x < H.size(); ++x) {
          const double wx = H[x].w;
          if (w[l] + wx >= best) continue;
          if (len[l] + H[x].s.length <= Smax) {
            const double m = std::max(w[h] - wx, w[l] + wx);
            if (m < best - 1e-9 * best) {
              best = m;
              bl = l;
              bx = x;
              swap = false;
            }
          }
        }
        // Swaps: only y with wx - (w[h] - w[l]) < wy < wx can help; scan L's segments in
        // increasing W from the first such y. The order depends only on L's contents, so
        // it is kept until L changes.
        auto& sb = byw_[l];
        if (!sb.ok) {
          sb.idx.resize(Lb.size());
          for (std::size_t y = 0; y < Lb.size(); ++y) sb.idx[y] = y;
          std::sort(sb.idx.begin(), sb.idx.end(), [&](std::size_t a, std::size_t b) { return Lb[a].w < Lb[b].w; });
          sb.w.clear();
          sb.len.clear();
          for (const auto y : sb.idx) {
            sb.w.push_back(Lb[y].w);
            sb.len.push_back(Lb[y].s.length);
          }
          sb.ok = true;
        }
        if (sb.idx.empty()) continue;
        const double gap = w[h] - w[l];
        const double wy_min = sb.w.front(), wy_max = sb.w.back();
        for (std::size_t x = 0; x < H.size(); ++x) {
          const double wx = H[x].w;
          // Also skip y whose swap cannot get below `best`: w[l] + wx - wy >= best (from
          // below) or w[h] - wx + wy >= best (from above; this bound is <= wx as best <=
          // w[h]). The acceptance test keeps a 1e-9 relative margin, far above rounding,
          // so every y skipped here would be rejected anyway.
          const double from = std::max(wx - gap, w[l] + wx - best);
          if (from >= wy_max || wx - (w[h] - best) <= wy_min) continue;  // no y in range
          // Both sides within s_max: W need not be monotone in length under a measured
          // profile. As bounds on y's length:
          const std::int64_t lx = H[x].s.length, ly_lo = len[l] + lx - Smax, ly_hi = Smax - len[h] + lx;
          for (auto k = static_cast<std::size_t>(std::upper_bound(sb.w.begin(), sb.w.end(), from) - sb.w.begin());
               k < sb.w.size(); ++k) {
            const double wy = sb.w[k];
            if (wy >= wx - (w[h] - best)) break;
            if (sb.len[k] < ly_lo || sb.len[k] > ly_hi) continue;
            const double m = std::max(w[h] - wx + wy, w[l] + wx - wy);
            if (m < best - 1e-9 * best) {
              best = m;
              bl = l;
              bx = x;
              by = sb.idx[k];
              swap = true;
            }
          }
        }
      }
      if (bl == N) break;
      byw_[h].ok = byw_[bl].ok = false;
      auto& Lb = bins_[bl];
      const Item ix = H[bx];
      if (swap) {
        const Item iy = Lb[by];
        H[bx] = iy;
        Lb[by] = ix;
        w[h] += iy.w - ix.w;
        w[bl] += ix.w - iy.w;
        len[h] += iy.s.length - ix.s.length;
        len[bl] += ix.s.length - iy.s.length;
      } else {
        H.erase(H.begin() + static_cast<std::ptrdiff_t>(bx));
        Lb.push_back(ix);
        w[h] -= ix.w;
        w[bl] += ix.w;
        len[h] -= ix.s.length;
        len[bl] += ix.s.length;
      }
    }
  }

  nlohmann::json saveState() const override {
    nlohmann::json q = nlohmann::json::array();
    for (const auto& v : queues_) q.push_back(segsToJson(segmentsOf(v)));
    return {{"carry", segsToJson(segmentsOf(carry_))},
            {"queues", q},
            {"delay_sum", delay_sum_},
            {"delay_tokens", delay_tokens_}};
  }
  void loadState(const nlohmann::json& s) override {
    carry_ = itemsOf(segsFromJson(s.at("carry")));
    delay_sum_ = s.value("delay_sum", 0.0);
    delay_tokens_ = s.value("delay_tokens", 0.0);
    const auto& q = s.at("queues");
    if (q.size() != queues_.size())
      throw InputError(fmt::format("packer state: {} outlier queues saved, {} configured", q.size(), queues_.size()));
    for (std::size_t i = 0; i < queues_.size(); ++i) queues_[i] = itemsOf(segsFromJson(q[i]));
    // Arrivals are cut at s_max; a longer held piece was saved under a larger data.s_max and
    // would fit no micro-batch of this one: it would come back every step, never trained.
    for (const Segment& h : heldSegments())
      if (h.length > opt_.s_max)
        throw InputError(
            fmt::format("packer state: held segment [doc {}, offset {}, length {}] is longer than "
                        "data.s_max = {}: the state was saved with another data.s_max (resume "
                        "with the deck it was saved with)",
                        h.doc, h.offset, h.length, opt_.s_max));
  }
  std::vector<Segment> heldSegments() const override {
    std::vector<Segment> v = segmentsOf(carry_);
    for (const auto& q : queues_) {
      const auto qs = segmentsOf(q);
      v.insert(v.end(), qs.begin(), qs.end());
    }
    return v;
  }

 private:
  /// A segment with its W, computed once when it enters the packer (not saved: W is a
  /// function of the length).
  struct Item {
    Segment s;
    double w = 0;
  };
  struct Cand {
    std::size_t q, i, base;
    double w;
  };
  /// Below this many items the sorts below just call std::sort.
  static constexpr std::size_t kRadixMin = 64;
  /// Radix digit width (bits) and the most passes radixSortKeyed makes.
  static constexpr int kRadixBits = 9, kRadixPasses = 4;

  static int bitWidth(std::uint64_t x) {
    int b = 0;
    for (; x != 0; x >>= 1) ++b;
    return b;
  }
  static bool radixFits(std::uint64_t max_key) { return bitWidth(max_key) <= kRadixBits * kRadixPasses; }

  /// Stable LSD radix sort of keyed_ by key (all keys <= max_key, radixFits(max_key)).
  void radixSortKeyed(std::uint64_t max_key) {
    constexpr std::size_t kBuckets = std::size_t{1} << kRadixBits;
    const std::size_t n = keyed_.size();
    const int passes = (bitWidth(max_key) + kRadixBits - 1) / kRadixBits;
    keyed_tmp_.resize(n);
    std::uint32_t count[kRadixPasses][kBuckets] = {};
    for (const auto& k : keyed_)
      for (int d = 0; d < passes; ++d) ++count[d][(k.key >> (kRadixBits * d)) & (kBuckets - 1)];
    for (int d = 0; d < passes; ++d) {
      auto* c = count[d];
      const int shift = kRadixBits * d;
      if (c[(keyed_[0].key >> shift) & (kBuckets - 1)] == n) continue;  // one digit for all
      std::uint32_t sum = 0;
      for (std::size_t b = 0; b < kBuckets; ++b) {
        const std::uint32_t here = c[b];
        c[b] = sum;
        sum += here;
      }
      for (const auto& k : keyed_) keyed_tmp_[c[(k.key >> shift) & (kBuckets - 1)]++] = k;
      keyed_.swap(keyed_tmp_);
    }
  }

  /// Sorts document ids ascending (radix sort on id - min for larger inputs).
  void sortDocs(std::vector<DocId>& v) {
    const std::size_t n = v.size();
    if (n < kRadixMin || n > std::numeric_limits<std::uint32_t>::max()) {
      std::sort(v.begin(), v.end());
      return;
    }
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    const DocId base = *lo;
    const auto span = static_cast<std::uint64_t>(*hi) - static_cast<std::uint64_t>(base);
    if (!radixFits(span)) {
      std::sort(v.begin(), v.end());
      return;
    }
    keyed_.resize(n);
    for (std::size_t i = 0; i < n; ++i)
      keyed_[i] = {static_cast<std::uint64_t>(v[i]) - static_cast<std::uint64_t>(base), 0};
    radixSortKeyed(span);
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<DocId>(static_cast<std::uint64_t>(base) + keyed_[i].key);
  }

  /// Sorts v longest first, then by doc and offset (as longerFirst). For larger inputs:
  /// a stable LSD radix sort on the length, then runs of equal length are ordered by
  /// (doc, offset). That result is used only if no two items are equal in all three
  /// fields: the order is then unique, so it equals std::sort's. Otherwise std::sort.
  void sortLongerFirst(std::vector<Item>& v) {
    const auto longer = [](const Item& a, const Item& b) { return longerFirst(a.s, b.s); };
    const std::size_t n = v.size();
    if (n < kRadixMin || n > std::numeric_limits<std::uint32_t>::max()) {
      std::sort(v.begin(), v.end(), longer);
      return;
    }
    std::int64_t len_lo = v[0].s.length, len_hi = len_lo;
    for (const auto& it : v) {
      len_lo = std::min(len_lo, it.s.length);
      len_hi = std::max(len_hi, it.s.length);
    }
    // Key: len_hi - length (ascending = longest first).
    const auto span = static_cast<std::uint64_t>(len_hi) - static_cast<std::uint64_t>(len_lo);
    if (!radixFits(span)) {
      std::sort(v.begin(), v.end(), longer);
      return;
    }
    keyed_.resize(n);
    for (std::size_t i = 0; i < n; ++i)
      keyed_[i] = {static_cast<std::uint64_t>(len_hi) - static_cast<std::uint64_t>(v[i].s.length),
                   static_cast<std::uint32_t>(i)};
    radixSortKeyed(span);
    // Within a run of equal length (short): insertion sort by (doc, offset); a repeated
    // (doc, offset) means equal items, whose order std::sort leaves unspecified.
    for (std::size_t i = 1; i < n; ++i) {
      if (keyed_[i].key != keyed_[i - 1].key) continue;
      const Keyed k = keyed_[i];
      const auto& x = v[k.idx].s;
      std::size_t j = i;
      for (; j > 0 && keyed_[j - 1].key == k.key; --j) {
        const auto& y = v[keyed_[j - 1].idx].s;
        if (x.doc == y.doc && x.offset == y.offset) {
          std::sort(v.begin(), v.end(), longer);
          return;
        }
        if (longerFirst(y, x)) break;  // equal length: y before x by (doc, offset)
        keyed_[j] = keyed_[j - 1];
      }
      keyed_[j] = k;
    }
    items_tmp_.clear();
    for (const auto& k : keyed_) items_tmp_.push_back(v[k.idx]);
    v.swap(items_tmp_);
  }

  static std::int64_t tokensOf(const std::vector<Item>& v) {
    std::int64_t t = 0;
    for (const auto& it : v) t += it.s.length;
    return t;
  }
  static std::vector<Segment> segmentsOf(const std::vector<Item>& v) {
    std::vector<Segment> out;
    out.reserve(v.size());
    for (const auto& it : v) out.push_back(it.s);
    return out;
  }
  std::vector<Item> itemsOf(const std::vector<Segment>& v) const {
    std::vector<Item> out;
    out.reserve(v.size());
    for (const auto& s : v) out.push_back({s, work(s.length)});
    return out;
  }

  std::vector<Item> carry_;
  std::vector<std::vector<Item>> queues_;
  double delay_sum_ = 0, delay_tokens_ = 0;
  WorkTable table_;
  std::vector<double> w_memo_;  ///< w_memo_[len] = work(len), NaN until first use
  // Per-step scratch, kept across steps so its storage is reused.
  std::vector<Item> prio_, fresh_;
  std::vector<Cand> cands_;
  std::vector<char> take_;
  std::vector<std::vector<Item>> bins_;  ///< micro-batch contents during placement/refine
  std::vector<double> w_;
  std::vector<std::int64_t> len_;
  MinTree<double> by_w_;
  MinTree<std::int64_t> by_len_;
  std::vector<std::size_t> order_;
  /// A micro-batch's segments by increasing W (refine's swap scan), kept until it changes.
  struct ByW {
    std::vector<std::size_t> idx;   ///< segment indices
    std::vector<double> w;          ///< their W
    std::vector<std::int64_t> len;  ///< their lengths
    bool ok = false;
  };
  std::vector<ByW> byw_;
  struct Keyed {
    std::uint64_t key;
    std::uint32_t idx;
  };
  std::vector<Keyed> keyed_, keyed_tmp_;
  std::vector<Item> items_tmp_;
  std::vector<DocId> docs_;
};

}  // namespace

std::unique_ptr<Packer> makeWlb(const PackerOptions& opt, const model::CostModel& cost) {
  return std::make_unique<WlbPacker>(opt, cost);
}

}  // namespace detail
}  // namespace wlb::packing
