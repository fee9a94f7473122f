// fixed_optimal: the fixed-length min-max attention packing ILP solved with CBC.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include <coin/CbcModel.hpp>
#include <coin/CglGomory.hpp>
#include <coin/CglKnapsackCover.hpp>
#include <coin/CglProbing.hpp>
#include <coin/CoinPackedMatrix.hpp>
#include <coin/CoinPackedVector.hpp>
#include <coin/OsiClpSolverInterface.hpp>

#include <fmt/format.h>

#include "packing/milp.hpp"
#include "packing/packer.hpp"
#include "packing/packer_internal.hpp"

namespace wlb::packing {

double minMaxObjective(const std::vector<std::int64_t>& lengths, const std::vector<int>& bin_of, int bins,
                       std::int64_t capacity) {
  std::vector<double> w(static_cast<std::size_t>(bins), 0.0);
  std::vector<std::int64_t> t(static_cast<std::size_t>(bins), 0);
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    const int b = bin_of[i];
    if (b < 0 || b >= bins) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(lengths[i]);
    w[static_cast<std::size_t>(b)] += d * d;
    t[static_cast<std::size_t>(b)] += lengths[i];
  }
  for (auto x : t)
    if (x > capacity) return std::numeric_limits<double>::infinity();
  return w.empty() ? 0.0 : *std::max_element(w.begin(), w.end());
}

namespace {
double trivialBound(const std::vector<std::int64_t>& lengths, int bins) {
  double mx = 0, sum = 0;
  for (auto l : lengths) {
    const double d2 = static_cast<double>(l) * static_cast<double>(l);
    mx = std::max(mx, d2);
    sum += d2;
  }
  return std::max(mx, sum / std::max(1, bins));
}
}  // namespace

MinMaxResult bruteForceMinMaxSquares(const std::vector<std::int64_t>& lengths, int bins, std::int64_t capacity) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::size_t n = lengths.size();
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](auto a, auto b) { return lengths[a] > lengths[b]; });
  std::vector<double> w(static_cast<std::size_t>(bins), 0.0);
  std::vector<std::int64_t> t(static_cast<std::size_t>(bins), 0);
  std::vector<int> cur(n, -1), best;
  double best_obj = std::numeric_limits<double>::infinity();
  std::function<void(std::size_t, int, double)> rec = [&](std::size_t k, int used, double mx) {
    if (mx >= best_obj) return;
    if (k == n) {
      best_obj = mx;
      best = cur;
      return;
    }
    const std::size_t i = order[k];
    const double d2 = static_cast<double>(lengths[i]) * static_cast<double>(lengths[i]);
    for (int b = 0; b < std::min(bins, used + 1); ++b) {
      const auto bs = static_cast<std::size_t>(b);
      if (t[bs] + lengths[i] > capacity) continue;
      t[bs] += lengths[i];
      w[bs] += d2;
      cur[i] = b;
      rec(k + 1, std::max(used, b + 1), std::max(mx, w[bs]));
      t[bs] -= lengths[i];
      w[bs] -= d2;
    }
    cur[i] = -1;
  };
  rec(0, 0, 0.0);
  MinMaxResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (best.empty() && n > 0) {
    r.status = "infeasible";
    return r;
  }
  r.bin_of = best;
  r.objective = n ? best_obj : 0.0;
  r.bound = r.objective;
  r.status = "optimal";
  return r;
}

MinMaxResult solveMinMaxSquares(const std::vector<std::int64_t>& lengths, int bins, std::int64_t capacity,
                                double time_limit, const std::vector<int>* warm) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(clock::now() - t0).count(); };
  MinMaxResult r;
  const std::size_t n = lengths.size();
  if (n == 0) {
    r.status = "optimal";
    return r;
  }
  const double lb0 = trivialBound(lengths, bins);
  // Sorted order and symmetry-broken warm start.
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return lengths[a] > lengths[b]; });
  double warm_obj = std::numeric_limits<double>::infinity();
  if (warm && warm->size() == n) warm_obj = minMaxObjective(lengths, *warm, bins, capacity);
  const bool have_warm = std::isfinite(warm_obj);
  if (have_warm && warm_obj <= lb0 * (1.0 + 1e-12)) {
    r.bin_of = *warm;
    r.objective = warm_obj;
    r.bound = lb0;
    r.status = "optimal";
    r.seconds = elapsed();
    return r;
  }
  // Model size: CBC's root LP and cut rounds are not interruptible, so a model of every
  // item x bin (250,000 binaries for 8,000 documents on 32 sequences) overruns any time
  // limit. Beyond kMaxBinaries the longest items stay free — they carry the squared work
  // — and the rest keep their warm-start sequence, entering as fixed load per bin.
  const std::size_t max_free = std::max<std::size_t>(static_cast<std::size_t>(bins), kMaxBinaries / bins);
  const bool reduced = have_warm && n > max_free && static_cast<std::size_t>(bins) * n > kMaxBinaries;
  const std::size_t nf = reduced ? max_free : n;  // free items: order[0..nf)
  const double cap = static_cast<double>(capacity);
  const double scale = cap * cap;
  std::vector<double> fixed_tok(static_cast<std::size_t>(bins), 0.0), fixed_w(static_cast<std::size_t>(bins), 0.0);
  for (std::size_t k = nf; k < n; ++k) {
    const auto j = static_cast<std::size_t>((*warm)[order[k]]);
    const double d = static_cast<double>(lengths[order[k]]) / cap;
    fixed_tok[j] += d;
    fixed_w[j] += d * d;
  }
  // Columns: x_{k,j} for free item k; full model: bin j <= min(k, bins-1) (symmetry
  // breaking: identical bins); reduced model: every bin (bins differ by their fixed load).
  std::vector<int> first_col(nf + 1, 0);
  for (std::size_t k = 0; k < nf; ++k)
    first_col[k + 1] = first_col[k] + (reduced ? bins : std::min<int>(static_cast<int>(k) + 1, bins));
  const int nx = first_col[nf];
  const int ncols = nx + 1, zcol = nx;
  std::vector<double> collb(ncols, 0.0), colub(ncols, 1.0), obj(ncols, 0.0);
  colub[zcol] = COIN_DBL_MAX;
  obj[zcol] = 1.0;
  CoinPackedMatrix m(false, 0, 0);
  m.setDimensions(0, ncols);
  std::vector<double> rowlb, rowub;
  for (std::size_t k = 0; k < nf; ++k) {  // assignment
    CoinPackedVector row;
    for (int c = first_col[k]; c < first_col[k + 1]; ++c) row.insert(c, 1.0);
    m.appendRow(row);
    rowlb.push_back(1.0);
    rowub.push_back(1.0);
  }
  for (int j = 0; j < bins; ++j) {  // capacity and work
    const auto js = static_cast<std::size_t>(j);
    CoinPackedVector cap_row, work_row;
    for (std::size_t k = reduced ? 0 : js; k < nf; ++k) {
      const double d = static_cast<double>(lengths[order[k]]) / cap;
      cap_row.insert(first_col[k] + j, d);
      work_row.insert(first_col[k] + j, d * d);
    }
    if (cap_row.getNumElements() == 0 && fixed_w[js] == 0) continue;
    work_row.insert(zcol, -1.0);
    m.appendRow(cap_row);
    rowlb.push_back(-COIN_DBL_MAX);
    rowub.push_back(1.0 - fixed_tok[js]);
    m.appendRow(work_row);
    rowlb.push_back(-COIN_DBL_MAX);
    rowub.push_back(-fixed_w[js]);
  }
  std::vector<double> sol;
  if (have_warm) {
    sol.assign(static_cast<std::size_t>(ncols), 0.0);
    if (reduced) {
      for (std::size_t k = 0; k < nf; ++k)
        sol[static_cast<std::size_t>(first_col[k]) + static_cast<std::size_t>((*warm)[order[k]])] = 1.0;
    } else {
      // Relabel bins by first use in sorted order so the warm start obeys symmetry breaking.
      std::vector<int> relabel(static_cast<std::size_t>(bins), -1);
      int next = 0;
      for (std::size_t k = 0; k < n; ++k) {
        int& b = relabel[static_cast<std::size_t>((*warm)[order[k]])];
        if (b < 0) b = next++;
        sol[static_cast<std::size_t>(first_col[k]) + static_cast<std::size_t>(b)] = 1.0;
      }
    }
    sol[static_cast<std::size_t>(zcol)] = warm_obj / scale;
  }
  // The limit covers building the model too: what is left goes to CBC.
  const double left = time_limit - elapsed();
  const auto finish_with_warm = [&](const std::string& note) {
    r.bin_of = *warm;
    r.objective = warm_obj;
    r.bound = lb0;
    r.gap = r.objective > 0 ? std::max(0.0, (r.objective - r.bound) / r.objective) : 0.0;
    r.status = "heuristic";
    r.note = note;
    r.seconds = elapsed();
    return r;
  };
  if (have_warm && left < 0.005)
    return finish_with_warm("time limit reached while building the model: greedy start kept");
  OsiClpSolverInterface solver;
  solver.messageHandler()->setLogLevel(0);
  solver.loadProblem(m, collb.data(), colub.data(), obj.data(), rowlb.data(), rowub.data());
  for (int c = 0; c < nx; ++c) solver.setInteger(c);
  CbcModel model(solver);
  model.setLogLevel(0);
  model.messageHandler()->setLogLevel(0);
  model.setMaximumSeconds(std::max(0.005, left));
  CglProbing probing;
  probing.setUsingObjective(true);
  CglGomory gomory;
  CglKnapsackCover knapsack;
  model.addCutGenerator(&probing, -1, "Probing");
  model.addCutGenerator(&gomory, -1, "Gomory");
  model.addCutGenerator(&knapsack, -1, "KnapsackCover");
  if (have_warm) model.setBestSolution(sol.data(), ncols, warm_obj / scale, true);
  model.branchAndBound();
  r.nodes = model.getNodeCount();
  const double* best = model.bestSolution();
  if (best) {
    r.bin_of.assign(n, -1);
    for (std::size_t k = 0; k < nf; ++k)
      for (int c = first_col[k]; c < first_col[k + 1]; ++c)
        if (best[c] > 0.5) r.bin_of[order[k]] = c - first_col[k];
    for (std::size_t k = nf; k < n; ++k) r.bin_of[order[k]] = (*warm)[order[k]];
    r.objective = minMaxObjective(lengths, r.bin_of, bins, capacity);
  }
  if (!best || !std::isfinite(r.objective) || (have_warm && warm_obj < r.objective)) {
    if (have_warm) {
      r.bin_of = *warm;
      r.objective = warm_obj;
    } else if (!best) {
      r.bin_of.clear();
      r.status = model.isProvenInfeasible() ? "infeasible" : "time_limit";
      r.seconds = elapsed();
      return r;
    }
  }
  // A reduced model's bound holds only for its fixed part: the full problem's proven
  // bound is the trivial one.
  const bool proven = !reduced && model.isProvenOptimal();
  r.bound = reduced ? lb0 : std::max(lb0, std::min(r.objective, model.getBestPossibleObjValue() * scale));
  if (proven) {
    r.bound = r.objective;
    r.tolerance = model.getCutoffIncrement() * scale;
  }
  r.gap = r.objective > 0 ? std::max(0.0, (r.objective - r.bound) / r.objective) : 0.0;
  if (r.gap < 1e-9) r.gap = 0.0;
  r.status = (proven || r.gap == 0.0) ? "optimal" : reduced ? "heuristic" : "time_limit";
  if (reduced)
    r.note = fmt::format("model reduced to the {} longest of {} items ({} binaries); the rest keep the greedy start",
                         nf, n, nx);
  r.seconds = elapsed();
  return r;
}

namespace detail {
namespace {

class FixedOptimalPacker final : public CarryPacker {
 public:
  FixedOptimalPacker(PackerOptions o, const model::CostModel& c) : CarryPacker(std::move(o), c) {}
  std::string name() const override { return "fixed_optimal"; }

  StepPlan pack(std::int64_t step, const std::vector<Document>& incoming) override {
    const auto S = opt_.context_window;
    const int N = static_cast<int>(opt_.N());
    auto items = carry_;
    auto pieces = splitToSegments(incoming, S);
    items.insert(items.end(), pieces.begin(), pieces.end());
    carry_.clear();
    // Feasible start 1: greedy decreasing into the least-squared-work bin with room.
    std::vector<std::size_t> order(items.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](auto a, auto b) { return longerFirst(items[a], items[b]); });
    std::vector<int> greedy(items.size(), -1);
    {
      std::vector<std::int64_t> room(static_cast<std::size_t>(N), S);
      std::vector<double> w(static_cast<std::size_t>(N), 0.0);
      for (auto i : order) {
        int best = -1;
        for (int j = 0; j < N; ++j)
          if (room[j] >= items[i].length && (best < 0 || w[j] < w[best])) best = j;
        if (best < 0) continue;
        greedy[i] = best;
        room[best] -= items[i].length;
        w[best] += static_cast<double>(items[i].length) * static_cast<double>(items[i].length);
      }
    }
    // Feasible start 2: the original sequential fill (always feasible for a source batch).
    std::vector<int> seq(items.size(), -1);
    {
      int cur = 0;
      std::int64_t room = S;
      for (std::size_t i = 0; i < items.size(); ++i) {
        if (items[i].length > room) {
          if (cur + 1 >= N) break;
          ++cur;
          room = S;
        }
        seq[i] = cur;
        room -= items[i].length;
      }
    }
    auto unplaced = [](const std::vector<int>& a) { return std::count(a.begin(), a.end(), -1); };
    std::vector<int> start;
    if (unplaced(greedy) == 0)
      start = greedy;
    else if (unplaced(seq) == 0)
      start = seq;
    else
      start = unplaced(greedy) <= unplaced(seq) ? greedy : seq;
    std::vector<Segment> placed;
    std::vector<int> warm;
    std::vector<std::int64_t> lens;
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (start[i] < 0) {
        carry_.push_back(items[i]);
        continue;
      }
      placed.push_back(items[i]);
      warm.push_back(start[i]);
      lens.push_back(items[i].length);
    }
    MinMaxResult res = solveMinMaxSquares(lens, N, S, opt_.milp_time_limit, &warm);
    const std::vector<int>& assign = res.bin_of.size() == placed.size() ? res.bin_of : warm;
    std::vector<MicroBatch> mbs(static_cast<std::size_t>(N));
    for (std::size_t i = 0; i < placed.size(); ++i)
      mbs[static_cast<std::size_t>(assign[i])].segments.push_back(placed[i]);
    info_ = {{"status", res.status},
             {"objective", res.objective / double(S) / double(S)},
             {"bound", res.bound / double(S) / double(S)},
             {"gap", res.gap},
             {"tolerance", res.tolerance / double(S) / double(S)},
             {"seconds", res.seconds},
             {"nodes", res.nodes},
             {"items", placed.size()}};
    if (!res.note.empty()) info_["note"] = res.note;
    StepPlan plan;
    plan.step = step;
    distribute(plan, mbs, opt_, nullptr);
    fillDelayed(plan, {&carry_});
    return plan;
  }
  nlohmann::json lastSolverInfo() const override { return info_; }

 private:
  nlohmann::json info_;
};

}  // namespace

std::unique_ptr<Packer> makeFixedOptimal(const PackerOptions& opt, const model::CostModel& cost) {
  return std::make_unique<FixedOptimalPacker>(opt, cost);
}

}  // namespace detail
}  // namespace wlb::packing
