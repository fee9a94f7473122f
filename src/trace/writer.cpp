/// \file writer.cpp
/// \brief Trace writer: parallel /events, rank-0 tables and metadata, temp name + rename.

#include "trace/writer.hpp"

#include <sys/statvfs.h>
#include <unistd.h>

#include <fmt/format.h>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <unordered_map>

#include "core/error.hpp"
#include "core/h5.hpp"
#include "core/plan_json.hpp"
#include "core/version_info.hpp"
#include "trace/schema.hpp"

namespace wlb::trace {

namespace {

/// ": " + the system's reason for the failed write or close HDF5 reported (errno, which
/// HDF5's message leaves out: "No space left on device", "File too large"), if any.
std::string systemError() {
  const int e = errno;
  return e == 0 ? std::string() : std::string(": ") + std::strerror(e);
}

/// "; N MiB free on its file system" for the folder of `path` (empty where it cannot tell):
/// whether a failed write was the disk's room or something else.
std::string freeSpace(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return "";
  const double mib = static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize) / (1024.0 * 1024.0);
  return fmt::format("; {:.1f} MiB free on its file system", mib);
}

/// Strings joined with '\0' separators (and a trailing '\0').
std::string pack(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    out += s;
    out.push_back('\0');
  }
  return out;
}

std::vector<std::string> unpack(const char* p, std::size_t n) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i < n) {
    std::size_t len = std::strlen(p + i);
    out.emplace_back(p + i, len);
    i += len + 1;
  }
  return out;
}

/// Allgather of one string list per rank.
std::vector<std::vector<std::string>> allgatherLists(MPI_Comm comm, const std::vector<std::string>& mine) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  std::string buf = pack(mine);
  int n = static_cast<int>(buf.size());
  std::vector<int> counts(size), displs(size);
  MPI_Allgather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, comm);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    displs[r] = total;
    total += counts[r];
  }
  std::vector<char> all(static_cast<std::size_t>(std::max(total, 1)));
  MPI_Allgatherv(buf.data(), n, MPI_CHAR, all.data(), counts.data(), displs.data(), MPI_CHAR, comm);
  std::vector<std::vector<std::string>> out(size);
  for (int r = 0; r < size; ++r) out[r] = unpack(all.data() + displs[r], static_cast<std::size_t>(counts[r]));
  return out;
}

/// Union in order of first appearance.
void mergeInto(std::vector<std::string>& u, const std::vector<std::string>& v) {
  for (const auto& s : v)
    if (std::find(u.begin(), u.end(), s) == u.end()) u.push_back(s);
}

int indexOf(const std::vector<std::string>& v, const std::string& s) {
  return static_cast<int>(std::find(v.begin(), v.end(), s) - v.begin());
}

// parallel::bcastString's twin: the trace layer stands beside parallel and may not include it
std::string bcastString(MPI_Comm comm, const std::string& s) {
  long long n = static_cast<long long>(s.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, comm);
  std::string out = s;
  out.resize(static_cast<std::size_t>(n));
  if (n > 0) MPI_Bcast(out.data(), static_cast<int>(n), MPI_CHAR, 0, comm);
  return out;
}

std::string joined(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

}  // namespace

// Checked when the writer is made, before any work: the parallel create at commit needs
// every rank to reach rank 0's file, and ranks on nodes that do not share the output folder
// (a relative output.dir on node-local disks) would hang in it. Rank 0 leaves a marker
// beside the file; every rank must read it back.
void Writer::checkSharedFolder(const std::string& marker, int rank, int size) const {
  int ok = 1;
  if (rank == 0) {
    makeParentFolders(marker);
    std::FILE* f = std::fopen(marker.c_str(), "w");
    ok = f != nullptr && std::fputs(marker.c_str(), f) >= 0;
    if (f != nullptr && std::fclose(f) != 0) ok = 0;
  }
  MPI_Bcast(&ok, 1, MPI_INT, 0, comm_);
  if (ok == 0) {
    std::remove(marker.c_str());
    throw InputError(fmt::format("trace {}: cannot write in its folder ({})", path_, std::strerror(errno)), true);
  }
  int seen = 1;
  if (rank != 0) {
    char buf[4096] = {};
    std::FILE* f = std::fopen(marker.c_str(), "r");
    seen = f != nullptr && std::fgets(buf, sizeof buf, f) != nullptr && marker == buf;
    if (f != nullptr) std::fclose(f);
  }
  std::vector<int> all(static_cast<std::size_t>(size));
  MPI_Allgather(&seen, 1, MPI_INT, all.data(), 1, MPI_INT, comm_);
  if (rank == 0) std::remove(marker.c_str());
  for (int r = 0; r < size; ++r)
    if (all[static_cast<std::size_t>(r)] == 0)
      throw InputError(fmt::format("trace {}: rank {} cannot see the folder rank 0 writes it in; every rank must "
                                   "reach output.dir (a shared file system, or an absolute path on one)",
                                   path_, r),
                       true);
}

Writer::Writer(std::string path, RunMeta meta, WriterOptions opts)
    : path_(std::move(path)), meta_(std::move(meta)), opts_(std::move(opts)) {}

Writer::Writer(std::string path, RunMeta meta, MPI_Comm comm, WriterOptions opts)
    : path_(std::move(path)), meta_(std::move(meta)), opts_(std::move(opts)) {
  if (comm == MPI_COMM_NULL) return;
  MPI_Comm_dup(comm, &comm_);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm_, &rank);
  MPI_Comm_size(comm_, &size);
  if (size > 1) checkSharedFolder(bcastString(comm_, path_ + ".shared-" + std::to_string(::getpid())), rank, size);
}

Writer::~Writer() {
  if (comm_ != MPI_COMM_NULL) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
}

std::string Writer::planToJson(const std::string& strategy, const StepPlan& plan) {
  nlohmann::json j = wlb::planToJson(plan);  // a plan file's step line, without its metrics
  j["strategy"] = strategy;
  return j.dump();
}

void Writer::addPlan(const std::string& strategy, const StepPlan& plan, std::string packing_json,
                     std::string shard_json) {
  int s = indexOf(plan_strategies_, strategy);
  if (s == static_cast<int>(plan_strategies_.size())) plan_strategies_.push_back(strategy);
  PlanStepRow row;
  row.strategy = s;
  row.step = plan.step;
  row.packing_json = packing_json.empty() ? planToJson(strategy, plan) : std::move(packing_json);
  row.shard_json = shard_json.empty() ? "{}" : std::move(shard_json);  // the schema's "no shard plans"
  plan_steps_.push_back(std::move(row));
  for (std::size_t dp = 0; dp < plan.replicas.size(); ++dp) {
    for (std::size_t m = 0; m < plan.replicas[dp].size(); ++m) {
      const auto& segs = plan.replicas[dp][m].segments;
      for (std::size_t i = 0; i < segs.size(); ++i) {
        SegmentRow r;
        r.strategy = s;
        r.step = plan.step;
        r.dp = static_cast<std::int32_t>(dp);
        r.micro_batch = static_cast<std::int32_t>(m);
        r.index = static_cast<std::int32_t>(i);
        r.doc = segs[i].doc;
        r.offset = segs[i].offset;
        r.length = segs[i].length;
        r.arrival_step = segs[i].arrival_step;
        segments_.push_back(r);
      }
    }
  }
}

std::string Writer::commit(const Recorder& rec) {
  const bool parallel = comm_ != MPI_COMM_NULL;
  int rank = 0, size = 1;
  if (parallel) {
    MPI_Comm_rank(comm_, &rank);
    MPI_Comm_size(comm_, &size);
  }

  // ---- 1. unified label and strategy tables --------------------------------------------
  std::vector<std::string> regions = labels::standard();
  std::vector<std::string> strategies;
  std::vector<std::string> plan_strats = plan_strategies_;
  if (parallel) {
    for (const auto& l : allgatherLists(comm_, rec.regions())) mergeInto(regions, l);
    for (const auto& l : allgatherLists(comm_, rec.strategies())) mergeInto(strategies, l);
    // Only rank 0's plans are written: its strategy names count.
    auto ps = allgatherLists(comm_, plan_strategies_);
    plan_strats = ps[0];
  } else {
    mergeInto(regions, rec.regions());
    mergeInto(strategies, rec.strategies());
  }
  mergeInto(strategies, plan_strats);

  // ---- 2. local events, remapped to the unified ids ------------------------------------
  std::vector<int> region_map(rec.regions().size()), strategy_map(rec.strategies().size());
  for (std::size_t i = 0; i < rec.regions().size(); ++i) region_map[i] = indexOf(regions, rec.regions()[i]);
  for (std::size_t i = 0; i < rec.strategies().size(); ++i) strategy_map[i] = indexOf(strategies, rec.strategies()[i]);
  std::vector<Event> events = rec.events();
  for (auto& e : events) {
    if (e.region < 0 || e.region >= static_cast<int>(region_map.size()))
      throw std::invalid_argument("trace: event with unknown region id " + std::to_string(e.region));
    if (e.strategy < 0 || e.strategy >= static_cast<int>(strategy_map.size()))
      throw std::invalid_argument("trace: event with unknown strategy id " + std::to_string(e.strategy));
    e.region = region_map[e.region];
    e.strategy = strategy_map[e.strategy];
  }

  // ---- 3. rank table and offsets -------------------------------------------------------
  std::vector<schema::RankRow> ranks;
  long long my_offset = 0, total = 0;
  if (parallel) {
    long long n = static_cast<long long>(events.size());
    MPI_Exscan(&n, &my_offset, 1, MPI_LONG_LONG, MPI_SUM, comm_);
    if (rank == 0) my_offset = 0;
    MPI_Allreduce(&n, &total, 1, MPI_LONG_LONG, MPI_SUM, comm_);
    long long mine[7] = {rec.coord().tp,
                         rec.coord().cp,
                         rec.coord().pp,
                         rec.coord().dp,
                         static_cast<long long>(rec.clockOffsetNs()),
                         my_offset,
                         n};
    std::vector<long long> all(7 * static_cast<std::size_t>(size));
    MPI_Gather(mine, 7, MPI_LONG_LONG, all.data(), 7, MPI_LONG_LONG, 0, comm_);
    if (rank == 0) {
      for (int r = 0; r < size; ++r) {
        const long long* a = &all[7 * static_cast<std::size_t>(r)];
        ranks.push_back({r, static_cast<int>(a[0]), static_cast<int>(a[1]), static_cast<int>(a[2]),
                         static_cast<int>(a[3]), a[4], a[5], a[6]});
      }
    }
  } else {
    // Serial: events may belong to many virtual ranks; make each rank's slice contiguous.
    std::stable_sort(events.begin(), events.end(), [](const Event& a, const Event& b) { return a.rank < b.rank; });
    total = static_cast<long long>(events.size());
    std::vector<RankCoord> coords = rec.virtualRanks();
    int max_rank = events.empty() ? 0 : events.back().rank;
    if (coords.empty()) {
      coords.assign(static_cast<std::size_t>(std::max(max_rank, rec.rank())) + 1, RankCoord{});
      coords[static_cast<std::size_t>(rec.rank())] = rec.coord();
    }
    if (!events.empty() && (events.front().rank < 0 || max_rank >= static_cast<int>(coords.size())))
      throw std::invalid_argument("trace: event rank outside the rank table (setVirtualRanks)");
    ranks.resize(coords.size());
    for (std::size_t r = 0; r < coords.size(); ++r)
      ranks[r] = {static_cast<int>(r), coords[r].tp, coords[r].cp, coords[r].pp, coords[r].dp, 0, 0, 0};
    for (std::size_t i = 0; i < events.size(); ++i) {
      auto& row = ranks[static_cast<std::size_t>(events[i].rank)];
      if (row.event_count == 0) row.event_offset = static_cast<long long>(i);
      row.event_count++;
    }
    for (auto& row : ranks)
      if (row.event_count == 0) row.event_offset = 0;
  }

  // ---- 4. temporary name -------------------------------------------------------------
  std::string tmp = path_ + ".tmp-" + std::to_string(::getpid());
  if (parallel) tmp = bcastString(comm_, tmp);
  const TrackedTemporaries tracked(rank == 0 ? opts_.track_temporary : TemporaryTracker{}, {tmp});

  // ---- 5. /events (parallel: collective hyperslab writes) ----------------------------
  auto memType = schema::eventMemType();
  auto fileType = schema::packed(memType);
  errno = 0;  // what is set from here on is the write's (systemError)
  std::string events_err;  // this rank's part of /events failed
  try {
    auto file = h5::File::create(tmp, parallel ? comm_ : MPI_COMM_NULL);
    auto ds = file.createDataset("events", fileType.id(), h5::Dataspace::simple({static_cast<hsize_t>(total)}));
    if (total > 0) {
      auto fspace = ds.space();
      auto mspace = h5::Dataspace::simple({std::max<hsize_t>(events.size(), 1)});
      if (events.empty()) {
        fspace.selectNone();
        mspace.selectNone();
      } else {
        fspace.selectHyperslab({static_cast<hsize_t>(my_offset)}, {events.size()});
      }
      if (parallel) {
        auto dxpl = h5::PropList::collectiveTransfer();
        Event dummy;
        ds.write(memType.id(), mspace, fspace, dxpl.id(), events.empty() ? &dummy : events.data());
      } else {
        ds.write(memType.id(), mspace, fspace, H5P_DEFAULT, events.data());
      }
    }
    ds.close();
    file.close();
  } catch (const h5::Error& e) {
    events_err = e.what() + systemError();
  }
  // Every rank learns whether any rank's part failed, and every failing rank's reason (a
  // collective write fails differently on each: one rank's write, another's close), so rank
  // 0 never completes a trace that lacks a rank's events, and one message is printed.
  int failed = events_err.empty() ? 0 : 1;
  if (parallel) MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, comm_);
  if (failed) {
    std::string why = events_err;
    if (parallel) {
      std::vector<std::pair<std::string, std::string>> reasons;  // reason -> its ranks, first seen first
      const auto all = allgatherLists(comm_, {events_err});
      for (std::size_t r = 0; r < all.size(); ++r) {
        if (all[r].empty() || all[r][0].empty()) continue;
        auto it = std::find_if(reasons.begin(), reasons.end(), [&](const auto& x) { return x.first == all[r][0]; });
        if (it == reasons.end()) it = reasons.insert(reasons.end(), {all[r][0], ""});
        it->second += (it->second.empty() ? "" : ",") + std::to_string(r);
      }
      why.clear();
      for (std::size_t i = 0; i < reasons.size() && i < 3; ++i)
        why += fmt::format("{}rank {}: {}", i ? "; " : "", reasons[i].second, reasons[i].first);
      if (reasons.size() > 3) why += fmt::format("; {} other reasons", reasons.size() - 3);
    }
    if (rank == 0) std::remove(tmp.c_str());
    throw WriteError(fmt::format("trace {}: cannot write it ({}){}", path_, why, freeSpace(path_)), parallel);
  }

  // ---- 6. tables, metadata and `complete` by rank 0, then rename -----------------------
  int ok = 1;
  std::string err;
  if (rank == 0) {
    errno = 0;
    try {
      auto file = h5::File::open(tmp, h5::File::Mode::ReadWrite);
      // /meta
      RunMeta m = meta_;
      if (m.git_hash.empty()) m.git_hash = wlb::gitHash();
      if (m.wlb_version.empty()) m.wlb_version = wlb::versionString();
      if (m.kokkos_version.empty()) m.kokkos_version = wlb::kokkosVersion();
      if (m.kokkos_backend.empty()) m.kokkos_backend = wlb::kokkosBackend();
      if (m.start_time.empty()) m.start_time = rec.startTimeIso();
      auto derive = [&](int v, int schema::RankRow::*f) {
        if (v > 0) return v;
        int mx = 0;
        for (const auto& r : ranks) mx = std::max(mx, r.*f);
        return mx + 1;
      };
      auto meta = file.createGroup("meta");
      meta.setAttribute("schema_version", kSchemaVersion);
      meta.setAttribute("source", m.source);
      meta.setAttribute("git_hash", m.git_hash);
      meta.setAttribute("wlb_version", m.wlb_version);
      meta.setAttribute("kokkos_version", m.kokkos_version);
      meta.setAttribute("kokkos_backend", m.kokkos_backend);
      meta.setAttribute("hdf5_version", wlb::hdf5Version());
      meta.setAttribute("mpi_size", size);
      meta.setAttribute("world_size", static_cast<int>(ranks.size()));
      meta.setAttribute("mesh_tp", derive(m.tp, &schema::RankRow::tp));
      meta.setAttribute("mesh_cp", derive(m.cp, &schema::RankRow::cp));
      meta.setAttribute("mesh_pp", derive(m.pp, &schema::RankRow::pp));
      meta.setAttribute("mesh_dp", derive(m.dp, &schema::RankRow::dp));
      meta.setAttribute("warmup", m.warmup);
      meta.setAttribute("start_time", m.start_time);
      meta.setAttribute("clock", std::string("steady_clock ns since the run epoch (rank 0), offsets aligned"));
      meta.setAttribute("strategy", joined(strategies, ","));
      meta.setAttribute("command", m.command);
      // HDF5 attributes live in the object header (64 KiB limit): a very large deck goes
      // into the dataset /meta/deck instead (readers check the attribute first).
      if (m.deck_toml.size() < 60000) {
        meta.setAttribute("deck", m.deck_toml);
      } else {
        meta.writeStrings("deck", {m.deck_toml});
      }
      for (const auto& kv : m.extra) meta.setAttribute(kv.first, kv.second);
      meta.writeStrings("strategies", strategies);
      // /ranks, /regions
      {
        auto rt = schema::rankMemType();
        auto ds = file.createDataset("ranks", schema::packed(rt).id(), h5::Dataspace::simple({ranks.size()}));
        if (!ranks.empty()) ds.writeAll(rt.id(), ranks.data());
      }
      file.writeStrings("regions", regions);
      // /plan
      auto plan = file.createGroup("plan");
      {
        std::vector<int> smap(plan_strategies_.size());
        for (std::size_t i = 0; i < plan_strategies_.size(); ++i) smap[i] = indexOf(strategies, plan_strategies_[i]);
        std::vector<schema::PlanStepKey> keys;
        std::vector<std::string> pj, sj;
        for (const auto& p : plan_steps_) {
          keys.push_back({smap[static_cast<std::size_t>(p.strategy)], p.step});
          pj.push_back(p.packing_json);
          sj.push_back(p.shard_json);
        }
        auto kt = schema::planStepMemType();
        auto ds = plan.createDataset("steps", schema::packed(kt).id(), h5::Dataspace::simple({keys.size()}));
        if (!keys.empty()) ds.writeAll(kt.id(), keys.data());
        plan.writeStrings("packing_json", pj);
        plan.writeStrings("shard_json", sj);
        std::vector<SegmentRow> segs = segments_;
        for (auto& s : segs) s.strategy = smap[static_cast<std::size_t>(s.strategy)];
        auto st = schema::segmentMemType();
        auto sd = plan.createDataset("segments", schema::packed(st).id(), h5::Dataspace::simple({segs.size()}));
        if (!segs.empty()) sd.writeAll(st.id(), segs.data());
      }
      // /train (wlb train)
      if (have_training_) {
        auto train = file.createGroup("train");
        auto tt = schema::trainStepMemType();
        auto sd = train.createDataset("steps", schema::packed(tt).id(), h5::Dataspace::simple({train_steps_.size()}));
        if (!train_steps_.empty()) sd.writeAll(tt.id(), train_steps_.data());
        auto rt = schema::trainRankMemType();
        auto rd = train.createDataset("ranks", schema::packed(rt).id(), h5::Dataspace::simple({train_ranks_.size()}));
        if (!train_ranks_.empty()) rd.writeAll(rt.id(), train_ranks_.data());
      }
      file.setAttribute("schema_version", kSchemaVersion);
      file.flush();
      if (opts_.before_complete) opts_.before_complete(tmp);
      file.setAttribute("complete", 1);  // last write
      file.close();
      if (std::rename(tmp.c_str(), path_.c_str()) != 0)
        throw h5::Error("cannot rename " + tmp + " to " + path_ + ": " + std::strerror(errno));
    } catch (const std::exception& e) {
      ok = 0;
      err = e.what() + systemError();
      std::remove(tmp.c_str());
    }
  }
  if (parallel) {
    MPI_Bcast(&ok, 1, MPI_INT, 0, comm_);
    err = bcastString(comm_, err);
  }
  // A WriteError, not an InputError: a close that failed (a full disk) leaves HDF5 state that
  // its shutdown in MPI_Finalize would crash on, so the driver aborts instead.
  if (!ok) throw WriteError(fmt::format("trace {}: cannot write it ({}){}", path_, err, freeSpace(path_)), parallel);
  return path_;
}

}  // namespace wlb::trace
