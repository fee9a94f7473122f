/// \file trainer.cpp
/// \brief `wlb train`: packer-driven batches of real tokens, the training loop, evaluation,
/// checkpoints and resume (trainer.hpp, docs/training.md).

#include "train/trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "data/length_source.hpp"
#include "data/prepare.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"
#include "train/llama.hpp"

namespace wlb::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'W', 'L', 'B', 'C', 'K', 'P', 'T', '1'};

// A dataset prefix relative to the deck's directory when PREFIX_train.idx is there, else as given.
std::string resolvePrefix(const Deck& deck, const std::string& prefix) {
  if (prefix.empty() || prefix[0] == '/' || deck.source_path.empty()) return prefix;
  const fs::path cand = fs::path(deck.source_path).parent_path() / prefix;
  if (fs::exists(cand.string() + "_train.idx")) return cand.string();
  return prefix;
}

std::vector<std::int32_t> segmentTokens(const data::IndexedDataset& ds, std::int64_t doc, std::int64_t offset,
                                        std::int64_t length) {
  const auto t = ds.document(doc);
  if (offset + length > static_cast<std::int64_t>(t.size()))
    throw std::logic_error("wlb train: segment past the end of document " + std::to_string(doc));
  return std::vector<std::int32_t>(t.begin() + offset, t.begin() + offset + length);
}

TokenBatch makeBatch(const std::vector<std::vector<std::int32_t>>& segs, const Deck& deck) {
  try {
    return TokenBatch::fromSegments(segs, static_cast<int>(deck.model.vocab));
  } catch (const std::invalid_argument& e) {
    throw InputError(std::string("model.vocab: ") + e.what());
  }
}

// What a checkpoint must agree with: the keys that change the numbers of a run.
nlohmann::json fingerprint(const Deck& d, const std::string& prefix, std::int64_t total_steps) {
  const auto& m = d.model;
  const auto& t = d.train;
  return {{"model.hidden", m.hidden},
          {"model.heads", m.heads},
          {"model.kv_heads", m.kv_heads},
          {"model.ffn", m.ffn},
          {"model.layers", m.layers},
          {"model.vocab", m.vocab},
          {"data.context_window", d.data.context_window},
          {"data.s_max", d.data.s_max},
          {"packing.strategy", d.packing.strategy},
          {"packing.micro_batches", d.packing.micro_batches},
          {"packing.window", d.packing.window},
          {"packing.delay_budget", d.packing.delay_budget},
          {"packing.max_queue_wait", d.packing.max_queue_wait},
          {"packing.outlier_thresholds", d.packing.outlier_thresholds},
          {"train.dataset", fs::absolute(prefix).lexically_normal().string()},
          {"train.steps (resolved)", total_steps},
          {"train.lr", t.lr},
          {"train.min_lr_ratio", t.min_lr_ratio},
          {"train.warmup_steps", t.warmup_steps},
          {"train.weight_decay", t.weight_decay},
          {"train.beta1", t.beta1},
          {"train.beta2", t.beta2},
          {"train.clip", t.clip},
          {"train.seed", t.seed},
          {"train.rope_theta", t.rope_theta}};
}

std::vector<float> toHost(const Vec& v) {
  std::vector<float> h(v.extent(0));
  Kokkos::deep_copy(Kokkos::View<float*, Kokkos::HostSpace>(h.data(), h.size()), v);
  return h;
}
void fromHost(const Vec& v, const std::vector<float>& h) {
  Kokkos::deep_copy(v, Kokkos::View<const float*, Kokkos::HostSpace>(h.data(), h.size()));
}

// One file: magic, u64 header length, JSON header, then weights, m, v (float32, native
// little-endian). Written under .tmp and renamed: a crash leaves the previous checkpoint.
void writeCheckpoint(const std::string& path, const nlohmann::json& header, const std::vector<Vec>& tensors,
                     const TrainOptions& opt) {
  const std::string tmp = path + ".tmp";
  if (opt.track_temporary) opt.track_temporary(tmp, true);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw InputError(fmt::format("{}: cannot write ({})", tmp, std::strerror(errno)));
    const std::string h = header.dump();
    const std::uint64_t n = h.size();
    f.write(kMagic, 8);
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const Vec& t : tensors) {
      const auto v = toHost(t);
      f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    }
    f.close();
    if (!f) throw InputError(fmt::format("{}: write failed ({})", tmp, std::strerror(errno)));
  }
  fs::rename(tmp, path);
  if (opt.track_temporary) opt.track_temporary(tmp, false);
}

nlohmann::json readCheckpoint(const std::string& path, const std::vector<Vec>& tensors) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(fmt::format("{}: no checkpoint to resume from ({})", path, std::strerror(errno)));
  char magic[8];
  std::uint64_t n = 0;
  f.read(magic, 8);
  f.read(reinterpret_cast<char*>(&n), 8);
  if (!f || std::memcmp(magic, kMagic, 8) != 0 || n > (1u << 30))
    throw InputError(path + ": not a wlb training checkpoint (bad magic)");
  std::string h(n, '\0');
  f.read(h.data(), static_cast<std::streamsize>(n));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(h);
  } catch (const std::exception& e) {
    throw InputError(path + ": corrupt checkpoint header (" + e.what() + ")");
  }
  for (const Vec& t : tensors) {
    std::vector<float> v(t.extent(0));
    f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    if (!f) throw InputError(path + ": truncated checkpoint (tensor data)");
    fromHost(t, v);
  }
  return header;
}

// The validation split as micro-batches of whole documents cut into S-token pieces, in
// document order, up to `limit` tokens (0: all).
std::vector<std::vector<std::vector<std::int32_t>>> evalBatches(const data::IndexedDataset& ds, std::int64_t S,
                                                                std::int64_t limit, double& entropy) {
  std::vector<std::vector<std::vector<std::int32_t>>> out;
  std::vector<std::vector<std::int32_t>> cur;
  std::int64_t cur_tokens = 0, total = 0;
  std::map<std::int32_t, std::int64_t> counts;
  for (std::int64_t d = 0; d < ds.documents() && (limit == 0 || total < limit); ++d) {
    const auto t = ds.document(d);
    for (std::size_t off = 0; off < t.size() && (limit == 0 || total < limit);) {
      std::int64_t len = std::min<std::int64_t>(S, static_cast<std::int64_t>(t.size() - off));
      if (limit > 0) len = std::min(len, limit - total);
      if (cur_tokens + len > S) {
        out.push_back(std::move(cur));
        cur.clear();
        cur_tokens = 0;
      }
      cur.emplace_back(t.begin() + static_cast<std::ptrdiff_t>(off),
                       t.begin() + static_cast<std::ptrdiff_t>(off + len));
      for (std::int64_t i = 0; i < len; ++i) ++counts[t[off + static_cast<std::size_t>(i)]];
      cur_tokens += len;
      total += len;
      off += static_cast<std::size_t>(len);
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  entropy = 0;
  for (const auto& [tok, c] : counts) {
    const double p = static_cast<double>(c) / static_cast<double>(total);
    entropy -= p * std::log(p);
  }
  return out;
}

}  // namespace

TrainSummary train(const Deck& deck, const TrainOptions& opt) {
  const auto& mesh = deck.mesh;
  if (mesh.tp != 1 || mesh.cp != 1 || mesh.pp != 1 || mesh.dp != 1)
    throw InputError(
        fmt::format("mesh.tp/cp/pp/dp = {}/{}/{}/{}: wlb train runs on one rank; multi-rank training is not built yet "
                    "(set mesh.tp = mesh.cp = mesh.pp = mesh.dp = 1)",
                    mesh.tp, mesh.cp, mesh.pp, mesh.dp));
  const TrainConfig& tc = deck.train;
  if (tc.dataset.empty()) throw InputError("train.dataset: required (the PREFIX given to `wlb data prepare --out`)");
  const std::string prefix = resolvePrefix(deck, tc.dataset);
  if (!fs::exists(prefix + "_train.idx"))
    throw InputError(
        fmt::format("train.dataset: {}_train.idx does not exist (prepare it with `wlb data prepare "
                    "SRC --out {}`)",
                    prefix, tc.dataset));
  data::IndexedDataset train_ds(prefix + "_train");
  std::unique_ptr<data::IndexedDataset> valid_ds;
  if (fs::exists(prefix + "_valid.idx")) valid_ds = std::make_unique<data::IndexedDataset>(prefix + "_valid");

  // The packers see the documents of the training split through the Megatron length source.
  Deck d = deck;
  d.data.source = "megatron";
  d.data.path = fs::absolute(prefix + "_train.idx").string();
  auto source = data::makeLengthSource(d);
  if (source->documentsPerEpoch() != train_ds.documents())
    throw InputError(
        fmt::format("{}_train.idx: {} documents, of which {} are non-empty: wlb train needs a dataset "
                    "without empty documents (as `wlb data prepare` writes)",
                    prefix, train_ds.documents(), source->documentsPerEpoch()));
  const auto cost = model::CostModel::fromDeck(d);
  auto packer = packing::makePacker(d.packing.strategy, d, cost);

  LlamaConfig mc;
  mc.vocab = static_cast<int>(deck.model.vocab);
  mc.hidden = static_cast<int>(deck.model.hidden);
  mc.heads = static_cast<int>(deck.model.heads);
  mc.kv_heads = static_cast<int>(deck.model.kv_heads);
  mc.ffn = static_cast<int>(deck.model.ffn);
  mc.layers = static_cast<int>(deck.model.layers);
  mc.rope_theta = static_cast<float>(tc.rope_theta);
  try {
    mc.validate();
  } catch (const std::invalid_argument& e) {
    throw InputError(fmt::format("model.hidden / model.heads / model.kv_heads ({} / {} / {}): {}", mc.hidden, mc.heads,
                                 mc.kv_heads, e.what()));
  }
  const std::int64_t S = d.data.context_window;
  const std::int64_t M = data::microBatchesPerReplica(d);
  const std::int64_t per_step = M * S;
  const std::int64_t total_steps = tc.steps > 0 ? tc.steps : (tc.tokens + per_step - 1) / per_step;

  Space space;
  Llama model(mc, tc.seed);
  AdamWConfig oc;
  oc.lr = static_cast<float>(tc.lr);
  oc.min_lr_ratio = static_cast<float>(tc.min_lr_ratio);
  oc.warmup_steps = tc.warmup_steps;
  oc.total_steps = total_steps;
  oc.beta1 = static_cast<float>(tc.beta1);
  oc.beta2 = static_cast<float>(tc.beta2);
  oc.weight_decay = static_cast<float>(tc.weight_decay);
  oc.clip = static_cast<float>(tc.clip);
  AdamW adam(model, oc);

  const fs::path out_dir = deck.output.dir;
  const fs::path ckpt_dir = tc.checkpoint_dir.empty() ? out_dir / "checkpoint" : fs::path(tc.checkpoint_dir);
  const std::string ckpt_path = (ckpt_dir / "checkpoint.wlb").string();
  const std::string log_path = (out_dir / "train_log.jsonl").string();
  const nlohmann::json fp = fingerprint(d, prefix, total_steps);
  const std::vector<Vec> state_tensors{model.weights(), adam.m(), adam.v()};

  TrainSummary sum;
  sum.params = model.paramCount();
  sum.log_path = log_path;
  std::int64_t start = 0, tokens = 0;
  try {
    fs::create_directories(out_dir);
  } catch (const fs::filesystem_error& e) {
    throw InputError(fmt::format("output.dir: cannot create {} ({})", out_dir.string(), e.code().message()));
  }
  if (opt.resume) {
    const nlohmann::json h = readCheckpoint(ckpt_path, state_tensors);
    for (const auto& [k, v] : fp.items())
      if (!h.at("fingerprint").contains(k) || h.at("fingerprint").at(k) != v)
        throw InputError(fmt::format("{}: written with {} = {}, the deck says {} (resume needs the same run)",
                                     ckpt_path, k, h.at("fingerprint").value(k, nlohmann::json()).dump(), v.dump()));
    start = h.at("step").get<std::int64_t>();
    tokens = h.at("tokens").get<std::int64_t>();
    source->loadState(h.at("source"));
    packer->loadState(h.at("packer"));
    // Keep the log of the steps before the checkpoint; later ones are run again.
    std::ifstream in(log_path);
    std::string kept, line;
    while (std::getline(in, line))
      if (!line.empty() && nlohmann::json::parse(line).value("step", std::int64_t{0}) < start) kept += line + "\n";
    std::ofstream(log_path, std::ios::trunc) << kept;
  } else {
    std::ofstream(log_path, std::ios::trunc);
  }
  std::ofstream log(log_path, std::ios::app);
  if (!log) throw InputError(fmt::format("{}: cannot write ({})", log_path, std::strerror(errno)));

  double entropy = 0;
  const auto eval_host = valid_ds && valid_ds->documents() > 0 ? evalBatches(*valid_ds, S, tc.eval_tokens, entropy)
                                                               : std::vector<std::vector<std::vector<std::int32_t>>>{};
  sum.unigram_entropy = entropy;
  auto evaluate = [&]() {
    double loss = 0;
    std::int64_t predicted = 0;
    for (const auto& segs : eval_host) {
      const TokenBatch b = makeBatch(segs, deck);
      loss += model.lossSum(space, b);
      predicted += b.predicted;
    }
    return predicted > 0 ? loss / static_cast<double>(predicted) : -1.0;
  };

  const auto t0 = Clock::now();
  double busy = 0;
  std::int64_t run_tokens = 0;
  bool have_first = false;  // the summary's first loss is that of the first step with tokens
  sum.first_step = start;
  for (std::int64_t step = start; step < total_steps; ++step) {
    const auto docs = source->next(step);
    const StepPlan plan = packer->pack(step, docs);
    const auto ts = Clock::now();
    std::vector<TokenBatch> batches;
    std::int64_t predicted = 0, step_tokens = 0;
    for (const MicroBatch& mb : plan.replicas.at(0)) {
      if (mb.segments.empty()) continue;
      std::vector<std::vector<std::int32_t>> segs;
      for (const Segment& s : mb.segments)
        segs.push_back(segmentTokens(train_ds, s.doc % train_ds.documents(), s.offset, s.length));
      batches.push_back(makeBatch(segs, deck));
      predicted += batches.back().predicted;
      step_tokens += batches.back().n;
    }
    model.zeroGrads(space);
    double loss_sum = 0;
    const float scale = predicted > 0 ? 1.0f / static_cast<float>(predicted) : 0.0f;
    for (const TokenBatch& b : batches) loss_sum += model.forwardBackward(space, b, scale);
    // A step whose micro-batches are all empty (a packer that holds every document back)
    // trains nothing: no update, so weight decay and the moments do not move either.
    const double gnorm = predicted > 0 ? adam.step(space, model, step) : 0.0;
    kk::fence(space, "wlb::train::step");
    const double secs = std::chrono::duration<double>(Clock::now() - ts).count();
    busy += secs;
    run_tokens += step_tokens;
    tokens += step_tokens;
    const double loss = predicted > 0 ? loss_sum / static_cast<double>(predicted) : 0.0;
    if (predicted > 0) {
      if (!have_first) sum.first_loss = loss;
      have_first = true;
      sum.last_loss = loss;
    }
    nlohmann::json rec = {{"step", step},       {"loss", loss},          {"lr", oc.lrAt(step)},
                          {"grad_norm", gnorm}, {"tokens", step_tokens}, {"documents", docs.size()},
                          {"seconds", secs}};
    const bool last = step + 1 == total_steps;
    if ((tc.eval_interval > 0 && (step + 1) % tc.eval_interval == 0) || last) {
      const double ev = evaluate();
      if (ev >= 0) {
        rec["eval_loss"] = ev;
        sum.eval_loss = ev;
      }
    }
    log << rec.dump() << "\n";
    log.flush();
    if (opt.progress && ((step + 1) % tc.log_interval == 0 || last || rec.contains("eval_loss"))) {
      const double el = std::chrono::duration<double>(Clock::now() - t0).count();
      const double eta = el / static_cast<double>(step + 1 - start) * static_cast<double>(total_steps - step - 1);
      std::string ev = rec.contains("eval_loss") ? fmt::format("  eval {:.4f}", rec["eval_loss"].get<double>()) : "";
      std::fprintf(stderr, "wlb train: step %lld/%lld  loss %.4f%s  lr %.3g  gnorm %.3g  %.0f tok/s  ETA %.0f s\n",
                   static_cast<long long>(step + 1), static_cast<long long>(total_steps), loss, ev.c_str(),
                   oc.lrAt(step), gnorm, busy > 0 ? static_cast<double>(run_tokens) / busy : 0.0, eta);
      std::fflush(stderr);
    }
    if (tc.checkpoint_interval > 0 && ((step + 1) % tc.checkpoint_interval == 0 || last)) {
      try {
        fs::create_directories(ckpt_dir);
      } catch (const fs::filesystem_error& e) {
        throw InputError(
            fmt::format("train.checkpoint_dir: cannot create {} ({})", ckpt_dir.string(), e.code().message()));
      }
      nlohmann::json h = {{"format", "wlb-train-checkpoint"},
                          {"version", 1},
                          {"step", step + 1},
                          {"tokens", tokens},
                          {"params", model.paramCount()},
                          {"tensors", {"weights", "adam_m", "adam_v"}},
                          {"fingerprint", fp},
                          {"source", source->saveState()},
                          {"packer", packer->saveState()},
                          // No stochastic op after initialisation (no dropout; data order is
                          // the source's): the seed is the whole RNG state.
                          {"rng", {{"seed", tc.seed}}}};
      writeCheckpoint(ckpt_path, h, state_tensors, opt);
      sum.checkpoint_path = ckpt_path;
    }
    if (opt.kill_after_step == step) std::raise(SIGKILL);
  }
  sum.steps = total_steps;
  sum.tokens = tokens;
  sum.tokens_per_second = busy > 0 ? static_cast<double>(run_tokens) / busy : 0.0;
  return sum;
}

std::string formatSummary(const TrainSummary& s) {
  std::ostringstream os;
  os << fmt::format("steps            {} .. {} (this run: {})\n", s.first_step, s.steps, s.steps - s.first_step);
  os << fmt::format("parameters       {}\n", s.params);
  os << fmt::format("tokens trained   {}\n", s.tokens);
  os << fmt::format("train loss       {:.4f} -> {:.4f} (nats/token)\n", s.first_loss, s.last_loss);
  if (s.eval_loss >= 0)
    os << fmt::format("eval loss        {:.4f} (unigram entropy of the evaluation tokens {:.4f})\n", s.eval_loss,
                      s.unigram_entropy);
  os << fmt::format("throughput       {:.0f} tokens/s\n", s.tokens_per_second);
  os << fmt::format("log              {}\n", s.log_path);
  if (!s.checkpoint_path.empty()) os << fmt::format("checkpoint       {}\n", s.checkpoint_path);
  return os.str();
}

}  // namespace wlb::train
