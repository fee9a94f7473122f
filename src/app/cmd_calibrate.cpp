// `wlb calibrate TRACE... --profile P --out P2`: fit a hardware profile's factors and links
// to measured `wlb run` traces (model/calibration.hpp, docs/profile-format.md § Calibration)
// and say how far each moved. Reads the traces' op events, the FLOPs they recorded and the
// CP shard plans they carry; writes the new profile atomically. Single process.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "core/output_file.hpp"
#include "model/calibration.hpp"
#include "model/cost_model.hpp"
#include "trace/reader.hpp"

namespace {

namespace fs = std::filesystem;

struct Opts {
  std::vector<std::string> traces;
  std::string profile, out;
  bool quiet = false;
};

std::string isoNow() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

/// A measured trace as the fit's input: events after the warm-up, CP shares of every
/// planned micro-batch, model dims from the trace's deck.
wlb::model::MeasuredRun toRun(const wlb::trace::Trace& tr, wlb::Deck& deck_out) {
  const std::string& path = tr.path;
  if (tr.source != "measured")
    throw wlb::InputError(path + ": /meta/source is '" + tr.source +
                          "'; wlb calibrate needs a measured trace written by `wlb run`");
  if (tr.deck_toml.empty()) throw wlb::InputError(path + ": /meta/deck is empty (no deck to read the model from)");
  // The resolved deck lists derived keys (marked "# derived"), which a deck may not set.
  std::istringstream lines(tr.deck_toml);
  std::string text, line;
  while (std::getline(lines, line))
    if (line.find("# derived") == std::string::npos) text += line + "\n";
  wlb::Deck deck;
  try {
    deck = wlb::parseDeck(text, path + ":/meta/deck");
  } catch (const wlb::InputError& e) {
    throw wlb::InputError(std::string("the deck stored in ") + e.what());
  }
  deck_out = deck;
  wlb::model::MeasuredRun run;
  run.name = path;
  run.dims = wlb::model::ModelDims::fromDeck(deck.model);
  run.tp = tr.tp;
  run.cp = tr.cp;
  run.dp = tr.dp;
  run.linear_ref_tokens = static_cast<double>(deck.data.context_window) / static_cast<double>(std::max(tr.cp, 1));
  run.strategies = tr.strategies;
  for (const auto& r : tr.ranks) {
    if (r.rank < 0 || r.rank > 1 << 20) throw wlb::InputError(path + ": /ranks has rank " + std::to_string(r.rank));
    if (static_cast<std::size_t>(r.rank) >= run.ranks.size()) run.ranks.resize(static_cast<std::size_t>(r.rank) + 1);
    run.ranks[static_cast<std::size_t>(r.rank)] = {r.tp, r.cp, r.dp, r.pp};
  }
  for (const auto& e : tr.events) {
    if (e.step < tr.warmup) continue;  // cold caches, queues filling: not what the model predicts
    wlb::model::MeasuredEvent m;
    m.op = tr.regions[static_cast<std::size_t>(e.region)];
    m.phase = static_cast<int>(e.phase);
    m.rank = e.rank;
    m.strategy = e.strategy;
    m.step = e.step;
    m.micro_batch = e.micro_batch;
    m.layer = e.layer;
    m.seconds = static_cast<double>(e.end_ns - e.start_ns) * 1e-9;
    m.flops = e.flops;
    m.bytes = e.bytes;
    run.events.push_back(std::move(m));
  }
  if (run.events.empty())
    throw wlb::InputError(path + ": no events after the " + std::to_string(tr.warmup) + " warm-up step(s)");
  for (const auto& ps : tr.plan_steps) {
    if (ps.step < tr.warmup || ps.shard_json.empty()) continue;
    nlohmann::json sj;
    try {
      sj = nlohmann::json::parse(ps.shard_json);
    } catch (const nlohmann::json::exception& e) {
      throw wlb::InputError(path + ": /plan/shard_json of step " + std::to_string(ps.step) + " is not JSON (" +
                            e.what() + ")");
    }
    if (!sj.is_array()) continue;  // "{}": no shard plans recorded
    try {
      // a count no plan holds (negative, or past a document's limit) is damage, not a share
      const auto count = [&](const nlohmann::json& v, const char* what) {
        const auto n = v.get<std::int64_t>();
        if (n < 0 || n > (std::int64_t{1} << 40))
          throw wlb::InputError(path + ": /plan/shard_json of step " + std::to_string(ps.step) + ": " + what + " " +
                                std::to_string(n) + " is no token count");
        return n;
      };
      for (const auto& mb : sj) {
        std::vector<wlb::model::RankShare> shares;
        for (const auto& rk : mb.at("shard").at("ranks")) {
          wlb::model::RankShare s;
          s.tokens = count(rk.at("tokens"), "tokens");
          for (const auto& p : rk.at("pieces"))
            s.pieces.push_back({count(p.at("q_offset"), "q_offset"), count(p.at("q_len"), "q_len")});
          shares.push_back(std::move(s));
        }
        run.shares[{ps.strategy, ps.step, mb.at("dp").get<int>(), mb.at("micro_batch").get<int>()}] = std::move(shares);
      }
    } catch (const nlohmann::json::exception& e) {
      throw wlb::InputError(path + ": /plan/shard_json of step " + std::to_string(ps.step) +
                            " lacks a shard plan field (" + e.what() + ")");
    }
  }
  if (run.shares.empty())
    throw wlb::InputError(path + ": no CP shard plans under /plan/shard_json (needed to predict attention)");
  return run;
}

std::string resolveProfile(const Opts& o, const wlb::Deck& deck) {
  if (!o.profile.empty()) {
    if (!fs::exists(o.profile)) throw wlb::InputError("--profile: file '" + o.profile + "' not found");
    return o.profile;
  }
  const std::string& p = deck.hardware.profile;
  if (p == "analytic")
    throw wlb::InputError("the run used the analytic profile ([hardware] profile = \"analytic\"); pass --profile FILE");
  if (fs::exists(p)) return p;
  throw wlb::InputError("the trace's deck names [hardware] profile = '" + p +
                        "', which is not found from the working directory; pass --profile FILE");
}

std::string pct(double after, double before) {
  if (before <= 0) return "-";
  return fmt::format("{:+.1f}%", (after / before - 1.0) * 100.0);
}

int run(const Opts& o) {
  if (wlb::app::worldRank() != 0) return 0;
  if (o.traces.empty()) throw wlb::InputError("wlb calibrate: give at least one TRACE");
  wlb::checkOutputPath(o.out, "--out", o.traces);  // --out may be --profile: calibrated in place

  std::vector<wlb::model::MeasuredRun> runs;
  std::vector<std::string> names;
  wlb::Deck first_deck;
  std::ostringstream summary;
  for (std::size_t i = 0; i < o.traces.size(); ++i) {
    const auto tr = wlb::trace::readTrace(o.traces[i]);  // InputError: missing, incomplete, wrong schema
    wlb::Deck deck;
    runs.push_back(toRun(tr, deck));
    if (i == 0) first_deck = deck;
    // the file name and its folder (a run's output dir names its deck), never the full path
    const fs::path tp(o.traces[i]);
    names.push_back(tp.has_parent_path() && !tp.parent_path().filename().empty()
                        ? (tp.parent_path().filename() / tp.filename()).string()
                        : tp.filename().string());
    const auto& r = runs.back();
    summary << fmt::format("  {}: mesh tp{} cp{} dp{}, {} strategies, {} events after {} warm-up step(s)\n",
                           names.back(), r.tp, r.cp, r.dp, r.strategies.size(), r.events.size(), tr.warmup);
    if (r.dims.hidden != runs.front().dims.hidden || r.dims.ffn != runs.front().dims.ffn ||
        r.dims.heads != runs.front().dims.heads || r.dims.kv_heads != runs.front().dims.kv_heads)
      throw wlb::InputError(o.traces[i] + ": model dims differ from " + o.traces[0] +
                            "'s; calibrate one model shape at a time");
  }
  const std::string profile_path = resolveProfile(o, first_deck);
  const auto profile = wlb::model::HardwareProfile::load(profile_path);  // InputError on bad content
  nlohmann::json pj;
  {
    std::ifstream in(profile_path);
    in >> pj;  // load() parsed it already
  }
  const auto fit = wlb::model::fitProfile(runs, profile);
  wlb::model::CostModel probe(runs.front().dims, profile, runs.front().tp);
  probe.setLinearReferenceTokens(runs.front().linear_ref_tokens);

  std::ostringstream os;
  os << fmt::format("wlb calibrate: {} trace(s), profile {} ({})\n", runs.size(), profile.name,
                    probe.linearTableUsed() ? "deck-shaped linear_ops table"
                                            : "no linear_ops table for this shape: every op at linear_gflops");
  os << summary.str();
  os << fmt::format("{:<14} {:>8} {:>8} {:>8} {:>12} {:>14} {:>8} {:>9}\n", "factor", "before", "after", "moved",
                    "measured[s]", "predicted[s]", "events", "outliers");
  std::size_t outliers = 0;
  for (const auto& f : fit.factors) {
    os << fmt::format("{:<14} {:>8.4f} {:>8.4f} {:>8} {:>12.3f} {:>14.3f} {:>8} {:>9}", f.key, f.before, f.after,
                      f.fitted ? pct(f.after, f.before) : std::string("-"), f.measured_s, f.predicted_s, f.events,
                      f.outliers);
    if (!f.fitted) os << "  (" << f.note << ")";
    os << "\n";
    outliers += f.outliers;
  }
  os << "(predicted = the profile before the fit, same events; after = before x predicted / measured)\n";
  if (outliers > 0)
    os << fmt::format(
        "note: {} event(s) more than {:g}x slower than their kind's median (measured / predicted) were "
        "left out as interference (another job, a stall)\n",
        outliers, wlb::model::kOutlierRatio);
  for (const auto& l : fit.links) {
    if (l.fitted)
      os << fmt::format("{:<14} {:>8.3f} {:>8.3f} {:>8}  {} collectives, {:.1f} MB in {:.3f} s (fastest member)\n",
                        l.key, l.before, l.after, pct(l.after, l.before), l.instances, l.bytes / 1e6, l.seconds);
    else
      os << fmt::format("{:<14} {:>8.3f} {:>8} {:>8}  ({})\n", l.key, l.before, "-", "-", l.note);
  }
  if (const auto& sp = fit.spread; sp.fitted)
    os << fmt::format(
        "rank_speed     spread {:.4f} -> {:.4f}, step_spread {:.4f} -> {:.4f}, task_spread {:.4f} -> {:.4f}  ({} "
        "ranks, "
        "{} layer tasks: log of measured / predicted, the ranks' means, their steps' around them, each layer's "
        "around its rank's step)\n",
        sp.before_rank, sp.rank, sp.before_step, sp.step, sp.before_task, sp.task, sp.ranks, sp.tasks) +
              (sp.note.empty() ? "" : "               " + sp.note + "\n");
  else
    os << fmt::format("rank_speed     spread {:.4f}, step_spread {:.4f}, task_spread {:.4f} kept  ({})\n",
                      sp.before_rank, sp.before_step, sp.before_task, sp.note);
  std::string jumps;
  for (const auto& f : fit.factors)
    if (f.fitted && (f.after > 2.0 * f.before || f.after < 0.5 * f.before))
      jumps += (jumps.empty() ? "" : ", ") + f.key;
  if (!jumps.empty())
    os << "note: " << jumps
       << " moved by more than 2x; a run on a busy machine (other jobs on its cores) fits the load, not the "
          "kernels\n";
  if (fit.unmatched_events > 0)
    os << fmt::format("note: {} attention/linear event(s) had no shard plan or FLOPs and were not fitted\n",
                      fit.unmatched_events);
  // Residual per run and strategy: what one factor per op kind cannot remove.
  std::vector<std::pair<std::size_t, std::string>> columns;
  for (const auto& r : fit.residuals)
    if (std::find(columns.begin(), columns.end(), std::make_pair(r.run, r.strategy)) == columns.end())
      columns.push_back({r.run, r.strategy});
  std::sort(columns.begin(), columns.end(), [&](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first < b.first;
    const auto& st = runs[a.first].strategies;
    return std::find(st.begin(), st.end(), a.second) < std::find(st.begin(), st.end(), b.second);
  });
  const auto label = [&](const std::pair<std::size_t, std::string>& c) {
    if (runs.size() == 1) return c.second;
    const fs::path n(names[c.first]);
    return (n.has_parent_path() ? n.parent_path().string() : n.stem().string()) + ":" + c.second;
  };
  std::size_t w = 9;
  for (const auto& c : columns) w = std::max(w, label(c).size());
  os << "residual after the fit, measured / predicted op time per " << (runs.size() > 1 ? "trace and " : "")
     << "strategy (1.000 = exact):\n";
  os << fmt::format("  {:<12}", "factor");
  for (const auto& c : columns) os << fmt::format(" {:>{}}", label(c), w);
  os << "\n";
  for (const auto& key : wlb::model::Factors::keys()) {
    std::string line = fmt::format("  {:<12}", key);
    bool any = false;
    for (const auto& c : columns) {
      double m = 0, p = 0;
      for (const auto& r : fit.residuals)
        if (r.run == c.first && r.strategy == c.second && r.key == key) {
          m += r.measured_s;
          p += r.predicted_s;
        }
      line += p > 0 ? fmt::format(" {:>{}.3f}", m / p, w) : fmt::format(" {:>{}}", "-", w);
      any = any || p > 0;
    }
    if (any) os << line << "\n";
  }

  const nlohmann::json j = wlb::model::applyToJson(pj, fit, names, isoNow());
  // the new profile must load before it replaces anything (it is what the simulator will read);
  // a fit outside the loader's ranges (a CPU profile against a GPU's trace) is told with the
  // report and --out's name, not the temporary's
  try {
    wlb::app::writeAtomically(o.out, "--out", j.dump(2) + "\n", [&](const std::string& tmp) {
      try {
        (void)wlb::model::HardwareProfile::load(tmp);
      } catch (const wlb::InputError& e) {
        std::string why = e.what();
        if (why.rfind(tmp, 0) == 0) why = why.substr(tmp.size() + (why.compare(tmp.size(), 2, ": ") == 0 ? 2 : 0));
        throw wlb::InputError("--out " + o.out + ": the fitted profile would not load (" + why +
                              "): the traces are too far from the profile for its ranges; nothing written");
      }
    });
  } catch (const wlb::InputError&) {
    if (!o.quiet) std::fputs(os.str().c_str(), stdout);
    throw;
  }
  os << "wrote " << o.out << "\n";
  if (!o.quiet) std::fputs(os.str().c_str(), stdout);
  return 0;
}

const bool registered = wlb::app::registerCommand(
    "calibrate", "Fit a hardware profile's factors and links to measured `wlb run` traces; print how far each moved",
    [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      sub.add_option("traces", o->traces, "Measured trace(s) written by `wlb run` (HDF5)")->required();
      sub.add_option("--profile", o->profile,
                     "Profile the runs used (default: the trace deck's [hardware] profile, from the working "
                     "directory)")
          ->type_name("FILE");
      sub.add_option("--out", o->out, "Calibrated profile to write (atomically; may be --profile itself)")
          ->required()
          ->type_name("FILE");
      sub.add_flag("--quiet", o->quiet, "Print nothing");
      return [o]() -> int { return run(*o); };
    });

}  // namespace
