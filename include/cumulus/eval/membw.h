// Read bandwidth of the machine, measured the way decode attention reads memory: every
// thread of the pool streams over its share of a buffer much larger than the last-level
// cache and sums it. The bench reports each method's GB/s against this figure, measured in
// the same run with the same thread count (docs/architecture.md "Performance rules").
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cumulus/core/thread_pool.h"

namespace cumulus {

struct MemBwOptions {
  size_t bytes = size_t{1} << 30;  // buffer size, >= 64 MiB (well past any LLC here)
  int warmup = 1;                  // untimed passes, [0, 100]
  int repeats = 5;                 // timed passes, [1, 1000]
};

// Two loops are timed: a plain sum and one that also prefetches 4 KiB ahead (as the
// attention kernels do); the result is the better median, so a kernel's share of it is
// never overstated.
struct MemBwResult {
  size_t bytes = 0;
  int threads = 0;
  double gbps_median = 0;    // 1e9 bytes per second: max of the two loops' medians
  double gbps_max = 0;       // best pass of the chosen loop
  std::vector<double> gbps;  // [repeats] the chosen loop's passes
  std::vector<double> gbps_plain, gbps_prefetch;  // [repeats] each loop's passes
};

// The probe with its buffer allocated and written once (by the pool, so pages sit near the
// threads), for measuring again and again in one run (before and after each benchmark
// row) without paying a fresh allocation and first touch each time. Throws Error naming a
// bad bytes (range as MemBwOptions), warmup or repeats.
class MemBwProbe {
 public:
  MemBwProbe(ThreadPool& pool, size_t bytes = MemBwOptions{}.bytes);
  ~MemBwProbe();
  MemBwProbe(const MemBwProbe&) = delete;
  MemBwProbe& operator=(const MemBwProbe&) = delete;
  MemBwResult measure(int warmup = MemBwOptions{}.warmup, int repeats = MemBwOptions{}.repeats);

 private:
  ThreadPool& pool_;
  size_t n_blocks_ = 0;
  uint64_t* buf_ = nullptr;
};

// One probe, measured once. Throws Error naming a bad option.
MemBwResult membw_measure(ThreadPool& pool, const MemBwOptions& options = {});

// Size of the last-level cache from sysfs (cpu0's highest-level unified cache); 0 when
// unknown.
size_t llc_bytes();

// Pushes other data out of the caches by streaming over its own buffer, so that a timed
// step that follows reads its K/V from memory, as it does in a model where every other
// layer's cache passes through the LLC between two visits of one layer.
class CacheEvictor {
 public:
  CacheEvictor(size_t bytes, ThreadPool& pool);  // bytes >= 1 MiB
  ~CacheEvictor();
  CacheEvictor(const CacheEvictor&) = delete;
  CacheEvictor& operator=(const CacheEvictor&) = delete;
  void run();
  size_t bytes() const { return n_blocks_ * kBlock; }

 private:
  static constexpr size_t kBlock = size_t{1} << 20;
  ThreadPool& pool_;
  size_t n_blocks_ = 0;
  uint64_t* buf_ = nullptr;
  std::vector<uint64_t> sums_;
};

}  // namespace cumulus
