// The Python module `wlb._wlb` (docs/python.md): decks, length sources, the cost model,
// every packer as a stateful object, the CP shard planner and the metrics of wlb::plan.
// Plans come back as NumPy arrays built in C++ (no per-token Python work); bad input
// raises ValueError with the message the CLI prints after "wlb: error: ".
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/deck.hpp"
#include "core/deck_schema.hpp"
#include "core/error.hpp"
#include "cp/shard_plan.hpp"
#include "data/length_source.hpp"
#include "model/cost_model.hpp"
#include "packing/packer.hpp"
#include "packing/plan_io.hpp"
#include "packing/runner.hpp"

namespace py = pybind11;
using nlohmann::json;
namespace cp = wlb::cp;
namespace data = wlb::data;
namespace model = wlb::model;
namespace packing = wlb::packing;

using I64Array = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

namespace wlb_py {
/// An integer array argument: a numpy integer array or a sequence of ints. Floats (5.5) and
/// uint64 values past int64 are refused with a TypeError instead of being truncated or
/// wrapped, which forcecast alone would do.
struct Ints : I64Array {
  Ints() = default;
  explicit Ints(I64Array a) : I64Array(std::move(a)) {}
};

/// An integer scalar argument: a Python int or a NumPy integer scalar (or 0-d integer array).
/// pybind11's own integer caster converts with int(), so 2.9, np.float32(3.7), np.array([1.5])
/// and True would pass as 2, 3, 1 and 1; these are a TypeError here, as for Ints.
struct Int {
  std::int64_t v = 0;
  operator std::int64_t() const { return v; }  // NOLINT(google-explicit-constructor): an int
};
}  // namespace wlb_py

namespace pybind11::detail {
template <>
struct type_caster<wlb_py::Int> {
  PYBIND11_TYPE_CASTER(wlb_py::Int, const_name("int"));
  bool load(handle src, bool) {
    if (!src || PyBool_Check(src.ptr()) || PyFloat_Check(src.ptr())) return false;
    if (hasattr(src, "dtype")) {  // NumPy: an integer kind with no dimension (bool is kind 'b')
      const auto kind = src.attr("dtype").attr("kind").cast<std::string>();
      if ((kind != "i" && kind != "u") || (hasattr(src, "ndim") && src.attr("ndim").cast<int>() != 0)) return false;
    } else if (!PyLong_Check(src.ptr())) {
      return false;
    }
    const auto idx = reinterpret_steal<object>(PyNumber_Index(src.ptr()));
    if (!idx) {
      PyErr_Clear();
      return false;
    }
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
    if (overflow != 0 || (x == -1 && PyErr_Occurred())) {  // past int64: refused, never wrapped
      PyErr_Clear();
      return false;
    }
    value.v = x;
    return true;
  }
  static handle cast(const wlb_py::Int& i, return_value_policy, handle) { return PyLong_FromLongLong(i.v); }
};

template <>
struct type_caster<wlb_py::Ints> {
  PYBIND11_TYPE_CASTER(wlb_py::Ints, const_name("numpy.ndarray[numpy.int64]"));
  bool load(handle src, bool) {
    if (!src || src.is_none()) return false;
    const array a = array::ensure(src);  // how numpy reads it: a list of floats is a float array
    if (!a) return false;
    const char kind = a.dtype().kind();
    if (a.size() > 0 && kind != 'i' && kind != 'u') return false;
    if (kind == 'u' && a.itemsize() == 8) {
      const auto u = array_t<std::uint64_t, array::c_style | array::forcecast>::ensure(a);
      for (py::ssize_t i = 0; i < u.size(); ++i)
        if (u.data()[i] > static_cast<std::uint64_t>(INT64_MAX)) return false;
    }
    value = wlb_py::Ints(I64Array::ensure(a));
    return static_cast<bool>(value);
  }
};
}  // namespace pybind11::detail

namespace {
using wlb_py::Int;
using wlb_py::Ints;

// ---- JSON <-> Python -------------------------------------------------------------------

py::object toPy(const json& j) {
  switch (j.type()) {
    case json::value_t::null:
      return py::none();
    case json::value_t::boolean:
      return py::bool_(j.get<bool>());
    case json::value_t::number_integer:
      return py::int_(j.get<std::int64_t>());
    case json::value_t::number_unsigned:
      return py::int_(j.get<std::uint64_t>());
    case json::value_t::number_float:
      return py::float_(j.get<double>());
    case json::value_t::string:
      return py::str(j.get_ref<const std::string&>());
    case json::value_t::array: {
      py::list l(j.size());
      std::size_t i = 0;
      for (const auto& e : j) l[i++] = toPy(e);
      return std::move(l);
    }
    case json::value_t::object: {
      py::dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d[py::str(it.key())] = toPy(it.value());
      return std::move(d);
    }
    default:
      return py::none();
  }
}

json fromPy(py::handle o, const std::string& what) {
  if (o.is_none()) return nullptr;
  if (py::isinstance<py::bool_>(o)) return o.cast<bool>();
  if (py::isinstance<py::int_>(o)) {
    try {
      return o.cast<std::int64_t>();
    } catch (const py::cast_error&) {
      return o.cast<std::uint64_t>();
    }
  }
  if (py::isinstance<py::float_>(o)) return o.cast<double>();
  if (py::isinstance<py::str>(o)) return o.cast<std::string>();
  if (py::isinstance<py::dict>(o)) {
    json j = json::object();
    for (auto kv : o.cast<py::dict>()) {
      if (!py::isinstance<py::str>(kv.first))
        throw py::value_error(fmt::format("{}: dictionary keys must be strings", what));
      j[kv.first.cast<std::string>()] = fromPy(kv.second, what);
    }
    return j;
  }
  if (py::isinstance<py::list>(o) || py::isinstance<py::tuple>(o)) {
    json j = json::array();
    for (auto e : o) j.push_back(fromPy(e, what));
    return j;
  }
  if (py::hasattr(o, "tolist")) return fromPy(o.attr("tolist")(), what);  // NumPy scalars and arrays
  throw py::value_error(fmt::format("{}: cannot store a {} (expected dict, list, str, int, float, bool or None)", what,
                                    py::str(o.get_type().attr("__name__")).cast<std::string>()));
}

// ---- NumPy helpers ---------------------------------------------------------------------

I64Array i64Vector(const std::vector<std::int64_t>& v) {
  I64Array a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(std::int64_t));
  return a;
}

/// Segments as an (n, 4) array of [doc, offset, length, arrival_step]; when any segment is a
/// SlimPack slice (q_offset > 0: it attends to the keys of its document before it), an
/// (n, 5) array with q_offset last (0 for whole segments), as the plan JSON's 5-element rows.
/// `wide`: 5 columns anyway (every array of a plan that holds a slice has the same width).
I64Array segmentArray(const std::vector<wlb::Segment>& segs, bool wide = false) {
  bool sliced = wide;
  for (const auto& s : segs) sliced = sliced || s.q_offset != 0;
  const py::ssize_t w = sliced ? 5 : 4;
  I64Array a({static_cast<py::ssize_t>(segs.size()), w});
  auto* p = a.mutable_data();
  for (const auto& s : segs) {
    *p++ = s.doc;
    *p++ = s.offset;
    *p++ = s.length;
    *p++ = s.arrival_step;
    if (sliced) *p++ = s.q_offset;
  }
  return a;
}

/// (n, 5), (n, 4) or (n, 3) [doc, offset, length(, arrival(, q_offset))] array -> segments; a
/// 1-D array is read as lengths of whole documents 0..n-1.
std::vector<wlb::Segment> segmentsFrom(const I64Array& a, const char* what) {
  std::vector<wlb::Segment> out;
  if (a.ndim() == 1) {
    const auto* p = a.data();
    for (py::ssize_t i = 0; i < a.shape(0); ++i) out.push_back({i, 0, p[i], 0});
  } else if (a.ndim() == 2 && a.shape(1) >= 3 && a.shape(1) <= 5) {
    const auto* p = a.data();
    const auto w = a.shape(1);
    for (py::ssize_t i = 0; i < a.shape(0); ++i, p += w)
      out.push_back({p[0], p[1], p[2], w >= 4 ? p[3] : 0, w == 5 ? p[4] : 0});
  } else {
    throw py::value_error(
        fmt::format("{}: expected lengths (1-D) or segments (n x 4: doc, offset, length, "
                    "arrival_step; n x 5 with q_offset; or n x 3)",
                    what));
  }
  for (const auto& s : out) {
    // A segment lies inside a document: a length past the longest document would size
    // buffers the planner then fills token by token.
    if (s.doc < 0 || s.length < 1 || s.offset < 0 || s.length > data::kMaxDocTokens ||
        s.offset > data::kMaxDocTokens - s.length)
      throw py::value_error(
          fmt::format("{}: segment [{}, {}, {}, {}]: need doc >= 0, offset >= 0, length >= 1 and "
                      "offset + length <= {}",
                      what, s.doc, s.offset, s.length, s.arrival_step, data::kMaxDocTokens));
    if (s.q_offset < 0 || s.q_offset > s.offset)
      throw py::value_error(
          fmt::format("{}: segment [{}, {}, {}, {}, {}]: need 0 <= q_offset <= offset (the keys "
                      "of its document before the slice)",
                      what, s.doc, s.offset, s.length, s.arrival_step, s.q_offset));
  }
  return out;
}

model::Phase phaseOf(const std::string& p) {
  if (p == "fwd") return model::Phase::Fwd;
  if (p == "bwd") return model::Phase::Bwd;
  throw py::value_error("phase: expected 'fwd' or 'bwd', got '" + p + "'");
}

// ---- Deck ------------------------------------------------------------------------------

/// A TOML literal for one `--set` value given as a Python object.
std::string tomlLiteral(py::handle v, const std::string& key) {
  if (py::isinstance<py::bool_>(v)) return v.cast<bool>() ? "true" : "false";
  if (py::isinstance<py::int_>(v)) {
    const std::string s = py::str(v).cast<std::string>();
    try {
      (void)v.cast<std::int64_t>();
    } catch (const py::cast_error&) {  // TOML would clamp it and the error would quote another number
      throw py::value_error(fmt::format("--set {}: {} is not a 64-bit integer", key, s));
    }
    return s;
  }
  if (py::isinstance<py::float_>(v)) {
    const double d = v.cast<double>();
    if (std::isnan(d)) return "nan";
    if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
    std::string s = py::repr(v).cast<std::string>();
    return s;
  }
  if (py::isinstance<py::str>(v)) return json(v.cast<std::string>()).dump();  // JSON escapes are TOML escapes
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    std::string s = "[";
    for (auto e : v) s += (s.size() > 1 ? ", " : "") + tomlLiteral(e, key);
    return s + "]";
  }
  if (py::hasattr(v, "tolist")) return tomlLiteral(v.attr("tolist")(), key);
  throw py::value_error(fmt::format("--set {}: cannot write a {} as a TOML value", key,
                                    py::str(v.get_type().attr("__name__")).cast<std::string>()));
}

/// overrides: None, a dict {"table.key": value}, or a list of "table.key=value" strings.
std::vector<std::string> overridesFrom(py::object o) {
  std::vector<std::string> out;
  if (o.is_none()) return out;
  if (py::isinstance<py::dict>(o)) {
    for (auto kv : o.cast<py::dict>()) {
      const auto key = py::str(kv.first).cast<std::string>();
      out.push_back(key + "=" + tomlLiteral(kv.second, key));
    }
    return out;
  }
  if (py::isinstance<py::str>(o)) return {o.cast<std::string>()};
  for (auto e : o) {
    if (!py::isinstance<py::str>(e)) throw py::value_error("overrides: a list must hold 'table.key=value' strings");
    out.push_back(e.cast<std::string>());
  }
  return out;
}

struct PyDeck {
  wlb::Deck deck;
  // The TOML read when the deck was made, and its name (a file's absolute path): overrides
  // and pickling re-parse this text, so a deck is what was read, whatever the working
  // directory or the file holds later (a DataLoader worker gets the parent's deck).
  std::string text, name;
  std::vector<std::string> overrides;

  static std::shared_ptr<PyDeck> load(std::optional<std::string> path, std::vector<std::string> ov) {
    if (!path) return parse("", "defaults", std::move(ov), "wlb.Deck");
    // absolute: the deck's relative paths (data.path, a profile) resolve against its folder
    // now, not against a working directory changed later
    std::error_code ec;
    const std::string abs = std::filesystem::absolute(*path, ec).string();
    const std::string file = ec ? *path : abs;
    return parse(wlb::readDeckText(file, *path), file, std::move(ov), "wlb.Deck");
  }
  static std::shared_ptr<PyDeck> fromText(const std::string& text, const std::string& name,
                                          std::vector<std::string> ov) {
    return parse(text, name, std::move(ov), "wlb.Deck.from_toml");
  }
  static std::shared_ptr<PyDeck> parse(const std::string& text, const std::string& name, std::vector<std::string> ov,
                                       const std::string& command) {
    auto d = std::make_shared<PyDeck>();
    d->text = text;
    d->name = name;
    d->overrides = std::move(ov);
    d->deck = wlb::parseDeck(text, name, d->overrides);
    // one case: a sweep's base deck is no case of it (overrides pin the swept keys)
    wlb::requireOneCase(d->deck, name, command);
    return d;
  }
  std::shared_ptr<PyDeck> withOverrides(const std::vector<std::string>& more) const {
    auto ov = overrides;
    ov.insert(ov.end(), more.begin(), more.end());
    return parse(text, name, ov, "wlb.Deck");
  }
};

const wlb::KeySpec& keySpec(const std::string& key) {
  std::vector<std::string> names;
  for (const auto& k : wlb::deckSchema()) {
    if (k.name() == key) return k;
    names.push_back(k.name());
  }
  throw py::key_error(fmt::format("unknown deck key '{}' (did you mean '{}'?)", key, wlb::nearest(key, names)));
}

py::object deckValue(wlb::Deck& d, const wlb::KeySpec& k) {
  void* p = k.ptr(d);
  switch (k.kind) {
    case wlb::Kind::Int:
      return py::int_(*static_cast<std::int64_t*>(p));
    case wlb::Kind::UInt:
      return py::int_(*static_cast<std::uint64_t*>(p));
    case wlb::Kind::Float:
      return py::float_(*static_cast<double*>(p));
    case wlb::Kind::String:
      return py::str(*static_cast<std::string*>(p));
    case wlb::Kind::IntList:
      return py::cast(*static_cast<std::vector<std::int64_t>*>(p));
    case wlb::Kind::StringList:
      return py::cast(*static_cast<std::vector<std::string>*>(p));
  }
  return py::none();
}

// ---- Cost model ------------------------------------------------------------------------

using CostPtr = std::shared_ptr<model::CostModel>;

/// The cost model with the deck it was made from: pickling (DataLoader workers) sends
/// the deck and rebuilds the model.
struct PyCost {
  CostPtr cost;
  std::shared_ptr<PyDeck> deck;
  static std::shared_ptr<PyCost> fromDeck(std::shared_ptr<PyDeck> d) {
    return std::make_shared<PyCost>(
        PyCost{std::make_shared<model::CostModel>(model::CostModel::fromDeck(d->deck)), std::move(d)});
  }
};
using PyCostPtr = std::shared_ptr<PyCost>;

PyCostPtr costFor(std::shared_ptr<PyDeck> d, const std::optional<PyCostPtr>& cost) {
  if (cost && *cost) return *cost;
  return PyCost::fromDeck(std::move(d));
}

CostPtr innerCost(const std::optional<PyCostPtr>& cost) {
  return cost && *cost ? (*cost)->cost : nullptr;
}

// ---- Length sources --------------------------------------------------------------------

/// A token count the cost model is asked about: 0 .. the longest document a source holds
/// (a negative count gave negative seconds, 2^62 kept the tile loop busy for hours).
std::int64_t tokensArg(std::int64_t v, const char* what) {
  if (v < 0 || v > data::kMaxDocTokens)
    throw py::value_error(fmt::format("{} = {}: expected a token count in [0, {}]", what, v, data::kMaxDocTokens));
  return v;
}

std::vector<std::int64_t> lengthsFrom(const I64Array& a) {
  if (a.ndim() != 1) throw py::value_error("lengths: expected a 1-D array of document lengths");
  std::vector<std::int64_t> v(a.data(), a.data() + a.shape(0));
  if (v.empty()) throw py::value_error("lengths: no document lengths given");
  for (std::size_t i = 0; i < v.size(); ++i)
    if (v[i] < 1 || v[i] > data::kMaxDocTokens)
      throw py::value_error(
          fmt::format("lengths[{}] = {}: expected a positive integer <= {}", i, v[i], data::kMaxDocTokens));
  return v;
}

std::unique_ptr<data::LengthSource> makeSource(const wlb::Deck& deck, const std::optional<I64Array>& lengths,
                                               const std::optional<std::string>& name) {
  if (!lengths) return data::makeLengthSource(deck);
  auto v = lengthsFrom(*lengths);
  const std::string desc = name ? *name : fmt::format("array:{} documents", v.size());
  return data::makeArraySource(std::move(v), desc, deck.mesh.dp * data::microBatchesPerReplica(deck),
                               deck.data.context_window);
}

struct PyDocuments {
  std::vector<wlb::Document> docs;
};

struct PySource {
  std::unique_ptr<data::LengthSource> src;
};

// ---- Plans -----------------------------------------------------------------------------

struct PyPlan {
  wlb::StepPlan plan;
  std::int64_t incoming = 0;
  double plan_us = 0;
  json solver;
  std::vector<wlb::Document> docs;  // the step's incoming documents (plans from pack*)
  CostPtr cost;                     // null for a plan read from JSON without a cost model
  mutable std::optional<packing::StepMetrics> metrics;
  std::optional<json> stored_metrics;  // a plan read from JSON: its metrics as written

  bool hasMetrics() const { return cost || stored_metrics; }
  /// Any SlimPack slice in the plan: then every segment array of it has the q_offset column.
  bool sliced() const {
    for (const auto& r : plan.replicas)
      for (const auto& mb : r)
        for (const auto& sg : mb.segments)
          if (sg.q_offset != 0) return true;
    return false;
  }
  json metricsJson() const { return cost || !stored_metrics ? packing::toJson(stepMetrics()) : *stored_metrics; }
  json toJson() const {
    auto j = packing::stepToJson(plan, packing::StepMetrics{}, incoming);
    if (hasMetrics())
      j["metrics"] = metricsJson();
    else
      j.erase("metrics");
    return j;
  }

  std::int64_t dp() const { return static_cast<std::int64_t>(plan.replicas.size()); }
  std::int64_t microBatches() const { return plan.replicas.empty() ? 0 : plan.replicas[0].size(); }
  const packing::StepMetrics& stepMetrics() const {
    if (!metrics) {
      if (!cost) throw py::value_error("plan: no cost model attached; use wlb.compute_metrics(plan, cost)");
      auto m = packing::computeMetrics(plan, *cost);
      m.plan_us = plan_us;
      m.solver = solver;
      metrics = std::move(m);
    }
    return *metrics;
  }
  const wlb::MicroBatch& mb(std::int64_t r, std::int64_t m) const {
    if (r < 0 || r >= dp() || m < 0 || m >= microBatches())
      throw py::index_error(
          fmt::format("micro-batch ({}, {}) out of range: dp = {}, micro_batches = {}", r, m, dp(), microBatches()));
    return plan.replicas[r][m];
  }
};

// A plan with the step line's `incoming` and `metrics` (what the file recorded beside it).
std::unique_ptr<PyPlan> planOf(wlb::StepPlan plan, std::int64_t incoming, const json& metrics, CostPtr cost) {
  auto p = std::make_unique<PyPlan>();
  p->plan = std::move(plan);
  p->incoming = incoming;
  if (!p->plan.replicas.empty()) {
    const auto M = p->plan.replicas[0].size();
    for (const auto& r : p->plan.replicas)
      if (r.size() != M) throw wlb::InputError("plan: replicas hold different numbers of micro-batches");
  }
  if (metrics.is_object()) {
    p->plan_us = metrics.value("plan_us", 0.0);
    if (metrics.contains("solver")) p->solver = metrics["solver"];
    p->stored_metrics = metrics;
  }
  p->cost = std::move(cost);
  return p;
}

std::unique_ptr<PyPlan> planFromJsonValue(const json& j, CostPtr cost) {
  if (!j.is_object()) throw wlb::InputError("plan: a step line must be a JSON object");
  try {
    return planOf(packing::stepFromJson(j), j.value("incoming", std::int64_t{0}),
                  j.contains("metrics") ? j["metrics"] : json(), std::move(cost));
  } catch (const json::exception& e) {  // a missing or mistyped field
    throw wlb::InputError(std::string("plan: ") + e.what());
  }
}

/// A step line as `wlb plan --out` writes it (str or bytes), or the dict `to_json()` returns.
std::unique_ptr<PyPlan> planFromJson(py::object o, std::optional<PyCostPtr> cost) {
  if (py::isinstance<py::str>(o) || py::isinstance<py::bytes>(o)) {
    json j;
    try {
      j = json::parse(o.cast<std::string>());
    } catch (const json::exception& e) {
      throw wlb::InputError(std::string("plan: the step line is not JSON: ") + e.what());
    }
    return planFromJsonValue(j, innerCost(cost));
  }
  return planFromJsonValue(fromPy(o, "plan"), innerCost(cost));
}

// ---- Packers ---------------------------------------------------------------------------

/// A packer with its own length source and cost model; checkpoints are the CLI's
/// `wlb plan --save-state` format (wlb-plan-state holding this packer's wlb-packer-state).
struct PyPacker {
  std::shared_ptr<PyDeck> deck;
  PyCostPtr pycost;
  CostPtr cost;
  std::optional<I64Array> lengths;
  std::optional<std::string> source_name;
  std::unique_ptr<data::LengthSource> src;
  std::unique_ptr<packing::Packer> packer;

  std::int64_t capacity() const {
    idle("capacity");
    return packing::capacity(*packer);
  }

  /// The last step packed since construction or restore: steps must increase, whether the
  /// documents come from the packer's source (pack) or from elsewhere (pack_documents), so
  /// that mixing the two can neither repeat a step nor go back.
  std::optional<std::int64_t> last_step;

  /// pack() lets go of the GIL while it packs; a call from another thread then (above all
  /// load_state_dict, which replaces the packer) is refused rather than let run under it.
  /// Every method checks it while it holds the GIL, so a flag is enough.
  bool in_pack = false;
  void idle(const char* what) const {
    if (in_pack)
      throw std::runtime_error(fmt::format(
          "Packer.{}: the Packer is packing in another thread (a Packer serves one thread at a time)", what));
  }

  std::unique_ptr<PyPlan> packDocs(std::int64_t step, const std::vector<wlb::Document>* given) {
    const char* what = given ? "pack_documents" : "pack";
    idle(what);
    if (last_step && step <= *last_step)
      throw py::value_error(fmt::format(
          "{}: step {} after step {}: steps must increase (a Packer takes each step's documents from its length "
          "source, pack(), or from pack_documents(); mixing the two must keep the steps increasing)",
          what, step, *last_step));
    if (given) {
      for (const auto& d : *given)
        if (d.arrival_step > step)
          throw py::value_error(
              fmt::format("pack_documents: document {} arrives at step {}, after step {}", d.id, d.arrival_step, step));
      // A document the packer still holds (a queue, carry-over, the window) given again would
      // be planned twice, in one plan even. Ids it has planned completely are the caller's
      // to not repeat (it keeps no history: a sampler's epoch may well revisit them).
      std::unordered_set<wlb::DocId> held;
      for (const auto& seg : packer->heldSegments()) held.insert(seg.doc);
      for (const auto& d : *given)
        if (held.count(d.id))
          throw py::value_error(fmt::format(
              "pack_documents: document {} is still held by the packer (given at an earlier step, not yet fully "
              "planned): giving it again would plan its tokens twice",
              d.id));
    }
    auto out = std::make_unique<PyPlan>();
    in_pack = true;
    struct Done {  // cleared with the GIL held again, whichever way this returns
      bool& flag;
      ~Done() { flag = false; }
    } done{in_pack};
    {
      py::gil_scoped_release nogil;
      std::vector<wlb::Document> drawn;
      if (!given) drawn = src->next(step);
      const auto& docs = given ? *given : drawn;
      const auto t0 = std::chrono::steady_clock::now();
      out->plan = packer->pack(step, docs);
      const auto t1 = std::chrono::steady_clock::now();
      out->plan_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
      out->incoming = static_cast<std::int64_t>(docs.size());
      out->solver = packer->lastSolverInfo();
      if (given)
        out->docs = *given;
      else
        out->docs = std::move(drawn);  // the plan is made: `docs` is not read again
    }
    out->cost = cost;
    last_step = step;
    return out;
  }

  json checkpoint() const {
    idle("checkpoint");
    return {{"format", "wlb-plan-state"},
            {"version", 1},
            {"packers", {{packer->name(), packing::saveCheckpoint(*src, *packer)}}}};
  }

  /// Accepts the CLI's wlb-plan-state (any number of packers) or one wlb-packer-state.
  /// Transactional: on error the packer keeps its state.
  void restore(const json& j, const std::string& what) {
    idle("load_state_dict");
    const json* state = &j;
    const std::string name = packer->name();
    if (!j.is_object() || (j.value("format", "") != "wlb-plan-state" && j.value("format", "") != "wlb-packer-state"))
      throw wlb::InputError(fmt::format("{}: not a wlb-plan-state file", what), true);
    if (j.value("format", "") == "wlb-plan-state") {
      if (!j.contains("packers") || !j["packers"].is_object() || !j["packers"].contains(name))
        throw wlb::InputError(fmt::format("{}: no state for packer '{}'", what, name), true);
      state = &j["packers"][name];
    }
    auto s = makeSource(deck->deck, lengths, source_name);
    auto p = packing::makePacker(name, deck->deck, *cost);
    packing::loadCheckpoint(*state, *s, *p, what);
    last_step.reset();
    src = std::move(s);
    packer = std::move(p);
  }

  json header() const {
    idle("header");
    packing::PlanHeader h;
    h.packer = packer->name();
    h.dp = packer->options().dp;
    h.micro_batches = packer->options().micro_batches;
    h.context_window = packer->options().context_window;
    h.s_max = packer->options().s_max;
    h.source = src->describe();
    h.documents_per_epoch = src->documentsPerEpoch();
    h.seed = deck->deck.data.seed;
    h.first_step = src->nextStep();
    return packing::toJson(h);
  }
};

struct PyCheckpoint {
  json state;
};

json stateFrom(py::object o, const std::string& what) {
  if (py::isinstance<PyCheckpoint>(o)) return o.cast<const PyCheckpoint&>().state;
  return fromPy(o, what);
}

// ---- CP shard planner ------------------------------------------------------------------

/// A CP rank argument: IndexError outside [0, cp).
int cpRankChecked(std::int64_t r, int cp) {
  if (r < 0 || r >= cp) throw py::index_error(fmt::format("CP rank {} out of range [0, {})", r, cp));
  return static_cast<int>(r);
}

/// A CP degree argument, in the range of the deck's mesh.cp.
int cpDegreeChecked(std::int64_t cp, const char* what) {
  constexpr std::int64_t kMaxCp = std::int64_t{1} << 16;
  if (cp < 1) throw py::value_error(fmt::format("{}: CP degree must be >= 1 (got {})", what, cp));
  if (cp > kMaxCp)
    throw py::value_error(fmt::format("{}: CP degree must be <= {}, mesh.cp's limit (got {})", what, kMaxCp, cp));
  return static_cast<int>(cp);
}

struct PyCommPlan {
  cp::CommPlan comm;
};

struct PyShardPlan {
  wlb::MicroBatch mb;
  cp::ShardPlan plan;
  std::shared_ptr<PyCommPlan> comm;
  CostPtr cost;
  mutable std::optional<json> metrics;

  int rankChecked(std::int64_t r) const { return cpRankChecked(r, plan.cp); }
};

struct PyShardPlanner {
  PyCostPtr pycost;
  CostPtr cost;
  wlb::CpConfig cfg;
  cp::Strategy strategy = cp::Strategy::Adaptive;
  cp::CommMode comm = cp::CommMode::AllGather;
  int cp = 1;

  static PyShardPlanner make(PyCostPtr cost, wlb::CpConfig cfg, const std::string& strategy, const std::string& comm,
                             std::int64_t cp_degree) {
    PyShardPlanner p;
    p.pycost = std::move(cost);
    p.cost = p.pycost->cost;
    p.cfg = std::move(cfg);
    p.strategy = cp::parseStrategy(strategy);
    p.comm = cp::parseCommMode(comm);
    p.cfg.strategy = cp::strategyName(p.strategy);
    p.cfg.comm = cp::commModeName(p.comm);
    p.cp = cpDegreeChecked(cp_degree, "cp");
    return p;
  }

  std::shared_ptr<PyShardPlan> plan(const std::vector<wlb::Segment>& segs) const {
    auto out = std::make_shared<PyShardPlan>();
    out->mb.segments = segs;
    out->cost = cost;
    out->comm = std::make_shared<PyCommPlan>();
    {
      py::gil_scoped_release nogil;
      out->plan = cp::planShards(out->mb, strategy, cp, *cost, cfg);
      out->comm->comm = cp::planComm(out->plan, comm, *cost);
    }
    return out;
  }
};

// Pickling a shard plan (a DataLoader worker hands its batch to the trainer) goes through
// the JSON of docs/cp.md; these read it back.
cp::ShardPlan shardPlanFromJson(const json& j, const wlb::MicroBatch& mb) {
  cp::ShardPlan p;
  p.strategy = j.at("strategy").get<std::string>();
  p.requested = j.at("requested").get<std::string>();
  p.cp = j.at("cp").get<int>();
  p.total_tokens = j.at("total_tokens").get<std::int64_t>();
  p.sharded_segments = j.at("sharded_segments").get<std::int32_t>();
  std::int64_t begin = 0;
  for (const auto& s : mb.segments) {
    p.seg_begin.push_back(begin);
    p.seg_len.push_back(s.length);
    begin += s.length;
  }
  p.owner.assign(static_cast<std::size_t>(p.total_tokens), 0);
  p.local_index.assign(static_cast<std::size_t>(p.total_tokens), 0);
  int rank = 0;
  for (const auto& rj : j.at("ranks")) {
    cp::RankShard r;
    r.tokens = rj.at("tokens").get<std::int64_t>();
    r.kv_tokens = rj.at("kv_tokens").get<std::int64_t>();
    for (const auto& q : rj.at("pieces")) {
      cp::Piece c;
      c.segment = q.at("segment").get<std::int32_t>();
      c.doc = q.at("doc").get<wlb::DocId>();
      c.seg_begin = q.at("seg_begin").get<std::int64_t>();
      c.seg_len = q.at("seg_len").get<std::int64_t>();
      c.q_offset = q.at("q_offset").get<std::int64_t>();
      c.q_len = q.at("q_len").get<std::int64_t>();
      c.seg_prefix = q.value("seg_prefix", std::int64_t{0});  // a slice's keys before its segment
      c.local_begin = q.at("local_begin").get<std::int64_t>();
      c.kv_begin = q.at("kv_begin").get<std::int64_t>();
      c.kv_len = q.at("kv_len").get<std::int64_t>();
      c.whole = q.at("whole").get<bool>();
      for (std::int64_t i = 0; i < c.q_len; ++i) {
        p.owner[static_cast<std::size_t>(c.packedBegin() + i)] = rank;
        p.local_index[static_cast<std::size_t>(c.packedBegin() + i)] = c.local_begin + i;
      }
      r.pieces.push_back(c);
    }
    for (const auto& b : rj.at("kv_blocks"))
      r.kv_blocks.push_back({b.at(0).get<std::int32_t>(), b.at(1).get<std::int64_t>(), b.at(2).get<std::int64_t>(),
                             b.at(3).get<std::int64_t>()});
    for (const auto& k : rj.at("kv_runs"))
      r.kv_runs.push_back(
          {k.at(0).get<int>(), k.at(1).get<std::int64_t>(), k.at(2).get<std::int64_t>(), k.at(3).get<std::int64_t>()});
    p.ranks.push_back(std::move(r));
    ++rank;
  }
  return p;
}

cp::CommPlan commPlanFromJson(const json& j) {
  cp::CommPlan c;
  c.mode = cp::parseCommMode(j.at("mode").get<std::string>());
  c.cp = j.at("cp").get<int>();
  c.gather_counts = j.at("gather_counts").get<std::vector<std::int64_t>>();
  c.gather_displs = j.at("gather_displs").get<std::vector<std::int64_t>>();
  for (const auto& tj : j.at("transfers")) {
    cp::Transfer t;
    t.src = tj.at("src").get<int>();
    t.dst = tj.at("dst").get<int>();
    t.tokens = tj.at("tokens").get<std::int64_t>();
    for (const auto& k : tj.at("runs"))
      t.runs.push_back({t.src, k.at(0).get<std::int64_t>(), k.at(1).get<std::int64_t>(), k.at(2).get<std::int64_t>()});
    c.transfers.push_back(std::move(t));
  }
  for (const auto& rj : j.at("ranks")) {
    cp::RankComm r;
    r.fwd_bytes_sent = rj.at("fwd_bytes_sent").get<double>();
    r.fwd_bytes_recv = rj.at("fwd_bytes_recv").get<double>();
    r.bwd_bytes_sent = rj.at("bwd_bytes_sent").get<double>();
    r.bwd_bytes_recv = rj.at("bwd_bytes_recv").get<double>();
    r.fwd_tokens_recv = rj.at("fwd_tokens_recv").get<std::int64_t>();
    r.peers = rj.at("peers").get<int>();
    r.out_peers = rj.value("out_peers", 0);  // absent in plans from before it was written
    r.fwd_seconds = rj.at("fwd_seconds").get<double>();
    r.bwd_seconds = rj.at("bwd_seconds").get<double>();
    c.ranks.push_back(r);
  }
  return c;
}

json shardMetricsJson(const PyShardPlan& s) {
  if (!s.metrics) {
    if (!s.cost) throw py::value_error("shard plan: no cost model attached");
    s.metrics = cp::toJson(cp::computeMetrics(s.plan, s.comm->comm, *s.cost));
  }
  return *s.metrics;
}

py::dict piecesOf(const cp::RankShard& r) {
  const auto n = static_cast<py::ssize_t>(r.pieces.size());
  I64Array segment(n), doc(n), seg_begin(n), seg_len(n), q_offset(n), q_len(n), local_begin(n), kv_begin(n), kv_len(n);
  py::array_t<bool> whole(n);
  for (py::ssize_t i = 0; i < n; ++i) {
    const auto& p = r.pieces[static_cast<std::size_t>(i)];
    segment.mutable_data()[i] = p.segment;
    doc.mutable_data()[i] = p.doc;
    seg_begin.mutable_data()[i] = p.seg_begin;
    seg_len.mutable_data()[i] = p.seg_len;
    q_offset.mutable_data()[i] = p.q_offset;
    q_len.mutable_data()[i] = p.q_len;
    local_begin.mutable_data()[i] = p.local_begin;
    kv_begin.mutable_data()[i] = p.kv_begin;
    kv_len.mutable_data()[i] = p.kv_len;
    whole.mutable_data()[i] = p.whole;
  }
  py::dict d;
  d["segment"] = segment;
  d["doc"] = doc;
  d["seg_begin"] = seg_begin;
  d["seg_len"] = seg_len;
  d["q_offset"] = q_offset;
  d["q_len"] = q_len;
  d["local_begin"] = local_begin;
  d["kv_begin"] = kv_begin;
  d["kv_len"] = kv_len;
  d["whole"] = whole;
  return d;
}

I64Array runsArray(const std::vector<cp::KvRun>& runs, bool with_src) {
  const py::ssize_t w = with_src ? 4 : 3;
  I64Array a({static_cast<py::ssize_t>(runs.size()), w});
  auto* p = a.mutable_data();
  for (const auto& r : runs) {
    if (with_src) *p++ = r.src;
    *p++ = r.src_local_begin;
    *p++ = r.len;
    *p++ = r.kv_begin;
  }
  return a;
}

// ---- Metrics ---------------------------------------------------------------------------

struct PyChecker {
  packing::ConservationChecker checker;
  explicit PyChecker(std::int64_t cap) : checker(cap) {}
};

}  // namespace

PYBIND11_MODULE(_wlb, m) {
  m.doc() = "wlb planners (docs/python.md): decks, length sources, cost model, packers, CP shard planner, metrics";

  // InputError is bad input: the CLI exits 2 with this message, Python raises ValueError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const wlb::InputError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  // ---- Deck ----
  py::class_<PyDeck, std::shared_ptr<PyDeck>>(m, "Deck", R"(A validated input deck (docs/decks.md).

Deck(path=None, overrides=None): the TOML deck at `path` (None: the built-in defaults) with
`overrides` applied like the CLI's --set: a dict {"table.key": value} (Python values become
TOML literals) or a list of "table.key=value" strings (TOML values, exactly as on the
command line).)")
      .def(py::init([](py::object path, py::object overrides) {
             // a str or any os.PathLike (pathlib.Path)
             std::optional<std::string> p;
             if (!path.is_none()) p = py::module_::import("os").attr("fspath")(path).cast<std::string>();
             return PyDeck::load(std::move(p), overridesFrom(std::move(overrides)));
           }),
           py::arg("path") = py::none(), py::arg("overrides") = py::none())
      .def_static(
          "from_toml",
          [](const std::string& text, const std::string& name, py::object overrides) {
            return PyDeck::fromText(text, name, overridesFrom(std::move(overrides)));
          },
          py::arg("text"), py::arg("name") = "deck", py::arg("overrides") = py::none(),
          "A deck from TOML text (`name` is used in error messages and to resolve relative paths).")
      .def(py::pickle(
          // the text as read: a worker unpickles the parent's deck, even after the file changed
          [](const PyDeck& d) { return py::make_tuple(d.text, d.name, d.overrides); },
          [](py::tuple t) {
            if (t.size() != 3) throw py::value_error("wlb.Deck: not a pickled deck of this version");
            return PyDeck::parse(t[0].cast<std::string>(), t[1].cast<std::string>(),
                                 t[2].cast<std::vector<std::string>>(), "wlb.Deck");
          }))
      .def(
          "with_overrides",
          [](const PyDeck& d, py::object overrides) { return d.withOverrides(overridesFrom(std::move(overrides))); },
          py::arg("overrides"), "A new deck: this deck's source and overrides followed by `overrides`.")
      .def(
          "__getitem__", [](PyDeck& d, const std::string& key) { return deckValue(d.deck, keySpec(key)); },
          py::arg("key"), "The resolved value of a key, e.g. deck['data.context_window'].")
      .def("keys",
           [](const PyDeck&) {
             std::vector<std::string> v;
             for (const auto& k : wlb::deckSchema()) v.push_back(k.name());
             return v;
           })
      .def("to_dict",
           [](PyDeck& d) {
             py::dict out;
             for (const auto& k : wlb::deckSchema()) out[py::str(k.name())] = deckValue(d.deck, k);
             return out;
           })
      .def(
          "to_toml", [](const PyDeck& d) { return d.deck.toToml(); },
          "The deck as TOML, every key (an s_max or micro_batches left to derive as 0 with its resolved value in a "
          "comment): "
          "it reads back as the same deck.")
      .def_property_readonly("path", [](const PyDeck& d) { return d.deck.source_path; })
      .def_property_readonly("overrides", [](const PyDeck& d) { return d.overrides; })
      .def_property_readonly("dp", [](const PyDeck& d) { return d.deck.mesh.dp; })
      .def_property_readonly("cp", [](const PyDeck& d) { return d.deck.mesh.cp; })
      .def_property_readonly("pp", [](const PyDeck& d) { return d.deck.mesh.pp; })
      .def_property_readonly("tp", [](const PyDeck& d) { return d.deck.mesh.tp; })
      .def_property_readonly(
          "micro_batches", [](const PyDeck& d) { return data::microBatchesPerReplica(d.deck); },
          "M per DP replica (packing.micro_batches, or mesh.pp when 0).")
      .def_property_readonly("context_window", [](const PyDeck& d) { return d.deck.data.context_window; })
      .def_property_readonly(
          "s_max", [](const PyDeck& d) { return std::max(data::resolvedSMax(d.deck), d.deck.data.context_window); })
      .def_property_readonly("seed", [](const PyDeck& d) { return d.deck.data.seed; })
      .def_property_readonly("packer", [](const PyDeck& d) { return d.deck.packing.strategy; })
      .def_property_readonly("sharding", [](const PyDeck& d) { return d.deck.cp.strategy; })
      .def_property_readonly("comm", [](const PyDeck& d) { return d.deck.cp.comm; })
      .def("__repr__", [](const PyDeck& d) { return fmt::format("<wlb.Deck {}>", d.deck.source_path); });

  // ---- Cost model ----
  py::class_<PyCost, PyCostPtr>(m, "CostModel", R"(The one cost model (docs/architecture.md).

CostModel(deck): model dims, TP degree and [hardware] profile of the deck.
CostModel.from_profile(path, deck=None): the same with the profile JSON at `path`.)")
      .def(py::init([](std::shared_ptr<PyDeck> d) { return PyCost::fromDeck(std::move(d)); }),
           py::arg("deck").none(false))
      .def_static(
          "from_profile",
          [](const std::string& path, std::optional<std::shared_ptr<PyDeck>> deck) {
            auto base = deck && *deck ? *deck : PyDeck::load(std::nullopt, {});
            // a path the caller gives is relative to the working directory
            std::error_code ec;
            const auto abs = std::filesystem::absolute(path, ec);
            return PyCost::fromDeck(base->withOverrides({"hardware.profile=" + json(ec ? path : abs.string()).dump()}));
          },
          py::arg("path"), py::arg("deck") = py::none())
      .def(py::pickle([](const PyCost& c) { return py::make_tuple(c.deck); },
                      [](py::tuple t) { return PyCost::fromDeck(t[0].cast<std::shared_ptr<PyDeck>>()); }))
      .def_property_readonly("deck", [](const PyCost& c) { return c.deck; })
      .def_property_readonly("profile", [](const PyCost& c) { return c.cost->hardware().name; })
      .def_property_readonly("tp", [](const PyCost& c) { return c.cost->tp(); })
      .def_property_readonly("linear_table_used", [](const PyCost& c) { return c.cost->linearTableUsed(); })
      .def(
          "segment_work", [](const PyCost& c, Int len) { return c.cost->segmentWork(tokensArg(len, "length")); },
          py::arg("length"), "W(d): fwd+bwd seconds of one layer for a segment of `length` tokens (the packers' W).")
      .def(
          "segment_work",
          [](const PyCost& c, const Ints& lens) {
            if (lens.ndim() != 1) throw py::value_error("lengths: expected a 1-D array of segment lengths");
            py::array_t<double> out(lens.size());
            for (py::ssize_t i = 0; i < lens.size(); ++i)
              out.mutable_data()[i] = c.cost->segmentWork(tokensArg(lens.data()[i], "lengths[i]"));
            return out;
          },
          py::arg("lengths"))
      .def(
          "attn_seconds",
          [](const PyCost& c, Int q0, Int q, const std::string& phase) {
            return c.cost->attnSeconds(tokensArg(q0, "q0"), tokensArg(q, "q"), phaseOf(phase));
          },
          py::arg("q0"), py::arg("q"), py::arg("phase") = "fwd")
      .def(
          "attn_flops",
          [](const PyCost& c, Int q0, Int q, const std::string& phase) {
            return c.cost->attnFlops(tokensArg(q0, "q0"), tokensArg(q, "q"), phaseOf(phase));
          },
          py::arg("q0"), py::arg("q"), py::arg("phase") = "fwd")
      .def(
          "linear_seconds",
          [](const PyCost& c, Int tokens, const std::string& phase) {
            return c.cost->linearSeconds(tokensArg(tokens, "tokens"), phaseOf(phase));
          },
          py::arg("tokens"), py::arg("phase") = "fwd")
      .def(
          "linear_flops",
          [](const PyCost& c, Int tokens, const std::string& phase) {
            return c.cost->linearFlops(tokensArg(tokens, "tokens"), phaseOf(phase));
          },
          py::arg("tokens"), py::arg("phase") = "fwd")
      .def(
          "kv_bytes", [](const PyCost& c, Int t) { return c.cost->kvBytes(tokensArg(t, "tokens")); },
          py::arg("tokens"));

  // ---- Length sources ----
  py::class_<PyDocuments>(m, "Documents", "The documents of one global batch (ids, lengths, arrival steps).")
      .def(py::init([](const Ints& ids, const Ints& lengths, const Ints& arrival) {
             if (ids.ndim() != 1 || lengths.ndim() != 1 || arrival.ndim() != 1 || ids.size() != lengths.size() ||
                 ids.size() != arrival.size())
               throw py::value_error("Documents: ids, lengths and arrival_steps must be 1-D and of equal length");
             PyDocuments d;
             std::unordered_set<std::int64_t> seen;
             for (py::ssize_t i = 0; i < ids.size(); ++i) {
               const std::int64_t id = ids.data()[i], len = lengths.data()[i], at = arrival.data()[i];
               if (len < 1 || len > data::kMaxDocTokens)
                 throw py::value_error(
                     fmt::format("Documents: lengths[{}] = {} is not in [1, {}]", i, len, data::kMaxDocTokens));
               if (id < 0 || at < 0)
                 throw py::value_error(
                     fmt::format("Documents: ids[{}] = {} and arrival_steps[{}] = {} must be >= 0", i, id, i, at));
               if (!seen.insert(id).second) throw py::value_error(fmt::format("Documents: id {} is given twice", id));
               d.docs.push_back({id, len, at});
             }
             return d;
           }),
           py::arg("ids"), py::arg("lengths"), py::arg("arrival_steps"))
      .def("__len__", [](const PyDocuments& d) { return d.docs.size(); })
      .def_property_readonly("ids",
                             [](const PyDocuments& d) {
                               I64Array a(static_cast<py::ssize_t>(d.docs.size()));
                               for (std::size_t i = 0; i < d.docs.size(); ++i) a.mutable_data()[i] = d.docs[i].id;
                               return a;
                             })
      .def_property_readonly("lengths",
                             [](const PyDocuments& d) {
                               I64Array a(static_cast<py::ssize_t>(d.docs.size()));
                               for (std::size_t i = 0; i < d.docs.size(); ++i) a.mutable_data()[i] = d.docs[i].length;
                               return a;
                             })
      .def_property_readonly("arrival_steps", [](const PyDocuments& d) {
        I64Array a(static_cast<py::ssize_t>(d.docs.size()));
        for (std::size_t i = 0; i < d.docs.size(); ++i) a.mutable_data()[i] = d.docs[i].arrival_step;
        return a;
      });

  py::class_<PySource>(m, "LengthSource", R"(The documents of each global batch (docs/data.md).

LengthSource(deck, lengths=None, name=None): the deck's [data] source (generator preset,
text, JSONL or Megatron .idx), or, with `lengths`, an in-memory stream over those document
lengths with the file sources' batching and wrap-around (`name` is its description, which
a checkpoint records).)")
      .def(py::init([](const PyDeck& d, std::optional<Ints> lengths, std::optional<std::string> name) {
             return PySource{makeSource(d.deck, lengths, name)};
           }),
           py::arg("deck"), py::arg("lengths") = py::none(), py::arg("name") = py::none())
      .def(
          "next",
          [](PySource& s, std::optional<Int> step) {
            return PyDocuments{s.src->next(step ? *step : s.src->nextStep())};
          },
          py::arg("step") = py::none(), "Documents of `step` (default: the next step).")
      .def("state_dict", [](const PySource& s) { return toPy(s.src->saveState()); })
      .def(
          "load_state_dict", [](PySource& s, py::object o) { s.src->loadState(fromPy(o, "state_dict")); },
          py::arg("state"))
      .def_property_readonly("next_step", [](const PySource& s) { return s.src->nextStep(); })
      .def_property_readonly("documents_per_epoch", [](const PySource& s) { return s.src->documentsPerEpoch(); })
      .def_property_readonly("sequences_per_step", [](const PySource& s) { return s.src->sequencesPerStep(); })
      .def_property_readonly("context_window", [](const PySource& s) { return s.src->contextWindow(); })
      .def("describe", [](const PySource& s) { return s.src->describe(); });

  m.def(
      "read_text_lengths", [](const std::string& p) { return i64Vector(data::readTextLengths(p)); }, py::arg("path"),
      "Lengths of a text length file (one positive integer per line).");
  m.def(
      "read_jsonl_lengths",
      [](const std::string& p, const std::string& field) { return i64Vector(data::readJsonlLengths(p, field)); },
      py::arg("path"), py::arg("field") = "length");
  m.def(
      "read_megatron_idx",
      [](const std::string& p, bool allow_empty) { return i64Vector(data::readMegatronIdx(p, allow_empty)); },
      py::arg("path"), py::arg("allow_empty") = false,
      "Document lengths of a Megatron-LM MMIDIDX index (.idx); empty documents are skipped. An index without a "
      "non-empty document is refused unless allow_empty (a dataset's empty validation split).");
  m.def(
      "write_megatron_idx",
      [](const std::string& p, const Ints& lens) { data::writeMegatronIdx(p, lengthsFrom(lens)); }, py::arg("path"),
      py::arg("lengths"), "Write a .idx with one sequence per document (int32 tokens).");
  m.def("preset_names", &data::presetNames);
  m.def("packer_names", &packing::packerNames);
  m.def("sharding_names", []() { return wlb::shardingNames(); });

  // ---- Plans ----
  py::class_<PyPlan>(m, "Plan", R"(One step's packing plan (docs/plan-format.md).

`segments` is an (n, 4) int64 array [doc, offset, length, arrival_step] of every micro-batch
back to back, in replica-major order; micro-batch (r, m) is segments[offsets[r*M+m] :
offsets[r*M+m+1]] (also `micro_batch(r, m)`). Plans with SlimPack slices give (n, 5) arrays
(every array of such a plan):
a fifth column q_offset (= offset for a slice, which attends to its document's earlier
keys; 0 for a whole segment).)")
      .def_property_readonly("step", [](const PyPlan& p) { return p.plan.step; })
      .def_property_readonly("dp", &PyPlan::dp)
      .def_property_readonly("micro_batches", &PyPlan::microBatches)
      .def_property_readonly("incoming", [](const PyPlan& p) { return p.incoming; })
      .def_property_readonly(
          "plan_us", [](const PyPlan& p) { return p.plan_us; }, "Wall time of the packer's pack() call (µs).")
      .def_property_readonly("segments",
                             [](const PyPlan& p) {
                               std::vector<wlb::Segment> all;
                               for (const auto& r : p.plan.replicas)
                                 for (const auto& mb : r) all.insert(all.end(), mb.segments.begin(), mb.segments.end());
                               return segmentArray(all, p.sliced());
                             })
      .def_property_readonly("offsets",
                             [](const PyPlan& p) {
                               std::vector<std::int64_t> off{0};
                               for (const auto& r : p.plan.replicas)
                                 for (const auto& mb : r)
                                   off.push_back(off.back() + static_cast<std::int64_t>(mb.segments.size()));
                               return i64Vector(off);
                             })
      .def_property_readonly(
          "tokens",
          [](const PyPlan& p) {
            std::vector<std::int64_t> t;
            for (const auto& r : p.plan.replicas)
              for (const auto& mb : r) t.push_back(mb.tokens());
            return i64Vector(t);
          },
          "Tokens per micro-batch, replica-major (dp * M).")
      .def_property_readonly("delayed", [](const PyPlan& p) { return i64Vector(p.plan.delayed); })
      .def_property_readonly(
          "merged",
          [](const PyPlan& p) {
            py::list out;
            for (const auto& m : p.plan.merged) out.append(py::make_tuple(m.slot, i64Vector(m.group)));
            return out;
          },
          "SlimPack's DP-Merge units: [(slot, group replicas)], the owner first (docs/plan-format.md).")
      .def_property_readonly(
          "memory",
          [](const PyPlan& p) -> py::object {
            const auto& m = p.plan.memory;
            if (m.partition.empty()) return py::none();
            py::dict d;
            d["partition"] = m.partition;
            d["held"] = i64Vector(m.held);
            std::vector<double> gb;
            for (const auto b : m.peak_bytes) gb.push_back(b / 1e9);
            d["peak_gb"] = gb;
            d["budget_gb"] = m.budget_bytes / 1e9;
            return d;
          },
          "SlimPack: how the step fits the per-stage memory budget (the plan JSON's 'memory'); None otherwise.")
      .def_property_readonly(
          "documents", [](const PyPlan& p) { return PyDocuments{p.docs}; },
          "The documents that arrived at this step (empty for a plan read from JSON).")
      .def(
          "micro_batch", [](const PyPlan& p, Int r, Int mb) { return segmentArray(p.mb(r, mb).segments, p.sliced()); },
          py::arg("replica"), py::arg("index"))
      .def_property_readonly("replicas",
                             [](const PyPlan& p) {
                               py::list reps;
                               const bool wide = p.sliced();
                               for (const auto& r : p.plan.replicas) {
                                 py::list mbs;
                                 for (const auto& mb : r) mbs.append(segmentArray(mb.segments, wide));
                                 reps.append(mbs);
                               }
                               return reps;
                             })
      .def_property_readonly(
          "metrics", [](const PyPlan& p) { return toPy(p.metricsJson()); },
          "Per-step metrics (docs/packing.md): imbalance, delay, tokens, ...")
      .def(
          "to_json", [](const PyPlan& p) { return toPy(p.toJson()); }, "The step line of `wlb plan --out` as a dict.")
      .def(py::pickle(
          [](const PyPlan& p) {
            std::vector<std::int64_t> docs;
            for (const auto& d : p.docs) docs.insert(docs.end(), {d.id, d.length, d.arrival_step});
            return py::make_tuple(py::bytes(p.toJson().dump()), i64Vector(docs));
          },
          [](py::tuple t) {
            // without the cost model: the metrics travel as computed
            auto p = planFromJsonValue(json::parse(t[0].cast<std::string>()), nullptr);
            const auto docs = t[1].cast<I64Array>();
            for (py::ssize_t i = 0; i + 2 < docs.size(); i += 3)
              p->docs.push_back({docs.data()[i], docs.data()[i + 1], docs.data()[i + 2]});
            return p;
          }))
      .def_static("from_json", &planFromJson, py::arg("step"), py::arg("cost") = py::none(),
                  "A plan from a step line (dict) of a plan file.")
      .def("__repr__", [](const PyPlan& p) {
        return fmt::format("<wlb.Plan step {} dp {} M {}>", p.plan.step, p.dp(), p.microBatches());
      });

  m.def(
      "read_plan_file",
      [](const std::string& path, std::optional<PyCostPtr> cost) {
        auto f = packing::readPlanFile(path);
        py::list steps;
        for (std::size_t i = 0; i < f.steps.size(); ++i)
          steps.append(py::cast(planOf(std::move(f.steps[i]), f.incoming[i], f.metrics[i], innerCost(cost))));
        return py::make_tuple(toPy(packing::toJson(f.header)), steps);
      },
      py::arg("path"), py::arg("cost") = py::none(), "(header dict, [Plan]) of a `wlb plan --out` file.");

  py::class_<PyCheckpoint>(m, "PackerCheckpoint", "A packer checkpoint held in C++ (cheap to take every step).")
      .def("to_dict", [](const PyCheckpoint& c) { return toPy(c.state); });

  py::class_<PyPacker>(m, "Packer", R"(A stateful packer with its own length source (docs/packing.md).

Packer(deck, name=None, cost=None, lengths=None, source_name=None): packer `name` (default
packing.strategy) over the deck's length source, or over `lengths` (see LengthSource).
pack(step=None) draws the documents of the next step and packs them; state_dict() is the
`wlb plan --save-state` file's content and load_state_dict() takes that (or a
--save-state file written by the CLI) to continue the identical plan stream.)")
      .def(py::init([](std::shared_ptr<PyDeck> d, std::optional<std::string> name, std::optional<PyCostPtr> cost,
                       std::optional<Ints> lengths, std::optional<std::string> source_name) {
             auto p = std::make_unique<PyPacker>();
             p->deck = d;
             p->pycost = costFor(d, cost);
             p->cost = p->pycost->cost;
             p->lengths = lengths;
             p->source_name = source_name;
             p->src = makeSource(d->deck, lengths, source_name);
             if (name) packing::checkPackerName(*name, "name");  // the CLI's --packer
             p->packer = packing::makePacker(name ? *name : d->deck.packing.strategy, d->deck, *p->cost);
             return p;
           }),
           py::arg("deck").none(false), py::arg("name") = py::none(), py::arg("cost") = py::none(),
           py::arg("lengths") = py::none(), py::arg("source_name") = py::none())
      .def(
          "pack",
          [](PyPacker& p, std::optional<Int> step) {
            p.idle("pack");
            return p.packDocs(step ? *step : p.src->nextStep(), nullptr);
          },
          py::arg("step") = py::none(), "Pack the next step (steps must be consecutive).")
      .def(
          "pack_documents", [](PyPacker& p, const PyDocuments& docs, Int step) { return p.packDocs(step, &docs.docs); },
          py::arg("documents"), py::arg("step"),
          "Pack documents drawn elsewhere (the packer's own source is not advanced).")
      .def("state_dict", [](const PyPacker& p) { return toPy(p.checkpoint()); })
      .def(
          "load_state_dict", [](PyPacker& p, py::object o) { p.restore(stateFrom(o, "state_dict"), "state_dict"); },
          py::arg("state"))
      .def("checkpoint", [](const PyPacker& p) { return PyCheckpoint{p.checkpoint()}; })
      .def(
          "held_segments",
          [](const PyPacker& p) {
            p.idle("held_segments");
            return segmentArray(p.packer->heldSegments());
          },
          "Segments the packer holds back (queues, carry-over, window), as [doc, offset, length, arrival_step].")
      .def_property_readonly("pending_tokens",
                             [](const PyPacker& p) {
                               p.idle("pending_tokens");
                               return p.packer->pendingTokens();
                             })
      .def_property_readonly("name", [](const PyPacker& p) { return p.packer->name(); })
      .def_property_readonly("next_step",
                             [](const PyPacker& p) {
                               p.idle("next_step");
                               return p.src->nextStep();
                             })
      .def_property_readonly("capacity", &PyPacker::capacity,
                             "Largest micro-batch in tokens (s_max for wlb and slimpack, else S).")
      .def_property_readonly("dp", [](const PyPacker& p) { return p.packer->options().dp; })
      .def_property_readonly("micro_batches", [](const PyPacker& p) { return p.packer->options().micro_batches; })
      .def_property_readonly("documents_per_epoch",
                             [](const PyPacker& p) {
                               p.idle("documents_per_epoch");
                               return p.src->documentsPerEpoch();
                             })
      .def_property_readonly("cost", [](const PyPacker& p) { return p.pycost; })
      .def(
          "header", [](const PyPacker& p) { return toPy(p.header()); }, "The header line of `wlb plan --out`.")
      .def("describe_source",
           [](const PyPacker& p) {
             p.idle("describe_source");
             return p.src->describe();
           })
      .def("__repr__", [](const PyPacker& p) {
        if (p.in_pack) return fmt::format("<wlb.Packer {} packing>", p.packer->name());
        return fmt::format("<wlb.Packer {} next step {}>", p.packer->name(), p.src->nextStep());
      });

  // ---- CP shard planner ----
  py::class_<PyCommPlan, std::shared_ptr<PyCommPlan>>(m, "CommPlan",
                                                      "KV communication plan of a shard plan (docs/cp.md).")
      .def_property_readonly("mode", [](const PyCommPlan& c) { return cp::commModeName(c.comm.mode); })
      .def_property_readonly("cp", [](const PyCommPlan& c) { return c.comm.cp; })
      .def_property_readonly("gather_counts", [](const PyCommPlan& c) { return i64Vector(c.comm.gather_counts); })
      .def_property_readonly("gather_displs", [](const PyCommPlan& c) { return i64Vector(c.comm.gather_displs); })
      .def_property_readonly("total_bytes", [](const PyCommPlan& c) { return c.comm.totalBytes(); })
      .def_property_readonly("transfers",
                             [](const PyCommPlan& c) {
                               py::list l;
                               for (const auto& t : c.comm.transfers) {
                                 py::dict d;
                                 d["src"] = t.src;
                                 d["dst"] = t.dst;
                                 d["tokens"] = t.tokens;
                                 d["runs"] = runsArray(t.runs, false);  // [src_local_begin, len, kv_begin]
                                 l.append(d);
                               }
                               return l;
                             })
      .def_property_readonly("ranks", [](const PyCommPlan& c) { return toPy(cp::toJson(c.comm)["ranks"]); })
      .def(
          "transfers_from",
          [](const PyCommPlan& c, Int r) { return cp::transfersFrom(c.comm, cpRankChecked(r, c.comm.cp)); },
          py::arg("rank"))
      .def(
          "transfers_to",
          [](const PyCommPlan& c, Int r) { return cp::transfersTo(c.comm, cpRankChecked(r, c.comm.cp)); },
          py::arg("rank"))
      .def("to_json", [](const PyCommPlan& c) { return toPy(cp::toJson(c.comm)); });

  py::class_<PyShardPlan, std::shared_ptr<PyShardPlan>>(m, "ShardPlan",
                                                        R"(The CP sharding of one micro-batch (docs/cp.md).

token_index(r): packed positions of rank r's tokens in its local order (the rank's inputs
are packed[token_index(r)]); kv_index(r): packed position of each slot of its KV buffer.)")
      .def_property_readonly("strategy", [](const PyShardPlan& s) { return s.plan.strategy; })
      .def_property_readonly("requested", [](const PyShardPlan& s) { return s.plan.requested; })
      .def_property_readonly("cp", [](const PyShardPlan& s) { return s.plan.cp; })
      .def_property_readonly("total_tokens", [](const PyShardPlan& s) { return s.plan.total_tokens; })
      .def_property_readonly("sharded_segments", [](const PyShardPlan& s) { return s.plan.sharded_segments; })
      .def_property_readonly("owner",
                             [](const PyShardPlan& s) {
                               py::array_t<std::int32_t> a(static_cast<py::ssize_t>(s.plan.owner.size()));
                               if (!s.plan.owner.empty())
                                 std::memcpy(a.mutable_data(), s.plan.owner.data(), s.plan.owner.size() * 4);
                               return a;
                             })
      .def_property_readonly("local_index", [](const PyShardPlan& s) { return i64Vector(s.plan.local_index); })
      .def_property_readonly("rank_tokens",
                             [](const PyShardPlan& s) {
                               std::vector<std::int64_t> v;
                               for (const auto& r : s.plan.ranks) v.push_back(r.tokens);
                               return i64Vector(v);
                             })
      .def_property_readonly("kv_tokens",
                             [](const PyShardPlan& s) {
                               std::vector<std::int64_t> v;
                               for (const auto& r : s.plan.ranks) v.push_back(r.kv_tokens);
                               return i64Vector(v);
                             })
      .def(
          "token_index",
          [](const PyShardPlan& s, Int r) { return i64Vector(cp::packedPositions(s.plan, s.rankChecked(r))); },
          py::arg("rank"))
      .def(
          "kv_index",
          [](const PyShardPlan& s, Int r) { return i64Vector(cp::kvPackedPositions(s.plan, s.rankChecked(r))); },
          py::arg("rank"))
      .def(
          "all_gather_kv_index",
          [](const PyShardPlan& s, Int r) {
            return i64Vector(cp::allGatherKvIndex(s.plan, s.comm->comm, s.rankChecked(r)));
          },
          py::arg("rank"), "For each KV-buffer slot of `rank`, its index in the all-gathered buffer.")
      .def(
          "pieces", [](const PyShardPlan& s, Int r) { return piecesOf(s.plan.ranks[s.rankChecked(r)]); },
          py::arg("rank"), "The rank's query pieces as a dict of arrays (docs/cp.md).")
      .def(
          "kv_runs",
          [](const PyShardPlan& s, Int r) { return runsArray(s.plan.ranks[s.rankChecked(r)].kv_runs, true); },
          py::arg("rank"), "(n, 4) [src, src_local_begin, len, kv_begin].")
      .def(
          "kv_blocks",
          [](const PyShardPlan& s, Int r) {
            const auto& b = s.plan.ranks[s.rankChecked(r)].kv_blocks;
            I64Array a({static_cast<py::ssize_t>(b.size()), py::ssize_t{4}});
            auto* p = a.mutable_data();
            for (const auto& k : b) {
              *p++ = k.segment;
              *p++ = k.seg_begin;
              *p++ = k.len;
              *p++ = k.kv_begin;
            }
            return a;
          },
          py::arg("rank"), "(n, 4) [segment, seg_begin, len, kv_begin].")
      .def_property_readonly("comm", [](const PyShardPlan& s) { return s.comm; })
      .def_property_readonly("metrics", [](const PyShardPlan& s) { return toPy(shardMetricsJson(s)); })
      .def(py::pickle(
          [](const PyShardPlan& s) {
            return py::make_tuple(segmentArray(s.mb.segments), py::bytes(cp::toJson(s.plan).dump()),
                                  py::bytes(cp::toJson(s.comm->comm).dump()), py::bytes(shardMetricsJson(s).dump()));
          },
          [](py::tuple t) {
            auto s = std::make_shared<PyShardPlan>();
            s->mb.segments = segmentsFrom(t[0].cast<I64Array>(), "segments");
            s->plan = shardPlanFromJson(json::parse(t[1].cast<std::string>()), s->mb);
            s->comm = std::make_shared<PyCommPlan>(PyCommPlan{commPlanFromJson(json::parse(t[2].cast<std::string>()))});
            s->metrics = json::parse(t[3].cast<std::string>());
            return s;
          }))
      .def_static(
          "from_ranges",
          [](const Ints& segs, const Ints& ranges, Int cp_degree, const PyCostPtr& cost, const std::string& comm,
             const std::string& name) {
            if (!cost) throw py::value_error("from_ranges: cost: a wlb.CostModel is required");
            if (ranges.ndim() != 2 || ranges.shape(1) != 4)
              throw py::value_error("from_ranges: ranges: expected an (n, 4) array [rank, segment, q_offset, q_len]");
            std::vector<cp::QueryRange> qr(static_cast<std::size_t>(ranges.shape(0)));
            const auto* p = ranges.data();
            for (auto& q : qr) {
              q = {p[0], p[1], p[2], p[3]};
              p += 4;
            }
            const cp::CommMode mode = cp::parseCommMode(comm);
            auto out = std::make_shared<PyShardPlan>();
            out->mb.segments = segmentsFrom(segs, "segments");
            out->cost = cost->cost;
            out->comm = std::make_shared<PyCommPlan>();
            {
              py::gil_scoped_release nogil;
              out->plan = cp::planFromRanges(out->mb, qr, cpDegreeChecked(cp_degree, "from_ranges: cp"), name);
              out->comm->comm = cp::planComm(out->plan, mode, *out->cost);
            }
            return out;
          },
          py::arg("segments"), py::arg("ranges"), py::arg("cp"), py::arg("cost").none(false),
          py::arg("comm") = "allgather", py::arg("name") = "custom",
          "The plan of an assignment made elsewhere: ranges (n, 4) [rank, segment, q_offset, q_len] put every token "
          "of every segment on one rank; laid out, comm-planned and costed like the planner's plans (docs/cp.md).")
      .def(
          "validate", [](const PyShardPlan& s) { cp::validatePlan(s.plan, s.mb); },
          "Check every invariant of the plan (RuntimeError on a violation).")
      .def("to_json", [](const PyShardPlan& s) { return toPy(cp::toJson(s.plan)); })
      .def("__repr__", [](const PyShardPlan& s) {
        return fmt::format("<wlb.ShardPlan {} cp {} tokens {}>", s.plan.strategy, s.plan.cp, s.plan.total_tokens);
      });

  py::class_<PyShardPlanner>(m, "ShardPlanner", R"(The CP shard planner (docs/cp.md).

ShardPlanner(deck, strategy=None, comm=None, cp=None, cost=None): strategy (default
cp.strategy), KV comm mode (cp.comm) and CP degree (mesh.cp) of the deck unless given.
plan(segments) shards one micro-batch: an (n, 4) [doc, offset, length, arrival] array such
as Plan.micro_batch(r, m), or 1-D segment lengths.)")
      .def(py::init([](std::shared_ptr<PyDeck> d, std::optional<std::string> strategy, std::optional<std::string> comm,
                       std::optional<Int> cp_degree, std::optional<PyCostPtr> cost) {
             return PyShardPlanner::make(costFor(d, cost), d->deck.cp, strategy ? *strategy : d->deck.cp.strategy,
                                         comm ? *comm : d->deck.cp.comm, cp_degree ? cp_degree->v : d->deck.mesh.cp);
           }),
           py::arg("deck").none(false), py::arg("strategy") = py::none(), py::arg("comm") = py::none(),
           py::arg("cp") = py::none(), py::arg("cost") = py::none())
      .def(
          "plan", [](const PyShardPlanner& p, const Ints& segs) { return p.plan(segmentsFrom(segs, "segments")); },
          py::arg("segments"))
      .def_property_readonly("strategy", [](const PyShardPlanner& p) { return cp::strategyName(p.strategy); })
      .def_property_readonly("comm", [](const PyShardPlanner& p) { return cp::commModeName(p.comm); })
      .def_property_readonly("cp", [](const PyShardPlanner& p) { return p.cp; })
      .def_property_readonly("cost", [](const PyShardPlanner& p) { return p.pycost; })
      .def(py::pickle(
          [](const PyShardPlanner& p) {
            return py::make_tuple(p.pycost, cp::strategyName(p.strategy), cp::commModeName(p.comm), p.cp,
                                  p.cfg.capacity_factor);
          },
          [](py::tuple t) {
            wlb::CpConfig cfg;
            cfg.capacity_factor = t[4].cast<double>();
            return PyShardPlanner::make(t[0].cast<PyCostPtr>(), cfg, t[1].cast<std::string>(), t[2].cast<std::string>(),
                                        t[3].cast<int>());
          }));

  // ---- Metrics ----
  m.def(
      "compute_metrics",
      [](const PyPlan& p, const PyCostPtr& cost) {
        auto m = packing::computeMetrics(p.plan, *cost->cost);
        m.plan_us = p.plan_us;
        m.solver = p.solver;
        return toPy(packing::toJson(m));
      },
      py::arg("plan"), py::arg("cost").none(false), "Per-step metrics of a plan (docs/packing.md).");

  py::class_<packing::RunSummary>(m, "RunSummary", "Aggregate over steps: mean imbalance, token-weighted delay, ...")
      .def(py::init<>())
      .def(
          "add", [](packing::RunSummary& s, const PyPlan& p) { s.add(p.stepMetrics()); }, py::arg("plan"))
      .def("to_dict", [](const packing::RunSummary& s) {
        auto c = s;  // finish() divides the sums; keep this one adding
        c.finish();
        return toPy(c.toJson());
      });

  py::class_<PyChecker>(m, "ConservationChecker", R"(Every token trained exactly once (docs/packing.md).

ConservationChecker(capacity); add_held(packer.held_segments()) once for a resumed stream,
then per step add_incoming(documents) and add_plan(plan); ok(packer.pending_tokens).)")
      .def(py::init([](Int capacity) {
             if (capacity < 1) throw py::value_error(fmt::format("capacity = {}: expected >= 1 tokens", capacity.v));
             return std::make_unique<PyChecker>(capacity);
           }),
           py::arg("capacity"))
      .def(
          "add_incoming", [](PyChecker& c, const PyDocuments& d) { c.checker.addIncoming(d.docs); },
          py::arg("documents"))
      .def(
          "add_held", [](PyChecker& c, const Ints& segs) { c.checker.addHeld(segmentsFrom(segs, "held")); },
          py::arg("segments"))
      .def(
          "add_plan", [](PyChecker& c, const PyPlan& p) { c.checker.addPlan(p.plan); }, py::arg("plan"))
      .def(
          "ok", [](const PyChecker& c, Int pending) { return c.checker.ok(pending); }, py::arg("pending_tokens"))
      .def(
          "lost_tokens", [](const PyChecker& c, Int pending) { return c.checker.lostTokens(pending); },
          py::arg("pending_tokens"))
      .def(
          "report", [](const PyChecker& c, Int pending) { return c.checker.report(pending); },
          py::arg("pending_tokens"))
      .def_property_readonly("completed", [](const PyChecker& c) { return c.checker.completed(); })
      .def_property_readonly("in_flight", [](const PyChecker& c) { return c.checker.inFlight(); })
      .def_property_readonly("duplicated", [](const PyChecker& c) { return c.checker.duplicated(); })
      .def_property_readonly("unknown", [](const PyChecker& c) { return c.checker.unknown(); })
      .def_property_readonly("over_capacity", [](const PyChecker& c) { return c.checker.overCapacity(); })
      .def_property_readonly("early", [](const PyChecker& c) { return c.checker.early(); })
      .def_property_readonly("unreported", [](const PyChecker& c) { return c.checker.unreported(); });
}
