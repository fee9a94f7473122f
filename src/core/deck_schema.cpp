#include "core/deck_schema.hpp"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "attention/flops.hpp"

namespace wlb {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string num(double v) {
  if (v == kInf) return "inf";
  if (v == -kInf) return "-inf";
  // an integral bound in full (1048576, not 1.04858e+06), others as the shortest text that
  // reads back as the same double (0.003, not 0.0030000000000000001)
  if (v == std::floor(v) && std::fabs(v) < 9.0e15) return std::to_string(static_cast<std::int64_t>(v));
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// Field accessors: `F(model.hidden)` -> a function returning &deck.model.hidden.
// NOLINTNEXTLINE(bugprone-macro-parentheses): `path` is a member path, not an expression
#define WLB_F(path) [](Deck& d) -> void* { return &d.path; }

KeySpec I(const char* t, const char* k, double lo, double hi, std::function<void*(Deck&)> p, const char* help) {
  return KeySpec{t, k, Kind::Int, lo, hi, {}, help, std::move(p)};
}
KeySpec F(const char* t, const char* k, double lo, double hi, std::function<void*(Deck&)> p, const char* help) {
  return KeySpec{t, k, Kind::Float, lo, hi, {}, help, std::move(p)};
}
KeySpec S(const char* t, const char* k, std::vector<std::string> choices, std::function<void*(Deck&)> p,
          const char* help) {
  return KeySpec{t, k, Kind::String, -kInf, kInf, std::move(choices), help, std::move(p)};
}
}  // namespace

std::string KeySpec::rangeText() const {
  if (lo == -kInf && hi == kInf) return "any value";
  if (hi == kInf) return ">= " + num(lo);
  if (lo == -kInf) return "<= " + num(hi);
  return "[" + num(lo) + ", " + num(hi) + "]";
}

const std::vector<std::string>& packerNames() {
  static const std::vector<std::string> v{"original", "fixed_greedy", "fixed_optimal", "best_fit", "wlb", "slimpack"};
  return v;
}
const std::vector<std::string>& shardingNames() {
  static const std::vector<std::string> v{"per_sequence", "per_document", "adaptive", "whole_document", "hybrid"};
  return v;
}
const std::vector<std::string>& presetNameList() {
  static const std::vector<std::string> v{"long_context_128k", "pile", "code", "wikipedia", "sft_chat"};
  return v;
}

const std::vector<KeySpec>& deckSchema() {
  static const std::vector<KeySpec> schema = [] {
    const double big = 1e12;
    std::vector<KeySpec> s{
        S("model", "name", {}, WLB_F(model.name), "Free-form model name (reports only)."),
        I("model", "hidden", 1, 1 << 20, WLB_F(model.hidden), "Hidden size h."),
        I("model", "heads", 1, 4096, WLB_F(model.heads), "Attention (query) heads; must divide hidden."),
        I("model", "kv_heads", 1, 4096, WLB_F(model.kv_heads), "Key/value heads (GQA); must divide heads."),
        I("model", "ffn", 1, 1 << 22, WLB_F(model.ffn), "SwiGLU MLP intermediate size."),
        I("model", "layers", 1, 100000, WLB_F(model.layers),
          "Transformer layers; at least one per virtual stage (pp*virtual_stages), the first stages take the "
          "remainder."),
        I("model", "vocab", 1, 1 << 24, WLB_F(model.vocab), "Vocabulary size."),
        I("model", "dtype_bytes", 1, 8, WLB_F(model.dtype_bytes),
          "Bytes per element for memory/communication models (2 = bf16)."),
        I("model", "head_dim", 1, 1 << 20, WLB_F(model.head_dim), "Derived: hidden / heads."),

        I("mesh", "tp", 1, 1 << 16, WLB_F(mesh.tp), "Tensor-parallel size (innermost)."),
        I("mesh", "cp", 1, 1 << 16, WLB_F(mesh.cp), "Context-parallel size."),
        I("mesh", "pp", 1, 1 << 16, WLB_F(mesh.pp), "Pipeline-parallel stages."),
        I("mesh", "dp", 1, 1 << 20, WLB_F(mesh.dp), "Data-parallel replicas (outermost)."),
        I("mesh", "virtual_stages", 1, 1024, WLB_F(mesh.virtual_stages), "Model chunks per stage (interleaved 1F1B)."),

        S("data", "source", {"generator", "text", "jsonl", "megatron"}, WLB_F(data.source),
          "Length source: a generator preset, a text file (one length per line), JSONL, or a Megatron .idx."),
        S("data", "preset", presetNameList(), WLB_F(data.preset), "Generator preset (docs/data.md)."),
        S("data", "path", {}, WLB_F(data.path), "Length file for text/jsonl/megatron sources."),
        S("data", "jsonl_field", {}, WLB_F(data.jsonl_field), "JSONL field holding the token count."),
        KeySpec{"data", "seed", Kind::UInt, 0, 9.2e18, {}, "Random seed of the generator.", WLB_F(data.seed)},
        I("data", "context_window", 16, 1 << 26, WLB_F(data.context_window),
          "Context window S (tokens per fixed-length sequence)."),
        I("data", "s_max", 0, 1 << 28, WLB_F(data.s_max),
          "Variable-length micro-batch limit S_max; 0 = context_window."),
        F("data", "length_scale", 1e-6, 1e6, WLB_F(data.length_scale),
          "Multiply generated lengths (scaled-down runs keep the skew)."),

        S("packing", "strategy", packerNames(), WLB_F(packing.strategy), "Packer (docs/packing.md)."),
        I("packing", "micro_batches", 0, 1 << 20, WLB_F(packing.micro_batches),
          "Micro-batches per DP replica M; 0 = pp."),
        I("packing", "window", 1, 1024, WLB_F(packing.window),
          "fixed_greedy: global batches per packing window k (1 = repack within one global batch, the paper's "
          "Fixed-4D, preserving data order; larger k trades order for balance)."),
        KeySpec{"packing",
                "outlier_thresholds",
                Kind::IntList,
                1,
                big,
                {},
                "wlb: outlier queue thresholds L_1 < ... < L_n (tokens); empty = defaults (docs/packing.md).",
                WLB_F(packing.outlier_thresholds)},
        F("packing", "delay_budget", 0, 1e6, WLB_F(packing.delay_budget),
          "Mean per-token delay budget in steps (wlb tune)."),
        I("packing", "max_queue_wait", 0, 1 << 20, WLB_F(packing.max_queue_wait),
          "wlb: longest wait of an outlier in its queue (steps) before a forced release; 0 = max(2, "
          "ceil(5*delay_budget))."),
        I("packing", "slimpack_candidates", 1, 64, WLB_F(packing.slimpack_candidates),
          "slimpack: MicroPack counts m = i * pp scored per step by the simulator (i = i_min + 2^k - 1, k < this)."),
        I("packing", "slimpack_dp_merge", 0, 1, WLB_F(packing.slimpack_dp_merge),
          "slimpack: 1 = DP-Merge (a sample over one replica's forward-FLOPs share runs on a group of replicas as a CP "
          "group), 0 = off."),
        F("packing", "milp_time_limit", 0.01, 1e6, WLB_F(packing.milp_time_limit),
          "fixed_optimal: CBC time limit per solve (s)."),
        S("packing", "checkpoint", {}, WLB_F(packing.checkpoint),
          "wlb plan: file the packers' state is saved to after the last step (\"\" = none); --save-state overrides it, "
          "--resume reads one."),

        S("cp", "strategy", shardingNames(), WLB_F(cp.strategy), "CP sharding (docs/cp.md)."),
        S("cp", "comm", {"allgather", "sharding_aware"}, WLB_F(cp.comm), "KV communication mode."),
        F("cp", "capacity_factor", 1.0, 100.0, WLB_F(cp.capacity_factor),
          "whole_document: per-rank token cap as a multiple of tokens/cp."),

        S("pipeline", "schedule", {"gpipe", "1f1b", "interleaved", "packflow"}, WLB_F(pipeline.schedule),
          "Pipeline schedule (`packflow`: SlimPack plans; 1F1B order for the other packers)."),
        S("pipeline", "recompute", {"none", "selective", "full"}, WLB_F(pipeline.recompute),
          "Activation recomputation: selective recomputes the norms' outputs and the SwiGLU product in the "
          "backward (wlb simulate, run and train; the same numbers for the same plan, and SlimPack plans with the "
          "smaller activations), full the whole layer (wlb simulate only)."),

        S("hardware", "profile", {}, WLB_F(hardware.profile),
          "Hardware/kernel profile JSON (docs/profile-format.md) or \"analytic\"."),
        F("hardware", "tp_bandwidth_gbps", 0, 1e6, WLB_F(hardware.tp_bandwidth_gbps),
          "TP link GB/s; 0 = from profile."),
        F("hardware", "cp_bandwidth_gbps", 0, 1e6, WLB_F(hardware.cp_bandwidth_gbps),
          "CP link GB/s; 0 = from profile."),
        F("hardware", "pp_bandwidth_gbps", 0, 1e6, WLB_F(hardware.pp_bandwidth_gbps),
          "PP link GB/s; 0 = from profile."),
        F("hardware", "dp_bandwidth_gbps", 0, 1e6, WLB_F(hardware.dp_bandwidth_gbps),
          "DP link GB/s; 0 = from profile."),
        F("hardware", "link_latency_us", 0, 1e6, WLB_F(hardware.link_latency_us),
          "Per-message latency (us); 0 = from profile."),
        F("hardware", "memory_gb", 0, 1e6, WLB_F(hardware.memory_gb), "Device memory (GB); 0 = from profile."),

        I("run", "steps", 1, big, WLB_F(run.steps), "Measured (or planned) steps."),
        I("run", "warmup", 0, big, WLB_F(run.warmup), "Warm-up steps before measuring (wlb run)."),
        KeySpec{"run",
                "strategies",
                Kind::StringList,
                -kInf,
                kInf,
                {},
                "Strategies to compare: plain, fixed, wlb, slimpack or PACKER+SHARDING; empty = [packing]+[cp].",
                WLB_F(run.strategies)},
        S("run", "precision", {"fp32", "tf32", "bf16"}, WLB_F(run.precision),
          "Executor arithmetic and storage: fp32; tf32 (FP32 storage, TF32 tensor cores on a GPU); bf16 (activations "
          "and working weights stored in BF16, FP32 master weights, gradients, optimizer state and accumulation; "
          "host builds widen BF16 to FP32 to compute)."),
        S("run", "comm_backend", {"auto", "mpi", "nccl"}, WLB_F(run.comm_backend),
          "Executor collectives: host-staged mpi, nccl (CUDA build, one GPU per rank) or auto (nccl when it can run)."),
        S("run", "attention", attention::hopperVariants(), WLB_F(run.attention), attention::hopperVariantHelp()),

        S("train", "dataset", {}, WLB_F(train.dataset),
          "wlb train: dataset PREFIX from `wlb data prepare` (reads PREFIX_train and PREFIX_valid .bin/.idx; relative "
          "to the deck's directory first)."),
        I("train", "tokens", 1, big, WLB_F(train.tokens),
          "Token budget: steps = ceil(tokens / (dp * micro_batches * context_window))."),
        I("train", "steps", 0, big, WLB_F(train.steps), "Optimizer steps; 0 = from train.tokens."),
        F("train", "lr", 0, 10, WLB_F(train.lr), "Peak learning rate (AdamW)."),
        F("train", "min_lr_ratio", 0, 1, WLB_F(train.min_lr_ratio),
          "The cosine decays toward lr * min_lr_ratio, reached at step train.steps (one past the last)."),
        I("train", "warmup_steps", 0, big, WLB_F(train.warmup_steps), "Linear warm-up steps."),
        F("train", "weight_decay", 0, 10, WLB_F(train.weight_decay),
          "AdamW decoupled weight decay (matrices and embedding; not norm gains)."),
        F("train", "beta1", 0, 0.999999, WLB_F(train.beta1), "AdamW first-moment decay."),
        F("train", "beta2", 0, 0.999999, WLB_F(train.beta2), "AdamW second-moment decay."),
        F("train", "clip", 0, 1e6, WLB_F(train.clip), "Global gradient-norm clipping limit; 0 = none."),
        KeySpec{"train", "seed", Kind::UInt, 0, 9.2e18, {}, "Weight initialisation seed.", WLB_F(train.seed)},
        F("train", "rope_theta", 1, 1e9, WLB_F(train.rope_theta), "RoPE base."),
        I("train", "log_interval", 1, big, WLB_F(train.log_interval), "Progress line every N steps."),
        I("train", "eval_interval", 0, big, WLB_F(train.eval_interval),
          "Validation loss every N steps; 0 = at the end only."),
        I("train", "eval_tokens", 0, big, WLB_F(train.eval_tokens),
          "Validation tokens per evaluation (documents in order); 0 = the whole split."),
        I("train", "checkpoint_interval", 0, big, WLB_F(train.checkpoint_interval),
          "Checkpoint every N steps (and the last); 0 = only at a stop (--exit-after, SIGUSR1) and the last step of a "
          "resumed run."),
        S("train", "checkpoint_dir", {}, WLB_F(train.checkpoint_dir),
          "Checkpoint directory; \"\" = output.dir/checkpoint."),

        S("output", "dir", {}, WLB_F(output.dir), "Output directory."),
        S("output", "trace", {}, WLB_F(output.trace), "Trace file name (HDF5) inside dir."),
        S("output", "plan", {}, WLB_F(output.plan), "Plan file name (JSONL) inside dir."),
    };
    for (auto& k : s)
      if (k.table == "model" && k.key == "head_dim") k.derived = true;
    return s;
  }();
  return schema;
}

std::string deckReferenceMarkdown() {
  Deck defaults;
  std::ostringstream os;
  std::string table;
  for (const auto& k : deckSchema()) {
    if (k.table != table) {
      table = k.table;
      os << "\n### [" << table << "]\n\n| key | type | allowed | default | meaning |\n|---|---|---|---|---|\n";
    }
    const char* type = "";
    std::string def, allowed;
    void* p = k.ptr(defaults);
    switch (k.kind) {
      case Kind::Int:
        type = "integer";
        def = std::to_string(*static_cast<std::int64_t*>(p));
        allowed = k.rangeText();
        break;
      case Kind::UInt:
        type = "integer";
        def = std::to_string(*static_cast<std::uint64_t*>(p));
        allowed = k.rangeText();
        break;
      case Kind::Float:
        type = "float";
        def = num(*static_cast<double*>(p));
        allowed = k.rangeText();
        break;
      case Kind::String:
        type = "string";
        def = "\"" + *static_cast<std::string*>(p) + "\"";
        for (const auto& c : k.choices) allowed += (allowed.empty() ? "" : ", ") + std::string("`") + c + "`";
        if (allowed.empty()) allowed = "any";
        break;
      case Kind::IntList:
        type = "integer array";
        def = "[]";
        allowed = "each " + k.rangeText();
        break;
      case Kind::StringList:
        type = "string array";
        def = "[]";
        allowed = "see meaning";
        break;
    }
    os << "| `" << k.key << "` | " << type << " | " << allowed << " | `" << def << "` | " << k.help << " |\n";
  }
  return os.str();
}

}  // namespace wlb
