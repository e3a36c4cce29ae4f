// The small kernels of the GPU forward pass (forward_kernels.cuh has the contracts).
#include <cfloat>

#include "core/check.h"
#include "forward_kernels.cuh"
#include "core/cuda/cuda_util.cuh"

namespace cumulus::cuda::model {
namespace {

constexpr int kThreads = 256;

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets it.
template <class T>
__device__ T block_sum(T v) {
  __shared__ T part[32];
  for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += part[w];
  return total;
}
__device__ float block_max_f(float v) {
  __shared__ float part[32];
  for (int o = 16; o >= 1; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) m = fmaxf(m, part[w]);
  return m;
}

__global__ void embed_kernel(const int32_t* tokens, const __half* embd, int dim, float scale, float* x) {
  const size_t row = static_cast<size_t>(tokens[blockIdx.x]) * dim;
  float* out = x + static_cast<size_t>(blockIdx.x) * dim;
  for (int j = threadIdx.x; j < dim; j += blockDim.x) out[j] = __half2float(embd[row + j]) * scale;
}

__global__ void rmsnorm_kernel(const float* x, const float* g, int dim, float eps, __half* out) {
  const float* r = x + static_cast<size_t>(blockIdx.x) * dim;
  double ss = 0;
  for (int j = threadIdx.x; j < dim; j += blockDim.x) ss += static_cast<double>(r[j]) * r[j];
  ss = block_sum(ss);
  const float inv = static_cast<float>(1.0 / sqrt(ss / dim + eps));
  __half* o = out + static_cast<size_t>(blockIdx.x) * dim;
  for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = __float2half_rn(r[j] * inv * g[j]);
}

// Grid (n, n_heads), rope_dim / 2 threads (pair i).
__global__ void rope_kernel(float* x, int n_heads, int head_dim, const int32_t* pos0, bool per_row, double theta) {
  const int i = threadIdx.x;
  const int pos = per_row ? pos0[blockIdx.x] : pos0[0] + static_cast<int>(blockIdx.x);
  const double freq = pow(theta, -static_cast<double>(2 * i) / head_dim);
  const double angle = pos * freq;
  const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
  float* p = x + (static_cast<size_t>(blockIdx.x) * n_heads + blockIdx.y) * head_dim;
  const float a = p[2 * i], b = p[2 * i + 1];
  p[2 * i] = a * c - b * s;
  p[2 * i + 1] = a * s + b * c;
}

__global__ void swiglu_kernel(const float* gate, const float* up, size_t n, __half* out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = __float2half_rn(g / (1.0f + expf(-g)) * up[i]);
  }
}

__global__ void to_half_kernel(const float* x, size_t n, __half* out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = __float2half_rn(x[i]);
}

// Grid (n, heads), d threads (looping).
__global__ void to_head_major_kernel(const float* x, int n, int heads, int d, __half* out) {
  const int i = blockIdx.x, h = blockIdx.y;
  const float* src = x + (static_cast<size_t>(i) * heads + h) * d;
  __half* dst = out + (static_cast<size_t>(h) * n + i) * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = __float2half_rn(src[j]);
}
__global__ void from_head_major_kernel(const __half* x, int n, int heads, int d, __half* out) {
  const int i = blockIdx.x, h = blockIdx.y;
  const __half* src = x + (static_cast<size_t>(h) * n + i) * d;
  __half* dst = out + (static_cast<size_t>(i) * heads + h) * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
}

template <class T>
__global__ void cache_to_head_major_kernel(DeviceKvView kv, int n, __half* k, __half* v) {
  const int t = blockIdx.x, h = blockIdx.y, d = kv.head_dim;
  const int page = kv.page_table[static_cast<size_t>(h) * kv.max_pages + (t >> kv.page_shift)];
  const size_t src = (static_cast<size_t>(page) * kv.page_size + (t & (kv.page_size - 1))) * d;
  const size_t dst = (static_cast<size_t>(h) * n + t) * d;
  const T* ks = static_cast<const T*>(kv.k) + src;
  const T* vs = static_cast<const T*>(kv.v) + src;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    k[dst + j] = __float2half_rn(to_float(ks[j]));
    v[dst + j] = __float2half_rn(to_float(vs[j]));
  }
}

// Grid (n_q_heads, n), kRowThreads threads: tiles of kRowThreads keys, one score per
// thread, then each thread accumulates the output dimensions j = t, t + kRowThreads.
constexpr int kRowThreads = 128;
constexpr int kRowMaxDim = 2 * kRowThreads;

template <class T>
__global__ void attention_rows_kernel(DeviceKvView kv, int n, int group, float scale, const float* q, __half* out) {
  __shared__ float qs[kRowMaxDim];
  __shared__ float p[kRowThreads];
  const int qh = blockIdx.x, i = blockIdx.y, t = threadIdx.x, d = kv.head_dim, kvh = qh / group;
  const int n_q = gridDim.x;
  const int last = kv.n_tokens[0] - n + i;  // the row's position: keys [0, last]
  const float* qrow = q + (static_cast<size_t>(i) * n_q + qh) * d;
  for (int j = t; j < d; j += kRowThreads) qs[j] = qrow[j];
  __syncthreads();
  const T* kpool = static_cast<const T*>(kv.k);
  const T* vpool = static_cast<const T*>(kv.v);
  const int32_t* table = kv.page_table + static_cast<size_t>(kvh) * kv.max_pages;
  const int ps = kv.page_size;
  float m = -INFINITY, l = 0, acc0 = 0, acc1 = 0;
  for (int base = 0; base <= last; base += kRowThreads) {
    const int j = base + t;
    float s = -INFINITY;
    if (j <= last) {
      const T* kr = kpool + (static_cast<size_t>(table[j >> kv.page_shift]) * ps + (j & (ps - 1))) * d;
      float dot = 0;
      for (int c = 0; c < d; ++c) dot += qs[c] * to_float(kr[c]);
      s = dot * scale;
    }
    const float m_new = fmaxf(m, block_max_f(s));
    const float pj = j <= last ? expf(s - m_new) : 0.0f;
    const float corr = expf(m - m_new);  // 0 on the first tile (m = -inf)
    l = l * corr + block_sum(pj);
    p[t] = pj;
    __syncthreads();
    const int cnt = min(kRowThreads, last + 1 - base);
    acc0 *= corr;
    acc1 *= corr;
    for (int jj = 0; jj < cnt; ++jj) {
      const int tok = base + jj;
      const T* vr = vpool + (static_cast<size_t>(table[tok >> kv.page_shift]) * ps + (tok & (ps - 1))) * d;
      if (t < d) acc0 += p[jj] * to_float(vr[t]);
      if (t + kRowThreads < d) acc1 += p[jj] * to_float(vr[t + kRowThreads]);
    }
    m = m_new;
    __syncthreads();
  }
  __half* o = out + (static_cast<size_t>(i) * n_q + qh) * d;
  if (t < d) o[t] = __float2half_rn(acc0 / l);
  if (t + kRowThreads < d) o[t + kRowThreads] = __float2half_rn(acc1 / l);
}

// One CTA of 1024 threads per row: the maximum, lowest index on ties.
__global__ void argmax_kernel(const float* x, int n, int32_t* out) {
  x += static_cast<size_t>(blockIdx.x) * n;
  out += blockIdx.x;
  __shared__ float bv[32];
  __shared__ int bi[32];
  float v = -INFINITY;
  int idx = n;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    if (x[i] > v) v = x[i], idx = i;  // ascending i per thread: the first maximum
  for (int o = 16; o >= 1; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) v = ov, idx = oi;
  }
  if ((threadIdx.x & 31) == 0) bv[threadIdx.x >> 5] = v, bi[threadIdx.x >> 5] = idx;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w)
      if (bv[w] > v || (bv[w] == v && bi[w] < idx)) v = bv[w], idx = bi[w];
    *out = idx < n ? idx : 0;
  }
}

__device__ __forceinline__ float hash_uniform(uint64_t seed, size_t i) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);  // splitmix64
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
}
template <class T>
__global__ void fill_uniform_kernel(T* x, size_t n, float a, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    x[i] = static_cast<T>(a * (2.0f * hash_uniform(seed, i) - 1.0f));
}

unsigned grid_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65535)); }

}  // namespace

void embed(const int32_t* tokens, int n, const __half* embd, int dim, float scale, float* x, cudaStream_t st) {
  embed_kernel<<<n, kThreads, 0, st>>>(tokens, embd, dim, scale, x);
  CUMULUS_CUDA_LAUNCH("embed_kernel");
}

void rmsnorm(const float* x, const float* g, int n, int dim, float eps, __half* out, cudaStream_t st) {
  rmsnorm_kernel<<<n, kThreads, 0, st>>>(x, g, dim, eps, out);
  CUMULUS_CUDA_LAUNCH("rmsnorm_kernel");
}

void rope(float* x, int n, int n_heads, int head_dim, int rope_dim, const int32_t* pos0, bool per_row, float theta,
          cudaStream_t st) {
  rope_kernel<<<dim3(n, n_heads), rope_dim / 2, 0, st>>>(x, n_heads, head_dim, pos0, per_row,
                                                          static_cast<double>(theta));
  CUMULUS_CUDA_LAUNCH("rope_kernel");
}

void swiglu(const float* gate, const float* up, size_t n, __half* out, cudaStream_t st) {
  swiglu_kernel<<<grid_for(n), kThreads, 0, st>>>(gate, up, n, out);
  CUMULUS_CUDA_LAUNCH("swiglu_kernel");
}

void to_half(const float* x, size_t n, __half* out, cudaStream_t st) {
  to_half_kernel<<<grid_for(n), kThreads, 0, st>>>(x, n, out);
  CUMULUS_CUDA_LAUNCH("to_half_kernel");
}

void to_head_major(const float* x, int n, int heads, int d, __half* out, cudaStream_t st) {
  to_head_major_kernel<<<dim3(n, heads), 128, 0, st>>>(x, n, heads, d, out);
  CUMULUS_CUDA_LAUNCH("to_head_major_kernel");
}
void from_head_major(const __half* x, int n, int heads, int d, __half* out, cudaStream_t st) {
  from_head_major_kernel<<<dim3(n, heads), 128, 0, st>>>(x, n, heads, d, out);
  CUMULUS_CUDA_LAUNCH("from_head_major_kernel");
}

void cache_to_head_major(const DeviceKvView& kv, int n, __half* k, __half* v, cudaStream_t st) {
  const dim3 grid(n, kv.n_kv_heads);
  if (kv.dtype == DType::f16) {
    cache_to_head_major_kernel<__half><<<grid, 128, 0, st>>>(kv, n, k, v);
  } else {
    cache_to_head_major_kernel<__nv_bfloat16><<<grid, 128, 0, st>>>(kv, n, k, v);
  }
  CUMULUS_CUDA_LAUNCH("cache_to_head_major_kernel");
}

void attention_rows(const DeviceKvView& kv, int n, int n_q_heads, float scale, const float* q, __half* out,
                    cudaStream_t st) {
  CUMULUS_CHECK(kv.head_dim >= 1 && kv.head_dim <= kRowMaxDim, "attention_rows: head_dim={} must be in [1, {}]",
                kv.head_dim, kRowMaxDim);
  CUMULUS_CHECK(n_q_heads % kv.n_kv_heads == 0, "attention_rows: n_q_heads={} is not a multiple of n_kv_heads={}",
                n_q_heads, kv.n_kv_heads);
  const dim3 grid(n_q_heads, n);
  const int group = n_q_heads / kv.n_kv_heads;
  if (kv.dtype == DType::f16)
    attention_rows_kernel<__half><<<grid, kRowThreads, 0, st>>>(kv, n, group, scale, q, out);
  else
    attention_rows_kernel<__nv_bfloat16><<<grid, kRowThreads, 0, st>>>(kv, n, group, scale, q, out);
  CUMULUS_CUDA_LAUNCH("attention_rows_kernel");
}

void fill_uniform(__half* x, size_t n, float a, uint64_t seed, cudaStream_t st) {
  fill_uniform_kernel<__half><<<grid_for(n), kThreads, 0, st>>>(x, n, a, seed);
  CUMULUS_CUDA_LAUNCH("fill_uniform_kernel");
}
void fill_uniform(float* x, size_t n, float a, uint64_t seed, cudaStream_t st) {
  fill_uniform_kernel<float><<<grid_for(n), kThreads, 0, st>>>(x, n, a, seed);
  CUMULUS_CUDA_LAUNCH("fill_uniform_kernel");
}

void argmax_rows(const float* x, int rows, int n, int32_t* out, cudaStream_t st) {
  argmax_kernel<<<rows, 1024, 0, st>>>(x, n, out);
  CUMULUS_CUDA_LAUNCH("argmax_kernel");
}

}  // namespace cumulus::cuda::model
