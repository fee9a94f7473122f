// wlb-mpi-ranks: 1 2
// wlb-timeout: 120
// SlimPack's sliced execution (runtime/sliced.hpp): a step whose documents are cut into
// causal slices — cut inside attention tiles, single-token slices, two slices of one sample
// in one MicroPack, backward MicroPacks grouped apart from the forward ones — gives the loss
// and weight gradients of the same documents run whole (FP32, relative error <= 1e-4), on
// one stage and on pp = world size under PackFlow, and sharded over a CP group of two
// (equal to one rank within 1e-5); the per-sample KV cache and dK/dV accumulators are all
// freed; the measured activation peak is the memory model's.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "cp/shard_plan.hpp"
#include "model/cost_model.hpp"
#include "model/memory.hpp"
#include "mpi_world.hpp"
#include "pp/schedule.hpp"
#include "runtime/pipeline.hpp"

using namespace wlb;
using namespace wlb::runtime;
using wlb::test::worldRank;
using wlb::test::worldSize;

namespace {

const char* kDeck = R"(
[model]
hidden = 64
heads = 4
kv_heads = 2
ffn = 96
layers = 3
vocab = 256
[data]
context_window = 512
)";

constexpr int kLayers = 3;

Segment seg(DocId d, std::int64_t off, std::int64_t len, std::int64_t q_off = -1) {
  Segment s;
  s.doc = d;
  s.offset = off;
  s.length = len;
  s.q_offset = q_off < 0 ? off : q_off;
  return s;
}
MicroBatch mb(std::vector<Segment> s) {
  MicroBatch m;
  m.segments = std::move(s);
  return m;
}

// Documents A (300 tokens), B (130), C (1), D (70), E (200); A and E sliced.
std::vector<MicroBatch> slicedPacks() {
  return {mb({seg(1, 0, 37), seg(2, 0, 130)}),                     // A[0,37) cut inside a tile
          mb({seg(1, 37, 1), seg(1, 38, 112), seg(3, 0, 1)}),      // a 1-token slice, its successor
          mb({seg(1, 150, 150), seg(4, 0, 70)}),                   //
          mb({seg(5, 0, 100), seg(5, 100, 1), seg(5, 101, 99)})};  // three slices of E together
}
std::vector<MicroBatch> wholePacks() {
  return {mb({seg(1, 0, 300), seg(2, 0, 130)}), mb({seg(3, 0, 1), seg(4, 0, 70)}), mb({seg(5, 0, 200)}), mb({})};
}

struct Outcome {
  double loss = 0;
  std::vector<float> grads;  // this rank's stage
  std::int64_t peak = 0;
};

struct Fixture {
  Deck deck = parseDeck(kDeck, "sliced-test-deck");
  model::CostModel cost = model::CostModel::fromDeck(deck);
  SyntheticTokens tokens{11, 256};
  Space space;
  LayerEnv env(MPI_Comm cp_comm = MPI_COMM_SELF) {
    LayerEnv e;
    e.space = &space;
    e.cp_comm = cp_comm;
    e.cost = &cost;
    return e;
  }
  // pp_comm = MPI_COMM_WORLD: the ranks are pipeline stages; MPI_COMM_SELF: each rank runs
  // every layer (a DP replica or, with cp_comm = MPI_COMM_WORLD, a CP rank), and `dp_sum`
  // sums the loss and gradients over the world.
  Outcome run(const StageStepInput& in, MPI_Comm pp_comm = MPI_COMM_WORLD, bool dp_sum = false,
              MPI_Comm cp_comm = MPI_COMM_SELF) {
    int pp = 1, stage_id = 0;
    MPI_Comm_size(pp_comm, &pp);
    MPI_Comm_rank(pp_comm, &stage_id);
    const pp::Schedule sched = pp::makeOneFOneB(pp, static_cast<int>(in.mb_tokens.size()));
    Llama model(LlamaConfig::fromDeck(deck, 1, 0, pp, stage_id, 1), 7);
    model.zeroGrads(space);
    PipelineStage stage(env(cp_comm), model, sched, pp_comm);
    StageStepInput run_in = in;
    run_in.tokens = &tokens;
    const StageStepResult r = stage.run(run_in, 0);
    Outcome o;
    if (pp_comm == MPI_COMM_SELF && !dp_sum)
      o.loss = r.loss;
    else
      MPI_Allreduce(&r.loss, &o.loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.grads());
    o.grads.assign(h.data(), h.data() + h.size());
    if (dp_sum)
      MPI_Allreduce(MPI_IN_PLACE, o.grads.data(), static_cast<int>(o.grads.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    o.peak = r.peak_activation_bytes;
    return o;
  }
  StageStepInput sliced(const std::vector<MicroBatch>& packs, const std::vector<std::int64_t>& cuts, int stages,
                        int cp = 1, cp::Strategy strategy = cp::Strategy::PerDocument) {
    StepPlan plan;
    plan.step = 3;
    plan.replicas = {packs};
    if (!cuts.empty()) plan.backward = {cuts};
    return slicedStepInput(3, plan, 0, stages, cp, cost, strategy, cp::CommMode::AllGather, CpConfig{});
  }
  StageStepInput whole(std::vector<MicroBatch> packs = wholePacks()) {
    StageStepInput in;
    in.step = 3;
    in.mbs = std::move(packs);
    CpConfig cfg;
    auto plans = cp::planReplicaShards(in.mbs, cp::Strategy::PerDocument, cp::CommMode::AllGather, 1, cost, cfg);
    for (std::size_t m = 0; m < in.mbs.size(); ++m) {
      in.mb_tokens.push_back(in.mbs[m].tokens());
      in.shards.push_back(plans[m].shard);
      in.comms.push_back(plans[m].comm);
    }
    return in;
  }
};

double relErr(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 1e30;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

// Every rank's verdict (a failed rank must not leave the others waiting).
bool allOk(bool ok) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// The memory model of a sliced step on one stage, walked over its schedule: per layer,
// executorLayerActivationBytes of each forward MicroPack's rows on `rank` with the
// continued segments' whole length as KV tokens (FP32 accumulators, plus the cached K/V
// under CP), and the head's input gradient of its rows (the one stage is the last), freed
// per backward MicroPack.
std::int64_t modelPeak(const Fixture& f, const StageStepInput& in, int rank) {
  const auto& r = *in.slices;
  const auto& sh = *in.slice_shards;
  const auto bytesOf = [&](const std::vector<std::int64_t>& c, int k) {
    std::int64_t tok = 0, kv = 0;
    for (auto i = c[static_cast<std::size_t>(k)]; i < c[static_cast<std::size_t>(k) + 1]; ++i) {
      tok += sh.rows[static_cast<std::size_t>(rank)][static_cast<std::size_t>(i)];
      if (r.continued[static_cast<std::size_t>(i)]) kv += r.segments[static_cast<std::size_t>(i)].length;
    }
    return kLayers * model::executorLayerActivationBytes(f.cost.dims(), 1, tok, kv, 4, sh.cp > 1 ? 8 : 4) +
           model::executorHeadBytes(f.cost.dims(), tok);
  };
  std::int64_t held = 0, peak = 0;
  for (const pp::Task& t : in.schedule->order[0]) {
    if (t.phase == pp::Phase::Fwd) {
      held += bytesOf(r.fwd_cuts, t.mb);
      peak = std::max(peak, held);
    } else {
      held -= bytesOf(r.bwd_cuts, t.mb);
    }
  }
  EXPECT_EQ(held, 0);
  return peak;
}

}  // namespace

TEST(Sliced, EqualsTheWholeDocuments) {
  Fixture f;
  const Outcome ref = f.run(f.whole());
  ASSERT_GT(std::abs(ref.loss), 0.0);
  // The asymmetric partition: segments 0-1 | 2 | 3-6 | 7-9 (forward: 0-1 | 2-4 | 5-6 | 7-9),
  // and the forward grouping itself.
  for (const auto& cuts : {std::vector<std::int64_t>{0, 2, 3, 7, 10}, std::vector<std::int64_t>{}}) {
    SCOPED_TRACE(cuts.empty() ? "symmetric" : "asymmetric");
    const StageStepInput in = f.sliced(slicedPacks(), cuts, worldSize());
    ASSERT_TRUE(in.slices && in.schedule);
    EXPECT_FALSE(in.schedule->paired);
    const Outcome got = f.run(in);
    EXPECT_NEAR(got.loss, ref.loss, 1e-4 * std::abs(ref.loss));
    ASSERT_EQ(got.grads.size(), ref.grads.size());
    const double e = relErr(got.grads, ref.grads);
    EXPECT_LE(e, 1e-4) << "rank " << worldRank();
    EXPECT_TRUE(allOk(e <= 1e-4));
    EXPECT_GT(got.peak, 0);
  }
}

TEST(Sliced, PeakIsTheMemoryModelOnOneStage) {
  if (worldSize() != 1) GTEST_SKIP() << "one stage";
  Fixture f;
  // Forward grouping for the backward: after the forwards of MicroPacks 0..3 and before
  // any backward (PackFlow on one stage: F0 B? ... the order decides); walk the schedule.
  const std::vector<std::int64_t> cuts{0, 2, 3, 7, 10};
  const StageStepInput in = f.sliced(slicedPacks(), cuts, 1);
  const Outcome got = f.run(in);
  EXPECT_EQ(got.peak, modelPeak(f, in, 0));
}

TEST(Sliced, UnderCpEqualsOneRank) {
  // The ranks as one CP group: each forward MicroPack sharded by a CP planner (the slices'
  // queries split over ranks or kept whole, their key prefixes gathered), against the same
  // plan on one rank (FP32, 1e-5) and the documents run whole (1e-4); then the peak is the
  // memory model's: each rank's rows, and every continued segment's whole length in
  // accumulators and KV cache.
  if (worldSize() != 2) GTEST_SKIP() << "a CP group of two";
  Fixture f;
  const Outcome whole = f.run(f.whole(), MPI_COMM_SELF);
  const std::vector<std::int64_t> cuts{0, 2, 3, 7, 10};
  const Outcome one = f.run(f.sliced(slicedPacks(), cuts, 1), MPI_COMM_SELF);
  for (const cp::Strategy st : cp::allStrategies()) {
    SCOPED_TRACE(cp::strategyName(st));
    const StageStepInput in = f.sliced(slicedPacks(), cuts, 1, 2, st);
    ASSERT_TRUE(in.slice_shards);
    int split_slices = 0;  // slices whose queries two ranks share
    for (std::size_t i = 0; i < in.slices->segments.size(); ++i)
      split_slices += in.slices->segments[i].q_offset > 0 && in.slice_shards->parts[i].size() > 1;
    if (st == cp::Strategy::PerSequence || st == cp::Strategy::PerDocument) {
      EXPECT_GT(split_slices, 0);
    }
    const Outcome got = f.run(in, MPI_COMM_SELF, true, MPI_COMM_WORLD);
    EXPECT_NEAR(got.loss, one.loss, 1e-5 * std::abs(one.loss));
    EXPECT_NEAR(got.loss, whole.loss, 1e-4 * std::abs(whole.loss));
    const double e1 = relErr(got.grads, one.grads), ew = relErr(got.grads, whole.grads);
    EXPECT_LE(e1, 1e-5) << "rank " << worldRank();
    EXPECT_LE(ew, 1e-4) << "rank " << worldRank();
    EXPECT_TRUE(allOk(e1 <= 1e-5 && ew <= 1e-4));

    EXPECT_EQ(got.peak, modelPeak(f, in, worldRank())) << "rank " << worldRank();
  }
}

TEST(Sliced, ASliceWithoutItsPrefixIsAPlanError) {
  // The slice of A at 37 without A[0, 37) in the step: the executor cannot build its keys.
  std::vector<MicroBatch> packs = {mb({seg(1, 37, 20)}), mb({seg(2, 0, 10)})};
  Fixture f;
  if (worldSize() == 1) {
    const StageStepInput in = f.sliced(packs, {}, 1);
    EXPECT_THROW(f.run(in), InputError);
  }
}

TEST(Sliced, DpMergeEqualsTheWholeDocuments) {
  // Two DP replicas; document A (300 tokens) runs on both as a CP group of 2 (DP-Merge,
  // slot 0, owner replica 0), the rest sliced on each replica.
  if (worldSize() != 2) GTEST_SKIP() << "two DP replicas";
  Fixture f;
  const Outcome ref = f.run(f.whole({mb({seg(1, 0, 300), seg(2, 0, 130)}), mb({seg(3, 0, 1), seg(4, 0, 70)}),
                                     mb({seg(5, 0, 200)}), mb({seg(6, 0, 200)})}),
                            MPI_COMM_SELF);
  StepPlan plan;
  plan.step = 3;
  plan.replicas = {{mb({seg(1, 0, 300)}), mb({seg(2, 0, 130), seg(5, 0, 100)}), mb({seg(5, 100, 1), seg(5, 101, 99)})},
                   {mb({}), mb({seg(4, 0, 70), seg(6, 0, 50)}), mb({seg(3, 0, 1), seg(6, 50, 150)})}};
  plan.backward = {{0, 1, 3, 5}, {0, 0, 1, 4}};
  plan.merged = {{0, {0, 1}}};
  StageStepInput in = slicedStepInput(3, plan, static_cast<std::size_t>(worldRank()), 1, 1, f.cost,
                                      cp::Strategy::PerDocument, cp::CommMode::AllGather, CpConfig{});
  ASSERT_EQ(in.merged.size(), 1u);
  EXPECT_EQ(in.merged[0].rank, worldRank());
  EXPECT_EQ(in.shards[0].ranks[static_cast<std::size_t>(worldRank())].tokens, 150);
  in.merged[0].comm = MPI_COMM_WORLD;
  const Outcome got = f.run(in, MPI_COMM_SELF, true);
  EXPECT_NEAR(got.loss, ref.loss, 1e-4 * std::abs(ref.loss));
  const double e = relErr(got.grads, ref.grads);
  EXPECT_LE(e, 1e-4) << "rank " << worldRank();
  EXPECT_TRUE(allOk(e <= 1e-4));
}
