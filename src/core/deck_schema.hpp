#pragma once
/// \file deck_schema.hpp
/// \brief The table of every deck key: type, range or choices, default (the Deck
/// struct's initialiser), help text and where it lives in Deck. Parsing, `--set`,
/// `[sweep]`, the resolved TOML and `wlb validate --reference` all read this table.

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/deck.hpp"

namespace wlb {

enum class Kind { Int, UInt, Float, String, IntList, StringList };

struct KeySpec {
  std::string table, key;
  Kind kind;
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  std::vector<std::string> choices;  ///< allowed strings (empty: any)
  std::string help;
  std::function<void*(Deck&)> ptr;   ///< the field this key sets
  bool derived = false;              ///< computed during resolution; not settable

  std::string name() const { return table + "." + key; }
  std::string rangeText() const;
};

const std::vector<KeySpec>& deckSchema();

/// Names accepted by [packing] strategy and [cp] strategy.
const std::vector<std::string>& packerNames();
const std::vector<std::string>& shardingNames();
/// Length generator presets accepted by [data] preset.
const std::vector<std::string>& presetNameList();

/// Markdown reference of every key (docs/decks.md is generated from it).
std::string deckReferenceMarkdown();

}  // namespace wlb
