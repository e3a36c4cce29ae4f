// GGUF reader (format in gguf.h). A cursor walks the mapped bytes; every read checks the
// bytes that remain first, and every count is checked against the smallest size its
// elements could take, so a corrupt file produces an Error, never a huge allocation or an
// out-of-range read.
#include "cumulus/model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <unordered_set>

#include "core/check.h"
#include "cumulus/core/file.h"

static_assert(std::endian::native == std::endian::little, "GGUF reader assumes a little-endian host");

namespace cumulus {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as little-endian u32
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxArrayDepth = 8;  // nested arrays deeper than this are rejected

size_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::u8: case GgufType::i8: case GgufType::boolean: return 1;
    case GgufType::u16: case GgufType::i16: return 2;
    case GgufType::u32: case GgufType::i32: case GgufType::f32: return 4;
    case GgufType::u64: case GgufType::i64: case GgufType::f64: return 8;
    default: return 0;  // string, array: variable
  }
}

bool is_known_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::f64); }

// Reads little-endian values from [base, base + size), throwing on any overrun.
class Cursor {
 public:
  Cursor(const std::string& path, const uint8_t* base, size_t size) : path_(path), base_(base), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  void need(uint64_t n, std::string_view what) const {
    if (n > remaining())
      throw Error(fmt::format("gguf: {}: truncated at offset {}: {} needs {} bytes, {} remain", path_, pos_,
                              what, n, remaining()));
  }
  template <typename T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string_view read_string(std::string_view what) {
    const size_t at = pos_;
    const uint64_t len = read<uint64_t>(what);
    if (len > remaining())
      throw Error(fmt::format("gguf: {}: {} at offset {} has length {} but only {} bytes remain", path_, what,
                              at, len, remaining()));
    std::string_view s(reinterpret_cast<const char*>(base_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return s;
  }
  const uint8_t* take(uint64_t n, std::string_view what) {
    need(n, what);
    const uint8_t* p = base_ + pos_;
    pos_ += static_cast<size_t>(n);
    return p;
  }
  // Checks that `count` elements of at least `min_size` bytes each can fit in what remains.
  void check_count(uint64_t count, uint64_t min_size, size_t at, std::string_view what) const {
    if (min_size != 0 && count > remaining() / min_size)
      throw Error(fmt::format("gguf: {}: {} at offset {} is {}, but only {} bytes remain (each needs >= {})", path_,
                              what, at, count, remaining(), min_size));
  }
  [[noreturn]] void fail(size_t at, const std::string& msg) const {
    throw Error(fmt::format("gguf: {}: offset {}: {}", path_, at, msg));
  }

 private:
  const std::string& path_;
  const uint8_t* base_;
  size_t size_;
  size_t pos_ = 0;
};

GgufValue read_value(Cursor& c, GgufType type, int depth, std::string_view key) {
  GgufValue v;
  v.type = type;
  switch (type) {
    case GgufType::u8: v.u = c.read<uint8_t>(key); break;
    case GgufType::i8: v.i = c.read<int8_t>(key); break;
    case GgufType::u16: v.u = c.read<uint16_t>(key); break;
    case GgufType::i16: v.i = c.read<int16_t>(key); break;
    case GgufType::u32: v.u = c.read<uint32_t>(key); break;
    case GgufType::i32: v.i = c.read<int32_t>(key); break;
    case GgufType::u64: v.u = c.read<uint64_t>(key); break;
    case GgufType::i64: v.i = c.read<int64_t>(key); break;
    case GgufType::f32: v.f = c.read<float>(key); break;
    case GgufType::f64: v.f = c.read<double>(key); break;
    case GgufType::boolean: {
      const size_t at = c.pos();
      const uint8_t b = c.read<uint8_t>(key);
      if (b > 1) c.fail(at, fmt::format("key '{}': bool value {} is not 0 or 1", key, b));
      v.u = b;
      break;
    }
    case GgufType::string: v.str = c.read_string(key); break;
    case GgufType::array: {
      const size_t at = c.pos();
      if (depth >= kMaxArrayDepth) c.fail(at, fmt::format("key '{}': arrays nested deeper than {}", key, kMaxArrayDepth));
      const uint32_t et = c.read<uint32_t>(key);
      if (!is_known_type(et)) c.fail(at, fmt::format("key '{}': unknown array element type {}", key, et));
      v.elem_type = static_cast<GgufType>(et);
      const size_t count_at = c.pos();
      v.count = c.read<uint64_t>(key);
      if (const size_t sz = scalar_size(v.elem_type); sz != 0) {
        c.check_count(v.count, sz, count_at, fmt::format("array count of key '{}'", key));
        v.raw = c.take(v.count * sz, key);
      } else if (v.elem_type == GgufType::string) {
        c.check_count(v.count, 8, count_at, fmt::format("array count of key '{}'", key));
        v.strings.reserve(static_cast<size_t>(v.count));
        for (uint64_t i = 0; i < v.count; ++i) v.strings.push_back(c.read_string(key));
      } else {
        // Array of arrays: each element is at least a u32 type and a u64 count.
        c.check_count(v.count, 12, count_at, fmt::format("array count of key '{}'", key));
        v.arrays.reserve(static_cast<size_t>(v.count));
        for (uint64_t i = 0; i < v.count; ++i) v.arrays.push_back(read_value(c, GgufType::array, depth + 1, key));
      }
      break;
    }
  }
  return v;
}

template <typename T>
T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::u8: case GgufType::i8: case GgufType::u16: case GgufType::i16: case GgufType::u32:
    case GgufType::i32: case GgufType::u64: case GgufType::i64: return true;
    default: return false;
  }
}
bool GgufValue::is_float() const { return type == GgufType::f32 || type == GgufType::f64; }

std::string_view gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::u8: return "u8";
    case GgufType::i8: return "i8";
    case GgufType::u16: return "u16";
    case GgufType::i16: return "i16";
    case GgufType::u32: return "u32";
    case GgufType::i32: return "i32";
    case GgufType::f32: return "f32";
    case GgufType::boolean: return "bool";
    case GgufType::string: return "string";
    case GgufType::array: return "array";
    case GgufType::u64: return "u64";
    case GgufType::i64: return "i64";
    case GgufType::f64: return "f64";
  }
  return "unknown";
}

// Owns either a read-only mapping or a heap buffer.
struct GgufFile::Storage {
  void* map = nullptr;
  size_t map_size = 0;
  std::vector<uint8_t> bytes;
  ~Storage() {
    if (map != nullptr) munmap(map, map_size);
  }
};

GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

GgufFile GgufFile::open(const std::string& path) {
  GgufFile f;
  f.path_ = path;
  f.storage_ = std::make_unique<Storage>();
  file_check_regular(path, "gguf");  // stat before open: a FIFO would block open()
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CUMULUS_CHECK(fd >= 0, "gguf: cannot open '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    CUMULUS_FAIL("gguf: '{}' is not a regular file", path);
  }
  const auto size = static_cast<size_t>(st.st_size);
  if (size > 0) {
    void* m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      CUMULUS_FAIL("gguf: cannot mmap '{}' ({} bytes): {}", path, size, std::strerror(err));
    }
    f.storage_->map = m;
    f.storage_->map_size = size;
    f.base_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);
  f.size_ = size;
  f.parse();
  return f;
}

GgufFile GgufFile::from_bytes(std::string name, std::vector<uint8_t> bytes) {
  GgufFile f;
  f.path_ = std::move(name);
  f.storage_ = std::make_unique<Storage>();
  f.storage_->bytes = std::move(bytes);
  f.base_ = f.storage_->bytes.data();
  f.size_ = f.storage_->bytes.size();
  f.parse();
  return f;
}

void GgufFile::parse() {
  Cursor c(path_, base_, size_);
  const uint32_t magic = c.read<uint32_t>("magic");
  if (magic != kGgufMagic) c.fail(0, fmt::format("bad magic 0x{:08x}, want 0x{:08x} (\"GGUF\")", magic, kGgufMagic));
  version_ = c.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3) {
    const bool swapped = version_ == 0x02000000u || version_ == 0x03000000u;
    c.fail(4, fmt::format("unsupported version {}{} (supported: 2, 3)", version_,
                          swapped ? " (a big-endian file?)" : ""));
  }
  const size_t tc_at = c.pos();
  const uint64_t n_tensors = c.read<uint64_t>("tensor_count");
  const size_t kc_at = c.pos();
  const uint64_t n_kv = c.read<uint64_t>("kv_count");
  // A kv takes at least 8 (key length) + 4 (type) + 1 (value) bytes; a tensor info at
  // least 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset).
  c.check_count(n_kv, 13, kc_at, "kv_count");
  kvs_.reserve(static_cast<size_t>(n_kv));
  std::unordered_set<std::string_view> keys;
  for (uint64_t k = 0; k < n_kv; ++k) {
    const size_t at = c.pos();
    GgufKv kv;
    kv.key = c.read_string("metadata key");
    if (!keys.insert(kv.key).second) c.fail(at, fmt::format("duplicate metadata key '{}'", kv.key));
    const size_t type_at = c.pos();
    const uint32_t t = c.read<uint32_t>("metadata type");
    if (!is_known_type(t)) c.fail(type_at, fmt::format("key '{}': unknown value type {}", kv.key, t));
    kv.value = read_value(c, static_cast<GgufType>(t), 0, kv.key);
    kvs_.push_back(std::move(kv));
  }

  if (const GgufValue* a = find("general.alignment")) {
    if (!a->is_integer() || a->type == GgufType::i8 || a->type == GgufType::i16 || a->type == GgufType::i32 ||
        a->type == GgufType::i64)
      c.fail(0, fmt::format("general.alignment has type {}, want an unsigned integer", gguf_type_name(a->type)));
    alignment_ = a->u;
    if (alignment_ == 0 || (alignment_ & (alignment_ - 1)) != 0 || alignment_ > (1u << 20))
      c.fail(0, fmt::format("general.alignment={} must be a power of two in [1, 2^20]", alignment_));
  } else {
    alignment_ = kDefaultAlignment;
  }

  c.check_count(n_tensors, 32, tc_at, "tensor_count");
  tensors_.reserve(static_cast<size_t>(n_tensors));
  std::unordered_set<std::string_view> names;
  for (uint64_t ti = 0; ti < n_tensors; ++ti) {
    const size_t at = c.pos();
    GgufTensorInfo info;
    info.name = c.read_string("tensor name");
    if (!names.insert(info.name).second) c.fail(at, fmt::format("duplicate tensor name '{}'", info.name));
    const size_t nd_at = c.pos();
    info.n_dims = c.read<uint32_t>("tensor n_dims");
    if (info.n_dims < 1 || info.n_dims > 4)
      c.fail(nd_at, fmt::format("tensor '{}': n_dims={} must be in [1, 4]", info.name, info.n_dims));
    uint64_t n_el = 1;
    for (uint32_t d = 0; d < info.n_dims; ++d) {
      const size_t d_at = c.pos();
      const uint64_t ne = c.read<uint64_t>("tensor dim");
      if (ne == 0 || ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        c.fail(d_at, fmt::format("tensor '{}': ne[{}]={} must be in [1, 2^63)", info.name, d, ne));
      if (n_el > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / ne)
        c.fail(d_at, fmt::format("tensor '{}': element count overflows at ne[{}]={}", info.name, d, ne));
      n_el *= ne;
      info.ne[d] = ne;
    }
    info.n_elements = n_el;
    const size_t type_at = c.pos();
    const uint32_t type_id = c.read<uint32_t>("tensor type");
    const GgmlTypeInfo* ti_info = ggml_type_info(type_id);
    if (ti_info == nullptr) c.fail(type_at, fmt::format("tensor '{}': unknown ggml type {}", info.name, type_id));
    info.type = ti_info->type;
    if (info.ne[0] % ti_info->block_size != 0)
      c.fail(at, fmt::format("tensor '{}': ne[0]={} is not a multiple of the {} block size {}", info.name, info.ne[0],
                             ti_info->name, ti_info->block_size));
    // n_el / block_size * type_size cannot overflow u64 (type_size <= block_size * 8).
    info.n_bytes = n_el / ti_info->block_size * ti_info->type_size;
    const size_t off_at = c.pos();
    info.offset = c.read<uint64_t>("tensor offset");
    if (info.offset % alignment_ != 0)
      c.fail(off_at, fmt::format("tensor '{}': offset {} is not a multiple of the alignment {}", info.name,
                                 info.offset, alignment_));
    tensors_.push_back(info);
  }

  // The data section starts at the next multiple of the alignment (it may be empty when
  // there are no tensors, in which case the padding may be missing too).
  const uint64_t end_of_infos = c.pos();
  data_offset_ = (end_of_infos + alignment_ - 1) / alignment_ * alignment_;
  if (!tensors_.empty() && data_offset_ > size_)
    c.fail(end_of_infos, fmt::format("data section starts at {} but the file has {} bytes", data_offset_, size_));
  for (auto& t : tensors_) {
    const uint64_t avail = size_ - data_offset_;
    if (t.offset > avail || t.n_bytes > avail - t.offset)
      c.fail(end_of_infos, fmt::format("tensor '{}' ({}, {} elements, {} bytes): data [{}, {}) past the end of the data "
                                       "section ({} bytes)",
                                       t.name, ggml_type_name(t.type), t.n_elements, t.n_bytes, t.offset,
                                       t.offset + t.n_bytes, avail));
    t.data = base_ + data_offset_ + t.offset;
  }
}

const GgufValue* GgufFile::find(std::string_view key) const {
  for (const auto& kv : kvs_)
    if (kv.key == key) return &kv.value;
  return nullptr;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

uint64_t GgufFile::get_u64(std::string_view key) const {
  const GgufValue* v = find(key);
  CUMULUS_CHECK(v != nullptr, "gguf: {}: missing metadata key '{}'", path_, key);
  CUMULUS_CHECK(v->is_integer(), "gguf: {}: key '{}' has type {}, want an integer", path_, key,
                gguf_type_name(v->type));
  const bool is_signed = v->type == GgufType::i8 || v->type == GgufType::i16 || v->type == GgufType::i32 ||
                         v->type == GgufType::i64;
  if (is_signed) {
    CUMULUS_CHECK(v->i >= 0, "gguf: {}: key '{}'={} must not be negative", path_, key, v->i);
    return static_cast<uint64_t>(v->i);
  }
  return v->u;
}

uint64_t GgufFile::get_u64_or(std::string_view key, uint64_t fallback) const {
  return find(key) ? get_u64(key) : fallback;
}

double GgufFile::get_f64(std::string_view key) const {
  const GgufValue* v = find(key);
  CUMULUS_CHECK(v != nullptr, "gguf: {}: missing metadata key '{}'", path_, key);
  CUMULUS_CHECK(v->is_float(), "gguf: {}: key '{}' has type {}, want f32 or f64", path_, key,
                gguf_type_name(v->type));
  return v->f;
}

double GgufFile::get_f64_or(std::string_view key, double fallback) const {
  return find(key) ? get_f64(key) : fallback;
}

bool GgufFile::get_bool_or(std::string_view key, bool fallback) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return fallback;
  CUMULUS_CHECK(v->type == GgufType::boolean, "gguf: {}: key '{}' has type {}, want bool", path_, key,
                gguf_type_name(v->type));
  return v->u != 0;
}

std::string_view GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  CUMULUS_CHECK(v != nullptr, "gguf: {}: missing metadata key '{}'", path_, key);
  CUMULUS_CHECK(v->type == GgufType::string, "gguf: {}: key '{}' has type {}, want string", path_, key,
                gguf_type_name(v->type));
  return v->str;
}

std::string_view GgufFile::get_string_or(std::string_view key, std::string_view fallback) const {
  return find(key) ? get_string(key) : fallback;
}

std::vector<std::string_view> GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  CUMULUS_CHECK(v != nullptr, "gguf: {}: missing metadata key '{}'", path_, key);
  CUMULUS_CHECK(v->type == GgufType::array && v->elem_type == GgufType::string,
                "gguf: {}: key '{}' is not an array of strings", path_, key);
  return v->strings;
}

std::vector<int64_t> GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  CUMULUS_CHECK(v != nullptr, "gguf: {}: missing metadata key '{}'", path_, key);
  CUMULUS_CHECK(v->type == GgufType::array, "gguf: {}: key '{}' is not an array", path_, key);
  std::vector<int64_t> out(static_cast<size_t>(v->count));
  const uint8_t* p = v->raw;
  for (size_t i = 0; i < out.size(); ++i) {
    switch (v->elem_type) {
      case GgufType::u8: out[i] = load_le<uint8_t>(p + i); break;
      case GgufType::i8: out[i] = load_le<int8_t>(p + i); break;
      case GgufType::u16: out[i] = load_le<uint16_t>(p + 2 * i); break;
      case GgufType::i16: out[i] = load_le<int16_t>(p + 2 * i); break;
      case GgufType::u32: out[i] = load_le<uint32_t>(p + 4 * i); break;
      case GgufType::i32: out[i] = load_le<int32_t>(p + 4 * i); break;
      case GgufType::i64: out[i] = load_le<int64_t>(p + 8 * i); break;
      case GgufType::u64: {
        const uint64_t u = load_le<uint64_t>(p + 8 * i);
        CUMULUS_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                      "gguf: {}: key '{}'[{}]={} does not fit in int64", path_, key, i, u);
        out[i] = static_cast<int64_t>(u);
        break;
      }
      default:
        CUMULUS_FAIL("gguf: {}: key '{}' is an array of {}, want integers", path_, key, gguf_type_name(v->elem_type));
    }
  }
  return out;
}

std::vector<double> GgufFile::get_float_array(std::string_view key) const {
  const GgufValue* v = find(key);
  CUMULUS_CHECK(v != nullptr, "gguf: {}: missing metadata key '{}'", path_, key);
  CUMULUS_CHECK(v->type == GgufType::array && (v->elem_type == GgufType::f32 || v->elem_type == GgufType::f64),
                "gguf: {}: key '{}' is not an array of floats", path_, key);
  std::vector<double> out(static_cast<size_t>(v->count));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = v->elem_type == GgufType::f32 ? load_le<float>(v->raw + 4 * i) : load_le<double>(v->raw + 8 * i);
  return out;
}

bool gguf_has_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char m[4] = {};
  if (!in.read(m, 4)) return false;
  return std::memcmp(m, "GGUF", 4) == 0;
}

}  // namespace cumulus
