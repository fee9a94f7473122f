#include "runtime/gemm_timer.hpp"

#include <cstdio>
#include <sstream>
#include <stdexcept>

namespace wlb::runtime {

void GemmTimer::add(const char* name, double seconds, double flops) {
  if (!active_) return;
  merge({Row{strategy_, name, 1, seconds, flops}});
}

void GemmTimer::merge(const std::vector<Row>& other) {
  for (const Row& o : other) {
    Row* hit = nullptr;
    for (Row& r : rows_)  // a few dozen rows: a linear scan keeps first-call order simply
      if (r.strategy == o.strategy && r.name == o.name) {
        hit = &r;
        break;
      }
    if (!hit) {
      rows_.push_back(o);
      continue;
    }
    hit->calls += o.calls;
    hit->seconds += o.seconds;
    hit->flops += o.flops;
  }
}

std::string GemmTimer::serialize() const {
  std::string out;
  char num[96];
  for (const Row& r : rows_) {
    std::snprintf(num, sizeof num, "\t%lld\t%.17g\t%.17g\n", static_cast<long long>(r.calls), r.seconds, r.flops);
    out += r.strategy + "\t" + r.name + num;
  }
  return out;
}

std::vector<GemmTimer::Row> GemmTimer::parse(const std::string& text) {
  std::vector<Row> rows;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream f(line);
    Row r;
    if (!std::getline(f, r.strategy, '\t') || !std::getline(f, r.name, '\t') || !(f >> r.calls >> r.seconds >> r.flops))
      throw std::logic_error("GemmTimer::parse: malformed line '" + line + "'");
    rows.push_back(std::move(r));
  }
  return rows;
}

}  // namespace wlb::runtime
