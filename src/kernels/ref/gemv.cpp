// Reference matrix-vector product against block-quantised weights (scalar, float64, never
// optimised; layout and activation rounding in kernels/gemv.h), and the view checks every
// backend shares. Each weight is dequantised in float64 from its f16 scale (and min) and
// its integer code, each activation is dx_b q_j, and every product is summed in float64.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/gemv.h"

namespace cumulus {

std::string_view quant_format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::q4_0: return "Q4_0";
    case QuantFormat::q4_1: return "Q4_1";
    case QuantFormat::q8_0: return "Q8_0";
  }
  return "?";
}

int quant_block_bytes(QuantFormat f) { return f == QuantFormat::q8_0 ? 32 : 16; }

void quant_matrix_validate(const QuantMatrixView& w) {
  CUMULUS_CHECK(w.format == QuantFormat::q4_0 || w.format == QuantFormat::q4_1 || w.format == QuantFormat::q8_0,
                "quant matrix format={} is unknown", static_cast<int>(w.format));
  CUMULUS_CHECK(w.rows >= 1, "quant matrix rows={} must be >= 1", w.rows);
  CUMULUS_CHECK(w.cols >= kQuantBlock && w.cols % kQuantBlock == 0,
                "quant matrix cols={} must be a positive multiple of {}", w.cols, kQuantBlock);
  CUMULUS_CHECK(w.qs != nullptr && w.d != nullptr, "quant matrix ({}) has a null qs or d array",
                quant_format_name(w.format));
  CUMULUS_CHECK((w.m != nullptr) == (w.format == QuantFormat::q4_1), "quant matrix ({}): m must be {}",
                quant_format_name(w.format), w.format == QuantFormat::q4_1 ? "set" : "null");
}

namespace ref {

void quant_dequantize_rows(const QuantMatrixView& w, int row_begin, int row_end, double* out) {
  quant_matrix_validate(w);
  CUMULUS_CHECK(row_begin >= 0 && row_begin <= row_end && row_end <= w.rows, "rows [{}, {}) outside [0, {})",
                row_begin, row_end, w.rows);
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
          case QuantFormat::q8_0:
            o[j] = static_cast<int8_t>(qs[j]) * d;
            break;
        }
      }
    }
  }
}

void quant_activation(const float* x, int cols, QuantActivation& a) {
  CUMULUS_CHECK(cols >= kQuantBlock && cols % kQuantBlock == 0, "quant_activation: cols={} must be a positive multiple of {}",
                cols, kQuantBlock);
  const int nb = cols / kQuantBlock;
  const size_t padded = static_cast<size_t>((nb + 15) & ~15);
  a.cols = cols;
  a.q.assign(static_cast<size_t>(cols), 0);
  a.d.assign(padded, 0.0f);
  a.sum.assign(padded, 0.0f);
  for (int b = 0; b < nb; ++b) {
    const float* xb = x + static_cast<size_t>(b) * kQuantBlock;
    float amax = 0.0f;
    for (int j = 0; j < kQuantBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    int32_t isum = 0;
    for (int j = 0; j < kQuantBlock; ++j) {
      const float prod = xb[j] * inv;  // one float32 rounding, then nearest even
      const auto q = static_cast<int16_t>(std::nearbyint(prod));
      a.q[static_cast<size_t>(b) * kQuantBlock + j] = q;
      isum += q;
    }
    a.d[static_cast<size_t>(b)] = amax / 32767.0f;
    a.sum[static_cast<size_t>(b)] = a.d[static_cast<size_t>(b)] * static_cast<float>(isum);
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
