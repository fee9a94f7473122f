/// \file schema.cpp
/// \brief Compound and enum HDF5 types of the trace tables.

#include "trace/schema.hpp"

#include <cstddef>

namespace wlb::trace::schema {

h5::Datatype phaseType() {
  auto t = h5::Datatype::adopt(H5Tenum_create(H5T_NATIVE_INT8));
  const std::int8_t none = 0, fwd = 1, bwd = 2;
  H5Tenum_insert(t.id(), "none", &none);
  H5Tenum_insert(t.id(), "fwd", &fwd);
  H5Tenum_insert(t.id(), "bwd", &bwd);
  return t;
}

h5::Datatype eventMemType() {
  auto phase = phaseType();
  auto t = h5::Datatype::compound(sizeof(Event));
  t.insert("rank", offsetof(Event, rank), H5T_NATIVE_INT32)
      .insert("strategy", offsetof(Event, strategy), H5T_NATIVE_INT32)
      .insert("step", offsetof(Event, step), H5T_NATIVE_INT32)
      .insert("micro_batch", offsetof(Event, micro_batch), H5T_NATIVE_INT32)
      .insert("region", offsetof(Event, region), H5T_NATIVE_INT32)
      .insert("layer", offsetof(Event, layer), H5T_NATIVE_INT32)
      .insert("chunk", offsetof(Event, chunk), H5T_NATIVE_INT32)
      .insert("phase", offsetof(Event, phase), phase.id())
      .insert("start_ns", offsetof(Event, start_ns), H5T_NATIVE_INT64)
      .insert("end_ns", offsetof(Event, end_ns), H5T_NATIVE_INT64)
      .insert("flops", offsetof(Event, flops), H5T_NATIVE_DOUBLE)
      .insert("bytes", offsetof(Event, bytes), H5T_NATIVE_DOUBLE);
  return t;
}

h5::Datatype rankMemType() {
  auto t = h5::Datatype::compound(sizeof(RankRow));
  t.insert("rank", offsetof(RankRow, rank), H5T_NATIVE_INT32)
      .insert("tp", offsetof(RankRow, tp), H5T_NATIVE_INT32)
      .insert("cp", offsetof(RankRow, cp), H5T_NATIVE_INT32)
      .insert("pp", offsetof(RankRow, pp), H5T_NATIVE_INT32)
      .insert("dp", offsetof(RankRow, dp), H5T_NATIVE_INT32)
      .insert("clock_offset_ns", offsetof(RankRow, clock_offset_ns), H5T_NATIVE_INT64)
      .insert("event_offset", offsetof(RankRow, event_offset), H5T_NATIVE_INT64)
      .insert("event_count", offsetof(RankRow, event_count), H5T_NATIVE_INT64);
  return t;
}

h5::Datatype segmentMemType() {
  auto t = h5::Datatype::compound(sizeof(SegmentRow));
  t.insert("strategy", offsetof(SegmentRow, strategy), H5T_NATIVE_INT32)
      .insert("step", offsetof(SegmentRow, step), H5T_NATIVE_INT64)
      .insert("dp", offsetof(SegmentRow, dp), H5T_NATIVE_INT32)
      .insert("micro_batch", offsetof(SegmentRow, micro_batch), H5T_NATIVE_INT32)
      .insert("index", offsetof(SegmentRow, index), H5T_NATIVE_INT32)
      .insert("doc", offsetof(SegmentRow, doc), H5T_NATIVE_INT64)
      .insert("offset", offsetof(SegmentRow, offset), H5T_NATIVE_INT64)
      .insert("length", offsetof(SegmentRow, length), H5T_NATIVE_INT64)
      .insert("arrival_step", offsetof(SegmentRow, arrival_step), H5T_NATIVE_INT64);
  return t;
}

h5::Datatype planStepMemType() {
  auto t = h5::Datatype::compound(sizeof(PlanStepKey));
  t.insert("strategy", offsetof(PlanStepKey, strategy), H5T_NATIVE_INT32)
      .insert("step", offsetof(PlanStepKey, step), H5T_NATIVE_INT64);
  return t;
}

h5::Datatype trainStepMemType() {
  auto t = h5::Datatype::compound(sizeof(TrainStepRow));
  t.insert("step", offsetof(TrainStepRow, step), H5T_NATIVE_INT64)
      .insert("tokens", offsetof(TrainStepRow, tokens), H5T_NATIVE_INT64)
      .insert("predicted", offsetof(TrainStepRow, predicted), H5T_NATIVE_INT64)
      .insert("documents", offsetof(TrainStepRow, documents), H5T_NATIVE_INT64)
      .insert("loss", offsetof(TrainStepRow, loss), H5T_NATIVE_DOUBLE)
      .insert("eval_loss", offsetof(TrainStepRow, eval_loss), H5T_NATIVE_DOUBLE)
      .insert("lr", offsetof(TrainStepRow, lr), H5T_NATIVE_DOUBLE)
      .insert("grad_norm", offsetof(TrainStepRow, grad_norm), H5T_NATIVE_DOUBLE)
      .insert("seconds", offsetof(TrainStepRow, seconds), H5T_NATIVE_DOUBLE)
      .insert("tokens_per_second", offsetof(TrainStepRow, tokens_per_second), H5T_NATIVE_DOUBLE);
  return t;
}

h5::Datatype trainRankMemType() {
  auto t = h5::Datatype::compound(sizeof(TrainRankRow));
  t.insert("step", offsetof(TrainRankRow, step), H5T_NATIVE_INT64)
      .insert("rank", offsetof(TrainRankRow, rank), H5T_NATIVE_INT32)
      .insert("tokens", offsetof(TrainRankRow, tokens), H5T_NATIVE_INT64)
      .insert("step_seconds", offsetof(TrainRankRow, step_seconds), H5T_NATIVE_DOUBLE)
      .insert("data_seconds", offsetof(TrainRankRow, data_seconds), H5T_NATIVE_DOUBLE)
      .insert("compute_seconds", offsetof(TrainRankRow, compute_seconds), H5T_NATIVE_DOUBLE)
      .insert("attn_seconds", offsetof(TrainRankRow, attn_seconds), H5T_NATIVE_DOUBLE)
      .insert("cp_comm_seconds", offsetof(TrainRankRow, cp_comm_seconds), H5T_NATIVE_DOUBLE)
      .insert("tp_comm_seconds", offsetof(TrainRankRow, tp_comm_seconds), H5T_NATIVE_DOUBLE)
      .insert("allreduce_seconds", offsetof(TrainRankRow, allreduce_seconds), H5T_NATIVE_DOUBLE)
      .insert("optimizer_seconds", offsetof(TrainRankRow, optimizer_seconds), H5T_NATIVE_DOUBLE)
      .insert("eval_seconds", offsetof(TrainRankRow, eval_seconds), H5T_NATIVE_DOUBLE)
      .insert("allocations", offsetof(TrainRankRow, allocations), H5T_NATIVE_INT64)
      .insert("pool_bytes", offsetof(TrainRankRow, pool_bytes), H5T_NATIVE_INT64)
      .insert("pool_live_bytes", offsetof(TrainRankRow, pool_live_bytes), H5T_NATIVE_INT64)
      .insert("pool_requested_bytes", offsetof(TrainRankRow, pool_requested_bytes), H5T_NATIVE_INT64);
  return t;
}

h5::Datatype packed(const h5::Datatype& mem) {
  auto t = h5::Datatype::copyOf(mem.id());
  if (H5Tpack(t.id()) < 0) throw h5::Error("HDF5 error: H5Tpack");
  return t;
}

}  // namespace wlb::trace::schema
