// Matrix-vector products against weights kept in the block quantisation of their GGUF file
// (the ggml block formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 of 32 elements and the K-quants
// Q4_K, Q5_K, Q6_K of 256), so decode reads 4.5 to 8.5 bits per weight instead of 32.
// Backends share signatures: ref:: (scalar, float64, never optimised) and cpu:: (Highway
// SIMD with runtime dispatch). Block layouts are in model/quant.h.
//
// Activations: x [cols] is rounded once per product to integer codes per block of 32
// (QuantActivation), 16 or 8 bits: q_j = round(x_j * Q / amax_b) (nearest even), dx_b =
// amax_b / Q, amax_b = max_j |x_j| over the block, Q = 32767 (16 bits) or 127 (8 bits). Products
// of 4- to 8-bit weight codes with the codes are then exact integer multiply-adds, per scale
// group (16 or 32 weights sharing one scale), and float32 across groups. Every weight format's
// scale groups lie inside one activation block of 32. The contract of both backends is
// y = W (dx q), with W dequantised exactly, for either width.
// 16 bits (pmaddwd: int16 x int16, twice the throughput of widening both to float32) change
// each x_j by about dx_b / 2 = amax_b * 2^-16 at most; 8 bits (vpdpbusd: u8 x s8 in groups of
// 4, AVX-512 VNNI, as llama.cpp's Q8_0/Q8_1 activations) by amax_b / 254, 129x coarser, for
// about half the instructions per weight. The model runtime takes 16 bits
// (cpu::gemv_quant_activation_bits): 8-bit codes measured no faster in the model (Gemma 3 at
// 32K: the head, MLP and Q/K/V times within noise of the 16-bit path, docs/model.md) and
// moved SmolLM2's logits 40x further from float32 weights (max 0.49 against 0.012). They
// stay available: quant_activation(x, cols, 8, a), then gemv_quant_rows (vpdpbusd where the
// dispatched target has VNNI, Highway's AVX3_DL; else the 16-bit products on the 8-bit
// codes, the same integer sums).
//
// Weight layout, two kinds:
// Repacked (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; struct of arrays, built once at load from the
// GGUF blocks):
//   qs [rows][cols / 32][16]  Q4_x/Q5_x: byte j holds (the low 4 bits of) element j (low
//                             nibble) and j + 16 (high nibble) of the block, as in ggml
//      [rows][cols / 32][32]  Q8_0: int8 elements
//   d  [rows][S]              f16 scale per block; S = quant_scale_stride(cols), the block
//                             count rounded up to a multiple of 8 with zero padding, so a
//                             row's scales convert to float32 in whole 8-lane vectors
//   m  [rows][S]              f16 min per block (Q4_1, Q5_1; nullptr otherwise), padded
//                             with zeros likewise
//   qh [rows][cols / 32]      Q5_x: u32 whose bit j is bit 4 of element j (nullptr otherwise)
//   Element value: Q4_0 (q - 8) d, Q4_1 q d + m, Q5_0 (q - 16) d, Q5_1 q d + m, Q8_0 q d.
// Verbatim (Q4_K, Q5_K, Q6_K): the GGUF tensor's bytes unchanged,
//   qs [rows][cols / 256][T]  T = quant_block_bytes (144, 176, 210); d, m and qh are
//                             nullptr. The scales sit inside the blocks (one or two per
//                             32 weights), so repacking them would save no reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>


namespace cumulus {

enum class QuantFormat : uint8_t { q4_0, q4_1, q8_0, q5_0, q5_1, q4_k, q5_k, q6_k };

// Elements per activation block, and per weight block of the 32-element formats.
constexpr int kQuantBlock = 32;

std::string_view quant_format_name(QuantFormat f);  // "Q4_0", ..., "Q6_K"
// True for the repacked formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), false for the K-quants.
bool quant_format_repacked(QuantFormat f);
// Elements per weight block: 32, or 256 for the K-quants.
int quant_format_block(QuantFormat f);
// Bytes of qs per block: 16 for Q4_x/Q5_x, 32 for Q8_0; the GGUF block size for the
// verbatim formats.
int quant_block_bytes(QuantFormat f);
// Entries per row of d and m (repacked formats): cols / 32 rounded up to a multiple of 8.
inline int quant_scale_stride(int cols) { return (cols / kQuantBlock + 7) & ~7; }

// A read-only view of a quantised matrix W [rows][cols]; cols is a multiple of the
// format's block (32 or 256). d, m and qh: repacked formats only (see above).
struct QuantMatrixView {
  QuantFormat format = QuantFormat::q4_1;
  int rows = 0;
  int cols = 0;
  const uint8_t* qs = nullptr;
  const uint16_t* d = nullptr;
  const uint16_t* m = nullptr;
  const uint32_t* qh = nullptr;
};

// Checks the view (the arrays its format needs non-null, the others null; cols a positive
// multiple of the format's block; rows >= 1); throws Error naming the bad value.
void quant_matrix_validate(const QuantMatrixView& w);

// x [cols] rounded to codes per block of 32 (see the top of this file). Arrays indexed by
// block are padded with zeros to a multiple of 16 entries.
struct QuantActivation {
  int cols = 0;
  int bits = 16;           // 16: codes in [-32767, 32767]; 8: in [-127, 127]
  std::vector<int16_t> q;  // [cols]
  std::vector<float> d;    // [blocks, padded] dx_b = amax_b / Q (0 for an all-zero block)
  std::vector<float> sum;  // [blocks, padded] dx_b * sum_j q_j (the min terms' factor)
  // bits == 8 only (empty otherwise), for byte dot products: the codes as int8, and the sum
  // of each 4 consecutive codes (what vpdpbusd adds into one int32 lane).
  std::vector<int8_t> q8;      // [cols]
  std::vector<int32_t> sum4;   // [cols / 4]
};

namespace ref {
// The rounding of x to `bits` (16 or 8) bits, scalar, float32 operations exactly as
// documented above.
void quant_activation(const float* x, int cols, int bits, QuantActivation& a);
// y [rows] = W (dx q): every weight dequantised and every product summed in float64.
void gemv_quant(const QuantMatrixView& w, const QuantActivation& x, double* y);
// out [row_end - row_begin][cols] = W rows [row_begin, row_end), float64: every weight from
// its f16 scale(s), integer sub-block scale and code (the float64 reference dequantiser,
// checked against gguf-py's in tests/test_model_quant.cpp).
void quant_dequantize_rows(const QuantMatrixView& w, int row_begin, int row_end, double* out);
}  // namespace ref

namespace cpu {
// The rounding of x (SIMD); bit-identical to ref::quant_activation.
void quant_activation(const float* x, int cols, int bits, QuantActivation& a);
// The activation width the model runtime uses: 16 (see the top of this file for why not 8
// where VNNI is there).
int gemv_quant_activation_bits();
// The single-threaded core: y [row_end - row_begin] = rows [row_begin, row_end) of W x,
// x of either width (8 bits: VNNI byte dot products where the target has them, else the
// 16-bit path on the 8-bit codes, which gives the same integer sums). No checks (callers
// validated the view and x.cols == w.cols).
void gemv_quant_rows(const QuantMatrixView& w, int row_begin, int row_end, const QuantActivation& x, float* y);
// out [row_end - row_begin][cols] = W rows [row_begin, row_end) dequantised to float32
// (for the prefill GEMM, which multiplies a slice at a time). No checks.
void quant_dequantize_rows(const QuantMatrixView& w, int row_begin, int row_end, float* out);
// Rows per task when a product with a matrix of `rows` rows is split over `n_threads`
// threads: at most one contiguous run of whole row groups per thread and matrix (the
// shortest such run, at least 16 rows), so each thread streams its rows in address order,
// which the prefetchers follow. The result does not depend on the split: every row is
// computed by the same instruction sequence wherever it falls (tested for 1-3 threads).
// The model runtime's split, src/model/weight_matrix.cpp.
int gemv_quant_task_rows(int rows, int n_threads);
}  // namespace cpu

}  // namespace cumulus
