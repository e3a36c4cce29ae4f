// The identity of a model file (model_identity.h): a hash of its metadata, its tensor table
// and a sample of its tensor data, read with bounded preads.
#include "cumulus/model/model_identity.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "cumulus/kv/kv_snapshot.h"
#include "cumulus/model/gguf.h"
#include "cumulus/model/model_weights.h"

namespace cumulus {
namespace {

constexpr uint64_t kLlama2cHeaderBytes = 28;
constexpr uint64_t kDataSample = 64 << 10;

}  // namespace

uint64_t model_identity(const std::string& path) {
  const ModelFormat format = model_format_of(path);
  // Where the tensor data starts: everything before it is metadata and tensor table.
  const uint64_t data_offset =
      format == ModelFormat::gguf ? GgufFile::open(path).data_offset() : kLlama2cHeaderBytes;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CUMULUS_CHECK(fd >= 0, "model '{}': cannot open ({})", path, std::strerror(errno));
  const off_t end = ::lseek(fd, 0, SEEK_END);
  auto read_range = [&](uint64_t begin, uint64_t n) {
    std::vector<uint8_t> buf(n);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd, buf.data() + done, n - done, static_cast<off_t>(begin + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        const int err = errno;
        ::close(fd);
        CUMULUS_FAIL("model '{}': read of bytes [{}, {}) failed ({})", path, begin, begin + n,
                     r == 0 ? "end of file" : std::strerror(err));
      }
      done += static_cast<size_t>(r);
    }
    return buf;
  };
  if (end < 0 || static_cast<uint64_t>(end) < data_offset) {
    ::close(fd);
    CUMULUS_FAIL("model '{}': {} bytes, shorter than its metadata ({} bytes)", path, static_cast<int64_t>(end),
                 data_offset);
  }
  const uint64_t size = static_cast<uint64_t>(end);
  uint8_t size_le[8];
  for (int i = 0; i < 8; ++i) size_le[i] = static_cast<uint8_t>(size >> (8 * i));
  uint64_t h = fnv1a64(size_le, 8);
  // The metadata is read in pieces: a GGUF header with a large vocabulary is megabytes.
  for (uint64_t at = 0; at < data_offset; at += kDataSample) {
    const std::vector<uint8_t> b = read_range(at, std::min(kDataSample, data_offset - at));
    h = fnv1a64(b.data(), b.size(), h);
  }
  const uint64_t data = size - data_offset;
  const uint64_t head = std::min(kDataSample, data);
  const uint64_t tail = std::min(kDataSample, data - head);
  for (const auto& [begin, n] : {std::pair{data_offset, head}, std::pair{size - tail, tail}}) {
    const std::vector<uint8_t> b = read_range(begin, n);
    h = fnv1a64(b.data(), b.size(), h);
  }
  ::close(fd);
  return h;
}

}  // namespace cumulus
