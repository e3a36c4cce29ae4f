// Storage dtypes for K/V and weights. Computation is always float32 (or float64 in the
// reference kernels); 16-bit types exist only in memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace cumulus {

enum class DType : uint8_t { f32, f16, bf16 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
// Parses "f32", "f16", "bf16"; throws Error naming the bad value otherwise.
DType dtype_from_name(std::string_view name);

// IEEE binary16 and bfloat16 conversions, round to nearest even; NaN and Inf preserved.
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t h);

// Row conversions between float32 and a storage dtype (scalar; hot paths use the SIMD
// kernels in src/kernels/cpu).
void convert_from_f32(const float* src, void* dst, DType dst_type, size_t n);
void convert_to_f32(const void* src, DType src_type, float* dst, size_t n);
// Element j of a row stored as `t`, as float32 (scalar references).
float dtype_load(const void* row, DType t, size_t j);

// Round-trip through the storage type: what a value becomes once stored.
float dtype_round(float x, DType t);

}  // namespace cumulus
