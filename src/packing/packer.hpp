#pragma once
/// \file packer.hpp
/// \brief PP/DP-level packers (docs/packing.md, WLB-LLM): `original`, `fixed_greedy`,
/// `fixed_optimal` (CBC MILP), `best_fit`, `wlb` (variable-length packing + outlier-delay
/// queues), `slimpack` (slice-level MicroPacks, packing/slimpack.hpp), their metrics, and a
/// conservation checker. Semantics: docs/packing.md.
///
/// Contract shared by every packer:
///  - `pack(step, incoming)` is called once per step with consecutive steps; it returns
///    `replicas[dp][M]` micro-batches (some may be empty) and the ids of documents that
///    arrived by `step` but are still held back (queues, carry-over, window buffers).
///  - Every token that enters is trained exactly once: a document is emitted whole in one
///    segment, or — when longer than the packer's capacity (S for the fixed-length packers
///    and `original`, s_max for `wlb`) — as consecutive capacity-sized segments
///    (offset 0, cap, 2cap, ...), each emitted exactly once. Nothing is ever dropped.
///  - No micro-batch exceeds the packer's capacity in tokens.
///  - `slimpack` is the exception to the segment rule above: it cuts documents into causal
///    slices at cost-model boundaries (Segment::q_offset), and chooses the number of
///    micro-batches (MicroPacks) per step, the same on every replica.
///  - `saveState()`/`loadState()` capture everything held across steps; a packer restored
///    from a saved state produces the identical plan stream.

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/deck.hpp"
#include "core/types.hpp"
#include "model/cost_model.hpp"

namespace wlb::pp {
struct SimConfig;
}

namespace wlb::packing {

/// Packer parameters resolved from a deck.
struct PackerOptions {
  std::int64_t dp = 1;
  std::int64_t micro_batches = 1;                ///< M per replica
  std::int64_t context_window = 4096;            ///< S
  std::int64_t s_max = 4096;                     ///< variable-length limit (>= S)
  std::int64_t window = 1;                       ///< fixed_greedy: global batches per window (1 = the paper's Fixed-4D)
  std::vector<std::int64_t> outlier_thresholds;  ///< wlb: L_1 < ... < L_n (empty = none)
  /// wlb: a queued outlier that has waited this many steps is released even if its queue
  /// holds fewer than N documents (bounds the delay; 0 = never force).
  std::int64_t max_queue_wait = 8;
  double milp_time_limit = 10.0;  ///< fixed_optimal: seconds per solve
  /// wlb: mean per-token delay budget (steps); while the running mean delay exceeds it,
  /// the forced-release wait is shortened by one step (0 = no control).
  double delay_budget = 0;
  std::int64_t pp = 1;  ///< pipeline stages (slimpack: MicroPack counts are multiples of it)
  /// slimpack: MicroPack counts m = i * pp tried per step (docs/packing.md).
  std::int64_t slimpack_candidates = 6;
  /// slimpack: DP-Merge (docs/packing.md): a sample whose forward FLOPs exceed a replica's
  /// share runs on a group of replicas as a CP group.
  bool slimpack_dp_merge = true;
  /// slimpack: the step simulator's configuration that scores each count (set by
  /// makePacker from a deck; null = pp/dp of these options with the cost model's links).
  std::shared_ptr<const pp::SimConfig> sim;
  std::int64_t N() const { return dp * micro_batches; }
  /// Deck -> options. Empty outlier_thresholds in the deck -> defaultThresholds().
  static PackerOptions fromDeck(const Deck& deck);
};

/// Default wlb thresholds when the deck gives none (docs/packing.md): three levels,
/// L = 3S/16, 3S/8, 3S/4 (clamped to s_max).
std::vector<std::int64_t> defaultThresholds(std::int64_t context_window, std::int64_t s_max);

/// Abstract, stateful packer.
class Packer {
 public:
  virtual ~Packer();
  virtual std::string name() const = 0;
  /// Pack step `step` given its incoming documents (see the contract above).
  virtual StepPlan pack(std::int64_t step, const std::vector<Document>& incoming) = 0;
  /// Everything held across steps (queues, carry-over, window buffer) as JSON.
  virtual nlohmann::json saveState() const = 0;
  virtual void loadState(const nlohmann::json& state) = 0;
  /// Segments currently held back (carry-over, window buffer, outlier queues): what a
  /// checkpoint saves, and what a conservation check of a resumed stream starts from.
  virtual std::vector<Segment> heldSegments() const = 0;
  /// Tokens currently held back.
  std::int64_t pendingTokens() const;
  /// Per-step solver report: fixed_optimal fills it ({"status","objective","bound","gap",
  /// "seconds"}); other packers return null.
  virtual nlohmann::json lastSolverInfo() const { return nullptr; }
  const PackerOptions& options() const { return opt_; }

 protected:
  Packer(PackerOptions opt, const model::CostModel& cost) : opt_(std::move(opt)), cost_(&cost) {}
  PackerOptions opt_;
  const model::CostModel* cost_;
};

/// The most tokens one of `packer`'s micro-batches may hold: s_max for the variable-length
/// packers (wlb, slimpack), the context window S for the others.
std::int64_t capacity(const Packer& packer);

/// Packer names in a stable order: original, fixed_greedy, fixed_optimal, best_fit, wlb, slimpack.
std::vector<std::string> packerNames();
/// InputError naming `what` (the key or option it came from) unless `name` is a packer.
void checkPackerName(const std::string& name, const std::string& what);
/// Create a packer. `cost` must outlive it. InputError naming `packing.strategy` (and the
/// valid names) for an unknown name.
std::unique_ptr<Packer> makePacker(const std::string& name, const Deck& deck, const model::CostModel& cost);
std::unique_ptr<Packer> makePacker(const std::string& name, const PackerOptions& opt, const model::CostModel& cost);

/// Per-step metrics (docs/packing.md). Imbalance degree = max_j W(mb_j) / mean_j W(mb_j)
/// over all dp*M micro-batches of the step (empty ones count as 0 work; 1.0 when the step
/// has no work). Segments are independent causal attention spans (types.hpp), so
/// W_a(segment) = attnSeconds(0, length). Delays are token-weighted over trained tokens.
// NOLINTNEXTLINE(bugprone-exception-escape): flagged for its nlohmann::json member, whose moves do not throw
struct StepMetrics {
  std::int64_t step = 0;
  std::int64_t micro_batches = 0, segments = 0, tokens = 0, delayed_docs = 0;
  double imbalance_attn_fwd = 1, imbalance_attn_bwd = 1;    ///< attention only
  double imbalance_total_fwd = 1, imbalance_total_bwd = 1;  ///< W_a + W_l
  double imbalance = 1;                                     ///< total, fwd+bwd: the headline number
  double delay_mean = 0, delay_p99 = 0, delay_max = 0;      ///< steps, per token
  double tokens_max = 0, tokens_mean = 0;
  double max_work_seconds = 0;  ///< max_j W(mb_j), fwd+bwd, one layer
  double plan_us = 0;           ///< wall time of pack() (filled by the caller)
  nlohmann::json solver;        ///< Packer::lastSolverInfo() (null if none)
};
StepMetrics computeMetrics(const StepPlan& plan, const model::CostModel& cost);
nlohmann::json toJson(const StepMetrics& m);

/// Aggregate of many steps (means of per-step imbalance, token-weighted delay).
struct RunSummary {
  std::int64_t steps = 0, tokens = 0, documents = 0;
  double imbalance_mean = 0, imbalance_max = 0;
  double imbalance_attn_fwd_mean = 0, imbalance_attn_bwd_mean = 0;
  double imbalance_total_fwd_mean = 0, imbalance_total_bwd_mean = 0;
  double delay_mean = 0, delay_max = 0;  ///< per-token over the whole run
  double plan_us_mean = 0, plan_us_max = 0;
  double tokens_max_over_mean = 0;  ///< mean over steps of max/mean tokens per micro-batch
  double max_gap = 0;               ///< fixed_optimal: worst optimality gap seen
  void add(const StepMetrics& m);
  void finish();
  nlohmann::json toJson() const;

 private:
  double delay_token_sum_ = 0;
};

/// Verifies conservation: every incoming token trained exactly once, segments of a
/// document contiguous and complete, no micro-batch over capacity, no segment before its
/// document arrived. Memory is O(documents in flight).
class ConservationChecker {
 public:
  explicit ConservationChecker(std::int64_t capacity) : capacity_(capacity) {}
  void addIncoming(const std::vector<Document>& docs);
  /// A resumed stream: the restored packer's held segments are documents that arrived
  /// before the checkpoint; the part of each before its first held offset was trained
  /// then. Call once, before the first addIncoming.
  void addHeld(const std::vector<Segment>& held);
  void addPlan(const StepPlan& plan);
  /// Documents fully trained / still in flight / errors so far.
  std::int64_t completed() const { return completed_; }
  std::int64_t inFlight() const { return static_cast<std::int64_t>(open_.size()); }
  std::int64_t duplicated() const { return duplicated_; }  ///< segments repeating tokens
  std::int64_t unknown() const { return unknown_; }        ///< segments of never-seen docs
  std::int64_t overCapacity() const { return over_capacity_; }
  std::int64_t early() const { return early_; }  ///< trained before arrival
  /// Step-document pairs where an arrived, unfinished document was missing from
  /// StepPlan::delayed (the packer "forgot" it).
  std::int64_t unreported() const { return unreported_; }
  /// At the end of a run: documents still held by the packer are not lost; pass the
  /// packer's pending token count; lost = in-flight tokens not accounted for by it.
  std::int64_t lostTokens(std::int64_t packer_pending_tokens) const;
  std::int64_t inFlightTokens() const;
  bool ok(std::int64_t packer_pending_tokens) const;
  std::string report(std::int64_t packer_pending_tokens) const;

 private:
  struct Open {
    std::int64_t length = 0, covered = 0, arrival = 0;
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;  ///< trained [off, end)
  };
  std::unordered_map<DocId, Open> open_;
  DocId max_seen_ = -1;
  std::int64_t capacity_;
  std::int64_t completed_ = 0, duplicated_ = 0, unknown_ = 0, over_capacity_ = 0, early_ = 0, unreported_ = 0;
};

/// Split documents into capacity-sized segments (the shared rule for documents longer
/// than a packer's capacity). Each result holds one segment.
std::vector<Segment> splitToSegments(const std::vector<Document>& docs, std::int64_t cap);

}  // namespace wlb::packing
