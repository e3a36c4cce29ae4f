// The small kernels of the GPU forward pass (cuda_runner.cu): embedding lookup, RMSNorm,
// RoPE, SwiGLU, layout changes between the projections' token-major rows and the prefill
// kernel's head-major tensors, a generic paged attention for head dims the tuned kernels
// are not built for, and greedy argmax. Each mirrors a loop of src/model/session.cpp and
// says where it differs. Internal to src/model/cuda.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cumulus/kernels/cuda.h"

namespace cumulus::cuda::model {

// x [n][dim] float32 = embd[tokens[i]] (f16) * scale.
void embed(const int32_t* tokens, int n, const __half* embd, int dim, float scale, float* x, cudaStream_t st);

// out [n][dim] f16 = x / rms(x) * g (sum of squares in float64, as the CPU).
void rmsnorm(const float* x, const float* g, int n, int dim, float eps, __half* out, cudaStream_t st);

// RoPE in place on x [n][n_heads][head_dim] at positions pos0[0] + i (pos0 read on the
// device), or pos0[i] with per_row (row i is sequence i of a batch),
// adjacent pairs (x[2i], x[2i+1]) of the first rope_dim dimensions, angle (pos * theta^(-2i /
// head_dim)) in float64 as the CPU computes it.
void rope(float* x, int n, int n_heads, int head_dim, int rope_dim, const int32_t* pos0, bool per_row, float theta,
          cudaStream_t st);

// out [n] f16 = silu(gate) * up.
void swiglu(const float* gate, const float* up, size_t n, __half* out, cudaStream_t st);

// f32 -> f16, n values.
void to_half(const float* x, size_t n, __half* out, cudaStream_t st);

// x [n][heads][d] float32 -> out [heads][n][d] f16 (the prefill kernel's layout).
void to_head_major(const float* x, int n, int heads, int d, __half* out, cudaStream_t st);
// x [heads][n][d] f16 -> out [n][heads][d] f16.
void from_head_major(const __half* x, int n, int heads, int d, __half* out, cudaStream_t st);
// Tokens [0, n) of sequence 0 of a paged cache -> k, v [n_kv_heads][n][head_dim] f16 (the
// prefill kernel's layout; a bf16 cache is converted), for a prefill chunk that attends
// the keys cached before it.
void cache_to_head_major(const DeviceKvView& kv, int n, __half* k, __half* v, cudaStream_t st);

// Causal attention of n rows of queries q [n][n_q_heads][head_dim] float32 over sequence 0
// of `kv` (which already holds them: row i sits at position n_tokens - n + i and attends
// keys [0, that position]); out [n][n_q_heads][head_dim] f16. Float32 online softmax, one
// CTA per (query head, row): for any head_dim up to 256 (stories260K's 8), not tuned.
void attention_rows(const DeviceKvView& kv, int n, int n_q_heads, float scale, const float* q, __half* out,
                    cudaStream_t st);

// x [n] f16 = uniform in [-a, a) from a counter-based hash of (seed, i) (benchmarks).
void fill_uniform(__half* x, size_t n, float a, uint64_t seed, cudaStream_t st);
void fill_uniform(float* x, size_t n, float a, uint64_t seed, cudaStream_t st);

// out[r] = argmax of row r of x [rows][n] (the lowest index among equal maxima, as
// Sampler's greedy pick).
void argmax_rows(const float* x, int rows, int n, int32_t* out, cudaStream_t st);

}  // namespace cumulus::cuda::model
