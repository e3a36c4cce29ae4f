// Weight matrices of the model runtime: float32 or compact GGUF blocks (design note in
// weight_matrix.h), and the batched matmul the forward pass runs on them (OpenBLAS for
// float32 and for prefill, cpu::gemv_quant_rows for quantised decode).
#include "cumulus/model/weight_matrix.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/check.h"

namespace cumulus {
namespace {

// Output rows per task for float32 weights and for the prefill GEMM. OpenBLAS runs
// single-threaded inside each task (the session sets it); the split depends on the shape
// alone, so every output element is computed by the same call on the same slice whatever
// the thread count (OpenBLAS's own threading splits by thread count and changes rounding).
constexpr int kSliceRows = 64;

// The compact format a GGUF type is kept in, if any.
std::optional<QuantFormat> compact_format_of(GgmlType t) {
  switch (t) {
    case GgmlType::q4_0: return QuantFormat::q4_0;
    case GgmlType::q4_1: return QuantFormat::q4_1;
    case GgmlType::q8_0: return QuantFormat::q8_0;
    case GgmlType::q5_0: return QuantFormat::q5_0;
    case GgmlType::q5_1: return QuantFormat::q5_1;
    case GgmlType::q4_k: return QuantFormat::q4_k;
    case GgmlType::q5_k: return QuantFormat::q5_k;
    case GgmlType::q6_k: return QuantFormat::q6_k;
    default: return std::nullopt;
  }
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

}  // namespace

WeightMatrix WeightMatrix::from_f32(std::vector<float> data, int rows, int cols) {
  CUMULUS_CHECK(rows >= 1 && cols >= 1, "weight matrix [{}][{}] must have positive dimensions", rows, cols);
  CUMULUS_CHECK(data.size() == static_cast<size_t>(rows) * static_cast<size_t>(cols),
                "weight matrix [{}][{}] given {} values", rows, cols, data.size());
  WeightMatrix w;
  w.rows_ = rows;
  w.cols_ = cols;
  w.f32_ = std::move(data);
  return w;
}

WeightMatrix WeightMatrix::from_ggml(GgmlType type, std::span<const uint8_t> data, int rows, int cols,
                                     WeightStorage storage, std::string_view name) {
  const GgmlTypeInfo& info = ggml_type_info(type);
  CUMULUS_CHECK(rows >= 1 && cols >= 1, "weight matrix '{}' ({}) [{}][{}] must have positive dimensions", name,
                info.name, rows, cols);
  CUMULUS_CHECK(cols % static_cast<int>(info.block_size) == 0,
                "weight matrix '{}' ({}) [{}][{}]: cols={} is not a multiple of the {} block size {}", name, info.name,
                rows, cols, cols, info.name, info.block_size);
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  const size_t need = static_cast<size_t>(rows) * ggml_row_bytes(type, static_cast<uint64_t>(cols));
  CUMULUS_CHECK(data.size() >= need, "weight matrix '{}' ({}) [{}][{}] needs {} bytes, the tensor has {}", name,
                info.name, rows, cols, need, data.size());
  CUMULUS_CHECK(info.can_dequantize, "weight matrix '{}' has type {}, which cannot be dequantised", name, info.name);
  const std::optional<QuantFormat> format = compact_format_of(type);
  if (storage == WeightStorage::f32 || !format) {
    std::vector<float> f(n);
    dequantize_row(type, data.data(), f.data(), n);
    return from_f32(std::move(f), rows, cols);
  }
  WeightMatrix w;
  w.rows_ = rows;
  w.cols_ = cols;
  w.format_ = *format;
  if (!quant_format_repacked(w.format_)) {
    // The K-quants: the tensor's bytes as they are (kernels/gemv.h).
    w.qs_.assign(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(need));
    return w;
  }
  const int nb = cols / kQuantBlock;
  const size_t stride = static_cast<size_t>(quant_scale_stride(cols));
  const size_t qb = static_cast<size_t>(quant_block_bytes(w.format_));
  const size_t block_bytes = info.type_size;  // bytes of one GGUF block
  w.qs_.resize(static_cast<size_t>(rows) * nb * qb);
  // GGUF blocks: Q4_0 {f16 d, qs[16]}, Q4_1 {f16 d, f16 m, qs[16]}, Q5_0 {f16 d, u32 qh,
  // qs[16]}, Q5_1 {f16 d, f16 m, u32 qh, qs[16]}, Q8_0 {f16 d, i8 qs[32]}.
  const bool has_min = w.format_ == QuantFormat::q4_1 || w.format_ == QuantFormat::q5_1;
  const bool has_qh = w.format_ == QuantFormat::q5_0 || w.format_ == QuantFormat::q5_1;
  const size_t qh_offset = has_min ? 4 : 2;
  const size_t qs_offset = qh_offset + (has_qh ? 4 : 0);
  w.d_.assign(static_cast<size_t>(rows) * stride, 0);
  if (has_min) w.m_.assign(static_cast<size_t>(rows) * stride, 0);
  if (has_qh) w.qh_.resize(static_cast<size_t>(rows) * nb);
  const uint8_t* src = data.data();
  for (int r = 0; r < rows; ++r) {
    for (int b = 0; b < nb; ++b) {
      const size_t blk = static_cast<size_t>(r) * nb + b;
      const uint8_t* s = src + blk * block_bytes;
      w.d_[static_cast<size_t>(r) * stride + b] = load_u16(s);
      if (has_min) w.m_[static_cast<size_t>(r) * stride + b] = load_u16(s + 2);
      if (has_qh) std::memcpy(&w.qh_[blk], s + qh_offset, 4);
      std::memcpy(w.qs_.data() + blk * qb, s + qs_offset, qb);
    }
  }
  return w;
}

std::string_view WeightMatrix::storage_name() const { return quantized() ? quant_format_name(format_) : "F32"; }

size_t WeightMatrix::bytes() const {
  return f32_.size() * sizeof(float) + qs_.size() + (d_.size() + m_.size()) * sizeof(uint16_t) +
         qh_.size() * sizeof(uint32_t);
}

QuantMatrixView WeightMatrix::quant_view() const {
  CUMULUS_CHECK(quantized(), "quant_view of a float32 weight matrix [{}][{}]", rows_, cols_);
  return QuantMatrixView{format_, rows_, cols_, qs_.data(), d_.empty() ? nullptr : d_.data(),
                         m_.empty() ? nullptr : m_.data(), qh_.empty() ? nullptr : qh_.data()};
}

void WeightMatrix::rows_to_f32(int row_begin, int row_end, float* out) const {
  CUMULUS_CHECK(row_begin >= 0 && row_begin <= row_end && row_end <= rows_, "rows [{}, {}) outside [0, {})", row_begin,
                row_end, rows_);
  if (quantized()) {
    cpu::quant_dequantize_rows(quant_view(), row_begin, row_end, out);
  } else {
    std::copy(f32_.begin() + static_cast<ptrdiff_t>(row_begin) * cols_, f32_.begin() + static_cast<ptrdiff_t>(row_end) * cols_,
              out);
  }
}

std::vector<float> WeightMatrix::to_f32() const {
  std::vector<float> out(size());
  rows_to_f32(0, rows_, out.data());
  return out;
}

void weight_matmul(ThreadPool& pool, const float* x, int n_rows, std::span<const MatmulOut> outs,
                   MatmulWorkspace* workspace) {
  struct Task {
    int out, r0, nr;
  };
  std::vector<Task> tasks;
  for (size_t o = 0; o < outs.size(); ++o) {
    const WeightMatrix& w = *outs[o].w;
    CUMULUS_CHECK(w.cols() == outs[0].w->cols(), "weight_matmul: matrices with {} and {} columns share one x", w.cols(),
                  outs[0].w->cols());
    const int per = w.quantized() && n_rows == 1 ? cpu::gemv_quant_task_rows(w.rows(), pool.n_threads()) : kSliceRows;
    for (int r0 = 0; r0 < w.rows(); r0 += per) tasks.push_back({static_cast<int>(o), r0, std::min(per, w.rows() - r0)});
  }
  // Decode: x rounded to codes once for all quantised products, 8 or 16 bits as the GEMV
  // takes them on this CPU (kernels/gemv.h).
  // The caller's workspace (or this call's own), shared by the tasks: the codes written
  // here, the slices one per worker.
  MatmulWorkspace call_ws;
  MatmulWorkspace& scratch = workspace != nullptr ? *workspace : call_ws;
  const size_t n_threads = static_cast<size_t>(pool.n_threads());
  if (scratch.slices.size() < n_threads) scratch.slices.resize(n_threads);
  const QuantActivation* xq = &scratch.x_codes;
  bool any_quant = false;
  for (const MatmulOut& o : outs) any_quant = any_quant || o.w->quantized();
  if (n_rows == 1 && any_quant) cpu::quant_activation(x, outs[0].w->cols(), cpu::gemv_quant_activation_bits(),
                                              scratch.x_codes);
  pool.parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t t, int worker) {
    const Task& task = tasks[static_cast<size_t>(t)];
    const WeightMatrix& w = *outs[static_cast<size_t>(task.out)].w;
    float* y = outs[static_cast<size_t>(task.out)].y;
    const int n_in = w.cols(), n_out = w.rows();
    if (w.quantized() && n_rows == 1) {
      cpu::gemv_quant_rows(w.quant_view(), task.r0, task.r0 + task.nr, *xq, y + task.r0);
      return;
    }
    const float* ws = w.f32();
    if (ws != nullptr) {
      ws += static_cast<size_t>(task.r0) * n_in;
    } else {
      std::vector<float>& slice = scratch.slices[static_cast<size_t>(worker)];
      slice.resize(static_cast<size_t>(task.nr) * n_in);
      w.rows_to_f32(task.r0, task.r0 + task.nr, slice.data());
      ws = slice.data();
    }
    if (n_rows == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, task.nr, n_in, 1.0f, ws, n_in, x, 1, 0.0f, y + task.r0, 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n_rows, task.nr, n_in, 1.0f, x, n_in, ws, n_in, 0.0f,
                  y + task.r0, n_out);
    }
  });
}

}  // namespace cumulus
