#include "runtime/op_timer.hpp"

#include <Kokkos_Core.hpp>

#include <cstdio>
#include <sstream>
#include <stdexcept>

namespace wlb::runtime {

void OpTimer::add(const char* name, double seconds, double flops) {
  if (!active_) return;
  merge({Row{strategy_, name, 1, seconds, flops}});
}

void OpTimer::merge(const std::vector<Row>& other) {
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

std::string OpTimer::serialize() const {
  std::string out;
  char num[96];
  for (const Row& r : rows_) {
    std::snprintf(num, sizeof num, "\t%lld\t%.17g\t%.17g\n", static_cast<long long>(r.calls), r.seconds, r.flops);
    out += r.strategy + "\t" + r.name + num;
  }
  return out;
}

std::vector<OpTimer::Row> OpTimer::parse(const std::string& text) {
  std::vector<Row> rows;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream f(line);
    Row r;
    if (!std::getline(f, r.strategy, '\t') || !std::getline(f, r.name, '\t') || !(f >> r.calls >> r.seconds >> r.flops))
      throw std::logic_error("OpTimer::parse: malformed line '" + line + "'");
    rows.push_back(std::move(r));
  }
  return rows;
}

// ---- Kokkos kernels through the tool callbacks ------------------------------------------

namespace {

namespace kt = Kokkos::Tools::Experimental;
using Clock = std::chrono::steady_clock;

// The process-wide state the callbacks (plain function pointers) reach: the timer, the
// callbacks KernelHooks replaced, and the operations begun and not yet ended, a stack, so
// that one begun inside another's begin and end (should Kokkos issue one there) still ends
// in order. The id Kokkos hands back only tells a timed kernel from an untimed one.
struct Open {
  std::string name;
  Clock::time_point start;
};
OpTimer* g_timer = nullptr;
kt::EventSet g_saved;
std::vector<Open> g_open;
constexpr std::uint64_t kUntimed = ~std::uint64_t{0};

void begin(std::string name) {
  Kokkos::fence();  // what ran before is not this kernel's
  g_open.push_back(Open{std::move(name), Clock::now()});
}
void end() {
  if (g_open.empty()) return;
  Kokkos::fence();  // a device launch returns before the kernel ends
  const Open o = std::move(g_open.back());
  g_open.pop_back();
  g_timer->add(o.name.c_str(), std::chrono::duration<double>(Clock::now() - o.start).count(), 0.0);
}
void beginKernel(const char* name, const std::uint32_t, std::uint64_t* id) {
  const bool timed = g_timer && g_timer->active();
  if (timed) begin(name);
  *id = timed ? 0 : kUntimed;
}
void endKernel(std::uint64_t id) {
  if (id != kUntimed && g_timer) end();
}
// Deep copies have no id: an untimed one pushes nothing, so its end must know.
std::vector<bool> g_copy_timed;
void beginCopy(Kokkos_Profiling_SpaceHandle, const char* dst, const void*, Kokkos_Profiling_SpaceHandle, const char*,
               const void*, std::uint64_t) {
  const bool timed = g_timer && g_timer->active();
  g_copy_timed.push_back(timed);
  if (timed) begin(std::string("deep_copy ") + (dst && *dst ? dst : "(unlabelled)"));
}
void endCopy() {
  if (g_copy_timed.empty()) return;
  const bool timed = g_copy_timed.back();
  g_copy_timed.pop_back();
  if (timed && g_timer) end();
}

}  // namespace

KernelHooks::KernelHooks(OpTimer& timer) {
  if (g_timer)
    throw std::logic_error("KernelHooks: another instance is installed (Kokkos' callbacks are process-wide)");
  g_timer = &timer;
  g_saved = kt::get_callbacks();
  g_open.clear();
  g_copy_timed.clear();
  kt::set_begin_parallel_for_callback(beginKernel);
  kt::set_end_parallel_for_callback(endKernel);
  kt::set_begin_parallel_reduce_callback(beginKernel);
  kt::set_end_parallel_reduce_callback(endKernel);
  kt::set_begin_parallel_scan_callback(beginKernel);
  kt::set_end_parallel_scan_callback(endKernel);
  kt::set_begin_deep_copy_callback(beginCopy);
  kt::set_end_deep_copy_callback(endCopy);
}

KernelHooks::~KernelHooks() {
  kt::set_callbacks(g_saved);
  g_timer = nullptr;
  g_open.clear();
  g_copy_timed.clear();
}

}  // namespace wlb::runtime
