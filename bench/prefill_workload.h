// The synthetic prompt of the prefill benchmarks (bench/prefill_bench.cpp on the CPU,
// bench/cuda_prefill_bench.cpp on the GPU): one layer's queries, keys and values with the
// structure FlexPrefill exploits, element by element from a counter-based hash, so any
// thread order and either benchmark gives the same numbers.
//
// Per kv head h of n_kv, token t, head_dim D (logits are q.k / sqrt(D)):
//   keys    k[0 : D/2)   content ~N(0, 1), plus 8 on dim 0 for the sinks t < 4 and 6 on dim 1
//                        for one "heavy" token in 512 (seeded)
//           k[D/2 : D)   D/4 rotation planes (RoPE-like) a_h (cos t w_m, sin t w_m),
//                        w_m = 10000^(-m / (D/4))
//   queries content ~N(0, c_qh^2) plus 1 + 0.5 (qh mod 4) on dim 0 and 1.5 on dim 1, and the
//           same rotation planes at the query's own position, so q_i.k_j holds
//           a_h^2 sum_m cos((i - j) w_m): a recency prior decaying with log distance (slash
//           pattern); sinks and heavy tokens make vertical lines; the content noise makes the
//           rest query-dependent
//   values  ~N(0, 1)
// a_h^2 = 2 + 6 h / (n_kv - 1) (diffuse to sharply local heads), c_qh = 1 + (qh mod 5) / 4.
// Normals are Irwin-Hall approximations (sum of four uniforms). Real models' patterns differ:
// the CPU benchmark's SmolLM2 rows measure those.
#pragma once

#include <cmath>
#include <cstdint>

namespace cumulus::bench {

inline uint64_t workload_mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}
inline float workload_uniform(uint64_t stream, uint64_t i) {
  return static_cast<float>(workload_mix(stream * 0x9e3779b97f4a7c15ULL + i) >> 40) * 0x1p-24f;
}
inline float workload_normal(uint64_t stream, uint64_t i) {
  float s = 0.0f;
  for (uint64_t r = 0; r < 4; ++r) s += workload_uniform(stream, 4 * i + r);
  return (s - 2.0f) * 1.7320508f;
}

struct PromptShape {
  int n_kv = 8;
  int group = 4;
  int head_dim = 128;
};

inline float workload_amplitude(const PromptShape& s, int h) {
  return std::sqrt(2.0f + 6.0f * static_cast<float>(h) / static_cast<float>(s.n_kv > 1 ? s.n_kv - 1 : 1));
}
// The rotation part of dim j >= D/2 at position t.
inline float workload_rotation(const PromptShape& s, int h, int t, int j) {
  const int planes = s.head_dim / 4, m = (j - s.head_dim / 2) / 2;
  const float w = std::pow(10000.0f, -static_cast<float>(m) / static_cast<float>(planes));
  const float a = workload_amplitude(s, h);
  return (j % 2 == 0) ? a * std::cos(static_cast<float>(t) * w) : a * std::sin(static_cast<float>(t) * w);
}

inline float prompt_key(const PromptShape& s, int h, int t, int j) {
  if (j >= s.head_dim / 2) return workload_rotation(s, h, t, j);
  float x = workload_normal(1 + static_cast<uint64_t>(h), static_cast<uint64_t>(t) * s.head_dim + j);
  if (j == 0 && t < 4) x += 8.0f;
  if (j == 1 && workload_mix(0x5eed0000ULL + static_cast<uint64_t>(t)) % 512 == 0) x += 6.0f;
  return x;
}

inline float prompt_value(const PromptShape& s, int h, int t, int j) {
  return workload_normal(100 + static_cast<uint64_t>(h), static_cast<uint64_t>(t) * s.head_dim + j);
}

inline float prompt_query(const PromptShape& s, int qh, int t, int j) {
  const int h = qh / s.group;
  if (j >= s.head_dim / 2) return workload_rotation(s, h, t, j);
  const float c = 1.0f + static_cast<float>(qh % 5) / 4.0f;
  float x = c * workload_normal(1000 + static_cast<uint64_t>(qh), static_cast<uint64_t>(t) * s.head_dim + j);
  if (j == 0) x += 1.0f + 0.5f * static_cast<float>(qh % 4);
  if (j == 1) x += 1.5f;
  return x;
}

}  // namespace cumulus::bench
