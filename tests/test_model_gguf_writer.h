// A minimal GGUF writer for tests and fuzz seeds: builds small files in memory and records
// the byte offset of every field it writes (so tests can corrupt exactly one field).
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace cumulus::test {

class GgufWriter {
 public:
  enum Type : uint32_t { U8 = 0, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 };

  uint32_t version = 3;
  uint64_t alignment = 32;  // used for padding; write general.alignment yourself to change it

  // Values are appended as raw bytes; `kv` writes key + type, then the caller's value.
  void kv_u8(const std::string& k, uint8_t v) { key(k, U8); put(v); }
  void kv_i8(const std::string& k, int8_t v) { key(k, I8); put(v); }
  void kv_u16(const std::string& k, uint16_t v) { key(k, U16); put(v); }
  void kv_i16(const std::string& k, int16_t v) { key(k, I16); put(v); }
  void kv_u32(const std::string& k, uint32_t v) { key(k, U32); put(v); }
  void kv_i32(const std::string& k, int32_t v) { key(k, I32); put(v); }
  void kv_u64(const std::string& k, uint64_t v) { key(k, U64); put(v); }
  void kv_i64(const std::string& k, int64_t v) { key(k, I64); put(v); }
  void kv_f32(const std::string& k, float v) { key(k, F32); put(v); }
  void kv_f64(const std::string& k, double v) { key(k, F64); put(v); }
  void kv_bool(const std::string& k, bool v) { key(k, BOOL); put(static_cast<uint8_t>(v)); }
  void kv_string(const std::string& k, const std::string& v) { key(k, STRING); str(kv_, v, "kv:" + k + ".len"); }
  template <typename T>
  void kv_array(const std::string& k, Type elem, const std::vector<T>& v) {
    key(k, ARRAY);
    put(static_cast<uint32_t>(elem));
    kv_marks_["kv:" + k + ".count"] = kv_.size();
    put(static_cast<uint64_t>(v.size()));
    for (const T& x : v) put(x);
  }
  void kv_string_array(const std::string& k, const std::vector<std::string>& v) {
    key(k, ARRAY);
    put(static_cast<uint32_t>(STRING));
    kv_marks_["kv:" + k + ".count"] = kv_.size();
    put(static_cast<uint64_t>(v.size()));
    for (const auto& s : v) str(kv_, s, "");
  }
  // An array of arrays of i32.
  void kv_nested_i32(const std::string& k, const std::vector<std::vector<int32_t>>& v) {
    key(k, ARRAY);
    put(static_cast<uint32_t>(ARRAY));
    put(static_cast<uint64_t>(v.size()));
    for (const auto& inner : v) {
      put(static_cast<uint32_t>(I32));
      put(static_cast<uint64_t>(inner.size()));
      for (int32_t x : inner) put(x);
    }
  }
  // Raw bytes after key + type (for hand-made corrupt values).
  void kv_raw(const std::string& k, uint32_t type, const std::vector<uint8_t>& raw) {
    key(k, static_cast<Type>(type));
    kv_.insert(kv_.end(), raw.begin(), raw.end());
  }

  // dims: ne[0] first (innermost). data: the tensor's bytes.
  void tensor(const std::string& name, const std::vector<uint64_t>& dims, uint32_t ggml_type,
              const std::vector<uint8_t>& data) {
    tensors_.push_back({name, dims, ggml_type, data});
  }
  template <typename T>
  static std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
    std::vector<uint8_t> out(v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
    return out;
  }

  // The file. After the call, `marks` holds offsets of: "magic", "version", "tensor_count",
  // "kv_count", "kv:<key>.len" (string values), "kv:<key>.count" (arrays), "key:<key>"
  // (key length), "type:<key>", "tensor:<name>.{name,n_dims,dim0,type,offset}",
  // "data:<name>", "data".
  std::vector<uint8_t> bytes() {
    std::vector<uint8_t> out;
    marks["magic"] = 0;
    raw(out, "GGUF", 4);
    marks["version"] = out.size();
    put_to(out, version);
    marks["tensor_count"] = out.size();
    put_to(out, static_cast<uint64_t>(tensors_.size()));
    marks["kv_count"] = out.size();
    put_to(out, n_kv_);
    const size_t kv_base = out.size();
    for (auto& [name, off] : kv_marks_) marks[name] = kv_base + off;
    out.insert(out.end(), kv_.begin(), kv_.end());
    // Tensor data offsets, each aligned.
    std::vector<uint64_t> offsets;
    uint64_t data_size = 0;
    for (const auto& t : tensors_) {
      data_size = (data_size + alignment - 1) / alignment * alignment;
      offsets.push_back(data_size);
      data_size += t.data.size();
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      const std::string p = "tensor:" + t.name;
      marks[p + ".name"] = out.size();
      str(out, t.name, "");
      marks[p + ".n_dims"] = out.size();
      put_to(out, static_cast<uint32_t>(t.dims.size()));
      marks[p + ".dim0"] = out.size();
      for (uint64_t d : t.dims) put_to(out, d);
      marks[p + ".type"] = out.size();
      put_to(out, t.type);
      marks[p + ".offset"] = out.size();
      put_to(out, offsets[i]);
    }
    const size_t data_start = (out.size() + alignment - 1) / alignment * alignment;
    out.resize(data_start, 0);
    marks["data"] = data_start;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      out.resize(data_start + offsets[i], 0);
      marks["data:" + tensors_[i].name] = out.size();
      out.insert(out.end(), tensors_[i].data.begin(), tensors_[i].data.end());
    }
    return out;
  }

  std::map<std::string, size_t> marks;

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t type;
    std::vector<uint8_t> data;
  };
  template <typename T>
  static void put_to(std::vector<uint8_t>& out, const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put(const T& v) { put_to(kv_, v); }
  static void raw(std::vector<uint8_t>& out, const char* s, size_t n) {
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(s), reinterpret_cast<const uint8_t*>(s) + n);
  }
  void str(std::vector<uint8_t>& out, const std::string& s, const std::string& mark) {
    if (!mark.empty() && &out == &kv_) kv_marks_[mark] = kv_.size();
    put_to(out, static_cast<uint64_t>(s.size()));
    raw(out, s.data(), s.size());
  }
  void key(const std::string& k, Type t) {
    ++n_kv_;
    kv_marks_["key:" + k] = kv_.size();
    str(kv_, k, "");
    kv_marks_["type:" + k] = kv_.size();
    put(static_cast<uint32_t>(t));
  }
  std::vector<uint8_t> kv_;
  uint64_t n_kv_ = 0;
  std::map<std::string, size_t> kv_marks_;
  std::vector<Tensor> tensors_;
};

}  // namespace cumulus::test
