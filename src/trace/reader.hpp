#pragma once
/// \file reader.hpp
/// \brief Read a trace file written by trace::Writer (docs/trace-schema.md) back into
/// memory, for tests and tools. Serial (any one process).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "trace/recorder.hpp"
#include "trace/schema.hpp"
#include "trace/writer.hpp"

namespace wlb::trace {

/// Everything in a trace file.
struct Trace {
  std::string path;
  int schema_version = 0;
  /// Every attribute of /meta; numeric ones formatted as decimal text.
  std::map<std::string, std::string> meta;
  std::string source;  ///< "measured" | "simulated"
  std::string deck_toml;
  std::string git_hash;
  std::string start_time;
  int mpi_size = 0, world_size = 0;
  int tp = 1, cp = 1, pp = 1, dp = 1;  ///< mesh sizes
  int warmup = 0;

  std::vector<schema::RankRow> ranks;
  std::vector<std::string> regions;     ///< label table (Event::region indexes it)
  std::vector<std::string> strategies;  ///< Event::strategy indexes it
  std::vector<Event> events;
  std::vector<PlanStepRow> plan_steps;  ///< strategy = index into `strategies`
  std::vector<SegmentRow> segments;
  /// `wlb train` metrics (/train/steps, /train/ranks); empty for other runs.
  std::vector<TrainStepRow> train_steps;
  std::vector<TrainRankRow> train_ranks;

  /// Label id, or -1 when the file has no such label.
  int regionId(const std::string& label) const;
  /// Events of one world rank (using the /ranks offsets).
  std::vector<Event> eventsOfRank(int rank) const;
};

/// Read `path`. Throws wlb::InputError naming the file when it is missing, not HDF5,
/// truncated, lacks the `complete` attribute (writer did not finish), or does not match
/// the schema.
Trace readTrace(const std::string& path);

/// True when `path` is a complete trace file (never throws).
bool isCompleteTrace(const std::string& path);

}  // namespace wlb::trace
