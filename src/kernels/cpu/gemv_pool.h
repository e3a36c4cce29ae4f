// The quantised GEMV of kernels/gemv.h as one threaded call, for tests and benchmarks. The
// model runtime does not call it: weight_matmul (src/model/weight_matrix.cpp) rounds x once
// and splits every matrix of a step into tasks with the same gemv_quant_task_rows and
// gemv_quant_rows, in one parallel_for. Not installed.
#pragma once

#include "cumulus/core/thread_pool.h"
#include "cumulus/kernels/gemv.h"

namespace cumulus::cpu {

// y [rows] = W x, x [cols] float32 (rounded by quant_activation to
// gemv_quant_activation_bits() first). Rows are split into one task per thread
// (gemv_quant_task_rows) and every row is computed by the same instruction sequence wherever
// it falls, so y is bit-identical for any thread count.
void gemv_quant(const QuantMatrixView& w, const float* x, float* y, ThreadPool& pool);

}  // namespace cumulus::cpu
