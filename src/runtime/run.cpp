/// \file run.cpp
/// \brief The measured step executor (see run.hpp, docs/runtime.md).

#include "runtime/run.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "cp/shard_plan.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "model/throughput.hpp"
#include "packing/packer.hpp"
#include "packing/plan_io.hpp"
#include "parallel/comm.hpp"
#include "parallel/mesh.hpp"
#include "runtime/layer.hpp"
#include "trace/recorder.hpp"
#include "trace/writer.hpp"

namespace wlb::runtime {
namespace {

namespace labels = trace::labels;

constexpr double kNs = 1e-9;
// Labels counted as compute (busy) and as communication (incl. waiting for peers).
bool isCompute(const std::string& l) {
  return l == labels::kEmbed || l == labels::kQkvProj || l == labels::kAttn || l == labels::kOutProj ||
         l == labels::kMlp || l == labels::kLoss || l == labels::kNorm || l == labels::kOptimizer;
}
bool isComm(const std::string& l) {
  return l == labels::kKvAllgather || l == labels::kKvExchange || l == labels::kTpAllreduce ||
         l == labels::kGradAllreduce || l == labels::kPpSend || l == labels::kPpRecv;
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

void bcastString(std::string& s, MPI_Comm comm) {
  long long len = static_cast<long long>(s.size());
  MPI_Bcast(&len, 1, MPI_LONG_LONG, 0, comm);
  s.resize(static_cast<std::size_t>(len));
  if (len > 0) MPI_Bcast(s.data(), static_cast<int>(len), MPI_CHAR, 0, comm);
}

std::string planPath(const Deck& deck, const std::string& strategy, std::size_t nstrategies) {
  std::filesystem::path p = std::filesystem::path(deck.output.dir) / deck.output.plan;
  if (nstrategies > 1) {
    const std::string ext = p.extension().string();
    p.replace_filename(p.stem().string() + "." + strategy + ext);
  }
  return p.string();
}

// Per-rank, per-step measurements shipped to rank 0: [step s, busy s, comm s, attn s,
// then per micro-batch m: attention s, latency s, local tokens].
constexpr int kHead = 4, kPerMb = 3;

}  // namespace

RunReport runDeck(const Deck& deck_in, const RunOptions& opt) {
  Deck deck = deck_in;
  if (opt.steps >= 0) deck.run.steps = opt.steps;
  if (opt.warmup >= 0) deck.run.warmup = opt.warmup;
  const std::int64_t steps = deck.run.steps, warmup = deck.run.warmup;
  if (steps < 1) throw InputError("run.steps (--steps) must be >= 1", true);
  if (warmup < 0) throw InputError("run.warmup (--warmup) must be >= 0", true);

  const auto shape = parallel::MeshShape::fromDeck(deck.mesh);
  parallel::Mesh mesh(shape, MPI_COMM_WORLD);  // collective InputError on a size mismatch
  if (shape.pp() > 1)
    throw InputError("wlb run: mesh.pp = " + std::to_string(shape.pp()) +
                         " is not supported by the measured executor (it runs pp = 1: TP x CP x DP); "
                         "use `wlb simulate` for pipelines or set mesh.pp = 1",
                     true);
  const int world_rank = mesh.rank(), world_size = shape.size();
  const auto& coord = mesh.coord();

  // Everything that can fail on bad input is checked on every rank alike (collective).
  std::string err;
  std::unique_ptr<model::CostModel> cost;
  LayerShape lshape;
  std::vector<StrategyPair> strategies;
  cp::CommMode comm_mode = cp::CommMode::AllGather;
  try {
    cost = std::make_unique<model::CostModel>(model::CostModel::fromDeck(deck));
    lshape = LayerShape::fromDims(cost->dims(), shape.tp());
    strategies = resolveStrategies(deck);
    comm_mode = cp::parseCommMode(deck.cp.comm);
    for (const auto& s : strategies) (void)cp::parseStrategy(s.sharding);
    if (strategies.empty()) throw InputError("run.strategies resolves to no strategy");
  } catch (const InputError& e) {
    err = e.what();
  }
  parallel::throwIfAnyFailed(mesh.world(), err);

  const std::int64_t M = data::microBatchesPerReplica(deck);
  const int layers = static_cast<int>(deck.model.layers);

  // Gradient all-reduce group: all ranks holding the same weights (same TP slice and
  // pipeline stage) = the DP x CP group.
  MPI_Comm dpcp_raw = MPI_COMM_NULL;
  MPI_Comm_split(mesh.world(), coord.tp + shape.tp() * coord.pp, world_rank, &dpcp_raw);
  parallel::Comm dpcp = parallel::Comm::adopt(dpcp_raw);

  Space space;
  Model model(lshape, layers, deck.data.seed, coord.tp);
  trace::Recorder rec(mesh.world(), {coord.tp, coord.cp, coord.pp, coord.dp});
  rec.reserve(static_cast<std::size_t>((steps + warmup) * M * layers * 16 * strategies.size() + 64));

  if (opt.write_outputs && world_rank == 0) std::filesystem::create_directories(deck.output.dir);
  std::unique_ptr<trace::Writer> writer;
  RunReport report;
  report.mesh = shape.describe();
  report.steps = steps;
  report.warmup = warmup;
  report.layers = layers;
  if (opt.write_outputs) {
    trace::RunMeta meta;
    meta.source = "measured";
    meta.deck_toml = deck.toToml();
    meta.command = opt.command;
    meta.tp = shape.tp();
    meta.cp = shape.cp();
    meta.pp = shape.pp();
    meta.dp = shape.dp();
    meta.warmup = static_cast<int>(warmup);
    meta.extra.emplace_back("measured_steps", std::to_string(steps));  // drain steps follow them
    meta.extra.emplace_back("executor", "wlb::runtime::runDeck");
    meta.extra.emplace_back("gemm", gemmBackend());
    report.trace_path = (std::filesystem::path(deck.output.dir) / deck.output.trace).string();
    writer = std::make_unique<trace::Writer>(report.trace_path, meta, mesh.world());
  }

  if (opt.progress && world_rank == 0) {
    std::fprintf(
        opt.out,
        "wlb run: mesh %s, %lld micro-batch(es) per replica, %d layer(s), %lld step(s) + %lld warm-up, KV comm %s\n",
        shape.describe().c_str(), static_cast<long long>(M), layers, static_cast<long long>(steps),
        static_cast<long long>(warmup), deck.cp.comm.c_str());
    std::fflush(opt.out);
  }

  LayerEnv env;
  env.space = &space;
  env.cp_comm = mesh.cp();
  env.tp_comm = mesh.tp();
  env.tp = shape.tp();
  env.cost = cost.get();
  env.recorder = &rec;

  const int nrow = kHead + kPerMb * static_cast<int>(M);
  // Per-strategy state. Strategies are interleaved step by step (step 0 of every
  // strategy, then step 1, ...), so slow drifts of the machine's load affect them alike.
  struct StratState {
    StrategyPair strat;
    std::unique_ptr<data::LengthSource> source;  // rank 0 only
    std::unique_ptr<packing::Packer> packer;     // rank 0 only
    std::ofstream plan_out;
    std::string plan_path;  ///< final name; plan_out writes plan_path + ".partial" until commit
    StrategyResult res;
  };
  std::vector<StratState> states(strategies.size());
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
          st.plan_path = path;
          st.plan_out.open(path + ".partial");
          if (!st.plan_out) throw InputError("cannot write the plan file " + path + ".partial");
          report.plan_paths.push_back(path);
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
  // One step of one strategy on every rank; `drain` steps get no new documents (only what
  // the packer still holds), so every strategy ends having trained its whole stream.
  const auto runStep = [&](StratState& st, std::int64_t step, bool drain) {
    {
      const StrategyPair& strat = st.strat;
      auto& source = st.source;
      auto& packer = st.packer;
      auto& plan_out = st.plan_out;
      StrategyResult& res = st.res;
      rec.setStrategy(strat.name);
      // ---- plan (rank 0) and broadcast -------------------------------------------------
      std::string plan_text;
      double predicted = 1;
      err.clear();
      if (world_rank == 0) {
        try {
          const auto docs = drain ? std::vector<Document>{} : source->next(step);
          const StepPlan plan = packer->pack(step, docs);
          const auto metrics = packing::computeMetrics(plan, *cost);
          predicted = metrics.imbalance;
          plan_text = packing::stepToJson(plan, metrics, static_cast<std::int64_t>(docs.size())).dump();
        } catch (const std::exception& e) {
          err = std::string("planning step ") + std::to_string(step) + " (" + strat.name + "): " + e.what();
        }
      }
      parallel::throwIfAnyFailed(mesh.world(), err);
      bcastString(plan_text, mesh.world());
      const StepPlan plan = packing::stepFromJson(nlohmann::json::parse(plan_text));
      if (static_cast<int>(plan.replicas.size()) != shape.dp())
        throw std::logic_error("wlb run: packer returned " + std::to_string(plan.replicas.size()) +
                               " replicas for dp=" + std::to_string(shape.dp()));
      std::int64_t step_tokens = 0;
      for (const auto& rep : plan.replicas)
        for (const auto& mb : rep) step_tokens += mb.tokens();

      // ---- CP shard plans of this rank's replica (deterministic on every rank) -------
      const auto& mine = plan.replicas[static_cast<std::size_t>(coord.dp)];
      std::vector<cp::ShardPlan> shards(mine.size());
      std::vector<cp::CommPlan> comms(mine.size());
      for (std::size_t m = 0; m < mine.size(); ++m) {
        if (mine[m].tokens() == 0) continue;
        shards[m] = cp::planShards(mine[m], strat.sharding, shape.cp(), *cost, deck.cp);
        comms[m] = cp::planComm(shards[m], comm_mode, *cost);
      }
      if (writer && world_rank == 0) {
        nlohmann::json sj = nlohmann::json::array();
        for (std::size_t d = 0; d < plan.replicas.size(); ++d)
          for (std::size_t m = 0; m < plan.replicas[d].size(); ++m) {
            const MicroBatch& mb = plan.replicas[d][m];
            if (mb.tokens() == 0) continue;
            const cp::ShardPlan sp = d == static_cast<std::size_t>(coord.dp)
                                         ? shards[m]
                                         : cp::planShards(mb, strat.sharding, shape.cp(), *cost, deck.cp);
            const cp::CommPlan cpl = cp::planComm(sp, comm_mode, *cost);
            sj.push_back({{"dp", d},
                          {"micro_batch", m},
                          {"shard", cp::toJson(sp)},
                          {"metrics", cp::toJson(cp::computeMetrics(sp, cpl, *cost))}});
          }
        writer->addPlan(strat.name, plan, plan_text, sj.dump());
        if (plan_out) plan_out << plan_text << "\n";
      }

      // ---- execute ---------------------------------------------------------------------
      std::vector<double> row(static_cast<std::size_t>(nrow), 0.0);
      const std::size_t first_event = rec.events().size();
      mesh.world().barrier();
      const std::int64_t t0 = rec.now();
      model.zeroGrads(space);
      for (std::size_t m = 0; m < mine.size(); ++m) {
        if (mine[m].tokens() == 0) continue;  // the whole CP group skips it alike
        const std::int64_t tm0 = rec.now();
        rec.setContext({static_cast<int>(step), static_cast<int>(m), trace::Phase::Fwd, -1});
        std::vector<std::unique_ptr<LayerStep>> ls;
        ls.reserve(static_cast<std::size_t>(layers));
        const std::int64_t n = shards[m].ranks[static_cast<std::size_t>(coord.cp)].tokens;
        Mat x = Mat(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::x"), n, lshape.hidden);
        {
          trace::Recorder::Scope s(rec, labels::kEmbed, space);
          fillRandom(space, x, deck.data.seed, static_cast<std::uint64_t>(step * 1000 + m) * 4 + coord.cp, 1.0f);
        }
        for (int l = 0; l < layers; ++l) {
          rec.context().layer = l;
          ls.push_back(std::make_unique<LayerStep>(env, model, l, shards[m], comms[m]));
          x = ls.back()->forward(x);
        }
        rec.setContext({static_cast<int>(step), static_cast<int>(m), trace::Phase::Bwd, -1});
        Mat dy = Mat(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::dy"), n, lshape.hidden);
        {
          trace::Recorder::Scope s(rec, labels::kLoss, space);
          fillRandom(space, dy, deck.data.seed + 1, static_cast<std::uint64_t>(step * 1000 + m) * 4 + coord.cp, 1e-2f);
        }
        for (int l = layers - 1; l >= 0; --l) {
          rec.context().layer = l;
          dy = ls[static_cast<std::size_t>(l)]->backward(dy);
          row[kHead + kPerMb * m] += ls[static_cast<std::size_t>(l)]->attnSeconds();
        }
        kk::fence(space, "wlb::runtime::micro_batch");
        row[kHead + kPerMb * m + 1] = static_cast<double>(rec.now() - tm0) * kNs;
        row[kHead + kPerMb * m + 2] = static_cast<double>(n);
      }
      // DP x CP gradient all-reduce (one buffer: every layer's weight gradients).
      rec.setContext({static_cast<int>(step), -1, trace::Phase::Bwd, -1});
      if (dpcp.size() > 1) {
        auto g = model.gradBuffer();
        trace::Recorder::Scope s(rec, labels::kGradAllreduce, space, 0, 4.0 * static_cast<double>(g.size()));
        auto h = Kokkos::create_mirror_view(g);
        Kokkos::deep_copy(h, g);
        kk::fence(space, "wlb::runtime::grad_allreduce");
        MPI_Allreduce(MPI_IN_PLACE, h.data(), static_cast<int>(h.size()), MPI_FLOAT, MPI_SUM, dpcp);
        Kokkos::deep_copy(g, h);
      }
      kk::fence(space, "wlb::runtime::step");
      const std::int64_t t1 = rec.now();
      rec.setContext({static_cast<int>(step), -1, trace::Phase::None, -1});
      rec.record(rec.region(labels::kStep), t0, t1);

      row[0] = static_cast<double>(t1 - t0) * kNs;
      const auto& evs = rec.events();
      for (std::size_t i = first_event; i < evs.size(); ++i) {
        const std::string& l = rec.regions()[static_cast<std::size_t>(evs[i].region)];
        const double d = static_cast<double>(evs[i].end_ns - evs[i].start_ns) * kNs;
        if (isCompute(l)) row[1] += d;
        if (isComm(l)) row[2] += d;
        if (l == labels::kAttn) row[3] += d;
      }

      // ---- gather and summarise (rank 0) ----------------------------------------------
      std::vector<double> all(world_rank == 0 ? static_cast<std::size_t>(nrow) * world_size : 0);
      MPI_Gather(row.data(), nrow, MPI_DOUBLE, all.data(), nrow, MPI_DOUBLE, 0, mesh.world());
      if (world_rank == 0) {
        StepRecord sr;
        sr.step = step;
        sr.warmup = step < warmup;
        sr.drain = drain;
        sr.tokens = step_tokens;
        sr.flops = model::usefulFlops(plan, *cost, layers);
        sr.predicted_imbalance = predicted;
        auto at = [&](int r, int k) { return all[static_cast<std::size_t>(r) * nrow + k]; };
        for (int r = 0; r < world_size; ++r) {
          sr.seconds = std::max(sr.seconds, at(r, 0));
          sr.rank_busy.push_back(at(r, 1));
          sr.rank_comm.push_back(at(r, 2));
          sr.rank_attn.push_back(at(r, 3));
        }
        std::vector<double> latencies;
        std::vector<double> cp_imb;
        for (int d = 0; d < shape.dp(); ++d)
          for (std::int64_t m = 0; m < M; ++m) {
            double lat = 0, toks = 0;
            std::vector<double> attn_cp;
            for (int c = 0; c < shape.cp(); ++c) {
              for (int t = 0; t < shape.tp(); ++t) {
                const int r = shape.rankOf({t, c, 0, d});
                lat = std::max(lat, at(r, kHead + kPerMb * static_cast<int>(m) + 1));
                if (t == 0) {
                  attn_cp.push_back(at(r, kHead + kPerMb * static_cast<int>(m)));
                  toks += at(r, kHead + kPerMb * static_cast<int>(m) + 2);
                }
              }
            }
            latencies.push_back(lat);
            if (toks > 0) cp_imb.push_back(maxOverMean(attn_cp));
          }
        sr.mb_imbalance = maxOverMean(latencies);
        sr.cp_imbalance = cp_imb.empty()
                              ? 1.0
                              : std::accumulate(cp_imb.begin(), cp_imb.end(), 0.0) / static_cast<double>(cp_imb.size());
        if (!drain) ++done_steps;
        if (opt.progress) {
          // ETA over every strategy's remaining steps (they are interleaved)
          const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_steps).count();
          const double eta = el / static_cast<double>(done_steps) * static_cast<double>(total_steps - done_steps);
          std::fprintf(opt.out,
                       "[%-5s] step %lld/%lld%s  %.3f s  tokens %lld  mb-imbalance %.2f  cp-imbalance %.2f  "
                       "(predicted %.2f)  ETA %.0f s\n",
                       strat.name.c_str(), static_cast<long long>(step + 1), static_cast<long long>(warmup + steps),
                       sr.warmup ? " (warm-up)"
                       : drain   ? " (drain)"
                                 : "",
                       sr.seconds, static_cast<long long>(sr.tokens), sr.mb_imbalance, sr.cp_imbalance,
                       sr.predicted_imbalance, eta);
          std::fflush(opt.out);
        }
        res.steps.push_back(std::move(sr));
      }
    }
  };
  for (std::int64_t step = 0; step < warmup + steps; ++step)
    for (StratState& st : states) runStep(st, step, false);
  // Drain: rank 0 owns the packers and tells everyone which strategies still hold documents.
  std::int64_t drained = 0;
  for (std::int64_t step = warmup + steps;; ++step) {
    std::vector<int> hold(states.size(), 0);
    if (world_rank == 0)
      for (std::size_t i = 0; i < states.size(); ++i) hold[i] = states[i].packer->pendingTokens() > 0 ? 1 : 0;
    MPI_Bcast(hold.data(), static_cast<int>(hold.size()), MPI_INT, 0, mesh.world());
    if (std::none_of(hold.begin(), hold.end(), [](int h) { return h != 0; })) break;
    if (++drained > model::kMaxDrainSteps)
      throw std::logic_error("wlb run: a packer still holds documents after " + std::to_string(model::kMaxDrainSteps) +
                             " drain steps");
    for (std::size_t i = 0; i < states.size(); ++i)
      if (hold[i]) runStep(states[i], step, true);
  }

  for (StratState& st : states) {
    StrategyResult& res = st.res;
    if (world_rank == 0) {
      std::vector<double> times;
      double tok = 0, cpi = 0, mbi = 0, pri = 0;
      res.rank_busy.assign(static_cast<std::size_t>(world_size), 0.0);
      res.rank_comm = res.rank_attn = res.rank_busy;
      std::vector<model::StepWork> work;
      for (const auto& s : res.steps) {
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
      for (auto* v : {&res.rank_busy, &res.rank_comm, &res.rank_attn})
        for (auto& x : *v) x /= n;
      report.strategies.push_back(std::move(res));
    }
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

  if (writer) writer->commit(rec);
  // the plans become final with the trace they belong to
  for (auto& st : states) {
    if (st.plan_path.empty()) continue;
    st.plan_out.close();
    if (!st.plan_out || std::rename((st.plan_path + ".partial").c_str(), st.plan_path.c_str()) != 0)
      throw InputError("cannot finish the plan file " + st.plan_path + " (write or rename failed)");
  }
  // The comparison, machine-readable, next to the trace (sweeps collect these).
  if (world_rank == 0 && opt.write_outputs) {
    report.summary_path = (std::filesystem::path(deck.output.dir) / "summary.json").string();
    const std::string tmp = report.summary_path + ".partial";
    std::ofstream f(tmp);
    f << toJson(report).dump(2) << "\n";
    f.close();
    if (!f || std::rename(tmp.c_str(), report.summary_path.c_str()) != 0)
      throw InputError("cannot write " + report.summary_path + " (write or rename failed)");
  }
  return report;
}

nlohmann::json toJson(const RunReport& rep) {
  nlohmann::json st = nlohmann::json::array();
  for (const auto& s : rep.strategies)
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
                  {"predicted_imbalance", s.predicted_imbalance}});
  return {{"format", "wlb-run-summary"},
          {"version", 1},
          {"mesh", rep.mesh},
          {"steps", rep.steps},
          {"warmup", rep.warmup},
          {"layers", rep.layers},
          {"baseline", rep.strategies.empty() ? "" : rep.strategies.front().name},
          {"trace", rep.trace_path},
          {"strategies", st}};
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
        "useful FLOPs of the layers run (causal attention + linear, fwd+bwd); step-x = step-time ratio (flatters "
        "deferral)\n";
  os << "\nPer-rank time per step [s]: busy = compute (GEMMs, attention), comm = KV/TP/gradient "
        "communication incl. waiting for peers\n";
  for (const auto& s : rep.strategies) {
    os << "  " << s.name << ":";
    for (std::size_t r = 0; r < s.rank_busy.size(); ++r) {
      std::snprintf(buf, sizeof buf, "  r%zu busy %.3f (attn %.3f) comm %.3f", r, s.rank_busy[r], s.rank_attn[r],
                    s.rank_comm[r]);
      os << buf;
    }
    os << "\n";
  }
  if (!rep.trace_path.empty()) os << "\ntrace: " << rep.trace_path << "\n";
  for (const auto& p : rep.plan_paths) os << "plan:  " << p << "\n";
  if (!rep.summary_path.empty()) os << "summary: " << rep.summary_path << "\n";
  return os.str();
}

}  // namespace wlb::runtime
