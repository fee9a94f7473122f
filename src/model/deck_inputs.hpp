#pragma once
/// \file inputs.hpp
/// \brief The files a deck makes a command read, so that no output of the command can
/// overwrite one of them (core/output_file.hpp checks the outputs against this list).

#include <string>
#include <vector>

#include "core/deck.hpp"

namespace wlb::model {

/// The deck file, its hardware profile, its length source's files (`data.path`; a Megatron
/// index with its `.bin`) and `train.dataset`'s four files. Paths as the commands open them.
std::vector<std::string> deckInputFiles(const Deck& deck);

}  // namespace wlb::model
