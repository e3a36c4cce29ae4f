// GGUF reader: the llama.cpp ecosystem's single-file model format, versions 2 and 3
// (little-endian). The file is mapped read-only; metadata strings and tensor data are
// views into the mapping, so a GgufFile must outlive everything it hands out.
//
// Layout: "GGUF" u32 version, u64 tensor_count, u64 kv_count, kv_count x (string key,
// u32 type, value), tensor_count x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml
// type, u64 offset), padding to `general.alignment` (default 32), tensor data. A string is
// u64 length + bytes; an array is u32 element type, u64 count, elements (arrays nest).
//
// Nothing read from the file is trusted: every length, count and offset is checked
// against the bytes that remain before it is used, and every failure throws
// cumulus::Error naming the file, the byte offset and the offending value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cumulus/model/quant.h"

namespace cumulus {

enum class GgufType : uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12,
};
std::string_view gguf_type_name(GgufType t);

// One metadata value. Scalars are stored widened; strings and arrays of fixed-size scalars
// are views into the mapped file.
struct GgufValue {
  GgufType type = GgufType::u8;
  uint64_t u = 0;             // u8/u16/u32/u64/bool
  int64_t i = 0;              // i8/i16/i32/i64
  double f = 0;               // f32/f64
  std::string_view str;       // string
  GgufType elem_type = GgufType::u8;  // array: element type
  uint64_t count = 0;                 // array: number of elements
  const uint8_t* raw = nullptr;       // array of fixed-size scalars: little-endian elements
  std::vector<std::string_view> strings;  // array of strings
  std::vector<GgufValue> arrays;          // array of arrays

  bool is_integer() const;
  bool is_float() const;
};

struct GgufKv {
  std::string_view key;
  GgufValue value;
};

struct GgufTensorInfo {
  std::string_view name;
  uint32_t n_dims = 0;
  uint64_t ne[4] = {1, 1, 1, 1};  // ne[0] is the innermost (contiguous) dimension
  GgmlType type = GgmlType::f32;
  uint64_t offset = 0;            // relative to the start of the data section
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
  const uint8_t* data = nullptr;  // into the mapping; n_bytes long
};

class GgufFile {
 public:
  // Maps `path` read-only and parses it.
  static GgufFile open(const std::string& path);
  // Parses bytes held in memory (tests, fuzzing); `name` is used in error messages.
  static GgufFile from_bytes(std::string name, std::vector<uint8_t> bytes);

  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the data section
  size_t file_size() const { return size_; }

  const std::vector<GgufKv>& metadata() const { return kvs_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  // nullptr when absent.
  const GgufValue* find(std::string_view key) const;
  const GgufTensorInfo* find_tensor(std::string_view name) const;

  // Typed getters: throw Error naming the file and key when the key is absent or has the
  // wrong type or an out-of-range value. The *_or variants return `fallback` when absent.
  uint64_t get_u64(std::string_view key) const;
  uint64_t get_u64_or(std::string_view key, uint64_t fallback) const;
  double get_f64(std::string_view key) const;
  double get_f64_or(std::string_view key, double fallback) const;
  bool get_bool_or(std::string_view key, bool fallback) const;
  std::string_view get_string(std::string_view key) const;
  std::string_view get_string_or(std::string_view key, std::string_view fallback) const;
  // Arrays: element type must match (integers of any width for i64, f32/f64 for f64).
  std::vector<std::string_view> get_string_array(std::string_view key) const;
  std::vector<int64_t> get_int_array(std::string_view key) const;
  std::vector<double> get_float_array(std::string_view key) const;

 private:
  GgufFile() = default;
  void parse();

  struct Storage;
  std::unique_ptr<Storage> storage_;
  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<GgufKv> kvs_;
  std::vector<GgufTensorInfo> tensors_;
};

// True when the first four bytes of the file are "GGUF" (does not parse further).
bool gguf_has_magic(const std::string& path);

}  // namespace cumulus
