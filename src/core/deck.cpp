// Deck parsing: one schema table drives parsing, --set overrides, sweep expansion,
// the resolved TOML text and the key reference, so the four can never disagree.
#include "core/deck.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <toml.hpp>

#include "core/deck_schema.hpp"
#include "core/error.hpp"

namespace wlb {
namespace {

// TOML text must be UTF-8; toml11 3.7 reads past the end of its buffer on some invalid
// sequences inside strings (found by fuzz_deck), so invalid text never reaches it.
void requireUtf8(const std::string& text, const std::string& name) {
  std::size_t line = 1, i = 0;
  const auto bad = [&](std::size_t at) {
    throw InputError(name + ":" + std::to_string(line) + ": not valid UTF-8 (byte offset " + std::to_string(at) + ")");
  };
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    std::size_t n = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      if (c == '\n') ++line;
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      bad(i);
    }
    if (i + n >= text.size()) bad(i);  // truncated sequence
    for (std::size_t k = 1; k <= n; ++k) {
      const auto cc = static_cast<unsigned char>(text[i + k]);
      if ((cc & 0xC0) != 0x80) bad(i);
      cp = (cp << 6) | (cc & 0x3F);
    }
    // overlong forms, surrogates and code points past U+10FFFF are not UTF-8
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      bad(i);
    i += n + 1;
  }
}

using TomlValue = toml::value;

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        // other control characters as \uXXXX: TOML takes none of them raw
        if ((static_cast<unsigned char>(c) < 0x20 || c == 0x7f)) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string formatDouble(double v) {
  // Shortest text that reads back as the same double, still a TOML float.
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

std::size_t editDistance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string nearest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_d = std::numeric_limits<std::size_t>::max();
  for (const auto& c : candidates) {
    const std::size_t d = editDistance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

namespace {

// Where a value came from, for messages: "deck.toml:12" or "--set model.hidden=...".
struct Origin {
  std::string where;
  static Origin of(const TomlValue& v, const std::string& fallback) {
    const auto loc = v.location();
    if (loc.line() == 0 || loc.file_name().empty() || loc.file_name() == "unknown file") return {fallback};
    return {loc.file_name() + ":" + std::to_string(loc.line())};
  }
};

[[noreturn]] void fail(const Origin& o, const std::string& msg) {
  throw InputError(o.where + ": " + msg);
}

std::string typeName(const TomlValue& v) {
  switch (v.type()) {
    case toml::value_t::boolean:
      return "boolean";
    case toml::value_t::integer:
      return "integer";
    case toml::value_t::floating:
      return "float";
    case toml::value_t::string:
      return "string";
    case toml::value_t::array:
      return "array";
    case toml::value_t::table:
      return "table";
    default:
      return "date/time";
  }
}

std::string literalOf(const TomlValue& v) {
  switch (v.type()) {
    case toml::value_t::boolean:
      return v.as_boolean() ? "true" : "false";
    case toml::value_t::integer:
      return std::to_string(v.as_integer());
    case toml::value_t::floating:
      return formatDouble(v.as_floating());
    case toml::value_t::string:
      return quote(v.as_string().str);
    case toml::value_t::array: {
      std::string s = "[";
      bool first = true;
      for (const auto& e : v.as_array()) {
        if (!first) s += ", ";
        first = false;
        s += literalOf(e);
      }
      return s + "]";
    }
    default:
      return toml::format(v);
  }
}

std::int64_t checkInt(const KeySpec& k, const TomlValue& v, const Origin& o) {
  if (!v.is_integer()) fail(o, "key '" + k.name() + "' must be an integer, got " + typeName(v) + " " + literalOf(v));
  const std::int64_t x = v.as_integer();
  if (static_cast<double>(x) < k.lo || static_cast<double>(x) > k.hi)
    fail(o, "key '" + k.name() + "' = " + std::to_string(x) + " is out of range; allowed " + k.rangeText());
  return x;
}

double checkFloat(const KeySpec& k, const TomlValue& v, const Origin& o) {
  double x = 0;
  if (v.is_floating())
    x = v.as_floating();
  else if (v.is_integer())
    x = static_cast<double>(v.as_integer());
  else
    fail(o, "key '" + k.name() + "' must be a number, got " + typeName(v) + " " + literalOf(v));
  if (!std::isfinite(x) || x < k.lo || x > k.hi)
    fail(o, "key '" + k.name() + "' = " + literalOf(v) + " is out of range; allowed " + k.rangeText());
  return x;
}

std::string checkString(const KeySpec& k, const TomlValue& v, const Origin& o) {
  if (!v.is_string()) fail(o, "key '" + k.name() + "' must be a string, got " + typeName(v) + " " + literalOf(v));
  std::string s = v.as_string().str;
  if (!k.choices.empty() && std::find(k.choices.begin(), k.choices.end(), s) == k.choices.end()) {
    std::string allowed;
    for (const auto& c : k.choices) allowed += (allowed.empty() ? "" : ", ") + c;
    fail(o, "key '" + k.name() + "' = \"" + s + "\" is not allowed (did you mean \"" + nearest(s, k.choices) +
                "\"?); allowed: " + allowed);
  }
  return s;
}

void applyValue(Deck& d, const KeySpec& k, const TomlValue& v, const Origin& o) {
  void* p = k.ptr(d);
  switch (k.kind) {
    case Kind::Int:
      *static_cast<std::int64_t*>(p) = checkInt(k, v, o);
      break;
    case Kind::UInt:
      *static_cast<std::uint64_t*>(p) = static_cast<std::uint64_t>(checkInt(k, v, o));
      break;
    case Kind::Float:
      *static_cast<double*>(p) = checkFloat(k, v, o);
      break;
    case Kind::String:
      *static_cast<std::string*>(p) = checkString(k, v, o);
      break;
    case Kind::IntList: {
      if (!v.is_array()) fail(o, "key '" + k.name() + "' must be an array of integers, got " + typeName(v));
      std::vector<std::int64_t> out;
      for (const auto& e : v.as_array()) out.push_back(checkInt(k, e, o));
      *static_cast<std::vector<std::int64_t>*>(p) = out;
      break;
    }
    case Kind::StringList: {
      if (!v.is_array()) fail(o, "key '" + k.name() + "' must be an array of strings, got " + typeName(v));
      std::vector<std::string> out;
      for (const auto& e : v.as_array()) out.push_back(checkString(k, e, o));
      *static_cast<std::vector<std::string>*>(p) = out;
      break;
    }
  }
}

const KeySpec* findKey(const std::string& table, const std::string& key) {
  for (const auto& k : deckSchema())
    if (table == k.table && key == k.key) return &k;
  return nullptr;
}

std::vector<std::string> tableNames() {
  std::vector<std::string> t;
  for (const auto& k : deckSchema())
    if (std::find(t.begin(), t.end(), k.table) == t.end()) t.push_back(k.table);
  t.push_back("sweep");
  return t;
}

std::vector<std::string> keysOf(const std::string& table) {
  std::vector<std::string> out;
  for (const auto& k : deckSchema())
    if (table == k.table) out.push_back(k.key);
  return out;
}

// Parse "table.key=value": the value is TOML; bare words are taken as strings. Returns the
// key it set, as `table.key`.
std::string applyOverride(Deck& d, const std::string& text, const std::string& origin_prefix) {
  requireUtf8(text, origin_prefix);
  const Origin o{origin_prefix + " '" + text + "'"};
  const auto eq = text.find('=');
  if (eq == std::string::npos) fail(o, "expected table.key=value");
  std::string lhs = text.substr(0, eq), rhs = text.substr(eq + 1);
  auto trim = [](const std::string& s) {
    const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  lhs = trim(lhs);
  rhs = trim(rhs);
  const auto dot = lhs.find('.');
  if (dot == std::string::npos) fail(o, "expected table.key=value (no table in '" + lhs + "')");
  const std::string table = lhs.substr(0, dot), key = lhs.substr(dot + 1);
  const KeySpec* k = findKey(table, key);
  if (!k) {
    const auto tables = tableNames();
    if (std::find(tables.begin(), tables.end(), table) == tables.end())
      fail(o, "unknown table [" + table + "] (did you mean [" + nearest(table, tables) + "]?)");
    const auto keys = keysOf(table);
    if (keys.empty())  // [sweep] holds no keys of its own: a sweep cannot sweep the sweep
      fail(o, "[" + table + "] has no keys to set ('" + lhs + "')");
    fail(o, "unknown key '" + key + "' in table [" + table + "] (did you mean '" + nearest(key, keys) + "'?)");
  }
  if (k->derived) fail(o, "key '" + k->name() + "' is derived and cannot be set");
  // one value: a line break would let the rest parse as more TOML and be dropped
  if (rhs.find_first_of("\n\r") != std::string::npos) fail(o, "the value holds a line break");
  TomlValue v;
  try {
    std::istringstream in("v = " + rhs);
    v = toml::find(toml::parse(in, "--set"), "v");
  } catch (const std::exception&) {
    // a bare word is a string (model.name=llama); text that starts as a TOML string, array
    // or table but does not parse is a mistake, not a string with a quote in it
    if (!rhs.empty() && std::strchr("\"'[{", rhs.front()) != nullptr)
      fail(o, "'" + rhs + "' is not a TOML value (an unclosed quote or bracket?)");
    v = TomlValue(rhs);
  }
  if (v.is_string() && (k->kind == Kind::StringList)) v = TomlValue(toml::array{v});
  applyValue(d, *k, v, o);
  return k->name();
}

/// Derives what the deck leaves to derive and checks the rules across keys; with `check`
/// false only derives (a sweep's base deck, whose cases are checked one by one).
void resolveAndValidate(Deck& d, const std::string& name, bool check = true) {
  auto err = [&](const std::string& key, const std::string& msg) {
    if (check) throw InputError(name + ": key '" + key + "': " + msg);
  };
  auto& m = d.model;
  if (m.hidden % m.heads != 0)
    err("model.heads", "heads = " + std::to_string(m.heads) + " must divide hidden = " + std::to_string(m.hidden));
  if (m.heads % m.kv_heads != 0)
    err("model.kv_heads",
        "kv_heads = " + std::to_string(m.kv_heads) + " must divide heads = " + std::to_string(m.heads));
  m.head_dim = m.hidden / m.heads;
  const auto& mesh = d.mesh;
  // Rank counts are ints (MPI's, the mesh's): a product past that would wrap.
  constexpr std::int64_t kMaxRanks = std::int64_t{1} << 20;
  // in double, which cannot wrap (each factor is at most 2^20 by the schema)
  const double ranks = static_cast<double>(mesh.tp) * mesh.cp * mesh.pp * mesh.dp;
  if (ranks > static_cast<double>(kMaxRanks))
    err("mesh", fmt::format("tp x cp x pp x dp = {} x {} x {} x {} = {:.0f} ranks; at most {}", mesh.tp, mesh.cp,
                            mesh.pp, mesh.dp, ranks, kMaxRanks));
  if (m.heads % mesh.tp != 0)
    err("mesh.tp", "tp = " + std::to_string(mesh.tp) + " must divide model.heads = " + std::to_string(m.heads));
  // A TP rank holds whole KV heads, or tp / kv_heads ranks hold copies of one (Megatron's
  // replication, which the cost model prices; the executor needs tp | kv_heads: runtime::LayerShape).
  if (m.kv_heads % mesh.tp != 0 && mesh.tp % m.kv_heads != 0)
    err("mesh.tp", "tp = " + std::to_string(mesh.tp) + " must divide model.kv_heads = " + std::to_string(m.kv_heads) +
                       " or be a multiple of it");
  if (m.ffn % mesh.tp != 0)
    err("mesh.tp", "tp = " + std::to_string(mesh.tp) + " must divide model.ffn = " + std::to_string(m.ffn));
  // An uneven split is allowed (pp::layerBlock: the first stages hold one layer more).
  if (m.layers < mesh.pp * mesh.virtual_stages)
    err("model.layers", "model.layers = " + std::to_string(m.layers) + " is fewer than pp * virtual_stages = " +
                            std::to_string(mesh.pp * mesh.virtual_stages) + ": every pipeline stage needs a layer");
  if (mesh.virtual_stages > 1 && d.pipeline.schedule != "interleaved")
    err("mesh.virtual_stages", "virtual_stages > 1 needs [pipeline] schedule = \"interleaved\"");
  d.data.s_max_derived = d.data.s_max == 0;
  if (d.data.s_max == 0) d.data.s_max = d.data.context_window;
  if (d.data.s_max < d.data.context_window)
    err("data.s_max", "s_max = " + std::to_string(d.data.s_max) +
                          " must be >= context_window = " + std::to_string(d.data.context_window));
  if (d.data.source != "generator" && d.data.path.empty())
    err("data.path", "source = \"" + d.data.source + "\" needs a path to the length file");
  for (const auto& [key, file] : {std::pair{"output.trace", &d.output.trace}, std::pair{"output.plan", &d.output.plan}})
    if (file->empty()) err(key, "empty: name a file inside output.dir");
  // A path with a control character (a tab, a line break) is a slip, and no shell script
  // of run/slurm could carry it.
  for (const auto& [key, path] :
       {std::pair{"output.dir", &d.output.dir}, std::pair{"output.trace", &d.output.trace},
        std::pair{"output.plan", &d.output.plan}, std::pair{"data.path", &d.data.path},
        std::pair{"hardware.profile", &d.hardware.profile}, std::pair{"train.dataset", &d.train.dataset}})
    for (const char ch : *path)
      if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) {
        char code[8];
        std::snprintf(code, sizeof code, "0x%02x", static_cast<unsigned>(static_cast<unsigned char>(ch)));
        err(key, std::string("holds the control character ") + code + ": a path cannot");
        break;
      }
  d.packing.micro_batches_derived = d.packing.micro_batches == 0;
  if (d.packing.micro_batches == 0) d.packing.micro_batches = mesh.pp;
  if (d.pipeline.schedule == "interleaved" && d.packing.micro_batches % mesh.pp != 0)
    err("packing.micro_batches", "interleaved 1F1B needs micro_batches (" + std::to_string(d.packing.micro_batches) +
                                     ") divisible by pp (" + std::to_string(mesh.pp) + ")");
  const auto& th = d.packing.outlier_thresholds;
  for (std::size_t i = 0; i < th.size(); ++i) {
    if (i > 0 && th[i] <= th[i - 1]) err("packing.outlier_thresholds", "thresholds must be strictly increasing");
    if (th[i] > d.data.s_max)
      err("packing.outlier_thresholds", "threshold " + std::to_string(th[i]) + " exceeds s_max");
  }
  try {
    (void)resolveStrategies(d);
  } catch (const InputError& e) {
    if (check) throw InputError(name + ": " + e.what());
  }
}

}  // namespace

std::string Deck::toToml() const {
  Deck& self = const_cast<Deck&>(*this);  // schema accessors are non-const; we only read
  std::ostringstream os;
  std::string table;
  for (const auto& k : deckSchema()) {
    if (table != k.table) {
      if (!table.empty()) os << "\n";
      table = k.table;
      os << "[" << table << "]\n";
    }
    const void* p = k.ptr(self);
    // A derived key is shown as a comment: the text parses back to the same deck.
    if (k.derived) os << "# ";
    os << k.key << " = ";
    // 0 where the deck left a value to derive (what follows each [sweep] case), with the
    // value it resolved to: printed as the value, a sweep deck read back would pin it.
    const bool left_derived =
        (p == &data.s_max && data.s_max_derived) || (p == &packing.micro_batches && packing.micro_batches_derived);
    switch (k.kind) {
      case Kind::Int:
        if (left_derived)
          os << "0  # resolved: " << *static_cast<const std::int64_t*>(p);
        else
          os << *static_cast<const std::int64_t*>(p);
        break;
      case Kind::UInt:
        os << *static_cast<const std::uint64_t*>(p);
        break;
      case Kind::Float:
        os << formatDouble(*static_cast<const double*>(p));
        break;
      case Kind::String:
        os << quote(*static_cast<const std::string*>(p));
        break;
      case Kind::IntList: {
        os << "[";
        const auto& v = *static_cast<const std::vector<std::int64_t>*>(p);
        for (std::size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
        os << "]";
        break;
      }
      case Kind::StringList: {
        os << "[";
        const auto& v = *static_cast<const std::vector<std::string>*>(p);
        for (std::size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << quote(v[i]);
        os << "]";
        break;
      }
    }
    if (k.derived) os << "  (derived)";
    os << "\n";
  }
  if (!sweep.empty()) {
    os << "\n[sweep]\n";
    for (const auto& [key, values] : sweep) {
      os << quote(key) << " = [";
      for (std::size_t i = 0; i < values.size(); ++i) os << (i ? ", " : "") << values[i];
      os << "]\n";
    }
  }
  return os.str();
}
namespace {
/// Whether a TOML value is, or holds at any depth, a table.
bool holdsTable(const TomlValue& v) {
  if (v.is_table()) return true;
  if (v.is_array())
    for (const auto& e : v.as_array())
      if (holdsTable(e)) return true;
  return false;
}
}  // namespace

Deck parseDeck(const std::string& text, const std::string& name, const std::vector<std::string>& overrides) {
  requireUtf8(text, name);
  TomlValue root;
  try {
    std::istringstream in(text);
    root = toml::parse(in, name);
  } catch (const toml::syntax_error& e) {
    throw InputError(name + ": TOML syntax error:\n" + std::string(e.what()));
  } catch (const std::exception& e) {
    throw InputError(name + ": cannot parse: " + std::string(e.what()));
  }
  Deck d;
  d.source_path = name;
  const auto tables = tableNames();

  // Visit keys in file order so the first error reported is the first in the file.
  struct Item {
    std::uint32_t line;
    std::string table, key;
    const TomlValue* value;
  };
  std::vector<Item> items;
  std::vector<std::pair<std::string, const TomlValue*>> sweep_items;
  for (const auto& [tname, tval] : root.as_table()) {
    const Origin o = Origin::of(tval, name);
    if (std::find(tables.begin(), tables.end(), tname) == tables.end()) {
      fail(o, tval.is_table() ? "unknown table [" + tname + "] (did you mean [" + nearest(tname, tables) + "]?)"
                              : "key '" + tname + "' must be inside a table (e.g. [" + nearest(tname, tables) + "])");
    }
    if (!tval.is_table()) fail(o, "[" + tname + "] must be a table");
    if (tname == "sweep") {
      // Accept "table.key" = [...] and nested dotted keys table.key = [...].
      for (const auto& [k1, v1] : tval.as_table()) {
        if (v1.is_table())
          for (const auto& [k2, v2] : v1.as_table()) sweep_items.emplace_back(k1 + "." + k2, &v2);
        else
          sweep_items.emplace_back(k1, &v1);
      }
      continue;
    }
    for (const auto& [key, val] : tval.as_table()) items.push_back({val.location().line(), tname, key, &val});
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.line < b.line; });
  for (const auto& it : items) {
    const Origin o = Origin::of(*it.value, name);
    const KeySpec* k = findKey(it.table, it.key);
    if (!k)
      fail(o, "unknown key '" + it.key + "' in table [" + it.table + "] (did you mean '" +
                  nearest(it.key, keysOf(it.table)) + "'?)");
    if (k->derived) fail(o, "key '" + k->name() + "' is derived and cannot be set");
    applyValue(d, *k, *it.value, o);
  }
  std::set<std::string> pinned;  // a --set of a swept key pins it: that key leaves the sweep
  for (const auto& ov : overrides) pinned.insert(applyOverride(d, ov, "--set"));
  const Deck base = d;
  std::map<std::string, std::string> spelled;  // a key's schema name -> how the deck wrote it
  for (const auto& [key, val] : sweep_items) {
    const Origin o = Origin::of(*val, name);
    if (!val->is_array() || val->as_array().empty())
      fail(o, "[sweep] '" + key + "' must be a non-empty array of values");
    std::vector<std::string> literals;
    std::string canonical;
    for (const auto& e : val->as_array()) {
      if (holdsTable(e))  // no deck key takes a table; its TOML text would garble the message
        fail(o, "[sweep] '" + key + "' lists an inline table; its values must be numbers, booleans, strings or arrays");
      Deck probe = base;  // validate each value against the key's schema now
      const std::string lit = literalOf(e);
      canonical = applyOverride(probe, key + "=" + lit, o.where + ": [sweep]");
      if (std::find(literals.begin(), literals.end(), lit) != literals.end())
        fail(o, "[sweep] '" + key + "' lists " + lit + " twice: the two cases would be one");
      literals.push_back(lit);
    }
    // "mesh.cp", "mesh.cp " and a dotted mesh.cp are one key: two axes would fight over it.
    if (const auto [it, fresh] = spelled.emplace(canonical, key); !fresh)
      fail(o, "[sweep] '" + key + "' and '" + it->second + "' both sweep " + canonical);
    if (pinned.count(canonical)) continue;
    // every case writes under output.dir/<its key-value folder>: output.dir names the sweep's root
    if (canonical == "output.dir")
      fail(o, "[sweep] cannot sweep output.dir: each case writes to output.dir/<key>-<value>_...");
    d.sweep[canonical] = literals;
  }
  if (d.sweep.empty()) {
    resolveAndValidate(d, name);
    return d;
  }
  // A sweep's cases are what runs: each is checked as expandSweep resolves it. The base
  // alone may break a rule that every case's values replace (an s_max above the swept
  // windows but below the default one), so it is only derived.
  (void)expandSweep(d);
  resolveAndValidate(d, name, false);
  return d;
}

std::string readDeckText(const std::string& path, const std::string& shown) {
  const std::string& name = shown.empty() ? path : shown;
  // a directory opens as an empty stream on Linux and would parse as the defaults
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw InputError("deck '" + name + "' is a directory, not a TOML file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("cannot open deck '" + name + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Deck loadDeck(const std::string& path, const std::vector<std::string>& overrides) {
  return parseDeck(readDeckText(path), path, overrides);
}

void requireOneCase(const Deck& deck, const std::string& name, const std::string& command) {
  if (deck.sweep.empty()) return;
  std::string keys;
  for (const auto& [k, v] : deck.sweep) keys += (keys.empty() ? "" : ", ") + k;
  const auto& [k0, v0] = *deck.sweep.begin();
  throw InputError(name + ": [sweep] over " + keys + ": " + command +
                   " runs one case; pick it with --set (e.g. --set " + k0 + "=" + v0.front() +
                   "); wlb simulate and run/slurm/sweep run every case");
}

std::vector<Deck> expandSweep(const Deck& deck) {
  std::vector<Deck> out;
  if (deck.sweep.empty()) return {deck};
  std::vector<std::pair<std::string, std::vector<std::string>>> axes(deck.sweep.begin(), deck.sweep.end());
  std::vector<std::size_t> idx(axes.size(), 0);
  std::map<std::string, std::string> folders;  // case folder -> the values that named it
  std::map<std::string, std::string> decks;    // case deck (TOML) -> the values that made it
  const std::string where = deck.source_path.empty() ? std::string("[sweep]") : deck.source_path + ": [sweep]";
  for (;;) {
    // Re-resolve from the deck's own (unresolved) values: derived keys follow the case.
    Deck c = deck;
    c.sweep.clear();
    // Derived defaults follow the case (unless the case sets them: its values come after).
    if (deck.data.s_max_derived) c.data.s_max = 0;
    if (deck.packing.micro_batches_derived) c.packing.micro_batches = 0;
    std::string suffix, values;
    for (std::size_t a = 0; a < axes.size(); ++a) {
      const std::string& lit = axes[a].second[idx[a]];
      applyOverride(c, axes[a].first + "=" + lit, "[sweep]");
      c.sweep_case.push_back(axes[a].first + "=" + lit);
      // The value as part of one folder name: quotes go, and any character but letters,
      // digits and . + - = , becomes '_', so a value holding '/' (a profile's path) can
      // neither leave output.dir nor nest folders.
      std::string v;
      for (const char ch : lit) {
        if (ch == '"') continue;
        const bool keep = std::isalnum(static_cast<unsigned char>(ch)) || std::strchr(".+-=,", ch) != nullptr;
        v += keep ? ch : '_';
      }
      suffix += (suffix.empty() ? "" : "_") + axes[a].first + "-" + v;
      values += (values.empty() ? "" : ", ") + axes[a].first + " = " + lit;
    }
    resolveAndValidate(c, deck.source_path.empty() ? "[sweep]" : deck.source_path + " [sweep] " + suffix);
    // An empty output.dir is the working directory, as without a sweep (not the root).
    const std::string dir = deck.output.dir.empty() ? suffix : deck.output.dir + "/" + suffix;
    if (const auto [it, fresh] = folders.emplace(suffix, values); !fresh)
      throw InputError(where + " cases (" + it->second + ") and (" + values + ") would write to the same folder " +
                           dir + ": their values differ only where a folder name cannot",
                       true);
    // Equal values written differently (1 and 1.0, or 0 and the value 0 derives) make the
    // same case twice: compare the resolved decks.
    Deck resolved = c;
    resolved.data.s_max_derived = resolved.packing.micro_batches_derived = false;
    if (const auto [it, fresh] = decks.emplace(resolved.toToml(), values); !fresh)
      throw InputError(where + " cases (" + it->second + ") and (" + values +
                           ") resolve to the same deck: it would run twice (a value listed twice, as 1 and 1.0?)",
                       true);
    c.output.dir = dir;
    out.push_back(std::move(c));
    std::size_t a = 0;
    for (; a < axes.size(); ++a) {
      if (++idx[a] < axes[a].second.size()) break;
      idx[a] = 0;
    }
    if (a == axes.size()) break;
  }
  return out;
}

std::vector<StrategyPair> resolveStrategies(const Deck& deck) {
  static const std::vector<std::string> packers = packerNames();
  static const std::vector<std::string> shardings = shardingNames();
  std::vector<StrategyPair> out;
  if (deck.run.strategies.empty()) {
    out.push_back({deck.packing.strategy + "+" + deck.cp.strategy, deck.packing.strategy, deck.cp.strategy});
    return out;
  }
  std::set<std::string> seen;
  for (const auto& s : deck.run.strategies) {
    if (!seen.insert(s).second) throw InputError("key 'run.strategies': \"" + s + "\" is listed twice");
    if (s == "plain")
      out.push_back({s, "original", "per_sequence"});
    else if (s == "fixed")
      out.push_back({s, "fixed_greedy", "per_document"});
    else if (s == "wlb")
      out.push_back({s, "wlb", "adaptive"});
    else if (s == "slimpack")  // under CP, each MicroPack is sharded per document
      out.push_back({s, "slimpack", "per_document"});
    else {
      const auto plus = s.find('+');
      if (plus == std::string::npos)
        throw InputError("key 'run.strategies': \"" + s +
                         "\" is neither plain, fixed, wlb, slimpack nor PACKER+SHARDING (e.g. best_fit+per_document)");
      const std::string p = s.substr(0, plus), c = s.substr(plus + 1);
      if (std::find(packers.begin(), packers.end(), p) == packers.end())
        throw InputError("key 'run.strategies': unknown packer \"" + p + "\" in \"" + s + "\" (did you mean \"" +
                         nearest(p, packers) + "\"?)");
      if (std::find(shardings.begin(), shardings.end(), c) == shardings.end())
        throw InputError("key 'run.strategies': unknown sharding \"" + c + "\" in \"" + s + "\" (did you mean \"" +
                         nearest(c, shardings) + "\"?)");
      out.push_back({s, p, c});
    }
  }
  return out;
}

}  // namespace wlb
