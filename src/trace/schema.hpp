#pragma once
/// \file schema.hpp
/// \brief HDF5 types of the trace file's compound tables (shared by writer and reader).
/// See docs/trace-schema.md for the layout.

#include <cstdint>

#include "core/h5.hpp"
#include "trace/recorder.hpp"
#include "trace/writer.hpp"

namespace wlb::trace::schema {

/// One row of `/ranks`.
struct RankRow {
  std::int32_t rank = 0;
  std::int32_t tp = 0, cp = 0, pp = 0, dp = 0;
  std::int64_t clock_offset_ns = 0;  ///< measured offset of this rank's clock to rank 0
  std::int64_t event_offset = 0;     ///< first row of this rank's events in /events
  std::int64_t event_count = 0;      ///< number of its events
};

/// In-memory row of `/plan/steps` (the strings live in parallel datasets).
struct PlanStepKey {
  std::int32_t strategy = 0;
  std::int64_t step = 0;
};

/// HDF5 enum `phase_t` {none=0, fwd=1, bwd=2} over int8.
h5::Datatype phaseType();
/// Native (memory) compound types matching the structs.
h5::Datatype eventMemType();
h5::Datatype rankMemType();
h5::Datatype segmentMemType();
h5::Datatype planStepMemType();
h5::Datatype trainStepMemType();
h5::Datatype trainRankMemType();
/// Packed copy of a memory type for storage (no padding in the file).
h5::Datatype packed(const h5::Datatype& mem);

}  // namespace wlb::trace::schema
