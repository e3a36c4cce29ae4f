// Host memory the process can still take (memory checks before any work, such as the GPU
// runtime's pinned host tier). Plain C++.
#pragma once

#include <cstddef>
#include <string_view>

namespace cumulus {

// MemAvailable of a /proc/meminfo text, in bytes (the kernel's estimate of the memory new
// allocations can take without swapping); 0 when the line is absent or malformed.
size_t meminfo_available_bytes(std::string_view meminfo);
// This host's MemAvailable (/proc/meminfo); 0 where it cannot be read (not Linux): the
// caller then has no figure to check against and says so.
size_t host_available_bytes();

}  // namespace cumulus
