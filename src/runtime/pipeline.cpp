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
#include "trace/recorder.hpp"

namespace wlb::runtime {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

namespace labels = trace::labels;
using HostMat = Mat::HostMirror;

// Input and loss-projection streams per (step, micro-batch), indexed by packed token
// position: a micro-batch's numbers do not depend on the pipeline or the CP sharding.
std::uint64_t inputStream(std::int64_t step, std::size_t m) {
  return static_cast<std::uint64_t>(step * 1000 + static_cast<std::int64_t>(m)) * 4;
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

// Drives MPI's progress engine while the rank computes. Without single-copy transports
// a large message moves in fragments only while both sides are inside MPI; a rank deep in
// a layer would hold its neighbour's receive until its next MPI call. MPI_Iprobe on a
// private communicator makes progress without touching the executor's requests. Needs
// MPI_THREAD_MULTIPLE; otherwise a no-op (the stage then polls between layers).
class ProgressThread {
 public:
  explicit ProgressThread(MPI_Comm comm) {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    if (level != MPI_THREAD_MULTIPLE) return;
    MPI_Comm_dup(comm, &comm_);
    thread_ = std::thread([this] {
      int flag = 0;
      while (!stop_.load(std::memory_order_relaxed)) {
        MPI_Iprobe(MPI_ANY_SOURCE, 0, comm_, &flag, MPI_STATUS_IGNORE);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    });
  }
  ~ProgressThread() {
    if (!thread_.joinable()) return;
    stop_.store(true);
    thread_.join();
    MPI_Comm_free(&comm_);
  }
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::atomic<bool> stop_{false};
  std::thread thread_;
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
  // tags: (direction, destination virtual stage, micro-batch)
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

StageStepResult PipelineStage::run(const StageStepInput& in, std::int64_t t0_ns) {
  const pp::Schedule& S = *sched_;
  const int V = S.virtualStages(), M = S.micro_batches;
  if (static_cast<int>(in.mb_tokens.size()) != M || in.shards.size() != in.mb_tokens.size() ||
      in.comms.size() != in.mb_tokens.size())
    throw std::logic_error("PipelineStage::run: step input has " + std::to_string(in.mb_tokens.size()) +
                           " micro-batches, schedule " + std::to_string(M));
  const Space& space = *env_.space;
  trace::Recorder* rec = env_.recorder;
  const int hidden = model_->shape().hidden;
  int cp_rank = 0;
  MPI_Comm_rank(env_.cp_comm, &cp_rank);
  const auto local = [&](std::size_t m) { return in.shards[m].ranks[static_cast<std::size_t>(cp_rank)].tokens; };
  const auto tagOf = [&](pp::Phase ph, int vs_dst, int m) { return ((ph == pp::Phase::Bwd ? V : 0) + vs_dst) * M + m; };

  StageStepResult res;
  res.mb_attn.assign(static_cast<std::size_t>(M), 0.0);
  res.mb_seconds = res.mb_attn;
  res.mb_tokens = res.mb_attn;
  for (int m = 0; m < M; ++m)
    if (in.mb_tokens[static_cast<std::size_t>(m)] > 0)
      res.mb_tokens[static_cast<std::size_t>(m)] = static_cast<double>(local(static_cast<std::size_t>(m)));

  // ---- post every receive of the step --------------------------------------------------
  struct Incoming {
    Mat dev;
    HostMat host;
    MPI_Request req = MPI_REQUEST_NULL;
  };
  std::map<std::tuple<int, int, int>, Incoming> incoming;  // (bwd?, vstage, mb)
  for (const pp::Task& t : S.order[static_cast<std::size_t>(stage_)]) {
    const std::size_t m = static_cast<std::size_t>(t.mb);
    if (in.mb_tokens[m] == 0) continue;
    const int vs = S.virtualStage(stage_, t.chunk);
    const bool fwd = t.phase == pp::Phase::Fwd;
    if ((fwd && vs == 0) || (!fwd && vs == V - 1)) continue;  // made here, not received
    const int src = S.stageOf(fwd ? vs - 1 : vs + 1);
    Incoming& inc = incoming[{fwd ? 0 : 1, vs, t.mb}];
    inc.dev = Mat(Kokkos::view_alloc(Kokkos::WithoutInitializing,
                                     std::string(fwd ? "wlb::runtime::pp_act" : "wlb::runtime::pp_grad")),
                  local(m), hidden);
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
  std::optional<ProgressThread> progress_thread;
  if (V > 1) progress_thread.emplace(pp_comm_);
  // live[(mb, chunk)]: the block's LayerSteps from forward to backward; dy of the loss.
  std::map<std::pair<int, int>, std::vector<std::unique_ptr<LayerStep>>> live;
  std::map<int, Mat> loss_grad;
  std::int64_t held = 0;
  std::int64_t last_end = t0_ns;
  for (const pp::Task& t : S.order[static_cast<std::size_t>(stage_)]) {
    const std::size_t m = static_cast<std::size_t>(t.mb);
    if (in.mb_tokens[m] == 0) continue;  // the whole replica skips it alike
    const int vs = S.virtualStage(stage_, t.chunk);
    const auto blk = pp::layerBlock(layers_, V, vs);
    const std::int64_t n = local(m);
    const bool fwd = t.phase == pp::Phase::Fwd;
    if (rec)
      rec->setContext({static_cast<int>(in.step), t.mb, fwd ? trace::Phase::Fwd : trace::Phase::Bwd, -1, t.chunk});
    const double wait0 = res.p2p_wait_seconds;
    const auto t_task = Clock::now();
    double attn = 0;
    if (fwd) {
      Mat x;
      if (vs == 0) {
        x = Mat(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::x"), n, hidden);
        Region r(rec, labels::kEmbed, space);
        fillRandomRows(space, x, in.seed, inputStream(in.step, m), 1.0f, cp::packedPositions(in.shards[m], cp_rank));
      } else {
        x = receive(t.phase, vs, t.mb);
      }
      auto& steps = live[{t.mb, t.chunk}];
      for (int l = blk.first; l < blk.first + blk.count; ++l) {
        if (rec) rec->context().layer = l;
        steps.push_back(std::make_unique<LayerStep>(env_, *model_, l, in.shards[m], in.comms[m]));
        x = steps.back()->forward(x);
        held += steps.back()->savedBytes();
        progress();
      }
      res.peak_activation_bytes = std::max(res.peak_activation_bytes, held);
      if (rec) rec->context().layer = -1;
      if (vs == V - 1) {
        Mat dy(Kokkos::view_alloc(Kokkos::WithoutInitializing, "wlb::runtime::dy"), n, hidden);
        Region r(rec, labels::kLoss, space);
        fillRandomRows(space, dy, in.seed + 1, inputStream(in.step, m), 1e-2f,
                       cp::packedPositions(in.shards[m], cp_rank));
        // only TP rank 0 counts the loss: every TP rank holds the full y
        int tp_rank = 0;
        if (env_.tp_comm != MPI_COMM_NULL) MPI_Comm_rank(env_.tp_comm, &tp_rank);
        if (tp_rank == 0) res.loss += dot(space, x, dy);
        loss_grad[t.mb] = dy;
      } else {
        send(t.phase, vs + 1, t.mb, x);
      }
    } else {
      Mat dy;
      if (vs == V - 1) {
        dy = loss_grad.at(t.mb);
        loss_grad.erase(t.mb);
      } else {
        dy = receive(t.phase, vs, t.mb);
      }
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
      if (rec) rec->context().layer = -1;
      if (vs > 0) send(t.phase, vs - 1, t.mb, dy);
    }
    kk::fence(space, "wlb::runtime::pp_task");
    const double sec = since(t_task) - (res.p2p_wait_seconds - wait0);
    res.task_seconds += sec;
    res.mb_seconds[m] += sec;
    if (!fwd) res.mb_attn[m] += attn;
    if (rec) last_end = rec->now();
  }
  res.pipeline_seconds = static_cast<double>(last_end - t0_ns) * 1e-9;
  if (!incoming.empty() || !live.empty())
    throw std::logic_error("PipelineStage: the schedule left messages or activations behind");
  {
    if (rec) rec->setContext({static_cast<int>(in.step), -1, trace::Phase::None, -1});
    Region r(rec, labels::kPpSend, space);
    for (auto& o : outgoing) MPI_Wait(&o.req, MPI_STATUS_IGNORE);
  }
  return res;
}

}  // namespace wlb::runtime
