// Reference matrix-vector product against block-quantised weights (scalar, float64, never
// optimised; layout and activation rounding in kernels/gemv.h), and the view checks every
// backend shares. Each weight is dequantised in float64 from its f16 scale (and min) and
// its integer code, each activation is dx_b q_j, and every product is summed in float64.
//
// The verbatim formats (K-quants) are decoded element by element: for element e of a
// block, where its bits and scales lie; Q5_x from the repacked layout. Sources for the layouts: ggml's ggml-common.h (block structs)
// and ggml-quants.c (dequantize_row_q5_0, _q5_1, _q4_K, _q5_K, _q6_K, get_scale_min_k4),
// and gguf-py's gguf/quants.py (the numpy dequantisers the tests compare against), read
// for the layout and written here independently.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "cumulus/core/dtype.h"
#include "cumulus/kernels/gemv.h"

namespace cumulus {

std::string_view quant_format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::q4_0: return "Q4_0";
    case QuantFormat::q4_1: return "Q4_1";
    case QuantFormat::q8_0: return "Q8_0";
    case QuantFormat::q5_0: return "Q5_0";
    case QuantFormat::q5_1: return "Q5_1";
    case QuantFormat::q4_k: return "Q4_K";
    case QuantFormat::q5_k: return "Q5_K";
    case QuantFormat::q6_k: return "Q6_K";
  }
  return "?";
}

bool quant_format_repacked(QuantFormat f) {
  return f != QuantFormat::q4_k && f != QuantFormat::q5_k && f != QuantFormat::q6_k;
}

int quant_format_block(QuantFormat f) {
  return f == QuantFormat::q4_k || f == QuantFormat::q5_k || f == QuantFormat::q6_k ? 256 : kQuantBlock;
}

int quant_block_bytes(QuantFormat f) {
  switch (f) {
    case QuantFormat::q4_0: return 16;
    case QuantFormat::q4_1: return 16;
    case QuantFormat::q8_0: return 32;
    case QuantFormat::q5_0: return 16;   // repacked; the GGUF block is f16 d, u32 qh, u8 qs[16]
    case QuantFormat::q5_1: return 16;   // repacked; the GGUF block is f16 d, f16 m, u32 qh, u8 qs[16]
    case QuantFormat::q4_k: return 144;  // f16 d, f16 dmin, u8 scales[12], u8 qs[128]
    case QuantFormat::q5_k: return 176;  // f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]
    case QuantFormat::q6_k: return 210;  // u8 ql[128], u8 qh[64], i8 scales[16], f16 d
  }
  return 0;
}

void quant_matrix_validate(const QuantMatrixView& w) {
  CUMULUS_CHECK(static_cast<int>(w.format) <= static_cast<int>(QuantFormat::q6_k), "quant matrix format={} is unknown",
                static_cast<int>(w.format));
  const std::string_view name = quant_format_name(w.format);
  const int block = quant_format_block(w.format);
  CUMULUS_CHECK(w.rows >= 1, "quant matrix ({}) rows={} must be >= 1", name, w.rows);
  CUMULUS_CHECK(w.cols >= block && w.cols % block == 0, "quant matrix ({}) cols={} must be a positive multiple of {}",
                name, w.cols, block);
  CUMULUS_CHECK(w.qs != nullptr, "quant matrix ({}) has a null qs array", name);
  if (quant_format_repacked(w.format)) {
    const bool has_min = w.format == QuantFormat::q4_1 || w.format == QuantFormat::q5_1;
    const bool has_qh = w.format == QuantFormat::q5_0 || w.format == QuantFormat::q5_1;
    CUMULUS_CHECK(w.d != nullptr, "quant matrix ({}) has a null d array", name);
    CUMULUS_CHECK((w.m != nullptr) == has_min, "quant matrix ({}): m must be {}", name, has_min ? "set" : "null");
    CUMULUS_CHECK((w.qh != nullptr) == has_qh, "quant matrix ({}): qh must be {}", name, has_qh ? "set" : "null");
  } else {
    CUMULUS_CHECK(w.d == nullptr && w.m == nullptr && w.qh == nullptr,
                  "quant matrix ({}) keeps its scales in its blocks: d, m and qh must be null", name);
  }
}

namespace ref {
namespace {

double f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<double>(f16_to_f32(h));
}

// Q4_K/Q5_K: the 6-bit scale (which = 0) or min (which = 1) of sub-block s (32 weights) from
// the 12 packed bytes: s < 4 in the low 6 bits of byte s (scale) or s + 4 (min); s >= 4 in
// the low (scale) or high (min) nibble of byte s + 4, with the top 2 bits in bits 6-7 of
// byte s - 4 (scale) or s (min).
int k_scale_6bit(const uint8_t* sc, int s, int which) {
  if (s < 4) return sc[s + 4 * which] & 63;
  const int low4 = which == 0 ? (sc[s + 4] & 15) : (sc[s + 4] >> 4);
  const int top2 = sc[s - 4 + 4 * which] >> 6;
  return low4 | (top2 << 4);
}

// Element e of one verbatim block, float64.
double verbatim_element(QuantFormat f, const uint8_t* blk, int e) {
  switch (f) {
    case QuantFormat::q4_k:
    case QuantFormat::q5_k: {
      // Sub-block s = e / 32; 64-element group g = e / 64; element l = e % 32 of its
      // sub-block: low 4 bits in qs[32 g + l] (high nibble for odd s); Q5_K: bit 4 is bit
      // s of qh[l]. Value d sc_s q - dmin m_s.
      const bool five = f == QuantFormat::q5_k;
      const int s = e / 32, g = e / 64, l = e % 32;
      const uint8_t* qs = blk + (five ? 48 : 16);
      int q = (s % 2 == 0) ? (qs[32 * g + l] & 15) : (qs[32 * g + l] >> 4);
      if (five) q |= ((blk[16 + l] >> s) & 1) << 4;
      const uint8_t* sc = blk + 4;
      return f16_at(blk) * k_scale_6bit(sc, s, 0) * q - f16_at(blk + 2) * k_scale_6bit(sc, s, 1);
    }
    case QuantFormat::q6_k: {
      // Half h = e / 128; within it r = e % 128, quarter k = r / 32, l = r % 32. Low 4 bits:
      // ql[64 h + 32 (k % 2) + l], low nibble for k < 2, high for k >= 2; top 2 bits: bits
      // 2k, 2k + 1 of qh[32 h + l]; scale: int8 scales[e / 16]. Value d scale (q - 32).
      const int h = e / 128, r = e % 128, k = r / 32, l = r % 32;
      const uint8_t lq = blk[64 * h + 32 * (k % 2) + l];
      const int low4 = k < 2 ? (lq & 15) : (lq >> 4);
      const int top2 = (blk[128 + 32 * h + l] >> (2 * k)) & 3;
      const int q = low4 | (top2 << 4);
      const auto scale = static_cast<int8_t>(blk[192 + e / 16]);
      return f16_at(blk + 208) * scale * (q - 32);
    }
    default:
      CUMULUS_FAIL("verbatim_element: format {} is repacked", quant_format_name(f));
  }
}

}  // namespace

void quant_dequantize_rows(const QuantMatrixView& w, int row_begin, int row_end, double* out) {
  quant_matrix_validate(w);
  CUMULUS_CHECK(row_begin >= 0 && row_begin <= row_end && row_end <= w.rows, "rows [{}, {}) outside [0, {})",
                row_begin, row_end, w.rows);
  if (!quant_format_repacked(w.format)) {
    const int block = quant_format_block(w.format), tb = quant_block_bytes(w.format);
    const size_t row_bytes = static_cast<size_t>(w.cols / block) * tb;
    for (int r = row_begin; r < row_end; ++r) {
      const uint8_t* row = w.qs + static_cast<size_t>(r) * row_bytes;
      double* o = out + static_cast<size_t>(r - row_begin) * w.cols;
      for (int c = 0; c < w.cols; ++c) o[c] = verbatim_element(w.format, row + static_cast<size_t>(c / block) * tb, c % block);
    }
    return;
  }
  const int nb = w.cols / kQuantBlock;
  const int qb = quant_block_bytes(w.format);
  const size_t stride = static_cast<size_t>(quant_scale_stride(w.cols));
  for (int r = row_begin; r < row_end; ++r) {
    for (int b = 0; b < nb; ++b) {
      const size_t blk = static_cast<size_t>(r) * nb + b;
      const uint8_t* qs = w.qs + blk * qb;
      const size_t sc = static_cast<size_t>(r) * stride + b;
      const double d = f16_to_f32(w.d[sc]);
      double* o = out + static_cast<size_t>(r - row_begin) * w.cols + static_cast<size_t>(b) * kQuantBlock;
      for (int j = 0; j < kQuantBlock; ++j) {
        switch (w.format) {
          case QuantFormat::q4_0: {
            const int q = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
            o[j] = (q - 8) * d;
            break;
          }
          case QuantFormat::q4_1: {
            const int q = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
            o[j] = q * d + static_cast<double>(f16_to_f32(w.m[sc]));
            break;
          }
          case QuantFormat::q5_0:
          case QuantFormat::q5_1: {
            // Bit 4 of element j is bit j of the block's qh word.
            const int low4 = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
            const int q = low4 | static_cast<int>(((w.qh[blk] >> j) & 1u) << 4);
            o[j] = w.format == QuantFormat::q5_0 ? (q - 16) * d : q * d + static_cast<double>(f16_to_f32(w.m[sc]));
            break;
          }
          case QuantFormat::q8_0:
            o[j] = static_cast<int8_t>(qs[j]) * d;
            break;
          default:
            break;  // verbatim formats handled above
        }
      }
    }
  }
}

void quant_activation(const float* x, int cols, int bits, QuantActivation& a) {
  CUMULUS_CHECK(cols >= kQuantBlock && cols % kQuantBlock == 0, "quant_activation: cols={} must be a positive multiple of {}",
                cols, kQuantBlock);
  CUMULUS_CHECK(bits == 8 || bits == 16, "quant_activation: bits={} must be 8 or 16", bits);
  const float qmax = bits == 8 ? 127.0f : 32767.0f;
  const int nb = cols / kQuantBlock;
  const size_t padded = static_cast<size_t>((nb + 15) & ~15);
  a.cols = cols;
  a.bits = bits;
  a.q.assign(static_cast<size_t>(cols), 0);
  a.d.assign(padded, 0.0f);
  a.sum.assign(padded, 0.0f);
  for (int b = 0; b < nb; ++b) {
    const float* xb = x + static_cast<size_t>(b) * kQuantBlock;
    float amax = 0.0f;
    for (int j = 0; j < kQuantBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inv = amax > 0.0f ? qmax / amax : 0.0f;
    int32_t isum = 0;
    for (int j = 0; j < kQuantBlock; ++j) {
      const float prod = xb[j] * inv;  // one float32 rounding, then nearest even
      const auto q = static_cast<int16_t>(std::nearbyint(prod));
      a.q[static_cast<size_t>(b) * kQuantBlock + j] = q;
      isum += q;
    }
    a.d[static_cast<size_t>(b)] = amax / qmax;
    a.sum[static_cast<size_t>(b)] = a.d[static_cast<size_t>(b)] * static_cast<float>(isum);
  }
  a.q8.clear();
  a.sum4.clear();
  if (bits == 8) {
    a.q8.resize(static_cast<size_t>(cols));
    a.sum4.assign(static_cast<size_t>(cols / 4), 0);
    for (int j = 0; j < cols; ++j) {
      a.q8[static_cast<size_t>(j)] = static_cast<int8_t>(a.q[static_cast<size_t>(j)]);
      a.sum4[static_cast<size_t>(j / 4)] += a.q[static_cast<size_t>(j)];
    }
  }
}

void gemv_quant(const QuantMatrixView& w, const QuantActivation& x, double* y) {
  quant_matrix_validate(w);
  CUMULUS_CHECK(x.cols == w.cols, "gemv_quant: x has {} columns, W has {}", x.cols, w.cols);
  CUMULUS_CHECK(y != nullptr, "gemv_quant: y must be non-null");
  std::vector<double> row(static_cast<size_t>(w.cols));
  for (int r = 0; r < w.rows; ++r) {
    quant_dequantize_rows(w, r, r + 1, row.data());
    double s = 0.0;
    for (int j = 0; j < w.cols; ++j)
      s += row[static_cast<size_t>(j)] * (static_cast<double>(x.d[static_cast<size_t>(j / kQuantBlock)]) *
                                          x.q[static_cast<size_t>(j)]);
    y[r] = s;
  }
}

}  // namespace ref
}  // namespace cumulus
