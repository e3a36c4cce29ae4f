// The loaders below read files by path; a fuzzer hands them its input through one
// in-memory file (memfd) named /proc/self/fd/N, rewritten for every input, so no disk is
// touched and the loaders' own open/stat/read paths are exercised as they are in use.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace cumulus::fuzz {

inline std::string fuzz_file(const uint8_t* data, size_t size) {
  static const int fd = [] {
    const int f = ::memfd_create("cumulus_fuzz", 0);
    if (f < 0) std::abort();
    return f;
  }();
  if (::ftruncate(fd, 0) != 0) std::abort();
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) std::abort();
    done += static_cast<size_t>(n);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

}  // namespace cumulus::fuzz
