// Dequantisation of ggml block types to float32 (format summary in quant.h). Written from
// the GGUF/ggml format description; scalar code, run once at load time.
#include "cumulus/model/quant.h"

#include <cstring>

#include "core/check.h"
#include "cumulus/core/dtype.h"

namespace cumulus {
namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::f32, "F32", 1, 4, true},
    {GgmlType::f16, "F16", 1, 2, true},
    {GgmlType::q4_0, "Q4_0", 32, 18, true},
    {GgmlType::q4_1, "Q4_1", 32, 20, true},
    {GgmlType::q5_0, "Q5_0", 32, 22, true},
    {GgmlType::q5_1, "Q5_1", 32, 24, true},
    {GgmlType::q8_0, "Q8_0", 32, 34, true},
    {GgmlType::q8_1, "Q8_1", 32, 36, false},
    {GgmlType::q2_k, "Q2_K", 256, 84, false},
    {GgmlType::q3_k, "Q3_K", 256, 110, false},
    {GgmlType::q4_k, "Q4_K", 256, 144, true},
    {GgmlType::q5_k, "Q5_K", 256, 176, true},
    {GgmlType::q6_k, "Q6_K", 256, 210, true},
    {GgmlType::q8_k, "Q8_K", 256, 292, false},
    {GgmlType::i8, "I8", 1, 1, false},
    {GgmlType::i16, "I16", 1, 2, false},
    {GgmlType::i32, "I32", 1, 4, false},
    {GgmlType::i64, "I64", 1, 8, false},
    {GgmlType::f64, "F64", 1, 8, false},
    {GgmlType::bf16, "BF16", 1, 2, true},
};

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
float load_f16(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// Q4_K / Q5_K: 8 six-bit scales and 8 six-bit mins packed into 12 bytes. Sub-blocks 0..3
// keep their low 6 bits in bytes 0..3 (scales) and 4..7 (mins); sub-blocks 4..7 keep their
// low 4 bits in the nibbles of bytes 8..11 and their top 2 bits in the spare top bits of
// bytes 0..3 (scales) and 4..7 (mins).
void k_scale_min(const uint8_t* s, int j, float* scale, float* min) {
  int sc, m;
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
  *scale = static_cast<float>(sc);
  *min = static_cast<float>(m);
}

void dequant_q4_0(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void dequant_q4_1(const uint8_t* b, float* y) {
  const float d = load_f16(b), m = load_f16(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// Q5_0 / Q5_1 share the layout of the 5-bit quants: qh (u32) then qs[16].
void q5_values(const uint8_t* qh_bytes, const uint8_t* qs, int q[32]) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = (qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
    q[j + 16] = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
  }
}

void dequant_q5_0(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  int q[32];
  q5_values(b + 2, b + 6, q);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(q[j] - 16) * d;
}

void dequant_q5_1(const uint8_t* b, float* y) {
  const float d = load_f16(b), m = load_f16(b + 2);
  int q[32];
  q5_values(b + 4, b + 8, q);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(q[j]) * d + m;
}

void dequant_q8_0(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// Q4_K: 4 groups of 64 elements; group g uses sub-blocks 2g (low nibbles of 32 bytes)
// and 2g + 1 (high nibbles of the same 32 bytes).
void dequant_q4_k(const uint8_t* b, float* y) {
  const float d = load_f16(b), dmin = load_f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 4; ++g) {
    float sc0, m0, sc1, m1;
    k_scale_min(scales, 2 * g, &sc0, &m0);
    k_scale_min(scales, 2 * g + 1, &sc1, &m1);
    const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;
    const uint8_t* q = qs + 32 * g;
    float* out = y + 64 * g;
    for (int l = 0; l < 32; ++l) {
      out[l] = d0 * static_cast<float>(q[l] & 0x0F) - o0;
      out[l + 32] = d1 * static_cast<float>(q[l] >> 4) - o1;
    }
  }
}

// Q5_K: as Q4_K; bit 4 of element l of group g's low half is bit 2g of qh[l], of its high
// half bit 2g + 1.
void dequant_q5_k(const uint8_t* b, float* y) {
  const float d = load_f16(b), dmin = load_f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 4; ++g) {
    float sc0, m0, sc1, m1;
    k_scale_min(scales, 2 * g, &sc0, &m0);
    k_scale_min(scales, 2 * g + 1, &sc1, &m1);
    const float d0 = d * sc0, o0 = dmin * m0, d1 = d * sc1, o1 = dmin * m1;
    const uint8_t* q = qs + 32 * g;
    float* out = y + 64 * g;
    for (int l = 0; l < 32; ++l) {
      const int lo = (q[l] & 0x0F) | (((qh[l] >> (2 * g)) & 1) << 4);
      const int hi = (q[l] >> 4) | (((qh[l] >> (2 * g + 1)) & 1) << 4);
      out[l] = d0 * static_cast<float>(lo) - o0;
      out[l + 32] = d1 * static_cast<float>(hi) - o1;
    }
  }
}

// Q6_K: two halves of 128 elements; half h uses ql[64h..64h+63], qh[32h..32h+31] and
// scales[8h..8h+7]. Within a half, element 32k + l (k = 0..3, l = 0..31) takes its low 4
// bits from ql[l + 32 (k & 1)] (low nibble for k < 2, high for k >= 2) and its top 2 bits
// from bits 2k, 2k+1 of qh[l]; its scale is scales[l / 16 + 2k].
void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql_all = b;
  const uint8_t* qh_all = b + 128;
  const auto* sc_all = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_f16(b + 208);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = ql_all + 64 * h;
    const uint8_t* qh = qh_all + 32 * h;
    const int8_t* sc = sc_all + 8 * h;
    float* out = y + 128 * h;
    for (int k = 0; k < 4; ++k) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo_byte = ql[l + 32 * (k & 1)];
        const int lo = k < 2 ? (lo_byte & 0x0F) : (lo_byte >> 4);
        const int hi = (qh[l] >> (2 * k)) & 3;
        const int q = (lo | (hi << 4)) - 32;
        out[32 * k + l] = d * static_cast<float>(sc[l / 16 + 2 * k]) * static_cast<float>(q);
      }
    }
  }
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(uint32_t id) {
  for (const auto& t : kTypes)
    if (static_cast<uint32_t>(t.type) == id) return &t;
  return nullptr;
}

const GgmlTypeInfo& ggml_type_info(GgmlType t) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(t));
  CUMULUS_CHECK(info != nullptr, "unknown ggml type id {}", static_cast<uint32_t>(t));
  return *info;
}

std::string_view ggml_type_name(GgmlType t) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(t));
  return info ? info->name : std::string_view("unknown");
}

size_t ggml_row_bytes(GgmlType t, uint64_t n) {
  const GgmlTypeInfo& info = ggml_type_info(t);
  CUMULUS_CHECK(n % info.block_size == 0, "n={} is not a multiple of the {} block size {}", n,
                info.name, info.block_size);
  return static_cast<size_t>(n / info.block_size * info.type_size);
}

void dequantize_row(GgmlType t, const void* src, float* dst, uint64_t n) {
  const GgmlTypeInfo& info = ggml_type_info(t);
  CUMULUS_CHECK(info.can_dequantize, "type {} cannot be dequantised", info.name);
  CUMULUS_CHECK(n % info.block_size == 0, "n={} is not a multiple of the {} block size {}", n,
                info.name, info.block_size);
  const auto* p = static_cast<const uint8_t*>(src);
  const uint64_t n_blocks = n / info.block_size;
  switch (t) {
    case GgmlType::f32:
      std::memcpy(dst, p, n * sizeof(float));
      return;
    case GgmlType::f16:
      for (uint64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(load_u16(p + 2 * i));
      return;
    case GgmlType::bf16:
      for (uint64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_u16(p + 2 * i));
      return;
    default:
      break;
  }
  void (*block_fn)(const uint8_t*, float*) = nullptr;
  switch (t) {
    case GgmlType::q4_0: block_fn = dequant_q4_0; break;
    case GgmlType::q4_1: block_fn = dequant_q4_1; break;
    case GgmlType::q5_0: block_fn = dequant_q5_0; break;
    case GgmlType::q5_1: block_fn = dequant_q5_1; break;
    case GgmlType::q8_0: block_fn = dequant_q8_0; break;
    case GgmlType::q4_k: block_fn = dequant_q4_k; break;
    case GgmlType::q5_k: block_fn = dequant_q5_k; break;
    case GgmlType::q6_k: block_fn = dequant_q6_k; break;
    default: CUMULUS_FAIL("type {} cannot be dequantised", info.name);
  }
  for (uint64_t b = 0; b < n_blocks; ++b)
    block_fn(p + b * info.type_size, dst + b * info.block_size);
}

}  // namespace cumulus
