// KV snapshot files (kv_snapshot.h; the format field by field in docs/kv_snapshot.md).
//
// Header, 128 bytes, little-endian:
//    0  char[8]  magic "CUMKVSNP"
//    8  u32      version (kKvSnapshotVersion)
//   12  u32      dtype of K and V: 0 f32, 1 f16, 2 bf16
//   16  u64      model_id
//   24  u32      n_layers        28  u32  n_heads       32  u32  n_kv_heads
//   36  u32      head_dim        40  u32  vocab_size    44  u32  page_size
//   48  u32      n_tokens        52  u32  prompt_q_rows 56  u32  setup_bytes
//   60  u8[68]   reserved, zero
// Version 2 adds, after the setup text, the first token of each layer's K/V (u32 per layer).
// Every size below is a product of these fields; each field is bounded first so that the
// products cannot overflow 64 bits, and the total must equal the file's size before any
// section is touched.
#include "cumulus/kv/kv_snapshot.h"

#include <fcntl.h>
// xxHash (Debian's libxxhash-dev) compiled into this file: nothing to link, for the package's
// consumers either.
#define XXH_INLINE_ALL
#include <xxhash.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>

#include "core/check.h"
#include "cumulus/core/file.h"

namespace cumulus {
namespace {

constexpr char kMagic[8] = {'C', 'U', 'M', 'K', 'V', 'S', 'N', 'P'};
constexpr size_t kHeaderBytes = 128;
constexpr size_t kChecksumBytes = 8;
constexpr size_t kSectionAlign = 64;
constexpr uint32_t kMaxSetupBytes = 4096;

size_t align_up(size_t x) { return (x + kSectionAlign - 1) / kSectionAlign * kSectionAlign; }

uint32_t dtype_code(DType t) {
  switch (t) {
    case DType::f32: return 0;
    case DType::f16: return 1;
    case DType::bf16: return 2;
  }
  return 0xffffffffu;
}

// Byte offsets of the sections for a header's fields (checked by check_fields first) and,
// for version 2, the layers' first tokens (each in [0, n_tokens]).
struct Layout {
  size_t first = 0, tokens = 0, logits = 0, prompt_q = 0, kv = 0, total = 0;
  std::vector<size_t> layer_kv;  // [n_layers] offset of each layer's K
};

// The first token of layer l (version 1: every layer from 0).
int first_of(const KvSnapshotInfo& i, int l) { return i.first_token.empty() ? 0 : i.first_token[static_cast<size_t>(l)]; }

Layout layout_of(const KvSnapshotInfo& i, uint32_t version) {
  Layout l;
  l.first = align_up(kHeaderBytes + i.setup.size());
  l.tokens = version >= 2 ? align_up(l.first + 4 * static_cast<size_t>(i.n_layers)) : l.first;
  l.logits = align_up(l.tokens + 4 * static_cast<size_t>(i.n_tokens));
  l.prompt_q = align_up(l.logits + 4 * static_cast<size_t>(i.vocab_size));
  const size_t q = 4 * static_cast<size_t>(i.n_layers) * i.prompt_q_rows * i.n_heads * i.head_dim;
  l.kv = align_up(l.prompt_q + q);
  const size_t row = static_cast<size_t>(i.n_kv_heads) * i.head_dim * dtype_size(i.dtype);
  size_t at = l.kv;
  for (int layer = 0; layer < i.n_layers; ++layer) {
    l.layer_kv.push_back(at);
    at += 2 * static_cast<size_t>(i.n_tokens - first_of(i, layer)) * row;
  }
  l.total = at + kChecksumBytes;
  return l;
}

// Named functions, not lambdas: an Error's prefix is the function's name.
void check_range(const std::string& path, const char* field, int64_t v, int64_t lo, int64_t hi) {
  CUMULUS_CHECK(v >= lo && v <= hi, "KV snapshot '{}': {}={} must be in [{}, {}]", path, field, v, lo, hi);
}

void check_equal(const std::string& path, const char* field, int got, int want) {
  CUMULUS_CHECK(got == want, "KV snapshot '{}': {}={} but this session has {}={}", path, field, got, field, want);
}

// The ranges every field must be in (the reader's and the writer's, so nothing is written
// that cannot be read). With these bounds no size in layout_of exceeds 2^62.
void check_fields(const std::string& path, const KvSnapshotInfo& i, uint32_t setup_bytes) {
  auto range = [&](const char* field, int64_t v, int64_t lo, int64_t hi) { check_range(path, field, v, lo, hi); };
  range("n_layers", i.n_layers, 1, 4096);
  range("n_heads", i.n_heads, 1, 4096);
  range("n_kv_heads", i.n_kv_heads, 1, i.n_heads);
  CUMULUS_CHECK(i.n_heads % i.n_kv_heads == 0, "KV snapshot '{}': n_heads={} is not a multiple of n_kv_heads={}",
                path, i.n_heads, i.n_kv_heads);
  CUMULUS_CHECK(head_dim_supported(i.head_dim),
                "KV snapshot '{}': head_dim={} is not one the kernels support (a multiple of 8 up to 256)", path,
                i.head_dim);
  range("vocab_size", i.vocab_size, 1, 1 << 24);
  CUMULUS_CHECK(i.page_size >= 1 && i.page_size <= 256 && (i.page_size & (i.page_size - 1)) == 0,
                "KV snapshot '{}': page_size={} must be a power of two in [1, 256]", path, i.page_size);
  range("n_tokens", i.n_tokens, 1, 1 << 24);
  range("prompt_q_rows", i.prompt_q_rows, 0, i.n_tokens);
  range("setup_bytes", setup_bytes, 0, kMaxSetupBytes);
}

void check_setup_text(const std::string& path, std::string_view setup) {
  for (size_t j = 0; j < setup.size(); ++j) {
    const auto c = static_cast<unsigned char>(setup[j]);
    CUMULUS_CHECK(c >= 0x20 && c < 0x7f, "KV snapshot '{}': setup byte {} is 0x{:02x}, not printable ASCII", path, j,
                  c);
  }
}

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class T>
void store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// Index of the first element of `n` stored as `dt` that is not finite, or n.
size_t first_non_finite(const void* data, DType dt, size_t n) {
  switch (dt) {
    case DType::f32: {
      const auto* f = static_cast<const float*>(data);
      for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(f[i])) return i;
      return n;
    }
    case DType::f16:
    case DType::bf16: {
      const uint16_t mask = dt == DType::f16 ? 0x7c00 : 0x7f80;
      const auto* h = static_cast<const uint16_t*>(data);
      for (size_t i = 0; i < n; ++i)
        if ((h[i] & mask) == mask) return i;
      return n;
    }
  }
  return 0;
}

}  // namespace

uint64_t fnv1a64(const void* data, size_t n, uint64_t h) {
  const auto* b = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

uint64_t kv_snapshot_checksum(const void* data, size_t n, uint32_t version) {
  return version >= 3 ? XXH3_64bits(data, n) : fnv1a64(data, n);
}

// ---------------------------------------------------------------------------------------
// Writing

void kv_snapshot_write(const std::string& path, const KvSnapshotInfo& info, std::span<const int32_t> tokens,
                       std::span<const float> logits, const std::vector<std::vector<float>>& prompt_q,
                       const KvCache& kv) {
  CUMULUS_CHECK(info.setup.size() <= kMaxSetupBytes, "KV snapshot '{}': setup of {} bytes exceeds {}", path,
                info.setup.size(), kMaxSetupBytes);
  check_fields(path, info, static_cast<uint32_t>(info.setup.size()));
  check_setup_text(path, info.setup);
  const Shape& s = kv.shape();
  CUMULUS_CHECK(info.n_layers == s.n_layers && info.n_heads == s.n_q_heads && info.n_kv_heads == s.n_kv_heads &&
                    info.head_dim == s.head_dim && info.page_size == kv.page_size() && info.dtype == kv.dtype(),
                "KV snapshot '{}': info (n_layers={}, n_heads={}, n_kv_heads={}, head_dim={}, page_size={}, dtype={}) "
                "does not match the cache (n_layers={}, n_heads={}, n_kv_heads={}, head_dim={}, page_size={}, "
                "dtype={})",
                path, info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim, info.page_size,
                dtype_name(info.dtype), s.n_layers, s.n_q_heads, s.n_kv_heads, s.head_dim, kv.page_size(),
                dtype_name(kv.dtype()));
  for (int l = 0; l < s.n_layers; ++l)
    CUMULUS_CHECK(kv.n_tokens(l) >= info.n_tokens, "KV snapshot '{}': n_tokens={} but layer {} caches {} tokens", path,
                  info.n_tokens, l, kv.n_tokens(l));
  // What each layer's next query after the prompt reads: a window layer's last w - 1 tokens.
  KvSnapshotInfo out = info;
  out.first_token.assign(static_cast<size_t>(s.n_layers), 0);
  for (int l = 0; l < s.n_layers; ++l) {
    const int w = kv.window(l);
    if (w == 0) continue;
    const int first = kv.first_needed(l, info.n_tokens);
    out.first_token[static_cast<size_t>(l)] = first;
    const PagedHeadView v = kv.view(l, 0);
    for (int t = first; t < info.n_tokens; ++t)
      CUMULUS_CHECK(v.k_pages[t >> v.page_shift] != nullptr,
                    "KV snapshot '{}': layer {} (window {}) no longer holds token {} of the prompt's last window", path,
                    l, w, t);
  }
  CUMULUS_CHECK(tokens.size() == static_cast<size_t>(info.n_tokens), "KV snapshot '{}': {} tokens given, n_tokens={}",
                path, tokens.size(), info.n_tokens);
  for (size_t t = 0; t < tokens.size(); ++t)
    CUMULUS_CHECK(tokens[t] >= 0 && tokens[t] < info.vocab_size,
                  "KV snapshot '{}': token {} is {}, outside the vocabulary [0, {})", path, t, tokens[t],
                  info.vocab_size);
  CUMULUS_CHECK(logits.size() == static_cast<size_t>(info.vocab_size),
                "KV snapshot '{}': {} logits given, vocab_size={}", path, logits.size(), info.vocab_size);
  const size_t q_per_layer = static_cast<size_t>(info.prompt_q_rows) * info.n_heads * info.head_dim;
  CUMULUS_CHECK(prompt_q.size() == static_cast<size_t>(info.n_layers),
                "KV snapshot '{}': prompt queries of {} layers given, n_layers={}", path, prompt_q.size(),
                info.n_layers);
  for (int l = 0; l < info.n_layers; ++l)
    CUMULUS_CHECK(prompt_q[l].size() >= q_per_layer,
                  "KV snapshot '{}': layer {} has {} prompt-query floats, prompt_q_rows={} needs {}", path, l,
                  prompt_q[l].size(), info.prompt_q_rows, q_per_layer);

  const Layout lay = layout_of(out, kKvSnapshotVersion);
  file_write_atomic_stream(path, "KV snapshot", [&](const FileAppend& append) {
    // Bytes go through `buf` (flushed at 4 MiB) so the checksum and the writes see large pieces.
    std::string buf;
    buf.reserve(size_t{4} << 20);
    const std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> xxh(XXH3_createState(), &XXH3_freeState);
    CUMULUS_CHECK(xxh != nullptr && XXH3_64bits_reset(xxh.get()) == XXH_OK,
                  "KV snapshot '{}': cannot start the checksum (out of memory)", path);
    size_t written = 0;
    auto flush = [&] {
      XXH3_64bits_update(xxh.get(), buf.data(), buf.size());
      append(buf);
      written += buf.size();
      buf.clear();
    };
    auto put = [&](const void* p, size_t n) {
      buf.append(static_cast<const char*>(p), n);
      if (buf.size() >= (size_t{4} << 20)) flush();
    };
    auto pad_to = [&](size_t offset) {
      const size_t at = written + buf.size();
      buf.append(offset - at, '\0');
    };

    uint8_t header[kHeaderBytes] = {};
    std::memcpy(header, kMagic, 8);
    store<uint32_t>(header + 8, kKvSnapshotVersion);
    store<uint32_t>(header + 12, dtype_code(info.dtype));
    store<uint64_t>(header + 16, info.model_id);
    const uint32_t fields[] = {static_cast<uint32_t>(info.n_layers),   static_cast<uint32_t>(info.n_heads),
                               static_cast<uint32_t>(info.n_kv_heads), static_cast<uint32_t>(info.head_dim),
                               static_cast<uint32_t>(info.vocab_size), static_cast<uint32_t>(info.page_size),
                               static_cast<uint32_t>(info.n_tokens),   static_cast<uint32_t>(info.prompt_q_rows),
                               static_cast<uint32_t>(info.setup.size())};
    for (size_t f = 0; f < std::size(fields); ++f) store<uint32_t>(header + 24 + 4 * f, fields[f]);
    put(header, kHeaderBytes);
    put(info.setup.data(), info.setup.size());
    pad_to(lay.first);
    for (int f : out.first_token) {
      uint8_t word[4];
      store<uint32_t>(word, static_cast<uint32_t>(f));
      put(word, 4);
    }
    pad_to(lay.tokens);
    put(tokens.data(), tokens.size_bytes());
    pad_to(lay.logits);
    put(logits.data(), logits.size_bytes());
    pad_to(lay.prompt_q);
    for (int l = 0; l < info.n_layers; ++l) put(prompt_q[l].data(), q_per_layer * sizeof(float));
    pad_to(lay.kv);
    // Per layer, K then V, token-major [n_tokens - first][n_kv_heads][head_dim] (what append takes).
    for (int l = 0; l < info.n_layers; ++l) {
      std::vector<PagedHeadView> views;
      for (int hd = 0; hd < info.n_kv_heads; ++hd) views.push_back(kv.view(l, hd));
      const size_t row = views[0].row_bytes();
      for (bool keys : {true, false})
        for (int t = out.first_token[static_cast<size_t>(l)]; t < info.n_tokens; ++t)
          for (const PagedHeadView& v : views) put(keys ? v.key(t) : v.value(t), row);
    }
    flush();
    CUMULUS_CHECK(written + kChecksumBytes == lay.total, "KV snapshot '{}': wrote {} bytes, the layout has {}", path,
                  written + kChecksumBytes, lay.total);
    uint8_t sum[kChecksumBytes];
    store<uint64_t>(sum, XXH3_64bits_digest(xxh.get()));
    append(std::string_view(reinterpret_cast<const char*>(sum), kChecksumBytes));
  });
}

// ---------------------------------------------------------------------------------------
// Reading

// The file's bytes, read into memory by open(): a mapping would die of SIGBUS when the
// file is truncated while the run uses it (a `cp` over the snapshot mid-run); a copy
// cannot change under us, and a change during the read is detected and named.
struct KvSnapshot::Mapping {
  std::unique_ptr<uint8_t[]> bytes;
};

KvSnapshot::KvSnapshot(KvSnapshot&&) noexcept = default;
KvSnapshot& KvSnapshot::operator=(KvSnapshot&&) noexcept = default;
KvSnapshot::~KvSnapshot() = default;

KvSnapshot KvSnapshot::open(const std::string& path) {
  file_check_regular(path, "KV snapshot");  // stat before open: a FIFO would block open()
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  CUMULUS_CHECK(fd >= 0, "KV snapshot '{}': cannot open ({})", path, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  CUMULUS_CHECK(::fstat(fd, &st) == 0, "KV snapshot '{}': cannot stat ({})", path, std::strerror(errno));
  CUMULUS_CHECK(S_ISREG(st.st_mode), "KV snapshot '{}': not a regular file (replaced while opened?)", path);
  const auto size = static_cast<size_t>(st.st_size);
  CUMULUS_CHECK(size >= kHeaderBytes + kChecksumBytes,
                "KV snapshot '{}': {} bytes is less than the {} of a header and a checksum (truncated?)", path, size,
                kHeaderBytes + kChecksumBytes);
  KvSnapshot s;
  s.map_ = std::make_unique<Mapping>();
  s.map_->bytes.reset(new (std::nothrow) uint8_t[size]);
  CUMULUS_CHECK(s.map_->bytes != nullptr, "KV snapshot '{}': cannot allocate {} bytes ({:.1f} MiB) to read it", path,
                size, size / 1048576.0);
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::pread(fd, s.map_->bytes.get() + done, size - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    CUMULUS_CHECK(n >= 0, "KV snapshot '{}': read failed at byte {} ({})", path, done, std::strerror(errno));
    CUMULUS_CHECK(n > 0,
                  "KV snapshot '{}': the file ended at byte {} while it was read, though it had {} bytes: it changed "
                  "while it was read (copied over?); load it again once it is complete",
                  path, done, size);
    done += static_cast<size_t>(n);
  }
  struct stat after {};
  CUMULUS_CHECK(::fstat(fd, &after) == 0 && after.st_size == st.st_size && after.st_mtim.tv_sec == st.st_mtim.tv_sec &&
                    after.st_mtim.tv_nsec == st.st_mtim.tv_nsec,
                "KV snapshot '{}': the file changed while it was read ({} bytes before, {} after; copied over?); load "
                "it again once it is complete",
                path, size, after.st_size);
  s.path_ = path;
  s.base_ = s.map_->bytes.get();
  s.size_ = size;
  const uint8_t* b = s.base_;

  // Magic and version first: another file, or another version, is named as such.
  if (std::memcmp(b, kMagic, 8) != 0) {
    std::string got;
    for (int j = 0; j < 8; ++j) got += fmt::format("{:02x}", b[j]);
    CUMULUS_FAIL("KV snapshot '{}': magic is 0x{}, not \"CUMKVSNP\": not a cumulus KV snapshot", path, got);
  }
  const uint32_t version = load<uint32_t>(b + 8);
  CUMULUS_CHECK(version >= 1 && version <= kKvSnapshotVersion,
                "KV snapshot '{}': version={} is not supported (this build reads versions 1 to {})", path, version,
                kKvSnapshotVersion);
  const uint32_t dt = load<uint32_t>(b + 12);
  CUMULUS_CHECK(dt <= 2, "KV snapshot '{}': dtype={} must be 0 (f32), 1 (f16) or 2 (bf16)", path, dt);
  KvSnapshotInfo& i = s.info_;
  i.dtype = dt == 0 ? DType::f32 : dt == 1 ? DType::f16 : DType::bf16;
  i.model_id = load<uint64_t>(b + 16);
  // Read as u32 and bounded before narrowing to int.
  uint32_t f[9];
  for (int j = 0; j < 9; ++j) f[j] = load<uint32_t>(b + 24 + 4 * j);
  for (int j = 0; j < 9; ++j)
    CUMULUS_CHECK(f[j] <= (1u << 30), "KV snapshot '{}': header field {} at byte {} is {}, beyond any valid size",
                  path, j, 24 + 4 * j, f[j]);
  i.n_layers = static_cast<int>(f[0]);
  i.n_heads = static_cast<int>(f[1]);
  i.n_kv_heads = static_cast<int>(f[2]);
  i.head_dim = static_cast<int>(f[3]);
  i.vocab_size = static_cast<int>(f[4]);
  i.page_size = static_cast<int>(f[5]);
  i.n_tokens = static_cast<int>(f[6]);
  i.prompt_q_rows = static_cast<int>(f[7]);
  const uint32_t setup_bytes = f[8];
  check_fields(path, i, setup_bytes);
  for (size_t j = 60; j < kHeaderBytes; ++j)
    CUMULUS_CHECK(b[j] == 0, "KV snapshot '{}': reserved header byte {} is 0x{:02x}, must be 0", path, j, b[j]);

  // Version 2: the layers' first tokens, read once the file is known to hold them.
  KvSnapshotInfo sized = i;
  sized.setup.assign(setup_bytes, ' ');
  if (version >= 2) {
    const size_t first_at = align_up(kHeaderBytes + setup_bytes);
    const size_t need = first_at + 4 * static_cast<size_t>(i.n_layers) + kChecksumBytes;
    CUMULUS_CHECK(size >= need,
                  "KV snapshot '{}': the file has {} bytes, less than the {} its header (n_layers={}, setup_bytes={}) "
                  "needs before the layers' first tokens end (truncated)",
                  path, size, need, i.n_layers, setup_bytes);
    for (int l = 0; l < i.n_layers; ++l) {
      const uint32_t f0 = load<uint32_t>(b + first_at + 4 * static_cast<size_t>(l));
      CUMULUS_CHECK(f0 <= static_cast<uint32_t>(i.n_tokens), "KV snapshot '{}': first_token[{}]={} must be in [0, n_tokens={}]",
                    path, l, f0, i.n_tokens);
      i.first_token.push_back(static_cast<int>(f0));
    }
    sized.first_token = i.first_token;
  }
  // The size the fields imply, against the file's: nothing is read beyond this point
  // unless they agree.
  const Layout lay = layout_of(sized, version);
  CUMULUS_CHECK(lay.total == size,
                "KV snapshot '{}': the file has {} bytes but its header (n_layers={}, n_heads={}, n_kv_heads={}, "
                "head_dim={}, vocab_size={}, dtype={}, n_tokens={}, prompt_q_rows={}, setup_bytes={}) implies {} "
                "bytes ({})",
                path, size, i.n_layers, i.n_heads, i.n_kv_heads, i.head_dim, i.vocab_size, dtype_name(i.dtype),
                i.n_tokens, i.prompt_q_rows, setup_bytes, lay.total, size < lay.total ? "truncated" : "extra bytes");
  const uint64_t stored = load<uint64_t>(b + size - kChecksumBytes);
  const uint64_t computed = kv_snapshot_checksum(b, size - kChecksumBytes, version);
  CUMULUS_CHECK(stored == computed,
                "KV snapshot '{}': checksum mismatch: the file says 0x{:016x}, its bytes hash to 0x{:016x} (corrupted)",
                path, stored, computed);
  s.checksum_ = stored;

  // Contents. The checksum guards against corruption, not against a file written by
  // something else: every value is checked as if it could be anything.
  i.setup.assign(reinterpret_cast<const char*>(b + kHeaderBytes), setup_bytes);
  check_setup_text(path, i.setup);
  const size_t first_end = version >= 2 ? lay.first + 4 * static_cast<size_t>(i.n_layers) : lay.first;
  // The gaps between sections (docs/kv_snapshot.md): [start, end) pairs.
  const size_t q_bytes = 4 * static_cast<size_t>(i.n_layers) * i.prompt_q_rows * i.n_heads * i.head_dim;
  const std::pair<size_t, size_t> gaps[] = {{kHeaderBytes + setup_bytes, lay.first},
                                            {first_end, lay.tokens},
                                            {lay.tokens + 4 * static_cast<size_t>(i.n_tokens), lay.logits},
                                            {lay.logits + 4 * static_cast<size_t>(i.vocab_size), lay.prompt_q},
                                            {lay.prompt_q + q_bytes, lay.kv}};
  for (const auto& [from, to] : gaps)
    for (size_t j = from; j < to; ++j)
      CUMULUS_CHECK(b[j] == 0, "KV snapshot '{}': padding byte {} is 0x{:02x}, must be 0", path, j, b[j]);
  if (i.first_token.empty()) i.first_token.assign(static_cast<size_t>(i.n_layers), 0);  // version 1
  s.off_tokens_ = lay.tokens;
  s.off_logits_ = lay.logits;
  s.off_prompt_q_ = lay.prompt_q;
  s.off_kv_ = lay.layer_kv;
  const std::span<const int32_t> tokens = s.tokens();
  for (size_t t = 0; t < tokens.size(); ++t)
    CUMULUS_CHECK(tokens[t] >= 0 && tokens[t] < i.vocab_size,
                  "KV snapshot '{}': token {} is {}, outside the vocabulary [0, {})", path, t, tokens[t], i.vocab_size);
  const std::span<const float> logits = s.logits();
  if (const size_t j = first_non_finite(logits.data(), DType::f32, logits.size()); j < logits.size())
    CUMULUS_FAIL("KV snapshot '{}': logit {} is {}, not finite", path, j, logits[j]);
  for (int l = 0; l < i.n_layers; ++l) {
    const std::span<const float> q = s.prompt_q(l);
    if (const size_t j = first_non_finite(q.data(), DType::f32, q.size()); j < q.size())
      CUMULUS_FAIL("KV snapshot '{}': prompt query value {} of layer {} is {}, not finite", path, j, l, q[j]);
    const int first = i.first_token[static_cast<size_t>(l)];
    const size_t n = static_cast<size_t>(i.n_tokens - first) * i.n_kv_heads * i.head_dim;
    for (bool keys : {true, false}) {
      const void* data = keys ? s.keys(l) : s.values(l);
      if (const size_t j = first_non_finite(data, i.dtype, n); j < n)
        CUMULUS_FAIL("KV snapshot '{}': {}[layer={}][token={}][head={}][dim={}] is {}, not finite", path,
                     keys ? "k" : "v", l, first + j / (static_cast<size_t>(i.n_kv_heads) * i.head_dim),
                     j / i.head_dim % i.n_kv_heads, j % i.head_dim, dtype_load(data, i.dtype, j));
    }
  }
  return s;
}

std::span<const int32_t> KvSnapshot::tokens() const {
  return {reinterpret_cast<const int32_t*>(base_ + off_tokens_), static_cast<size_t>(info_.n_tokens)};
}

std::span<const float> KvSnapshot::logits() const {
  return {reinterpret_cast<const float*>(base_ + off_logits_), static_cast<size_t>(info_.vocab_size)};
}

std::span<const float> KvSnapshot::prompt_q(int layer) const {
  CUMULUS_CHECK(layer >= 0 && layer < info_.n_layers, "layer={} out of range [0, {})", layer, info_.n_layers);
  const size_t n = static_cast<size_t>(info_.prompt_q_rows) * info_.n_heads * info_.head_dim;
  return {reinterpret_cast<const float*>(base_ + off_prompt_q_) + layer * n, n};
}

const void* KvSnapshot::keys(int layer) const {
  CUMULUS_CHECK(layer >= 0 && layer < info_.n_layers, "layer={} out of range [0, {})", layer, info_.n_layers);
  return base_ + off_kv_[static_cast<size_t>(layer)];
}

const void* KvSnapshot::values(int layer) const {
  const size_t rows = static_cast<size_t>(info_.n_tokens - info_.first_token[static_cast<size_t>(layer)]);
  const size_t half = rows * info_.n_kv_heads * info_.head_dim * dtype_size(info_.dtype);
  return static_cast<const uint8_t*>(keys(layer)) + half;
}

void KvSnapshot::check(const KvSnapshotInfo& e) const {
  const KvSnapshotInfo& i = info_;
  CUMULUS_CHECK(i.model_id == e.model_id,
                "KV snapshot '{}': model_id=0x{:016x} is another model's (this model is 0x{:016x}); setup '{}'", path_,
                i.model_id, e.model_id, i.setup);
  auto same = [&](const char* field, int got, int want) { check_equal(path_, field, got, want); };
  same("n_layers", i.n_layers, e.n_layers);
  same("n_heads", i.n_heads, e.n_heads);
  same("n_kv_heads", i.n_kv_heads, e.n_kv_heads);
  same("head_dim", i.head_dim, e.head_dim);
  same("vocab_size", i.vocab_size, e.vocab_size);
  same("page_size", i.page_size, e.page_size);
  CUMULUS_CHECK(i.dtype == e.dtype, "KV snapshot '{}': dtype={} but this session stores K/V as {}", path_,
                dtype_name(i.dtype), dtype_name(e.dtype));
  CUMULUS_CHECK(i.setup == e.setup, "KV snapshot '{}': setup is '{}' but this session's is '{}'", path_, i.setup,
                e.setup);
}

void KvSnapshot::restore(KvCache& kv) const {
  const Shape& s = kv.shape();
  CUMULUS_CHECK(s.n_layers == info_.n_layers && s.n_kv_heads == info_.n_kv_heads && s.head_dim == info_.head_dim &&
                    kv.page_size() == info_.page_size && kv.dtype() == info_.dtype,
                "KV snapshot '{}': the cache (n_layers={}, n_kv_heads={}, head_dim={}, page_size={}, dtype={}) is not "
                "the snapshot's (n_layers={}, n_kv_heads={}, head_dim={}, page_size={}, dtype={})",
                path_, s.n_layers, s.n_kv_heads, s.head_dim, kv.page_size(), dtype_name(kv.dtype()), info_.n_layers,
                info_.n_kv_heads, info_.head_dim, info_.page_size, dtype_name(info_.dtype));
  for (int l = 0; l < s.n_layers; ++l)
    CUMULUS_CHECK(kv.n_tokens(l) == 0, "KV snapshot '{}': restore into a cache whose layer {} holds {} tokens", path_,
                  l, kv.n_tokens(l));
  CUMULUS_CHECK(info_.n_tokens <= kv.options().max_tokens,
                "KV snapshot '{}': n_tokens={} exceeds the cache's capacity of {} tokens", path_, info_.n_tokens,
                kv.options().max_tokens);
  // Each layer from the first token its next query reads: a window layer of `kv` counts the
  // tokens before it as dropped. The file must hold them all.
  const size_t row = static_cast<size_t>(info_.n_kv_heads) * info_.head_dim * dtype_size(info_.dtype);
  std::vector<int> need(static_cast<size_t>(s.n_layers));
  for (int l = 0; l < s.n_layers; ++l) {
    need[static_cast<size_t>(l)] = kv.first_needed(l, info_.n_tokens);
    const int first = info_.first_token[static_cast<size_t>(l)];
    CUMULUS_CHECK(first <= need[static_cast<size_t>(l)],
                  "KV snapshot '{}': layer {} holds tokens from {} on, but this cache reads the layer from token {} "
                  "(a sliding-window snapshot into a cache that keeps every token?)",
                  path_, l, first, need[static_cast<size_t>(l)]);
  }
  for (int l = 0; l < s.n_layers; ++l) {
    const int from = need[static_cast<size_t>(l)], skip = from - info_.first_token[static_cast<size_t>(l)];
    if (from > 0) kv.append_dropped(l, from);
    if (info_.n_tokens > from)
      kv.append_stored(l, static_cast<const uint8_t*>(keys(l)) + skip * row, static_cast<const uint8_t*>(values(l)) + skip * row,
                       info_.n_tokens - from);
  }
}

}  // namespace cumulus
