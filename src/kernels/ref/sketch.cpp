// The 4-bit key sketch (kernels/sketch.h): the per-channel normalisation, the encoder and
// the query's int8 form, which both backends share, and the scalar reference of the
// estimate (float64 sums of the integer dot product and the affine terms).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/sketch.h"

namespace cumulus {

namespace {

// Normalised values are clamped to this, within f16's range (a key 60000 deviations from
// its channel's mean: only keys far outside the prompt's statistics get there).
constexpr float kSketchRange = 6.0e4f;

// The next f16 value below h (finite h): one unit in the last place toward -inf.
uint16_t f16_next_down(uint16_t h) {
  if ((h & 0x7FFF) == 0) return 0x8001;                          // +-0 -> the smallest negative subnormal
  return (h & 0x8000) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);  // away from / toward 0
}

void check_sketch(std::string_view fn, const KeySketchView& s, int t0, int t1) {
  CUMULUS_CHECK(head_dim_supported(s.head_dim), "{}: head_dim={} is not supported (multiples of 8 in [8, 256])", fn,
                s.head_dim);
  CUMULUS_CHECK(t0 >= 0 && t0 % kSketchBlock == 0 && t0 <= t1 && t1 <= s.n_tokens,
                "{}: tokens [{}, {}) must start at a multiple of {} and lie in [0, n_tokens={}]", fn, t0, t1,
                kSketchBlock, s.n_tokens);
  CUMULUS_CHECK(s.n_tokens == 0 || (s.codes && s.offset && s.step && s.center && s.scale),
                "{}: a sketch of {} tokens needs codes, offset, step, center and scale", fn, s.n_tokens);
}

// Nibble of dim c of lane t in a block: chunk c / 8, byte c % 4 of the lane's 4 bytes,
// low nibble for c % 8 < 4.
inline size_t sketch_byte(int c, int t) { return static_cast<size_t>(c / 8) * 64 + static_cast<size_t>(t) * 4 + c % 4; }

}  // namespace

void key_sketch_channels(const PagedHeadView& kv, float* center, float* scale) {
  const int d = kv.head_dim;
  CUMULUS_CHECK(head_dim_supported(d), "key_sketch_channels: head_dim={} is not supported", d);
  std::vector<double> sum(d, 0.0), sq(d, 0.0);
  std::vector<float> k(d);
  for (int t = 0; t < kv.n_tokens; ++t) {
    convert_to_f32(kv.key(t), kv.dtype, k.data(), static_cast<size_t>(d));
    for (int c = 0; c < d; ++c) {
      sum[c] += k[c];
      sq[c] += static_cast<double>(k[c]) * k[c];
    }
  }
  const double n = std::max(1, kv.n_tokens);
  double largest = 0;
  std::vector<double> sd(d);
  for (int c = 0; c < d; ++c) {
    const double mean = sum[c] / n;
    sd[c] = std::sqrt(std::max(0.0, sq[c] / n - mean * mean));
    largest = std::max(largest, sd[c]);
    center[c] = static_cast<float>(mean);
  }
  // A floor so that constant channels (and a single token) divide by something sane.
  const double floor = largest > 0 ? 1e-3 * largest : 1.0;
  for (int c = 0; c < d; ++c) scale[c] = static_cast<float>(std::max(sd[c], floor));
}

void key_sketch_encode(const PagedHeadView& kv, int t0, int t1, const float* center, const float* scale,
                       const KeySketchSpan& out) {
  const int d = kv.head_dim;
  CUMULUS_CHECK(head_dim_supported(d), "key_sketch_encode: head_dim={} is not supported", d);
  CUMULUS_CHECK(t0 >= 0 && t0 <= t1 && t1 <= kv.n_tokens, "key_sketch_encode: tokens [{}, {}) outside [0, {})", t0, t1,
                kv.n_tokens);
  std::vector<float> k(d), y(d);
  const size_t block_bytes = key_sketch_block_bytes(d);
  for (int t = t0; t < t1; ++t) {
    convert_to_f32(kv.key(t), kv.dtype, k.data(), static_cast<size_t>(d));
    float lo = y[0] = std::clamp((k[0] - center[0]) / scale[0], -kSketchRange, kSketchRange), hi = lo;
    for (int c = 1; c < d; ++c) {
      y[c] = std::clamp((k[c] - center[c]) / scale[c], -kSketchRange, kSketchRange);
      lo = std::min(lo, y[c]);
      hi = std::max(hi, y[c]);
    }
    // The stored (f16) offset and step, then codes against them: the estimate dequantises
    // exactly these values. The offset is rounded down and the step up, so that every
    // channel lies in [off, off + 15 step] and its code is off by at most half a step.
    uint16_t off16 = f32_to_f16(lo);
    if (f16_to_f32(off16) > lo) off16 = f16_next_down(off16);
    const float off = f16_to_f32(off16);
    float step = (hi - off) / 15.0f;
    uint16_t step16 = f32_to_f16(step);
    if (f16_to_f32(step16) * 15.0f < hi - off) step16 = static_cast<uint16_t>(step16 + 1);  // next f16 up (step >= 0)
    step = f16_to_f32(step16);
    out.offset[t] = off16;
    out.step[t] = step16;
    uint8_t* block = out.codes + static_cast<size_t>(t / kSketchBlock) * block_bytes;
    const int lane = t % kSketchBlock;
    for (int c = 0; c < d; ++c) {
      const float u = step > 0 ? std::nearbyint((y[c] - off) / step) : 0.0f;
      const uint8_t code = static_cast<uint8_t>(std::clamp(u, 0.0f, 15.0f));
      uint8_t& byte = block[sketch_byte(c, lane)];
      byte = (c % 8) < 4 ? static_cast<uint8_t>((byte & 0xF0) | code) : static_cast<uint8_t>((byte & 0x0F) | (code << 4));
    }
  }
}

SketchQuery key_sketch_quantize_query(const KeySketchView& s, const float* q, int8_t* q8) {
  const int d = s.head_dim;
  SketchQuery r;
  double amax = 0;
  for (int c = 0; c < d; ++c) {
    const double qs = static_cast<double>(q[c]) * s.scale[c];
    r.base += static_cast<double>(q[c]) * s.center[c];
    r.qsum += qs;
    amax = std::max(amax, std::abs(qs));
  }
  r.qstep = amax > 0 ? amax / 127.0 : 1.0;
  for (int c = 0; c < d; ++c) {
    const double v = std::nearbyint(static_cast<double>(q[c]) * s.scale[c] / r.qstep);
    q8[c] = static_cast<int8_t>(std::clamp(v, -127.0, 127.0));
  }
  return r;
}

void key_sketch_score_validate(const char* fn, const KeySketchView& s, const float* q, int n_q, int t0, int t1,
                               const float* scores) {
  check_sketch(fn, s, t0, t1);
  CUMULUS_CHECK(n_q >= 1 && q != nullptr && (t1 == t0 || scores != nullptr),
                "{}: n_q={} must be >= 1 with q and scores non-null", fn, n_q);
}

void key_sketch_weights_validate(const char* fn, const KeySketchView& s, const float* q, int n_q, int t0, int t1,
                                 const float* shift, const float* w, size_t stride, const double* sum,
                                 const float* top) {
  key_sketch_score_validate(fn, s, q, n_q, t0, t1, w);
  CUMULUS_CHECK(shift != nullptr && sum != nullptr && top != nullptr, "{}: shift, sum and top must be non-null", fn);
  CUMULUS_CHECK(stride >= static_cast<size_t>(t1 - t0), "{}: stride={} below the {} tokens", fn, stride, t1 - t0);
}

namespace ref {

void key_sketch_score(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float* scores, float* top) {
  key_sketch_score_validate("key_sketch_score", s, q, n_q, t0, t1, scores);
  const int d = s.head_dim;
  const int n = t1 - t0;
  const size_t block_bytes = key_sketch_block_bytes(d);
  std::vector<int8_t> q8(d);
  for (int j = 0; j < n_q; ++j) {
    const SketchQuery sq = key_sketch_quantize_query(s, q + static_cast<size_t>(j) * d, q8.data());
    float best = -std::numeric_limits<float>::infinity();
    for (int t = t0; t < t1; ++t) {
      const uint8_t* block = s.codes + static_cast<size_t>(t / kSketchBlock) * block_bytes;
      const int lane = t % kSketchBlock;
      int64_t dot = 0;
      for (int c = 0; c < d; ++c) {
        const uint8_t byte = block[sketch_byte(c, lane)];
        const int u = (c % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
        dot += static_cast<int64_t>(u) * q8[c];
      }
      const double est = sq.base + static_cast<double>(f16_to_f32(s.offset[t])) * sq.qsum +
                         static_cast<double>(f16_to_f32(s.step[t])) * sq.qstep * static_cast<double>(dot);
      scores[static_cast<size_t>(j) * n + (t - t0)] = static_cast<float>(est);
      best = std::max(best, static_cast<float>(est));
    }
    if (top != nullptr) top[j] = best;
  }
}

void key_sketch_weights(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float scale,
                        const float* shift, float* w, size_t stride, double* sum, float* top) {
  key_sketch_weights_validate("key_sketch_weights", s, q, n_q, t0, t1, shift, w, stride, sum, top);
  const int n = t1 - t0;
  std::vector<float> est(static_cast<size_t>(n_q) * n);
  key_sketch_score(s, q, n_q, t0, t1, est.data(), nullptr);
  for (int j = 0; j < n_q; ++j) {
    float* x = w + static_cast<size_t>(j) * stride;
    std::copy_n(est.data() + static_cast<size_t>(j) * n, n, x);
    sum[j] = 0;
    top[j] = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < n; ++i) {
      const double a = static_cast<double>(scale) * x[i] - shift[j];
      top[j] = std::max(top[j], static_cast<float>(a));
      x[i] = static_cast<float>(std::exp(std::clamp(a, -87.0, 80.0)));
      sum[j] += x[i];
    }
  }
}

}  // namespace ref

}  // namespace cumulus
