// wlb-timeout: 60
// Profile version 2 (deck-shaped linear ops, factors) and the calibration fit
// (model/calibration.hpp): v1 profiles predict exactly as before, the table and factors enter
// linear and attention time as documented, bad content names the key, and the fit recovers
// known factors and link bandwidths from a synthetic measured run.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "core/deck.hpp"
#include "core/error.hpp"
#include "model/calibration.hpp"
#include "model/cost_model.hpp"

using namespace wlb;
using model::Phase;

namespace {

const char* kV1 = R"({"format": "wlb-hardware-profile", "version": 1, "peak_gflops": 100,
    "linear_gflops": 50, "tile_q": 64, "tile_k": 64,
    "links": {"cp_gbps": 2.0, "dp_gbps": 3.0, "tp_gbps": 4.0, "pp_gbps": 1.0, "latency_us": 5.0},
    "attention": {
      "fwd": {"q_lens": [64, 1024], "k_lens": [64, 1024], "gflops": [[40, 50], [40, 80]]},
      "bwd": {"q_lens": [64, 1024], "k_lens": [64, 1024], "gflops": [[30, 45], [30, 90]]}}})";

model::ModelDims dims() {
  model::ModelDims d;
  d.hidden = 256;
  d.heads = 4;
  d.kv_heads = 2;
  d.head_dim = 64;
  d.ffn = 704;
  d.layers = 1;
  return d;
}

nlohmann::json linearOps() {
  return nlohmann::json::parse(R"({
    "shape": {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "ffn": 704, "tp": 1},
    "tokens": [1000, 4000],
    "gflops": {"qkv_proj": {"fwd": [100, 80], "bwd": [90, 70]},
               "out_proj": {"fwd": [110, 60], "bwd": [95, 75]},
               "mlp":      {"fwd": [70, 50],  "bwd": [85, 65]}},
    "elementwise_ns_per_token": {"fwd": [100, 200], "bwd": [150, 300]},
    "fill_ns_per_token": {"fwd": [400, 400], "bwd": [500, 500]}})");
}

std::string write(const std::string& name, const nlohmann::json& j) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << j.dump(2);
  return path;
}

nlohmann::json v2(const nlohmann::json& factors = nlohmann::json::object()) {
  auto j = nlohmann::json::parse(kV1);
  j["version"] = 2;
  j["linear_ops"] = linearOps();
  if (!factors.empty()) j["factors"] = factors;
  return j;
}

void expectInputError(const nlohmann::json& j, const std::string& key) {
  try {
    (void)model::HardwareProfile::load(write("bad.json", j));
    FAIL() << "accepted a profile with a bad " << key;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(ProfileV2, VersionOneLoadsAndPredictsAsBefore) {
  const auto p = model::HardwareProfile::load(write("v1.json", nlohmann::json::parse(kV1)));
  EXPECT_EQ(p.version, 1);
  EXPECT_TRUE(p.linear_ops.empty());
  const model::CostModel c(dims(), p);
  EXPECT_FALSE(c.linearTableUsed());
  for (std::int64_t n : {1, 100, 4096})
    for (auto ph : {Phase::Fwd, Phase::Bwd})
      EXPECT_EQ(c.linearSeconds(n, ph), c.linearFlops(n, ph) / (50.0 * 1e9));  // bit for bit
  // the per-op split sums to the whole
  double f = 0;
  for (int op = 0; op < model::kLinearOpCount; ++op)
    f += c.linearOpFlops(static_cast<model::LinearOp>(op), 777, Phase::Bwd);
  EXPECT_NEAR(f, c.linearFlops(777, Phase::Bwd), 1e-6 * f);
}

TEST(ProfileV2, LinearTableAtTheReferenceTokensLinearInTokens) {
  const auto p = model::HardwareProfile::load(write("v2.json", v2()));
  EXPECT_EQ(p.version, 2);
  model::CostModel c(dims(), p);
  ASSERT_TRUE(c.linearTableUsed());
  EXPECT_NEAR(c.linearReferenceTokens(), 2000.0, 1e-9);  // geometric middle of 1000..4000
  c.setLinearReferenceTokens(4000);
  // at the table's second point: ops at their GFLOP/s, elementwise + fill/layers per token
  const double n = 3000;
  double expect = 0;
  const double gf[3] = {80, 60, 50};
  for (int op = 0; op < 3; ++op)
    expect += c.linearOpFlops(static_cast<model::LinearOp>(op), 3000, Phase::Fwd) / (gf[op] * 1e9);
  expect += (200 + 400) * n * 1e-9;
  EXPECT_NEAR(c.linearSeconds(3000, Phase::Fwd), expect, 1e-12);
  // linear in tokens: a packer's per-document sums equal the micro-batch's
  EXPECT_NEAR(c.linearSeconds(1000, Phase::Bwd) + c.linearSeconds(2000, Phase::Bwd), c.linearSeconds(3000, Phase::Bwd),
              1e-12);
  // clamped outside the grid, interpolated in log-log inside
  c.setLinearReferenceTokens(1e6);
  const double at_max = c.linearOpSeconds(model::LinearOp::Mlp, 100, Phase::Fwd);
  c.setLinearReferenceTokens(4000);
  EXPECT_DOUBLE_EQ(at_max, c.linearOpSeconds(model::LinearOp::Mlp, 100, Phase::Fwd));
  c.setLinearReferenceTokens(2000);
  const double mid = c.linearOpFlops(model::LinearOp::Mlp, 100, Phase::Fwd) /
                     c.linearOpSeconds(model::LinearOp::Mlp, 100, Phase::Fwd) * 1e-9;
  EXPECT_NEAR(mid, std::sqrt(70.0 * 50.0), 1e-9);

  // another shape (or tp) falls back to linear_gflops and no elementwise term
  auto d = dims();
  d.ffn = 512;
  const model::CostModel other(d, p);
  EXPECT_FALSE(other.linearTableUsed());
  EXPECT_EQ(other.linearSeconds(100, Phase::Fwd), other.linearFlops(100, Phase::Fwd) / (50.0 * 1e9));
  EXPECT_FALSE(model::CostModel(dims(), p, 2).linearTableUsed());
  // a table that records its vocabulary (the LM head is inside fill_ns) matches that one only;
  // one without (written before the head) matches any
  auto jv = v2();
  jv["linear_ops"]["shape"]["vocab"] = 256;
  const auto pv = model::HardwareProfile::load(write("vocab.json", jv));
  auto d256 = dims(), d32k = dims();
  d256.vocab = 256;
  d32k.vocab = 32000;
  EXPECT_TRUE(model::CostModel(d256, pv).linearTableUsed());
  EXPECT_FALSE(model::CostModel(d32k, pv).linearTableUsed());
  EXPECT_TRUE(model::CostModel(d32k, p).linearTableUsed());
}

TEST(ProfileV2, FromDeckReadsTheTableAtARanksShareOfAMicroBatch) {
  Deck deck;
  deck.model.hidden = 256;
  deck.model.heads = 4;
  deck.model.kv_heads = 2;
  deck.model.head_dim = 64;
  deck.model.ffn = 704;
  deck.model.layers = 1;
  deck.data.context_window = 8192;
  deck.mesh.cp = 2;
  deck.hardware.profile = write("deck.json", v2());
  const auto c = model::CostModel::fromDeck(deck);
  EXPECT_TRUE(c.linearTableUsed());
  EXPECT_DOUBLE_EQ(c.linearReferenceTokens(), 4096.0);
  deck.mesh.cp = 1;
  EXPECT_DOUBLE_EQ(model::CostModel::fromDeck(deck).linearReferenceTokens(), 8192.0);
}

TEST(ProfileV2, FactorsDivideTime) {
  const auto base = model::HardwareProfile::load(write("f1.json", v2()));
  const auto fac = model::HardwareProfile::load(
      write("f2.json", v2({{"attn.fwd", 0.5}, {"attn.bwd", 0.8}, {"mlp.bwd", 0.25}, {"elementwise", 2.0}})));
  const model::CostModel a(dims(), base), b(dims(), fac);
  EXPECT_NEAR(b.attnSeconds(100, 500, Phase::Fwd), a.attnSeconds(100, 500, Phase::Fwd) / 0.5, 1e-15);
  EXPECT_NEAR(b.attnSeconds(100, 500, Phase::Bwd), a.attnSeconds(100, 500, Phase::Bwd) / 0.8, 1e-15);
  EXPECT_NEAR(b.linearOpSeconds(model::LinearOp::Mlp, 900, Phase::Bwd),
              4.0 * a.linearOpSeconds(model::LinearOp::Mlp, 900, Phase::Bwd), 1e-15);
  EXPECT_EQ(b.linearOpSeconds(model::LinearOp::Mlp, 900, Phase::Fwd),
            a.linearOpSeconds(model::LinearOp::Mlp, 900, Phase::Fwd));
  EXPECT_NEAR(b.elementwiseSeconds(900, Phase::Fwd), a.elementwiseSeconds(900, Phase::Fwd) / 2.0, 1e-15);
  // factors also apply to a profile without a linear table (every op at linear_gflops)
  auto j = nlohmann::json::parse(kV1);
  j["version"] = 2;
  j["factors"] = {{"qkv_proj.fwd", 0.5}};
  const model::CostModel v1f(dims(), model::HardwareProfile::load(write("f3.json", j)));
  EXPECT_NEAR(v1f.linearOpSeconds(model::LinearOp::QkvProj, 10, Phase::Fwd),
              v1f.linearOpFlops(model::LinearOp::QkvProj, 10, Phase::Fwd) / (25.0 * 1e9), 1e-18);
  EXPECT_EQ(v1f.elementwiseSeconds(10, Phase::Fwd), 0.0);
}

// The backward's selective recomputation: per token and layer at the reference token count,
// an elementwise cost (its factor divides it); 0 in a profile that did not measure it.
TEST(ProfileV2, RecomputeIsPricedFromTheTable) {
  auto j = v2({{"elementwise", 2.0}});
  j["linear_ops"]["recompute_ns_per_token"] = {50.0, 80.0};
  const auto p = model::HardwareProfile::load(write("rc.json", j));
  model::CostModel c(dims(), p);
  c.setLinearReferenceTokens(4000);
  EXPECT_NEAR(c.recomputeSeconds(3000), 80.0 * 3000 * 1e-9 / 2.0, 1e-15);
  c.setLinearReferenceTokens(2000);
  EXPECT_NEAR(c.recomputeSeconds(1000), (50.0 + 0.5 * 30.0) * 1000 * 1e-9 / 2.0, 1e-15);  // linear in log tokens
  EXPECT_EQ(c.recomputeSeconds(0), 0.0);
  EXPECT_EQ(model::CostModel(dims(), model::HardwareProfile::load(write("rc0.json", v2()))).recomputeSeconds(1000),
            0.0);
  EXPECT_EQ(model::CostModel(dims(), model::HardwareProfile::analytic()).recomputeSeconds(1000), 0.0);
  j["linear_ops"]["recompute_ns_per_token"] = {50.0};
  expectInputError(j, "linear_ops.recompute_ns_per_token");
  j["linear_ops"]["recompute_ns_per_token"] = {50.0, -1.0};
  expectInputError(j, "linear_ops.recompute_ns_per_token");
}

TEST(ProfileV2, BadContentNamesTheKey) {
  auto j = v2();
  j["version"] = 3;
  expectInputError(j, "version");
  expectInputError(v2({{"attn.sideways", 1.0}}), "factors.attn.sideways");
  expectInputError(v2({{"mlp.fwd", 0}}), "factors.mlp.fwd");
  expectInputError(v2({{"mlp.fwd", "fast"}}), "factors.mlp.fwd");
  j = v2();
  j["linear_ops"]["gflops"]["mlp"]["fwd"] = {1.0};
  expectInputError(j, "linear_ops.gflops.mlp.fwd");
  j = v2();
  j["linear_ops"]["gflops"].erase("out_proj");
  expectInputError(j, "linear_ops.gflops.out_proj");
  j = v2();
  j["linear_ops"]["tokens"] = {4000, 1000};
  expectInputError(j, "linear_ops.tokens");
  j = v2();
  j["linear_ops"]["shape"]["ffn"] = -1;
  expectInputError(j, "linear_ops.shape.ffn");
  j = v2();
  j["linear_ops"]["elementwise_ns_per_token"]["bwd"] = {1.0, -2.0};
  expectInputError(j, "linear_ops.elementwise_ns_per_token.bwd");
  j = v2();
  j["linear_ops"]["speed"] = 1;
  expectInputError(j, "linear_ops.speed");
  j = v2();
  j["rank_speed"] = {{"spread", 1.5}};
  expectInputError(j, "rank_speed.spread");
  j["rank_speed"] = {{"task_spread", "wide"}};
  expectInputError(j, "rank_speed.task_spread");
  j["rank_speed"] = {{"step_spread", -0.1}};
  expectInputError(j, "rank_speed.step_spread");
  j["rank_speed"] = {{"spread", 0.12}, {"task_spread", 0.2}};
  auto p = model::HardwareProfile::load(write("spread.json", j));
  EXPECT_EQ(p.rank_spread, 0.12);
  EXPECT_EQ(p.step_spread, 0.0);  // a profile of the first version: no step wander
  EXPECT_EQ(p.task_spread, 0.2);
  j["rank_speed"]["step_spread"] = 0.15;
  p = model::HardwareProfile::load(write("spread.json", j));
  EXPECT_EQ(p.step_spread, 0.15);
}

namespace {

/// A measured run whose every op took exactly what `truth` predicts (attention per piece,
/// linear ops at the tokens their FLOPs stand for, elementwise work partly in embed/loss
/// events and the rest outside every event), with a CP pair whose slower member waits for its
/// partner in the KV exchange and the gradient all-reduce.
model::MeasuredRun syntheticRun(const model::HardwareProfile& truth, double cp_gbps) {
  model::MeasuredRun run;
  run.name = "synthetic.h5";
  run.dims = dims();
  run.dims.layers = 2;
  run.tp = 1;
  run.cp = 2;
  run.dp = 1;
  run.linear_ref_tokens = 3000;
  run.strategies = {"plain", "wlb"};
  run.ranks = {{0, 0, 0}, {0, 1, 0}};
  model::CostModel cost(run.dims, truth, 1);
  cost.setLinearReferenceTokens(run.linear_ref_tokens);
  for (int s = 0; s < 2; ++s)
    for (std::int64_t step = 1; step <= 3; ++step) {
      for (int mb = 0; mb < 2; ++mb) {
        std::vector<model::RankShare> shares(2);
        for (int r = 0; r < 2; ++r) {
          auto& sh = shares[static_cast<std::size_t>(r)];
          const std::int64_t a = 200 + 300 * r + 97 * s + 31 * step + 50 * mb, b = 700 + 113 * step - 40 * r;
          sh.pieces = {{0, a}, {a, b}, {0, 64 + 5 * step}};
          sh.tokens = a + b + 64 + 5 * step;
        }
        run.shares[{s, step, 0, mb}] = shares;
      }
      for (int r = 0; r < 2; ++r) {
        double inside = 0;  // op events other than the fills
        const auto ev = [&](const std::string& op, int phase, int mb, int layer, double sec, double flops = 0,
                            double bytes = 0) {
          run.events.push_back({op, phase, r, s, step, mb, layer, sec, flops, bytes});
        };
        double elementwise = 0;
        for (int mb = 0; mb < 2; ++mb) {
          const auto& sh = run.shares[{s, step, 0, mb}][static_cast<std::size_t>(r)];
          const double e =
              2.0 * (cost.elementwiseSeconds(sh.tokens, Phase::Fwd) + cost.elementwiseSeconds(sh.tokens, Phase::Bwd));
          elementwise += e;
          ev("embed", 1, mb, -1, 0.1 * e);  // a quarter of it in the fill events
          ev("loss", 2, mb, -1, 0.15 * e);
          for (int layer = 0; layer < 2; ++layer)
            for (auto ph : {Phase::Fwd, Phase::Bwd}) {
              const int tph = ph == Phase::Fwd ? 1 : 2;
              double attn = 0;
              for (const auto& p : sh.pieces) attn += cost.attnSeconds(p.q0, p.q, ph);
              ev("attn", tph, mb, layer, attn, 123.0);
              inside += attn;
              for (int op = 0; op < model::kLinearOpCount; ++op) {
                const auto o = static_cast<model::LinearOp>(op);
                const double t = cost.linearOpSeconds(o, sh.tokens, ph);
                ev(model::linearOpName(o), tph, mb, layer, t, cost.linearOpFlops(o, sh.tokens, ph));
                inside += t;
              }
              // the fastest member's time is the transfer; the other waited 50% longer
              const double bytes = 1e5 * (1 + mb + layer), t = bytes / (cp_gbps * 1e9) * (r == 0 ? 1.0 : 1.5);
              ev("kv_exchange", tph, mb, layer, t, 0, bytes);
              inside += t;
            }
        }
        const double grad_bytes = 4e6, tg = grad_bytes / (cp_gbps * 1e9) * (r == 1 ? 1.0 : 3.0);
        ev("grad_allreduce", 2, -1, -1, tg, 0, grad_bytes);
        inside += tg;
        ev("step", 0, -1, -1, inside + elementwise);  // the rest of the elementwise time is outside events
      }
    }
  return run;
}

}  // namespace

TEST(Calibration, FitRecoversKnownFactorsAndLinks) {
  // truth: the profile with these factors; the fit starts from the unit-factor profile and
  // from one with other factors, and must land on the truth either way.
  const nlohmann::json true_factors = {{"attn.fwd", 0.7},     {"attn.bwd", 0.9},     {"qkv_proj.fwd", 0.8},
                                       {"qkv_proj.bwd", 1.3}, {"out_proj.fwd", 0.6}, {"out_proj.bwd", 1.1},
                                       {"mlp.fwd", 0.5},      {"mlp.bwd", 0.75},     {"elementwise", 1.6}};
  const auto truth = model::HardwareProfile::load(write("truth.json", v2(true_factors)));
  const auto run = syntheticRun(truth, 0.8);
  for (const auto& start : {v2(), v2({{"attn.fwd", 2.0}, {"mlp.bwd", 0.1}, {"elementwise", 3.0}})}) {
    const auto p0 = model::HardwareProfile::load(write("start.json", start));
    const auto fit = model::fitProfile({run}, p0);
    ASSERT_EQ(fit.factors.size(), model::Factors::keys().size());
    for (const auto& f : fit.factors) {
      ASSERT_TRUE(f.fitted) << f.key << ": " << f.note;
      EXPECT_NEAR(f.after, true_factors.at(f.key).get<double>(), 1e-9) << f.key;
      EXPECT_NEAR(f.before, p0.factors.at(f.key), 0) << f.key;
    }
    EXPECT_EQ(fit.unmatched_events, 0u);
    // links: bytes over the fastest member's time (the ring's 2(n-1)/n = 1 for 2 ranks)
    ASSERT_EQ(fit.links.size(), 2u);
    EXPECT_TRUE(fit.links[0].fitted);
    EXPECT_EQ(fit.links[0].key, "links.cp_gbps");
    EXPECT_NEAR(fit.links[0].after, 0.8, 1e-9);
    EXPECT_FALSE(fit.links[1].fitted);  // dp = 1: no dp collective
    // residual: every strategy predicted exactly after the fit
    for (const auto& r : fit.residuals)
      EXPECT_NEAR(r.measured_s / r.predicted_s, 1.0, 1e-9) << r.strategy << " " << r.key;
    // the fitted profile predicts each op kind's measured total
    const auto fitted = fit.apply(p0);
    model::CostModel c(run.dims, fitted, 1);
    c.setLinearReferenceTokens(run.linear_ref_tokens);
    double meas = 0, pred = 0;
    for (const auto& e : run.events)
      if (e.op == "mlp" && e.phase == 2) {
        meas += e.seconds;
        pred +=
            c.linearOpSeconds(model::LinearOp::Mlp,
                              std::llround(e.flops / c.linearOpFlops(model::LinearOp::Mlp, 1, Phase::Bwd)), Phase::Bwd);
      }
    EXPECT_NEAR(pred / meas, 1.0, 1e-9);
    EXPECT_NEAR(fitted.cp_bandwidth_gbps, 0.8, 1e-9);
  }
}

namespace {

/// A one-strategy run of `ranks` (world rank -> coordinate) at 2000 reference tokens, and
/// the cost model of `truth` that times its events.
model::MeasuredRun plainRun(const std::string& name, std::vector<model::MeasuredRun::Coord> ranks) {
  model::MeasuredRun run;
  run.name = name;
  run.dims = dims();
  run.linear_ref_tokens = 2000;
  run.strategies = {"plain"};
  run.ranks = std::move(ranks);
  return run;
}

model::CostModel costOf(const model::MeasuredRun& run, const model::HardwareProfile& truth) {
  model::CostModel cost(run.dims, truth, 1);
  cost.setLinearReferenceTokens(run.linear_ref_tokens);
  return cost;
}

/// The fit of one factor key; a test failure when the fit has none.
const model::FactorFit* factorOf(const model::CalibrationFit& fit, const std::string& key) {
  for (const auto& f : fit.factors)
    if (f.key == key) return &f;
  ADD_FAILURE() << "no factor " << key;
  return nullptr;
}

}  // namespace

// A run whose layers spend exactly what a profile with elementwise = 0.5 predicts; in the
// second, pipeline.recompute = "selective", also `recompute` events, elementwise work that
// recomputeSeconds predicts beside elementwiseSeconds.
TEST(Calibration, ElementwiseFactorFromTheTimeOutsideOps) {
  for (const bool selective : {false, true}) {
    auto tj = v2({{"elementwise", 0.5}}), bj = v2();
    for (auto* j : {&tj, &bj}) (*j)["linear_ops"]["recompute_ns_per_token"] = {60.0, 90.0};
    const auto truth = model::HardwareProfile::load(write("te.json", tj));
    auto run = plainRun("e.h5", {{0, 0, 0}});
    const auto cost = costOf(run, truth);
    for (std::int64_t step = 0; step < 4; ++step) {
      const std::int64_t n = 1500 + 200 * step;
      run.shares[{0, step, 0, 0}] = {model::RankShare{n, {{0, n}}}};
      const double q = cost.linearOpSeconds(model::LinearOp::QkvProj, n, Phase::Fwd);
      const double el = cost.elementwiseSeconds(n, Phase::Fwd) + cost.elementwiseSeconds(n, Phase::Bwd);
      const double rc = selective ? cost.recomputeSeconds(n) : 0.0;
      run.events.push_back(
          {"qkv_proj", 1, 0, 0, step, 0, 0, q, cost.linearOpFlops(model::LinearOp::QkvProj, n, Phase::Fwd)});
      run.events.push_back({"embed", 1, 0, 0, step, 0, -1, 0.25 * el, 0});
      if (selective) run.events.push_back({"recompute", 2, 0, 0, step, 0, 0, rc, 0});
      run.events.push_back({"step", 0, 0, 0, step, -1, -1, q + el + rc, 0});
    }
    const auto fit = model::fitProfile({run}, model::HardwareProfile::load(write("e0.json", bj)));
    for (const auto& f : fit.factors)
      if (f.key == "elementwise") {
        ASSERT_TRUE(f.fitted);
        EXPECT_NEAR(f.after, 0.5, 1e-9) << (selective ? "selective" : "none");
      } else if (f.key == "qkv_proj.fwd") {
        EXPECT_NEAR(f.after, 1.0, 1e-9);
      } else {
        EXPECT_FALSE(f.fitted) << f.key;  // no events of that kind
      }
  }
}

TEST(Calibration, ElementwiseFactorFromPipelineStagesTogether) {
  // pp = 2: each stage runs half the layers' elementwise work, stage 0 also the embedding and
  // stage 1 the loss end, and each waits in `pp_recv` for the other; per stage the time
  // outside events is no layer count's share, summed over the stages it is the model's.
  const auto truth = model::HardwareProfile::load(write("tp2.json", v2({{"elementwise", 0.5}})));
  auto run = plainRun("pp2.h5", {{0, 0, 0}, {0, 0, 0}});  // two stages of one (tp, cp, dp) coordinate
  run.dims.layers = 4;
  const auto cost = costOf(run, truth);
  for (std::int64_t step = 0; step < 4; ++step) {
    const std::int64_t n = 1500 + 200 * step;
    run.shares[{0, step, 0, 0}] = {model::RankShare{n, {{0, n}}}};
    const double el = 4.0 * (cost.elementwiseSeconds(n, Phase::Fwd) + cost.elementwiseSeconds(n, Phase::Bwd));
    const double q = cost.linearOpSeconds(model::LinearOp::QkvProj, n, Phase::Fwd);
    const double flops = cost.linearOpFlops(model::LinearOp::QkvProj, n, Phase::Fwd);
    // stage 0: embed 10% of the model's elementwise time, 30% outside events, waits 0.2 s
    run.events.push_back({"qkv_proj", 1, 0, 0, step, 0, 0, q, flops});
    run.events.push_back({"embed", 1, 0, 0, step, 0, -1, 0.1 * el, 0});
    run.events.push_back({"pp_recv", 2, 0, 0, step, 0, -1, 0.2, 0});
    run.events.push_back({"step", 0, 0, 0, step, -1, -1, q + 0.4 * el + 0.2, 0});
    // stage 1: the loss end 35%, 25% outside events, waits 0.3 s
    run.events.push_back({"qkv_proj", 1, 1, 0, step, 0, 2, q, flops});
    run.events.push_back({"loss", 1, 1, 0, step, 0, -1, 0.35 * el, 0});
    run.events.push_back({"pp_recv", 1, 1, 0, step, 0, -1, 0.3, 0});
    run.events.push_back({"step", 0, 1, 0, step, -1, -1, q + 0.6 * el + 0.3, 0});
  }
  const auto fit = model::fitProfile({run}, model::HardwareProfile::load(write("tp0.json", v2())));
  const auto* f = factorOf(fit, "elementwise");
  ASSERT_NE(f, nullptr);
  ASSERT_TRUE(f->fitted);
  EXPECT_NEAR(f->after, 0.5, 1e-9);
  EXPECT_EQ(f->events, 4u);  // one observation per step: the two stages together
}

TEST(Calibration, AnOpRecordedAsSeveralEventsIsFittedOnTheirSum) {
  // The layer records an op's GEMMs (with their FLOPs) and its residual add and norm (without)
  // as two events of the op's label, and `wlb profile` times both as the op: calibrating on
  // the GEMM event alone would fit the op faster than it runs.
  const auto truth = model::HardwareProfile::load(write("ts.json", v2({{"mlp.bwd", 0.5}})));
  auto run = plainRun("split.h5", {{0, 0, 0}});
  const auto cost = costOf(run, truth);
  for (std::int64_t step = 0; step < 3; ++step) {
    const std::int64_t n = 1500 + 300 * step;
    run.shares[{0, step, 0, 0}] = {model::RankShare{n, {{0, n}}}};
    const double t = cost.linearOpSeconds(model::LinearOp::Mlp, n, Phase::Bwd);
    const double flops = cost.linearOpFlops(model::LinearOp::Mlp, n, Phase::Bwd);
    for (int layer = 0; layer < 2; ++layer) {
      run.events.push_back({"mlp", 2, 0, 0, step, 0, layer, 0.8 * t, flops});
      run.events.push_back({"mlp", 2, 0, 0, step, 0, layer, 0.2 * t, 0});
    }
  }
  const auto fit = model::fitProfile({run}, model::HardwareProfile::load(write("ts0.json", v2())));
  EXPECT_EQ(fit.unmatched_events, 0u);
  const auto* f = factorOf(fit, "mlp.bwd");
  ASSERT_NE(f, nullptr);
  ASSERT_TRUE(f->fitted);
  EXPECT_NEAR(f->after, 0.5, 1e-9);
  EXPECT_EQ(f->events, 6u);  // one observation per op instance, not per event
}

TEST(Calibration, WithoutATableElementwiseIsNotModelled) {
  auto run = syntheticRun(model::HardwareProfile::load(write("t1.json", v2())), 1.0);
  const auto fit = model::fitProfile({run}, model::HardwareProfile::load(write("t2.json", nlohmann::json::parse(kV1))));
  for (const auto& f : fit.factors)
    if (f.key == "elementwise") {
      EXPECT_FALSE(f.fitted);
      EXPECT_NE(f.note.find("linear_ops"), std::string::npos) << f.note;
    } else {
      EXPECT_TRUE(f.fitted) << f.key;
    }
}

TEST(Calibration, RunWithoutComputeEventsIsBadInput) {
  model::MeasuredRun run;
  run.name = "empty.h5";
  run.dims = dims();
  run.ranks = {{0, 0, 0}};
  run.strategies = {"plain"};
  run.events.push_back({"step", 0, 0, 0, 1, -1, -1, 1.0, 0, 0});
  const auto p = model::HardwareProfile::load(write("p.json", v2()));
  try {
    (void)model::fitProfile({run}, p);
    FAIL() << "fitted a run without compute events";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("empty.h5"), std::string::npos) << e.what();
  }
  run.events.push_back({"attn", 1, 5, 0, 1, 0, 0, 1.0, 0, 0});  // rank outside the table
  EXPECT_THROW((void)model::fitProfile({run}, p), InputError);
  // an op with more FLOPs than any step holds (its token count would overflow) is damage
  run.events.pop_back();
  run.events.push_back({"mlp", 1, 0, 0, 1, 0, 0, 1.0, 1e30, 0});
  try {
    (void)model::fitProfile({run}, p);
    FAIL() << "fitted an op of 1e30 FLOPs";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("FLOP count is more than any step"), std::string::npos) << e.what();
  }
}

TEST(Calibration, AppliedJsonIsVersionTwoWithHistoryAndLoads) {
  const auto truth = model::HardwareProfile::load(write("h1.json", v2({{"mlp.fwd", 0.5}})));
  const auto run = syntheticRun(truth, 1.5);
  const auto j0 = nlohmann::json::parse(kV1);  // a version-1 file gains factors
  const auto fit = model::fitProfile({run}, model::HardwareProfile::load(write("h0.json", j0)));
  const auto j = model::applyToJson(j0, fit, {"run_cp2/trace.h5"}, "2026-01-01T00:00:00Z");
  EXPECT_EQ(j["version"], 2);
  EXPECT_EQ(j["factors"].size(), model::Factors::keys().size());
  EXPECT_EQ(j["calibration"].size(), 1u);
  EXPECT_EQ(j["calibration"][0]["traces"][0], "run_cp2/trace.h5");
  EXPECT_NEAR(j["links"]["cp_gbps"].get<double>(), 1.5, 1e-3);
  EXPECT_EQ(j["links"]["dp_gbps"].get<double>(), 3.0);  // not fitted: unchanged
  const auto back = model::HardwareProfile::load(write("h2.json", j));
  EXPECT_EQ(back.version, 2);
  EXPECT_NEAR(back.factors.at("mlp.fwd"), fit.factors[6].after, 1e-4);
  // calibrating again appends to the history
  const auto j2 = model::applyToJson(j, fit, {"b.h5"}, "2026-01-02T00:00:00Z");
  EXPECT_EQ(j2["calibration"].size(), 2u);
  // a hand-written sources string is kept as the list's first entry
  auto hand = j0;
  hand["sources"] = "vendor datasheet X";
  const auto j3 = model::applyToJson(hand, fit, {"c.h5"}, "2026-01-03T00:00:00Z");
  ASSERT_TRUE(j3["sources"].is_array());
  ASSERT_EQ(j3["sources"].size(), 2u);
  EXPECT_EQ(j3["sources"][0], "vendor datasheet X");
}

// Rank speed: eight ranks (cp 4 x dp 2) whose layer times carry a known factor per rank, a
// wander per rank and step, noise per layer task and a load common to each sync group; the
// fit recovers the rank, step and task spreads (the common load is no spread: it makes
// nobody wait), and a one-rank run leaves the profile's values.
TEST(Calibration, RankSpeedSpreadFromLayerTimes) {
  const auto truth = model::HardwareProfile::load(write("rs.json", v2()));
  std::vector<model::MeasuredRun::Coord> coords;
  for (int r = 0; r < 8; ++r) coords.push_back({0, r % 4, r / 4});
  auto run = plainRun("rs.h5", coords);
  const auto cost = costOf(run, truth);
  const double logf[8] = {-0.15, 0.1, -0.05, 0.0, 0.15, 0.0, 0.05, -0.1};  // sample sd 0.1
  std::mt19937_64 rng(7);
  std::normal_distribution<double> task(0.0, 0.08), wander(0.0, 0.06), common(0.0, 0.2);
  const std::int64_t n = 2000;
  for (std::int64_t step = 0; step < 100; ++step) {
    double w[8];
    for (double& x : w) x = wander(rng);
    for (int layer = 0; layer < 4; ++layer)
      for (int phase = 1; phase <= 2; ++phase) {
        const Phase ph = phase == 1 ? Phase::Fwd : Phase::Bwd;
        const double load[2] = {common(rng), common(rng)};  // per dp group
        for (int r = 0; r < 8; ++r) {
          const double t =
              cost.linearOpSeconds(model::LinearOp::Mlp, n, ph) * std::exp(logf[r] + w[r] + task(rng) + load[r / 4]);
          run.events.push_back(
              {"mlp", phase, r, 0, step, 0, layer, t, cost.linearOpFlops(model::LinearOp::Mlp, n, ph)});
        }
      }
  }
  const auto fit = model::fitProfile({run}, truth);
  ASSERT_TRUE(fit.spread.fitted) << fit.spread.note;
  EXPECT_NEAR(fit.spread.rank, 0.1, 0.02);
  EXPECT_NEAR(fit.spread.step, 0.06, 0.01);
  EXPECT_NEAR(fit.spread.task, 0.08, 0.01);
  EXPECT_EQ(fit.spread.ranks, 8u);
  const auto fitted = fit.apply(truth);
  EXPECT_EQ(fitted.rank_spread, fit.spread.rank);
  EXPECT_EQ(fitted.step_spread, fit.spread.step);
  EXPECT_EQ(fitted.task_spread, fit.spread.task);
  const auto j = model::applyToJson(v2(), fit, {"rs.h5"}, "now");
  EXPECT_EQ(j["rank_speed"]["spread"].get<double>(), fit.spread.rank);
  EXPECT_EQ(j["rank_speed"]["step_spread"].get<double>(), fit.spread.step);
  EXPECT_EQ(model::HardwareProfile::load(write("rs2.json", j)).step_spread, fit.spread.step);

  // A pipeline (four stages of one layer each, two replicas): a layer has no TP or CP peer,
  // so the micro-batch's layers on the other stages are its reference. The prediction's own
  // error per micro-batch (common to its stages) is no noise.
  std::vector<model::MeasuredRun::Coord> stages;
  for (int r = 0; r < 8; ++r) stages.push_back({0, 0, r / 4});
  auto pipe = plainRun("pp.h5", stages);
  std::normal_distribution<double> error(0.0, 0.3);
  for (std::int64_t step = 0; step < 20; ++step)
    for (int mb = 0; mb < 8; ++mb)
      for (int phase = 1; phase <= 2; ++phase) {
        const Phase ph = phase == 1 ? Phase::Fwd : Phase::Bwd;
        const double err[2] = {error(rng), error(rng)};
        for (int r = 0; r < 8; ++r)
          pipe.events.push_back({"mlp", phase, r, 0, step, mb, r % 4,
                                 cost.linearOpSeconds(model::LinearOp::Mlp, n, ph) * std::exp(task(rng) + err[r / 4]),
                                 cost.linearOpFlops(model::LinearOp::Mlp, n, ph)});
      }
  const auto pfit = model::fitProfile({pipe}, truth);
  ASSERT_TRUE(pfit.spread.fitted) << pfit.spread.note;
  EXPECT_NEAR(pfit.spread.task, 0.08, 0.01);
  EXPECT_LT(pfit.spread.step, 0.03);
  EXPECT_LT(pfit.spread.rank, 0.03);

  // Data parallelism alone (eight replicas of one rank): a replica has no second rank, so
  // the step's mean over every rank is the reference of a rank's step.
  std::vector<model::MeasuredRun::Coord> replicas;
  for (int r = 0; r < 8; ++r) replicas.push_back({0, 0, r});
  auto dp = plainRun("dp.h5", replicas);
  std::normal_distribution<double> host(0.0, 0.3);
  for (std::int64_t step = 0; step < 100; ++step) {
    const double load = host(rng);  // every rank alike: no wander
    for (int r = 0; r < 8; ++r) {
      const double w = wander(rng);
      for (int layer = 0; layer < 4; ++layer)
        dp.events.push_back({"mlp", 1, r, 0, step, 0, layer,
                             cost.linearOpSeconds(model::LinearOp::Mlp, n, Phase::Fwd) * std::exp(w + task(rng) + load),
                             cost.linearOpFlops(model::LinearOp::Mlp, n, Phase::Fwd)});
    }
  }
  const auto dfit = model::fitProfile({dp}, truth);
  ASSERT_TRUE(dfit.spread.fitted) << dfit.spread.note;
  EXPECT_NEAR(dfit.spread.step, 0.06, 0.012);

  auto one = plainRun("one.h5", {{0, 0, 0}});
  for (std::int64_t step = 0; step < 4; ++step)
    one.events.push_back({"mlp", 1, 0, 0, step, 0, 0, cost.linearOpSeconds(model::LinearOp::Mlp, n, Phase::Fwd),
                          cost.linearOpFlops(model::LinearOp::Mlp, n, Phase::Fwd)});
  auto seeded = truth;
  seeded.rank_spread = 0.05;
  const auto kept = model::fitProfile({one}, seeded);
  EXPECT_FALSE(kept.spread.fitted);
  EXPECT_EQ(kept.apply(seeded).rank_spread, 0.05);

  // Two replicas of one layer: no layer task has a peer, so task_spread cannot be fitted and
  // keeps the profile's value (it was written as 0).
  auto two = plainRun("two.h5", {{0, 0, 0}, {0, 0, 1}});
  for (std::int64_t step = 0; step < 20; ++step)
    for (int r = 0; r < 2; ++r)
      two.events.push_back({"mlp", 1, r, 0, step, 0, 0,
                            cost.linearOpSeconds(model::LinearOp::Mlp, n, Phase::Fwd) * std::exp(wander(rng)),
                            cost.linearOpFlops(model::LinearOp::Mlp, n, Phase::Fwd)});
  seeded.task_spread = 0.0815;
  const auto tfit = model::fitProfile({two}, seeded);
  ASSERT_TRUE(tfit.spread.fitted) << tfit.spread.note;
  EXPECT_EQ(tfit.spread.tasks, 0u);
  EXPECT_EQ(tfit.spread.task, 0.0815);
  EXPECT_NE(tfit.spread.note.find("task_spread kept"), std::string::npos) << tfit.spread.note;
  EXPECT_EQ(tfit.apply(seeded).task_spread, 0.0815);
}
