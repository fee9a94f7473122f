#include "model/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.hpp"

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
    if (!std::is_sorted(v.begin(), v.end()) ||
        std::adjacent_find(v.begin(), v.end()) != v.end())
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

}  // namespace

double ThroughputTable::at(double q, double k) const {
  std::size_t i = 0, j = 0;
  double tq = 0, tk = 0;
  bracket(q_lens, q, i, tq);
  bracket(k_lens, std::max(k, q), j, tk);
  const std::size_t i1 = std::min(i + 1, q_lens.size() - 1), j1 = std::min(j + 1, k_lens.size() - 1);
  // Interpolate log-throughput: throughput curves are closer to linear in log space.
  auto lg = [&](std::size_t a, std::size_t b) { return std::log(gflops[a][b]); };
  const double v = (1 - tq) * ((1 - tk) * lg(i, j) + tk * lg(i, j1)) + tq * ((1 - tk) * lg(i1, j) + tk * lg(i1, j1));
  return std::exp(v);
}

HardwareProfile HardwareProfile::analytic() { return HardwareProfile{}; }

HardwareProfile HardwareProfile::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError("cannot open hardware profile '" + path + "'");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::parse_error& e) {
    throw InputError(path + ": not valid JSON (byte " + std::to_string(e.byte) + "): " + e.what());
  }
  if (!j.is_object() || j.value("format", std::string()) != "wlb-hardware-profile")
    bad(path, "format", "must be \"wlb-hardware-profile\"");
  if (j.value("version", 0) != 1) bad(path, "version", "must be 1");
  HardwareProfile p;
  p.name = j.value("name", std::filesystem::path(path).stem().string());
  p.peak_gflops = positive(j, "peak_gflops", p.peak_gflops, path);
  p.linear_gflops = positive(j, "linear_gflops", p.linear_gflops, path);
  p.attention_efficiency = positive(j, "attention_efficiency", p.attention_efficiency, path);
  if (p.attention_efficiency > 2.0) bad(path, "attention_efficiency", "must be in (0, 2]");
  p.tile_q = static_cast<std::int64_t>(positive(j, "tile_q", static_cast<double>(p.tile_q), path));
  p.tile_k = static_cast<std::int64_t>(positive(j, "tile_k", static_cast<double>(p.tile_k), path));
  if (j.contains("attention")) {
    const auto& a = j["attention"];
    if (!a.is_object() || !a.contains("fwd") || !a.contains("bwd")) bad(path, "attention", "needs fwd and bwd tables");
    p.fwd = readTable(a["fwd"], path, "attention.fwd");
    p.bwd = readTable(a["bwd"], path, "attention.bwd");
  }
  if (j.contains("links")) {
    const auto& l = j["links"];
    p.tp_bandwidth_gbps = positive(l, "tp_gbps", p.tp_bandwidth_gbps, path, "links.");
    p.cp_bandwidth_gbps = positive(l, "cp_gbps", p.cp_bandwidth_gbps, path, "links.");
    p.pp_bandwidth_gbps = positive(l, "pp_gbps", p.pp_bandwidth_gbps, path, "links.");
    p.dp_bandwidth_gbps = positive(l, "dp_gbps", p.dp_bandwidth_gbps, path, "links.");
    p.link_latency_us = positive(l, "latency_us", p.link_latency_us, path, "links.");
  }
  p.memory_gb = positive(j, "memory_gb", p.memory_gb, path);
  return p;
}

HardwareProfile HardwareProfile::fromDeck(const Deck& deck) {
  const auto& h = deck.hardware;
  HardwareProfile p;
  if (h.profile != "analytic") {
    std::filesystem::path path(h.profile);
    if (path.is_relative() && !deck.source_path.empty()) {
      // Relative to the deck first, then to the working directory, then the source tree.
      auto rel = std::filesystem::path(deck.source_path).parent_path() / path;
      if (std::filesystem::exists(rel)) path = rel;
    }
    if (!std::filesystem::exists(path) && std::filesystem::path(h.profile).is_relative()) {
      auto src = std::filesystem::path(WLB_SOURCE_DIR) / h.profile;
      if (std::filesystem::exists(src)) path = src;
    }
    if (!std::filesystem::exists(path))
      throw InputError("[hardware] profile: file '" + h.profile + "' not found");
    p = load(path.string());
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
  if (!t.empty()) return attention_efficiency * t.at(q, k);
  // Analytic: short query tiles pay fixed per-row overheads (softmax, rescaling).
  const double eff = 0.7 * q / (q + static_cast<double>(tile_q));
  return std::max(attention_efficiency * peak_gflops * eff, 1e-3);
}

CostModel::CostModel(const ModelDims& dims, HardwareProfile hw, std::int64_t tp)
    : dims_(dims), hw_(std::move(hw)), tp_(tp < 1 ? 1 : tp) {}

CostModel CostModel::fromDeck(const Deck& deck) {
  return CostModel(ModelDims::fromDeck(deck.model), HardwareProfile::fromDeck(deck), deck.mesh.tp);
}

double CostModel::attnFlops(std::int64_t q0, std::int64_t q, Phase p) const {
  if (q <= 0) return 0.0;
  const double heads = static_cast<double>(dims_.heads) / static_cast<double>(tp_);
  const double f = 4.0 * attnPairs(q0, q) * static_cast<double>(dims_.head_dim) * heads;
  return p == Phase::Fwd ? f : kAttnBwdFactor * f;
}

double CostModel::attnPaddedFlops(std::int64_t q0, std::int64_t q, Phase p) const {
  if (q <= 0) return 0.0;
  // A tiled kernel visits, per query tile, every key tile up to the diagonal: count
  // whole tile_q x tile_k blocks of the bottom-right-aligned causal trapezoid.
  const std::int64_t tq = hw_.tile_q, tk = hw_.tile_k;
  double blocks = 0.0;
  for (std::int64_t r0 = 0; r0 < q; r0 += tq) {
    const std::int64_t last_row = std::min(r0 + tq, q) - 1;  // within the piece
    const std::int64_t keys = q0 + last_row + 1;              // keys seen by that row
    blocks += static_cast<double>((keys + tk - 1) / tk);
  }
  const double heads = static_cast<double>(dims_.heads) / static_cast<double>(tp_);
  const double f = 4.0 * blocks * static_cast<double>(tq * tk) * static_cast<double>(dims_.head_dim) * heads;
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
  return linearFlops(tokens, p) / (hw_.linear_gflops * 1e9);
}

double CostModel::kvBytes(std::int64_t tokens) const {
  const double kv_heads_local = std::max(1.0, static_cast<double>(dims_.kv_heads) / static_cast<double>(tp_));
  return 2.0 * static_cast<double>(tokens) * kv_heads_local * static_cast<double>(dims_.head_dim) *
         static_cast<double>(dims_.dtype_bytes);
}

}  // namespace wlb::model
