// Read bandwidth of the machine, measured the way decode attention reads memory: every
// thread of the pool streams over its share of a buffer much larger than the last-level
// cache and sums it. The bench reports each method's GB/s against this figure, measured in
// the same run with the same thread count (docs/architecture.md "Performance rules").
#pragma once

#include <cstddef>
#include <vector>

#include "cumulus/core/thread_pool.h"

namespace cumulus {

struct MemBwOptions {
  size_t bytes = size_t{1} << 30;  // buffer size, >= 64 MiB (well past any LLC here)
  int warmup = 1;                  // untimed passes, [0, 100]
  int repeats = 5;                 // timed passes, [1, 1000]
};

struct MemBwResult {
  size_t bytes = 0;
  int threads = 0;
  double gbps_median = 0;    // 1e9 bytes per second
  double gbps_max = 0;
  std::vector<double> gbps;  // [repeats] every timed pass
};

// Throws Error naming a bad option.
MemBwResult membw_measure(ThreadPool& pool, const MemBwOptions& options = {});

}  // namespace cumulus
