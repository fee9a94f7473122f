// The simulator's validation loop behind `wlb validate-sim` (profile/validate_sim.hpp,
// docs/simulator.md § Validating on this machine).
#include "profile/validate_sim.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "core/json_text.hpp"
#include "core/output_file.hpp"
#include "model/cost_model.hpp"
#include "trace/reader.hpp"

extern char** environ;

namespace wlb::profile {
namespace {

namespace fs = std::filesystem;

struct DeckCase {
  std::string path, name;  ///< file, unique short name (stem)
  wlb::Deck deck;
  int ranks = 1;
  bool calibrates = true;
};

std::string quote(const std::string& a) {
  if (!a.empty() && a.find_first_of(" \t\"'\\$`;&|<>()*?[]{}~!#") == std::string::npos) return a;
  std::string q = "'";
  for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string joinArgs(const std::vector<std::string>& args) {
  std::string s;
  for (const auto& a : args) s += (s.empty() ? "" : " ") + quote(a);
  return s;
}

std::string selfExe() {
  std::error_code ec;
  const auto p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("wlb") : p.string();
}

/// Environment for the children without the variables this process's own MPI start put there
/// (a singleton's or mpirun's job ids): a nested `mpirun` or `wlb` must start a job of its own.
/// glibc malloc settings for every stage (unless --malloc-default or GLIBC_TUNABLES is set):
/// the executor allocates each op's outputs fresh; with glibc's dynamic mmap threshold and heap
/// trimming, buffers of a few MB go back to the OS and are first-touch faulted again on the next
/// op, as often as each process's heap history decides (rank 0, which also plans and writes
/// plans, faulted 2.8x as often as rank 1 in a dp2 run: 40% of its step). Up to 32 MB from the
/// heap and no trimming below 4 GB make every rank's ops what the profile measures.
constexpr const char* kMallocTunables =
    "GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296";

std::vector<std::string> childEnv(bool malloc_tuned) {
  static const char* drop[] = {"OMPI_COMM_WORLD_",
                               "OMPI_MCA_orte_",
                               "OMPI_MCA_ess",
                               "ORTE_",
                               "OMPI_MCA_pmix",
                               "PMIX_",
                               "OMPI_UNIVERSE_SIZE",
                               "OMPI_FIRST_RANKS",
                               "OMPI_APP_CTX_",
                               "OMPI_NUM_APP_CTX",
                               "OMPI_FILE_LOCATION",
                               "OMPI_MCA_initial_wdir",
                               "OMPI_MCA_mpi_yield_when_idle",
                               "OMPI_MCA_shmem_RUNTIME_QUERY_hint",
                               "OMPI_ARGV",
                               "OMPI_COMMAND",
                               "OMPI_MCA_ompi_",
                               "OMPI_MCA_orte_precondition_transports",
                               "OMPI_MCA_state_",
                               "PRTE_",
                               "PMI_",
                               "HYDRA_",
                               "MPI_LOCALRANKID",
                               "MPI_LOCALNRANKS"};
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string v(*e);
    bool keep = true;
    for (const char* d : drop)
      if (v.rfind(d, 0) == 0) keep = false;
    if (keep) env.push_back(v);
  }
  env.push_back("OPENBLAS_NUM_THREADS=1");
  if (malloc_tuned && !std::getenv("GLIBC_TUNABLES")) env.push_back(kMallocTunables);
  return env;
}

std::string tail(const fs::path& log, std::size_t lines) {
  std::ifstream in(log);
  std::deque<std::string> last;
  std::string l;
  while (std::getline(in, l)) {
    last.push_back(l);
    if (last.size() > lines) last.pop_front();
  }
  std::string s;
  for (const auto& x : last) s += "    " + x + "\n";
  return s;
}

double loadAvg() {
  std::ifstream in("/proc/loadavg");
  double l = -1;
  in >> l;
  return l;
}

std::string cpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string l;
  while (std::getline(in, l))
    if (l.rfind("model name", 0) == 0) {
      const auto c = l.find(':');
      if (c != std::string::npos) return l.substr(l.find_first_not_of(" \t", c + 1));
    }
  return "unknown CPU";
}

/// The stages of one validation: each runs as a child process, is printed to `out` and
/// recorded (command, exit, seconds, CPU seconds, load average).
struct Stages {
  std::FILE* out = stdout;
  bool malloc_tuned = true;
  ChildTracker track_child;  // the driver passes signals on to the running stage
  std::vector<nlohmann::json> record;

  /// Run `args` with stdout+stderr into `log`; returns the exit code (StageFailed on failure).
  int run(const std::string& title, const std::vector<std::string>& args, const fs::path& log,
          bool echo_output = false);
};

int Stages::run(const std::string& title, const std::vector<std::string>& args, const fs::path& log, bool echo_output) {
  std::fprintf(out, "\n== %s\n   $ %s\n", title.c_str(), joinArgs(args).c_str());
  std::fflush(out);
  const double load0 = loadAvg();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> env = childEnv(malloc_tuned);
  std::vector<char*> argv, envp;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("wlb validate-sim: fork failed: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
    }
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::execvpe(argv[0], argv.data(), envp.data());
    std::fprintf(stderr, "cannot run %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  if (track_child) track_child(static_cast<int>(pid), true);
  int status = 0;
  struct rusage ru {};
  while (::wait4(pid, &status, 0, &ru) < 0 && errno == EINTR) {
  }
  if (track_child) track_child(static_cast<int>(pid), false);
  // CPU time of the stage and every process it waited for (mpirun's ranks)
  const double cpu = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                     1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double load1 = loadAvg();
  record.push_back({{"stage", title},
                    {"command", joinArgs(args)},
                    {"exit", rc},
                    {"seconds", secs},
                    {"cpu_seconds", cpu},
                    {"load_before", load0},
                    {"load_after", load1}});
  if (rc != 0) {
    std::fprintf(out, "   FAILED (exit %d) after %.1f s; last lines of %s:\n%s", rc, secs, log.string().c_str(),
                 tail(log, 25).c_str());
    if (rc == 127 || (args.front().find("mpirun") != std::string::npos && rc != 2))
      std::fprintf(out,
                   "   (is mpirun on PATH? as root: `source run/mpienv` first; --mpirun CMD names another launcher)\n");
    std::fflush(out);
    throw StageFailed(title + ": exit " + std::to_string(rc), rc == 2 ? 2 : 1);
  }
  if (echo_output) {
    std::ifstream in(log);
    std::string l;
    while (std::getline(in, l))
      if (l.rfind("wlb profile:", 0) != 0 || l.rfind("wlb profile: wrote", 0) == 0)
        std::fprintf(out, "   %s\n", l.c_str());
  }
  std::fprintf(out, "   done in %.1f s (load average %.2f -> %.2f); log %s\n", secs, load0, load1,
               log.string().c_str());
  std::fflush(out);
  return rc;
}

nlohmann::json readJson(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw std::runtime_error("wlb validate-sim: stage output " + p.string() + " is missing");
  return parseJsonText(in);
}

/// Segments of every planned step in a trace: (strategy, step, dp, mb, index) -> (doc, offset, length).
std::map<std::tuple<std::string, std::int64_t, int, int, int>, std::tuple<std::int64_t, std::int64_t, std::int64_t>>
planSegments(const std::string& path) {
  const auto tr = wlb::trace::readTrace(path);
  std::map<std::tuple<std::string, std::int64_t, int, int, int>, std::tuple<std::int64_t, std::int64_t, std::int64_t>>
      m;
  for (const auto& s : tr.segments)
    m[{tr.strategies.at(static_cast<std::size_t>(s.strategy)), s.step, s.dp, s.micro_batch, s.index}] = {
        s.doc, s.offset, s.length};
  return m;
}

struct Row {
  std::string deck, strategy;
  double measured = 0, predicted = 0, error = 0;  ///< tokens/s, % (predicted / measured - 1)
  double speedup_measured = 1, speedup_predicted = 1;
  std::int64_t drain_measured = 0, drain_predicted = 0;
  double round_min = 0, round_max = 0;  ///< measured tokens/s over the rounds
};

std::string ordering(std::vector<std::pair<std::string, double>> v) {
  std::stable_sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " > ") + x.first;
  return s;
}

}  // namespace

ValidateSimResult validateSim(const ValidateSimOptions& o) {
  if (o.decks.empty()) throw wlb::InputError("wlb validate-sim: no decks given");
  if (!(o.tolerance > 0) || !std::isfinite(o.tolerance))
    throw wlb::InputError("--tolerance must be a number > 0 (percent)");
  if (o.no_calibrate && !o.calibrate_on.empty())
    throw wlb::InputError("--no-calibrate and --calibrate-on contradict each other: give one");
  if (o.seed_offset < 0) throw wlb::InputError("--seed-offset must be >= 0");
  if (o.rounds < 1) throw wlb::InputError("--rounds must be >= 1");
  if (o.steps == 0 || o.steps < -1) throw wlb::InputError("--steps must be >= 1");
  if (o.warmup < -1) throw wlb::InputError("--warmup must be >= 0");
  if (!o.profile.empty()) {  // read now, not in the first measured run's child process
    if (!fs::exists(o.profile)) throw wlb::InputError("--profile: '" + o.profile + "' not found");
    try {
      (void)wlb::model::HardwareProfile::load(o.profile);
    } catch (const wlb::InputError& e) {
      throw wlb::InputError(std::string("--profile: ") + e.what());
    }
  }

  // Every deck is validated before anything runs.
  std::vector<DeckCase> cases;
  std::set<std::string> names;
  for (const auto& p : o.decks) {
    DeckCase c;
    c.path = p;
    c.deck = wlb::loadDeck(p, o.overrides);
    wlb::requireOneCase(c.deck, p, "wlb validate-sim");
    if (c.deck.run.strategies.size() < 2)
      throw wlb::InputError(p + ": run.strategies lists fewer than two strategies: nothing to order");
    c.ranks = static_cast<int>(c.deck.mesh.size());
    c.name = fs::path(p).stem().string();
    for (int i = 2; names.count(c.name); ++i) c.name = fs::path(p).stem().string() + "-" + std::to_string(i);
    names.insert(c.name);
    cases.push_back(std::move(c));
  }
  if (!o.calibrate_on.empty()) {
    for (auto& c : cases) c.calibrates = false;
    for (const auto& want : o.calibrate_on) {
      bool found = false;
      for (auto& c : cases)
        if (c.name == want || c.path == want || fs::path(c.path).filename() == want) c.calibrates = found = true;
      if (!found) throw wlb::InputError("--calibrate-on: '" + want + "' is none of the decks given");
    }
  }

  std::vector<std::string> mpirun;
  {
    std::istringstream is(o.mpirun);
    std::string w;
    while (is >> w) mpirun.push_back(w);
    if (mpirun.empty()) throw wlb::InputError("--mpirun is empty");
    // The launcher must exist before a profile is measured for runs it could not start.
    bool found = mpirun[0].find('/') != std::string::npos && ::access(mpirun[0].c_str(), X_OK) == 0;
    if (mpirun[0].find('/') == std::string::npos) {
      std::istringstream path(std::getenv("PATH") != nullptr ? std::getenv("PATH") : "");
      for (std::string dir; !found && std::getline(path, dir, ':');)
        found = !dir.empty() && ::access((dir + "/" + mpirun[0]).c_str(), X_OK) == 0;
    }
    if (!found)
      throw wlb::InputError("--mpirun: '" + mpirun[0] +
                            "' is not an executable (on PATH); as root `source run/mpienv` first");
  }
  checkOutputFolder(o.out, "--out");  // a file or an unwritable place, named before any work
  const fs::path out = fs::absolute(o.out);
  static constexpr const char* kStageFolders[] = {"logs", "calibration", "validation", "simulation"};
  for (const char* sub : kStageFolders) {  // all checked before any is made
    std::error_code ec;
    if (fs::exists(out / sub, ec) && !fs::is_directory(out / sub, ec))
      throw InputError(fmt::format("--out '{}': {} is a file, not a folder", o.out, (out / sub).string()));
  }
  for (const char* sub : kStageFolders) {
    std::error_code ec;
    fs::create_directories(out / sub, ec);
    if (ec)
      throw InputError(
          fmt::format("--out '{}': cannot create the folder {} ({})", o.out, (out / sub).string(), ec.message()));
  }
  const fs::path logs = out / "logs";
  const std::string wlb = o.wlb.empty() ? selfExe() : o.wlb;
  const auto steps_args = [&](std::vector<std::string>& a) {
    if (o.steps > 0) a.insert(a.end(), {"--steps", std::to_string(o.steps)});
    if (o.warmup >= 0) a.insert(a.end(), {"--warmup", std::to_string(o.warmup)});
  };
  const auto set_args = [&](std::vector<std::string>& a) {
    for (const auto& s : o.overrides) a.insert(a.end(), {"--set", s});
  };
  Stages stages;
  stages.out = o.log;
  stages.malloc_tuned = !o.malloc_default;
  stages.track_child = o.track_child;
  const auto t_all = std::chrono::steady_clock::now();
  const std::string malloc_mode = std::getenv("GLIBC_TUNABLES") ? std::string("GLIBC_TUNABLES as set by the caller")
                                  : stages.malloc_tuned
                                      ? std::string(kMallocTunables).substr(std::strlen("GLIBC_TUNABLES="))
                                      : std::string("glibc defaults (--malloc-default)");
  const std::string cpu = cpuModel();
  const unsigned cores = std::thread::hardware_concurrency();

  std::fprintf(o.log,
               "wlb validate-sim: %zu deck(s) on %s (%u cores); tolerance %.1f%% on throughput per strategy and the "
               "same ordering; output %s\n",
               cases.size(), cpu.c_str(), cores, o.tolerance, out.string().c_str());
  {
    std::string how;
    if (o.no_calibrate) {
      how = "not calibrated (--no-calibrate): the profile as measured";
    } else if (o.calibrate_on.empty()) {
      how = "each deck calibrated on its own run with data.seed";
    } else {
      for (const auto& c : cases)
        if (c.calibrates) how += (how.empty() ? "" : ", ") + c.name;
      how = "one profile calibrated on the runs of " + how + " (data.seed) for every deck";
    }
    std::fprintf(o.log, "  %s; validated with data.seed + %lld (documents the calibration did not see); malloc: %s\n",
                 how.c_str(), static_cast<long long>(o.seed_offset), malloc_mode.c_str());
  }

  try {
    // 1. Profile (the decks' shapes, planned as they run) unless one is given.
    fs::path profile = o.profile.empty() ? out / "profile.json" : fs::absolute(o.profile);
    if (o.profile.empty()) {
      std::vector<std::string> a{wlb, "profile", "--out", profile.string(), "--name", "validate-sim"};
      for (const auto& c : cases) a.insert(a.end(), {"--deck", c.path});
      set_args(a);
      if (o.quick) a.push_back("--quick");
      stages.run("profile: plan the decks, time their layer ops and attention pieces", a, logs / "profile.log", true);
    }
    // Measured runs: `rounds` of them, the fastest kept (the profile is best-of-repetitions
    // too: it describes the machine undisturbed); every round's throughput is reported.
    struct Measured {
      fs::path dir;                                       ///< the fastest round's output.dir
      std::map<std::string, std::vector<double>> rounds;  ///< strategy -> tokens/s per round
      double core_share = 0;                              ///< of the fastest round
    };
    const auto measure = [&](const DeckCase& c, const std::string& kind, const fs::path& prof,
                             const std::string& seed) {
      Measured m;
      double best = -1;
      for (int r = 0; r < o.rounds; ++r) {
        const fs::path dir = out / kind / (c.name + (o.rounds > 1 ? "-r" + std::to_string(r + 1) : ""));
        std::vector<std::string> a = mpirun;
        a.insert(a.end(), {"-n", std::to_string(c.ranks), wlb, "run", c.path});
        set_args(a);
        a.insert(a.end(), {"--set", "hardware.profile=\"" + prof.string() + "\"", "--set", "data.seed=" + seed, "--set",
                           "output.dir=\"" + dir.string() + "\"", "--set", "output.trace=\"trace.h5\""});
        steps_args(a);
        stages.run("measured " + kind + " run: " + c.name + " (data.seed = " + seed + ", " + std::to_string(c.ranks) +
                       " ranks" +
                       (o.rounds > 1 ? ", round " + std::to_string(r + 1) + "/" + std::to_string(o.rounds) : "") + ")",
                   a, logs / (kind + "-" + c.name + (o.rounds > 1 ? "-r" + std::to_string(r + 1) : "") + ".log"));
        const auto& st = stages.record.back();
        const double share = st["cpu_seconds"].get<double>() /
                             (static_cast<double>(c.ranks) * std::max(st["seconds"].get<double>(), 1e-9));
        std::fprintf(
            o.log,
            "   core share %.2f (CPU seconds of the ranks / (ranks x wall seconds); below ~0.9 other jobs took "
            "part of their cores)\n",
            share);
        stages.record.back()["core_share"] = share;
        const auto summary = readJson(dir / "summary.json");
        double score = 0;
        for (const auto& st : summary.at("strategies")) {
          const double t = st.at("tokens_per_second").get<double>();
          m.rounds[st.at("strategy").get<std::string>()].push_back(t);
          score += t;
        }
        if (score > best) {
          best = score;
          m.dir = dir;
          m.core_share = share;
        }
      }
      if (o.rounds > 1) std::fprintf(o.log, "   fastest round: %s\n", m.dir.filename().string().c_str());
      return m;
    };
    // 2-3. Calibration runs and the fit: each deck on its own documents (default), or one
    // profile from the --calibrate-on decks for every deck (a cross-deck prediction).
    std::map<std::string, fs::path> calibrated;  // deck name -> profile its validation uses
    for (const auto& c : cases) calibrated[c.name] = profile;
    const auto fit = [&](const std::vector<std::string>& traces, const fs::path& to, const std::string& what) {
      std::vector<std::string> a{wlb, "calibrate"};
      a.insert(a.end(), traces.begin(), traces.end());
      a.insert(a.end(), {"--profile", profile.string(), "--out", to.string()});
      stages.run(
          "calibrate: fit the profile's factors to " + what, a,
          logs / ("calibrate" +
                  (to.stem().string() == "profile.calibrated" ? std::string() : "-" + to.stem().string()) + ".log"),
          true);
    };
    if (!o.no_calibrate && o.calibrate_on.empty()) {
      for (const auto& c : cases) {
        const Measured m = measure(c, "calibration", profile, std::to_string(c.deck.data.seed));
        calibrated[c.name] = out / ("profile.calibrated." + c.name + ".json");
        fit({(m.dir / "trace.h5").string()}, calibrated[c.name], c.name + "'s calibration run");
      }
    } else if (!o.no_calibrate) {
      std::vector<std::string> traces, names;
      for (const auto& c : cases) {
        if (!c.calibrates) continue;
        const Measured m = measure(c, "calibration", profile, std::to_string(c.deck.data.seed));
        traces.push_back((m.dir / "trace.h5").string());
        names.push_back(c.name);
      }
      const fs::path joint = out / "profile.calibrated.json";
      std::string list;
      for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
      fit(traces, joint, "the calibration runs of " + list);
      for (const auto& c : cases) calibrated[c.name] = joint;
    }
    // 4-5. Validation runs on other documents and the simulation of the same steps.
    std::vector<Row> rows;
    nlohmann::json deck_json = nlohmann::json::array();
    bool all_ok = true;
    double worst = 0;
    for (const auto& c : cases) {
      const std::string seed = std::to_string(c.deck.data.seed + static_cast<std::uint64_t>(o.seed_offset));
      const Measured mv = measure(c, "validation", calibrated[c.name], seed);
      const fs::path vdir = mv.dir, sdir = out / "simulation" / c.name;
      std::vector<std::string> s{wlb, "simulate", c.path, "--as-run"};
      set_args(s);
      s.insert(s.end(), {"--set", "hardware.profile=\"" + calibrated[c.name].string() + "\"", "--set",
                         "data.seed=" + seed, "--out", sdir.string(), "--trace", (sdir / "trace.h5").string()});
      steps_args(s);
      stages.run("simulate --as-run: " + c.name + " (same deck, profile and documents)", s,
                 logs / ("simulate-" + c.name + ".log"));

      // 6. Compare.
      const auto summary = readJson(vdir / "summary.json");
      const auto sim = readJson(sdir / "simulate.json");
      std::vector<std::pair<std::string, double>> meas_order, pred_order;
      nlohmann::json jrows = nlohmann::json::array();
      for (const auto& m : summary.at("strategies")) {
        Row r;
        r.deck = c.name;
        r.strategy = m.at("strategy").get<std::string>();
        r.measured = m.at("tokens_per_second").get<double>();
        r.speedup_measured = m.at("speedup").get<double>();
        r.drain_measured = m.at("drain_steps").get<std::int64_t>();
        bool found = false;
        for (const auto& p : sim)
          if (p.at("strategy").get<std::string>() == r.strategy) {
            r.predicted = p.at("tokens_per_second").get<double>();
            r.speedup_predicted = p.at("speedup").get<double>();
            r.drain_predicted = p.at("drain_steps").get<std::int64_t>();
            found = true;
          }
        if (!found) throw std::runtime_error("wlb validate-sim: simulate.json has no row for " + r.strategy);
        const auto& rr = mv.rounds.at(r.strategy);
        r.round_min = *std::min_element(rr.begin(), rr.end());
        r.round_max = *std::max_element(rr.begin(), rr.end());
        r.error = r.measured > 0 ? (r.predicted / r.measured - 1.0) * 100.0 : 0.0;
        worst = std::max(worst, std::abs(r.error));
        if (std::abs(r.error) > o.tolerance) all_ok = false;
        meas_order.push_back({r.strategy, r.measured});
        pred_order.push_back({r.strategy, r.predicted});
        jrows.push_back({{"strategy", r.strategy},
                         {"measured_tokens_per_second", r.measured},
                         {"predicted_tokens_per_second", r.predicted},
                         {"error_percent", r.error},
                         {"measured_speedup", r.speedup_measured},
                         {"predicted_speedup", r.speedup_predicted},
                         {"measured_tokens_per_second_rounds", rr},
                         {"measured_drain_steps", r.drain_measured},
                         {"predicted_drain_steps", r.drain_predicted}});
        rows.push_back(r);
      }
      const std::string mo = ordering(meas_order), po = ordering(pred_order);
      // Pairs in opposite order. A pair the measurement itself cannot order (measured closer
      // than either strategy's spread over the rounds) is a tie, not a miss; with one round
      // every swap counts.
      std::string swapped;
      bool order_ok = true;
      const auto spread = [&](const std::string& st) {
        const auto& v = mv.rounds.at(st);
        const double hi = *std::max_element(v.begin(), v.end()), lo = *std::min_element(v.begin(), v.end());
        return hi > 0 ? (hi - lo) / hi * 100.0 : 0.0;
      };
      for (std::size_t i = 0; i < meas_order.size(); ++i)
        for (std::size_t j = i + 1; j < meas_order.size(); ++j) {
          const double dm = meas_order[i].second - meas_order[j].second,
                       dp = pred_order[i].second - pred_order[j].second;
          if (dm * dp >= 0) continue;
          const double gap = std::abs(dm) / std::max(meas_order[i].second, meas_order[j].second) * 100.0;
          const double noise = std::max(spread(meas_order[i].first), spread(meas_order[j].first));
          const bool tie = gap <= noise;
          order_ok = order_ok && tie;
          swapped +=
              fmt::format("{}{} / {} (measured {:.1f}% apart, rounds spread {:.1f}%: {})", swapped.empty() ? "" : ", ",
                          meas_order[i].first, meas_order[j].first, gap, noise, tie ? "a tie" : "a miss");
        }
      if (!order_ok) all_ok = false;
      // the simulation must have predicted the plans that ran
      const auto ms = planSegments((vdir / "trace.h5").string()), ps = planSegments((sdir / "trace.h5").string());
      std::size_t differ = 0;
      for (const auto& [k, v] : ms) {
        const auto it = ps.find(k);
        if (it == ps.end() || it->second != v) ++differ;
      }
      differ += ps.size() > ms.size() ? ps.size() - ms.size() : 0;
      deck_json.push_back(
          {{"deck", c.name},
           {"file", fs::path(c.path).filename().string()},
           {"ranks", c.ranks},
           {"data_seed", std::stoull(seed)},
           {"calibrated_on", o.no_calibrate           ? std::string("-")
                             : o.calibrate_on.empty() ? c.name + " (data.seed " + std::to_string(c.deck.data.seed) + ")"
                                                      : calibrated[c.name].filename().string()},
           {"profile", calibrated[c.name].filename().string()},
           {"validation_core_share", mv.core_share},
           {"measured_order", mo},
           {"predicted_order", po},
           {"same_order", mo == po},
           {"order_ok", order_ok},
           {"swapped_pairs", swapped},
           {"plan_segments", ms.size()},
           {"plan_segments_differing", differ},
           {"strategies", jrows}});
    }

    // Table.
    std::ostringstream os;
    os << "\nwlb validate-sim: measured (wlb run) vs predicted (wlb simulate --as-run) throughput on " << cpu << "\n";
    os << fmt::format("{:<16} {:<10} {:>13} {:>13} {:>8} {:>11} {:>11} {:>7}\n", "deck", "strategy", "measured",
                      "predicted", "error", "speedup", "speedup", "drain");
    os << fmt::format("{:<16} {:<10} {:>13} {:>13} {:>8} {:>11} {:>11} {:>7}\n", "", "", "ktok/s", "ktok/s", "",
                      "measured", "predicted", "m/p");
    for (const auto& r : rows)
      os << fmt::format(
          "{:<16} {:<10} {:>13.3f} {:>13.3f} {:>+7.1f}% {:>10.3f}x {:>10.3f}x {:>3}/{:<3}{}\n", r.deck, r.strategy,
          r.measured / 1e3, r.predicted / 1e3, r.error, r.speedup_measured, r.speedup_predicted, r.drain_measured,
          r.drain_predicted,
          (o.rounds > 1 ? fmt::format("  rounds {:.3f}-{:.3f}", r.round_min / 1e3, r.round_max / 1e3) : std::string()) +
              (std::abs(r.error) > o.tolerance ? "  over tolerance" : ""));
    for (const auto& d : deck_json) {
      os << fmt::format(
          "{:<16} ordering by throughput: measured {}; predicted {}: {}; core share of the measured "
          "run {:.2f}\n",
          d["deck"].get<std::string>(), d["measured_order"].get<std::string>(), d["predicted_order"].get<std::string>(),
          d["same_order"].get<bool>() ? "same"
          : d["order_ok"].get<bool>() ? "same up to ties"
                                      : "DIFFERENT",
          d["validation_core_share"].get<double>());
      if (!d["swapped_pairs"].get<std::string>().empty())
        os << fmt::format("{:<16} swapped: {}\n", "", d["swapped_pairs"].get<std::string>());
      if (d["plan_segments_differing"].get<std::size_t>() > 0)
        os << fmt::format("{:<16} note: {} of {} planned segments differ between the measured and the simulated run\n",
                          "", d["plan_segments_differing"].get<std::size_t>(), d["plan_segments"].get<std::size_t>());
    }
    double load_max = 0, share_min = 1, cpu_secs = 0;  // cpu: the stages' processes (the command only waits)
    bool shares = false;
    for (const auto& st : stages.record) {
      cpu_secs += st["cpu_seconds"].get<double>();
      if (st["stage"].get<std::string>().rfind("measured", 0) == 0) {
        load_max = std::max({load_max, st["load_before"].get<double>(), st["load_after"].get<double>()});
        if (st.contains("core_share")) {
          shares = true;
          share_min = std::min(share_min, st["core_share"].get<double>());
        }
      }
    }
    // The core share says whether the ranks got their cores; the load average counts the
    // ranks' own helper threads too (a pipeline's progress thread), so it decides only
    // where no share was measured.
    if (share_min < 0.9 || (!shares && load_max > static_cast<double>(cores) + 0.5))
      os << fmt::format(
          "note: the measured runs shared their cores with other jobs (core share down to {:.2f}, load "
          "average up to {:.1f} on {} cores): the errors include that interference; measure on a quiet "
          "machine (--rounds N keeps the fastest of N runs)\n",
          share_min, load_max, cores);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_all).count();
    os << fmt::format(
        "error = predicted / measured - 1 (tokens/s over measured + drain steps); max |error| {:.1f}% "
        "vs tolerance {:.1f}%: {}; {:.0f} s in all\n",
        worst, o.tolerance, all_ok ? "PASS" : "FAIL", secs);
    nlohmann::json j = {{"format", "wlb-validate-sim"},
                        {"version", 1},
                        {"cpu", cpu},
                        {"cores", cores},
                        {"tolerance_percent", o.tolerance},
                        {"seed_offset", o.seed_offset},
                        {"calibrated", !o.no_calibrate},
                        {"profile", profile.filename().string()},
                        {"calibration", o.no_calibrate           ? "none"
                                        : o.calibrate_on.empty() ? "per deck"
                                                                 : "joint"},
                        {"max_abs_error_percent", worst},
                        {"rounds", o.rounds},
                        {"malloc", malloc_mode},
                        {"max_load_average", load_max},
                        {"min_core_share", share_min},
                        {"pass", all_ok},
                        {"seconds", secs},
                        {"cpu_seconds", cpu_secs},
                        {"decks", deck_json},
                        {"stages", stages.record}};
    wlb::writeFileAtomically((out / "validation.json").string(), "validation.json", j.dump(2) + "\n",
                             o.track_temporary);
    ValidateSimResult r;
    r.pass = all_ok;
    r.max_abs_error_percent = worst;
    r.table = os.str();
    r.report = std::move(j);
    r.out = out.string();
    return r;
  } catch (const StageFailed& f) {
    throw StageFailed("a stage failed (see above); outputs so far are in " + out.string(), f.exitCode());
  }
}

}  // namespace wlb::profile
