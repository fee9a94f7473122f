// `wlb simulate DECK... [--steps N] [--out DIR] [--trace FILE] [--plans RUN]`: predict 4D
// training steps with the DAG simulator (docs/simulator.md) for every case of every deck
// ([sweep] lists expand to cases; a `.list` file names decks, one per line) and compare
// strategies on the same length stream: plain, fixed, wlb and the PP-only / CP-only
// breakdown; or, with --plans, replay the plans a `wlb run` wrote. Every rank computes the
// same (cheap, deterministic) result; only rank 0 prints and writes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "core/input_file.hpp"
#include "core/output_file.hpp"
#include "core/progress.hpp"
#include "cp/shard_plan.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "model/throughput.hpp"
#include "packing/packer.hpp"
#include "packing/plan_io.hpp"
#include "packing/simulate_deck.hpp"
#include "pp/simulator.hpp"
#include "trace/recorder.hpp"
#include "trace/writer.hpp"

namespace {

namespace fs = std::filesystem;

struct Opts {
  wlb::app::DeckArgs deck;
  std::vector<std::string> more_decks;
  std::int64_t steps = -1, warmup = -1;
  bool as_run = false, mean_speed = false;
  std::string out, trace, plans;
  std::vector<std::string> strategies;
};

/// Strategies compared when the deck names none: the paper's three plus the breakdown.
const std::vector<std::pair<std::string, std::string>> kDefault = {
    {"plain", "plain"},
    {"fixed", "fixed"},
    {"wlb", "wlb"},
    {"pp-only", "wlb+per_sequence"},    // WLB packing, baseline CP sharding
    {"cp-only", "original+adaptive"}};  // baseline packing, WLB CP sharding

std::string displayName(const std::string& s) {
  for (const auto& [label, spec] : kDefault)
    if (spec == s) return label;
  return s;
}

/// A label of the default set (pp-only, cp-only, ...) names its strategy spec.
std::string specOf(const std::string& s) {
  for (const auto& [label, spec] : kDefault)
    if (label == s) return spec;
  return s;
}

/// --strategies names each strategy once, as the option (not the deck key it stands in
/// for): a label and the spec it stands for are the same strategy.
void checkCliStrategies(const std::vector<std::string>& given) {
  std::map<std::string, std::string> seen;  // spec -> as given
  for (const auto& s : given) {
    const auto spec = specOf(s);
    if (const auto [it, fresh] = seen.emplace(spec, s); !fresh)
      throw wlb::InputError(it->second == s ? "--strategies: \"" + s + "\" is listed twice"
                                            : "--strategies: \"" + it->second + "\" and \"" + s +
                                                  "\" are the same strategy (" + spec + ")",
                            true);
  }
}

/// One table row: a case's strategy (packing::simulateDeck's result) with the case's labels.
struct Row : wlb::packing::SimStrategyResult {
  std::string case_name, mesh, model;
  std::int64_t window = 0;
};

std::vector<std::string> expandDeckPaths(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const auto& p : paths) {
    if (p.size() > 5 && p.substr(p.size() - 5) == ".list") {
      auto in = wlb::openInput(p, "deck list", std::ios::in, true);
      std::string line;
      for (int no = 1; std::getline(in, line); ++no) {
        const auto hash = line.find('#');
        if (hash != std::string::npos) line.erase(hash);
        line.erase(0, line.find_first_not_of(" \t\r"));
        line.erase(line.find_last_not_of(" \t\r") + 1);
        if (line.empty()) continue;
        fs::path d(line);
        if (d.is_relative()) d = fs::path(p).parent_path() / d;
        // named by its line: loadDeck's own error would not say which list holds it
        std::error_code ec;
        if (!fs::is_regular_file(d, ec))
          throw wlb::InputError(p + ":" + std::to_string(no) + ": deck '" + line + "' " +
                                    (fs::exists(d, ec) ? "is not a file" : "does not exist") + " (looked for " +
                                    d.string() + ")",
                                true);
        out.push_back(d.string());
      }
    } else {
      out.push_back(p);
    }
  }
  return out;
}

std::string caseName(const std::string& path, const wlb::Deck& c, bool sweep) {
  std::string n = fs::path(path).stem().string();
  if (sweep) {
    // expandSweep appends "/<key-value_...>" to output.dir; reuse that suffix.
    const auto slash = c.output.dir.find_last_of('/');
    if (slash != std::string::npos) n += ":" + c.output.dir.substr(slash + 1);
  }
  return n;
}

std::string traceName(const std::string& trace, std::size_t idx, std::size_t n) {
  if (n <= 1) return trace;
  fs::path p(trace);
  return (p.parent_path() / (p.stem().string() + "." + std::to_string(idx) + p.extension().string())).string();
}

int run(const Opts& o) {
  const int rank = wlb::app::worldRank();
  checkCliStrategies(o.strategies);
  // Load and expand everything first: bad input fails before any output. Every rank reads
  // the decks, plans and profiles: one that cannot must not fail alone (its message
  // unprinted) or leave the others waiting.
  struct Case {
    std::string name;
    wlb::Deck deck;
  };
  std::vector<Case> cases;
  // --plans: the plans one run wrote, replayed on its one deck (model, mesh, profile).
  std::vector<wlb::packing::RunPlans::Strategy> replay;
  std::int64_t replay_steps = -1, replay_warmup = -1;
  // Validate every case (profile, schedule, strategies) before any output is written.
  // Same step accounting as `wlb run`: `warmup` unmeasured steps, then `steps` measured
  // (a replay: the run's own, from its summary.json, unless given).
  const auto stepCounts = [&](const wlb::Deck& deck) {
    const std::int64_t steps = o.steps > 0 ? o.steps : replay_steps > 0 ? replay_steps : deck.run.steps;
    const std::int64_t warmup = o.warmup >= 0        ? o.warmup
                                : replay_warmup >= 0 ? replay_warmup
                                                     : std::max<std::int64_t>(0, deck.run.warmup);
    return std::pair<std::int64_t, std::int64_t>{steps, warmup};
  };
  wlb::app::onEveryRank([&] {
    std::vector<std::string> paths{o.deck.path};
    paths.insert(paths.end(), o.more_decks.begin(), o.more_decks.end());
    paths = expandDeckPaths(paths);
    for (const auto& p : paths) {
      const wlb::Deck deck = wlb::loadDeck(p, o.deck.overrides);
      const auto expanded = wlb::expandSweep(deck);
      for (const auto& c : expanded) cases.push_back({caseName(p, c, !deck.sweep.empty()), c});
    }
    if (o.steps == 0 || o.steps < -1) throw wlb::InputError("--steps must be >= 1", true);
    if (o.warmup < -1) throw wlb::InputError("--warmup must be >= 0", true);
    if (!o.plans.empty()) {
      if (cases.size() != 1)
        throw wlb::InputError("--plans replays one run: give the one deck it ran (no [sweep], no more decks); got " +
                                  std::to_string(cases.size()) + " cases",
                              true);
      auto rp = wlb::packing::readRunPlans(o.plans);
      replay_steps = rp.steps;
      replay_warmup = rp.warmup;
      // A replay's steps are the file's: other counts than the run's would call the run's
      // measured steps warm-up or drain (no new documents), and count them so.
      if (rp.steps > 0 && o.steps > 0 && o.steps != rp.steps)
        throw wlb::InputError("--steps " + std::to_string(o.steps) + ": the run in " + o.plans + " measured " +
                                  std::to_string(rp.steps) + " steps (its summary.json); a replay takes the run's",
                              true);
      if (rp.warmup >= 0 && o.warmup >= 0 && o.warmup != rp.warmup)
        throw wlb::InputError("--warmup " + std::to_string(o.warmup) + ": the run in " + o.plans + " had " +
                                  std::to_string(rp.warmup) +
                                  " warm-up steps (its summary.json); a replay takes the run's",
                              true);
      if (o.strategies.empty()) {
        replay = std::move(rp.strategies);
      } else {
        for (const auto& want : o.strategies) {
          std::string have;
          for (const auto& st : rp.strategies) {
            if (st.strategy == want) replay.push_back(st);
            have += (have.empty() ? "" : ", ") + st.strategy;
          }
          if (replay.empty() || replay.back().strategy != want)
            throw wlb::InputError("--strategies: '" + want + "' has no plans in " + o.plans + " (it has " + have + ")",
                                  true);
        }
      }
    }
    for (const Case& cs : cases) try {
        wlb::Deck deck = cs.deck;
        if (!replay.empty()) {
          const wlb::model::CostModel cost = wlb::model::CostModel::fromDeck(deck);
          const wlb::pp::StepSimulator sim(deck, cost);
          const auto [steps, warmup] = stepCounts(deck);
          for (const auto& r : replay) {
            wlb::packing::checkReplay(deck, r, steps + warmup);
            wlb::packing::checkPackerSchedule(deck, r.file.header.packer);
          }
          continue;
        }
        if (!o.strategies.empty()) {
          deck.run.strategies.clear();
          for (const auto& st : o.strategies) deck.run.strategies.push_back(specOf(st));
          try {  // the deck's check, told as the option's
            (void)wlb::resolveStrategies(deck);
          } catch (const wlb::InputError& e) {
            std::string w = e.what();
            const std::string key = "key 'run.strategies'";
            if (w.rfind(key, 0) == 0) w = "--strategies" + w.substr(key.size());
            throw wlb::InputError(w, true);
          }
        }
        const wlb::model::CostModel cost = wlb::model::CostModel::fromDeck(deck);
        const wlb::pp::StepSimulator sim(deck, cost);
        (void)sim.schedule(static_cast<int>(wlb::data::microBatchesPerReplica(deck)));
        (void)wlb::data::makeLengthSource(deck);  // its length file, read here on every rank
        for (const auto& pr : wlb::resolveStrategies(deck)) {
          wlb::packing::checkPackerSchedule(deck, pr.packer);
          (void)wlb::packing::makePacker(pr.packer, deck, cost);
          (void)wlb::cp::parseStrategy(pr.sharding);
        }
      } catch (const wlb::InputError& e) {
        // several cases: say which one (its profile or length file may be its own)
        if (cases.size() < 2) throw;
        throw wlb::InputError("case " + cs.name + " (" + cs.deck.source_path + "): " + e.what(), e.collective());
      }
  });
  if (cases.empty()) throw wlb::InputError("wlb simulate: no decks to simulate (the deck list names none)", true);
  // Every output path before any work (rank 0 writes them): a bad one must not leave the
  // others written.
  wlb::app::checkOnRankZero([&] {
    std::vector<std::string> inputs{o.plans};
    for (const Case& cs : cases)
      for (const auto& f : wlb::app::deckInputs(cs.deck)) inputs.push_back(f);
    if (!o.out.empty()) {
      wlb::checkOutputFolder(o.out, "--out");
      for (const char* f : {"simulate.csv", "simulate.json"})
        wlb::checkOutputPath((fs::path(o.out) / f).string(), "--out", inputs);
    }
    std::vector<std::pair<std::string, std::string>> outs;
    if (!o.out.empty())
      for (const char* f : {"simulate.csv", "simulate.json"})
        outs.emplace_back("--out", (fs::path(o.out) / f).string());
    if (!o.trace.empty())
      for (std::size_t ci = 0; ci < cases.size(); ++ci) {
        wlb::checkOutputPath(traceName(o.trace, ci, cases.size()), "--trace", inputs);
        outs.emplace_back("--trace", traceName(o.trace, ci, cases.size()));
      }
    wlb::checkDistinctOutputs(outs);
  });
  // --trace's folders: made now, removed again (while empty) on failure or Ctrl-C
  std::optional<wlb::app::OutputFolders> trace_folders;
  if (!o.trace.empty() && rank == 0) {
    trace_folders.emplace(o.trace);
    if (trace_folders->error())
      throw wlb::InputError("--trace '" + o.trace + "': cannot make its folder (" + trace_folders->error().message() +
                            ")");
  }

  // Strategy list: --strategies, else the deck's run.strategies, else the default five.
  const auto strategyNames = [&](const wlb::Deck& deck) {
    std::vector<std::pair<std::string, std::string>> names;
    if (!replay.empty()) {
      for (const auto& r : replay) names.push_back({r.strategy, r.strategy});
    } else if (!o.strategies.empty()) {
      for (const auto& s : o.strategies) names.push_back({displayName(specOf(s)), specOf(s)});
    } else if (!deck.run.strategies.empty()) {
      for (const auto& s : deck.run.strategies) names.push_back({displayName(s), s});
    } else {
      names = kDefault;
    }
    return names;
  };
  std::int64_t total_steps = 0, done_steps = 0;
  for (const Case& cs : cases) {
    const auto [steps, warmup] = stepCounts(cs.deck);
    total_steps += static_cast<std::int64_t>(strategyNames(cs.deck).size()) * (steps + warmup);
  }
  wlb::Progress progress("wlb simulate", total_steps, "steps", rank == 0);

  std::vector<Row> rows;
  std::vector<std::string> spread_notes;    // cases whose profile has a rank-speed spread
  std::vector<std::string> unpriced_notes;  // selective cases whose profile does not time the recomputation
  const auto t_all = std::chrono::steady_clock::now();
  for (std::size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& cs = cases[ci];
    wlb::Deck deck = cs.deck;
    const auto names = strategyNames(deck);
    const auto [steps, warmup] = stepCounts(deck);
    const wlb::model::CostModel cost = wlb::model::CostModel::fromDeck(deck);
    if (const auto& hw = cost.hardware();
        !o.mean_speed && (hw.rank_spread > 0 || hw.step_spread > 0 || hw.task_spread > 0))
      spread_notes.push_back(fmt::format("{} spread {:g}, step_spread {:g}, task_spread {:g}", cs.name, hw.rank_spread,
                                         hw.step_spread, hw.task_spread));
    if (deck.pipeline.recompute == "selective" && !cost.recomputeTimed()) unpriced_notes.push_back(cs.name);
    std::unique_ptr<wlb::trace::Recorder> rec;
    std::unique_ptr<wlb::trace::Writer> writer;
    if (!o.trace.empty()) {
      rec = std::make_unique<wlb::trace::Recorder>();
      wlb::trace::RunMeta meta;
      meta.source = "simulated";
      meta.deck_toml = deck.toToml();
      meta.command = "wlb simulate";
      meta.tp = static_cast<int>(deck.mesh.tp);
      meta.cp = static_cast<int>(deck.mesh.cp);
      meta.pp = static_cast<int>(deck.mesh.pp);
      meta.dp = static_cast<int>(deck.mesh.dp);
      meta.warmup = static_cast<int>(warmup);
      meta.extra.push_back({"hardware_profile", cost.hardware().name});
      meta.extra.push_back({"measured_steps", std::to_string(steps)});  // drain steps follow them
      if (rank == 0) writer = std::make_unique<wlb::trace::Writer>(traceName(o.trace, ci, cases.size()), meta);
    }
    const std::string mesh = fmt::format("{}x{}x{}x{}", deck.mesh.tp, deck.mesh.cp, deck.mesh.pp, deck.mesh.dp);
    // The strategy loop is the library's (packing/simulate_deck.hpp); this driver adds the
    // trace file, progress and the output formats.
    wlb::packing::SimulateOptions so;
    so.strategies = names;
    so.steps = steps;
    so.warmup = warmup;
    so.as_run = o.as_run;
    so.mean_speed = o.mean_speed;
    so.recorder = rec.get();
    so.replay = replay;
    so.on_plan = [&](const std::string& strategy, const wlb::StepPlan& plan, std::int64_t incoming) {
      if (!writer) return;
      // the plan file's step line, metrics and all, as wlb run records it
      nlohmann::json j = wlb::packing::stepToJson(plan, wlb::packing::computeMetrics(plan, cost), incoming);
      j["strategy"] = strategy;
      writer->addPlan(strategy, plan, j.dump());
    };
    so.on_step = [&](const std::string& strategy) { progress.update(++done_steps, cs.name + " " + strategy); };
    for (auto& r : wlb::packing::simulateDeck(deck, so)) {
      Row row;
      static_cast<wlb::packing::SimStrategyResult&>(row) = std::move(r);
      row.case_name = cs.name;
      row.mesh = mesh;
      row.model = deck.model.name;
      row.window = deck.data.context_window;
      rows.push_back(std::move(row));
    }
    if (writer) writer->commit(*rec);
  }
  if (trace_folders) trace_folders->keep();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_all).count();
  if (rank != 0) return 0;

  // Table.
  std::size_t wc = 4, ws = 8;
  for (const auto& r : rows) {
    wc = std::max(wc, r.case_name.size());
    ws = std::max(ws, r.strategy.size());
  }
  std::ostringstream os;
  os << fmt::format("{:<{}}  {:<11} {:<{}} {:>9} {:>8} {:>8} {:>13} {:>9} {:>7} {:>6} {:>6} {:>8} {:>5}  {}\n", "case",
                    wc, "tp.cp.pp.dp", "strategy", ws, "Mtok/s", "PFLOP/s", "speedup", "[95% interval]", "step_s",
                    "step-x", "bubble", "idle", "grad_s", "drain", "peak_GB/stage");
  for (const auto& r : rows) {
    std::string mem;
    for (std::size_t s = 0; s < r.peak_gb.size(); ++s) mem += fmt::format("{}{:.1f}", s ? "/" : "", r.peak_gb[s]);
    if (!r.fits) mem += " (exceeds memory)";
    os << fmt::format(
        "{:<{}}  {:<11} {:<{}} {:>9.4f} {:>8.3f} {:>7.3f}x {:>13} {:>9.4f} {:>6.2f}x {:>6.3f} {:>6.3f} {:>8.4f} "
        "{:>5}  {}\n",
        r.case_name, wc, r.mesh, r.strategy, ws, r.tokens_per_s / 1e6, r.flops_per_s / 1e15, r.speedup,
        fmt::format("[{:.3f}-{:.3f}]", r.speedup_lo, r.speedup_hi), r.step_s, r.step_ratio, r.bubble, r.idle, r.grad_s,
        r.drain_steps, mem);
  }
  os << fmt::format(
      "# {} case(s); speedup = throughput (trained tokens/s) over {} of the same case, 95% paired bootstrap interval "
      "over steps; each strategy runs drain steps (no new documents) after its measured steps until nothing is held, "
      "and their time and tokens count; PFLOP/s = useful model FLOPs (causal attention + linear, fwd+bwd); step-x = "
      "step-time ratio (flatters deferral); pp-only = wlb packing + per_sequence CP, cp-only = original packing + "
      "adaptive CP; simulated in {:.2f} s\n",
      cases.size(), rows.empty() ? std::string("plain") : rows.front().baseline, wall);
  if (!spread_notes.empty()) {
    os << "# rank speed (the profile's rank_speed): ";
    for (std::size_t i = 0; i < spread_notes.size(); ++i) os << (i ? "; " : "") << spread_notes[i];
    os << "; every sync group waits for its slowest member (docs/simulator.md, Rank speed)\n";
  }
  if (!unpriced_notes.empty()) {
    os << "# pipeline.recompute = \"selective\" without its time: ";
    for (std::size_t i = 0; i < unpriced_notes.size(); ++i) os << (i ? ", " : "") << unpriced_notes[i];
    os << ": the profile does not time the backward's recomputation for this model (no linear_ops "
          "recompute_ns_per_token of this shape); `wlb profile --deck` measures it (docs/profile-format.md)\n";
  }
  if (!replay.empty()) {
    os << "# replayed the plans of " << o.plans << " (";
    for (std::size_t i = 0; i < replay.size(); ++i) os << (i ? ", " : "") << replay[i].path;
    os << "): the run's documents and micro-batches, its warm-up and drain steps\n";
  }
  // How slimpack fitted each step into memory (docs/packing.md § slimpack).
  for (const auto& r : rows) {
    if (r.partitions.empty()) continue;
    os << fmt::format("# {} {} memory partition, steps:", r.case_name, r.strategy);
    for (const auto& [k, n] : r.partitions) os << fmt::format(" {} {}", k, n);
    os << fmt::format("; samples held back {}; DP-Merge units {}\n", r.held, r.merged);
  }
  if (o.as_run) {
    // The quantity `wlb run` measures (its summary's stage_peak_activation_bytes).
    os << "# activation peak per stage [MiB], executor's memory model:";
    for (const auto& r : rows) {
      os << "  " << r.strategy << " ";
      for (std::size_t s = 0; s < r.peak_act_bytes.size(); ++s)
        os << fmt::format("{}{:.2f}", s ? "/" : "", r.peak_act_bytes[s] / (1024.0 * 1024.0));
    }
    os << "\n";
  }
  std::cout << os.str() << std::flush;

  if (!o.out.empty()) {  // writeAtomically makes the folder
    std::ostringstream csv;
    csv << "case,mesh,model,context_window,strategy,packer,sharding,steps,drain_steps,tokens,tokens_per_second,"
           "useful_flops_per_second,baseline,speedup,speedup_lo,speedup_hi,step_seconds,step_time_ratio,"
           "bubble_fraction,idle_fraction,grad_sync_seconds,peak_gb_per_stage,fits_memory,"
           "peak_activation_bytes_per_stage\n";
    nlohmann::json j = nlohmann::json::array();
    for (const auto& r : rows) {
      std::string mem;
      for (std::size_t s = 0; s < r.peak_gb.size(); ++s) mem += fmt::format("{}{:.3f}", s ? ";" : "", r.peak_gb[s]);
      std::string act;
      for (std::size_t s = 0; s < r.peak_act_bytes.size(); ++s)
        act += fmt::format("{}{:.0f}", s ? ";" : "", r.peak_act_bytes[s]);
      csv << fmt::format(
          "{},{},{},{},{},{},{},{},{},{:.0f},{:.6g},{:.6g},{},{:.4f},{:.4f},{:.4f},{:.6g},{:.4f},{:.4f},"
          "{:.4f},{:.6g},{},{},{}\n",
          r.case_name, r.mesh, r.model, r.window, r.strategy, r.packer, r.sharding, r.steps, r.drain_steps, r.tokens,
          r.tokens_per_s, r.flops_per_s, r.baseline, r.speedup, r.speedup_lo, r.speedup_hi, r.step_s, r.step_ratio,
          r.bubble, r.idle, r.grad_s, mem, r.fits ? 1 : 0, act);
      j.push_back({{"case", r.case_name},
                   {"mesh", r.mesh},
                   {"model", r.model},
                   {"context_window", r.window},
                   {"strategy", r.strategy},
                   {"packer", r.packer},
                   {"sharding", r.sharding},
                   {"steps", r.steps},
                   {"drain_steps", r.drain_steps},
                   {"tokens", r.tokens},
                   {"tokens_per_second", r.tokens_per_s},
                   {"useful_flops_per_second", r.flops_per_s},
                   {"baseline", r.baseline},
                   {"speedup", r.speedup},
                   {"speedup_interval", {r.speedup_lo, r.speedup_hi}},
                   {"step_seconds", r.step_s},
                   {"step_time_ratio", r.step_ratio},
                   {"bubble_fraction", r.bubble},
                   {"idle_fraction", r.idle},
                   {"grad_sync_seconds", r.grad_s},
                   {"peak_gb_per_stage", r.peak_gb},
                   {"fits_memory", r.fits},
                   {"peak_activation_bytes_per_stage", r.peak_act_bytes}});
      if (!r.partitions.empty()) {
        j.back()["memory_partitions"] = r.partitions;
        j.back()["held_samples"] = r.held;
        j.back()["dp_merge_units"] = r.merged;
      }
    }
    // both or neither: a CSV beside an old run's JSON would disagree with it
    wlb::writeFilesAtomically({{(fs::path(o.out) / "simulate.csv").string(), csv.str()},
                               {(fs::path(o.out) / "simulate.json").string(), j.dump(2) + "\n"}},
                              "--out", wlb::app::trackTemporary);
  }
  return 0;
}

const bool registered = wlb::app::registerCommand(
    "simulate", "Predict 4D step time, bubbles and memory with the DAG simulator; compare strategies",
    [](CLI::App& sub) {
      auto opts = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, opts->deck);
      sub.add_option("more", opts->more_decks, "More decks (or .list files naming decks) to simulate");
      sub.add_option("--steps", opts->steps, "Measured steps per strategy (default: run.steps)")
          ->check(wlb::app::intAtLeast(1, wlb::app::kMaxStepsOption));
      sub.add_option("--warmup", opts->warmup, "Unmeasured steps before them (default: run.warmup), as in `wlb run`")
          ->check(wlb::app::intAtLeast(0, wlb::app::kMaxStepsOption));
      sub.add_flag("--as-run", opts->as_run,
                   "Model what `wlb run` executes: layers only (no embedding/LM head), fp32 "
                   "KV and gradient communication");
      sub.add_flag("--mean-speed", opts->mean_speed,
                   "Run every rank at the profile's mean speed: leave out the profile's rank_speed spreads");
      sub.add_option("--out", opts->out, "Write simulate.csv and simulate.json into DIR")->type_name("DIR");
      sub.add_option("--trace", opts->trace,
                     "Write predicted events (trace schema, /meta/source = simulated) to FILE "
                     "(several cases: case i to FILE with .<i> before its extension, sim.h5 -> sim.0.h5)")
          ->type_name("FILE");
      sub.add_option("--plans", opts->plans,
                     "Replay the plans a `wlb run` wrote (its output directory, or one plan file) instead of "
                     "planning: exactly those documents and micro-batches, on the deck's model, mesh and profile")
          ->type_name("RUN");
      sub.add_option("--strategies", opts->strategies,
                     "Strategies to compare (plain, fixed, wlb, slimpack, pp-only, cp-only, PACKER+SHARDING); default: "
                     "run.strategies, else plain, fixed, wlb, pp-only, cp-only")
          ->delimiter(',');
      return [opts]() -> int { return run(*opts); };
    });

}  // namespace
