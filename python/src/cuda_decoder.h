// The CUDA half of cumulus.Decoder (device="cuda"; python/src/cuda_decoder.cpp, built with
// CUMULUS_CUDA=ON): per layer a DeviceKvCache (kv/cuda_kv_cache.h) holding every sequence,
// the method's GPU decoder as the CUDA model runtime builds it (src/model/cuda/
// decode_methods.h; nullptr: dense attention) and its attention plan. Arrays are CUDA
// float32 tensors of the current device, C-contiguous, read and written in place; work is
// enqueued on the legacy default stream, which orders it with torch's default stream.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "binding.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/shape.h"

namespace cumulus::python {

// One step's statistics, per (sequence, query head), as the CPU Decoder reports them.
struct CudaStepStats {
  std::vector<int32_t> tokens;
  std::vector<double> claimed, bytes, mass_true;
  std::vector<uint8_t> bypass;
};

class CudaDecoder {
 public:
  virtual ~CudaDecoder() = default;
  // Checks the method on the GPU, the shape and the memory (create_bytes against the free
  // device memory) before allocating; throws cumulus::Error naming what is wrong.
  static std::unique_ptr<CudaDecoder> make(const std::string& method, const std::map<std::string, std::string>& params,
                                           const Shape& shape, int batch, DType dtype, int page_size, int max_tokens,
                                           bool eval);
  // k, v: [batch, n, n_kv_heads, head_dim] float32 on the device: n tokens for every sequence.
  virtual void append(const AnyArray& k, const AnyArray& v, int layer) = 0;
  // prompt_q: [batch, rows, n_q_heads, head_dim] float32 on the device, or none.
  virtual void build_index(int layer, const AnyArray* prompt_q) = 0;
  // q, out: [batch, n_q_heads, head_dim] float32 on the device (out written). stats: the
  // step's statistics copied to the host (synchronises); false: none, nothing waits, and the
  // totals add up on the device.
  virtual CudaStepStats decode(const AnyArray& q, int layer, float* out, bool stats) = 0;
  // The layer's totals (synchronises).
  virtual StepTotals totals(int layer) = 0;
  virtual void truncate(int n, std::optional<int> seq) = 0;
  virtual std::vector<int> lengths(int layer) const = 0;
  virtual size_t kv_bytes() const = 0;
  virtual int prompt_queries() const = 0;
};

// Allocates n floats on the current device; the capsule frees them (a CUDA tensor's owner).
float* cuda_alloc_floats(size_t n, nb::capsule& owner);
// The current CUDA device's index.
int cuda_current_device();

}  // namespace cumulus::python
