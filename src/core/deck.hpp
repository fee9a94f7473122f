#pragma once
/// \file deck.hpp
/// \brief The validated, fully resolved input deck (TOML). Every table and key is
/// documented in docs/decks.md; parsing rejects unknown keys, wrong types and values out
/// of range with an InputError naming the key (exit 2).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace wlb {

struct ModelConfig {
  std::string name = "small";
  std::int64_t hidden = 512;
  std::int64_t heads = 8;
  std::int64_t kv_heads = 8;  ///< GQA: must divide heads
  std::int64_t ffn = 1408;
  std::int64_t layers = 2;
  std::int64_t vocab = 32000;
  std::int64_t dtype_bytes = 2;  ///< bytes per activation/weight element (simulator memory)
  std::int64_t head_dim = 64;    ///< derived: hidden / heads
};

struct MeshConfig {
  std::int64_t tp = 1, cp = 1, pp = 1, dp = 1;
  std::int64_t virtual_stages = 1;  ///< interleaved 1F1B model chunks per stage
  std::int64_t size() const { return tp * cp * pp * dp; }
};

struct DataConfig {
  std::string source = "generator";  ///< generator | text | jsonl | megatron
  std::string preset = "long_context_128k";
  std::string path;  ///< length file for text/jsonl/megatron (.idx)
  std::string jsonl_field = "length";
  std::uint64_t seed = 1234;
  std::int64_t context_window = 131072;  ///< S
  std::int64_t s_max = 0;                ///< variable-length limit; 0 -> resolved to S
  bool s_max_derived = false;            ///< resolved from 0 (a [sweep] case derives it again)
  double length_scale = 1.0;             ///< multiply generated lengths (scaled-down runs)
};

struct PackingConfig {
  std::string strategy = "wlb";    ///< original | fixed_greedy | fixed_optimal | best_fit | wlb | slimpack
  std::int64_t micro_batches = 0;  ///< M per DP replica; 0 -> resolved to pp
  bool micro_batches_derived = false;  ///< resolved from 0 (a [sweep] case derives it again)
  std::int64_t window = 1;         ///< fixed_greedy: global batches per window (1 = the paper's Fixed-4D)
  std::vector<std::int64_t> outlier_thresholds;  ///< L_1 < ... < L_n; empty -> defaults
  double delay_budget = 1.0;                     ///< mean per-token delay budget (steps) for tuning
  std::int64_t max_queue_wait = 0;       ///< wlb: longest outlier-queue wait (steps); 0 -> max(2, ceil(4*budget))
  double milp_time_limit = 10.0;         ///< seconds per fixed_optimal solve
  std::int64_t slimpack_candidates = 6;  ///< slimpack: MicroPack counts scored per step
  std::int64_t slimpack_dp_merge = 1;    ///< slimpack: DP-Merge of samples over a replica's share
  std::string checkpoint;                ///< packer state file ("" -> none)
};

struct CpConfig {
  std::string strategy = "adaptive";  ///< per_sequence | per_document | adaptive | whole_document | hybrid
  std::string comm = "allgather";     ///< allgather | sharding_aware
  double capacity_factor = 1.25;      ///< whole_document: per-rank token cap / (tokens / cp)
};

struct PipelineConfig {
  std::string schedule = "1f1b";   ///< gpipe | 1f1b | interleaved
  std::string recompute = "none";  ///< none | selective | full
};

struct HardwareConfig {
  std::string profile = "analytic";  ///< kernel/hardware profile JSON, or "analytic"
  double tp_bandwidth_gbps = 0;      ///< 0 -> from the profile
  double cp_bandwidth_gbps = 0;
  double pp_bandwidth_gbps = 0;
  double dp_bandwidth_gbps = 0;
  double link_latency_us = 0;
  double memory_gb = 0;
};

struct RunConfig {
  std::int64_t steps = 4;
  std::int64_t warmup = 1;
  /// Strategies to compare: "plain", "fixed", "wlb", or "PACKER+SHARDING" (e.g.
  /// "best_fit+per_document"). Empty -> the single [packing]/[cp] strategy.
  std::vector<std::string> strategies;
  /// Arithmetic of the executor's GEMMs and attention: fp32 | tf32 | bf16 (GPU tensor
  /// cores; host builds compute every mode in FP32).
  std::string precision = "fp32";
  /// Collectives of the executor's mesh groups: auto | mpi | nccl (docs/runtime.md).
  std::string comm_backend = "auto";
  /// Hopper attention kernel variant: auto | split | ws | ws-split (docs/attention.md;
  /// attention::setHopperVariant). Other devices ignore it.
  std::string attention = "auto";
};

/// `wlb train` (docs/training.md): a LLaMA-style model on a `wlb data prepare` dataset.
struct TrainConfig {
  std::string dataset;            ///< PREFIX of PREFIX_train / PREFIX_valid .bin/.idx
  std::int64_t tokens = 1000000;  ///< token budget -> steps = ceil(tokens / (dp*M*S))
  std::int64_t steps = 0;         ///< optimizer steps; 0 -> from tokens
  double lr = 3e-3;
  double min_lr_ratio = 0.1;  ///< cosine ends at lr * min_lr_ratio
  std::int64_t warmup_steps = 10;
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95;
  double clip = 1.0;       ///< global gradient-norm limit; 0 = none
  std::uint64_t seed = 1;  ///< weight initialisation
  double rope_theta = 10000;
  std::int64_t log_interval = 10;
  std::int64_t eval_interval = 0;        ///< steps; 0 = at the end only
  std::int64_t eval_tokens = 0;          ///< validation tokens per evaluation; 0 = all
  std::int64_t checkpoint_interval = 0;  ///< steps; 0 = none
  std::string checkpoint_dir;            ///< "" -> output.dir/checkpoint
};

struct OutputConfig {
  std::string dir = "wlb-out";
  std::string trace = "trace.h5";
  std::string plan = "plan.jsonl";
};

/// A complete, validated deck. Defaults are filled in and derived values resolved.
struct Deck {
  ModelConfig model;
  MeshConfig mesh;
  DataConfig data;
  PackingConfig packing;
  CpConfig cp;
  PipelineConfig pipeline;
  HardwareConfig hardware;
  RunConfig run;
  TrainConfig train;
  OutputConfig output;
  /// [sweep]: "table.key" -> list of values (TOML literals), expanded by expandSweep().
  std::map<std::string, std::vector<std::string>> sweep;

  std::string source_path;  ///< file the deck came from ("" for built-in)
  /// A case of expandSweep: its "table.key=literal" overrides, in the sweep's key order.
  std::vector<std::string> sweep_case;

  /// The resolved deck as TOML text (every key, defaults included). Stored in outputs.
  std::string toToml() const;
};

/// The text of the deck file `path` (InputError for a folder or a file it cannot open,
/// naming `shown`, or `path` when empty).
std::string readDeckText(const std::string& path, const std::string& shown = "");

/// Parse and validate a deck file, then apply `table.key=value` overrides in order.
/// Throws InputError (file, line, key, allowed values) on any problem.
Deck loadDeck(const std::string& path, const std::vector<std::string>& overrides = {});

/// Same, from TOML text (`name` is used in error messages).
Deck parseDeck(const std::string& text, const std::string& name, const std::vector<std::string>& overrides = {});

/// Expand [sweep] lists into the cartesian product of decks (one deck if no sweep).
/// Each case's `output.dir` gets a suffix naming its values.
std::vector<Deck> expandSweep(const Deck& deck);

/// For a command that runs one case (`wlb run`, `wlb train`, ...): throws InputError naming
/// `name` and the swept keys when the deck still has a [sweep] (a --set of a swept key pins it).
void requireOneCase(const Deck& deck, const std::string& name, const std::string& command);

/// Strategy name -> (packer, sharding) pair. "plain" = original+per_sequence,
/// "fixed" = fixed_greedy+per_document, "wlb" = wlb+adaptive.
struct StrategyPair {
  std::string name, packer, sharding;
};
std::vector<StrategyPair> resolveStrategies(const Deck& deck);

/// Levenshtein distance (typo suggestions: deck keys, subcommands, datasets).
std::size_t editDistance(const std::string& a, const std::string& b);
/// The candidate closest to `word` by editDistance (first of equals; "" if none).
std::string nearest(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace wlb
