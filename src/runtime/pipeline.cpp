/// \file pipeline.cpp
/// \brief The schedule walk of one pipeline stage (see pipeline.hpp).

#include "runtime/pipeline.hpp"

#include <atomic>
#include <chrono>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "model/memory.hpp"
#include "parallel/progress_thread.hpp"
#include "pp/simulator.hpp"
#include "runtime/head.hpp"
#include "runtime/sliced.hpp"
#include "trace/recorder.hpp"

namespace wlb::runtime {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

namespace labels = trace::labels;
using HostMat = Mat::HostMirror;

// A CP rank's rows of a micro-batch in its local order: packed positions -> (segment,
// index in it) through the shard plan's segment starts (cp/shard_plan.hpp).
std::vector<TokenRef> shardRows(const MicroBatch& mb, const cp::ShardPlan& plan, int rank) {
  std::vector<TokenRef> rows;
  for (const std::int64_t p : cp::packedPositions(plan, rank)) {
    const auto it = std::upper_bound(plan.seg_begin.begin(), plan.seg_begin.end(), p);
    if (it == plan.seg_begin.begin()) throw std::logic_error("pipeline: packed position outside the micro-batch");
    const std::size_t i = static_cast<std::size_t>(it - plan.seg_begin.begin()) - 1;
    const Segment& s = mb.segments.at(i);
    const std::int64_t j = p - plan.seg_begin[i];
    if (j >= s.length) throw std::logic_error("pipeline: packed position outside its segment");
    appendPieceRows(s, false, j, 1, rows);
  }
  return rows;
}

void checkTags(MPI_Comm pp_comm, const pp::Schedule& schedule) {
  int* tag_ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(pp_comm, MPI_TAG_UB, &tag_ub, &flag);
  const long long need = 2LL * schedule.virtualStages() * schedule.micro_batches;
  if (flag && tag_ub && need > *tag_ub)
    throw InputError("the pipeline needs " + std::to_string(need) +
                         " message tags (2 x virtual stages x micro-batches)"
                         ", more than MPI's tag limit " +
                         std::to_string(*tag_ub) + "; lower data.micro_batches",
                     true);
}

// Optional timed region (the executor always has a recorder; tests may not).
struct Region {
  std::optional<trace::Recorder::Scope> scope;
  Region(trace::Recorder* rec, const char* label, const Space& space, double bytes = 0) {
    if (rec) scope.emplace(*rec, label, space, 0.0, bytes);
  }
};

}  // namespace

PipelineStage::PipelineStage(const LayerEnv& env, Llama& model, const pp::Schedule& schedule, MPI_Comm pp_comm)
    : env_(env),
      model_(&model),
      sched_(&schedule),
      stage_(model.config().stage),
      pp_comm_(pp_comm),
      rope_(model.config().headDim(), model.config().rope_theta),
      pool_(*env.space) {
  int r = 0, n = 0;
  MPI_Comm_rank(pp_comm, &r);
  MPI_Comm_size(pp_comm, &n);
  if (r != stage_ || n != schedule.stages || model.config().pp != schedule.stages ||
      model.config().chunks != schedule.chunks)
    throw std::logic_error("PipelineStage: pipeline communicator rank " + std::to_string(r) + " of " +
                           std::to_string(n) + " for stage " + std::to_string(stage_) + " of " +
                           std::to_string(schedule.stages));
  checkTags(pp_comm, schedule);  // tags: (direction, destination virtual stage, micro-batch)
  env_.rope = &rope_;
  env_.pool = &pool_;
  env_.norm_eps = model.config().norm_eps;
}

StageStepInput slicedStepInput(std::int64_t step, const StepPlan& plan, std::size_t d, int stages, int cp,
                               const model::CostModel& cost, cp::Strategy strategy, cp::CommMode mode,
                               const CpConfig& cfg) {
  const std::vector<MicroBatch>& replica = plan.replicas[d];
  StageStepInput in;
  in.step = step;
  in.mbs = replica;
  for (const auto& mb : replica) in.mb_tokens.push_back(mb.tokens());
  in.shards.resize(replica.size());
  in.comms.resize(replica.size());
  auto slices = std::make_shared<pp::ReplicaSlices>(
      pp::replicaSlices(replica, plan.backward.empty() ? std::vector<std::int64_t>{} : plan.backward[d]));
  const pp::PackFlowDeps deps = pp::planFlowDeps(plan, d, *slices);
  for (const auto& m : plan.merged) {
    const int rank = m.member(static_cast<std::int64_t>(d));
    if (rank < 0) continue;
    const auto slot = static_cast<std::size_t>(m.slot);
    const MicroBatch& mb = plan.replicas[static_cast<std::size_t>(m.group.front())][slot];
    auto plans = cp::planReplicaShards({mb}, strategy, mode, static_cast<int>(m.group.size()) * cp, cost, cfg);
    in.mbs[slot] = mb;
    in.mb_tokens[slot] = mb.tokens();
    in.shards[slot] = std::move(plans.front().shard);
    in.comms[slot] = std::move(plans.front().comm);
    StageStepInput::Merged g;
    g.slot = static_cast<int>(m.slot);
    g.rank = rank;
    in.merged.push_back(g);
  }
  in.schedule = std::make_shared<pp::Schedule>(pp::makePackFlow(stages, static_cast<int>(replica.size()), deps));
  in.slice_shards =
      std::make_shared<pp::SliceShards>(pp::sliceShards(*slices, cp::strategyName(strategy), cp, cost, cfg));
  in.slices = std::move(slices);
  return in;
}

StageStepInput replicaStepInput(std::int64_t step, const StepPlan& plan, std::size_t d, int stages, std::int64_t slots,
                                int cp, const model::CostModel& cost, cp::Strategy strategy, cp::CommMode mode,
                                const CpConfig& cfg) {
  if (pp::isSlimPackPlan(plan)) return slicedStepInput(step, plan, d, stages, cp, cost, strategy, mode, cfg);
  const std::vector<MicroBatch>& replica = plan.replicas[d];
  const std::size_t M = static_cast<std::size_t>(slots);
  if (replica.size() > M)
    throw std::logic_error("a replica has " + std::to_string(replica.size()) + " micro-batches, expected at most " +
                           std::to_string(M));
  StageStepInput in;
  in.step = step;
  in.mbs.resize(M);
  in.mb_tokens.assign(M, 0);
  in.shards.resize(M);
  in.comms.resize(M);
  auto plans = cp::planReplicaShards(replica, strategy, mode, cp, cost, cfg);
  for (std::size_t m = 0; m < replica.size(); ++m) {
    in.mbs[m] = replica[m];
    in.mb_tokens[m] = replica[m].tokens();
    in.shards[m] = std::move(plans[m].shard);
    in.comms[m] = std::move(plans[m].comm);
  }
  return in;
}

std::string shardPlansJson(const StepPlan& plan, int stages, std::int64_t slots, int cp, const model::CostModel& cost,
                           cp::Strategy strategy, cp::CommMode mode, const CpConfig& cfg) {
  nlohmann::json sj = nlohmann::json::array();
  if (pp::isSlimPackPlan(plan)) return sj.dump();  // run sliced, without CP plans
  for (std::size_t d = 0; d < plan.replicas.size(); ++d) {
    const StageStepInput in = replicaStepInput(0, plan, d, stages, slots, cp, cost, strategy, mode, cfg);
    for (std::size_t m = 0; m < plan.replicas[d].size(); ++m) {
      if (in.mb_tokens[m] == 0) continue;
      sj.push_back({{"dp", d},
                    {"micro_batch", m},
                    {"shard", cp::toJson(in.shards[m])},
                    {"metrics", cp::toJson(cp::computeMetrics(in.shards[m], in.comms[m], cost))}});
    }
  }
  return sj.dump();
}

MergedComms connectMerged(const parallel::Mesh& mesh, const StepPlan& plan, StageStepInput& in,
                          parallel::CommBackend backend) {
  MergedComms mc;
  const auto& c = mesh.coord();
  const auto& shape = mesh.shape();
  mc.comms.reserve(plan.merged.size());
  for (const auto& m : plan.merged) {
    const bool member = m.member(c.dp) >= 0;
    const int color = member ? c.pp * shape.tp() + c.tp : MPI_UNDEFINED;
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_split(mesh.world(), color, static_cast<int>(c.dp * shape.cp() + c.cp), &raw);
    if (!member) continue;
    mc.comms.push_back(parallel::Comm::adopt(raw));
    mc.groups.push_back(parallel::makeGroupComm(raw, backend));
    for (auto& g : in.merged)
      if (g.slot == static_cast<int>(m.slot)) {
        g.comm = raw;
        g.group = mc.groups.back().get();
      }
  }
  return mc;
}

pp::Schedule forwardSchedule(int stages, int micro_batches, int chunks) {
  pp::Schedule s;
  s.kind = pp::ScheduleKind::GPipe;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.chunks = chunks;
  s.order.resize(static_cast<std::size_t>(stages));
  for (auto& o : s.order)
    for (int m = 0; m < micro_batches; ++m)
      for (int c = 0; c < chunks; ++c) o.push_back(pp::Task{pp::Phase::Fwd, m, c});
  return s;
}

double runLocal(Llama& model, const TokenSource& tokens, const std::vector<MicroBatch>& mbs, bool backward,
                float loss_scale) {
  const LlamaConfig& c = model.config();
  if (c.pp != 1 || c.tp != 1 || c.chunks != 1) throw std::logic_error("runLocal: a one-rank model");
  const model::CostModel cost(c.dims(), model::HardwareProfile::analytic(), 1);
  const Space space;
  LayerEnv env;
  env.space = &space;
  env.cp_comm = MPI_COMM_SELF;
  env.cost = &cost;
  if (model.hasWorkingCopy()) env.precision = env.kernel.precision = Precision::Bf16;  // the model's storage
  const int M = static_cast<int>(mbs.size());
  const pp::Schedule sched = backward ? pp::makeOneFOneB(1, M) : forwardSchedule(1, M, 1);
  PipelineStage stage(env, model, sched, MPI_COMM_SELF);
  StepPlan plan;
  plan.replicas = {mbs};
  StageStepInput in =
      replicaStepInput(0, plan, 0, 1, M, 1, cost, cp::Strategy::PerSequence, cp::CommMode::AllGather, CpConfig{});
  in.tokens = &tokens;
  in.loss_scale = loss_scale;
  in.forward_only = !backward;
  return stage.run(in, 0).loss;
}

StageStepResult PipelineStage::run(const StageStepInput& in, std::int64_t t0_ns) {
  if (in.schedule) checkTags(pp_comm_, *in.schedule);
  const pp::Schedule& S = in.schedule ? *in.schedule : *sched_;
  const int V = S.virtualStages(), M = S.micro_batches;
  if (static_cast<int>(in.mb_tokens.size()) != M || in.shards.size() != in.mb_tokens.size() ||
      in.comms.size() != in.mb_tokens.size() || in.mbs.size() != in.mb_tokens.size() || S.stages != sched_->stages)
    throw std::logic_error("PipelineStage::run: step input has " + std::to_string(in.mb_tokens.size()) +
                           " micro-batches, schedule " + std::to_string(M));
  if (!in.tokens) throw std::logic_error("PipelineStage::run: no token source");
  if (in.forward_only && in.slices) throw std::logic_error("PipelineStage::run: sliced plans are not evaluated");
  const Space& space = *env_.space;
  trace::Recorder* rec = env_.recorder;
  const LlamaConfig& mc = model_->config();
  const std::int64_t misses0 = pool_.misses();
  pool_.resetPeaks();
  const int hidden = mc.hidden;
  const bool train = !in.forward_only;
  int cp_rank = 0, cp_size = 1, tp_rank = 0;
  MPI_Comm_rank(env_.cp_comm, &cp_rank);
  MPI_Comm_size(env_.cp_comm, &cp_size);
  if (env_.tp_comm != MPI_COMM_NULL) MPI_Comm_rank(env_.tp_comm, &tp_rank);
  std::optional<SlicedStage> sliced;
  if (in.slices) {
    if (!in.slice_shards) throw std::logic_error("PipelineStage::run: sliced plan without its CP layout");
    sliced.emplace(env_, *model_, *in.slices, *in.slice_shards);
  }
  // DP-Merge units run as LayerSteps over their group (the CP communicator); the other
  // units of a sliced plan through the SlicedStage.
  const auto mergedOf = [&](std::size_t m) { return sliced ? in.mergedAt(m) : nullptr; };
  const auto slicedUnit = [&](std::size_t m) { return sliced && !in.mergedAt(m); };
  const auto shardRank = [&](std::size_t m) {
    const auto* mg = mergedOf(m);
    return mg ? mg->rank * cp_size + cp_rank : cp_rank;
  };
  // This rank's rows of a task's unit (forward MicroPack or, sliced, backward MicroPack).
  const auto local = [&](pp::Phase ph, std::size_t m) -> std::int64_t {
    if (slicedUnit(m))
      return ph == pp::Phase::Fwd ? sliced->fwdTokens(static_cast<int>(m)) : sliced->bwdTokens(static_cast<int>(m));
    return in.shards[m].ranks[static_cast<std::size_t>(shardRank(m))].tokens;
  };
  // Every rank of the replica skips an empty unit alike.
  const auto skip = [&](pp::Phase ph, std::size_t m) {
    if (mergedOf(m)) return false;
    return sliced ? sliced->unitTokens(ph == pp::Phase::Bwd, static_cast<int>(m)) == 0 : in.mb_tokens[m] == 0;
  };
  const auto envOf = [&](std::size_t m) {
    LayerEnv e = env_;
    if (const auto* mg = mergedOf(m)) {
      e.cp_comm = mg->comm;
      e.cp_group = mg->group;
    }
    return e;
  };
  // The rows of a unit, built once (an unsliced unit's backward uses its forward's).
  std::map<std::pair<int, int>, TokenRows> unit_rows;
  const auto rowsOf = [&](pp::Phase ph, std::size_t m) -> const TokenRows& {
    const bool bwd = ph == pp::Phase::Bwd && slicedUnit(m);
    auto it = unit_rows.find({bwd ? 1 : 0, static_cast<int>(m)});
    if (it != unit_rows.end()) return it->second;
    const std::vector<TokenRef> refs =
        slicedUnit(m) ? sliced->rows(bwd, static_cast<int>(m)) : shardRows(in.mbs[m], in.shards[m], shardRank(m));
    std::int64_t max_pos = 0;
    for (const TokenRef& t : refs) max_pos = std::max<std::int64_t>(max_pos, t.rope + 1);
    rope_.ensure(space, max_pos);
    return unit_rows
        .emplace(std::make_pair(bwd ? 1 : 0, static_cast<int>(m)), TokenRows::make(space, *in.tokens, refs, mc.vocab))
        .first->second;
  };
  const auto tagOf = [&](pp::Phase ph, int vs_dst, int m) { return ((ph == pp::Phase::Bwd ? V : 0) + vs_dst) * M + m; };
  const auto runs = [&](const pp::Task& t) { return train || t.phase == pp::Phase::Fwd; };

  StageStepResult res;
  res.mb_attn.assign(static_cast<std::size_t>(M), 0.0);
  res.mb_seconds = res.mb_attn;
  res.mb_tokens = res.mb_attn;
  res.mb_loss = res.mb_attn;
  for (int m = 0; m < M; ++m)
    if (!skip(pp::Phase::Fwd, static_cast<std::size_t>(m)))
      res.mb_tokens[static_cast<std::size_t>(m)] =
          static_cast<double>(local(pp::Phase::Fwd, static_cast<std::size_t>(m)));

  // Every unit's rows before any message: bad token ids fail on every rank of the group
  // alike (they read the same documents) instead of leaving a neighbour waiting.
  for (const pp::Task& t : S.order[static_cast<std::size_t>(stage_)])
    if (runs(t) && !skip(t.phase, static_cast<std::size_t>(t.mb)))
      (void)rowsOf(t.phase, static_cast<std::size_t>(t.mb));

  // ---- post every receive of the step --------------------------------------------------
  struct Incoming {
    Mat dev;
    HostMat host;
    MPI_Request req = MPI_REQUEST_NULL;
  };
  std::map<std::tuple<int, int, int>, Incoming> incoming;  // (bwd?, vstage, mb)
  for (const pp::Task& t : S.order[static_cast<std::size_t>(stage_)]) {
    const std::size_t m = static_cast<std::size_t>(t.mb);
    if (!runs(t) || skip(t.phase, m)) continue;
    const int vs = S.virtualStage(stage_, t.chunk);
    const bool fwd = t.phase == pp::Phase::Fwd;
    if ((fwd && vs == 0) || (!fwd && vs == V - 1)) continue;  // made here, not received
    const int src = S.stageOf(fwd ? vs - 1 : vs + 1);
    Incoming& inc = incoming[{fwd ? 0 : 1, vs, t.mb}];
    inc.dev = newMat(env_.pool, fwd ? "wlb::runtime::pp_act" : "wlb::runtime::pp_grad", local(t.phase, m), hidden);
    inc.host = Kokkos::create_mirror_view(inc.dev);  // the same view on host backends
    MPI_Irecv(inc.host.data(), static_cast<int>(inc.host.size()), MPI_FLOAT, src, tagOf(t.phase, vs, t.mb), pp_comm_,
              &inc.req);
  }
  struct Outgoing {
    HostMat host;
    MPI_Request req = MPI_REQUEST_NULL;
  };
  std::vector<Outgoing> outgoing;
  outgoing.reserve(2 * static_cast<std::size_t>(M * S.chunks));

  // MPI moves a large message only while both sides are inside the library (without
  // single-copy transports the sender pushes it in fragments), so a rank polls its
  // pending transfers between layers: a send is not held up until the sender's next
  // task, nor a receive until the receiver's.
  const auto progress = [&]() {
    int flag = 0;
    for (auto& o : outgoing)
      if (o.req != MPI_REQUEST_NULL) MPI_Test(&o.req, &flag, MPI_STATUS_IGNORE);
    for (auto& kv : incoming)
      if (kv.second.req != MPI_REQUEST_NULL) MPI_Test(&kv.second.req, &flag, MPI_STATUS_IGNORE);
  };
  const auto receive = [&](pp::Phase ph, int vs, int m) {
    Incoming& inc = incoming.at({ph == pp::Phase::Fwd ? 0 : 1, vs, m});
    const auto t = Clock::now();
    {
      Region r(rec, labels::kPpRecv, space, 4.0 * static_cast<double>(inc.host.size()));
      MPI_Wait(&inc.req, MPI_STATUS_IGNORE);
      Kokkos::deep_copy(space, inc.dev, inc.host);
    }
    res.p2p_wait_seconds += since(t);
    Mat x = inc.dev;
    incoming.erase({ph == pp::Phase::Fwd ? 0 : 1, vs, m});
    return x;
  };
  const auto send = [&](pp::Phase ph, int vs_dst, int m, const Mat& x) {
    Region r(rec, labels::kPpSend, space, 4.0 * static_cast<double>(x.size()));
    Outgoing o;
    o.host = Kokkos::create_mirror_view(x);
    Kokkos::deep_copy(space, o.host, x);
    kk::fence(space, "wlb::runtime::pp_send");
    MPI_Isend(o.host.data(), static_cast<int>(o.host.size()), MPI_FLOAT, S.stageOf(vs_dst), tagOf(ph, vs_dst, m),
              pp_comm_, &o.req);
    outgoing.push_back(std::move(o));
  };

  // The loss's input gradient, from the last virtual stage's forward to its backward: per
  // unit, or (sliced) per forward MicroPack, cut into the backward MicroPacks' rows.
  std::map<int, Mat> head_grad;
  std::map<int, std::int64_t> head_rows_left;  // sliced: rows of a forward MicroPack not yet taken
  const std::int64_t head_row_bytes = model::executorHeadBytes(mc.dims(), 1);
  const auto headGradOf = [&](std::size_t m) {
    if (!slicedUnit(m)) {
      Mat dy = head_grad.at(static_cast<int>(m));
      head_grad.erase(static_cast<int>(m));
      return dy;
    }
    const auto& sl = *in.slices;
    const int j = static_cast<int>(m);
    Mat dy = newMat(env_.pool, "wlb::runtime::dy", sliced->bwdTokens(j), hidden);
    for (auto i = sl.bwd_cuts[static_cast<std::size_t>(j)]; i < sl.bwd_cuts[static_cast<std::size_t>(j) + 1]; ++i) {
      const int k = sl.fwd_pack[static_cast<std::size_t>(i)];
      const std::int64_t len = sliced->ownRows(i), r0 = sliced->fwdRow(i), d0 = sliced->bwdRow(i);
      if (len == 0) continue;  // none of the segment's queries on this CP rank
      Kokkos::deep_copy(space, Kokkos::subview(dy, std::make_pair(d0, d0 + len), Kokkos::ALL),
                        Kokkos::subview(head_grad.at(k), std::make_pair(r0, r0 + len), Kokkos::ALL));
      if ((head_rows_left[k] -= len) == 0) {
        kk::fence(space, "wlb::runtime::head_grad");
        head_grad.erase(k);
        head_rows_left.erase(k);
      }
    }
    return dy;
  };

  // ---- the schedule walk ----------------------------------------------------------------
  std::optional<parallel::ProgressThread> progress_thread;
  if (V > 1) progress_thread.emplace(pp_comm_);
  // live[(mb, chunk)]: the block's LayerSteps from forward to backward.
  std::map<std::pair<int, int>, std::vector<std::unique_ptr<LayerStep>>> live;
  std::int64_t held = 0;
  std::int64_t last_end = t0_ns;
  for (const pp::Task& t : S.order[static_cast<std::size_t>(stage_)]) {
    const std::size_t m = static_cast<std::size_t>(t.mb);
    if (!runs(t) || skip(t.phase, m)) continue;  // the whole replica skips it alike
    const int vs = S.virtualStage(stage_, t.chunk);
    const auto blk = pp::layerBlock(mc.layers, V, vs);
    const bool fwd = t.phase == pp::Phase::Fwd;
    if (rec)
      rec->setContext({static_cast<int>(in.step), t.mb, fwd ? trace::Phase::Fwd : trace::Phase::Bwd, -1, t.chunk});
    const double wait0 = res.p2p_wait_seconds;
    const auto t_task = Clock::now();
    double attn = 0;
    const TokenRows& rows = rowsOf(t.phase, m);
    if (fwd) {
      Mat x = vs == 0 ? embedForward(env_, *model_, rows) : receive(t.phase, vs, t.mb);
      if (slicedUnit(m)) {
        for (int l = blk.first; l < blk.first + blk.count; ++l) {
          if (rec) rec->context().layer = l;
          x = sliced->forward(t.mb, l, x, rows.positions);
          attn += sliced->attnSeconds();
          progress();
        }
      } else {
        const LayerEnv env = envOf(m);
        auto& steps = live[{t.mb, t.chunk}];
        for (int l = blk.first; l < blk.first + blk.count; ++l) {
          if (rec) rec->context().layer = l;
          const LayerStep* like = steps.empty() ? nullptr : steps.front().get();  // the unit's maps, once
          steps.push_back(std::make_unique<LayerStep>(env, *model_, l, in.shards[m], in.comms[m], like));
          x = steps.back()->forward(x, rows.positions, train);
          if (!train) attn += steps.back()->attnSeconds();  // else counted with the backward
          held += steps.back()->savedBytes();
          progress();
        }
        if (!train) live.erase({t.mb, t.chunk});
      }
      if (rec) rec->context().layer = -1;
      if (vs == V - 1) {
        LossResult lr = lossForward(env_, *model_, rows, x, train, in.loss_scale);
        if (tp_rank == 0) {  // every TP rank holds the whole output: one counts it
          res.loss += lr.loss;
          res.mb_loss[m] += lr.loss;
          res.predicted += rows.predicted;
        }
        if (train && (rows.n > 0 || !slicedUnit(m))) {  // a sliced unit's rows are taken segment by segment
          head_grad[t.mb] = lr.dx;
          head_rows_left[t.mb] = rows.n;
          held += head_row_bytes * rows.n;
        }
      } else {
        send(t.phase, vs + 1, t.mb, x);
      }
      res.peak_activation_bytes = std::max(res.peak_activation_bytes, held + (sliced ? sliced->heldBytes() : 0));
    } else {
      Mat dy;
      if (vs == V - 1) {
        dy = headGradOf(m);
        held -= head_row_bytes * static_cast<std::int64_t>(dy.extent(0));
      } else {
        dy = receive(t.phase, vs, t.mb);
      }
      if (slicedUnit(m)) {
        for (int l = blk.first + blk.count - 1; l >= blk.first; --l) {
          if (rec) rec->context().layer = l;
          dy = sliced->backward(t.mb, l, dy, rows.positions);
          attn += sliced->attnSeconds();
          progress();
        }
      } else {
        auto it = live.find({t.mb, t.chunk});
        if (it == live.end()) throw std::logic_error("PipelineStage: backward before forward");
        auto& steps = it->second;
        for (int i = blk.count - 1; i >= 0; --i) {
          LayerStep& ls = *steps[static_cast<std::size_t>(i)];
          if (rec) rec->context().layer = blk.first + i;
          const std::int64_t before = ls.savedBytes();
          dy = ls.backward(dy, rows.positions);
          held -= before - ls.savedBytes();
          progress();
          attn += ls.attnSeconds();  // forward + backward of the layer
        }
        live.erase(it);
      }
      if (rec) rec->context().layer = -1;
      if (vs > 0)
        send(t.phase, vs - 1, t.mb, dy);
      else
        embedBackward(env_, *model_, rows, dy);
    }
    kk::fence(space, "wlb::runtime::pp_task");
    const double sec = since(t_task) - (res.p2p_wait_seconds - wait0);
    res.task_seconds += sec;
    res.mb_seconds[m] += sec;
    res.mb_attn[m] += attn;
    if (rec) last_end = rec->now();
  }
  res.pipeline_seconds = static_cast<double>(last_end - t0_ns) * 1e-9;
  if (!incoming.empty() || !live.empty() || !head_grad.empty() || (sliced && !sliced->empty()))
    throw std::logic_error("PipelineStage: the schedule left messages or activations behind");
  if (!outgoing.empty()) {  // the step's sends complete (none without a pipeline: no event)
    // a step-level event after the backward (trace schema)
    if (rec) rec->setContext({static_cast<int>(in.step), -1, trace::Phase::Bwd, -1});
    Region r(rec, labels::kPpSend, space);
    for (auto& o : outgoing) MPI_Wait(&o.req, MPI_STATUS_IGNORE);
  }
  res.allocations = pool_.misses() - misses0;
  res.pool_bytes = pool_.cachedBytes();
  res.pool_live_bytes = pool_.peakLiveBytes();
  res.pool_requested_bytes = pool_.peakRequestedBytes();
  return res;
}

}  // namespace wlb::runtime
