#include "model/deck_inputs.hpp"

#include "data/length_source.hpp"
#include "model/cost_model.hpp"

namespace wlb::model {

std::vector<std::string> deckInputFiles(const Deck& deck) {
  std::vector<std::string> in{deck.source_path, HardwareProfile::pathOf(deck)};
  if (deck.data.source != "generator") {
    const std::string path = data::resolvePath(deck, deck.data.path);
    in.push_back(path);
    if (deck.data.source == "megatron" && path.size() > 4 && path.compare(path.size() - 4, 4, ".idx") == 0)
      in.push_back(path.substr(0, path.size() - 4) + ".bin");
  }
  if (const std::string p = data::resolveDatasetPrefix(deck, deck.train.dataset); !p.empty())
    for (const char* f : {"_train.idx", "_train.bin", "_valid.idx", "_valid.bin"}) in.push_back(p + f);
  return in;
}

}  // namespace wlb::model
