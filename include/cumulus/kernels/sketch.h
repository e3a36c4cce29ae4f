// A 4-bit sketch of one (layer, kv head)'s keys: a cheap estimate of q . k for every
// token, so a top-p method can find its candidates without reading the keys (ours, after
// Twilight's low-bit estimate of the attention weights; docs/methods.md "sketch_topp").
//
// Keys are first normalised per channel with a fixed centre and scale (from the prompt's
// keys: mean and standard deviation), y_c = (k_c - center_c) / scale_c, which takes out
// the channels' offsets and outliers (RoPE'd keys have a few large channels); then each
// token's y is quantised on its own range with 16 levels:
//   y_c ~ offset_t + step_t u_c,  u_c in [0, 15],  offset_t = min_c y_c, step_t = range / 15
// with offset_t and step_t stored as f16 (the codes are chosen against the rounded values,
// so the dequantised key is exactly what the estimate uses). Then
//   q . k_t ~ q . center + offset_t sum_c q'_c + step_t q' . u_t,   q' = q * scale
// where the last dot product is integer work: q' is quantised to int8 per query (absmax /
// 127, rounded to nearest), and q8 . u_t is an exact integer (VNNI's dpbusd on AVX-512).
//
// Layout: blocks of kSketchBlock = 16 tokens; a block holds head_dim / 8 chunks of 64
// bytes, chunk c being [16 tokens][4 bytes] where byte b of token t packs dim 8c + b in
// its low nibble and dim 8c + 4 + b in its high nibble. So one 64-byte load gives 16
// tokens x 8 dims, tokens in 32-bit lanes, the shape dpbusd multiplies.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cumulus/core/shape.h"

namespace cumulus {

inline constexpr int kSketchBlock = 16;

// Bytes of codes per block of 16 tokens: head_dim / 2 per token.
inline size_t key_sketch_block_bytes(int head_dim) { return static_cast<size_t>(head_dim) * kSketchBlock / 2; }
// Bytes a sketch holds per token (codes plus the f16 offset and step): what a scan reads.
inline size_t key_sketch_token_bytes(int head_dim) { return static_cast<size_t>(head_dim) / 2 + 4; }

// Read-only view of a sketch of n_tokens tokens.
//   codes:  [ceil(n_tokens / 16)][head_dim / 8][16][4] packed nibbles (layout above)
//   offset: [ceil(n_tokens / 16) * 16] f16 bits of offset_t
//   step:   [ceil(n_tokens / 16) * 16] f16 bits of step_t
//   center, scale: [head_dim] float32 per-channel normalisation (scale > 0)
struct KeySketchView {
  const uint8_t* codes = nullptr;
  const uint16_t* offset = nullptr;
  const uint16_t* step = nullptr;
  const float* center = nullptr;
  const float* scale = nullptr;
  int n_tokens = 0;
  int head_dim = 0;
};

// Where key_sketch_encode writes: the same arrays, writable, sized for the tokens encoded.
struct KeySketchSpan {
  uint8_t* codes = nullptr;
  uint16_t* offset = nullptr;
  uint16_t* step = nullptr;
};

// Per-channel mean and standard deviation of tokens [0, kv.n_tokens) of one head
// (float64 sums): center [head_dim], scale [head_dim]. A channel whose deviation is below
// 1e-3 of the largest (or every channel, for one token) gets that floor, so scale > 0.
void key_sketch_channels(const PagedHeadView& kv, float* center, float* scale);

// Encodes tokens [t0, t1) of kv into `out` (token t at block t / 16, lane t % 16) with the
// given normalisation; other tokens' codes are left as they are. Scalar: runs once per
// token (the prompt at on_prefill, then one token per decode step).
void key_sketch_encode(const PagedHeadView& kv, int t0, int t1, const float* center, const float* scale,
                       const KeySketchSpan& out);

// The sketch's estimate of q_j . k_t for tokens [t0, t1) (t0 a multiple of 16, t1 <=
// n_tokens), raw (not scaled by 1/sqrt(head_dim)), for n_q queries:
//   q: [n_q][head_dim]; scores: [n_q][t1 - t0]; top: optional [n_q], each query's largest
//   estimate (-inf for no tokens)
// Both backends quantise q' = q * scale to int8 the same way (key_sketch_quantize_query),
// so they agree up to float rounding; the estimate's distance to the true q . k is the
// 4-bit quantisation error, at most sum_c |q'_c| step_t / 2 plus q's int8 rounding.
namespace ref {
void key_sketch_score(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float* scores,
                      float* top = nullptr);
}  // namespace ref
// The arguments both backends of key_sketch_score and key_sketch_weights check (Error
// naming the function and the bad value): the sketch and [t0, t1), q and n_q, scores (or
// w) non-null when there are tokens; for the weights also shift, sum, top and stride.
void key_sketch_score_validate(const char* fn, const KeySketchView& s, const float* q, int n_q, int t0, int t1,
                               const float* scores);
void key_sketch_weights_validate(const char* fn, const KeySketchView& s, const float* q, int n_q, int t0, int t1,
                                 const float* shift, const float* w, size_t stride, const double* sum,
                                 const float* top);
namespace cpu {
void key_sketch_score(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float* scores,
                      float* top = nullptr);
}  // namespace cpu

// The sketch's weights for tokens [t0, t1) (as key_sketch_score's estimates):
//   w[j * stride + i] = exp(scale est_j(t0 + i) - shift[j]) (stride >= t1 - t0: a caller
//   splitting the context into parts writes each into its place of one [n_q][n] array);
//   sum [n_q] their sums (float64);
//   top [n_q] the largest scale est_j - shift[j] (-inf for no tokens).
// The exponent is clamped to [-87, 80]: a top above about 60 means the shift was too low
// and weights may have lost their ratios, one below about -60 that it was too high; the
// caller then runs again with shift[j] + top[j]. The CPU computes exp by a degree-5
// polynomial (relative error below 3e-6 against the reference's float64 exp).
namespace ref {
void key_sketch_weights(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float scale,
                        const float* shift, float* w, size_t stride, double* sum, float* top);
}  // namespace ref
namespace cpu {
void key_sketch_weights(const KeySketchView& s, const float* q, int n_q, int t0, int t1, float scale,
                        const float* shift, float* w, size_t stride, double* sum, float* top);
}  // namespace cpu

// One query prepared for the integer dot product:
//   q8 [head_dim] int8 = round(q_c scale_c / qstep), qstep = max_c |q_c scale_c| / 127 (1 if q' = 0);
//   base = q . center (float64), qsum = sum_c q_c scale_c (float64).
// The estimate of token t is base + offset_t qsum + step_t qstep (q8 . u_t).
struct SketchQuery {
  double base = 0;
  double qsum = 0;
  double qstep = 1;
};
SketchQuery key_sketch_quantize_query(const KeySketchView& s, const float* q, int8_t* q8);

}  // namespace cumulus
