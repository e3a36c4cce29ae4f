// --device cpu|cuda: which runtime runs the model (model/runner.h) or the benchmark
// (eval/bench.h, eval/cuda_bench.h). The CUDA runtime is linked only in a CUDA build
// (CUMULUS_HAVE_CUDA, from the CUDA libraries); elsewhere --device cuda is an error naming
// the reason, raised before the model is loaded.
#include <fmt/format.h>

#include "core/check.h"
#include "cli.h"
#include "cumulus/core/error.h"
#ifdef CUMULUS_HAVE_CUDA
#include "cumulus/eval/cuda_bench.h"
#include "cumulus/model/cuda_runner.h"
#endif

namespace cumulus::cli {

void device_check(const std::string& device, const ModelConfig& config, const SessionOptions& options) {
  CUMULUS_CHECK(device == "cpu" || device == "cuda", "--device={} must be cpu or cuda", device);
  if (device == "cpu") return;
#ifdef CUMULUS_HAVE_CUDA
  cuda_runner_check(config, options);
#else
  CUMULUS_FAIL("--device cuda: this build of cumulus has no CUDA backend (configure with -DCUMULUS_CUDA=ON, the "
               "`cuda` preset)");
#endif
}

std::unique_ptr<ModelRunner> runner_make(const std::string& device, const ModelWeights& weights,
                                         const SessionOptions& options) {
  if (device == "cpu") return model_runner_cpu(weights, options);
#ifdef CUMULUS_HAVE_CUDA
  return model_runner_cuda(weights, options);
#else
  device_check(device, weights.config, options);
  return nullptr;  // not reached: device_check throws
#endif
}

std::vector<std::string> device_decode_methods(const std::string& device, const ModelConfig& config) {
  CUMULUS_CHECK(device == "cuda", "device_decode_methods: --device={} (cpu runs every decode method)", device);
#ifdef CUMULUS_HAVE_CUDA
  return cuda_runner_methods(config);
#else
  device_check(device, config, {});
  return {};  // not reached: device_check throws
#endif
}

BenchReport bench_run_device(const std::string& device, const BenchOptions& options, std::FILE* log) {
  CUMULUS_CHECK(device == "cpu" || device == "cuda", "--device={} must be cpu or cuda", device);
  if (device == "cpu") return bench_run(options, log);
#ifdef CUMULUS_HAVE_CUDA
  return bench_run_cuda(options, log);
#else
  CUMULUS_FAIL("--device cuda: this build of cumulus has no CUDA backend (configure with -DCUMULUS_CUDA=ON, the "
               "`cuda` preset)");
#endif
}

std::string device_line() {
#ifdef CUMULUS_HAVE_CUDA
  return "cuda: " + cuda_device_summary();
#else
  return "cuda: not built (configure with -DCUMULUS_CUDA=ON)";
#endif
}

}  // namespace cumulus::cli
