// ggml tensor types as stored in GGUF files, and dequantisation of rows to float32.
//
// Block formats (ggml, little-endian; "f16" is IEEE binary16):
//   Q4_0 [32]  f16 d, u8 qs[16]                     x = (q - 8) d
//   Q4_1 [32]  f16 d, f16 m, u8 qs[16]              x = q d + m
//   Q5_0 [32]  f16 d, u8 qh[4], u8 qs[16]           x = (q - 16) d, bit 4 of q from qh
//   Q5_1 [32]  f16 d, f16 m, u8 qh[4], u8 qs[16]    x = q d + m
//   Q8_0 [32]  f16 d, i8 qs[32]                     x = q d
//   Q4_K [256] f16 d, f16 dmin, u8 scales[12], u8 qs[128]
//              8 sub-blocks of 32, 6-bit scale sc and min m each: x = d sc q - dmin m
//   Q5_K [256] as Q4_K plus u8 qh[32] (bit 4 of q), before qs
//   Q6_K [256] u8 ql[128], u8 qh[64], i8 scales[16], f16 d: 16 sub-blocks of 16,
//              x = d scale (q - 32), q 6 bits (4 from ql, 2 from qh)
// In the 32-element types, qs[j] holds element j in its low nibble and element j + 16 in
// its high nibble, and bit j of the u32 qh is bit 4 of element j.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace cumulus {

// Values are the ggml type ids written in GGUF tensor infos.
enum class GgmlType : uint32_t {
  f32 = 0, f16 = 1, q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, q8_0 = 8, q8_1 = 9,
  q2_k = 10, q3_k = 11, q4_k = 12, q5_k = 13, q6_k = 14, q8_k = 15,
  i8 = 24, i16 = 25, i32 = 26, i64 = 27, f64 = 28, bf16 = 30,
};

struct GgmlTypeInfo {
  GgmlType type;
  std::string_view name;
  uint32_t block_size;   // elements per block
  uint32_t type_size;    // bytes per block
  bool can_dequantize;   // dequantize_row supports it
};

// nullptr for an id this reader does not know (the caller reports the error).
const GgmlTypeInfo* ggml_type_info(uint32_t id);
const GgmlTypeInfo& ggml_type_info(GgmlType t);
std::string_view ggml_type_name(GgmlType t);

// Bytes of a row of n elements; n must be a multiple of the block size (checked).
size_t ggml_row_bytes(GgmlType t, uint64_t n);

// Dequantises n elements (a multiple of the type's block size) from src to dst[n].
// Throws Error for types without dequantisation or a bad n.
void dequantize_row(GgmlType t, const void* src, float* dst, uint64_t n);

}  // namespace cumulus
