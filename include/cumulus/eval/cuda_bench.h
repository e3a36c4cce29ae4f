// `cumulus bench --device cuda` (src/eval/cuda/bench_cuda.cu, library cumulus_eval_cuda;
// docs/cuda.md "Benchmarks"): the CPU benchmark's synthetic workload (eval/bench.h, the same
// seeds and options) on the GPU decode methods, each run as the model runtime runs it, timed
// between CUDA events with the L2 flushed, against the device's copy bandwidth measured in the
// same run. The report is the CPU run's (BenchReport::device set), so bench_table and
// bench_json print both alike. Plain C++; built only with CUMULUS_CUDA=ON.
#pragma once

#include <cstdio>

#include "cumulus/eval/bench.h"

namespace cumulus {

// Throws Error before any work for a bad option, a method or value not on the GPU, a dtype
// other than f16/bf16, or no CUDA device. Progress lines go to `log` when it is not null.
BenchReport bench_run_cuda(const BenchOptions& options, std::FILE* log = nullptr);

}  // namespace cumulus
