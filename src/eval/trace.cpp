// Reader of `cumulus trace` files (include/cumulus/eval/trace.h; format in docs/cuda.md).
#include "cumulus/eval/trace.h"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/file.h"

namespace cumulus {

KvCache TraceFile::cache(int record) const {
  CUMULUS_CHECK(record >= 0 && record < static_cast<int>(layers.size()), "trace record={} out of range [0, {})",
                record, layers.size());
  KvCache kv(Shape{1, n_q_heads, n_kv_heads, head_dim}, KvCacheOptions{16, DType::f16, n_tokens});
  std::vector<float> kf(k[record].size()), vf(v[record].size());
  for (size_t i = 0; i < kf.size(); ++i) kf[i] = f16_to_f32(k[record][i]), vf[i] = f16_to_f32(v[record][i]);
  kv.append(0, kf.data(), vf.data(), n_tokens);
  return kv;
}

namespace {

// A header field that must be an integer within int's range: a float, a string or an integer
// beyond int (nlohmann converts those without a check) is an error naming it.
int header_int(const nlohmann::json& v, const std::string& path, const char* key) {
  CUMULUS_CHECK(v.is_number_integer() && (v.is_number_unsigned() ? v.get<uint64_t>() <= INT32_MAX
                                                                  : v.get<int64_t>() >= INT32_MIN &&
                                                                        v.get<int64_t>() <= INT32_MAX),
                "trace {}: header field {}={} is not an integer in int's range", path, key, v.dump());
  return static_cast<int>(v.get<int64_t>());
}

}  // namespace

TraceFile trace_read(const std::string& path) {
  file_check_regular(path, "trace");
  std::ifstream f(path, std::ios::binary);
  CUMULUS_CHECK(f.good(), "trace {}: cannot open ({})", path, std::strerror(errno));
  // The header's sizes are checked against the file's real size before any allocation: a
  // small file claiming large records must not reach gigabytes of memory.
  f.seekg(0, std::ios::end);
  const auto file_size = static_cast<uint64_t>(f.tellg());
  f.seekg(0, std::ios::beg);
  char magic[8] = {};
  uint32_t version = 0, hb = 0;
  f.read(magic, 8);
  f.read(reinterpret_cast<char*>(&version), 4);
  f.read(reinterpret_cast<char*>(&hb), 4);
  CUMULUS_CHECK(f.good() && std::memcmp(magic, "CUMTRACE", 8) == 0 && version == 1,
                "trace {}: not a cumulus trace (magic or version {})", path, version);
  CUMULUS_CHECK(hb > 0 && hb < (1u << 20), "trace {}: header_bytes={} out of range (0, 1 MiB)", path, hb);
  TraceFile t;
  t.header.assign(hb, '\0');
  f.read(t.header.data(), hb);
  CUMULUS_CHECK(f.good(), "trace {}: truncated header", path);
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(t.header);
    t.n_kv_heads = header_int(h.at("n_kv_heads"), path, "n_kv_heads");
    t.n_q_heads = header_int(h.at("n_q_heads"), path, "n_q_heads");
    t.head_dim = header_int(h.at("head_dim"), path, "head_dim");
    t.n_tokens = header_int(h.at("n_tokens"), path, "n_tokens");
    t.prompt_tokens = header_int(h.at("prompt_tokens"), path, "prompt_tokens");
    t.steps = header_int(h.at("steps"), path, "steps");
    const nlohmann::json& layers = h.at("layers");
    CUMULUS_CHECK(layers.is_array(), "trace {}: header field layers is not an array", path);
    for (const nlohmann::json& l : layers) t.layers.push_back(header_int(l, path, "layers[]"));
  } catch (const nlohmann::json::exception& e) {
    CUMULUS_FAIL("trace {}: bad header ({})", path, e.what());
  }
  CUMULUS_CHECK(t.n_kv_heads >= 1 && t.n_kv_heads <= 256 && t.n_q_heads >= t.n_kv_heads &&
                    t.n_q_heads % t.n_kv_heads == 0 && t.n_q_heads <= 1024 && t.head_dim >= 8 &&
                    t.head_dim <= 512 && t.steps >= 1 && t.steps <= 4096 && t.prompt_tokens >= 0 &&
                    t.n_tokens == t.prompt_tokens + t.steps && t.n_tokens <= (1 << 22) && !t.layers.empty() &&
                    t.layers.size() <= 1024,
                "trace {}: inconsistent header {}", path, t.header);
  const size_t kvn = static_cast<size_t>(t.n_tokens) * t.n_kv_heads * t.head_dim;
  const size_t qn = static_cast<size_t>(t.steps) * t.n_q_heads * t.head_dim;
  // Bounded above: n_tokens <= 2^22, heads <= 1024, head_dim <= 512, records <= 1024, so
  // no product overflows u64.
  const uint64_t record_bytes = 2 * uint64_t{kvn} * 2 + uint64_t{qn} * 4;
  const uint64_t want = 16 + uint64_t{hb} + record_bytes * t.layers.size();
  CUMULUS_CHECK(want == file_size,
                "trace {}: file has {} bytes, but its header ({} records of {} tokens, {} kv heads, {} q heads, "
                "head_dim {}, {} steps) implies {}",
                path, file_size, t.layers.size(), t.n_tokens, t.n_kv_heads, t.n_q_heads, t.head_dim, t.steps, want);
  for (int layer : t.layers) {
    t.k.emplace_back(kvn);
    t.v.emplace_back(kvn);
    t.q.emplace_back(qn);
    f.read(reinterpret_cast<char*>(t.k.back().data()), static_cast<std::streamsize>(kvn * 2));
    f.read(reinterpret_cast<char*>(t.v.back().data()), static_cast<std::streamsize>(kvn * 2));
    f.read(reinterpret_cast<char*>(t.q.back().data()), static_cast<std::streamsize>(qn * 4));
    CUMULUS_CHECK(f.good(), "trace {}: truncated in layer {}", path, layer);
  }
  return t;
}

}  // namespace cumulus
