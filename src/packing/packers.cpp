// Heuristic packers: original, fixed_greedy, best_fit, wlb (ALGORITHMS.md §1). The MILP
// packer fixed_optimal lives in fixed_optimal.cpp. Semantics: docs/packing.md.
#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <unordered_set>

#include <fmt/format.h>

#include "core/error.hpp"
#include "data/length_source.hpp"
#include "packing/packer.hpp"
#include "packing/packer_internal.hpp"

namespace wlb::packing {

Packer::~Packer() = default;

PackerOptions PackerOptions::fromDeck(const Deck& deck) {
  PackerOptions o;
  o.dp = deck.mesh.dp;
  o.micro_batches = data::microBatchesPerReplica(deck);
  o.context_window = deck.data.context_window;
  o.s_max = std::max(data::resolvedSMax(deck), o.context_window);
  o.window = std::max<std::int64_t>(1, deck.packing.window);
  o.outlier_thresholds = deck.packing.outlier_thresholds.empty()
                             ? defaultThresholds(o.context_window, o.s_max)
                             : deck.packing.outlier_thresholds;
  o.milp_time_limit = deck.packing.milp_time_limit;
  o.delay_budget = deck.packing.delay_budget;
  // Bound the outlier-queue wait: [packing] max_queue_wait, or by default derived from the
  // delay budget as max(2, ceil(5 * budget)) steps; the delay controller keeps the mean
  // under the budget by releasing one step earlier when needed (docs/packing.md).
  o.max_queue_wait = deck.packing.max_queue_wait > 0
                         ? deck.packing.max_queue_wait
                         : std::max<std::int64_t>(2, static_cast<std::int64_t>(std::ceil(5.0 * deck.packing.delay_budget)));
  for (std::size_t i = 0; i < o.outlier_thresholds.size(); ++i) {
    const auto L = o.outlier_thresholds[i];
    if (L < 1 || (i > 0 && L <= o.outlier_thresholds[i - 1]))
      throw InputError(fmt::format("packing.outlier_thresholds: must be positive and strictly "
                                   "increasing (entry {} = {})", i, L), true);
  }
  return o;
}

std::vector<std::int64_t> defaultThresholds(std::int64_t S, std::int64_t s_max) {
  std::vector<std::int64_t> t;
  for (std::int64_t L : {3 * S / 16, 3 * S / 8, 3 * S / 4}) {
    L = std::min(L, s_max);
    if (L >= 1 && (t.empty() || L > t.back())) t.push_back(L);
  }
  return t;
}

std::vector<Segment> splitToSegments(const std::vector<Document>& docs, std::int64_t cap) {
  std::vector<Segment> out;
  out.reserve(docs.size());
  for (const auto& d : docs) {
    for (std::int64_t off = 0; off < d.length; off += cap)
      out.push_back(Segment{d.id, off, std::min(cap, d.length - off), d.arrival_step});
  }
  return out;
}

namespace detail {

nlohmann::json segsToJson(const std::vector<Segment>& v) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& s : v) a.push_back({s.doc, s.offset, s.length, s.arrival_step});
  return a;
}

std::vector<Segment> segsFromJson(const nlohmann::json& a) {
  std::vector<Segment> v;
  for (const auto& e : a)
    v.push_back(Segment{e.at(0).get<DocId>(), e.at(1).get<std::int64_t>(),
                        e.at(2).get<std::int64_t>(), e.at(3).get<std::int64_t>()});
  return v;
}

bool longerFirst(const Segment& a, const Segment& b) {
  if (a.length != b.length) return a.length > b.length;
  if (a.doc != b.doc) return a.doc < b.doc;
  return a.offset < b.offset;
}

void fillDelayed(StepPlan& plan, const std::vector<const std::vector<Segment>*>& held) {
  std::unordered_set<DocId> seen;
  for (const auto* v : held)
    for (const auto& s : *v)
      if (seen.insert(s.doc).second) plan.delayed.push_back(s.doc);
  std::sort(plan.delayed.begin(), plan.delayed.end());
}

std::int64_t tokensOf(const std::vector<Segment>& v) {
  std::int64_t t = 0;
  for (const auto& s : v) t += s.length;
  return t;
}

void distribute(StepPlan& plan, std::vector<MicroBatch>& mbs, const PackerOptions& opt,
                const std::vector<double>* work) {
  const auto dp = opt.dp, M = opt.micro_batches;
  plan.replicas.assign(static_cast<std::size_t>(dp), std::vector<MicroBatch>());
  for (auto& r : plan.replicas) r.reserve(static_cast<std::size_t>(M));
  std::vector<std::size_t> order(mbs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (work) {
    // Snake-deal micro-batches by decreasing work so DP replicas get equal totals.
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return (*work)[a] > (*work)[b]; });
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto round = static_cast<std::int64_t>(i) / dp, pos = static_cast<std::int64_t>(i) % dp;
      const auto r = (round % 2 == 0) ? pos : dp - 1 - pos;
      plan.replicas[static_cast<std::size_t>(r)].push_back(std::move(mbs[order[i]]));
    }
  } else {
    for (std::size_t i = 0; i < order.size(); ++i)
      plan.replicas[i / static_cast<std::size_t>(M)].push_back(std::move(mbs[i]));
  }
}

WorkTable::WorkTable(const model::CostModel& cost, std::int64_t max_len)
    : cost_(&cost), max_len_(max_len) {
  const auto& hw = cost.hardware();
  const std::int64_t tq = hw.tile_q, tk = hw.tile_k;
  if (tq < 1 || tk < 1) return;
  const std::int64_t rows = max_len / tq + 2;
  prefix_.assign(static_cast<std::size_t>(rows + 1), 0.0);
  for (std::int64_t i = 1; i <= rows; ++i)
    prefix_[static_cast<std::size_t>(i)] =
        prefix_[static_cast<std::size_t>(i - 1)] + static_cast<double>((i * tq + tk - 1) / tk);
  const auto& d = cost.dims();
  const double heads = static_cast<double>(d.heads) / static_cast<double>(cost.tp());
  flops_per_block_fwd_ = 4.0 * static_cast<double>(tq * tk) * static_cast<double>(d.head_dim) * heads;
  // Linear work is linear in tokens (CostModel::linearFlops).
  lin_per_token_ = cost.linearSeconds(1 << 20, model::Phase::Fwd) / static_cast<double>(1 << 20) +
                   cost.linearSeconds(1 << 20, model::Phase::Bwd) / static_cast<double>(1 << 20);
  fast_ = true;
  for (std::int64_t len : {1L, 7L, 63L, 64L, 65L, 1000L, 4096L, 12345L, max_len / 3, max_len}) {
    if (len < 1 || len > max_len) continue;
    const double ref = cost.attnSeconds(0, len, model::Phase::Fwd) + cost.attnSeconds(0, len, model::Phase::Bwd);
    if (std::abs(fastAttn(len) - ref) > 1e-9 * std::abs(ref)) {
      fast_ = false;
      break;
    }
  }
}

double WorkTable::fastAttn(std::int64_t len) const {
  using model::Phase;
  const auto& hw = cost_->hardware();
  const std::int64_t tq = hw.tile_q, tk = hw.tile_k;
  const std::int64_t row_tiles = (len + tq - 1) / tq;
  const double blocks = prefix_[static_cast<std::size_t>(row_tiles - 1)] + static_cast<double>((len + tk - 1) / tk);
  const double f = blocks * flops_per_block_fwd_;
  const double q = static_cast<double>(len);
  return f / (hw.attnGflops(Phase::Fwd, q, q) * 1e9) +
         model::kAttnBwdFactor * f / (hw.attnGflops(Phase::Bwd, q, q) * 1e9);
}

double WorkTable::attn(std::int64_t len) const {
  if (len <= 0) return 0.0;
  if (fast_ && len <= max_len_) return fastAttn(len);
  return cost_->attnSeconds(0, len, model::Phase::Fwd) + cost_->attnSeconds(0, len, model::Phase::Bwd);
}

double WorkTable::work(std::int64_t len) const {
  if (len <= 0) return 0.0;
  if (fast_ && len <= max_len_) return fastAttn(len) + lin_per_token_ * static_cast<double>(len);
  return cost_->segmentWork(len);
}

}  // namespace detail

using namespace detail;

namespace {

// ---- original ------------------------------------------------------------------------
class OriginalPacker final : public Packer {
 public:
  OriginalPacker(PackerOptions o, const model::CostModel& c) : Packer(std::move(o), c) {}
  std::string name() const override { return "original"; }

  StepPlan pack(std::int64_t step, const std::vector<Document>& incoming) override {
    const auto S = opt_.context_window;
    const auto N = opt_.N();
    auto pieces = splitToSegments(incoming, S);
    std::vector<Segment> items;
    items.reserve(carry_.size() + pieces.size());
    items.insert(items.end(), carry_.begin(), carry_.end());
    items.insert(items.end(), pieces.begin(), pieces.end());
    carry_.clear();
    std::vector<MicroBatch> mbs(static_cast<std::size_t>(N));
    std::int64_t cur = 0, room = S;
    std::size_t i = 0;
    for (; i < items.size(); ++i) {
      const auto& s = items[i];
      if (s.length > room) {
        if (cur + 1 >= N) break;
        ++cur;
        room = S;
      }
      mbs[static_cast<std::size_t>(cur)].segments.push_back(s);
      room -= s.length;
    }
    carry_.assign(items.begin() + static_cast<std::ptrdiff_t>(i), items.end());
    StepPlan plan;
    plan.step = step;
    distribute(plan, mbs, opt_, nullptr);
    fillDelayed(plan, {&carry_});
    return plan;
  }
  nlohmann::json saveState() const override { return {{"carry", segsToJson(carry_)}}; }
  void loadState(const nlohmann::json& s) override { carry_ = segsFromJson(s.at("carry")); }
  std::int64_t pendingTokens() const override { return tokensOf(carry_); }

 private:
  std::vector<Segment> carry_;
};

// ---- best_fit (length only) ------------------------------------------------------------
class BestFitPacker final : public Packer {
 public:
  BestFitPacker(PackerOptions o, const model::CostModel& c) : Packer(std::move(o), c) {}
  std::string name() const override { return "best_fit"; }

  StepPlan pack(std::int64_t step, const std::vector<Document>& incoming) override {
    const auto S = opt_.context_window;
    const auto N = static_cast<std::size_t>(opt_.N());
    auto items = carry_;
    auto pieces = splitToSegments(incoming, S);
    items.insert(items.end(), pieces.begin(), pieces.end());
    std::sort(items.begin(), items.end(), longerFirst);
    carry_.clear();
    std::vector<MicroBatch> mbs(N);
    std::vector<std::int64_t> room(N, S);
    for (const auto& s : items) {
      std::size_t best = N;
      for (std::size_t j = 0; j < N; ++j)
        if (room[j] >= s.length && (best == N || room[j] < room[best])) best = j;
      if (best == N) {
        carry_.push_back(s);
        continue;
      }
      mbs[best].segments.push_back(s);
      room[best] -= s.length;
    }
    StepPlan plan;
    plan.step = step;
    distribute(plan, mbs, opt_, nullptr);
    fillDelayed(plan, {&carry_});
    return plan;
  }
  nlohmann::json saveState() const override { return {{"carry", segsToJson(carry_)}}; }
  void loadState(const nlohmann::json& s) override { carry_ = segsFromJson(s.at("carry")); }
  std::int64_t pendingTokens() const override { return tokensOf(carry_); }

 private:
  std::vector<Segment> carry_;
};

// ---- fixed_greedy (window of k global batches) -----------------------------------------
class FixedGreedyPacker final : public Packer {
 public:
  FixedGreedyPacker(PackerOptions o, const model::CostModel& c)
      : Packer(std::move(o), c), table_(c, opt_.context_window) {}
  std::string name() const override { return "fixed_greedy"; }

  StepPlan pack(std::int64_t step, const std::vector<Document>& incoming) override {
    const auto S = opt_.context_window;
    const auto N = static_cast<std::size_t>(opt_.N());
    const auto k = static_cast<std::size_t>(opt_.window);
    auto pieces = splitToSegments(incoming, S);
    buffer_.insert(buffer_.end(), pieces.begin(), pieces.end());
    if (++filled_ >= static_cast<std::int64_t>(k)) {
      filled_ = 0;
      auto items = std::move(buffer_);
      buffer_.clear();
      std::sort(items.begin(), items.end(), longerFirst);
      const std::size_t B = k * N;
      std::vector<std::vector<Segment>> bins(B);
      std::vector<std::int64_t> room(B, S);
      std::vector<double> attn(B, 0.0);
      for (const auto& s : items) {
        std::size_t best = B;
        for (std::size_t j = 0; j < B; ++j)
          if (room[j] >= s.length && (best == B || attn[j] < attn[best])) best = j;
        if (best == B) {
          buffer_.push_back(s);  // fits nowhere: carried into the next window
          continue;
        }
        bins[best].push_back(s);
        room[best] -= s.length;
        attn[best] += table_.attn(s.length);
      }
      // Group bins of similar work into the same step: sort by work, chunks of N.
      std::vector<std::size_t> order(B);
      for (std::size_t j = 0; j < B; ++j) order[j] = j;
      std::vector<double> w(B);
      for (std::size_t j = 0; j < B; ++j)
        w[j] = attn[j] + cost_->linearSeconds(S - room[j], model::Phase::Fwd) +
               cost_->linearSeconds(S - room[j], model::Phase::Bwd);
      std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return w[a] > w[b]; });
      for (std::size_t g = 0; g < k; ++g) {
        std::vector<std::vector<Segment>> group;
        for (std::size_t j = 0; j < N; ++j) group.push_back(std::move(bins[order[g * N + j]]));
        ready_.push_back(std::move(group));
      }
    }
    std::vector<MicroBatch> mbs(N);
    if (!ready_.empty()) {
      for (std::size_t j = 0; j < N; ++j) mbs[j].segments = std::move(ready_.front()[j]);
      ready_.pop_front();
    }
    StepPlan plan;
    plan.step = step;
    distribute(plan, mbs, opt_, nullptr);
    std::vector<const std::vector<Segment>*> held = {&buffer_};
    for (const auto& g : ready_)
      for (const auto& b : g) held.push_back(&b);
    fillDelayed(plan, held);
    return plan;
  }
  nlohmann::json saveState() const override {
    nlohmann::json r = nlohmann::json::array();
    for (const auto& g : ready_) {
      nlohmann::json gj = nlohmann::json::array();
      for (const auto& b : g) gj.push_back(segsToJson(b));
      r.push_back(gj);
    }
    return {{"buffer", segsToJson(buffer_)}, {"filled", filled_}, {"ready", r}};
  }
  void loadState(const nlohmann::json& s) override {
    buffer_ = segsFromJson(s.at("buffer"));
    filled_ = s.at("filled").get<std::int64_t>();
    ready_.clear();
    for (const auto& gj : s.at("ready")) {
      std::vector<std::vector<Segment>> g;
      for (const auto& b : gj) g.push_back(segsFromJson(b));
      ready_.push_back(std::move(g));
    }
  }
  std::int64_t pendingTokens() const override {
    std::int64_t t = tokensOf(buffer_);
    for (const auto& g : ready_)
      for (const auto& b : g) t += tokensOf(b);
    return t;
  }

 private:
  std::vector<Segment> buffer_;
  std::int64_t filled_ = 0;
  std::deque<std::vector<std::vector<Segment>>> ready_;
  WorkTable table_;
};

// ---- wlb: variable-length packing + outlier-delay queues (Algorithm 1) -------------------
class WlbPacker final : public Packer {
 public:
  WlbPacker(PackerOptions o, const model::CostModel& c)
      : Packer(std::move(o), c), table_(c, opt_.s_max) {
    queues_.resize(opt_.outlier_thresholds.size());
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

  double work(std::int64_t len) const { return table_.work(len); }

  StepPlan pack(std::int64_t step, const std::vector<Document>& incoming) override {
    const auto Smax = opt_.s_max;
    const auto N = static_cast<std::size_t>(opt_.N());
    const auto& L = opt_.outlier_thresholds;
    std::vector<Segment> fresh;
    fresh.reserve(incoming.size());
    for (const auto& d : incoming) {
      for (std::int64_t off = 0; off < d.length; off += Smax) {
        Segment s{d.id, off, std::min(Smax, d.length - off), d.arrival_step};
        const auto lvl = static_cast<std::size_t>(std::upper_bound(L.begin(), L.end(), s.length) - L.begin());
        if (lvl == 0) fresh.push_back(s);
        else queues_[lvl - 1].push_back(s);
      }
    }
    // Priority: carried-over documents and queue entries released by age go first.
    std::vector<Segment> prio = std::move(carry_);
    carry_.clear();
    const std::size_t n_carried = prio.size();  // prio = [carry-over..., forced...]
    std::int64_t planned = tokensOf(prio) + tokensOf(fresh);
    // Delay control: while the running mean per-token delay exceeds kDelayTarget x budget,
    // queues are force-released one step earlier (never later than max_queue_wait).
    std::int64_t wait = opt_.max_queue_wait;
    if (opt_.delay_budget > 0 && delay_tokens_ > 0 && delay_sum_ / delay_tokens_ > kDelayTarget * opt_.delay_budget)
      wait = std::max<std::int64_t>(1, wait - 1);
    for (auto& q : queues_) {
      if (wait > 0 && !q.empty() && step - q.front().arrival_step >= wait) {
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
        if (pick == queues_.size() || q.front().arrival_step < queues_[pick].front().arrival_step) pick = i;
      }
      if (pick == queues_.size()) break;
      auto& q = queues_[pick];
      std::int64_t t = 0;
      for (std::size_t k = 0; k < N; ++k) t += q[k].length;
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
        for (const auto& s : *v) {
          const double ws = work(s.length);
          wmax = std::max(wmax, ws);
          wsum += ws;
        }
      double budget = static_cast<double>(N) * wmax - wsum;
      if (budget > 0) {
        struct Cand {
          std::size_t q, i;
          double w;
        };
        std::vector<Cand> cands;
        for (std::size_t qi = 0; qi < queues_.size(); ++qi)
          for (std::size_t i = 0; i < queues_[qi].size(); ++i) {
            const double ws = work(queues_[qi][i].length);
            if (ws <= wmax) cands.push_back({qi, i, ws});
          }
        std::stable_sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) { return a.w > b.w; });
        std::vector<std::vector<char>> take(queues_.size());
        for (std::size_t qi = 0; qi < queues_.size(); ++qi) take[qi].assign(queues_[qi].size(), 0);
        bool any = false;
        for (const auto& c : cands) {
          const auto len = queues_[c.q][c.i].length;
          if (c.w > budget || planned + len > capacity) continue;
          budget -= c.w;
          planned += len;
          take[c.q][c.i] = 1;
          any = true;
        }
        if (any)
          for (std::size_t qi = 0; qi < queues_.size(); ++qi) {
            std::vector<Segment> keep;
            for (std::size_t i = 0; i < queues_[qi].size(); ++i)
              (take[qi][i] ? fresh : keep).push_back(queues_[qi][i]);
            queues_[qi] = std::move(keep);
          }
      }
    }
    // Placement order: last step's carry-over first (so it is not carried twice), then
    // everything else — forced, popped, pulled and new items — in one longest-first (LPT)
    // order.
    fresh.insert(fresh.end(), prio.begin() + static_cast<std::ptrdiff_t>(n_carried), prio.end());
    prio.resize(n_carried);
    std::sort(prio.begin(), prio.end(), longerFirst);
    std::sort(fresh.begin(), fresh.end(), longerFirst);
    std::vector<MicroBatch> mbs(N);
    std::vector<double> w(N, 0.0);
    std::vector<std::int64_t> len(N, 0);
    std::vector<std::vector<double>> sw(N);
    // Min-heap of (work, index): the least-loaded micro-batch in O(log N) (ties -> lowest
    // index, as a linear scan would pick).
    using Key = std::pair<double, std::size_t>;
    std::vector<Key> heap(N);
    for (std::size_t j = 0; j < N; ++j) heap[j] = {0.0, j};
    const auto cmp = std::greater<Key>();
    auto place = [&](const Segment& s) {
      const std::size_t bw = heap.front().second;
      std::size_t t = N;
      if (len[bw] + s.length <= Smax) {
        t = bw;
      } else {
        std::size_t bl = 0;
        for (std::size_t j = 1; j < N; ++j)
          if (len[j] < len[bl]) bl = j;
        if (len[bl] + s.length <= Smax) t = bl;
      }
      if (t == N) {
        carry_.push_back(s);
        return;
      }
      const double ws = work(s.length);
      mbs[t].segments.push_back(s);
      sw[t].push_back(ws);
      len[t] += s.length;
      w[t] += ws;
      if (t == bw) {
        std::pop_heap(heap.begin(), heap.end(), cmp);
        heap.back() = {w[t], t};
        std::push_heap(heap.begin(), heap.end(), cmp);
      } else {
        for (std::size_t j = 0; j < N; ++j) heap[j] = {w[j], j};
        std::make_heap(heap.begin(), heap.end(), cmp);
      }
    };
    for (const auto& s : prio) place(s);
    for (const auto& s : fresh) place(s);
    refine(mbs, sw, w, len, kRefineIterations, kRefineLights);
    for (const auto& mb : mbs)
      for (const auto& sg : mb.segments) {
        delay_sum_ += static_cast<double>(step - sg.arrival_step) * static_cast<double>(sg.length);
        delay_tokens_ += static_cast<double>(sg.length);
      }
    StepPlan plan;
    plan.step = step;
    distribute(plan, mbs, opt_, &w);
    std::vector<const std::vector<Segment>*> held = {&carry_};
    for (const auto& q : queues_) held.push_back(&q);
    fillDelayed(plan, held);
    return plan;
  }

  // Local search after the greedy: move one segment from the heaviest micro-batch to a
  // lighter one, or swap a pair, whenever that lowers the larger of the two below the
  // current maximum (s_max respected). `sw[j][i]` = W of segment i of micro-batch j.
  void refine(std::vector<MicroBatch>& mbs, std::vector<std::vector<double>>& sw, std::vector<double>& w,
              std::vector<std::int64_t>& len, int iters, std::size_t lights) const {
    const auto Smax = opt_.s_max;
    const std::size_t N = mbs.size();
    std::vector<std::size_t> order(N), byw;
    double total = 0;
    for (double x : w) total += x;
    const double good = (1.0 + kRefineTolerance) * total / static_cast<double>(N);
    for (int it = 0; it < iters; ++it) {
      for (std::size_t j = 0; j < N; ++j) order[j] = j;
      std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return w[a] < w[b] || (w[a] == w[b] && a < b); });
      const std::size_t h = order[N - 1];
      if (w[h] <= good) break;  // already balanced to within the tolerance
      double best = w[h];
      std::size_t bl = N, bx = 0, by = 0;
      bool swap = false;
      auto& H = mbs[h].segments;
      for (std::size_t k = 0; k < std::min(lights, N - 1); ++k) {
        const std::size_t l = order[k];
        const auto& Lb = mbs[l].segments;
        for (std::size_t x = 0; x < H.size(); ++x) {
          const double wx = sw[h][x];
          if (w[l] + wx >= best) continue;
          if (len[l] + H[x].length <= Smax) {
            const double m = std::max(w[h] - wx, w[l] + wx);
            if (m < best - 1e-9 * best) { best = m; bl = l; bx = x; swap = false; }
          }
        }
        // Swaps: only y with wx - (w[h] - w[l]) < wy < wx can help; scan L's segments in
        // increasing W from the first such y.
        byw.resize(Lb.size());
        for (std::size_t y = 0; y < Lb.size(); ++y) byw[y] = y;
        std::sort(byw.begin(), byw.end(), [&](std::size_t a, std::size_t b) { return sw[l][a] < sw[l][b]; });
        const double gap = w[h] - w[l];
        for (std::size_t x = 0; x < H.size(); ++x) {
          const double wx = sw[h][x];
          auto it = std::lower_bound(byw.begin(), byw.end(), wx - gap,
                                     [&](std::size_t a, double v) { return sw[l][a] <= v; });
          for (; it != byw.end(); ++it) {
            const std::size_t y = *it;
            const double wy = sw[l][y];
            if (wy >= wx) break;
            // Both sides: W need not be monotone in length under a measured profile.
            if (len[l] + H[x].length - Lb[y].length > Smax || len[h] - H[x].length + Lb[y].length > Smax) continue;
            const double m = std::max(w[h] - wx + wy, w[l] + wx - wy);
            if (m < best - 1e-9 * best) { best = m; bl = l; bx = x; by = y; swap = true; }
          }
        }
      }
      if (bl == N) break;
      auto& Lb = mbs[bl].segments;
      const Segment sx = H[bx];
      const double wx = sw[h][bx];
      if (swap) {
        const Segment sy = Lb[by];
        const double wy = sw[bl][by];
        H[bx] = sy; sw[h][bx] = wy;
        Lb[by] = sx; sw[bl][by] = wx;
        w[h] += wy - wx; w[bl] += wx - wy;
        len[h] += sy.length - sx.length; len[bl] += sx.length - sy.length;
      } else {
        H.erase(H.begin() + static_cast<std::ptrdiff_t>(bx));
        sw[h].erase(sw[h].begin() + static_cast<std::ptrdiff_t>(bx));
        Lb.push_back(sx); sw[bl].push_back(wx);
        w[h] -= wx; w[bl] += wx;
        len[h] -= sx.length; len[bl] += sx.length;
      }
    }
  }

  nlohmann::json saveState() const override {
    nlohmann::json q = nlohmann::json::array();
    for (const auto& v : queues_) q.push_back(segsToJson(v));
    return {{"carry", segsToJson(carry_)}, {"queues", q}, {"delay_sum", delay_sum_}, {"delay_tokens", delay_tokens_}};
  }
  void loadState(const nlohmann::json& s) override {
    carry_ = segsFromJson(s.at("carry"));
    delay_sum_ = s.value("delay_sum", 0.0);
    delay_tokens_ = s.value("delay_tokens", 0.0);
    const auto& q = s.at("queues");
    if (q.size() != queues_.size())
      throw InputError(fmt::format("packer state: {} outlier queues saved, {} configured",
                                   q.size(), queues_.size()));
    for (std::size_t i = 0; i < queues_.size(); ++i) queues_[i] = segsFromJson(q[i]);
  }
  std::int64_t pendingTokens() const override {
    std::int64_t t = tokensOf(carry_);
    for (const auto& q : queues_) t += tokensOf(q);
    return t;
  }

 private:
  std::vector<Segment> carry_;
  std::vector<std::vector<Segment>> queues_;
  double delay_sum_ = 0, delay_tokens_ = 0;
  WorkTable table_;
};

}  // namespace

std::vector<std::string> packerNames() {
  return {"original", "fixed_greedy", "fixed_optimal", "best_fit", "wlb"};
}

std::unique_ptr<Packer> makePacker(const std::string& name, const PackerOptions& opt,
                                   const model::CostModel& cost) {
  if (opt.dp < 1 || opt.micro_batches < 1 || opt.context_window < 1 || opt.s_max < opt.context_window)
    throw InputError(fmt::format("packer: need dp >= 1, micro_batches >= 1 and s_max >= "
                                 "context_window (got dp={}, M={}, S={}, s_max={})",
                                 opt.dp, opt.micro_batches, opt.context_window, opt.s_max), true);
  if (name == "original") return std::make_unique<OriginalPacker>(opt, cost);
  if (name == "best_fit") return std::make_unique<BestFitPacker>(opt, cost);
  if (name == "fixed_greedy") return std::make_unique<FixedGreedyPacker>(opt, cost);
  if (name == "wlb") return std::make_unique<WlbPacker>(opt, cost);
  if (name == "fixed_optimal") return detail::makeFixedOptimal(opt, cost);
  std::string valid;
  for (const auto& n : packerNames()) valid += (valid.empty() ? "" : ", ") + n;
  throw InputError(fmt::format("packing.strategy: unknown packer '{}' (valid: {})", name, valid), true);
}

std::unique_ptr<Packer> makePacker(const std::string& name, const Deck& deck,
                                   const model::CostModel& cost) {
  return makePacker(name, PackerOptions::fromDeck(deck), cost);
}

}  // namespace wlb::packing
