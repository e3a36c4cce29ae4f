// Read-bandwidth probe (include/cumulus/eval/membw.h). The buffer is split into a fixed
// number of blocks; threads take blocks from the pool and sum them as 64-bit integers with
// eight independent accumulators, which the compiler vectorises and which keeps the loop
// bound by memory, not by an add chain. The buffer is written first (so its pages are real
// memory, not the shared zero page) by the same pool, so pages sit near the threads that
// will read them.
#include "cumulus/eval/membw.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "core/check.h"
#include "cumulus/core/buffer.h"

namespace cumulus {

namespace {

constexpr size_t kBlockBytes = size_t{1} << 20;  // 1 MiB per task

// p: [n_groups][8] words (one 64-byte line per group).
uint64_t block_sum(const uint64_t* p, size_t n_groups) {
  uint64_t acc[8] = {};
  for (size_t g = 0; g < n_groups; ++g)
    for (int j = 0; j < 8; ++j) acc[j] += p[g * 8 + j];
  uint64_t s = 0;
  for (uint64_t a : acc) s += a;
  return s;
}

// The same with a software prefetch kPrefetchBytes ahead, as the attention kernels do.
// Prefetching past the buffer's end is harmless: prefetches never fault.
constexpr size_t kPrefetchBytes = 4096;
uint64_t block_sum_prefetch(const uint64_t* p, size_t n_groups) {
  uint64_t acc[8] = {};
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t g = 0; g < n_groups; ++g) {
    __builtin_prefetch(c + g * 64 + kPrefetchBytes);
    for (int j = 0; j < 8; ++j) acc[j] += p[g * 8 + j];
  }
  uint64_t s = 0;
  for (uint64_t a : acc) s += a;
  return s;
}

}  // namespace

MemBwProbe::MemBwProbe(ThreadPool& pool, size_t bytes) : pool_(pool) {
  CUMULUS_CHECK(bytes >= (size_t{64} << 20) && bytes <= (size_t{64} << 30), "bytes={} must be in [64 MiB, 64 GiB]",
                bytes);
  n_blocks_ = bytes / kBlockBytes;
  const size_t words_per_block = kBlockBytes / sizeof(uint64_t);
  // Raw allocation: a vector would zero it on one thread before the pool's first touch.
  buf_ = static_cast<uint64_t*>(std::aligned_alloc(kAlignment, n_blocks_ * kBlockBytes));
  CUMULUS_CHECK(buf_ != nullptr, "cannot allocate bytes={}", n_blocks_ * kBlockBytes);
  pool_.parallel_for(static_cast<int64_t>(n_blocks_), [&](int64_t b, int) {
    uint64_t* p = buf_ + b * words_per_block;
    for (size_t i = 0; i < words_per_block; ++i) p[i] = static_cast<uint64_t>(b) * 0x9e3779b97f4a7c15ULL + i;
  });
}

MemBwProbe::~MemBwProbe() { std::free(buf_); }

MemBwResult MemBwProbe::measure(int warmup, int repeats) {
  CUMULUS_CHECK(warmup >= 0 && warmup <= 100, "warmup={} must be in [0, 100]", warmup);
  CUMULUS_CHECK(repeats >= 1 && repeats <= 1000, "repeats={} must be in [1, 1000]", repeats);
  const size_t words_per_block = kBlockBytes / sizeof(uint64_t);
  std::vector<uint64_t> sums(n_blocks_);
  MemBwResult r;
  r.bytes = n_blocks_ * kBlockBytes;
  r.threads = pool_.n_threads();
  volatile uint64_t sink = 0;  // the sums feed a value the optimiser must keep
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x.size() % 2 ? x[x.size() / 2] : 0.5 * (x[x.size() / 2 - 1] + x[x.size() / 2]);
  };
  for (int prefetch = 0; prefetch < 2; ++prefetch) {
    std::vector<double>& samples = prefetch ? r.gbps_prefetch : r.gbps_plain;
    for (int pass = 0; pass < warmup + repeats; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      pool_.parallel_for(static_cast<int64_t>(n_blocks_), [&](int64_t b, int) {
        const uint64_t* p = buf_ + b * words_per_block;
        sums[b] = prefetch ? block_sum_prefetch(p, words_per_block / 8) : block_sum(p, words_per_block / 8);
      });
      const auto t1 = std::chrono::steady_clock::now();
      for (uint64_t s : sums) sink = sink + s;
      if (pass >= warmup)
        samples.push_back(static_cast<double>(r.bytes) / std::chrono::duration<double>(t1 - t0).count() * 1e-9);
    }
  }
  // The reference is the better of the two loops, so that no kernel's share is overstated.
  const double plain = median(r.gbps_plain), pre = median(r.gbps_prefetch);
  r.gbps = plain >= pre ? r.gbps_plain : r.gbps_prefetch;
  r.gbps_median = std::max(plain, pre);
  r.gbps_max = *std::max_element(r.gbps.begin(), r.gbps.end());
  return r;
}

MemBwResult membw_measure(ThreadPool& pool, const MemBwOptions& o) {
  MemBwProbe probe(pool, o.bytes);
  return probe.measure(o.warmup, o.repeats);
}

size_t llc_bytes() {
  size_t best = 0;
  int best_level = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_f(dir + "level"), type_f(dir + "type"), size_f(dir + "size");
    if (!level_f || !type_f || !size_f) break;
    int level = 0;
    std::string type, size;
    level_f >> level;
    type_f >> type;
    size_f >> size;
    if (type == "Instruction" || size.empty() || level < best_level) continue;
    size_t v = 0;
    size_t i_end = 0;
    while (i_end < size.size() && size[i_end] >= '0' && size[i_end] <= '9') v = v * 10 + (size[i_end++] - '0');
    const char unit = i_end < size.size() ? size[i_end] : 'B';
    if (unit == 'K') v <<= 10;
    if (unit == 'M') v <<= 20;
    if (unit == 'G') v <<= 30;
    best = v;
    best_level = level;
  }
  return best;
}

CacheEvictor::CacheEvictor(size_t bytes, ThreadPool& pool) : pool_(pool) {
  CUMULUS_CHECK(bytes >= kBlock, "bytes={} must be >= 1 MiB", bytes);
  n_blocks_ = bytes / kBlock;
  buf_ = static_cast<uint64_t*>(std::aligned_alloc(kAlignment, n_blocks_ * kBlock));
  CUMULUS_CHECK(buf_ != nullptr, "cannot allocate bytes={}", n_blocks_ * kBlock);
  sums_.resize(n_blocks_);
  const size_t words = kBlock / sizeof(uint64_t);
  pool_.parallel_for(static_cast<int64_t>(n_blocks_), [&](int64_t b, int) {
    for (size_t i = 0; i < words; ++i) buf_[b * words + i] = i ^ static_cast<uint64_t>(b);
  });
}

CacheEvictor::~CacheEvictor() { std::free(buf_); }

void CacheEvictor::run() {
  const size_t words = kBlock / sizeof(uint64_t);
  pool_.parallel_for(static_cast<int64_t>(n_blocks_),
                     [&](int64_t b, int) { sums_[b] = block_sum(buf_ + b * words, words / 8); });
  volatile uint64_t keep = 0;
  for (uint64_t s : sums_) keep = keep + s;
}

}  // namespace cumulus
