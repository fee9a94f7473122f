// The packers' shared helpers, the heuristic packers original, best_fit and fixed_greedy,
// and the one dispatch by name (docs/packing.md). wlb lives in wlb_packer.cpp, the MILP
// packer fixed_optimal in fixed_optimal.cpp, slimpack in slimpack.cpp.
#include <algorithm>
#include <cmath>
#include <deque>
#include <unordered_set>

#include <fmt/format.h>

#include "core/error.hpp"
#include "data/length_source.hpp"
#include "packing/packer.hpp"
#include "packing/packer_internal.hpp"
#include "pp/simulator.hpp"

namespace wlb::packing {

Packer::~Packer() = default;

std::int64_t capacity(const Packer& packer) {
  const auto& o = packer.options();
  return packer.name() == "wlb" || packer.name() == "slimpack" ? o.s_max : o.context_window;
}
std::int64_t Packer::pendingTokens() const {
  return detail::tokensOf(heldSegments());
}

PackerOptions PackerOptions::fromDeck(const Deck& deck) {
  PackerOptions o;
  o.dp = deck.mesh.dp;
  o.micro_batches = data::microBatchesPerReplica(deck);
  o.context_window = deck.data.context_window;
  o.s_max = std::max(data::resolvedSMax(deck), o.context_window);
  o.window = std::max<std::int64_t>(1, deck.packing.window);
  o.outlier_thresholds = deck.packing.outlier_thresholds.empty() ? defaultThresholds(o.context_window, o.s_max)
                                                                 : deck.packing.outlier_thresholds;
  o.milp_time_limit = deck.packing.milp_time_limit;
  o.pp = deck.mesh.pp;
  o.slimpack_candidates = deck.packing.slimpack_candidates;
  o.slimpack_dp_merge = deck.packing.slimpack_dp_merge != 0;
  o.delay_budget = deck.packing.delay_budget;
  // Bound the outlier-queue wait: [packing] max_queue_wait, or by default derived from the
  // delay budget as max(2, ceil(5 * budget)) steps; the delay controller keeps the mean
  // under the budget by releasing one step earlier when needed (docs/packing.md).
  o.max_queue_wait =
      deck.packing.max_queue_wait > 0
          ? deck.packing.max_queue_wait
          : std::max<std::int64_t>(2, static_cast<std::int64_t>(std::ceil(5.0 * deck.packing.delay_budget)));
  for (std::size_t i = 0; i < o.outlier_thresholds.size(); ++i) {
    const auto L = o.outlier_thresholds[i];
    if (L < 1 || (i > 0 && L <= o.outlier_thresholds[i - 1]))
      throw InputError(fmt::format("packing.outlier_thresholds: must be positive and strictly "
                                   "increasing (entry {} = {})",
                                   i, L),
                       true);
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
  for (const auto& s : v) {
    nlohmann::json e = {s.doc, s.offset, s.length, s.arrival_step};
    if (s.q_offset != 0) e.push_back(s.q_offset);
    a.push_back(std::move(e));
  }
  return a;
}

std::vector<Segment> segsFromJson(const nlohmann::json& a) {
  std::vector<Segment> v;
  for (const auto& e : a) {
    const Segment s{e.at(0).get<DocId>(), e.at(1).get<std::int64_t>(), e.at(2).get<std::int64_t>(),
                    e.at(3).get<std::int64_t>(), e.size() > 4 ? e.at(4).get<std::int64_t>() : 0};
    // A held segment is a piece of a real document: what a packer never writes is refused.
    if (s.doc < 0 || s.offset < 0 || s.length < 1 || s.length > data::kMaxDocTokens ||
        s.offset > data::kMaxDocTokens - s.length || s.arrival_step < 0 || s.q_offset < 0 || s.q_offset > s.offset)
      throw InputError("packer state: segment " + e.dump() +
                       " is not [doc >= 0, offset >= 0, 1 <= length, arrival >= 0(, 0 <= q_offset <= offset)]");
    v.push_back(s);
  }
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
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return (*work)[a] > (*work)[b]; });
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

WorkTable::WorkTable(const model::CostModel& cost, std::int64_t max_len) : cost_(&cost), max_len_(max_len) {
  const auto& hw = cost.hardware();
  const std::int64_t tq = hw.tile_q, tk = hw.tile_k;
  if (tq < 1 || tk < 1) return;
  const std::int64_t rows = max_len / tq + 2;
  prefix_.assign(static_cast<std::size_t>(rows + 1), 0.0);
  for (std::int64_t i = 1; i <= rows; ++i) {
    const std::int64_t key_tiles = (i * tq + tk - 1) / tk;
    prefix_[static_cast<std::size_t>(i)] = prefix_[static_cast<std::size_t>(i - 1)] + static_cast<double>(key_tiles);
  }
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
  const std::int64_t key_tiles = (len + tk - 1) / tk;
  const double blocks = prefix_[static_cast<std::size_t>(row_tiles - 1)] + static_cast<double>(key_tiles);
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
class OriginalPacker final : public CarryPacker {
 public:
  OriginalPacker(PackerOptions o, const model::CostModel& c) : CarryPacker(std::move(o), c) {}
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
};

// ---- best_fit (length only) ------------------------------------------------------------
class BestFitPacker final : public CarryPacker {
 public:
  BestFitPacker(PackerOptions o, const model::CostModel& c) : CarryPacker(std::move(o), c) {}
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
    if (filled_ < 0 || filled_ >= opt_.window)
      throw InputError(
          fmt::format("packer state: filled = {} is not a step of the window [0, {})", filled_, opt_.window));
    ready_.clear();
    for (const auto& gj : s.at("ready")) {
      std::vector<std::vector<Segment>> g;
      for (const auto& b : gj) g.push_back(segsFromJson(b));
      ready_.push_back(std::move(g));
    }
  }
  std::vector<Segment> heldSegments() const override {
    std::vector<Segment> v = buffer_;
    for (const auto& g : ready_)
      for (const auto& b : g) v.insert(v.end(), b.begin(), b.end());
    return v;
  }

 private:
  std::vector<Segment> buffer_;
  std::int64_t filled_ = 0;
  std::deque<std::vector<std::vector<Segment>>> ready_;
  WorkTable table_;
};

}  // namespace

std::vector<std::string> packerNames() {
  return {"original", "fixed_greedy", "fixed_optimal", "best_fit", "wlb", "slimpack"};
}

std::unique_ptr<Packer> makePacker(const std::string& name, const PackerOptions& opt, const model::CostModel& cost) {
  if (opt.dp < 1 || opt.micro_batches < 1 || opt.context_window < 1 || opt.s_max < opt.context_window)
    throw InputError(fmt::format("packer: need dp >= 1, micro_batches >= 1 and s_max >= "
                                 "context_window (got dp={}, M={}, S={}, s_max={})",
                                 opt.dp, opt.micro_batches, opt.context_window, opt.s_max),
                     true);
  if (name == "original") return std::make_unique<OriginalPacker>(opt, cost);
  if (name == "best_fit") return std::make_unique<BestFitPacker>(opt, cost);
  if (name == "fixed_greedy") return std::make_unique<FixedGreedyPacker>(opt, cost);
  if (name == "wlb") return detail::makeWlb(opt, cost);
  if (name == "fixed_optimal") return detail::makeFixedOptimal(opt, cost);
  if (name == "slimpack") return detail::makeSlimPack(opt, cost);
  checkPackerName(name, "packing.strategy");
  throw InputError("unknown packer '" + name + "'", true);  // not reached: a name packerNames() lists is made above
}

void checkPackerName(const std::string& name, const std::string& what) {
  const auto names = packerNames();
  if (std::find(names.begin(), names.end(), name) != names.end()) return;
  std::string valid;
  for (const auto& n : names) valid += (valid.empty() ? "" : ", ") + n;
  throw InputError(fmt::format("{}: unknown packer '{}' (valid: {})", what, name, valid), true);
}

std::unique_ptr<Packer> makePacker(const std::string& name, const Deck& deck, const model::CostModel& cost) {
  auto opt = PackerOptions::fromDeck(deck);
  // slimpack scores its MicroPack counts with the deck's step simulator.
  if (name == "slimpack")
    opt.sim = std::make_shared<const pp::SimConfig>(pp::SimConfig::fromDeck(deck, cost.hardware()));
  return makePacker(name, opt, cost);
}

}  // namespace wlb::packing
