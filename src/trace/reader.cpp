/// \file reader.cpp
/// \brief Trace reader (serial).

#include "trace/reader.hpp"

#include <array>
#include <cmath>
#include <set>
#include <sstream>
#include <string>

#include "core/error.hpp"
#include "core/h5.hpp"

namespace wlb::trace {

namespace {

template <class Row>
std::vector<Row> readTable(const h5::Location& loc, const std::string& name, const h5::Datatype& mem) {
  auto ds = loc.openDataset(name);
  if (ds.type().typeClass() != H5T_COMPOUND) throw InputError(ds.name() + ": not a compound table");
  auto d = ds.dims();
  if (d.size() != 1) throw InputError(ds.name() + ": expected a 1-D table");
  std::vector<Row> rows(d[0]);
  if (d[0] > 0) ds.readAll(mem.id(), rows.data());
  return rows;
}

}  // namespace

int Trace::regionId(const std::string& label) const {
  for (std::size_t i = 0; i < regions.size(); ++i)
    if (regions[i] == label) return static_cast<int>(i);
  return -1;
}

std::vector<Event> Trace::eventsOfRank(int rank) const {
  for (const auto& r : ranks) {
    if (r.rank == rank)
      return std::vector<Event>(events.begin() + r.event_offset, events.begin() + r.event_offset + r.event_count);
  }
  return {};
}

Trace readTrace(const std::string& path) {
  auto file = h5::File::open(path);  // InputError: missing / not HDF5 / truncated
  if (!file.hasAttribute("complete") || file.attributeClass("complete") != H5T_INTEGER)
    throw InputError(path + ": incomplete trace (no 'complete' attribute: the writer did not finish)");
  if (const int c = file.attribute<int>("complete"); c != 1)
    throw InputError(path + ": incomplete trace ('complete' = " + std::to_string(c) +
                     ", not 1: the writer did not finish)");
  Trace t;
  t.path = path;
  try {
    auto meta = file.openGroup("meta");
    for (const auto& name : meta.attributeNames()) {
      auto c = meta.attributeClass(name);
      if (c == H5T_STRING) {
        t.meta[name] = meta.stringAttribute(name);
      } else if (c == H5T_INTEGER) {
        t.meta[name] = std::to_string(meta.attribute<long long>(name));
      } else if (c == H5T_FLOAT) {
        std::ostringstream os;
        os << meta.attribute<double>(name);
        t.meta[name] = os.str();
      }
    }
    // The version is the root's attribute; /meta repeats it (older readers look there).
    t.schema_version = meta.attribute<int>("schema_version");
    if (file.hasAttribute("schema_version")) {
      const int root = file.attribute<int>("schema_version");
      if (root != t.schema_version)
        throw InputError(path + ": schema_version " + std::to_string(root) + " (/) differs from " +
                         std::to_string(t.schema_version) + " (/meta)");
    }
    if (t.schema_version > kSchemaVersion)
      throw InputError(path + ": trace schema version " + std::to_string(t.schema_version) +
                       " is newer than this wlb supports (" + std::to_string(kSchemaVersion) + ")");
    t.source = meta.stringAttribute("source");
    if (meta.hasAttribute("deck")) {
      t.deck_toml = meta.stringAttribute("deck");
    } else {
      auto d = meta.readStrings("deck");
      t.deck_toml = d.empty() ? std::string() : d[0];
      t.meta["deck"] = t.deck_toml;
    }
    t.git_hash = meta.stringAttribute("git_hash");
    t.start_time = meta.stringAttribute("start_time");
    t.mpi_size = meta.attribute<int>("mpi_size");
    t.world_size = meta.attribute<int>("world_size");
    t.tp = meta.attribute<int>("mesh_tp");
    t.cp = meta.attribute<int>("mesh_cp");
    t.pp = meta.attribute<int>("mesh_pp");
    t.dp = meta.attribute<int>("mesh_dp");
    t.warmup = meta.attribute<int>("warmup");
    t.strategies = meta.readStrings("strategies");

    t.ranks = readTable<schema::RankRow>(file, "ranks", schema::rankMemType());
    t.regions = file.readStrings("regions");
    t.events = readTable<Event>(file, "events", schema::eventMemType());

    auto plan = file.openGroup("plan");
    auto keys = readTable<schema::PlanStepKey>(plan, "steps", schema::planStepMemType());
    auto pj = plan.readStrings("packing_json");
    auto sj = plan.readStrings("shard_json");
    if (pj.size() != keys.size() || sj.size() != keys.size())
      throw InputError(path + ": /plan/steps, packing_json and shard_json differ in length");
    for (std::size_t i = 0; i < keys.size(); ++i)
      t.plan_steps.push_back({keys[i].strategy, keys[i].step, pj[i], sj[i]});
    t.segments = readTable<SegmentRow>(plan, "segments", schema::segmentMemType());
    if (file.exists("train")) {
      auto train = file.openGroup("train");
      t.train_steps = readTable<TrainStepRow>(train, "steps", schema::trainStepMemType());
      t.train_ranks = readTable<TrainRankRow>(train, "ranks", schema::trainRankMemType());
    }
  } catch (const h5::Error& e) {
    throw InputError(path + ": damaged trace (" + e.what() + ")");
  }

  // Consistency checks: ids in range, rank slices inside the table, and the figures the
  // analysis, calibration and replay divide by (an edited or damaged file is refused, not
  // averaged: a NaN or negative count would otherwise vanish from or skew every fit).
  if (t.warmup < 0) throw InputError(path + ": /meta warmup " + std::to_string(t.warmup) + " is negative");
  // the mesh every coordinate and collective group is read against
  for (const auto& [name, v] :
       {std::pair{"mesh_tp", t.tp}, std::pair{"mesh_cp", t.cp}, std::pair{"mesh_pp", t.pp}, std::pair{"mesh_dp", t.dp}})
    if (v < 1) throw InputError(path + ": /meta " + name + " " + std::to_string(v) + " is not a mesh size");
  if (static_cast<std::int64_t>(t.tp) * t.cp * t.pp * t.dp != t.world_size)
    throw InputError(path + ": /meta mesh " + std::to_string(t.tp) + "x" + std::to_string(t.cp) + "x" +
                     std::to_string(t.pp) + "x" + std::to_string(t.dp) + " is not world_size " +
                     std::to_string(t.world_size));
  const auto nreg = static_cast<int>(t.regions.size());
  const auto nstr = static_cast<int>(t.strategies.size());
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const Event& e = t.events[i];
    if (e.region < 0 || e.region >= nreg || e.strategy < 0 || e.strategy >= nstr)
      throw InputError(path + ": /events refers to a label or strategy outside the tables");
    if (static_cast<int>(e.phase) < 0 || static_cast<int>(e.phase) > 2)  // none, fwd, bwd
      throw InputError(path + ": /events row " + std::to_string(i) + " has phase " +
                       std::to_string(static_cast<int>(e.phase)) + " (none, fwd or bwd)");
    if (e.end_ns < e.start_ns || !std::isfinite(e.flops) || e.flops < 0 || !std::isfinite(e.bytes) || e.bytes < 0)
      throw InputError(path + ": /events row " + std::to_string(i) +
                       " is damaged (an end before its start, or a FLOP or byte count that is negative or not a "
                       "number)");
  }
  std::set<std::array<int, 4>> coords;
  for (const auto& r : t.ranks) {
    if (r.event_offset < 0 || r.event_count < 0 ||
        r.event_offset + r.event_count > static_cast<std::int64_t>(t.events.size()))
      throw InputError(path + ": /ranks event slice of rank " + std::to_string(r.rank) + " is out of range");
    for (std::int64_t i = r.event_offset; i < r.event_offset + r.event_count; ++i)
      if (t.events[static_cast<std::size_t>(i)].rank != r.rank)
        throw InputError(path + ": /ranks event slice of rank " + std::to_string(r.rank) +
                         " holds another rank's events");
    if (r.tp < 0 || r.tp >= t.tp || r.cp < 0 || r.cp >= t.cp || r.pp < 0 || r.pp >= t.pp || r.dp < 0 || r.dp >= t.dp)
      throw InputError(path + ": /ranks gives rank " + std::to_string(r.rank) + " coordinates outside the mesh");
    if (!coords.insert({r.tp, r.cp, r.pp, r.dp}).second)
      throw InputError(path + ": /ranks gives two ranks the coordinates (tp, cp, pp, dp) = (" + std::to_string(r.tp) +
                       ", " + std::to_string(r.cp) + ", " + std::to_string(r.pp) + ", " + std::to_string(r.dp) + ")");
  }
  return t;
}

bool isCompleteTrace(const std::string& path) {
  try {
    auto file = h5::File::open(path);
    return file.hasAttribute("complete") && file.attribute<int>("complete") == 1;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace wlb::trace
