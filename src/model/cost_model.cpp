#include "model/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "core/json_text.hpp"

namespace wlb::model {

ModelDims ModelDims::fromDeck(const ModelConfig& m) {
  ModelDims d;
  d.hidden = m.hidden;
  d.heads = m.heads;
  d.kv_heads = m.kv_heads;
  d.head_dim = m.head_dim;
  d.ffn = m.ffn;
  d.layers = m.layers;
  d.vocab = m.vocab;
  d.dtype_bytes = m.dtype_bytes;
  return d;
}

namespace {

// Index i and weight t such that log(x) lies between axis[i] and axis[i+1] (clamped).
void bracket(const std::vector<double>& axis, double x, std::size_t& i, double& t) {
  if (axis.size() == 1 || x <= axis.front()) {
    i = 0;
    t = 0.0;
    return;
  }
  if (x >= axis.back()) {
    i = axis.size() - 2;
    t = 1.0;
    return;
  }
  const auto it = std::upper_bound(axis.begin(), axis.end(), x);
  i = static_cast<std::size_t>(it - axis.begin()) - 1;
  const double a = std::log(axis[i]), b = std::log(axis[i + 1]);
  t = (std::log(x) - a) / (b - a);
}

[[noreturn]] void bad(const std::string& file, const std::string& key, const std::string& why) {
  throw InputError(file + ": profile key '" + key + "': " + why);
}

ThroughputTable readTable(const nlohmann::json& j, const std::string& file, const std::string& key) {
  ThroughputTable t;
  auto axis = [&](const char* name) {
    if (!j.contains(name) || !j[name].is_array() || j[name].empty())
      bad(file, key + "." + name, "must be a non-empty array of positive numbers");
    std::vector<double> v;
    for (const auto& x : j[name]) {
      if (!x.is_number() || x.get<double>() <= 0)
        bad(file, key + "." + name, "must be a non-empty array of positive numbers");
      v.push_back(x.get<double>());
    }
    if (!std::is_sorted(v.begin(), v.end()) || std::adjacent_find(v.begin(), v.end()) != v.end())
      bad(file, key + "." + name, "must be strictly ascending");
    return v;
  };
  t.q_lens = axis("q_lens");
  t.k_lens = axis("k_lens");
  if (!j.contains("gflops") || !j["gflops"].is_array() || j["gflops"].size() != t.q_lens.size())
    bad(file, key + ".gflops", "must have one row per q_lens entry");
  for (const auto& row : j["gflops"]) {
    if (!row.is_array() || row.size() != t.k_lens.size())
      bad(file, key + ".gflops", "every row must have one value per k_lens entry");
    std::vector<double> r;
    for (const auto& x : row) {
      if (!x.is_number() || x.get<double>() <= 0) bad(file, key + ".gflops", "values must be positive numbers");
      r.push_back(x.get<double>());
    }
    t.gflops.push_back(std::move(r));
  }
  return t;
}

double positive(const nlohmann::json& j, const char* name, double fallback, const std::string& file,
                const std::string& prefix = "") {
  if (!j.contains(name)) return fallback;
  if (!j[name].is_number() || j[name].get<double>() <= 0) bad(file, prefix + name, "must be a positive number");
  return j[name].get<double>();
}

// A kernel tile edge: a whole number of rows (the padded-FLOP loops step by it).
std::int64_t tileEdge(const nlohmann::json& j, const char* name, std::int64_t fallback, const std::string& file) {
  if (!j.contains(name)) return fallback;
  const auto& v = j[name];
  if (!v.is_number() || v.get<double>() < 1 || v.get<double>() > 65536 ||
      v.get<double>() != std::floor(v.get<double>()))
    bad(file, name, "must be a whole number of rows in [1, 65536]");
  return static_cast<std::int64_t>(v.get<double>());
}

// Linear interpolation of log(value) over log(x) (clamped at the ends); values must be > 0.
double logLogAt(const std::vector<double>& xs, const std::vector<double>& ys, double x) {
  std::size_t i = 0;
  double t = 0;
  bracket(xs, std::max(x, 1e-300), i, t);
  const std::size_t i1 = std::min(i + 1, xs.size() - 1);
  return std::exp((1 - t) * std::log(ys[i]) + t * std::log(ys[i1]));
}

// Linear interpolation of the value over log(x) (clamped): for quantities that may be 0.
double linLogAt(const std::vector<double>& xs, const std::vector<double>& ys, double x) {
  std::size_t i = 0;
  double t = 0;
  bracket(xs, std::max(x, 1e-300), i, t);
  const std::size_t i1 = std::min(i + 1, xs.size() - 1);
  return (1 - t) * ys[i] + t * ys[i1];
}

std::vector<double> numberArray(const nlohmann::json& j, const std::string& file, const std::string& key, std::size_t n,
                                bool allow_zero) {
  const char* why = allow_zero ? "must be an array of one non-negative number per linear_ops.tokens entry"
                               : "must be an array of one positive number per linear_ops.tokens entry";
  if (!j.is_array() || j.size() != n) bad(file, key, why);
  std::vector<double> v;
  for (const auto& x : j) {
    if (!x.is_number() || x.get<double>() < 0 || (!allow_zero && x.get<double>() == 0)) bad(file, key, why);
    v.push_back(x.get<double>());
  }
  return v;
}

LinearOpsTable readLinearOps(const nlohmann::json& j, const std::string& file) {
  const std::string k = "linear_ops";
  if (!j.is_object()) bad(file, k, "must be an object (docs/profile-format.md)");
  LinearOpsTable t;
  if (!j.contains("shape") || !j["shape"].is_object()) bad(file, k + ".shape", "must be an object");
  const auto& sh = j["shape"];
  auto dim = [&](const char* name, std::int64_t& out) {
    if (!sh.contains(name) || !sh[name].is_number_integer() || sh[name].get<std::int64_t>() <= 0)
      bad(file, k + ".shape." + name, "must be a positive integer");
    out = sh[name].get<std::int64_t>();
  };
  dim("hidden", t.hidden);
  dim("heads", t.heads);
  dim("kv_heads", t.kv_heads);
  dim("head_dim", t.head_dim);
  dim("ffn", t.ffn);
  dim("tp", t.tp);
  if (sh.contains("vocab")) dim("vocab", t.vocab);  // profiles written before the model's head: absent
  if (!j.contains("tokens") || !j["tokens"].is_array() || j["tokens"].empty())
    bad(file, k + ".tokens", "must be a non-empty array of positive numbers");
  for (const auto& x : j["tokens"]) {
    if (!x.is_number() || x.get<double>() <= 0)
      bad(file, k + ".tokens", "must be a non-empty array of positive numbers");
    t.tokens.push_back(x.get<double>());
  }
  if (!std::is_sorted(t.tokens.begin(), t.tokens.end()) ||
      std::adjacent_find(t.tokens.begin(), t.tokens.end()) != t.tokens.end())
    bad(file, k + ".tokens", "must be strictly ascending");
  const std::size_t n = t.tokens.size();
  auto phases = [&](const nlohmann::json& parent, const std::string& key, std::array<std::vector<double>, 2>& out,
                    bool allow_zero) {
    if (!parent.is_object()) bad(file, key, "must be an object with fwd and bwd arrays");
    for (int p = 0; p < 2; ++p) {
      const char* ph = p == 0 ? "fwd" : "bwd";
      if (!parent.contains(ph)) bad(file, key + "." + ph, "is missing");
      out[static_cast<std::size_t>(p)] = numberArray(parent[ph], file, key + "." + ph, n, allow_zero);
    }
  };
  if (!j.contains("gflops") || !j["gflops"].is_object()) bad(file, k + ".gflops", "must be an object");
  for (int op = 0; op < kLinearOpCount; ++op) {
    const char* name = linearOpName(static_cast<LinearOp>(op));
    if (!j["gflops"].contains(name)) bad(file, k + ".gflops." + name, "is missing");
    phases(j["gflops"][name], k + ".gflops." + name, t.gflops[static_cast<std::size_t>(op)], false);
  }
  for (const auto& [key, out] :
       {std::pair<const char*, std::array<std::vector<double>, 2>*>{"elementwise_ns_per_token", &t.elementwise_ns},
        {"fill_ns_per_token", &t.fill_ns}}) {
    if (j.contains(key)) {
      phases(j[key], k + "." + key, *out, true);
    } else {
      (*out)[0].assign(n, 0.0);
      (*out)[1].assign(n, 0.0);
    }
  }
  // profiles written before the backward's recomputation was its own event: absent (not priced)
  if (j.contains("recompute_ns_per_token"))
    t.recompute_ns = numberArray(j["recompute_ns_per_token"], file, k + ".recompute_ns_per_token", n, true);
  for (const auto& [key, v] : j.items())
    if (key != "shape" && key != "tokens" && key != "gflops" && key != "elementwise_ns_per_token" &&
        key != "fill_ns_per_token" && key != "recompute_ns_per_token" && key != "note")
      bad(file, k + "." + key,
          "unknown key (shape, tokens, gflops, elementwise_ns_per_token, fill_ns_per_token, "
          "recompute_ns_per_token, note)");
  return t;
}

Factors readFactors(const nlohmann::json& j, const std::string& file) {
  if (!j.is_object()) bad(file, "factors", "must be an object of factor name -> number");
  Factors f;
  for (const auto& [key, v] : j.items()) {
    const auto& keys = Factors::keys();
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      std::string list;
      for (const auto& x : keys) list += (list.empty() ? "" : ", ") + x;
      bad(file, "factors." + key, "unknown factor (known: " + list + ")");
    }
    if (!v.is_number() || v.get<double>() <= 0 || v.get<double>() > 1000)
      bad(file, "factors." + key, "must be a number in (0, 1000]");
    f.at(key) = v.get<double>();
  }
  return f;
}

}  // namespace

const char* linearOpName(LinearOp op) {
  switch (op) {
    case LinearOp::QkvProj:
      return "qkv_proj";
    case LinearOp::OutProj:
      return "out_proj";
    case LinearOp::Mlp:
      return "mlp";
  }
  return "?";
}

bool LinearOpsTable::matches(const ModelDims& d, std::int64_t tp_) const {
  return !empty() && hidden == d.hidden && heads == d.heads && kv_heads == d.kv_heads && head_dim == d.head_dim &&
         ffn == d.ffn && tp == std::max<std::int64_t>(tp_, 1) && (vocab == 0 || vocab == d.vocab);
}

double LinearOpsTable::gflopsAt(LinearOp op, Phase p, double n) const {
  return logLogAt(tokens, gflops[static_cast<std::size_t>(op)][static_cast<std::size_t>(p)], n);
}

double LinearOpsTable::elementwiseNsAt(Phase p, double n) const {
  return linLogAt(tokens, elementwise_ns[static_cast<std::size_t>(p)], n);
}

double LinearOpsTable::fillNsAt(Phase p, double n) const {
  return linLogAt(tokens, fill_ns[static_cast<std::size_t>(p)], n);
}

double LinearOpsTable::recomputeNsAt(double n) const {
  return recompute_ns.empty() ? 0.0 : linLogAt(tokens, recompute_ns, n);
}

const std::vector<std::string>& Factors::keys() {
  static const std::vector<std::string> k = {"attn.fwd",     "attn.bwd", "qkv_proj.fwd", "qkv_proj.bwd", "out_proj.fwd",
                                             "out_proj.bwd", "mlp.fwd",  "mlp.bwd",      "elementwise"};
  return k;
}

double& Factors::at(const std::string& key) {
  if (key == "elementwise") return elementwise;
  const auto dot = key.find('.');
  if (dot != std::string::npos) {
    const std::string op = key.substr(0, dot), ph = key.substr(dot + 1);
    if (ph == "fwd" || ph == "bwd") {
      const std::size_t p = ph == "fwd" ? 0 : 1;
      if (op == "attn") return attn[p];
      for (int i = 0; i < kLinearOpCount; ++i)
        if (op == linearOpName(static_cast<LinearOp>(i))) return linear[static_cast<std::size_t>(i)][p];
    }
  }
  throw std::out_of_range("unknown factor '" + key + "'");
}

double Factors::at(const std::string& key) const {
  return const_cast<Factors*>(this)->at(key);
}

bool Factors::linearIsUnit() const {
  for (const auto& op : linear)
    for (double f : op)
      if (f != 1.0) return false;
  return elementwise == 1.0;
}

double ThroughputTable::at(double q, double k) const {
  std::size_t i = 0;
  double tq = 0;
  bracket(q_lens, q, i, tq);
  const std::size_t i1 = std::min(i + 1, q_lens.size() - 1);
  // Interpolate log-throughput: throughput curves are closer to linear in log space. Each
  // row is read at k >= its own q: cells with k < q are ignored (docs/profile-format.md),
  // also in the row above q that the interpolation blends in.
  auto row = [&](std::size_t a) {
    std::size_t j = 0;
    double tk = 0;
    bracket(k_lens, std::max({k, q, q_lens[a]}), j, tk);
    const std::size_t j1 = std::min(j + 1, k_lens.size() - 1);
    return (1 - tk) * std::log(gflops[a][j]) + tk * std::log(gflops[a][j1]);
  };
  return std::exp((1 - tq) * row(i) + tq * row(i1));
}

HardwareProfile HardwareProfile::analytic() {
  return HardwareProfile{};
}

HardwareProfile HardwareProfile::load(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError("hardware profile '" + path + "' is a directory, not a JSON file");
  std::ifstream in(path);
  if (!in) throw InputError("cannot open hardware profile '" + path + "'");
  nlohmann::json j;
  try {
    // the whole file (text after the JSON is damage, not ignored)
    j = parseJsonText(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw InputError(path + ": not valid JSON (byte " + std::to_string(e.byte) + "): " + e.what());
  } catch (const nlohmann::json::exception& e) {  // a number past the range of a double
    throw InputError(path + ": not valid JSON: " + e.what());
  }
  return fromJson(j, path);
}

HardwareProfile HardwareProfile::fromJson(const nlohmann::json& j, const std::string& path) {
  HardwareProfile p;
  // A misspelt key would be ignored and its default used without a word: the closed tables
  // (links, rank_speed) take their own keys only, and a top-level key one letter from one
  // the model reads is taken for a slip (other top-level keys are free metadata:
  // description, notes, measured, ...).
  const auto onlyKeys = [&](const nlohmann::json& o, const std::string& table, const std::vector<std::string>& known) {
    for (const auto& [key, value] : o.items())
      if (std::find(known.begin(), known.end(), key) == known.end())
        bad(path, table + key, "unknown key (did you mean '" + table + nearest(key, known) + "'?)");
  };
  try {
    if (!j.is_object() || j.value("format", std::string()) != "wlb-hardware-profile")
      bad(path, "format", "must be \"wlb-hardware-profile\"");
    static const std::vector<std::string> kRead = {
        "format",    "version",    "name",       "peak_gflops", "linear_gflops", "attention_efficiency",
        "tile_q",    "tile_k",     "head_dim",   "calibration", "attention",     "links",
        "memory_gb", "rank_speed", "linear_ops", "factors",     "topology",      "sources"};
    static const std::vector<std::string> kMeta = {
        "source", "description", "notes", "measured", "measured_fma_gflops", "created", "backend", "deck_profile"};
    for (const auto& [key, value] : j.items())
      if (std::find(kRead.begin(), kRead.end(), key) == kRead.end() &&
          std::find(kMeta.begin(), kMeta.end(), key) == kMeta.end())
        if (const std::string near = nearest(key, kRead); editDistance(key, near) <= 1)
          bad(path, key, "unknown key (did you mean '" + near + "'?)");
    if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<std::int64_t>() < 1 ||
        j["version"].get<std::int64_t>() > 2)
      bad(path, "version", "must be 1 or 2");
    p.version = j["version"].get<int>();
    if (j.contains("name") && !j["name"].is_string()) bad(path, "name", "must be a string");
    p.name = j.value("name", std::filesystem::path(path).stem().string());
    p.peak_gflops = positive(j, "peak_gflops", p.peak_gflops, path);
    p.linear_gflops = positive(j, "linear_gflops", p.linear_gflops, path);
    p.attention_efficiency = positive(j, "attention_efficiency", p.attention_efficiency, path);
    if (p.attention_efficiency > 2.0) bad(path, "attention_efficiency", "must be in (0, 2]");
    p.tile_q = tileEdge(j, "tile_q", p.tile_q, path);
    p.tile_k = tileEdge(j, "tile_k", p.tile_k, path);
    // Not used by the cost model, but what the tables were measured at and what calibrate
    // appends to: checked so that a damaged file is named here, not rewritten later.
    if (j.contains("head_dim") && (!j["head_dim"].is_number_integer() || j["head_dim"].get<std::int64_t>() < 1 ||
                                   j["head_dim"].get<std::int64_t>() > 1024))
      bad(path, "head_dim", "must be an integer in [1, 1024]");
    if (j.contains("calibration")) {
      bool ok = j["calibration"].is_array();
      for (const auto& c : ok ? j["calibration"] : nlohmann::json::array()) ok = ok && c.is_object();
      if (!ok) bad(path, "calibration", "must be a list of calibration records (objects)");
    }
    if (j.contains("attention")) {
      const auto& a = j["attention"];
      if (!a.is_object() || !a.contains("fwd") || !a.contains("bwd"))
        bad(path, "attention", "needs fwd and bwd tables");
      p.fwd = readTable(a["fwd"], path, "attention.fwd");
      p.bwd = readTable(a["bwd"], path, "attention.bwd");
    }
    if (j.contains("links")) {
      const auto& l = j["links"];
      if (!l.is_object()) bad(path, "links", "must be an object {tp_gbps, cp_gbps, pp_gbps, dp_gbps, latency_us}");
      onlyKeys(l, "links.", {"tp_gbps", "cp_gbps", "pp_gbps", "dp_gbps", "latency_us"});
      p.tp_bandwidth_gbps = positive(l, "tp_gbps", p.tp_bandwidth_gbps, path, "links.");
      p.cp_bandwidth_gbps = positive(l, "cp_gbps", p.cp_bandwidth_gbps, path, "links.");
      p.pp_bandwidth_gbps = positive(l, "pp_gbps", p.pp_bandwidth_gbps, path, "links.");
      p.dp_bandwidth_gbps = positive(l, "dp_gbps", p.dp_bandwidth_gbps, path, "links.");
      p.link_latency_us = positive(l, "latency_us", p.link_latency_us, path, "links.");
    }
    p.memory_gb = positive(j, "memory_gb", p.memory_gb, path);
    if (j.contains("rank_speed")) {
      const auto& r = j["rank_speed"];
      if (!r.is_object()) bad(path, "rank_speed", "must be an object {spread, step_spread, task_spread}");
      onlyKeys(r, "rank_speed.", {"spread", "step_spread", "task_spread"});
      const auto spread = [&](const char* key) {
        if (!r.contains(key)) return 0.0;
        if (!r[key].is_number() || r[key].get<double>() < 0 || r[key].get<double>() >= 1)
          bad(path, std::string("rank_speed.") + key, "must be a number in [0, 1)");
        return r[key].get<double>();
      };
      p.rank_spread = spread("spread");
      p.step_spread = spread("step_spread");
      p.task_spread = spread("task_spread");
    }
    if (j.contains("linear_ops")) p.linear_ops = readLinearOps(j["linear_ops"], path);
    if (j.contains("factors")) p.factors = readFactors(j["factors"], path);
  } catch (const nlohmann::json::exception& e) {  // a field of the wrong JSON type
    throw InputError(path + ": " + e.what());
  }
  return p;
}

std::string HardwareProfile::pathOf(const Deck& deck) {
  namespace fs = std::filesystem;
  const std::string& name = deck.hardware.profile;
  if (name.empty() || name == "analytic") return {};
  const fs::path p(name);
  // Relative to the deck first, then to the working directory: never a folder of the
  // machine the binary was built on, which a copied deck would silently read instead.
  if (p.is_relative() && !deck.source_path.empty()) {
    const auto rel = fs::path(deck.source_path).parent_path() / p;
    if (fs::exists(rel)) return rel.string();
  }
  return fs::exists(p) ? p.string() : std::string();
}

HardwareProfile HardwareProfile::fromDeck(const Deck& deck) {
  const auto& h = deck.hardware;
  HardwareProfile p;
  if (h.profile != "analytic") {
    const std::string path = pathOf(deck);
    if (path.empty()) throw InputError("[hardware] profile: file '" + h.profile + "' not found");
    p = load(path);
  }
  if (h.tp_bandwidth_gbps > 0) p.tp_bandwidth_gbps = h.tp_bandwidth_gbps;
  if (h.cp_bandwidth_gbps > 0) p.cp_bandwidth_gbps = h.cp_bandwidth_gbps;
  if (h.pp_bandwidth_gbps > 0) p.pp_bandwidth_gbps = h.pp_bandwidth_gbps;
  if (h.dp_bandwidth_gbps > 0) p.dp_bandwidth_gbps = h.dp_bandwidth_gbps;
  if (h.link_latency_us > 0) p.link_latency_us = h.link_latency_us;
  if (h.memory_gb > 0) p.memory_gb = h.memory_gb;
  return p;
}

double HardwareProfile::attnGflops(Phase p, double q, double k) const {
  const ThroughputTable& t = p == Phase::Fwd ? fwd : bwd;
  const double f = factors.attn[static_cast<std::size_t>(p)];
  if (!t.empty()) return attention_efficiency * t.at(q, k) * f;
  // Analytic: a piece of few query tiles keeps few tiles in flight, so the rate rises
  // with the tile count. Counted in whole tiles because the padded FLOPs already charge
  // a partial tile in full (the measured tables are flat below tile_q); counting rows
  // here would charge a short piece twice and make 1 query dearer than 10.
  const double tq = static_cast<double>(std::max<std::int64_t>(tile_q, 1));
  const double q_pad = std::ceil(std::max(q, 1.0) / tq) * tq;
  const double eff = 0.7 * q_pad / (q_pad + tq);
  return std::max(attention_efficiency * peak_gflops * eff * f, 1e-3);
}

CostModel::CostModel(const ModelDims& dims, HardwareProfile hw, std::int64_t tp)
    : dims_(dims), hw_(std::move(hw)), tp_(tp < 1 ? 1 : tp) {
  linear_table_ = hw_.linear_ops.matches(dims_, tp_);
  if (linear_table_) {
    const auto& t = hw_.linear_ops.tokens;
    linear_ref_tokens_ = std::sqrt(t.front() * t.back());
  }
}

void CostModel::setLinearReferenceTokens(double tokens) {
  if (tokens > 0) linear_ref_tokens_ = tokens;
}

CostModel CostModel::fromDeck(const Deck& deck) {
  CostModel c(ModelDims::fromDeck(deck.model), HardwareProfile::fromDeck(deck), deck.mesh.tp);
  // a rank's share of a full micro-batch: the size the deck's linear ops run at
  c.setLinearReferenceTokens(static_cast<double>(deck.data.context_window) /
                             static_cast<double>(std::max<std::int64_t>(deck.mesh.cp, 1)));
  return c;
}

double CostModel::attnFlops(std::int64_t q0, std::int64_t q, Phase p) const {
  if (q <= 0) return 0.0;
  const double heads = static_cast<double>(dims_.heads) / static_cast<double>(tp_);
  const double f = attention::forwardFlops(attnPairs(q0, q), 1, dims_.head_dim) * heads;
  return p == Phase::Fwd ? f : kAttnBwdFactor * f;
}

double CostModel::attnPaddedFlops(std::int64_t q0, std::int64_t q, Phase p) const {
  if (q <= 0) return 0.0;
  // The pairs of the whole tile_q x tile_k blocks a tiled kernel visits (attention/flops.hpp)
  attention::KernelConfig tiles;
  tiles.tile_q = static_cast<int>(hw_.tile_q);
  tiles.tile_k = static_cast<int>(hw_.tile_k);
  const double heads = static_cast<double>(dims_.heads) / static_cast<double>(tp_);
  const double f = attention::forwardFlops(attention::paddedPairs(q, q0 + q, tiles), 1, dims_.head_dim) * heads;
  return p == Phase::Fwd ? f : kAttnBwdFactor * f;
}

double CostModel::attnSeconds(std::int64_t q0, std::int64_t q, Phase p) const {
  if (q <= 0) return 0.0;
  const double gf = hw_.attnGflops(p, static_cast<double>(q), static_cast<double>(q0 + q));
  return attnPaddedFlops(q0, q, p) / (gf * 1e9);
}

double CostModel::linearFlops(std::int64_t tokens, Phase p) const {
  const double h = static_cast<double>(dims_.hidden);
  const double kv = static_cast<double>(dims_.kv_heads * dims_.head_dim);
  const double ffn = static_cast<double>(dims_.ffn);
  // QKV (h -> h + 2 kv), out-proj (h -> h), SwiGLU MLP (3 matrices h x ffn); 2 FLOPs/MAC.
  const double per_token = 2.0 * (h * (h + 2.0 * kv) + h * h + 3.0 * h * ffn) / static_cast<double>(tp_);
  const double f = per_token * static_cast<double>(tokens);
  return p == Phase::Fwd ? f : kLinearBwdFactor * f;
}

double CostModel::linearSeconds(std::int64_t tokens, Phase p) const {
  // A version-1 profile (or a table for another shape) with unit factors: one throughput.
  if (!linear_table_ && hw_.factors.linearIsUnit()) return linearFlops(tokens, p) / (hw_.linear_gflops * 1e9);
  if (tokens <= 0) return 0.0;
  double s = elementwiseSeconds(tokens, p);
  for (int op = 0; op < kLinearOpCount; ++op) s += linearOpSeconds(static_cast<LinearOp>(op), tokens, p);
  return s;
}

double CostModel::linearOpFlops(LinearOp op, std::int64_t tokens, Phase p) const {
  const double h = static_cast<double>(dims_.hidden);
  const double kv = static_cast<double>(dims_.kv_heads * dims_.head_dim);
  const double ffn = static_cast<double>(dims_.ffn);
  double per_token = 0;
  switch (op) {
    case LinearOp::QkvProj:
      per_token = 2.0 * h * (h + 2.0 * kv);
      break;
    case LinearOp::OutProj:
      per_token = 2.0 * h * h;
      break;
    case LinearOp::Mlp:
      per_token = 2.0 * 3.0 * h * ffn;
      break;
  }
  const double f = per_token / static_cast<double>(tp_) * static_cast<double>(tokens);
  return p == Phase::Fwd ? f : kLinearBwdFactor * f;
}

double CostModel::linearOpSeconds(LinearOp op, std::int64_t tokens, Phase p) const {
  if (tokens <= 0) return 0.0;
  const double gf = linear_table_ ? hw_.linear_ops.gflopsAt(op, p, linear_ref_tokens_) : hw_.linear_gflops;
  const double f = hw_.factors.linear[static_cast<std::size_t>(op)][static_cast<std::size_t>(p)];
  return linearOpFlops(op, tokens, p) / (gf * f * 1e9);
}

double CostModel::elementwiseSeconds(std::int64_t tokens, Phase p) const {
  if (!linear_table_ || tokens <= 0) return 0.0;
  const double n = linear_ref_tokens_;
  const double layers = static_cast<double>(std::max<std::int64_t>(dims_.layers, 1));
  const double ns = hw_.linear_ops.elementwiseNsAt(p, n) + hw_.linear_ops.fillNsAt(p, n) / layers;
  return ns * static_cast<double>(tokens) * 1e-9 / hw_.factors.elementwise;
}

double CostModel::recomputeSeconds(std::int64_t tokens) const {
  if (!recomputeTimed() || tokens <= 0) return 0.0;
  const double ns = hw_.linear_ops.recomputeNsAt(linear_ref_tokens_);
  return ns * static_cast<double>(tokens) * 1e-9 / hw_.factors.elementwise;
}

double CostModel::kvBytes(std::int64_t tokens) const {
  const double kv_heads_local = std::max(1.0, static_cast<double>(dims_.kv_heads) / static_cast<double>(tp_));
  return 2.0 * static_cast<double>(tokens) * kv_heads_local * static_cast<double>(dims_.head_dim) *
         static_cast<double>(dims_.dtype_bytes);
}

}  // namespace wlb::model
