// `wlb plan DECK`: run the length source and one or more packers for --steps steps, write
// the JSONL plan (docs/plan-format.md), print a comparison table, optionally check
// conservation and save/restore packer checkpoints. Every MPI rank computes the same
// plan; only rank 0 prints and writes.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <unistd.h>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "core/input_file.hpp"
#include "core/json_text.hpp"
#include "core/output_file.hpp"
#include "core/progress.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"
#include "packing/plan_io.hpp"
#include "packing/runner.hpp"

namespace {

struct Opts {
  wlb::app::DeckArgs deck;
  std::int64_t steps = -1;
  std::string out;
  std::vector<std::string> packers;
  bool check = false;
  std::string resume, save_state, summary_json;
};

std::string outPathFor(const std::string& out, const std::string& packer, bool several) {
  if (!several) return out;
  const auto slash = out.find_last_of('/');
  const auto dot = out.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return out + "." + packer;
  return out.substr(0, dot) + "." + packer + out.substr(dot);
}

std::vector<std::string> packersFor(const Opts& o, const wlb::Deck& deck) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  auto add = [&](const std::string& n) {
    if (seen.insert(n).second) names.push_back(n);
  };
  if (!o.packers.empty()) {
    for (const auto& p : o.packers) {
      if (p == "all") {
        for (const auto& n : wlb::packing::packerNames()) add(n);
      } else {
        wlb::packing::checkPackerName(p, "--packer");
        add(p);
      }
    }
  } else if (!deck.run.strategies.empty()) {
    for (const auto& s : wlb::resolveStrategies(deck)) add(s.packer);
  } else {
    add(deck.packing.strategy);
  }
  return names;
}

int runPlan(const Opts& o) {
  using namespace wlb;
  const bool root = app::worldRank() == 0;
  const Deck deck = o.deck.load("wlb plan");
  const std::int64_t steps = o.steps >= 0 ? o.steps : deck.run.steps;
  if (steps < 1) throw InputError("--steps: must be >= 1", true);
  const auto names = packersFor(o, deck);
  // the profile and the length file are read on every rank: one that cannot must not fail alone
  const model::CostModel cost = app::readOnEveryRank([&] {
    (void)data::makeLengthSource(deck);
    return model::CostModel::fromDeck(deck);
  });
  // Validate everything before writing anything.
  // --out names a file (several packers write NAME.PACKER.EXT beside it): a directory
  // would silently become "DIR.PACKER" files next to it
  std::vector<std::string> inputs = app::deckInputs(deck);
  app::checkOnRankZero([&] {  // rank 0 writes them
    std::vector<std::string> all = inputs;
    all.push_back(o.resume);
    if (!o.out.empty()) checkOutputPath(o.out, "--out", all);
    if (!o.summary_json.empty()) checkOutputPath(o.summary_json, "--summary-json", all);
  });
  std::vector<std::unique_ptr<packing::Packer>> packers;
  packers.reserve(names.size());
  for (const auto& n : names) packers.push_back(packing::makePacker(n, deck, cost));
  nlohmann::json resume;
  // every rank reads --resume's state: one that cannot must not fail alone, its message
  // unprinted
  if (!o.resume.empty())
    app::onEveryRank([&] {
      auto f = openInput(o.resume, "--resume", std::ios::in, true);
      try {
        resume = parseJsonText(f);  // the whole file: a NUL or text after the state is damage
      } catch (const nlohmann::json::exception& e) {
        throw InputError(fmt::format("--resume {}: not valid JSON: {}", o.resume, e.what()), true);
      }
      if (!resume.is_object() || resume.value("format", "") != "wlb-plan-state")
        throw InputError(fmt::format("--resume {}: not a wlb-plan-state file", o.resume), true);
    });
  const std::string save = !o.save_state.empty() ? o.save_state : deck.packing.checkpoint;
  app::checkOnRankZero([&] {  // may be --resume's file: the state moves on in place
    const std::string save_key = o.save_state.empty() ? "packing.checkpoint" : "--save-state";
    if (!save.empty()) checkOutputPath(save, save_key, inputs);
    std::vector<std::pair<std::string, std::string>> outs;
    if (!o.out.empty())
      for (const auto& n : names) outs.emplace_back("--out", outPathFor(o.out, n, names.size() > 1));
    if (!o.summary_json.empty()) outs.emplace_back("--summary-json", o.summary_json);
    if (!save.empty()) outs.emplace_back(save_key, save);
    checkDistinctOutputs(outs);
  });
  const bool several = packers.size() > 1;
  if (!resume.is_null()) {  // every packer's state, before any output is begun
    if (!resume.contains("packers") || !resume["packers"].is_object())
      throw InputError(fmt::format("--resume {}: no 'packers' object", o.resume), true);
    for (const auto& packer : packers)
      if (!resume["packers"].contains(packer->name()))
        throw InputError(fmt::format("--resume {}: no state for packer '{}'", o.resume, packer->name()), true);
  }
  // The plan files' folders: removed again if the run fails or is interrupted before the
  // files are in place (every packer's file has the same folder).
  std::optional<app::OutputFolders> out_folders;
  if (root && !o.out.empty()) out_folders.emplace(o.out);

  std::vector<packing::RunResult> results;
  std::vector<std::string> tmp_files;
  nlohmann::json state = {{"format", "wlb-plan-state"}, {"version", 1}, {"packers", nlohmann::json::object()}};
  try {
    for (auto& packer : packers) {
      auto src = data::makeLengthSource(deck);
      if (!resume.is_null()) {
        packing::loadCheckpoint(resume["packers"][packer->name()], *src, *packer, o.resume);
      }
      std::ofstream out;
      std::string final_path, tmp_path;
      if (root && !o.out.empty()) {
        final_path = outPathFor(o.out, packer->name(), several);
        tmp_path = fmt::format("{}.tmp.{}", final_path, ::getpid());
        // registered before the open: a Ctrl-C in between would leave it behind
        tmp_files.push_back(tmp_path);
        wlb::app::registerTemporary(tmp_path);  // removed if interrupted
        out.open(tmp_path);
        if (!out) throw InputError(fmt::format("--out {}: cannot write", final_path), true);
        packing::PlanHeader h;
        h.packer = packer->name();
        h.dp = packer->options().dp;
        h.micro_batches = packer->options().micro_batches;
        h.context_window = packer->options().context_window;
        h.s_max = packer->options().s_max;
        h.source = src->describe();
        h.documents_per_epoch = src->documentsPerEpoch();
        h.seed = deck.data.seed;
        h.first_step = src->nextStep();
        out << packing::toJson(h).dump() << '\n';
      }
      packing::RunOptions ro;
      ro.steps = steps;
      ro.check = o.check;
      // progress on stderr (rank 0) for long runs: core/progress.hpp
      Progress progress("wlb plan", steps, "steps", root);
      std::int64_t done = 0;
      const std::string pname = packer->name();
      ro.on_step = [&](const StepPlan& p, const packing::StepMetrics& m, std::int64_t n) {
        if (out.is_open()) out << packing::stepToJson(p, m, n).dump() << '\n';
        progress.update(++done, pname);
      };
      auto res = packing::runPacker(*src, *packer, cost, ro);
      if (out.is_open()) {
        out << nlohmann::json{{"type", "summary"}, {"result", res.toJson()}}.dump() << '\n';
        out.close();
        if (!out) throw InputError(fmt::format("--out {}: write failed", final_path), true);
      }
      state["packers"][packer->name()] = packing::saveCheckpoint(*src, *packer);
      results.push_back(std::move(res));
    }
    if (root) {
      for (std::size_t i = 0; i < tmp_files.size(); ++i) {
        const auto final_path = outPathFor(o.out, packers[i]->name(), several);
        wlb::app::forgetTemporary(tmp_files[i]);
        if (std::rename(tmp_files[i].c_str(), final_path.c_str()) != 0)
          throw InputError(fmt::format("--out {}: cannot rename into place", final_path), true);
      }
      tmp_files.clear();
      if (out_folders) out_folders->keep();
      if (!save.empty())
        wlb::app::writeAtomically(save, o.save_state.empty() ? "packing.checkpoint" : "--save-state",
                                  state.dump() + "\n");
      if (!o.summary_json.empty()) {
        nlohmann::json js = nlohmann::json::array();
        for (const auto& r : results) js.push_back(r.toJson());
        wlb::app::writeAtomically(o.summary_json, "--summary-json", js.dump(2) + "\n");
      }
    }
  } catch (...) {
    for (const auto& t : tmp_files) {
      wlb::app::forgetTemporary(t);
      std::remove(t.c_str());
    }
    throw;
  }

  if (root) {
    const auto M = data::microBatchesPerReplica(deck);
    std::cout << fmt::format("wlb plan: {} steps, dp={} M={} (N={} micro-batches), S={}, s_max={}, source {}\n", steps,
                             deck.mesh.dp, M, deck.mesh.dp * M, deck.data.context_window,
                             std::max(data::resolvedSMax(deck), deck.data.context_window),
                             data::makeLengthSource(deck)->describe());
    std::cout << fmt::format("{:<14} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10} {:>8}\n", "packer",
                             "imbalance", "imb.max", "attn.fwd", "total.bwd", "delay", "delay.mx", "tok.mx/mn",
                             "plan.us", "plan.us.mx", "gap");
    for (const auto& r : results) {
      const auto& s = r.summary;
      std::cout << fmt::format(
          "{:<14} {:>9.4f} {:>9.4f} {:>9.4f} {:>9.4f} {:>8.3f} {:>8.0f} {:>8.3f} {:>10.1f} {:>10.1f} {:>8}\n", r.packer,
          s.imbalance_mean, s.imbalance_max, s.imbalance_attn_fwd_mean, s.imbalance_total_bwd_mean, s.delay_mean,
          s.delay_max, s.tokens_max_over_mean, s.plan_us_mean, s.plan_us_max,
          r.packer == "fixed_optimal" ? fmt::format("{:.3f}", s.max_gap) : "-");
    }
    if (o.check) {
      bool all_ok = true;
      for (const auto& r : results) {
        std::cout << fmt::format("check {}: {} — lost {} tokens, duplicated {} — {}\n", r.packer,
                                 r.check_ok ? "OK" : "FAILED", r.lost_tokens, r.duplicated, r.check_report);
        all_ok = all_ok && r.check_ok;
      }
      if (!all_ok) return 1;
    }
  }
  if (o.check)
    for (const auto& r : results)
      if (!r.check_ok) return 1;
  return 0;
}

const bool registered = wlb::app::registerCommand(
    "plan", "Pack documents into micro-batches with one or more packers; write a JSONL plan", [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      wlb::app::addDeckArgs(sub, o->deck);
      sub.add_option("--steps", o->steps, "Steps to plan (default: run.steps)")
          ->check(wlb::app::intAtLeast(1, wlb::app::kMaxStepsOption));
      sub.add_option("--out", o->out, "JSONL plan file (with several packers: NAME.PACKER.EXT per packer)");
      sub.add_option("--packer", o->packers,
                     "Packer to run (repeatable; 'all' = every packer; default: run.strategies or "
                     "packing.strategy)");
      sub.add_flag("--check", o->check, "Verify conservation (every token trained exactly once); exit 1 on violation");
      sub.add_option("--resume", o->resume, "Start from a packer-state file written by --save-state");
      sub.add_option("--save-state", o->save_state,
                     "Write the packers' state after the last step (default: packing.checkpoint)");
      sub.add_option("--summary-json", o->summary_json, "Write the per-packer summaries as JSON");
      return [o]() { return runPlan(*o); };
    });

}  // namespace
