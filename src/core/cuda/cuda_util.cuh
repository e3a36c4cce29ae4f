// Pieces every file of the CUDA backend shares: the checked-call macros (every CUDA call
// goes through CUMULUS_CUDA_CHECK, whose error names the call, the file and the line),
// 16-byte loads of f16/bf16 rows widened to float32, warp reductions, and the
// order-preserving float <-> uint32 key used by the sorts and selections. Internal to
// the CUDA libraries (src/*/cuda, src/methods/*/*.cu): public headers never include CUDA
// headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"

namespace cumulus::cuda {

// Throws cumulus::Error("CUDA error <name> (<text>) in <call> at <file>:<line>").
[[noreturn]] void cuda_fail(cudaError_t e, const char* call, const char* file, int line);

}  // namespace cumulus::cuda

#define CUMULUS_CUDA_CHECK(call)                                                               \
  do {                                                                                         \
    const cudaError_t cumulus_cuda_e_ = (call);                                                \
    if (cumulus_cuda_e_ != cudaSuccess) ::cumulus::cuda::cuda_fail(cumulus_cuda_e_, #call, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: the launch itself (bad configuration, no kernel image for the
// device) is checked here; faults inside the kernel surface at the next checked call.
#define CUMULUS_CUDA_LAUNCH(kernel_name)                                                              \
  do {                                                                                                \
    const cudaError_t cumulus_cuda_e_ = cudaGetLastError();                                           \
    if (cumulus_cuda_e_ != cudaSuccess) ::cumulus::cuda::cuda_fail(cumulus_cuda_e_, "launch of " kernel_name, __FILE__, __LINE__); \
  } while (0)

namespace cumulus::cuda {

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Storage types on the device. f32 K/V is not supported by the CUDA backend.
template <DType kT>
struct StorageOf;
template <>
struct StorageOf<DType::f16> {
  using type = __half;
};
template <>
struct StorageOf<DType::bf16> {
  using type = __nv_bfloat16;
};

// 8 consecutive elements (16 bytes) widened to float32.
__device__ __forceinline__ void widen8(const uint4& u, float (&f)[8], __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void widen8(const uint4& u, float (&f)[8], __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// q . k for a row split across RL lanes of a warp, 8 channels a lane: the lane's packed
// 16-bit k widened and multiplied into its qv, then summed over the RL lanes (each lane
// gets the sum). The scoring kernels of tokens and centroids share it (the same order of
// operations everywhere, so their scores agree bit for bit).
template <int RL, typename T>
__device__ __forceinline__ float lane_group_dot8(const float (&qv)[8], const uint4& k, T) {
  float kf[8];
  widen8(k, kf, T());
  float acc = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc = fmaf(qv[e], kf[e], acc);
#pragma unroll
  for (int off = RL / 2; off >= 1; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Streaming 16-byte load through the read-only path (K/V rows are read once per step).
__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

// Sum / max over a full warp (every lane gets the result): float, double, int, long long.
template <class T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
template <class T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Order-preserving key: a > b as floats (with -0 == +0) iff key(a) > key(b) as uint32.
// NaN is not ordered meaningfully (the reference rejects it).
__host__ __device__ __forceinline__ uint32_t float_key(float f) {
  if (f == 0.0f) f = 0.0f;  // -0 -> +0
  uint32_t u;
#ifdef __CUDA_ARCH__
  u = __float_as_uint(f);
#else
  __builtin_memcpy(&u, &f, 4);
#endif
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__host__ __device__ __forceinline__ float key_float(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  float f;
#ifdef __CUDA_ARCH__
  f = __uint_as_float(u);
#else
  __builtin_memcpy(&f, &u, 4);
#endif
  return f;
}

// log(exp(a) + exp(b)) in natural-log units; either may be -inf.
__device__ __forceinline__ double log_add(double a, double b) {
  if (a == -INFINITY) return b;
  if (b == -INFINITY) return a;
  const double m = fmax(a, b);
  return m + log(exp(a - m) + exp(b - m));
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Multiprocessor count of the current device (cached per process).
int sm_count();

// The kernel instantiation for a runtime head_dim: f(std::integral_constant<int, D>()) for
// D = 64, 128 or 256 (DeviceKvView::validate admits no other), and with the cache's 16-bit
// type: f(D, T()) for T = __half or __nv_bfloat16.
template <class F>
void with_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: f(std::integral_constant<int, 64>()); break;
    case 128: f(std::integral_constant<int, 128>()); break;
    default: f(std::integral_constant<int, 256>()); break;
  }
}
template <class F>
void with_head_dim_type(int head_dim, DType dtype, F&& f) {
  with_head_dim(head_dim, [&](auto d) {
    if (dtype == DType::f16) f(d, __half());
    else f(d, __nv_bfloat16());
  });
}

}  // namespace cumulus::cuda
