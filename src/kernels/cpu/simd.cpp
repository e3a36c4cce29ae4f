// The SIMD target cap (kernels/simd.h) over Highway's dispatch. Highway picks, per
// HWY_DYNAMIC_DISPATCH table, the best target that is both compiled into that file and in
// hwy::SupportedTargets(); hwy::SetSupportedTargetsForTest replaces the latter's CPU answer
// with a mask (and re-initialises the dispatch tables), which is how the cap works: the
// mask holds the chosen target and every lesser one the CPU has.
#include "cumulus/kernels/simd.h"

#include <hwy/targets.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include <fmt/format.h>

#include <utility>

#include "cumulus/core/error.h"

namespace cumulus::cpu {
namespace {

struct TargetName {
  const char* name;
  int64_t bit;
};

// The portable fallback: Highway 1.0 compiles HWY_SCALAR, later versions HWY_EMU128.
constexpr int64_t kScalar = (HWY_TARGETS & HWY_EMU128) != 0 ? HWY_EMU128 : HWY_SCALAR;

// Best first. On x86 a smaller bit is a better target (hwy/detect_targets.h).
#if HWY_ARCH_X86
constexpr TargetName kTargets[] = {{"avx512vnni", HWY_AVX3_DL}, {"avx512", HWY_AVX3}, {"avx2", HWY_AVX2},
                                   {"sse4", HWY_SSE4},          {"scalar", kScalar}};
#else
constexpr TargetName kTargets[] = {{"scalar", kScalar}};
#endif

// Every target any kernel file is compiled for: this file carries HWY_WANT_AVX3_DL as
// gemv.cpp and sketch.cpp do (CMakeLists.txt), and the layer's HWY_DISABLED_TARGETS.
constexpr int64_t kCompiled = HWY_TARGETS;

// The CPU's own answer, read once before any cap is set.
int64_t cpu_supported() {
  static const int64_t s = [] {
    hwy::SetSupportedTargetsForTest(0);
    return hwy::SupportedTargets();
  }();
  return s;
}

std::mutex g_mutex;
std::string g_cap;       // "" = no cap
std::string g_cap_from;  // what set it, for simd_target_line

// The message names the variable or argument itself (`what`), not this file's function.
template <class... Args>
void require(bool cond, fmt::format_string<Args...> f, Args&&... args) {
  if (!cond) throw Error(fmt::format(f, std::forward<Args>(args)...));
}

std::string names_of(int64_t mask) {
  std::string out;
  for (const TargetName& t : kTargets)
    if (mask & t.bit) out += (out.empty() ? "" : ", ") + std::string(t.name);
  return out;
}

std::vector<std::string> list_of(int64_t mask) {
  std::vector<std::string> out;
  for (const TargetName& t : kTargets)
    if (mask & t.bit) out.emplace_back(t.name);
  return out;
}

void select_locked(std::string_view name, std::string_view what) {
  const int64_t cpu = cpu_supported();
  if (name.empty() || name == "native") {
    hwy::SetSupportedTargetsForTest(0);
    g_cap.clear();
    g_cap_from.clear();
    return;
  }
  const TargetName* found = nullptr;
  for (const TargetName& t : kTargets)
    if (name == t.name) found = &t;
  require(found != nullptr, "{}{} is not a SIMD target (known: {}, or native)", what, name, names_of(~int64_t{0}));
  require((kCompiled & found->bit) != 0, "{}{}: this build has no {} code (compiled: {})", what, name, name,
                names_of(kCompiled));
  require((cpu & found->bit) != 0, "{}{}: this CPU cannot run {} (it runs: {})", what, name, name,
                names_of(cpu & kCompiled));
  // The chosen target and every lesser one the CPU has: a file not compiled for the chosen
  // target runs its best lesser one, as it would on a CPU whose best is the chosen one.
  const int64_t mask = cpu & ~(found->bit - 1);
  hwy::SetSupportedTargetsForTest(mask);
  g_cap = found->name;
  g_cap_from = std::string(what);
}

}  // namespace

std::vector<std::string> simd_targets_compiled() { return list_of(kCompiled); }

std::vector<std::string> simd_targets_supported() { return list_of(kCompiled & cpu_supported()); }

void simd_select(std::string_view name) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  select_locked(name, "simd_select: target=");
}

void simd_select_from_env() {
  const char* v = std::getenv("CUMULUS_SIMD");
  const std::lock_guard<std::mutex> lock(g_mutex);
  select_locked(v != nullptr ? std::string_view(v) : std::string_view(), "CUMULUS_SIMD=");
}

std::string simd_target() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  const int64_t cpu = cpu_supported();
  int64_t allowed = kCompiled & cpu;
  for (const TargetName& t : kTargets)
    if (t.name == g_cap) allowed &= ~(t.bit - 1);
  for (const TargetName& t : kTargets)
    if (allowed & t.bit) return t.name;
  return "scalar";
}

std::string simd_target_line() {
  const std::string best = simd_targets_supported().empty() ? "scalar" : simd_targets_supported().front();
  const std::string now = simd_target();
  std::string cap;
  {
    const std::lock_guard<std::mutex> lock(g_mutex);
    cap = g_cap_from == "CUMULUS_SIMD=" ? "CUMULUS_SIMD=" + g_cap : g_cap.empty() ? "" : "simd_select(" + g_cap + ")";
  }
  if (now == best && cap.empty()) return now;
  return now + " (" + (cap.empty() ? "" : cap + "; ") + "CPU supports " + best + ")";
}

}  // namespace cumulus::cpu
