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

#include "core/error.hpp"
#include "core/kokkos_compat.hpp"
#include "parallel/progress_thread.hpp"
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

// Input and loss-projection streams: rows are keyed by document token (tokenKey).
constexpr std::uint64_t kInputStream = 4;

// Keys of a CP rank's local rows: packed positions -> (document, position) of the segment.
std::vector<std::int64_t> tokenKeys(const MicroBatch& mb, const std::vector<std::int64_t>& packed) {
  std::vector<std::int64_t> seg_begin;
  std::int64_t at = 0;
  for (const auto& s : mb.segments) {
    seg_begin.push_back(at);
    at += s.length;
  }
  std::vector<std::int64_t> keys;
  keys.reserve(packed.size());
  for (const std::int64_t p : packed) {
    const auto it = std::upper_bound(seg_begin.begin(), seg_begin.end(), p);
    if (it == seg_begin.begin() || p >= at) throw std::logic_error("pipeline: packed position outside the micro-batch");
    const std::size_t i = static_cast<std::size_t>(it - seg_begin.begin()) - 1;
    keys.push_back(tokenKey(mb.segments[i].doc, mb.segments[i].offset + (p - seg_begin[i])));
  }
  return keys;
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

double dot(const Space& space, const Mat& a, const Mat& b) {
  double s = 0;
  Kokkos::parallel_reduce(
      "wlb::runtime::loss", Kokkos::RangePolicy<Space>(space, 0, static_cast<std::int64_t>(a.size())),
      KOKKOS_LAMBDA(const std::int64_t i, double& acc) {
        acc += static_cast<double>(a.data()[i]) * static_cast<double>(b.data()[i]);
      },
      s);
  return s;
}

// Optional timed region (the executor always has a recorder; tests may not).
struct Region {
  std::optional<trace::Recorder::Scope> scope;
  Region(trace::Recorder* rec, const char* label, const Space& space, double bytes = 0) {
    if (rec) scope.emplace(*rec, label, space, 0.0, bytes);
  }
};

}  // namespace

std::vector<int> PipelineStage::stageLayers(int layers, int stages, int chunks, int stage) {
  std::vector<int> ids;
  for (int c = 0; c < chunks; ++c) {
    const auto b = pp::layerBlock(layers, stages * chunks, c * stages + stage);
    for (int l = b.first; l < b.first + b.count; ++l) ids.push_back(l);
  }
  return ids;
}

PipelineStage::PipelineStage(const LayerEnv& env, Model& model, const pp::Schedule& schedule, int stage, int layers,
                             MPI_Comm pp_comm)
    : env_(env), model_(&model), sched_(&schedule), stage_(stage), layers_(layers), pp_comm_(pp_comm) {
  int r = 0, n = 0;
  MPI_Comm_rank(pp_comm, &r);
  MPI_Comm_size(pp_comm, &n);
  if (r != stage || n != schedule.stages)
    throw std::logic_error("PipelineStage: pipeline communicator rank " + std::to_string(r) + " of " +
                           std::to_string(n) + " for stage " + std::to_string(stage) + " of " +
                           std::to_string(schedule.stages));
  checkTags(pp_comm, schedule);  // tags: (direction, destination virtual stage, micro-batch)
}

StageStepInput slicedStepInput(std::int64_t step, std::uint64_t seed, const StepPlan& plan, std::size_t d, int stages,
                               const model::CostModel& cost, cp::Strategy strategy, cp::CommMode mode,
                               const CpConfig& cfg) {
  const std::vector<MicroBatch>& replica = plan.replicas[d];
  StageStepInput in;
  in.step = step;
  in.seed = seed;
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
    auto plans = cp::planReplicaShards({mb}, strategy, mode, static_cast<int>(m.group.size()), cost, cfg);
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
  in.slices = std::move(slices);
  return in;
}

StageStepResult PipelineStage::run(const StageStepInput& in, std::int64_t t0_ns) {
  if (in.schedule) checkTags(pp_comm_, *in.schedule);
  const pp::Schedule& S = in.schedule ? *in.schedule : *sched_;
  const int V = S.virtualStages(), M = S.micro_batches;
  if (static_cast<int>(in.mb_tokens.size()) != M || in.shards.size() != in.mb_tokens.size() ||
      in.comms.size() != in.mb_tokens.size() || in.mbs.size() != in.mb_tokens.size() || S.stages != sched_->stages)
    throw std::logic_error("PipelineStage::run: step input has " + std::to_string(in.mb_tokens.size()) +
                           " micro-batches, schedule " + std::to_string(M));
  const Space& space = *env_.space;
  trace::Recorder* rec = env_.recorder;
  const int hidden = model_->shape().hidden;
  int cp_rank = 0, cp_size = 1;
  MPI_Comm_rank(env_.cp_comm, &cp_rank);
  MPI_Comm_size(env_.cp_comm, &cp_size);
  std::optional<SlicedStage> sliced;
  if (in.slices) {
    if (cp_size != 1) throw std::logic_error("PipelineStage::run: sliced plans run with cp = 1");
    sliced.emplace(env_, *model_, *in.slices);
  }
  // DP-Merge units run as paired LayerSteps over their group (the CP communicator); the
  // other units of a sliced plan through the SlicedStage.
  const auto mergedOf = [&](std::size_t m) { return sliced ? in.mergedAt(m) : nullptr; };
  const auto slicedUnit = [&](std::size_t m) { return sliced && !in.mergedAt(m); };
  const auto shardRank = [&](std::size_t m) {
    const auto* mg = mergedOf(m);
    return mg ? mg->rank : cp_rank;
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
    return sliced ? local(ph, m) == 0 : in.mb_tokens[m] == 0;
  };
  const auto keysOf = [&](pp::Phase ph, std::size_t m) {
    if (slicedUnit(m)) return sliced->rowKeys(ph == pp::Phase::Bwd, static_cast<int>(m));
    return tokenKeys(in.mbs[m], cp::packedPositions(in.shards[m], shardRank(m)));
  };
  const auto envOf = [&](std::size_t m) {
    LayerEnv e = env_;
    if (const auto* mg = mergedOf(m)) {
      e.cp_comm = mg->comm;
      e.cp_group = mg->group;
    }
    return e;
  };
  const auto tagOf = [&](pp::Phase ph, int vs_dst, int m) { return ((ph == pp::Phase::Bwd ? V : 0) + vs_dst) * M + m; };

  StageStepResult res;
  res.mb_attn.assign(static_cast<std::size_t>(M), 0.0);
  res.mb_seconds = res.mb_attn;
  res.mb_tokens = res.mb_attn;
  for (int m = 0; m < M; ++m)
    if (!skip(pp::Phase::Fwd, static_cast<std::size_t>(m)))
      res.mb_tokens[static_cast<std::size_t>(m)] =
          static_cast<double>(local(pp::Phase::Fwd, static_cast<std::size_t>(m)));

  // ---- post every receive of the step --------------------------------------------------
  struct Incoming {
    Mat dev;
    HostMat host;
    MPI_Request req = MPI_REQUEST_NULL;
  };
  std::map<std::tuple<int, int, int>, Incoming> incoming;  // (bwd?, vstage, mb)
  for (const pp::Task& t : S.order[static_cast<std::size_t>(stage_)]) {
    const std::size_t m = static_cast<std::size_t>(t.mb);
    if (skip(t.phase, m)) continue;
    const int vs = S.virtualStage(stage_, t.chunk);
    const bool fwd = t.phase == pp::Phase::Fwd;
    if ((fwd && vs == 0) || (!fwd && vs == V - 1)) continue;  // made here, not received
    const int src = S.stageOf(fwd ? vs - 1 : vs + 1);
    Incoming& inc = incoming[{fwd ? 0 : 1, vs, t.mb}];
    inc.dev = Mat(Kokkos::view_alloc(Kokkos::WithoutInitializing,
                                     std::string(fwd ? "wlb::runtime::pp_act" : "wlb::runtime::pp_grad")),
                  local(t.phase, m), hidden);
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

  // ---- the schedule walk ----------------------------------------------------------------
  std::optional<parallel::ProgressThread> progress_thread;
  if (V > 1) progress_thread.emplace(pp_comm_);
  // live[(mb, chunk)]: the block's LayerSteps from forward to backward; dy of the loss.
  std::map<std::pair<int, int>, std::vector<std::unique_ptr<LayerStep>>> live;
  std::map<int, Mat> loss_grad;
  std::int64_t held = 0;
  std::int64_t last_end = t0_ns;
  for (const pp::Task& t : S.order[static_cast<std::size_t>(stage_)]) {
    const std::size_t m = static_cast<std::size_t>(t.mb);
    if (skip(t.phase, m)) continue;  // the whole replica skips it alike
    const int vs = S.virtualStage(stage_, t.chunk);
    const auto blk = pp::layerBlock(layers_, V, vs);
    const std::int64_t n = local(t.phase, m);
    const bool fwd = t.phase == pp::Phase::Fwd;
    if (rec)
      rec->setContext({static_cast<int>(in.step), t.mb, fwd ? trace::Phase::Fwd : trace::Phase::Bwd, -1, t.chunk});
    const double wait0 = res.p2p_wait_seconds;
    const auto t_task = Clock::now();
    double attn = 0;
    // dL/dy = R, pseudo-random per token
    const auto lossGrad = [&]() {
      Mat dy(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::dy"), n, hidden);
      fillRandomRows(space, dy, in.seed + 1, kInputStream, 1e-2f, keysOf(t.phase, m));
      return dy;
    };
    if (fwd) {
      Mat x;
      if (vs == 0) {
        x = Mat(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::x"), n, hidden);
        Region r(rec, labels::kEmbed, space);
        fillRandomRows(space, x, in.seed, kInputStream, 1.0f, keysOf(t.phase, m));
      } else {
        x = receive(t.phase, vs, t.mb);
      }
      if (slicedUnit(m)) {
        for (int l = blk.first; l < blk.first + blk.count; ++l) {
          if (rec) rec->context().layer = l;
          x = sliced->forward(t.mb, l, x);
          attn += sliced->attnSeconds();
          progress();
        }
      } else {
        const LayerEnv env = envOf(m);
        auto& steps = live[{t.mb, t.chunk}];
        for (int l = blk.first; l < blk.first + blk.count; ++l) {
          if (rec) rec->context().layer = l;
          steps.push_back(std::make_unique<LayerStep>(env, *model_, l, in.shards[m], in.comms[m]));
          x = steps.back()->forward(x);
          held += steps.back()->savedBytes();
          progress();
        }
      }
      res.peak_activation_bytes = std::max(res.peak_activation_bytes, held + (sliced ? sliced->heldBytes() : 0));
      if (rec) rec->context().layer = -1;
      if (vs == V - 1) {
        Region r(rec, labels::kLoss, space);
        const Mat dy = lossGrad();
        // only TP rank 0 counts the loss: every TP rank holds the full y
        int tp_rank = 0;
        if (env_.tp_comm != MPI_COMM_NULL) MPI_Comm_rank(env_.tp_comm, &tp_rank);
        if (tp_rank == 0) res.loss += dot(space, x, dy);
        if (!slicedUnit(m)) loss_grad[t.mb] = dy;  // sliced: the backward MicroPack makes its own
      } else {
        send(t.phase, vs + 1, t.mb, x);
      }
    } else {
      Mat dy;
      if (vs == V - 1) {
        if (slicedUnit(m)) {
          Region r(rec, labels::kLoss, space);
          dy = lossGrad();
        } else {
          dy = loss_grad.at(t.mb);
          loss_grad.erase(t.mb);
        }
      } else {
        dy = receive(t.phase, vs, t.mb);
      }
      if (slicedUnit(m)) {
        for (int l = blk.first + blk.count - 1; l >= blk.first; --l) {
          if (rec) rec->context().layer = l;
          dy = sliced->backward(t.mb, l, dy);
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
          dy = ls.backward(dy);
          held -= before - ls.savedBytes();
          progress();
          attn += ls.attnSeconds();  // forward + backward of the layer
        }
        live.erase(it);
      }
      if (rec) rec->context().layer = -1;
      if (vs > 0) send(t.phase, vs - 1, t.mb, dy);
    }
    kk::fence(space, "wlb::runtime::pp_task");
    const double sec = since(t_task) - (res.p2p_wait_seconds - wait0);
    res.task_seconds += sec;
    res.mb_seconds[m] += sec;
    if (!fwd || slicedUnit(m)) res.mb_attn[m] += attn;
    if (rec) last_end = rec->now();
  }
  res.pipeline_seconds = static_cast<double>(last_end - t0_ns) * 1e-9;
  if (!incoming.empty() || !live.empty() || (sliced && !sliced->empty()))
    throw std::logic_error("PipelineStage: the schedule left messages or activations behind");
  {
    if (rec) rec->setContext({static_cast<int>(in.step), -1, trace::Phase::None, -1});
    Region r(rec, labels::kPpSend, space);
    for (auto& o : outgoing) MPI_Wait(&o.req, MPI_STATUS_IGNORE);
  }
  return res;
}

}  // namespace wlb::runtime
