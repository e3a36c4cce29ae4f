// Memory, address-space and stdout checks of the CLI (limits.h).
#include "limits.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "core/check.h"
#include "cumulus/core/error.h"
#include "cumulus/core/host_memory.h"

namespace cumulus::cli {
namespace {

// A "Key:   N kB" line of a /proc file, in bytes; 0 when absent.
uint64_t proc_kb(const char* file, const std::string& key) {
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line))
    if (line.compare(0, key.size(), key) == 0 && line.size() > key.size() && line[key.size()] == ':')
      return std::strtoull(line.c_str() + key.size() + 1, nullptr, 10) * 1024;
  return 0;
}

std::string mib(uint64_t b) { return fmt::format("{:.1f} MiB", static_cast<double>(b) / 1048576.0); }

std::string gib(uint64_t b) {
  return b >= (uint64_t{1} << 30) ? fmt::format("{:.2f} GiB", static_cast<double>(b) / 1073741824.0) : mib(b);
}

}  // namespace

MemoryRoom memory_room() {
  MemoryRoom r;
  if (const uint64_t avail = host_available_bytes(); avail > 0) {
    r.bytes = avail;
    r.source = "MemAvailable in /proc/meminfo";
  }
  rlimit lim{};
  if (::getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    const uint64_t used = proc_kb("/proc/self/status", "VmSize");
    const uint64_t room = lim.rlim_cur > used ? lim.rlim_cur - used : 0;
    if (room < r.bytes) {
      r.bytes = room;
      r.source = fmt::format("the address-space limit (ulimit -v) of {} less the {} in use", mib(lim.rlim_cur),
                             mib(used));
    }
  }
  return r;
}

void address_space_check() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_AS, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return;
  const uint64_t used = proc_kb("/proc/self/status", "VmSize");
  const uint64_t room = lim.rlim_cur > used ? lim.rlim_cur - used : 0;
  CUMULUS_CHECK(room >= kBlasThreadBuffer + (uint64_t{64} << 20),
                "the address-space limit (ulimit -v) of {} leaves {} free after the {} this process maps at start; "
                "OpenBLAS maps {} per thread and the run needs more: raise the limit to at least {}",
                mib(lim.rlim_cur), mib(room), mib(used), mib(kBlasThreadBuffer),
                mib(used + kBlasThreadBuffer + (uint64_t{64} << 20)));
}

uint64_t memory_weights_bytes(const std::string& model_path, const ModelConfig& c, WeightStorage storage) {
  if (storage == WeightStorage::compact) {
    struct stat st {};
    return ::stat(model_path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
  }
  const uint64_t d = static_cast<uint64_t>(c.dim), q = static_cast<uint64_t>(c.n_heads) * c.head_dim,
                 kv = static_cast<uint64_t>(c.n_kv_heads) * c.head_dim;
  const uint64_t layer = d * q + 2 * d * kv + q * d + 3 * d * static_cast<uint64_t>(c.hidden_dim);
  const uint64_t params = static_cast<uint64_t>(c.vocab_size) * d * (c.tied_output ? 1 : 2) +
                          static_cast<uint64_t>(c.n_layers) * layer;
  return 4 * params;
}

uint64_t memory_kv_bytes(const ModelConfig& c, DType kv_dtype, int64_t tokens, int sessions) {
  // K and V rows of every layer (a sliding-window layer holds its window).
  uint64_t rows = 0;
  for (int l = 0; l < c.n_layers; ++l)
    rows += static_cast<uint64_t>(c.is_local(l) ? std::min<int64_t>(tokens, c.sliding_window) : tokens);
  const uint64_t per_token = 2 * static_cast<uint64_t>(c.n_kv_heads) * c.head_dim * dtype_size(kv_dtype);
  return rows * per_token * static_cast<uint64_t>(std::max(1, sessions));
}

void memory_check(std::string_view what, uint64_t weights, uint64_t kv, uint64_t other, std::string_view detail) {
  const MemoryRoom room = memory_room();
  const uint64_t need = weights + kv + other;
  CUMULUS_CHECK(need <= room.bytes,
                "{} needs about {} of memory (weights {}, KV cache {}{}{}) but {} is available ({})", what, gib(need),
                gib(weights), gib(kv), other > 0 ? ", other " + gib(other) : std::string(),
                detail.empty() ? std::string() : "; " + std::string(detail), gib(room.bytes), room.source);
}

void stdout_check() {
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  CUMULUS_CHECK(flushed && !std::ferror(stdout), "writing to stdout failed ({}): the output is incomplete",
                err != 0 ? std::strerror(err) : "a write error");
}

}  // namespace cumulus::cli
