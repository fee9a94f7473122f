/// \file run.cpp
/// \brief The measured step executor (see run.hpp, docs/runtime.md).

#include "runtime/run.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "core/output_file.hpp"
#include "cp/shard_plan.hpp"
#include "data/length_source.hpp"
#include "data/prepare.hpp"
#include "model/cost_model.hpp"
#include "model/deck_inputs.hpp"
#include "model/throughput.hpp"
#include "packing/packer.hpp"
#include "packing/plan_io.hpp"
#include "packing/simulate_deck.hpp"
#include "parallel/comm.hpp"
#include "parallel/group_comm.hpp"
#include "parallel/mesh.hpp"
#include "pp/schedule.hpp"
#include "pp/simulator.hpp"
#include "runtime/layer.hpp"
#include "runtime/llama.hpp"
#include "runtime/pipeline.hpp"
#include "runtime/tokens.hpp"
#include "trace/clock_sync.hpp"
#include "trace/recorder.hpp"
#include "trace/writer.hpp"

namespace wlb::runtime {
namespace {

namespace labels = trace::labels;

constexpr double kNs = 1e-9;
// Labels counted as compute (busy) and as communication (incl. waiting for peers).
bool isCompute(const std::string& l) {
  return l == labels::kEmbed || l == labels::kQkvProj || l == labels::kAttn || l == labels::kOutProj ||
         l == labels::kMlp || l == labels::kLoss || l == labels::kNorm || l == labels::kOptimizer ||
         l == labels::kRecompute;
}
bool isComm(const std::string& l) {
  return l == labels::kKvAllgather || l == labels::kKvExchange || l == labels::kTpAllreduce ||
         l == labels::kGradAllreduce || l == labels::kPpSend || l == labels::kPpRecv;
}

// into[i] = max(into[i], v[i]), `into` grown to v's size (per-stage peaks over steps).
void maxInto(std::vector<double>& into, const std::vector<double>& v) {
  if (into.size() < v.size()) into.resize(v.size(), 0.0);
  for (std::size_t i = 0; i < v.size(); ++i) into[i] = std::max(into[i], v[i]);
}

double maxOverMean(const std::vector<double>& v) {
  if (v.empty()) return 1.0;
  const double mx = *std::max_element(v.begin(), v.end());
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return mean > 0 ? mx / mean : 1.0;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string planPath(const Deck& deck, const std::string& strategy, std::size_t nstrategies) {
  std::filesystem::path p = std::filesystem::path(deck.output.dir) / deck.output.plan;
  if (nstrategies > 1) {
    const std::string ext = p.extension().string();
    p.replace_filename(p.stem().string() + "." + strategy + ext);
  }
  return p.string();
}

// Per-rank, per-step measurements shipped to rank 0 (gatherStep): a head, then per
// micro-batch m: attention s, task s, local tokens.
enum Head : int {
  kStepS,
  kBusyS,
  kCommS,
  kAttnS,
  kTaskS,
  kPipeS,
  kLoss,
  kPeakBytes,
  kAllocs,
  kPoolBytes,
  kLiveBytes,
  kAskedBytes,
  kHead
};
constexpr int kPerMb = 3;

// Everything about the run that is fixed on this rank.
struct RunContext {
  const Deck& deck;
  const RunOptions& opt;
  parallel::MeshShape shape;
  parallel::Mesh& mesh;
  const model::CostModel& cost;
  const TokenSource& tokens;
  cp::CommMode comm_mode{};
  std::int64_t M = 0;
  int layers = 0;
  pp::Schedule schedule;
  static int nrow(std::int64_t m) { return kHead + kPerMb * static_cast<int>(m); }
  /// Micro-batch slots of a step: data.micro_batches, or the MicroPack count a SlimPack
  /// plan chose for the step.
  std::int64_t slots(const StepPlan& plan) const {
    if (!pp::isSlimPackPlan(plan)) return M;
    std::size_t m = 0;
    for (const auto& r : plan.replicas) m = std::max(m, r.size());
    return static_cast<std::int64_t>(m);
  }
};

// Per-strategy state. Strategies are interleaved step by step (step 0 of every strategy,
// then step 1, ...), so slow drifts of the machine's load affect them alike.
struct StratState {
  StrategyPair strat;
  std::unique_ptr<data::LengthSource> source;  // rank 0 only
  std::unique_ptr<packing::Packer> packer;     // rank 0 only
  std::ofstream plan_out;
  std::string plan_path;  ///< final name; plan_out writes plan_path + ".partial" until commit
  StrategyResult res;
};

// ---- 1. plan (rank 0) and broadcast -------------------------------------------------------
struct PlannedStep {
  StepPlan plan;
  std::string text;  ///< the plan JSONL line
  double predicted = 1;
  std::int64_t tokens = 0;
  std::int64_t predicted_rows = 0;  ///< rows with a target (the loss's normaliser)
};

PlannedStep planStep(const RunContext& rc, StratState& st, std::int64_t step, bool drain) {
  PlannedStep ps;
  std::string err;
  if (rc.mesh.rank() == 0) {
    try {
      const auto docs = drain ? std::vector<Document>{} : st.source->next(step);
      const StepPlan plan = st.packer->pack(step, docs);
      const auto metrics = packing::computeMetrics(plan, rc.cost);
      ps.predicted = metrics.imbalance;
      ps.text = packing::stepToJson(plan, metrics, static_cast<std::int64_t>(docs.size())).dump();
    } catch (const std::exception& e) {
      err = std::string("planning step ") + std::to_string(step) + " (" + st.strat.name + "): " + e.what();
    }
  }
  parallel::throwIfAnyFailed(rc.mesh.world(), err);
  ps.text = parallel::bcastString(rc.mesh.world(), ps.text);
  ps.plan = packing::stepFromJson(nlohmann::json::parse(ps.text));
  if (static_cast<int>(ps.plan.replicas.size()) != rc.shape.dp())
    throw std::logic_error("wlb run: packer returned " + std::to_string(ps.plan.replicas.size()) +
                           " replicas for dp=" + std::to_string(rc.shape.dp()));
  for (const auto& rep : ps.plan.replicas)
    for (const auto& mb : rep) ps.tokens += mb.tokens();
  ps.predicted_rows = predictedRows(ps.plan);
  return ps;
}

// ---- 2. shard: the CP plans of one replica (deterministic on every rank) ------------------
// SlimPack plans run sliced (cp = 1, runtime/sliced.hpp) under their own PackFlow schedule.
StageStepInput shardReplica(const RunContext& rc, const StepPlan& plan, std::size_t d, const std::string& sharding,
                            std::int64_t step) {
  StageStepInput in = replicaStepInput(step, plan, d, rc.shape.pp(), rc.M, rc.shape.cp(), rc.cost,
                                       cp::parseStrategy(sharding), rc.comm_mode, rc.deck.cp);
  const std::int64_t predicted = predictedRows(plan);
  in.tokens = &rc.tokens;
  in.loss_scale = predicted > 0 ? 1.0f / static_cast<float>(predicted) : 0.0f;  // mean CE of the step
  return in;
}

// The shard plans of every replica as the trace's /plan/shard_json.
std::string shardJson(const RunContext& rc, const StepPlan& plan, const std::string& sharding) {
  return shardPlansJson(plan, rc.shape.pp(), rc.M, rc.shape.cp(), rc.cost, cp::parseStrategy(sharding), rc.comm_mode,
                        rc.deck.cp);
}

// ---- 3. execute: the schedule walk, the gradient reduction, the step's measurements -------
std::vector<double> executeStep(const RunContext& rc, PipelineStage& stage, Llama& model, parallel::GroupComm& dpcp,
                                trace::Recorder& rec, const StageStepInput& in, std::int64_t slots) {
  const Space space;
  std::vector<double> row(static_cast<std::size_t>(RunContext::nrow(slots)), 0.0);
  const std::size_t first_event = rec.events().size();
  rc.mesh.world().barrier();
  const std::int64_t t0 = rec.now();
  model.zeroGrads(space);
  if (rc.mesh.rank() == rc.opt.fail_rank && in.step == rc.opt.fail_step) {
    if (rc.opt.fail_kill) std::raise(SIGKILL);
    throw std::runtime_error("injected failure on rank " + std::to_string(rc.mesh.rank()) + " at step " +
                             std::to_string(in.step) + " (RunOptions::fail_rank)");
  }
  const StageStepResult sr = stage.run(in, t0);
  // DP x CP gradient all-reduce of this stage (one buffer: the stage's weight gradients).
  rec.setContext({static_cast<int>(in.step), -1, trace::Phase::Bwd, -1});
  if (dpcp.size() > 1) {
    auto g = model.grads();
    trace::Recorder::Scope s(rec, labels::kGradAllreduce, space, 0, 4.0 * static_cast<double>(g.size()));
    dpcp.allreduceSum(space, g.data(), static_cast<std::int64_t>(g.size()));
  }
  kk::fence(space, "wlb::runtime::step");
  const std::int64_t t1 = rec.now();
  rec.setContext({static_cast<int>(in.step), -1, trace::Phase::None, -1});
  rec.record(rec.region(labels::kStep), t0, t1);

  row[kStepS] = static_cast<double>(t1 - t0) * kNs;
  const auto& evs = rec.events();
  for (std::size_t i = first_event; i < evs.size(); ++i) {
    const std::string& l = rec.regions()[static_cast<std::size_t>(evs[i].region)];
    const double d = static_cast<double>(evs[i].end_ns - evs[i].start_ns) * kNs;
    if (isCompute(l)) row[kBusyS] += d;
    if (isComm(l)) row[kCommS] += d;
    if (l == labels::kAttn) row[kAttnS] += d;
  }
  row[kTaskS] = sr.task_seconds;
  row[kPipeS] = sr.pipeline_seconds;
  row[kLoss] = sr.loss;
  row[kPeakBytes] = static_cast<double>(sr.peak_activation_bytes);
  row[kAllocs] = static_cast<double>(sr.allocations);
  row[kPoolBytes] = static_cast<double>(sr.pool_bytes);
  row[kLiveBytes] = static_cast<double>(sr.pool_live_bytes);
  row[kAskedBytes] = static_cast<double>(sr.pool_requested_bytes);
  for (std::size_t m = 0; m < sr.mb_attn.size(); ++m) {
    row[kHead + kPerMb * m] = sr.mb_attn[m];
    row[kHead + kPerMb * m + 1] = sr.mb_seconds[m];
    row[kHead + kPerMb * m + 2] = sr.mb_tokens[m];
  }
  return row;
}

// ---- 4. gather: every rank's row -> the step's record (rank 0) ----------------------------
StepRecord gatherStep(const RunContext& rc, const std::vector<double>& row, const PlannedStep& ps, std::int64_t step,
                      bool drain) {
  const std::int64_t slots = rc.slots(ps.plan);
  const int nrow = RunContext::nrow(slots), W = rc.shape.size();
  std::vector<double> all(rc.mesh.rank() == 0 ? static_cast<std::size_t>(nrow) * W : 0);
  MPI_Gather(row.data(), nrow, MPI_DOUBLE, all.data(), nrow, MPI_DOUBLE, 0, rc.mesh.world());
  StepRecord sr;
  if (rc.mesh.rank() != 0) return sr;
  sr.step = step;
  sr.warmup = step < rc.deck.run.warmup;
  sr.drain = drain;
  sr.tokens = ps.tokens;
  sr.flops = model::usefulFlops(ps.plan, rc.cost, rc.layers);
  sr.predicted_imbalance = ps.predicted;
  const double predicted_rows = static_cast<double>(ps.predicted_rows);
  const auto& shape = rc.shape;
  auto at = [&](int r, int k) { return all[static_cast<std::size_t>(r) * nrow + k]; };
  sr.stage_peak_bytes.assign(static_cast<std::size_t>(shape.pp()), 0.0);
  sr.stage_pool_bytes.assign(static_cast<std::size_t>(shape.pp()), 0.0);
  sr.stage_live_bytes = sr.stage_asked_bytes = sr.stage_pool_bytes;
  for (int r = 0; r < W; ++r) {
    sr.seconds = std::max(sr.seconds, at(r, kStepS));
    sr.rank_busy.push_back(at(r, kBusyS));
    sr.rank_comm.push_back(at(r, kCommS));
    if (at(r, kStepS) > 0) sr.unrecorded += std::max(0.0, 1.0 - (at(r, kBusyS) + at(r, kCommS)) / at(r, kStepS)) / W;
    sr.rank_attn.push_back(at(r, kAttnS));
    sr.loss += at(r, kLoss);
    sr.allocations += static_cast<std::int64_t>(at(r, kAllocs));
    const auto stage = static_cast<std::size_t>(shape.coordOf(r).pp);
    sr.stage_peak_bytes[stage] = std::max(sr.stage_peak_bytes[stage], at(r, kPeakBytes));
    sr.stage_pool_bytes[stage] = std::max(sr.stage_pool_bytes[stage], at(r, kPoolBytes));
    sr.stage_live_bytes[stage] = std::max(sr.stage_live_bytes[stage], at(r, kLiveBytes));
    sr.stage_asked_bytes[stage] = std::max(sr.stage_asked_bytes[stage], at(r, kAskedBytes));
  }
  // Micro-batch latency: over stages, the slowest (cp, tp) rank's task time.
  std::vector<double> latencies, cp_imb;
  for (int d = 0; d < shape.dp(); ++d)
    for (int m = 0; m < static_cast<int>(slots); ++m) {
      double lat = 0, toks = 0;
      std::vector<double> attn_cp(static_cast<std::size_t>(shape.cp()), 0.0);  // all layers: summed over stages
      for (int p = 0; p < shape.pp(); ++p) {
        double stage_lat = 0;
        for (int c = 0; c < shape.cp(); ++c)
          for (int t = 0; t < shape.tp(); ++t) {
            const int r = shape.rankOf({t, c, p, d});
            stage_lat = std::max(stage_lat, at(r, kHead + kPerMb * m + 1));
            if (t == 0) {
              attn_cp[static_cast<std::size_t>(c)] += at(r, kHead + kPerMb * m);
              if (p == 0) toks += at(r, kHead + kPerMb * m + 2);
            }
          }
        lat += stage_lat;
      }
      if (toks > 0) cp_imb.push_back(maxOverMean(attn_cp));
      latencies.push_back(lat);
    }
  sr.mb_imbalance = maxOverMean(latencies);
  sr.cp_imbalance =
      cp_imb.empty() ? 1.0 : std::accumulate(cp_imb.begin(), cp_imb.end(), 0.0) / static_cast<double>(cp_imb.size());
  // Bubble: per replica, 1 - (task time of its ranks) / (ranks x pipeline span).
  for (int d = 0; d < shape.dp(); ++d) {
    double span = 0, busy = 0;
    int n = 0;
    for (int r = 0; r < W; ++r)
      if (shape.coordOf(r).dp == d) {
        span = std::max(span, at(r, kPipeS));
        busy += at(r, kTaskS);
        ++n;
      }
    if (span > 0) sr.bubble += (1.0 - busy / (n * span)) / shape.dp();
  }
  // A step without a predicted row (a drain step with nothing left) has no loss, not 0.
  sr.loss = predicted_rows > 0 ? sr.loss / predicted_rows : std::numeric_limits<double>::quiet_NaN();
  return sr;
}

// --gemm-timing, --kernel-timing: every rank's table on rank 0, rows of the same strategy
// and operation summed (rank 0's order first). Collective over `comm`.
std::vector<OpTimer::Row> gatherTimes(const OpTimer& timer, MPI_Comm comm) {
  int me = 0, n = 1;
  MPI_Comm_rank(comm, &me);
  MPI_Comm_size(comm, &n);
  const std::string mine = timer.serialize();
  int len = static_cast<int>(mine.size());
  std::vector<int> lens(static_cast<std::size_t>(n)), offs(static_cast<std::size_t>(n));
  MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm);
  std::string all;
  if (me == 0) {
    for (int r = 1; r < n; ++r) offs[r] = offs[r - 1] + lens[r - 1];
    all.resize(static_cast<std::size_t>(offs[n - 1]) + static_cast<std::size_t>(lens[n - 1]));
  }
  MPI_Gatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), offs.data(), MPI_CHAR, 0, comm);
  if (me != 0) return {};
  OpTimer sum;
  sum.merge(OpTimer::parse(all));
  // Each strategy's rows together, strategies in first-row order: operations only another
  // rank ran (the last stage's head.*, with pp > 1) are appended after rank 0's rows of
  // every strategy, and the report prints a table per run of one strategy.
  std::vector<OpTimer::Row> rows = sum.rows();
  std::vector<std::string> order;
  for (const auto& r : rows)
    if (std::find(order.begin(), order.end(), r.strategy) == order.end()) order.push_back(r.strategy);
  std::stable_sort(rows.begin(), rows.end(), [&](const OpTimer::Row& a, const OpTimer::Row& b) {
    return std::find(order.begin(), order.end(), a.strategy) < std::find(order.begin(), order.end(), b.strategy);
  });
  return rows;
}

// Tests: the whole model's gradients on rank 0, tensor by tensor in model order, each whole
// and row-major whatever mesh.tp is (a replicated tensor once, a column-split one with its
// TP blocks put side by side again), so any two meshes compare element by element; ranks
// cp = dp = 0 hold the reduced ones.
std::vector<float> gatherGradients(const RunContext& rc, const Llama& model) {
  const auto& shape = rc.shape;
  std::vector<float> out;
  const int me = rc.mesh.rank();
  constexpr int kTag = 7301;
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.grads());
  // Every stage's layout (each rank computes the same tables).
  std::vector<std::vector<TensorInfo>> stages;
  for (int s = 0; s < shape.pp(); ++s) {
    LlamaConfig c = model.config();
    c.stage = s;
    c.tp_rank = 0;
    stages.push_back(Llama::layout(c));
  }
  const int tensors = 3 + 9 * static_cast<int>(model.config().layers);  // embed, 9 per layer, norm_f, head
  std::vector<float> slice;
  for (int index = 0; index < tensors; ++index)
    for (int s = 0; s < shape.pp(); ++s)
      for (const TensorInfo& t : stages[static_cast<std::size_t>(s)]) {
        if (t.index != index) continue;
        const int parts = t.slice == 0 ? 1 : shape.tp();  // a replicated tensor: TP rank 0's copy
        const std::size_t at = out.size();
        if (me == 0) out.resize(at + static_cast<std::size_t>(t.size * parts));
        for (int tp = 0; tp < parts; ++tp) {
          const int src = shape.rankOf({tp, 0, s, 0});
          if (me == src && me != 0)
            MPI_Send(h.data() + t.offset, static_cast<int>(t.size), MPI_FLOAT, 0, kTag, rc.mesh.world());
          if (me != 0) continue;
          slice.resize(static_cast<std::size_t>(t.size));
          if (src == 0)
            std::copy(h.data() + t.offset, h.data() + t.offset + t.size, slice.begin());
          else
            MPI_Recv(slice.data(), static_cast<int>(t.size), MPI_FLOAT, src, kTag, rc.mesh.world(), MPI_STATUS_IGNORE);
          const SliceIndex whole(t, tp);
          for (std::int64_t i = 0; i < t.size; ++i)
            out[at + static_cast<std::size_t>(whole(i))] = slice[static_cast<std::size_t>(i)];
        }
      }
  return out;
}

// ---- 5. summarise: the strategy's steps -> its result (rank 0) ----------------------------
void summarise(StrategyResult& res, int world_size) {
  std::vector<double> times;
  double tok = 0, cpi = 0, mbi = 0, pri = 0, bub = 0, unr = 0, alloc = 0;
  res.rank_busy.assign(static_cast<std::size_t>(world_size), 0.0);
  res.rank_comm = res.rank_attn = res.rank_busy;
  std::vector<model::StepWork> work;
  for (const auto& s : res.steps) {
    // the memory peak over every step (warm-up too, as `wlb simulate` counts it)
    maxInto(res.stage_peak_bytes, s.stage_peak_bytes);
    maxInto(res.stage_pool_bytes, s.stage_pool_bytes);
    maxInto(res.stage_live_bytes, s.stage_live_bytes);
    maxInto(res.stage_asked_bytes, s.stage_asked_bytes);
    if (s.warmup) continue;
    work.push_back({s.seconds, static_cast<double>(s.tokens), s.flops});
    if (s.drain) {
      ++res.drain_steps;
      continue;
    }
    times.push_back(s.seconds);
    tok += static_cast<double>(s.tokens);
    cpi += s.cp_imbalance;
    mbi += s.mb_imbalance;
    pri += s.predicted_imbalance;
    bub += s.bubble;
    unr += s.unrecorded;
    alloc += static_cast<double>(s.allocations);
    for (int r = 0; r < world_size; ++r) {
      res.rank_busy[static_cast<std::size_t>(r)] += s.rank_busy[static_cast<std::size_t>(r)];
      res.rank_comm[static_cast<std::size_t>(r)] += s.rank_comm[static_cast<std::size_t>(r)];
      res.rank_attn[static_cast<std::size_t>(r)] += s.rank_attn[static_cast<std::size_t>(r)];
    }
  }
  const double n = static_cast<double>(times.size());
  const double total = std::accumulate(times.begin(), times.end(), 0.0);
  res.step_mean = total / n;
  res.step_min = *std::min_element(times.begin(), times.end());
  res.step_median = median(times);
  res.tokens_per_step = tok / n;
  // throughput over the measured steps and the drain (model/throughput.hpp)
  res.work = model::foldDrain(std::move(work), static_cast<std::size_t>(res.drain_steps));
  const auto tw = model::total(res.work);
  res.tokens = tw.tokens;
  res.tokens_per_second = tw.tokensPerSecond();
  res.flops_per_second = tw.flopsPerSecond();
  res.cp_imbalance = cpi / n;
  res.mb_imbalance = mbi / n;
  res.predicted_imbalance = pri / n;
  res.bubble = bub / n;
  res.unrecorded = unr / n;
  res.allocations = alloc / n;
  for (auto* v : {&res.rank_busy, &res.rank_comm, &res.rank_attn})
    for (auto& x : *v) x /= n;
}

}  // namespace

trace::RunMeta measuredMeta(const Deck& deck, const MeshShape& shape, const std::string& command, const char* executor,
                            Precision precision, parallel::CommBackend backend) {
  trace::RunMeta meta;
  meta.source = "measured";
  meta.deck_toml = deck.toToml();
  meta.command = command;
  meta.tp = shape.tp();
  meta.cp = shape.cp();
  meta.pp = shape.pp();
  meta.dp = shape.dp();
  meta.extra = {{"executor", executor},
                {"gemm", gemmBackend()},
                {"precision", precisionName(precision)},
                {"comm_backend", parallel::commBackendName(backend)},
                {"execution_space", Space::name()}};
  return meta;
}

RunReport runDeck(const Deck& deck_in, const RunOptions& opt) {
  Deck deck = deck_in;
  if (opt.steps >= 0) deck.run.steps = opt.steps;
  if (opt.warmup >= 0) deck.run.warmup = opt.warmup;
  const std::int64_t steps = deck.run.steps, warmup = deck.run.warmup;
  if (steps < 1) throw InputError("run.steps (--steps) must be >= 1", true);
  if (warmup < 0) throw InputError("run.warmup (--warmup) must be >= 0", true);

  const auto shape = parallel::MeshShape::fromDeck(deck.mesh);
  parallel::Mesh mesh(shape, opt.comm);  // collective InputError on a size mismatch
  const int world_rank = mesh.rank(), world_size = shape.size();
  const auto& coord = mesh.coord();

  // Everything that can fail on bad input is checked on every rank alike (collective).
  std::string err;
  std::unique_ptr<model::CostModel> cost;
  LlamaConfig mc;
  std::unique_ptr<TokenSource> tokens;
  std::vector<StrategyPair> strategies;
  cp::CommMode comm_mode = cp::CommMode::AllGather;
  Precision precision = Precision::Fp32;
  bool recompute = false;  // pipeline.recompute = "selective"
  pp::Schedule schedule;
  const std::int64_t M = data::microBatchesPerReplica(deck);
  const int layers = static_cast<int>(deck.model.layers);
  try {
    cost = std::make_unique<model::CostModel>(model::CostModel::fromDeck(deck));
    (void)LayerShape::fromDims(cost->dims(), shape.tp());  // the executor's shape rules (tp | kv_heads, ...)
    strategies = resolveStrategies(deck);
    comm_mode = cp::parseCommMode(deck.cp.comm);
    precision = parsePrecision(deck.run.precision);
    recompute = pp::executorRecomputesSelective(deck.pipeline.recompute);
    for (const auto& s : strategies) {
      (void)cp::parseStrategy(s.sharding);
      packing::checkPackerSchedule(deck, s.packer);
    }
    if (strategies.empty()) throw InputError("run.strategies resolves to no strategy");
    const pp::PipelineLayout layout = pp::pipelineLayout(deck);
    schedule = layout.schedule(static_cast<int>(M));  // the simulator's schedule, same function
    mc = LlamaConfig::fromDeck(deck, shape.tp(), coord.tp, shape.pp(), coord.pp, schedule.chunks);
    tokens = tokenSourceOf(deck);
    {  // every output path before the first step, not after the last
      namespace fs = std::filesystem;
      std::vector<std::pair<std::string, std::string>> outs;
      if (opt.write_outputs) {
        outs = {{"output.dir (summary.json)", (fs::path(deck.output.dir) / "summary.json").string()},
                {"output.trace", (fs::path(deck.output.dir) / deck.output.trace).string()}};
        for (const auto& s : strategies)
          outs.emplace_back("output.plan (" + s.name + ")", planPath(deck, s.name, strategies.size()));
      }
      if (!opt.gradients_dir.empty()) {  // the driver writes them after the run
        outs.emplace_back("--gradients (losses.json)", (fs::path(opt.gradients_dir) / "losses.json").string());
        for (const auto& s : strategies)
          outs.emplace_back("--gradients (" + s.name + ".npy)",
                            (fs::path(opt.gradients_dir) / (s.name + ".npy")).string());
      }
      const std::vector<std::string> inputs = model::deckInputFiles(deck);
      for (const auto& [what, path] : outs) checkOutputPath(path, what, inputs);
      checkDistinctOutputs(outs);
    }
  } catch (const InputError& e) {
    err = e.what();
  }
  parallel::throwIfAnyFailed(mesh.world(), err);
  const RunContext rc{deck, opt, shape, mesh, *cost, *tokens, comm_mode, M, layers, schedule};

  // Gradient all-reduce group: all ranks holding the same weights (same TP slice and
  // pipeline stage) = the DP x CP group.
  MPI_Comm dpcp_raw = MPI_COMM_NULL;
  MPI_Comm_split(mesh.world(), coord.tp + shape.tp() * coord.pp, world_rank, &dpcp_raw);
  parallel::Comm dpcp = parallel::Comm::adopt(dpcp_raw);
  // The collectives of the mesh groups (host-staged MPI or NCCL; collective choice).
  err.clear();
  parallel::CommBackend backend = parallel::CommBackend::Mpi;
  try {
    backend = parallel::resolveCommBackend(deck.run.comm_backend, mesh.world());
  } catch (const InputError& e) {
    err = e.what();
  }
  parallel::throwIfAnyFailed(mesh.world(), err);
  const auto cp_group = parallel::makeGroupComm(mesh.cp(), backend);
  const auto tp_group = parallel::makeGroupComm(mesh.tp(), backend);
  const auto dpcp_group = parallel::makeGroupComm(dpcp, backend);

  Space space;
  Llama model(mc, deck.data.seed, precision);
  trace::Recorder rec = trace::alignedRecorder(mesh.world(), {coord.tp, coord.cp, coord.pp, coord.dp});
  // A hint, capped: the counts allow 10^12 steps, which run (and stream) but cannot be reserved.
  const double events = static_cast<double>(steps + warmup) * static_cast<double>(M) *
                            static_cast<double>(static_cast<std::int64_t>(model.layerIds().size()) * 20 + 8) *
                            static_cast<double>(strategies.size()) +
                        64;
  rec.reserve(static_cast<std::size_t>(std::min(events, double{1 << 22})));

  // Rank 0's output folders (output.trace and output.plan may name subfolders): removed
  // again where empty if the run fails (out of memory, say) before its outputs are written.
  // Destroyed in reverse order, so the plan's subfolder goes before the trace's.
  // Also on SIGINT/SIGTERM (mpirun's, when another rank aborts): the driver's tracker.
  std::optional<MadeFolders> made_trace_dir, made_plan_dir;
  err.clear();
  if (opt.write_outputs && world_rank == 0) {
    const std::filesystem::path out(deck.output.dir);
    for (auto [made, f, key] : {std::tuple{&made_trace_dir, &deck.output.trace, "output.trace"},
                                {&made_plan_dir, &deck.output.plan, "output.plan"}}) {
      std::error_code ec;
      const auto dir = (out / *f).parent_path();
      made->emplace(dir, ec, opt.track_temporary);
      if (ec) {
        err = fmt::format("output.dir / {}: cannot create the folder {} ({})", key, dir.string(), ec.message());
        break;
      }
    }
  }
  parallel::throwIfAnyFailed(mesh.world(), err);
  std::unique_ptr<trace::Writer> writer;
  RunReport report;
  report.mesh = shape.describe();
  report.pipeline = std::string(pp::scheduleKindName(schedule.kind)) + ", " + std::to_string(schedule.stages) +
                    " stage(s), " + std::to_string(schedule.chunks) + " chunk(s), " + std::to_string(M) +
                    " micro-batch(es)";
  report.steps = steps;
  report.warmup = warmup;
  report.layers = layers;
  if (opt.write_outputs) {
    trace::RunMeta meta = measuredMeta(deck, shape, opt.command, "wlb::runtime::runDeck", precision, backend);
    meta.warmup = static_cast<int>(warmup);
    meta.extra.emplace_back("measured_steps", std::to_string(steps));  // drain steps follow them
    meta.extra.emplace_back("pipeline_schedule", pp::scheduleKindName(schedule.kind));
    meta.extra.emplace_back("pipeline_chunks", std::to_string(schedule.chunks));
    report.trace_path = (std::filesystem::path(deck.output.dir) / deck.output.trace).string();
    trace::WriterOptions wo;
    wo.track_temporary = opt.track_temporary;
    writer = std::make_unique<trace::Writer>(report.trace_path, meta, mesh.world(), wo);
  }

  if (opt.progress && world_rank == 0) {
    std::fprintf(opt.out, "wlb run: mesh %s, pipeline %s, %d layer(s), %lld step(s) + %lld warm-up, KV comm %s\n",
                 shape.describe().c_str(), report.pipeline.c_str(), layers, static_cast<long long>(steps),
                 static_cast<long long>(warmup), deck.cp.comm.c_str());
    std::fflush(opt.out);
  }

  LayerEnv env = LayerEnv::onMesh(space, mesh, *cost, &rec, precision, cp_group.get(), tp_group.get());
  attention::setHopperVariant(env.kernel, deck.run.attention);  // validated with the deck
  env.recompute_selective = recompute;
  OpTimer gemm_timer, kernel_timer;
  if (opt.gemm_timing) env.gemm_timer = &gemm_timer;
  std::optional<KernelHooks> kernel_hooks;
  if (opt.kernel_timing) kernel_hooks.emplace(kernel_timer);
  PipelineStage stage(env, model, schedule, mesh.pp());

  std::vector<StratState> states(strategies.size());
  // Plan files stay under their temporary names until the trace is committed; a run that
  // fails (a full disk, another rank's error) or is interrupted removes them.
  struct PartialPlans {
    std::vector<StratState>& states;
    const TemporaryTracker& track;
    bool done = false;
    ~PartialPlans() {
      for (const StratState& st : states) {
        if (st.plan_path.empty()) continue;
        if (track) track(st.plan_path + ".partial", false);
        if (!done) ::unlink((st.plan_path + ".partial").c_str());  // a file only: a folder of that name is the user's
      }
    }
  } partial_plans{states, opt.track_temporary};
  for (std::size_t si = 0; si < strategies.size(); ++si) {
    StratState& st = states[si];
    const StrategyPair& strat = strategies[si];
    st.strat = strat;
    rec.setStrategy(strat.name);  // register in deck order
    st.res.name = strat.name;
    st.res.packer = strat.packer;
    st.res.sharding = strat.sharding;
    st.res.comm = deck.cp.comm;
    // Rank 0 owns the length stream and the packer (one plan for everyone, broadcast).
    err.clear();
    if (world_rank == 0) {
      try {
        st.source = data::makeLengthSource(deck);
        st.packer = packing::makePacker(strat.packer, deck, *cost);
        if (opt.write_outputs) {
          // streamed under a temporary name (a killed run leaves no partial plan under the
          // final one; the next run's open truncates the same temporary) and renamed once the
          // trace is committed
          const std::string path = planPath(deck, strat.name, strategies.size());
          st.plan_path = path;  // partial_plans forgets and removes it whichever way the run ends
          // tracked before the open: a Ctrl-C in between would leave it behind
          if (opt.track_temporary) opt.track_temporary(path + ".partial", true);
          st.plan_out.open(path + ".partial");
          if (!st.plan_out) throw InputError("cannot write the plan file " + path + ".partial");
          report.plan_paths.push_back(path);
          {  // relative to output.dir, from absolute forms: an absolute output.plan beside a relative dir
            namespace fs = std::filesystem;
            const fs::path rel = fs::absolute(path).lexically_normal().lexically_relative(
                fs::absolute(deck.output.dir).lexically_normal());
            // outside it ("..": through a link, the folder's real parent), absolute
            const bool inside = !rel.empty() && *rel.begin() != "..";
            st.res.plan_file = inside ? rel.generic_string() : fs::absolute(path).lexically_normal().string();
          }
          packing::PlanHeader h;
          h.packer = strat.packer;
          h.dp = shape.dp();
          h.micro_batches = M;
          h.context_window = deck.data.context_window;
          h.s_max = data::resolvedSMax(deck);
          h.source = st.source->describe();
          h.documents_per_epoch = st.source->documentsPerEpoch();
          h.seed = deck.data.seed;
          auto hj = packing::toJson(h);
          hj["strategy"] = strat.name;
          hj["sharding"] = strat.sharding;
          st.plan_out << hj.dump() << "\n";
        }
      } catch (const InputError& e) {
        err = e.what();
      }
    }
    parallel::throwIfAnyFailed(mesh.world(), err);
  }

  const auto t_steps = std::chrono::steady_clock::now();
  const std::int64_t total_steps = (warmup + steps) * static_cast<std::int64_t>(states.size());
  std::int64_t done_steps = 0;
  // One step of one strategy on every rank: the five named parts above. `drain` steps get
  // no new documents (only what the packer still holds), so every strategy ends having
  // trained its whole stream.
  const auto runStep = [&](StratState& st, std::int64_t step, bool drain) {
    rec.setStrategy(st.strat.name);
    const PlannedStep ps = planStep(rc, st, step, drain);
    StageStepInput in = shardReplica(rc, ps.plan, static_cast<std::size_t>(coord.dp), st.strat.sharding, step);
    {
      // a dataset's bad token ids stop every rank together, before the step's collectives
      std::string terr;
      try {
        touchTokens(rc.tokens, in.mbs);
      } catch (const InputError& e) {
        terr = e.what();
      }
      parallel::throwIfAnyFailed(mesh.world(), terr);
    }
    const MergedComms merged_comms = connectMerged(mesh, ps.plan, in, backend);
    if (writer && world_rank == 0) {
      writer->addPlan(st.strat.name, ps.plan, ps.text, shardJson(rc, ps.plan, st.strat.sharding));
      if (st.plan_out) st.plan_out << ps.text << "\n";
    }
    const bool measured = step >= warmup && !drain;
    gemm_timer.setStrategy(st.strat.name);
    gemm_timer.setActive(opt.gemm_timing && measured);
    kernel_timer.setStrategy(st.strat.name);
    kernel_timer.setActive(opt.kernel_timing && measured);
    const std::vector<double> row = executeStep(rc, stage, model, *dpcp_group, rec, in, rc.slots(ps.plan));
    StepRecord sr = gatherStep(rc, row, ps, step, drain);
    rc.tokens.forget();
    if (opt.keep_gradients) st.res.gradients = gatherGradients(rc, model);
    if (world_rank != 0) return;
    if (!drain) ++done_steps;
    if (opt.progress) {
      // ETA over every strategy's remaining steps (they are interleaved). Steps are numbered
      // from 0 as in the plan and the trace; "(k of N)" counts the measured run.
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_steps).count();
      const double eta = el / static_cast<double>(done_steps) * static_cast<double>(total_steps - done_steps);
      char where[64];
      if (drain)
        std::snprintf(where, sizeof where, "(drain)");
      else
        std::snprintf(where, sizeof where, "(%lld of %lld)%s", static_cast<long long>(step) + 1,
                      static_cast<long long>(warmup) + steps, sr.warmup ? " (warm-up)" : "");
      char loss[32] = "-";
      if (std::isfinite(sr.loss)) std::snprintf(loss, sizeof loss, "%.4f", sr.loss);
      char bubble[32] = "";
      if (shape.pp() > 1) std::snprintf(bubble, sizeof bubble, "  bubble %.2f", sr.bubble);
      std::fprintf(opt.out,
                   "[%-5s] step %lld %s  %.3f s  tokens %lld  loss %s  mb-imbalance %.2f  cp-imbalance %.2f  "
                   "(predicted %.2f)%s  allocations %lld  ETA %.0f s\n",
                   st.strat.name.c_str(), static_cast<long long>(step), where, sr.seconds,
                   static_cast<long long>(sr.tokens), loss, sr.mb_imbalance, sr.cp_imbalance, sr.predicted_imbalance,
                   bubble, static_cast<long long>(sr.allocations), eta);
      std::fflush(opt.out);
    }
    st.res.steps.push_back(std::move(sr));
  };
  for (std::int64_t step = 0; step < warmup + steps; ++step)
    for (StratState& st : states) runStep(st, step, false);
  // Drain: rank 0 owns the packers and tells everyone which strategies still hold documents.
  std::vector<model::DrainWatch> drain_watch(states.size());
  for (std::int64_t step = warmup + steps;; ++step) {
    std::vector<int> hold(states.size(), 0);
    if (world_rank == 0)
      for (std::size_t i = 0; i < states.size(); ++i) hold[i] = states[i].packer->pendingTokens() > 0 ? 1 : 0;
    MPI_Bcast(hold.data(), static_cast<int>(hold.size()), MPI_INT, 0, mesh.world());
    if (std::none_of(hold.begin(), hold.end(), [](int h) { return h != 0; })) break;
    if (world_rank == 0)  // rank 0 alone throws: a packer bug, the driver's abort ends every rank
      for (std::size_t i = 0; i < states.size(); ++i)
        if (hold[i] && drain_watch[i].stalled(states[i].packer->pendingTokens()))
          throw std::logic_error("wlb run: " + states[i].strat.name + " still holds documents after " +
                                 std::to_string(model::kMaxDrainSteps) + " drain steps without progress");
    for (std::size_t i = 0; i < states.size(); ++i)
      if (hold[i]) runStep(states[i], step, true);
  }

  kernel_hooks.reset();
  if (opt.gemm_timing) report.gemms = gatherTimes(gemm_timer, mesh.world());
  if (opt.kernel_timing) report.kernels = gatherTimes(kernel_timer, mesh.world());

  if (world_rank == 0)
    for (StratState& st : states) {
      summarise(st.res, world_size);
      report.strategies.push_back(std::move(st.res));
    }

  // Throughput speedup against the first strategy, with its bootstrap interval over steps.
  if (world_rank == 0 && !report.strategies.empty()) {
    const auto& base = report.strategies.front();
    for (auto& r : report.strategies) {
      const auto sp = model::throughputSpeedup(base.work, r.work);
      r.speedup = sp.value;
      r.speedup_lo = sp.lo;
      r.speedup_hi = sp.hi;
      r.step_ratio = r.step_mean > 0 ? base.step_mean / r.step_mean : 0;
    }
  }

  if (writer) {
    if (world_rank == 0) {
      nlohmann::json peaks = nlohmann::json::object();
      for (const auto& r : report.strategies) peaks[r.name] = r.stage_peak_bytes;
      writer->addMeta("activation_peak_bytes", peaks.dump());
    }
    writer->commit(rec);
  }
  // the plans become final with the trace they belong to
  for (auto& st : states) {
    if (st.plan_path.empty()) continue;
    st.plan_out.close();
    if (!st.plan_out || std::rename((st.plan_path + ".partial").c_str(), st.plan_path.c_str()) != 0)
      throw InputError("cannot finish the plan file " + st.plan_path + " (write or rename failed)");
  }
  partial_plans.done = true;
  // The comparison, machine-readable, next to the trace (sweeps collect these).
  if (world_rank == 0 && opt.write_outputs) {
    report.summary_path = (std::filesystem::path(deck.output.dir) / "summary.json").string();
    const std::string tmp = report.summary_path + ".partial";
    std::ofstream f(tmp);
    f << toJson(report).dump(2) << "\n";
    f.close();
    if (!f || std::rename(tmp.c_str(), report.summary_path.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw InputError("cannot write " + report.summary_path + " (write or rename failed)");
    }
    for (auto* made : {&made_trace_dir, &made_plan_dir})
      if (*made) (*made)->keep();
  }
  return report;
}

nlohmann::json toJson(const RunReport& rep) {
  nlohmann::json st = nlohmann::json::array();
  for (const auto& s : rep.strategies) {
    st.push_back({{"strategy", s.name},
                  {"packer", s.packer},
                  {"sharding", s.sharding},
                  {"comm", s.comm},
                  {"drain_steps", s.drain_steps},
                  {"tokens", s.tokens},
                  {"tokens_per_second", s.tokens_per_second},
                  {"useful_flops_per_second", s.flops_per_second},
                  {"speedup", s.speedup},
                  {"speedup_interval", {s.speedup_lo, s.speedup_hi}},
                  {"step_seconds_mean", s.step_mean},
                  {"step_seconds_min", s.step_min},
                  {"step_seconds_median", s.step_median},
                  {"step_time_ratio", s.step_ratio},
                  {"cp_imbalance", s.cp_imbalance},
                  {"mb_imbalance", s.mb_imbalance},
                  {"predicted_imbalance", s.predicted_imbalance},
                  {"bubble_fraction", s.bubble},
                  {"unrecorded_fraction", s.unrecorded},
                  {"allocations_per_step", s.allocations},
                  {"stage_peak_activation_bytes", s.stage_peak_bytes},
                  {"stage_pool_bytes", s.stage_pool_bytes},
                  {"stage_pool_live_bytes", s.stage_live_bytes},
                  {"stage_pool_requested_bytes", s.stage_asked_bytes}});
    // the plan file of this run: `wlb simulate --plans` takes these, not older files beside them
    if (!s.plan_file.empty()) st.back()["plan"] = s.plan_file;
  }
  nlohmann::json j = {{"format", "wlb-run-summary"},
                      {"version", 1},
                      {"mesh", rep.mesh},
                      {"pipeline", rep.pipeline},
                      {"steps", rep.steps},
                      {"warmup", rep.warmup},
                      {"layers", rep.layers},
                      {"baseline", rep.strategies.empty() ? "" : rep.strategies.front().name},
                      {"trace", rep.trace_path},
                      {"strategies", st}};
  if (!rep.gemms.empty()) {
    nlohmann::json g = nlohmann::json::array();
    for (const auto& r : rep.gemms)
      g.push_back({{"strategy", r.strategy},
                   {"gemm", r.name},
                   {"calls", r.calls},
                   {"seconds", r.seconds},
                   {"flops", r.flops},
                   {"flops_per_second", r.seconds > 0 ? r.flops / r.seconds : 0.0}});
    j["gemm_timing"] = g;
  }
  if (!rep.kernels.empty()) {
    nlohmann::json k = nlohmann::json::array();
    for (const auto& r : rep.kernels)
      k.push_back({{"strategy", r.strategy}, {"kernel", r.name}, {"calls", r.calls}, {"seconds", r.seconds}});
    j["kernel_timing"] = k;
  }
  return j;
}

std::string formatReport(const RunReport& rep) {
  std::ostringstream os;
  char buf[512];
  if (rep.strategies.empty()) return "";
  std::snprintf(buf, sizeof buf,
                "\nMeasured over %lld step(s) after %lld warm-up, mesh %s, %lld layer(s); times per step, "
                "mean over steps\n",
                static_cast<long long>(rep.steps), static_cast<long long>(rep.warmup), rep.mesh.c_str(),
                static_cast<long long>(rep.layers));
  os << buf;
  std::snprintf(buf, sizeof buf, "%-8s %-28s %9s %9s %8s %15s %9s %9s %7s %7s %7s %8s %5s\n", "strategy",
                "packer+sharding", "ktok/s", "GFLOP/s", "speedup", "[95% interval]", "step[s]", "min[s]", "step-x",
                "cp-imb", "mb-imb", "pred-imb", "drain");
  os << buf;
  for (const auto& s : rep.strategies) {
    const std::string ps = s.packer + "+" + s.sharding;
    char iv[64];
    std::snprintf(iv, sizeof iv, "[%.3f-%.3f]", s.speedup_lo, s.speedup_hi);
    std::snprintf(buf, sizeof buf, "%-8s %-28s %9.2f %9.2f %7.3fx %15s %9.3f %9.3f %6.2fx %7.2f %7.2f %8.2f %5lld\n",
                  s.name.c_str(), ps.c_str(), s.tokens_per_second / 1e3, s.flops_per_second / 1e9, s.speedup, iv,
                  s.step_mean, s.step_min, s.step_ratio, s.cp_imbalance, s.mb_imbalance, s.predicted_imbalance,
                  static_cast<long long>(s.drain_steps));
    os << buf;
  }
  os << "speedup = throughput (trained tokens/s) over " << rep.strategies.front().name
     << ", 95% paired bootstrap interval over steps; drain = steps run after the measured ones, with no new documents, "
        "until nothing is held (their time and tokens count), so every strategy trains its whole stream; GFLOP/s = "
        "useful FLOPs of the model run (causal attention + linear layers and LM head, fwd+bwd); step-x = step-time "
        "ratio (flatters deferral)\n";
  os << "\nPer-rank time per step [s]: busy = compute (GEMMs, attention, norms, head), comm = KV/TP/gradient "
        "communication incl. waiting for peers; unrecorded = share of the step outside every recorded region, "
        "mean over ranks; buffer allocations = blocks the ranks' activation pools had to allocate (runtime/pool.hpp)\n";
  for (const auto& s : rep.strategies) {
    std::snprintf(buf, sizeof buf, "  %s (unrecorded %.1f%%, %.1f buffer allocations per step):", s.name.c_str(),
                  100.0 * s.unrecorded, s.allocations);
    os << buf;
    for (std::size_t r = 0; r < s.rank_busy.size(); ++r) {
      std::snprintf(buf, sizeof buf, "  r%zu busy %.3f (attn %.3f) comm %.3f", r, s.rank_busy[r], s.rank_attn[r],
                    s.rank_comm[r]);
      os << buf;
    }
    os << "\n";
  }
  os << "\nPipeline " << rep.pipeline
     << ": bubble = 1 - task time / (ranks x pipeline span), mean over steps; peak = activations kept from "
        "forward to backward, max over the stage's ranks and steps; pool = bytes the stage's activation pool held "
        "after the strategy's steps, its free blocks included (one pool per stage, shared by the strategies); in use = "
        "the most of the pool's bytes in use at once in a step, asked = what the buffers alive then asked for "
        "(rows asked, not the blocks' rows)\n";
  for (const auto& s : rep.strategies) {
    std::snprintf(buf, sizeof buf, "  %-8s bubble %.3f  peak [MiB]", s.name.c_str(), s.bubble);
    os << buf;
    for (std::size_t p = 0; p < s.stage_peak_bytes.size(); ++p) {
      std::snprintf(buf, sizeof buf, "  stage %zu %.2f", p, s.stage_peak_bytes[p] / (1024.0 * 1024.0));
      os << buf;
    }
    os << "  pool / in use / asked [MiB]";
    for (std::size_t p = 0; p < s.stage_pool_bytes.size(); ++p) {
      std::snprintf(buf, sizeof buf, "  stage %zu %.2f / %.2f / %.2f", p, s.stage_pool_bytes[p] / (1024.0 * 1024.0),
                    s.stage_live_bytes[p] / (1024.0 * 1024.0), s.stage_asked_bytes[p] / (1024.0 * 1024.0));
      os << buf;
    }
    os << "\n";
  }
  if (!rep.gemms.empty()) {
    os << "\nGEMMs timed one by one (--gemm-timing; fenced before and after, so these steps are not a throughput "
          "figure): measured steps, summed over ranks\n";
    double all_s = 0, all_f = 0;
    const auto total = [&] {  // a strategy's last row: all its products
      std::snprintf(buf, sizeof buf, "    %-18s %8s %10.3f %10s %10.2f\n", "all", "", 1e3 * all_s, "",
                    all_s > 0 ? all_f / all_s / 1e12 : 0.0);
      os << buf;
    };
    std::string last;
    for (const auto& g : rep.gemms) {
      if (g.strategy != last) {
        if (!last.empty()) total();
        std::snprintf(buf, sizeof buf, "  %s\n    %-18s %8s %10s %10s %10s\n", g.strategy.c_str(), "gemm", "calls",
                      "ms", "ms/call", "TFLOP/s");
        os << buf;
        last = g.strategy;
        all_s = all_f = 0;
      }
      all_s += g.seconds;
      all_f += g.flops;
      std::snprintf(buf, sizeof buf, "    %-18s %8lld %10.3f %10.4f %10.2f\n", g.name.c_str(),
                    static_cast<long long>(g.calls), 1e3 * g.seconds,
                    g.calls > 0 ? 1e3 * g.seconds / static_cast<double>(g.calls) : 0.0,
                    g.seconds > 0 ? g.flops / g.seconds / 1e12 : 0.0);
      os << buf;
    }
    total();
  }
  if (!rep.kernels.empty()) {
    os << "\nKokkos kernels and deep copies timed one by one (--kernel-timing; fenced before and after, so these "
          "steps are not a throughput figure; not in it: cuBLAS products, raw Hopper attention launches, "
          "communication): measured steps, summed over ranks, longest first\n";
    std::vector<std::string> order;  // strategies in first-row order
    for (const auto& k : rep.kernels)
      if (std::find(order.begin(), order.end(), k.strategy) == order.end()) order.push_back(k.strategy);
    for (const auto& strategy : order) {
      std::vector<const OpTimer::Row*> rows;
      double all = 0;
      for (const auto& k : rep.kernels)
        if (k.strategy == strategy) {
          rows.push_back(&k);
          all += k.seconds;
        }
      std::stable_sort(rows.begin(), rows.end(), [](const auto* a, const auto* b) { return a->seconds > b->seconds; });
      std::snprintf(buf, sizeof buf, "  %s\n    %-52s %8s %10s %10s %7s\n", strategy.c_str(), "kernel", "calls", "ms",
                    "ms/call", "share");
      os << buf;
      for (const auto* k : rows) {
        std::snprintf(buf, sizeof buf, "    %-52s %8lld %10.3f %10.4f %6.1f%%\n", k->name.c_str(),
                      static_cast<long long>(k->calls), 1e3 * k->seconds,
                      k->calls > 0 ? 1e3 * k->seconds / static_cast<double>(k->calls) : 0.0,
                      all > 0 ? 100.0 * k->seconds / all : 0.0);
        os << buf;
      }
      std::snprintf(buf, sizeof buf, "    %-52s %8s %10.3f\n", "all", "", 1e3 * all);
      os << buf;
    }
  }
  if (!rep.trace_path.empty()) os << "\ntrace: " << rep.trace_path << "\n";
  for (const auto& p : rep.plan_paths) os << "plan:  " << p << "\n";
  if (!rep.summary_path.empty()) os << "summary: " << rep.summary_path << "\n";
  return os.str();
}

}  // namespace wlb::runtime
