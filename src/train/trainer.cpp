/// \file trainer.cpp
/// \brief `wlb train`: packer-driven batches of real tokens, the training loop on a TP x CP
/// x PP x DP mesh, evaluation, checkpoints and resume, training metrics in the trace (trainer.hpp,
/// docs/training.md).

#include "train/trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/json_text.hpp"
#include "core/kokkos_compat.hpp"
#include "core/mesh_shape.hpp"
#include "core/output_file.hpp"
#include "cp/shard_plan.hpp"
#include "data/indexed_dataset.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "model/deck_inputs.hpp"
#include "packing/packer.hpp"
#include "packing/plan_io.hpp"
#include "packing/runner.hpp"
#include "packing/simulate_deck.hpp"
#include "parallel/comm.hpp"
#include "parallel/group_comm.hpp"
#include "parallel/mesh.hpp"
#include "parallel/progress_thread.hpp"
#include "pp/schedule.hpp"
#include "pp/simulator.hpp"
#include "runtime/gemm.hpp"
#include "runtime/llama.hpp"
#include "runtime/pipeline.hpp"
#include "runtime/run.hpp"
#include "runtime/tokens.hpp"
#include "trace/clock_sync.hpp"
#include "trace/recorder.hpp"
#include "trace/writer.hpp"
#include "train/optimizer.hpp"

namespace wlb::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using runtime::Llama;
using runtime::LlamaConfig;
using runtime::Mat;
using runtime::Space;
using runtime::TensorInfo;
using runtime::Vec;

constexpr char kMagic[8] = {'W', 'L', 'B', 'C', 'K', 'P', 'T', '1'};

// FNV-1a over bytes: the final weights' hash and the identity of a checkpoint header or file.
std::uint64_t fnv1a(const void* data, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// A file's identity for the fingerprint: FNV-1a of all of it, or for a large one of its size
// and 64 blocks of 4 KiB spread over it (a re-prepared or edited dataset under the same path).
std::string fileHash(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "unreadable";
  f.seekg(0, std::ios::end);
  const auto size = static_cast<std::int64_t>(f.tellg());
  constexpr std::int64_t kBlock = 4096, kBlocks = 64;
  std::string bytes;
  if (size <= kBlock * kBlocks) {
    bytes.resize(static_cast<std::size_t>(size));
    f.seekg(0);
    f.read(bytes.data(), size);
  } else {
    std::string block(static_cast<std::size_t>(kBlock), '\0');
    for (std::int64_t b = 0; b < kBlocks; ++b) {
      f.seekg((size - kBlock) / (kBlocks - 1) * b);
      f.read(block.data(), kBlock);
      bytes += block;
    }
  }
  return fmt::format("{} bytes, {:016x}", size, fnv1a(bytes.data(), bytes.size()));
}

// What a checkpoint must agree with: the keys that change the numbers of a run.
nlohmann::json fingerprint(const Deck& d, const std::string& prefix, std::int64_t total_steps) {
  const auto& m = d.model;
  const auto& t = d.train;
  nlohmann::json fp = {
      {"model.hidden", m.hidden},
      {"model.heads", m.heads},
      {"model.kv_heads", m.kv_heads},
      {"model.ffn", m.ffn},
      {"model.layers", m.layers},
      {"model.vocab", m.vocab},
      {"mesh.dp", d.mesh.dp},  // the packer's replicas (mesh.cp may change: same numbers up to rounding)
      {"mesh.tp", d.mesh.tp},  // the checkpoint's tensor layout (TP slices)
      {"mesh.pp", d.mesh.pp},  // and its pipeline stages
      {"mesh.virtual_stages", pp::pipelineLayout(d).chunks},  // and the stages' layer blocks
      {"run.precision", d.run.precision},                     // bf16 working copy and activations vs fp32
      {"data.context_window", d.data.context_window},
      {"data.s_max", d.data.s_max},
      {"packing.strategy", d.packing.strategy},
      {"packing.micro_batches", d.packing.micro_batches},
      {"packing.window", d.packing.window},
      {"packing.delay_budget", d.packing.delay_budget},
      {"packing.max_queue_wait", d.packing.max_queue_wait},
      {"packing.outlier_thresholds", d.packing.outlier_thresholds},
      // The levels the packer uses: [] and the defaults written out are one run.
      {"packing.outlier_thresholds (resolved)", packing::PackerOptions::fromDeck(d).outlier_thresholds},
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
      {"train.eval_tokens", t.eval_tokens},  // what every evaluation loss of the log averages
      {"train.rope_theta", t.rope_theta},
      // The tokens themselves, and the profile and memory the packer plans with.
      {"train.dataset (files)", fileHash(prefix + "_train.idx") + "; " + fileHash(prefix + "_train.bin")},
      // The evaluation losses of the log average over the validation split.
      {"train.dataset (validation files)",
       fs::exists(prefix + "_valid.idx") ? fileHash(prefix + "_valid.idx") + "; " + fileHash(prefix + "_valid.bin")
                                         : std::string("none")},
      {"hardware.profile",
       d.hardware.profile == "analytic" ? std::string("analytic") : fileHash(model::HardwareProfile::pathOf(d))},
      {"hardware.memory_gb", d.hardware.memory_gb}};
  // The executor's recomputation changes no number, so a run that ran out of memory may
  // resume with "selective"; SlimPack's packer plans with the activation bytes it sets.
  if (d.packing.strategy == "slimpack") fp["pipeline.recompute"] = d.pipeline.recompute;
  return fp;
}

std::vector<float> toHost(const Vec& v) {
  std::vector<float> h(v.extent(0));
  Kokkos::deep_copy(Kokkos::View<float*, Kokkos::HostSpace>(h.data(), h.size()), v);
  return h;
}
void fromHost(const Vec& v, const std::vector<float>& h) {
  Kokkos::deep_copy(v, Kokkos::View<const float*, Kokkos::HostSpace>(h.data(), h.size()));
}

// A checkpoint tensor's checksum (FNV-1a over 8-byte words, then the tail): a flipped or
// edited byte, or tensors from another file under this header, fail the resume.
std::string checksumBytes(const void* data, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return fmt::format("{:016x}", h);
}

std::string checksum(const std::vector<float>& v) {
  return checksumBytes(v.data(), v.size() * sizeof(float));
}

// The header's own checksum: over its JSON as dumped without this key (dump(parse(dump(x)))
// is dump(x)), so an edited held piece or cursor fails the resume like an edited tensor.
std::string headerChecksum(nlohmann::json header) {
  header.erase("header_checksum");
  const std::string text = header.dump();
  return checksumBytes(text.data(), text.size());
}

// One file: magic, u64 header length, JSON header, then weights, m, v (float32, native
// little-endian). Written under .tmp and renamed: a crash leaves the previous checkpoint.
void writeCheckpoint(const std::string& path, const nlohmann::json& header,
                     const std::vector<std::vector<float>>& tensors, const TrainOptions& opt) {
  const std::string tmp = path + ".tmp";
  if (opt.track_temporary) opt.track_temporary(tmp, true);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw InputError(fmt::format("{}: cannot write ({})", tmp, std::strerror(errno)));
    nlohmann::json sealed = header;
    sealed["header_checksum"] = headerChecksum(header);
    const std::string h = sealed.dump();
    const std::uint64_t n = h.size();
    f.write(kMagic, 8);
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const auto& v : tensors)
      f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    f.close();
    if (!f) {
      const std::string why = std::strerror(errno);
      std::error_code ec;
      fs::remove(tmp, ec);  // no half-written checkpoint beside the last good one
      if (opt.track_temporary) opt.track_temporary(tmp, false);
      throw InputError(fmt::format("{}: write failed ({})", tmp, why));
    }
  }
  fs::rename(tmp, path);
  if (opt.track_temporary) opt.track_temporary(tmp, false);
}

// Each state tensor (weights, AdamW m, v) is stored whole: the flat buffers of the stages
// in order, each stage's as its TP ranks' slices back to back (tp order). This rank (stage
// pp_rank, TP rank tp_rank) loads its own; `stage_params` are the per-TP-rank sizes of
// every stage of the deck's model (Llama::layout).
// The checkpoint's fingerprint against the deck's: a difference names the key.
void checkFingerprint(const std::string& path, const nlohmann::json& header, const nlohmann::json& fp) {
  const bool resolved_levels = header.at("fingerprint").contains("packing.outlier_thresholds (resolved)");
  for (const auto& [k, v] : fp.items()) {
    if (k == "packing.outlier_thresholds" && resolved_levels) continue;  // the resolved levels decide
    nlohmann::json was = header.at("fingerprint").value(k, nlohmann::json());
    if (was.is_null() && (k == "mesh.dp" || k == "mesh.tp" || k == "mesh.pp" || k == "mesh.virtual_stages"))
      was = 1;  // written before multi-rank training / interleaved stages
    // Recorded since this version; an older checkpoint's value is unknown (run.precision
    // already took effect then), so it is not held against the deck.
    if (was.is_null() && (k == "run.precision" || k == "train.eval_tokens" || k == "train.dataset (files)" ||
                          k == "hardware.profile" || k == "hardware.memory_gb" || k == "pipeline.recompute" ||
                          k == "packing.outlier_thresholds (resolved)" || k == "train.dataset (validation files)"))
      continue;
    if (was != v)
      throw InputError(fmt::format("{}: written with {} = {}, the deck says {} (resume needs the same run)", path, k,
                                   was.dump(), v.dump()));
  }
}

nlohmann::json readCheckpoint(const std::string& path, const std::vector<Vec>& tensors, int tp, int tp_rank,
                              const std::vector<std::int64_t>& stage_params, int pp_rank, const nlohmann::json& fp) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw InputError(path + ": is a directory, not a training checkpoint");
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
    header = parseJsonText(h);
  } catch (const std::exception& e) {
    throw InputError(path + ": corrupt checkpoint header (" + e.what() + ")");
  }
  // Older checkpoints carry none.
  if (header.is_object() && header.contains("header_checksum") && header["header_checksum"] != headerChecksum(header))
    throw InputError(path + ": the header does not match its checksum (a corrupt or edited file)");
  // Before the tensors, whose sizes follow the deck: another model names its key, not a size.
  try {
    if (header.at("format") != "wlb-train-checkpoint" || header.at("version") != 1)
      throw InputError(fmt::format("{}: not a wlb-train-checkpoint version 1 (format {}, version {})", path,
                                   header.at("format").dump(), header.at("version").dump()));
    checkFingerprint(path, header, fp);
    const auto step = header.at("step").get<std::int64_t>();
    const auto steps = fp.at("train.steps (resolved)").get<std::int64_t>();
    if (step < 0 || step > steps)
      throw InputError(fmt::format("{}: step {} is not a step of this run (0 .. {})", path, step, steps));
    if (header.at("tokens").get<std::int64_t>() < 0)
      throw InputError(fmt::format("{}: tokens {} must be >= 0", path, header.at("tokens").get<std::int64_t>()));
    if (header.contains("adam_updates")) {
      const auto& u = header.at("adam_updates");
      if (!u.is_number_integer() || u.get<std::int64_t>() < 0)
        throw InputError(fmt::format("{}: adam_updates {} is not a count of updates", path, u.dump()));
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path + ": corrupt checkpoint header (" + e.what() + ")");
  }
  if (header.value("tp", 1) != tp)
    throw InputError(fmt::format("{}: written with mesh.tp = {}, the deck says {} (resume needs the same run)", path,
                                 header.value("tp", 1), tp));
  const int pp = static_cast<int>(stage_params.size());
  if (header.value("pp", 1) != pp)
    throw InputError(fmt::format("{}: written with mesh.pp = {}, the deck says {} (resume needs the same run)", path,
                                 header.value("pp", 1), pp));
  const std::int64_t mine = stage_params[static_cast<std::size_t>(pp_rank)];
  std::int64_t total = 0, at = 0;
  for (int s = 0; s < pp; ++s) {
    if (s == pp_rank) at = total + mine * tp_rank;
    total += stage_params[static_cast<std::size_t>(s)] * tp;
  }
  if (header.contains("params") && header["params"] != total)
    throw InputError(
        fmt::format("{}: holds {} floats per tensor, the deck's model has {}", path, header["params"].dump(), total));
  const nlohmann::json sums = header.value("checksums", nlohmann::json::array());  // older ones carry none
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Vec& t = tensors[i];
    if (static_cast<std::int64_t>(t.extent(0)) != mine)
      throw std::logic_error("readCheckpoint: tensor size differs from the stage's layout");
    std::vector<float> v(static_cast<std::size_t>(total));
    f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    if (!f) throw InputError(path + ": truncated checkpoint (tensor data)");
    if (i < sums.size() && sums[i] != checksum(v))
      throw InputError(fmt::format("{}: the {} tensor does not match its checksum (a corrupt or edited file)", path,
                                   header.at("tensors").at(i).get<std::string>()));
    fromHost(t, std::vector<float>(v.begin() + at, v.begin() + at + mine));
  }
  if (f.peek() != std::char_traits<char>::eof())
    throw InputError(path + ": bytes after the tensors (not one checkpoint file)");
  return header;
}

// The validation split as micro-batches of whole documents cut into S-token pieces, in
// document order, up to `limit` tokens (0: all), and the unigram entropy of those tokens.
std::vector<MicroBatch> evalBatches(const data::IndexedDataset& ds, std::int64_t S, std::int64_t limit,
                                    double& entropy) {
  std::vector<MicroBatch> out;
  MicroBatch cur;
  std::int64_t cur_tokens = 0, total = 0;
  std::map<std::int32_t, std::int64_t> counts;
  for (std::int64_t d = 0; d < ds.documents() && (limit == 0 || total < limit); ++d) {
    const auto t = ds.document(d);
    for (std::size_t off = 0; off < t.size() && (limit == 0 || total < limit);) {
      std::int64_t len = std::min<std::int64_t>(S, static_cast<std::int64_t>(t.size() - off));
      if (limit > 0) len = std::min(len, limit - total);
      if (cur_tokens + len > S) {
        out.push_back(std::move(cur));
        cur = MicroBatch();
        cur_tokens = 0;
      }
      Segment seg;
      seg.doc = d;
      seg.offset = static_cast<std::int64_t>(off);
      seg.length = len;
      cur.segments.push_back(seg);
      for (std::int64_t i = 0; i < len; ++i) ++counts[t[off + static_cast<std::size_t>(i)]];
      cur_tokens += len;
      total += len;
      off += static_cast<std::size_t>(len);
    }
  }
  if (!cur.segments.empty()) out.push_back(std::move(cur));
  entropy = 0;
  for (const auto& [tok, c] : counts) {
    const double p = static_cast<double>(c) / static_cast<double>(total);
    entropy -= p * std::log(p);
  }
  return out;
}

// Per-rank timings of a step, gathered to rank 0 for /train/ranks.
enum RankCol : int {
  kStepS,
  kDataS,
  kComputeS,
  kAttnS,
  kCpCommS,
  kTpCommS,
  kAllreduceS,
  kOptimizerS,
  kEvalS,
  kTokens,
  kAllocs,
  kPoolBytes,
  kLiveBytes,
  kAskedBytes,
  kCols
};

}  // namespace

TrainSummary train(const Deck& deck, const TrainOptions& opt) {
  const auto& mc_deck = deck.mesh;
  // Deck-only checks: every rank sees the same deck, so every rank raises the same error.
  const auto& md = deck.model;
  if (mc_deck.pp > md.layers)
    throw InputError(fmt::format("mesh.pp = {}: pipeline parallelism needs at least one layer per stage, and "
                                 "model.layers is {}",
                                 mc_deck.pp, md.layers),
                     true);
  const pp::PipelineLayout pipe = pp::pipelineLayout(deck);  // InputError naming pipeline.schedule
  packing::checkPackerSchedule(deck, deck.packing.strategy);  // packflow <-> slimpack
  if (mc_deck.tp > 1 && (md.heads % mc_deck.tp != 0 || md.kv_heads % mc_deck.tp != 0 || md.ffn % mc_deck.tp != 0))
    throw InputError(fmt::format("mesh.tp = {}: tensor parallelism splits the heads, KV heads and MLP columns, so "
                                 "it must divide model.heads ({}), model.kv_heads ({}) and model.ffn ({})",
                                 mc_deck.tp, md.heads, md.kv_heads, md.ffn),
                     true);
  const auto shape = parallel::MeshShape::fromDeck(deck.mesh);
  parallel::Mesh mesh(shape, opt.comm);  // collective InputError on a size mismatch
  const MPI_Comm world = mesh.world();
  const int rank = mesh.rank(), W = shape.size();
  const auto coord = mesh.coord();
  const TrainConfig& tc = deck.train;
  // One rank's error stops every rank (parallel::throwIfAnyFailed names the failing rank;
  // a one-rank run reports the message as it is).
  auto combine = [&](const std::string& e) {
    if (W > 1)
      parallel::throwIfAnyFailed(world, e);
    else if (!e.empty())
      throw InputError(e, true);
  };

  // Everything that reads input is checked on every rank, then combined: one rank's bad
  // input (a dataset it cannot read) stops every rank with one message, no hang.
  std::string err;
  std::string prefix;
  std::shared_ptr<const data::IndexedDataset> train_ds, valid_ds;
  std::unique_ptr<runtime::DatasetTokens> train_tokens, valid_tokens;
  runtime::Precision precision = runtime::Precision::Fp32;
  bool recompute = false;  // pipeline.recompute = "selective"
  Deck d = deck;
  std::unique_ptr<data::LengthSource> source;  // rank 0 only
  std::unique_ptr<packing::Packer> packer;     // rank 0 only
  std::unique_ptr<model::CostModel> cost;
  LlamaConfig mc;
  try {
    if (tc.dataset.empty()) throw InputError("train.dataset: required (the PREFIX given to `wlb data prepare --out`)");
    prefix = data::resolveDatasetPrefix(deck, tc.dataset);
    if (!fs::exists(prefix + "_train.idx"))
      throw InputError(
          fmt::format("train.dataset: {}_train.idx does not exist (prepare it with `wlb data prepare "
                      "SRC --out {}`)",
                      prefix, tc.dataset));
    train_ds = std::make_shared<const data::IndexedDataset>(prefix + "_train");
    if (fs::exists(prefix + "_valid.idx")) valid_ds = std::make_shared<const data::IndexedDataset>(prefix + "_valid");
    // The packers see the documents of the training split through the Megatron length source.
    d.data.source = "megatron";
    d.data.path = fs::absolute(prefix + "_train.idx").string();
    cost = std::make_unique<model::CostModel>(model::CostModel::fromDeck(d));
    if (rank == 0) {
      source = data::makeLengthSource(d);
      if (source->documentsPerEpoch() != train_ds->documents())
        throw InputError(
            fmt::format("{}_train.idx: {} documents, of which {} are non-empty: wlb train needs a dataset "
                        "without empty documents (as `wlb data prepare` writes)",
                        prefix, train_ds->documents(), source->documentsPerEpoch()));
      packer = packing::makePacker(d.packing.strategy, d, *cost);
    }
    if (shape.cp() > 1) {
      (void)cp::parseStrategy(d.cp.strategy);
      (void)cp::parseCommMode(d.cp.comm);
    }
    mc = LlamaConfig::fromDeck(deck, shape.tp(), coord.tp, shape.pp(), coord.pp, pipe.chunks);
    precision = runtime::parsePrecision(deck.run.precision);
    recompute = pp::executorRecomputesSelective(deck.pipeline.recompute);
    train_tokens = std::make_unique<runtime::DatasetTokens>(train_ds, mc.vocab, prefix + "_train");
    if (valid_ds && valid_ds->documents() > 0)
      valid_tokens = std::make_unique<runtime::DatasetTokens>(valid_ds, mc.vocab, prefix + "_valid");
    // Ids past model.vocab now, not at the step that first reads them (after the log of an
    // earlier run in output.dir was replaced).
    if (rank == 0)
      for (const auto* t : {train_tokens.get(), valid_tokens.get()})
        if (t) t->checkVocabulary();
  } catch (const InputError& e) {
    err = e.what();
  }
  combine(err);
  // Every rank must read the same splits (node-local copies): a rank without the validation
  // split skipped the evaluation's collective the others entered (a hang).
  if (W > 1) {
    const auto summary = [](const std::shared_ptr<const data::IndexedDataset>& ds) {
      if (!ds) return std::string("none");
      std::int64_t tokens = 0;
      for (std::int64_t i = 0; i < ds->documents(); ++i) tokens += ds->length(i);
      return fmt::format("{} documents, {} tokens", ds->documents(), tokens);
    };
    const std::string mine = "train " + summary(train_ds) + "; validation " + summary(valid_ds);
    const std::string first = parallel::bcastString(world, mine);
    combine(mine == first ? std::string()
                          : fmt::format("train.dataset {}: this rank reads {}, rank 0 {}: every rank must read the "
                                        "same dataset",
                                        prefix, mine, first));
  }

  const std::int64_t S = d.data.context_window;
  const std::int64_t M = data::microBatchesPerReplica(d);
  std::int64_t sum_params_whole = 0;
  const std::int64_t per_step = shape.dp() * M * S;  // a step holds at most this many tokens
  const std::int64_t total_steps = tc.steps > 0 ? tc.steps : (tc.tokens + per_step - 1) / per_step;

  // Gradient all-reduce over every rank holding the same weights: the DP x CP ranks of one
  // (TP slice, pipeline stage). The CP group moves K/V, the TP group sums partial
  // activations and input gradients, the pipeline group passes activations (runtime/pipeline.hpp).
  err.clear();
  parallel::CommBackend backend = parallel::CommBackend::Mpi;
  try {
    backend = parallel::resolveCommBackend(deck.run.comm_backend, world);
  } catch (const InputError& e) {
    err = e.what();
  }
  combine(err);
  MPI_Comm dpcp_raw = MPI_COMM_NULL;
  MPI_Comm_split(world, coord.pp * shape.tp() + coord.tp, rank, &dpcp_raw);
  const parallel::Comm dpcp = parallel::Comm::adopt(dpcp_raw);
  const auto cp_group = parallel::makeGroupComm(mesh.cp(), backend);
  const auto tp_group = parallel::makeGroupComm(mesh.tp(), backend);
  const auto dpcp_group = parallel::makeGroupComm(dpcp, backend);
  // The checkpoint's writers: one replica's ranks (dp = cp = 0), in (stage, TP rank) order.
  MPI_Comm ckpt_raw = MPI_COMM_NULL;
  MPI_Comm_split(world, coord.dp == 0 && coord.cp == 0 ? 0 : MPI_UNDEFINED, coord.pp * shape.tp() + coord.tp,
                 &ckpt_raw);
  const parallel::Comm ckpt_comm = parallel::Comm::adopt(ckpt_raw);
  {
    int pr = 0;
    MPI_Comm_rank(mesh.pp(), &pr);
    if (pr != coord.pp) throw std::logic_error("wlb train: pipeline communicator not in stage order");
  }
  // Per-TP-rank parameters of every stage (the checkpoint's layout) and the whole model's.
  std::vector<std::int64_t> stage_params;
  std::int64_t stored_floats = 0;
  for (int st = 0; st < shape.pp(); ++st) {
    LlamaConfig c = mc;
    c.stage = st;
    std::int64_t n = 0;
    for (const TensorInfo& t : Llama::layout(c)) {
      n += t.size;
      sum_params_whole += t.slice != 0 ? t.rows * t.cols : t.size;
    }
    stage_params.push_back(n);
    stored_floats += n * shape.tp();
  }

  Space space;
  Llama model(mc, tc.seed, precision);
  AdamWConfig oc;
  oc.lr = static_cast<float>(tc.lr);
  oc.min_lr_ratio = static_cast<float>(tc.min_lr_ratio);
  oc.warmup_steps = tc.warmup_steps;
  oc.total_steps = total_steps;
  oc.beta1 = static_cast<float>(tc.beta1);
  oc.beta2 = static_cast<float>(tc.beta2);
  oc.weight_decay = static_cast<float>(tc.weight_decay);
  oc.clip = static_cast<float>(tc.clip);
  AdamW adam(model, oc, tp_group.get(), mesh.pp().get());

  const fs::path out_dir = deck.output.dir;
  const fs::path ckpt_dir = tc.checkpoint_dir.empty() ? out_dir / "checkpoint" : fs::path(tc.checkpoint_dir);
  const std::string ckpt_path = (ckpt_dir / "checkpoint.wlb").string();
  const std::string log_path = (out_dir / "train_log.jsonl").string();
  const nlohmann::json fp = fingerprint(d, prefix, total_steps);
  const std::vector<Vec> state_tensors{model.weights(), adam.m(), adam.v()};

  TrainSummary sum;
  sum.params = sum_params_whole;  // the whole model
  sum.log_path = log_path;
  sum.mesh = shape.describe();
  std::int64_t start = 0, tokens = 0;
  std::uint64_t ckpt_id = 0;                   // the checkpoint header's hash (every rank must read the same)
  std::vector<trace::TrainStepRow> step_rows;  // rank 0: every step of the run, resumed part included
  std::vector<trace::TrainRankRow> rank_rows;  // rank 0: every rank's timings of this invocation's steps
  std::ofstream log;
  // A resumed log's records before the checkpoint: written over the log only once every rank
  // agreed on the checkpoint (a failed resume leaves the log as it was).
  std::optional<std::string> kept_log;
  // Rank 0's output folders: made now, removed again (where empty) if the run fails before
  // its first step is logged, so bad input leaves nothing behind.
  // output.trace may name a sub-folder of output.dir: made with it. Both are also removed on
  // Ctrl-C while empty (the driver's tracker).
  std::optional<MadeFolders> made_out, made_trace;
  err.clear();
  try {
    if (rank == 0) {
      std::error_code ec;
      made_out.emplace(out_dir, ec, opt.track_temporary);
      if (ec) throw InputError(fmt::format("output.dir: cannot create {} ({})", out_dir.string(), ec.message()));
      if (opt.write_trace) {
        const fs::path trace_dir = (out_dir / deck.output.trace).parent_path();
        made_trace.emplace(trace_dir, ec, opt.track_temporary);
        if (ec) throw InputError(fmt::format("output.trace: cannot create {} ({})", trace_dir.string(), ec.message()));
      }
    }
    {  // no output may be an input (the deck, the dataset) or another output
      const std::vector<std::string> inputs = model::deckInputFiles(deck);
      std::vector<std::pair<std::string, std::string>> outs{{"output.dir (train_log.jsonl)", log_path}};
      if (opt.write_trace) outs.emplace_back("output.trace", (out_dir / deck.output.trace).string());
      // Checked whatever the interval: a stop (--exit-after, SIGUSR1) always checkpoints.
      outs.emplace_back("train.checkpoint_dir (checkpoint.wlb)", ckpt_path);
      for (const auto& [what, path] : outs) checkOutputPath(path, what, inputs);
      checkDistinctOutputs(outs);
    }
    if (opt.resume) {
      // Every rank loads the weights and moments (the replicas start equal); rank 0 the
      // data cursor and the packer (it plans every step).
      const nlohmann::json h =
          readCheckpoint(ckpt_path, state_tensors, shape.tp(), coord.tp, stage_params, coord.pp, fp);
      model.refreshWorking(space);  // the loaded masters into the BF16 working copy
      start = h.at("step").get<std::int64_t>();
      tokens = h.at("tokens").get<std::int64_t>();
      // Older checkpoints counted every step as an update.
      adam.setUpdates(h.value("adam_updates", start));
      const std::string text = h.dump();
      ckpt_id = fnv1a(text.data(), text.size());
      if (rank == 0) {
        source->loadState(h.at("source"));
        packer->loadState(h.at("packer"));
        // What the packer holds must be pieces of documents the source drew, none twice.
        packing::checkHeld(*source, *packer);
        if (source->nextStep() != start)
          throw InputError(fmt::format("{}: step {} but its document source is at step {} (an edited checkpoint)",
                                       ckpt_path, start, source->nextStep()));
        // Keep the log of the steps before the checkpoint; later ones are run again.
        std::ifstream in(log_path);
        std::vector<std::pair<std::size_t, std::string>> lines;  // (line number, text)
        std::size_t number = 0;
        for (std::string line; std::getline(in, line);)
          if (++number; !line.empty()) lines.emplace_back(number, line);
        // No log, or an empty one (a resume into another output.dir that trained nothing):
        // a fresh log from the checkpoint's step.
        const bool have_log = !lines.empty();
        std::string kept;
        std::int64_t first = -1, next = 0;  // the first kept record's step; the step the next must hold
        for (std::size_t li = 0; li < lines.size(); ++li) {
          const auto& [lineno, line] = lines[li];
          nlohmann::json r;
          try {
            r = parseJsonText(line);
          } catch (const nlohmann::json::exception& e) {
            // A crash mid-write leaves a torn last line (a step after the checkpoint: run again).
            if (li + 1 == lines.size()) break;
            throw InputError(fmt::format("{}: line {}: not a log record ({})", log_path, lineno, e.what()));
          }
          trace::TrainStepRow row;
          try {
            if (!r.is_object() || !r.contains("step") || !r["step"].is_number_integer())
              throw InputError("not a log record (an object with an integer \"step\")");
            row.step = r["step"].get<std::int64_t>();
            if (row.step >= start) continue;
            row.tokens = r.value("tokens", std::int64_t{0});
            row.predicted = r.value("predicted", std::int64_t{0});
            row.documents = r.value("documents", std::int64_t{0});
            row.loss = r.value("loss", 0.0);
            row.eval_loss = r.value("eval_loss", std::nan(""));
            row.lr = r.value("lr", 0.0);
            row.grad_norm = r.value("grad_norm", 0.0);
            row.seconds = r.value("seconds", 0.0);
          } catch (const nlohmann::json::exception& e) {
            throw InputError(fmt::format("{}: line {}: not a log record ({})", log_path, lineno, e.what()));
          } catch (const InputError& e) {
            throw InputError(fmt::format("{}: line {}: {}", log_path, lineno, e.what()));
          }
          // The checkpoint's run logged its steps before the checkpoint once each, in order
          // (from step 0, or from where a resume into another output.dir began the log).
          if (first < 0) first = next = row.step;
          if (row.step != next)
            throw InputError(
                fmt::format("{}: line {}: step {} where step {} was expected (a step missing or "
                            "logged twice)",
                            log_path, lineno, row.step, next));
          ++next;
          kept += line + "\n";
          row.tokens_per_second = row.seconds > 0 ? static_cast<double>(row.tokens) / row.seconds : 0.0;
          step_rows.push_back(row);
        }
        // ... up to the checkpoint's step: a log that stops before it is another run's (a
        // fresh run into the same folder replaces the log and stopped before its first
        // checkpoint), and a resume would lose the steps between.
        // (A log whose records all lie at or after the checkpoint's step began there: a
        // resume into another output.dir, stopped before its next checkpoint.)
        if (first >= 0 && next != start)
          throw InputError(fmt::format(
              "{}: holds steps {} .. {} but the checkpoint {} is at step {}: the log and the checkpoint are not of "
              "one run; start afresh (without --resume) or move the log aside",
              log_path, first, next - 1, ckpt_path, start));
        if (have_log) kept_log = std::move(kept);
      }
    }
    if (rank == 0) {  // writable now; a fresh run's log replaces the old one at its first step
      const bool existed = fs::exists(log_path);
      log.open(log_path, std::ios::app);
      if (!log) throw InputError(fmt::format("{}: cannot write ({})", log_path, std::strerror(errno)));
      if (!existed) {  // made at the first step: a failure before it (or no step) leaves no empty log
        log.close();
        fs::remove(log_path);
      }
    }
  } catch (const InputError& e) {
    err = e.what();
  } catch (const nlohmann::json::exception& e) {
    err = fmt::format("{}: corrupt checkpoint ({})", ckpt_path, e.what());
  }
  combine(err);
  if (opt.resume && W > 1) {  // one checkpoint for all: a stale file on one node's disk would hang or drift
    std::vector<std::uint64_t> ids(static_cast<std::size_t>(W));
    std::vector<std::int64_t> steps(static_cast<std::size_t>(W));
    MPI_Allgather(&ckpt_id, 1, MPI_UINT64_T, ids.data(), 1, MPI_UINT64_T, world);
    MPI_Allgather(&start, 1, MPI_INT64_T, steps.data(), 1, MPI_INT64_T, world);
    for (int r = 1; r < W && err.empty(); ++r)
      if (ids[static_cast<std::size_t>(r)] != ids[0])
        err = fmt::format(
            "rank {} read another checkpoint than rank 0 ({}: step {} there, {} on rank 0); every "
            "rank must read the one rank 0 wrote (a train.checkpoint_dir all ranks share)",
            r, ckpt_path, steps[static_cast<std::size_t>(r)], steps[0]);
    combine(err);
  }
  // Nothing to train (a finished run, or --exit-after at or before the checkpoint's step):
  // the log, the trace and the checkpoint stay as they are.
  const bool trains = start < total_steps && !(opt.exit_after_steps > 0 && opt.exit_after_steps <= start);
  if (kept_log && trains) {  // rank 0: the log back to the checkpoint's step, whole or not at all
    try {
      log.close();
      writeFileAtomically(log_path, "train log", *kept_log, opt.track_temporary);
      log.open(log_path, std::ios::app);
      if (!log) throw InputError(fmt::format("{}: cannot write ({})", log_path, std::strerror(errno)));
    } catch (const InputError& e) {
      err = e.what();
    }
  }
  combine(err);

  // The trace: this rank's events (attention, KV exchange, gradient all-reduce, optimizer),
  // the plans, and the training metrics (rank 0's tables).
  trace::Recorder rec = trace::alignedRecorder(world, coord);
  rec.setStrategy(d.packing.strategy);
  std::unique_ptr<trace::Writer> writer;
  // A resume with nothing left to train keeps the trace the run wrote.
  if (opt.write_trace && trains) {
    trace::RunMeta meta = runtime::measuredMeta(deck, shape, opt.command, "wlb::train::train", precision, backend);
    meta.extra.emplace_back("first_step", std::to_string(start));
    sum.trace_path = (out_dir / deck.output.trace).string();
    trace::WriterOptions wo;
    wo.track_temporary = opt.track_temporary;
    writer = std::make_unique<trace::Writer>(sum.trace_path, meta, world, wo);
  }
  auto commitTrace = [&]() {
    if (!writer) return;
    writer->setTraining(step_rows, rank_rows);
    writer->commit(rec);
  };

  // The stage walker of every step (runtime/pipeline.hpp: the one `wlb run` measures) and
  // of the evaluation, whose batches run whole on one pipeline (no CP group).
  runtime::LayerEnv env =
      runtime::LayerEnv::onMesh(space, mesh, *cost, &rec, precision, cp_group.get(), tp_group.get());
  attention::setHopperVariant(env.kernel, deck.run.attention);   // validated with the deck
  env.recompute_selective = recompute;
  const pp::Schedule sched = pipe.schedule(static_cast<int>(M));  // the simulator's schedule, same function
  runtime::PipelineStage stage_walker(env, model, sched, mesh.pp());
  runtime::LayerEnv eval_env = env;
  eval_env.cp_comm = MPI_COMM_SELF;
  eval_env.cp_group = nullptr;
  runtime::PipelineStage eval_walker(eval_env, model, sched, mesh.pp());
  const cp::Strategy cp_strategy = cp::parseStrategy(d.cp.strategy);
  const cp::CommMode cp_mode = cp::parseCommMode(d.cp.comm);

  double entropy = 0;
  const auto eval_batches =
      valid_tokens ? evalBatches(*valid_ds, S, tc.eval_tokens, entropy) : std::vector<MicroBatch>{};
  sum.unigram_entropy = entropy;
  // Every TP x PP group (one pipeline of one replica's CP rank) holds the whole model:
  // evaluation batches are dealt round-robin over these groups (every rank of the group
  // runs the batch, the last stage's TP rank 0 reports it), each batch's loss sum travels
  // alone (the others contribute exact zeros) and the sums are added in batch order, so
  // the evaluation loss has the same bits on every DP x CP mesh for the same weights.
  const int P = shape.pp();
  const int groups = shape.dp() * shape.cp(), my_group = coord.dp * shape.cp() + coord.cp;
  auto evaluate = [&]() {
    const std::size_t nb = eval_batches.size();
    std::vector<double> part(nb, 0.0), all(nb, 0.0);
    std::int64_t predicted = 0;
    StepPlan plan;  // this group's batches, run whole (cp = 1)
    plan.replicas.resize(1);
    std::vector<std::size_t> mine;
    for (std::size_t i = 0; i < nb; ++i) {
      for (const Segment& seg : eval_batches[i].segments) predicted += seg.length - 1;
      if (static_cast<int>(i % static_cast<std::size_t>(groups)) == my_group) {
        mine.push_back(i);
        plan.replicas[0].push_back(eval_batches[i]);
      }
    }
    std::string e;
    if (!mine.empty()) {
      try {
        runtime::StageStepInput in =
            runtime::replicaStepInput(-1, plan, 0, P, static_cast<std::int64_t>(mine.size()), 1, *cost,
                                      cp::Strategy::PerSequence, cp::CommMode::AllGather, d.cp);
        in.tokens = valid_tokens.get();
        in.forward_only = true;
        in.schedule =
            std::make_shared<pp::Schedule>(runtime::forwardSchedule(P, static_cast<int>(mine.size()), sched.chunks));
        const runtime::StageStepResult r = eval_walker.run(in, rec.now());
        for (std::size_t k = 0; k < mine.size(); ++k) part[mine[k]] = r.mb_loss[k];
      } catch (const InputError& x) {
        e = x.what();
      }
    }
    combine(e);
    if (nb > 0) MPI_Allreduce(part.data(), all.data(), static_cast<int>(nb), MPI_DOUBLE, MPI_SUM, world);
    double loss = 0;
    for (const double x : all) loss += x;
    return predicted > 0 ? loss / static_cast<double>(predicted) : -1.0;
  };

  if (rank == 0 && tc.eval_interval > 0 && eval_batches.empty()) {  // asked for, but nothing to evaluate on
    std::fprintf(stderr,
                 "wlb train: note: train.eval_interval = %lld, but the validation split %s_valid holds no tokens: "
                 "no evaluation (prepare the dataset with --valid-fraction > 0)\n",
                 static_cast<long long>(tc.eval_interval), prefix.c_str());
    std::fflush(stderr);
  }
  if (opt.progress && rank == 0) {
    std::fprintf(stderr, "wlb train: mesh %s, %lld parameters, steps %lld..%lld, packer %s%s\n",
                 shape.describe().c_str(), static_cast<long long>(sum.params), static_cast<long long>(start),
                 static_cast<long long>(total_steps), d.packing.strategy.c_str(),
                 shape.cp() > 1 ? (", CP sharding " + d.cp.strategy + " / " + d.cp.comm).c_str() : "");
    std::fflush(stderr);
  }

  const auto t0 = Clock::now();
  double busy = 0;
  std::int64_t run_tokens = 0;
  std::int64_t later_allocs = 0;  // the pools' allocations in this invocation's steps after its first
  bool have_first = false;  // the summary's first loss is that of the first step with tokens
  sum.first_step = start;
  sum.total_steps = total_steps;
  std::int64_t end = total_steps;  // where this invocation stops
  if (opt.exit_after_steps > 0 && opt.exit_after_steps <= start && start < total_steps) {
    end = start;  // the checkpoint is already there
    sum.exit_reason = fmt::format("--exit-after {}", opt.exit_after_steps);
  }
  // A hint, capped: train.steps may be 10^12, which runs but cannot be reserved.
  rank_rows.reserve(static_cast<std::size_t>(std::min<std::int64_t>(total_steps - start, 1 << 16) * W));
  for (std::int64_t step = start; step < end; ++step) {
    std::vector<double> row(kCols, 0.0);
    const std::size_t first_event = rec.events().size();
    const auto ts = Clock::now();
    const std::int64_t ts_ns = rec.now();
    rec.setContext({static_cast<int>(step), -1, trace::Phase::None, -1});
    // 1. Rank 0 packs the step and broadcasts the plan (one plan for every rank, even for a
    //    packer whose result could depend on timing).
    std::string text;
    err.clear();
    if (rank == 0) {
      try {
        const auto docs = source->next(step);
        const StepPlan plan = packer->pack(step, docs);
        text = packing::stepToJson(plan, packing::computeMetrics(plan, *cost), static_cast<std::int64_t>(docs.size()))
                   .dump();
      } catch (const std::exception& e) {
        err = fmt::format("planning step {}: {}", step, e.what());
      }
    }
    combine(err);
    text = parallel::bcastString(world, text);
    const nlohmann::json pj = nlohmann::json::parse(text);
    const StepPlan plan = packing::stepFromJson(pj);
    const std::int64_t ndocs = pj.value("incoming", std::int64_t{0});
    if (static_cast<int>(plan.replicas.size()) != shape.dp())
      throw std::logic_error(
          fmt::format("wlb train: the packer returned {} replicas for mesh.dp = {}", plan.replicas.size(), shape.dp()));
    if (writer && rank == 0)  // with every replica's CP shard plans, as `wlb run` writes them (calibrate reads them)
      writer->addPlan(d.packing.strategy, plan, text,
                      runtime::shardPlansJson(plan, P, M, shape.cp(), *cost, cp_strategy, cp_mode, d.cp));
    // The loss is the mean over every predicted token of the step (all replicas), so each
    // rank scales its share by the same global count.
    const std::int64_t predicted = runtime::predictedRows(plan);
    std::int64_t step_tokens = 0;
    for (const auto& rep : plan.replicas)
      for (const MicroBatch& mb : rep) step_tokens += mb.tokens();

    // 2. This rank's units: its replica's micro-batches as its CP share (or SlimPack's
    //    MicroPacks), the DP-Merge groups' communicators.
    runtime::StageStepInput in;
    runtime::MergedComms merged;
    err.clear();
    try {
      in = runtime::replicaStepInput(step, plan, static_cast<std::size_t>(coord.dp), P, M, shape.cp(), *cost,
                                     cp_strategy, cp_mode, d.cp);
      in.tokens = train_tokens.get();
      in.loss_scale = predicted > 0 ? 1.0f / static_cast<float>(predicted) : 0.0f;
      runtime::touchTokens(*train_tokens, in.mbs);  // bad ids stop every rank here, together
    } catch (const InputError& e) {
      err = e.what();
    }
    combine(err);
    merged = runtime::connectMerged(mesh, plan, in, backend);
    const auto tc0 = Clock::now();
    row[kDataS] = std::chrono::duration<double>(tc0 - ts).count();

    // 3. Forward and backward of every unit: the stage walks its order of the schedule
    //    (the last stage computes the loss); gradients accumulate.
    model.zeroGrads(space);
    double loss_part = 0;
    err.clear();
    try {
      const runtime::StageStepResult r = stage_walker.run(in, rec.now());
      loss_part = r.loss;
      for (const double t : r.mb_tokens) row[kTokens] += t;
      row[kAllocs] = static_cast<double>(r.allocations);
      row[kPoolBytes] = static_cast<double>(r.pool_bytes);
      row[kLiveBytes] = static_cast<double>(r.pool_live_bytes);
      row[kAskedBytes] = static_cast<double>(r.pool_requested_bytes);
    } catch (const InputError& e) {
      err = e.what();
    }
    combine(err);
    train_tokens->forget();
    kk::fence(space, "wlb::train::fwd_bwd");
    const auto tc1 = Clock::now();
    row[kComputeS] = std::chrono::duration<double>(tc1 - tc0).count();

    // 4. Sum the gradients over DP x CP (every rank then holds its TP slice's gradient) and
    //    the loss; then the same AdamW update on every rank.
    rec.setContext({static_cast<int>(step), -1, trace::Phase::Bwd, -1});
    {
      auto g = model.grads();
      trace::Recorder::Scope s(rec, trace::labels::kGradAllreduce, space, 0, 4.0 * static_cast<double>(g.size()));
      if (dpcp_group->size() > 1) dpcp_group->allreduceSum(space, g.data(), static_cast<std::int64_t>(g.size()));
    }
    // The last stage's TP rank 0 of each replica's CP ranks hold the loss; the others add
    // exact zeros.
    double loss_sum = loss_part;
    if (W > 1) MPI_Allreduce(&loss_part, &loss_sum, 1, MPI_DOUBLE, MPI_SUM, world);
    const auto tc2 = Clock::now();
    row[kAllreduceS] = std::chrono::duration<double>(tc2 - tc1).count();
    // A step whose micro-batches are all empty (a packer that holds every document back)
    // trains nothing: no update, so weight decay and the moments do not move either.
    double gnorm = 0.0;
    if (predicted > 0) {
      trace::Recorder::Scope s(rec, trace::labels::kOptimizer, space);
      gnorm = adam.step(space, model, step);
    }
    kk::fence(space, "wlb::train::step");
    const auto te = Clock::now();
    row[kOptimizerS] = std::chrono::duration<double>(te - tc2).count();
    row[kStepS] = std::chrono::duration<double>(te - ts).count();
    rec.setContext({static_cast<int>(step), -1, trace::Phase::None, -1});
    rec.record(rec.region(trace::labels::kStep), ts_ns, rec.now());
    for (std::size_t i = first_event; i < rec.events().size(); ++i) {
      const auto& ev = rec.events()[i];
      const std::string& l = rec.regions()[static_cast<std::size_t>(ev.region)];
      const double sec = static_cast<double>(ev.end_ns - ev.start_ns) * 1e-9;
      if (l == trace::labels::kAttn) row[kAttnS] += sec;
      if (l == trace::labels::kKvAllgather || l == trace::labels::kKvExchange) row[kCpCommS] += sec;
      if (l == trace::labels::kTpAllreduce) row[kTpCommS] += sec;
    }

    const double loss = predicted > 0 ? loss_sum / static_cast<double>(predicted) : 0.0;
    // All ranks stop here together, before a checkpoint of the state.
    int diverged = !std::isfinite(loss) || !std::isfinite(gnorm);
    if (W > 1) MPI_Allreduce(MPI_IN_PLACE, &diverged, 1, MPI_INT, MPI_MAX, world);
    if (diverged != 0)
      throw InputError(fmt::format("step {}: the training loss is {} and the gradient norm {} (the run diverged: a "
                                   "lower train.lr; the last checkpoint is kept)",
                                   step, loss, gnorm),
                       /*collective=*/true);
    if (predicted > 0) {
      if (!have_first) sum.first_loss = loss;
      have_first = true;
      sum.last_loss = loss;
    }
    const bool last = step + 1 == total_steps;
    // A stop asked for (the step count, or a signal on any rank) ends every rank after this
    // step, with the checkpoint and trace of a finished run.
    int stop = (opt.exit_after_steps > 0 && step + 1 >= opt.exit_after_steps) ||
               (opt.exit_request != nullptr && *opt.exit_request != 0);
    if (W > 1) MPI_Allreduce(MPI_IN_PLACE, &stop, 1, MPI_INT, MPI_MAX, world);
    const bool exiting = stop != 0 && !last;
    if (exiting)
      sum.exit_reason = opt.exit_after_steps > 0 && step + 1 >= opt.exit_after_steps
                            ? fmt::format("--exit-after {}", opt.exit_after_steps)
                            : "SIGUSR1";
    double ev = -1;
    if ((tc.eval_interval > 0 && (step + 1) % tc.eval_interval == 0) || last) {
      const auto e0 = Clock::now();
      ev = evaluate();
      row[kEvalS] = std::chrono::duration<double>(Clock::now() - e0).count();
      if (ev >= 0) sum.eval_loss = ev;
    }
    sum.losses.push_back(loss);
    sum.eval_losses.push_back(ev >= 0 ? ev : std::nan(""));

    // 5. Every rank's timings to rank 0 (the step's time is the slowest rank's).
    std::vector<double> all(rank == 0 ? static_cast<std::size_t>(kCols) * W : 0);
    MPI_Gather(row.data(), kCols, MPI_DOUBLE, all.data(), kCols, MPI_DOUBLE, 0, world);
    double secs = row[kStepS];
    if (rank == 0) {
      std::int64_t step_allocs = 0;
      for (int r = 0; r < W; ++r) {
        const double* a = &all[static_cast<std::size_t>(r) * kCols];
        secs = std::max(secs, a[kStepS]);
        trace::TrainRankRow rr;
        rr.step = step;
        rr.rank = r;
        rr.tokens = static_cast<std::int64_t>(a[kTokens]);
        rr.step_seconds = a[kStepS];
        rr.data_seconds = a[kDataS];
        rr.compute_seconds = a[kComputeS];
        rr.attn_seconds = a[kAttnS];
        rr.cp_comm_seconds = a[kCpCommS];
        rr.tp_comm_seconds = a[kTpCommS];
        rr.allreduce_seconds = a[kAllreduceS];
        rr.optimizer_seconds = a[kOptimizerS];
        rr.eval_seconds = a[kEvalS];
        rr.allocations = static_cast<std::int64_t>(a[kAllocs]);
        rr.pool_bytes = static_cast<std::int64_t>(a[kPoolBytes]);
        rr.pool_live_bytes = static_cast<std::int64_t>(a[kLiveBytes]);
        rr.pool_requested_bytes = static_cast<std::int64_t>(a[kAskedBytes]);
        step_allocs += rr.allocations;
        sum.pool_bytes = std::max(sum.pool_bytes, rr.pool_bytes);
        sum.pool_live_bytes = std::max(sum.pool_live_bytes, rr.pool_live_bytes);
        sum.pool_requested_bytes = std::max(sum.pool_requested_bytes, rr.pool_requested_bytes);
        rank_rows.push_back(rr);
      }
      if (step > start) later_allocs += step_allocs;
    }
    busy += secs;
    run_tokens += step_tokens;
    tokens += step_tokens;

    // The checkpoint's tensors: the replicas hold the same weights and moments, so replica
    // 0's CP rank 0 ranks (every stage and TP slice) send theirs to rank 0, in (stage, TP
    // rank) order: each stage's slices back to back, the stages in order.
    // A stop checkpoints whatever the interval: its summary promises that --resume continues.
    // So does the last step of a resumed run: a later --resume then finds the run finished
    // (with interval 0 it found the stop's checkpoint and trained the tail again).
    const bool ckpt_now = exiting || (last && opt.resume) ||
                          (tc.checkpoint_interval > 0 && ((step + 1) % tc.checkpoint_interval == 0 || last));
    std::vector<std::vector<float>> ckpt_host;
    if (ckpt_now && ckpt_comm.get() != MPI_COMM_NULL) {
      const int writers = shape.tp() * P;
      std::vector<int> counts(static_cast<std::size_t>(writers)), displs(static_cast<std::size_t>(writers), 0);
      std::int64_t total = 0;
      for (int w = 0; w < writers; ++w) {
        counts[static_cast<std::size_t>(w)] = static_cast<int>(stage_params[static_cast<std::size_t>(w / shape.tp())]);
        displs[static_cast<std::size_t>(w)] = static_cast<int>(total);
        total += counts[static_cast<std::size_t>(w)];
      }
      for (const Vec& t : state_tensors) {
        std::vector<float> mine = toHost(t);
        if (writers == 1) {
          ckpt_host.push_back(std::move(mine));
          continue;
        }
        std::vector<float> all_parts(rank == 0 ? static_cast<std::size_t>(total) : 0);
        MPI_Gatherv(mine.data(), static_cast<int>(mine.size()), MPI_FLOAT, all_parts.data(), counts.data(),
                    displs.data(), MPI_FLOAT, 0, ckpt_comm);
        ckpt_host.push_back(std::move(all_parts));
      }
    }
    err.clear();
    if (rank == 0) {
      trace::TrainStepRow sr;
      sr.step = step;
      sr.tokens = step_tokens;
      sr.predicted = predicted;
      sr.documents = ndocs;
      sr.loss = loss;
      sr.eval_loss = ev >= 0 ? ev : std::nan("");
      sr.lr = oc.lrAt(step);
      sr.grad_norm = gnorm;
      sr.seconds = secs;
      sr.tokens_per_second = secs > 0 ? static_cast<double>(step_tokens) / secs : 0.0;
      step_rows.push_back(sr);
      nlohmann::json rec_json = {{"step", step},       {"loss", loss},          {"lr", oc.lrAt(step)},
                                 {"grad_norm", gnorm}, {"tokens", step_tokens}, {"predicted", predicted},
                                 {"documents", ndocs}, {"seconds", secs}};
      if (ev >= 0) rec_json["eval_loss"] = ev;
      if (!opt.resume && step == start) {  // an input error before the first step kept the old log
        log.close();
        log.open(log_path, std::ios::trunc);
        if (!log) err = fmt::format("{}: cannot write ({})", log_path, std::strerror(errno));  // combined below
        // ... and an earlier run's checkpoint goes with it: left beside this run's log it
        // would be resumed (a finished run's tail trained again, or steps lost between)
        std::error_code ec;
        fs::remove(ckpt_path, ec);
      } else if (!log.is_open()) {  // a resume into a folder without a log: made at its first step
        log.open(log_path, std::ios::app);
        if (!log) err = fmt::format("{}: cannot write ({})", log_path, std::strerror(errno));  // combined below
      }
      log << rec_json.dump() << "\n";
      log.flush();
      if (made_out) made_out->keep();
      if (made_trace) made_trace->keep();
      if (opt.progress && ((step + 1) % tc.log_interval == 0 || last || ev >= 0)) {
        const double el = std::chrono::duration<double>(Clock::now() - t0).count();
        const double eta = el / static_cast<double>(step + 1 - start) * static_cast<double>(total_steps - step - 1);
        const std::string evs = ev >= 0 ? fmt::format("  eval {:.4f}", ev) : "";
        std::fprintf(stderr, "wlb train: step %lld/%lld  loss %.4f%s  lr %.3g  gnorm %.3g  %.0f tok/s  ETA %.0f s\n",
                     static_cast<long long>(step) + 1, static_cast<long long>(total_steps), loss, evs.c_str(),
                     oc.lrAt(step), gnorm, busy > 0 ? static_cast<double>(run_tokens) / busy : 0.0, eta);
        std::fflush(stderr);
      }
      if (ckpt_now) {
        try {
          std::error_code mk;
          MadeFolders made_ckpt(ckpt_dir, mk, opt.track_temporary);  // removed again, while empty, if the write fails
          if (mk)
            throw InputError(
                fmt::format("train.checkpoint_dir: cannot create {} ({})", ckpt_dir.string(), mk.message()));
          nlohmann::json h = {{"format", "wlb-train-checkpoint"},
                              {"version", 1},
                              {"step", step + 1},
                              {"tokens", tokens},
                              {"params", stored_floats},  // per state tensor in the file
                              {"tp", shape.tp()},         // tensors: per stage, the TP slices back to back
                              {"pp", P},
                              {"stage_params", stage_params},  // per TP rank
                              {"tensors", {"weights", "adam_m", "adam_v"}},
                              {"adam_updates", adam.updates()},  // the moments' bias-correction count
                              {"fingerprint", fp},
                              {"source", source->saveState()},
                              {"packer", packer->saveState()},
                              // No stochastic op after initialisation (no dropout; data order is
                              // the source's): the seed is the whole RNG state.
                              {"rng", {{"seed", tc.seed}}}};
          h["checksums"] = nlohmann::json::array();
          for (const auto& t : ckpt_host) h["checksums"].push_back(checksum(t));
          // The replicas hold the same weights and moments: rank 0's are the run's.
          writeCheckpoint(ckpt_path, h, ckpt_host, opt);
          made_ckpt.keep();
          sum.checkpoint_path = ckpt_path;
        } catch (const InputError& e) {
          err = e.what();
        } catch (const fs::filesystem_error& e) {  // the rename: the other ranks must not wait
          err = fmt::format("train.checkpoint_dir: {}", e.what());
        }
      }
    }
    combine(err);
    if (ckpt_now && !last) commitTrace();  // a run killed later keeps the trace up to its last checkpoint
    if (opt.kill_after_step == step) std::raise(SIGKILL);
    if (opt.stop_after_step == step) {
      sum.steps = step + 1;
      sum.tokens = tokens;
      return sum;
    }
    if (exiting) {
      end = step + 1;
      break;
    }
  }
  commitTrace();
  sum.steps = end;
  sum.tokens = tokens;
  sum.tokens_per_second = busy > 0 ? static_cast<double>(run_tokens) / busy : 0.0;
  if (end - start > 1)
    sum.allocations_per_step = static_cast<double>(later_allocs) / static_cast<double>(end - start - 1);
  const std::vector<float> w = toHost(model.weights());
  sum.weights_hash = fnv1a(w.data(), w.size() * sizeof(float));
  return sum;
}

std::string formatSummary(const TrainSummary& s) {
  std::ostringstream os;
  os << fmt::format("steps            {} .. {} (this run: {})\n", s.first_step, s.steps, s.steps - s.first_step);
  if (!s.mesh.empty()) os << fmt::format("mesh             {}\n", s.mesh);
  os << fmt::format("parameters       {}\n", s.params);
  os << fmt::format("tokens trained   {} (since step 0)\n", s.tokens);
  if (!s.exit_reason.empty() && s.steps > s.first_step)
    os << fmt::format("stopped          after step {} of {} ({}); --resume continues\n", s.steps, s.total_steps,
                      s.exit_reason);
  if (s.steps == s.first_step) {  // a resume with nothing to train: no loss or rate to report
    os << (s.steps >= s.total_steps
               ? "nothing trained  the checkpoint had finished the run\n"
               : fmt::format("nothing trained  the checkpoint is at step {}, at or past {}\n", s.steps, s.exit_reason));
  } else {
    os << fmt::format("train loss       {:.4f} -> {:.4f} (nats/token)\n", s.first_loss, s.last_loss);
    if (s.eval_loss >= 0)
      os << fmt::format("eval loss        {:.4f} (unigram entropy of the evaluation tokens {:.4f})\n", s.eval_loss,
                        s.unigram_entropy);
    os << fmt::format("throughput       {:.0f} tokens/s\n", s.tokens_per_second);
  }
  if (s.pool_bytes > 0)
    os << fmt::format(
        "buffers          pool {:.2f} MiB, in use {:.2f}, asked {:.2f} (the largest rank's); "
        "{:.1f} allocations per step after the first\n",
        static_cast<double>(s.pool_bytes) / 1048576.0, static_cast<double>(s.pool_live_bytes) / 1048576.0,
        static_cast<double>(s.pool_requested_bytes) / 1048576.0, s.allocations_per_step);
  os << fmt::format("log              {}\n", s.log_path);
  if (!s.checkpoint_path.empty()) os << fmt::format("checkpoint       {}\n", s.checkpoint_path);
  if (!s.trace_path.empty()) os << fmt::format("trace            {}\n", s.trace_path);
  return os.str();
}

}  // namespace wlb::train
