// Host memory available (core/host_memory.h): MemAvailable parsed from /proc/meminfo texts
// written as the kernel writes them, and what is not that line or not its format is 0 (no
// figure), never a wrong one.
#include <gtest/gtest.h>

#include <string>

#include "cumulus/core/host_memory.h"

using namespace cumulus;

TEST(HostMemory, MemAvailableInBytes) {
  const std::string meminfo =
      "MemTotal:       131899284 kB\n"
      "MemFree:        129514708 kB\n"
      "MemAvailable:   130101232 kB\n"
      "Buffers:            2108 kB\n";
  EXPECT_EQ(meminfo_available_bytes(meminfo), size_t{130101232} * 1024);
  EXPECT_EQ(meminfo_available_bytes("MemAvailable: 1 kB"), size_t{1024});  // last line, no newline
}

TEST(HostMemory, NoFigureIsZero) {
  EXPECT_EQ(meminfo_available_bytes(""), 0u);
  EXPECT_EQ(meminfo_available_bytes("MemTotal: 100 kB\nMemFree: 50 kB\n"), 0u);
  EXPECT_EQ(meminfo_available_bytes("XMemAvailable: 100 kB\n"), 0u);  // not at a line's start
  EXPECT_EQ(meminfo_available_bytes("MemAvailable:\n"), 0u);
  EXPECT_EQ(meminfo_available_bytes("MemAvailable: lots kB\n"), 0u);
  EXPECT_EQ(meminfo_available_bytes("MemAvailable: 100 MB\n"), 0u);
  EXPECT_EQ(meminfo_available_bytes("MemAvailable: 100\n"), 0u);
  EXPECT_EQ(meminfo_available_bytes("MemAvailable: 99999999999999999999 kB\n"), 0u);
}

TEST(HostMemory, ThisHostHasSome) {
#ifdef __linux__
  EXPECT_GT(host_available_bytes(), size_t{1} << 20);
#else
  GTEST_SKIP() << "no /proc/meminfo";
#endif
}
