// A weight matrix W [rows][cols] of the model (y = W x reads row o for output o) and the
// products the forward pass takes with it.
//
// DESIGN (weight storage): GGUF tensors in the block formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K and Q6_K stay quantised in memory (kernels/gemv.h): the 32-element formats
// repacked once at load into a struct-of-arrays layout (the same bytes as the file, plus
// scale padding), the K-quants kept as the file's bytes. Every other type (F32, F16, BF16, Q2_K,
// Q3_K, ...) and llama2.c checkpoints are dequantised to float32 on load; so a Q4_K_M file
// (Q4_K, Q6_K, Q5_0, Q8_0 matrices) holds about its file size in memory.
//   decode (one row):   quantised -> cpu::gemv_quant_rows (Highway, reads the blocks);
//                       float32   -> OpenBLAS sgemv
//   prefill (C rows):   float32   -> OpenBLAS sgemm
//                       quantised -> each task dequantises its slice of 64 weight rows to
//                                    float32 scratch, then OpenBLAS sgemm; the slice is
//                                    reused for all C rows, so dequantising costs ~1/C of
//                                    the GEMM and no float32 copy of the model is kept
// SmolLM2-135M Q4_1 thus holds 100 MB of weights instead of 540 MB, and a decode step
// reads 100 MB of them (`cumulus generate --bench` prints both).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cumulus/core/buffer.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/kernels/gemv.h"
#include "cumulus/model/quant.h"

namespace cumulus {

enum class WeightStorage : uint8_t {
  compact,  // Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K kept quantised (default)
  f32,      // everything dequantised to float32 on load
};

class WeightMatrix {
 public:
  WeightMatrix() = default;
  // Float32 data [rows][cols] (data.size() == rows * cols, checked).
  static WeightMatrix from_f32(std::vector<float> data, int rows, int cols);
  // Raw GGUF tensor data of `type` holding rows * cols elements (cols innermost). With
  // WeightStorage::compact, the block formats above stay quantised; otherwise the data is
  // dequantised to float32. Throws Error naming `name` (the tensor), the type and the value
  // for: cols not a multiple of the type's block size, data shorter than the rows need, a
  // type that cannot be dequantised.
  static WeightMatrix from_ggml(GgmlType type, std::span<const uint8_t> data, int rows, int cols,
                                WeightStorage storage, std::string_view name = "");

  int rows() const { return rows_; }
  int cols() const { return cols_; }
  size_t size() const { return static_cast<size_t>(rows_) * static_cast<size_t>(cols_); }
  bool empty() const { return rows_ == 0; }
  bool quantized() const { return f32_.empty() && rows_ > 0; }
  // "F32" or the block format ("Q4_0", ..., "Q6_K").
  std::string_view storage_name() const;
  // Bytes held in memory.
  size_t bytes() const;
  // Float32 data [rows][cols]; nullptr when quantised.
  const float* f32() const { return quantized() ? nullptr : f32_.data(); }
  // The repacked matrix (only when quantised).
  QuantMatrixView quant_view() const;
  // out [row_end - row_begin][cols] = rows [row_begin, row_end) as float32.
  void rows_to_f32(int row_begin, int row_end, float* out) const;
  // The whole matrix as float32 [rows][cols] (tests, tools).
  std::vector<float> to_f32() const;

 private:
  int rows_ = 0, cols_ = 0;
  std::vector<float> f32_;
  QuantFormat format_ = QuantFormat::q4_1;
  // Huge pages where a matrix spans them (core/buffer.h): Gemma 3's 178 MB tied head read
  // at 22 GB/s on one core from 2 MiB pages against 15 GB/s from 4 KiB pages.
  LargeVector<uint8_t> qs_;
  LargeVector<uint16_t> d_, m_;
  LargeVector<uint32_t> qh_;
};

// One product of a batched matmul: y [n_rows][w->rows()] = x [n_rows][w->cols()] W^T.
struct MatmulOut {
  const WeightMatrix* w = nullptr;
  float* y = nullptr;
};

// Scratch of weight_matmul, owned by the caller (a Session: one per sequence) and reused by
// every call, so no product allocates in steady state and the scratch lives as long as its
// owner, not as long as a thread: decode's x rounded to codes once for every quantised
// product ([cols]), and prefill's float32 copies of quantised weight rows, one per pool
// thread ([64][cols] each). A call without one allocates its own.
struct MatmulWorkspace {
  QuantActivation x_codes;
  std::vector<std::vector<float>> slices;  // [pool threads][64 rows][cols]
};

// Every product in `outs` against the same x [n_rows][cols] (all W have cols columns), in
// one parallel_for, as tasks of output rows. n_rows > 1 (the GEMM path): slices whose size
// depends on the matrix shape alone. n_rows == 1 with quantised weights (the GEMV path): one
// run of rows per thread and matrix (cpu::gemv_quant_task_rows), each row computed by the
// same instructions whichever task holds it. Either way the result is bit-identical for any
// thread count (see the design note above).
void weight_matmul(ThreadPool& pool, const float* x, int n_rows, std::span<const MatmulOut> outs,
                   MatmulWorkspace* workspace = nullptr);

}  // namespace cumulus
