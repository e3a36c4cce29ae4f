// dtype conversions. f16 conversion is written out (not _cvtss_sh) so the scalar path has
// no ISA requirement; bf16 rounds to nearest even and keeps NaN quiet.
#include "cumulus/core/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>

#include "core/check.h"

namespace cumulus {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "?";
}

DType dtype_from_name(std::string_view name) {
  if (name == "f32") return DType::f32;
  if (name == "f16") return DType::f16;
  if (name == "bf16") return DType::bf16;
  CUMULUS_FAIL("dtype='{}' is not one of f32, f16, bf16", name);
}

uint16_t f32_to_f16(float x) {
  const uint32_t f = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t abs = f & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {                                              // result is subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);          // < 2^-25 rounds to 0
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 + (113 - exp) - 1 ... yields mantissa of subnormal
    uint32_t h = mant >> (shift);
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t f;
  if (exp == 0) {
    if (mant == 0) {
      f = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      f = sign | static_cast<uint32_t>(112 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    f = sign | 0x7f800000u | mant << 13;
  } else {
    f = sign | (exp + 112) << 23 | mant << 13;
  }
  return std::bit_cast<float>(f);
}

uint16_t f32_to_bf16(float x) {
  uint32_t f = std::bit_cast<uint32_t>(x);
  if ((f & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((f >> 16) | 0x40u);  // quiet NaN
  f += 0x7fffu + ((f >> 16) & 1u);
  return static_cast<uint16_t>(f >> 16);
}

float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

void convert_from_f32(const float* src, void* dst, DType dst_type, size_t n) {
  switch (dst_type) {
    case DType::f32: std::memcpy(dst, src, n * sizeof(float)); return;
    case DType::f16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::bf16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
  }
}

void convert_to_f32(const void* src, DType src_type, float* dst, size_t n) {
  switch (src_type) {
    case DType::f32: std::memcpy(dst, src, n * sizeof(float)); return;
    case DType::f16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::bf16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
  }
}

float dtype_load(const void* row, DType t, size_t j) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(row)[j];
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(row)[j]);
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(row)[j]);
  }
  return 0.0f;
}

float dtype_round(float x, DType t) {
  switch (t) {
    case DType::f32: return x;
    case DType::f16: return f16_to_f32(f32_to_f16(x));
    case DType::bf16: return bf16_to_f32(f32_to_bf16(x));
  }
  return x;
}

}  // namespace cumulus
