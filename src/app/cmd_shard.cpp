// `wlb shard DECK`: pack --steps steps with the deck's packer, CP-shard every micro-batch
// with the deck's [cp] strategy/comm (the "chosen" sharding) and with every compared
// strategy x comm mode on the same micro-batches; print a comparison table and write
// JSONL (docs/cp.md). Every MPI rank computes the same plans; only rank 0 prints and
// writes (temporary file + rename; nothing written on error).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "core/output_file.hpp"
#include "core/progress.hpp"
#include "cp/shard_plan.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"
#include "pp/simulator.hpp"

namespace {

struct Opts {
  wlb::app::DeckArgs deck;
  std::int64_t steps = -1;
  std::string out;
  std::string packer;
  std::vector<std::string> strategies;
  std::vector<std::string> comms;
  bool metrics_only = false;
  bool comm_plans = false;
};

using Clock = std::chrono::steady_clock;
double microseconds(Clock::time_point since) {
  return std::chrono::duration<double, std::micro>(Clock::now() - since).count();
}

/// Running aggregate of one (strategy, comm) row over all micro-batches.
struct Row {
  Row(std::string s, std::string c) : strategy(std::move(s)), comm(std::move(c)) {}
  std::string strategy, comm;
  std::int64_t n = 0;
  double imb_attn_sum = 0, imb_attn_max = 0, imb_lat_sum = 0;
  double bytes = 0, bytes_max_rank = 0;
  double latency = 0, attn_seconds = 0;         ///< sums over micro-batches of the max-rank value
  double plan_us = 0, plan_us_max = 0;          ///< planShards + planComm wall per micro-batch
  std::map<std::string, std::int64_t> applied;  ///< adaptive: which sharding it picked
  void add(const wlb::cp::ShardMetrics& m, double us) {
    ++n;
    plan_us += us;
    plan_us_max = std::max(plan_us_max, us);
    imb_attn_sum += m.imbalance_attn;
    imb_attn_max = std::max(imb_attn_max, m.imbalance_attn);
    imb_lat_sum += m.imbalance_latency;
    bytes += m.kv_bytes_total;
    bytes_max_rank = std::max(bytes_max_rank, m.kv_bytes_max);
    latency += m.max_latency;
    attn_seconds += m.max_attn_seconds;
    ++applied[m.strategy];
  }
  nlohmann::json toJson() const {
    const double d = n > 0 ? static_cast<double>(n) : 1.0;
    return {{"strategy", strategy},
            {"comm", comm},
            {"micro_batches", n},
            {"imbalance_attn_mean", imb_attn_sum / d},
            {"imbalance_attn_max", imb_attn_max},
            {"imbalance_latency_mean", imb_lat_sum / d},
            {"kv_bytes_total", bytes},
            {"kv_bytes_max_rank", bytes_max_rank},
            {"max_latency_sum", latency},
            {"max_attn_seconds_sum", attn_seconds},
            {"plan_us_mean", plan_us / d},
            {"plan_us_max", plan_us_max},
            {"applied", applied}};
  }
};

int runShard(const Opts& o) {
  using namespace wlb;
  const bool root = app::worldRank() == 0;
  const Deck deck = o.deck.load("wlb shard");
  const std::int64_t steps = o.steps >= 0 ? o.steps : deck.run.steps;
  if (steps < 1) throw InputError("--steps: must be >= 1", true);
  const int cp = static_cast<int>(deck.mesh.cp);
  if (cp < 1) throw InputError("mesh.cp: must be >= 1", true);
  // the profile and the length file are read on every rank: one that cannot must not fail alone
  std::unique_ptr<data::LengthSource> src;
  const model::CostModel cost = app::readOnEveryRank([&] {
    src = data::makeLengthSource(deck);
    return model::CostModel::fromDeck(deck);
  });
  const std::string packer_name = o.packer.empty() ? deck.packing.strategy : o.packer;
  if (!o.packer.empty()) packing::checkPackerName(o.packer, "--packer");

  // Validate every name before doing any work or writing anything.
  const cp::Strategy chosen = cp::parseStrategy(deck.cp.strategy);
  const cp::CommMode chosen_comm = cp::parseCommMode(deck.cp.comm);
  std::vector<cp::Strategy> strategies;
  std::set<std::string> seen;
  for (const auto& s : o.strategies) {
    if (s == "all") {
      for (auto x : cp::allStrategies())
        if (seen.insert(cp::strategyName(x)).second) strategies.push_back(x);
    } else if (seen.insert(s).second) {
      strategies.push_back(cp::parseStrategy(s));
    }
  }
  if (o.strategies.empty()) strategies = cp::allStrategies();
  std::vector<cp::CommMode> comms;
  for (const auto& c : o.comms) {  // a mode named twice is one row
    const auto mode = cp::parseCommMode(c);
    if (std::find(comms.begin(), comms.end(), mode) == comms.end()) comms.push_back(mode);
  }
  if (comms.empty()) comms = {cp::CommMode::AllGather, cp::CommMode::ShardingAware};
  auto packer = packing::makePacker(packer_name, deck, cost);

  app::checkOnRankZero([&] {  // before the work, not at the rename after it
    if (!o.out.empty()) checkOutputPath(o.out, "--out", app::deckInputs(deck));
  });
  std::ofstream out;
  std::string tmp;
  std::optional<app::OutputFolders> out_folders;  // removed again unless the file gets in place
  std::optional<app::TemporaryGuard> tmp_guard;   // removed if interrupted
  if (root && !o.out.empty()) {
    tmp = fmt::format("{}.tmp.{}", o.out, ::getpid());
    out_folders.emplace(o.out);
    tmp_guard.emplace(tmp);
    out.open(tmp);
    if (!out) throw InputError(fmt::format("--out {}: cannot write", o.out), true);
  }
  std::vector<Row> rows;
  for (auto s : strategies)
    for (auto c : comms) rows.emplace_back(cp::strategyName(s), cp::commModeName(c));
  Row chosen_row(cp::strategyName(chosen), cp::commModeName(chosen_comm));
  std::int64_t micro_batches = 0, tokens = 0;
  std::int64_t gathered = 0;  // SlimPack units run with allgather under a sharding_aware deck

  try {
    if (out.is_open()) {
      nlohmann::json names = nlohmann::json::array(), cnames = nlohmann::json::array();
      for (auto s : strategies) names.push_back(cp::strategyName(s));
      for (auto c : comms) cnames.push_back(cp::commModeName(c));
      out << nlohmann::json{{"type", "header"},
                            {"format", "wlb-shard"},
                            {"version", 1},
                            {"packer", packer->name()},
                            {"cp", cp},
                            {"tp", deck.mesh.tp},
                            {"strategy", cp::strategyName(chosen)},
                            {"comm", cp::commModeName(chosen_comm)},
                            {"capacity_factor", deck.cp.capacity_factor},
                            {"compare_strategies", names},
                            {"compare_comms", cnames},
                            {"source", src->describe()},
                            {"steps", steps}}
                 .dump()
          << '\n';
    }
    Progress progress("wlb shard", steps, "steps", root);
    for (std::int64_t i = 0; i < steps; ++i) {
      progress.update(i);
      const std::int64_t step = src->nextStep();
      const StepPlan plan = packer->pack(step, src->next(step));
      const bool sliced = pp::isSlimPackPlan(plan);
      for (std::size_t d = 0; d < plan.replicas.size(); ++d) {
        for (std::size_t m = 0; m < plan.replicas[d].size(); ++m) {
          // As `wlb run` and `wlb simulate` run a SlimPack plan: a DP-Merge slot is one sample
          // over the group's g·cp ranks (its other members' slots are their shares of it, not
          // micro-batches of their own); the other units' slices gather K/V whatever cp.comm.
          const StepPlan::Merged* merged = plan.mergedAt(static_cast<std::int64_t>(m));
          if (merged && merged->group.front() != static_cast<std::int64_t>(d)) continue;
          const int ranks = merged ? static_cast<int>(merged->group.size()) * cp : cp;
          const cp::CommMode mode = sliced && !merged ? cp::CommMode::AllGather : chosen_comm;
          const MicroBatch& mb = plan.replicas[d][m];
          if (mode != chosen_comm) ++gathered;
          ++micro_batches;
          tokens += mb.tokens();
          // The chosen plans as `wlb run` and `wlb simulate` make them, one micro-batch at a
          // time so that its planning time is its own.
          auto t0 = Clock::now();
          const auto chosen_plans = cp::planReplicaShards({mb}, chosen, mode, ranks, cost, deck.cp);
          const double chosen_us = microseconds(t0);
          const cp::ShardPlan sp =
              chosen_plans[0].empty ? cp::planShards(mb, chosen, ranks, cost, deck.cp) : chosen_plans[0].shard;
          const cp::CommPlan cplan = chosen_plans[0].empty ? cp::planComm(sp, mode, cost) : chosen_plans[0].comm;
          const cp::ShardMetrics cm = cp::computeMetrics(sp, cplan, cost);
          chosen_row.add(cm, chosen_us);
          nlohmann::json compare = nlohmann::json::array();
          std::size_t row = 0;
          for (auto s : strategies) {
            // Hybrid's search costs communication with the comm mode it will run under.
            CpConfig cfg = deck.cp;
            for (auto c : comms) {
              cfg.comm = cp::commModeName(c);
              const bool same = s == chosen && c == mode;
              t0 = Clock::now();
              const cp::ShardPlan p = same ? sp : cp::planShards(mb, s, ranks, cost, cfg);
              const cp::CommPlan pc = same ? cplan : cp::planComm(p, c, cost);
              const double us = same ? chosen_us : microseconds(t0);
              const cp::ShardMetrics mt = cp::computeMetrics(p, pc, cost);
              rows[row++].add(mt, us);
              compare.push_back({{"strategy", mt.requested},
                                 {"applied", mt.strategy},
                                 {"comm", mt.comm},
                                 {"imbalance_attn", mt.imbalance_attn},
                                 {"imbalance_latency", mt.imbalance_latency},
                                 {"kv_bytes_total", mt.kv_bytes_total},
                                 {"kv_bytes_max", mt.kv_bytes_max},
                                 {"max_attn_seconds", mt.max_attn_seconds},
                                 {"max_latency", mt.max_latency},
                                 {"sharded_segments", p.sharded_segments}});
            }
          }
          if (out.is_open()) {
            nlohmann::json j = {{"type", "micro_batch"},
                                {"step", plan.step},
                                {"replica", d},
                                {"index", m},
                                {"ranks", ranks},
                                {"tokens", mb.tokens()},
                                {"segments", mb.segments.size()},
                                {"strategy", sp.strategy},
                                {"requested", sp.requested},
                                {"comm", cp::commModeName(mode)},
                                {"metrics", cp::toJson(cm)},
                                {"compare", compare}};
            if (!o.metrics_only) j["plan"] = cp::toJson(sp);
            if (o.comm_plans) j["comm_plan"] = cp::toJson(cplan);
            out << j.dump() << '\n';
          }
        }
      }
    }
    if (out.is_open()) {
      nlohmann::json js = nlohmann::json::array();
      for (const auto& r : rows) js.push_back(r.toJson());
      out << nlohmann::json{{"type", "summary"},
                            {"micro_batches", micro_batches},
                            {"tokens", tokens},
                            {"chosen", chosen_row.toJson()},
                            {"compare", js}}
                 .dump()
          << '\n';
      out.close();
      if (!out) throw InputError(fmt::format("--out {}: write failed", o.out), true);
      if (std::rename(tmp.c_str(), o.out.c_str()) != 0)
        throw InputError(fmt::format("--out {}: cannot rename into place", o.out), true);
      tmp.clear();
      out_folders->keep();
    }
  } catch (...) {
    if (!tmp.empty()) {
      out.close();
      std::remove(tmp.c_str());
    }
    throw;
  }

  if (root) {
    std::cout << fmt::format(
        "wlb shard: packer {}, {} steps, {} micro-batches, {} tokens, cp={} tp={}; chosen {} + {}\n", packer->name(),
        steps, micro_batches, tokens, cp, deck.mesh.tp, cp::strategyName(chosen), cp::commModeName(chosen_comm));
    std::cout << "KV bytes: K+V forward and dK+dV backward received, one layer, one TP rank; "
                 "latency: sum over micro-batches of the slowest CP rank (attn+linear+comm)\n";
    // Baseline for relative columns: per_document + allgather when present (Llama-3 CP).
    double base_bytes = 0, base_lat = 0;
    for (const auto& r : rows)
      if (r.strategy == "per_document" && r.comm == "allgather") {
        base_bytes = r.bytes;
        base_lat = r.latency;
      }
    std::cout << "plan.us: planShards + planComm wall per micro-batch (mean, max), this machine\n";
    std::cout << fmt::format("{:<15} {:<15} {:>9} {:>9} {:>9} {:>12} {:>9} {:>12} {:>9} {:>9} {:>10} {:>10}\n",
                             "strategy", "comm", "imb.attn", "imb.max", "imb.lat", "KV GB", "KV/base", "latency s",
                             "lat/base", "attn s", "plan.us", "plan.us.mx");
    auto print = [&](const Row& r, const std::string& tag) {
      const double n = r.n > 0 ? static_cast<double>(r.n) : 1.0;
      std::cout << fmt::format(
          "{:<15} {:<15} {:>9.4f} {:>9.4f} {:>9.4f} {:>12.4f} {:>9} {:>12.4f} {:>9} {:>9.4f} {:>10.1f} {:>10.1f}{}\n",
          r.strategy, r.comm, r.imb_attn_sum / n, r.imb_attn_max, r.imb_lat_sum / n, r.bytes / 1e9,
          base_bytes > 0 ? fmt::format("{:.3f}", r.bytes / base_bytes) : "-", r.latency,
          base_lat > 0 ? fmt::format("{:.4f}", r.latency / base_lat) : "-", r.attn_seconds, r.plan_us / n,
          r.plan_us_max, tag);
    };
    for (const auto& r : rows) print(r, "");
    bool listed = false;
    for (const auto& r : rows) listed = listed || (r.strategy == chosen_row.strategy && r.comm == chosen_row.comm);
    if (!listed || gathered > 0)
      print(chosen_row, gathered > 0 ? fmt::format("  (chosen; {} SlimPack units gather K/V whatever cp.comm, as "
                                                   "wlb run runs them)",
                                                   gathered)
                                     : std::string("  (chosen)"));
    for (const auto& r : rows)
      if (r.strategy == "adaptive" && r.applied.size() > 0) {
        std::string a;
        for (const auto& [k, v] : r.applied) a += fmt::format(" {}={}", k, v);
        std::cout << fmt::format("adaptive ({}) picked:{}\n", r.comm, a);
        break;
      }
    if (!o.out.empty()) std::cout << "wrote " << o.out << "\n";
  }
  return 0;
}

const bool registered = wlb::app::registerCommand(
    "shard", "CP-shard packed micro-batches; compare sharding strategies and KV comm plans", [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, o->deck);
      sub.add_option("--steps", o->steps, "Steps to pack and shard (default: run.steps)")
          ->check(wlb::app::intAtLeast(1, wlb::app::kMaxStepsOption));
      sub.add_option("--out", o->out, "JSONL output (docs/cp.md)");
      sub.add_option("--packer", o->packer, "Packer (default: packing.strategy)");
      sub.add_option("--strategy", o->strategies,
                     "Sharding strategy to compare (repeatable; 'all' = every strategy; "
                     "default all)");
      sub.add_option("--comm", o->comms, "Comm mode to compare (repeatable: allgather, sharding_aware; default both)");
      sub.add_flag("--metrics-only", o->metrics_only,
                   "Omit the chosen shard plan's pieces/KV layout from the JSONL lines");
      sub.add_flag("--comm-plans", o->comm_plans,
                   "Also write the chosen comm plan (transfers and runs) per micro-batch");
      return [o]() { return runShard(*o); };
    });

}  // namespace
