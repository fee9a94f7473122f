// `wlb data stats [DECK]`: length statistics of a deck's source or of every preset.
// `wlb data prepare SRC --out PREFIX`: text documents -> Megatron .bin/.idx (docs/data.md).
#include <iostream>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "app/cleanup.hpp"
#include "app/command.hpp"
#include "core/error.hpp"
#include "data/length_source.hpp"
#include "data/prepare.hpp"

namespace {

struct Opts {
  wlb::app::DeckArgs deck;
  std::string preset;
  bool all = false;
  std::int64_t steps = 100;
  std::int64_t window = 0;
  wlb::data::PrepareOptions prepare;
};

void printStats(const std::string& title, const wlb::data::LengthStats& s, std::int64_t S) {
  std::cout << fmt::format("== {}\n", title);
  std::cout << fmt::format("documents {}  tokens {}  mean {:.1f}  min {}  max {}\n", s.count, s.total_tokens, s.mean,
                           s.min, s.max);
  std::string pc;
  for (const auto& [p, v] : s.percentiles) pc += fmt::format("  p{:g}={}", p, v);
  std::cout << "percentiles:" << pc << "\n";
  std::cout << fmt::format("{:>22} {:>10} {:>8} {:>8}\n", "length bucket", "docs", "doc%", "token%");
  for (const auto& b : s.buckets) {
    if (b.count == 0 && b.lo > S) continue;
    const std::string range = b.lo > S
                                  ? fmt::format("> {}", S)
                                  : fmt::format("[{}, {}{}", b.lo, b.hi - 1 == S ? S : b.hi, b.hi - 1 == S ? "]" : ")");
    std::cout << fmt::format("{:>22} {:>10} {:>7.2f}% {:>7.2f}%\n", range, b.count,
                             s.count ? 100.0 * b.count / s.count : 0.0,
                             s.total_tokens ? 100.0 * b.tokens / s.total_tokens : 0.0);
  }
}

int runStats(const Opts& o) {
  using namespace wlb;
  Deck deck;
  // Without a deck, the defaults with the --set overrides (which name the source to read).
  deck = o.deck.path.empty() ? parseDeck("", "defaults", o.deck.overrides) : o.deck.load("wlb data stats");
  if (o.window != 0) {  // the deck key's own range (0: not given)
    if (o.window < 16 || o.window > (std::int64_t{1} << 26))
      throw InputError(
          "--window: " + std::to_string(o.window) + " is outside data.context_window's range [16, 67108864]", true);
    deck.data.context_window = o.window;
  }
  if (o.steps < 1) throw InputError("--steps: must be >= 1", true);
  std::vector<std::string> presets;
  if (o.all)
    presets = data::presetNames();
  else if (!o.preset.empty())
    presets = {o.preset};
  const bool root = app::worldRank() == 0;
  auto statsOf = [&](const Deck& d) {
    auto src = data::makeLengthSource(d);
    std::vector<std::int64_t> lens;
    const std::int64_t epoch = src->documentsPerEpoch();
    for (std::int64_t t = 0; epoch > 0 ? static_cast<std::int64_t>(lens.size()) < epoch : t < o.steps; ++t)
      for (const auto& doc : src->next(t)) {
        if (epoch > 0 && static_cast<std::int64_t>(lens.size()) >= epoch) break;
        lens.push_back(doc.length);
      }
    return std::make_pair(src->describe(), data::computeLengthStats(lens, d.data.context_window));
  };
  if (presets.empty()) {
    std::pair<std::string, data::LengthStats> stats;
    app::onEveryRank([&] { stats = statsOf(deck); });  // none fails alone, its message unprinted
    const auto& [desc, st] = stats;
    if (root)
      printStats(fmt::format("{} (S={}{})", desc, deck.data.context_window,
                             deck.data.source == "generator" ? fmt::format(", {} steps", o.steps) : ", one epoch"),
                 st, deck.data.context_window);
    return 0;
  }
  for (const auto& p : presets) {
    Deck d = deck;
    d.data.source = "generator";
    d.data.preset = p;
    const auto& spec = data::presetByName(p);
    auto [desc, st] = statsOf(d);
    if (root) {
      printStats(fmt::format("{} (S={}, {} steps)", desc, d.data.context_window, o.steps), st, d.data.context_window);
      std::cout << "fitted to: " << spec.sources << "\n\n";
    }
  }
  return 0;
}

int runPrepare(const Opts& o) {
  using namespace wlb;
  auto opt = o.prepare;
  const bool root = app::worldRank() == 0;
  // one process writes; other ranks of an accidental mpiexec would race on the same files
  if (!root) return 0;
  opt.track_temporary = app::trackTemporary;
  const auto r = data::prepareDataset(opt);
  std::cout << fmt::format(
      "source {}: {} regular files ({} shorter than --min-bytes {} skipped{}), {} symbolic "
      "links or other entries skipped{}{}, {} files split by --max-bytes\n",
      opt.source, r.regular_files, r.skipped_small, opt.min_bytes,
      opt.max_file_bytes > 0
          ? fmt::format(", {} longer than --max-file-bytes {} skipped", r.skipped_large, opt.max_file_bytes)
          : std::string(),
      r.skipped_other,
      r.skipped_datasets > 0 ? fmt::format(", {} files of token datasets (.idx/.bin) skipped", r.skipped_datasets)
                             : std::string(),
      r.skipped_hard_links > 0 ? fmt::format(", {} hard links to a file already taken skipped", r.skipped_hard_links)
                               : std::string(),
      r.cut_files);
  std::cout << fmt::format("tokenizer {} (vocab {}), tokens uint16, valid fraction {:g}, order {}\n",
                           data::ByteTokenizer::name(), data::ByteTokenizer::kVocabSize, opt.valid_fraction,
                           opt.shuffle ? fmt::format("shuffled (seed {})", opt.shuffle_seed) : std::string("path"));
  std::cout << fmt::format("{:<6} {:>10} {:>10} {:>14}  {}\n", "split", "files", "documents", "tokens", "output");
  std::cout << fmt::format("{:<6} {:>10} {:>10} {:>14}  {}.{{bin,idx}}\n", "train", r.train.files, r.train.documents,
                           r.train.tokens, r.train_prefix);
  std::cout << fmt::format("{:<6} {:>10} {:>10} {:>14}  {}.{{bin,idx}}\n", "valid", r.valid.files, r.valid.documents,
                           r.valid.tokens, r.valid_prefix);
  if (r.valid.documents == 0 && opt.valid_fraction > 0)
    std::cerr << fmt::format(
        "wlb data prepare: warning: no document fell into the held-out split (valid "
        "fraction {:g} of {} files); raise --valid-fraction\n",
        opt.valid_fraction, r.train.files);
  return 0;
}

const bool registered = wlb::app::registerCommand(
    "data", "Document-length sources and datasets: `wlb data stats|prepare`", [](CLI::App& sub) {
      auto o = std::make_shared<Opts>();
      sub.require_subcommand(1);
      CLI::App* stats = sub.add_subcommand("stats", "Count, mean, percentiles and token share by length bucket");
      wlb::app::addDeckArgs(*stats, o->deck, /*optional=*/true);
      auto* preset = stats->add_option("--preset", o->preset, "Generator preset (overrides the deck's source)");
      stats->add_flag("--all-presets", o->all, "Every generator preset")->excludes(preset);
      stats->add_option("--steps", o->steps, "Steps (global batches) to sample from a generator")
          ->check(wlb::app::intAtLeast(1, wlb::app::kMaxStepsOption));
      stats->add_option("--window", o->window, "Context window S (overrides data.context_window)");
      CLI::App* prep = sub.add_subcommand(
          "prepare", "Text documents (a directory or tarball) -> Megatron .bin/.idx, byte-level tokens, train/valid");
      prep->add_option("SRC", o->prepare.source,
                       "Directory (one document per regular file) or tarball (.tar, .tar.gz/.tgz, .tar.xz, .tar.bz2)")
          ->required();
      prep->add_option("--out", o->prepare.out_prefix,
                       "Output prefix: writes PREFIX_train.{bin,idx}, PREFIX_valid.{bin,idx}")
          ->required();
      prep->add_option("--valid-fraction", o->prepare.valid_fraction,
                       "Share of documents held out for evaluation, chosen by a hash of the path (default 0)");
      prep->add_option("--min-bytes", o->prepare.min_bytes, "Skip files shorter than this (default 1: empty files)")
          ->check(wlb::app::intAtLeast(1));
      prep->add_option("--max-bytes", o->prepare.max_bytes,
                       "Split longer files into consecutive documents of this many bytes (default 0: no cap)")
          ->check(wlb::app::intAtLeast(0));
      prep->add_option("--max-file-bytes", o->prepare.max_file_bytes,
                       "Skip files longer than this (default 0: keep every file; a deterministic subset)")
          ->check(wlb::app::intAtLeast(0));
      prep->add_option("--shuffle", o->prepare.shuffle_seed,
                       "Write documents in a deterministic shuffled order keyed by SEED and the path "
                       "(default: sorted path order)")
          ->check(CLI::Validator(  // "-3" would wrap to a huge unsigned seed; seeds up to 2^64 - 1 are fine
              [](std::string& s) {
                if (s.rfind('-', 0) == 0) return "must be at least 0 (got " + s + ")";
                try {  // past 2^64 - 1 the parse would saturate to another seed
                  std::size_t end = 0;
                  (void)std::stoull(s, &end, 10);
                  if (end != s.size()) return "must be an integer (got " + s + ")";
                } catch (const std::exception&) {
                  return "must be an integer in [0, 18446744073709551615] (got " + s + ")";
                }
                return std::string();
              },
              "SEED >= 0"))
          ->each([o](const std::string&) { o->prepare.shuffle = true; });
      return [o, prep]() { return prep->parsed() ? runPrepare(*o) : runStats(*o); };
    });

}  // namespace
