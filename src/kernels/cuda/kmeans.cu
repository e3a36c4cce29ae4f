// K-means ops on the GPU (kernels/kmeans.h over device memory; Tactic, section 4.2).
//
// Assignment computes the distances as a matrix product: ||x - c||^2 = ||x||^2 - 2 x.c +
// ||c||^2, and argmin_c does not depend on ||x||^2, so each CTA computes a 64 x 64 tile of
// X C^T (x rows against centroids, float32 in shared-memory tiles of 32 dims, 4 x 4 outputs
// per thread) and folds ||c||^2 - 2 x.c into a running argmin per row (ties: lower c);
// the n x k distance matrix is never stored. Float32 dot products differ from the float64
// reference only for near-ties (relative gap ~1e-6 of ||c||^2).
//
// The update is deterministic: rows are grouped by cluster with a stable radix sort (so
// each cluster's rows stay in row order), and one warp per cluster sums its rows in
// float64 in that order.
#include "core/check.h"
#include "cuda_internal.cuh"
#include "cumulus/kernels/cuda.h"

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

namespace cumulus::cuda {
namespace {

constexpr int kTile = 64;   // rows and centroids per tile
constexpr int kDimTile = 32;

__global__ void centroid_norm_kernel(const float* __restrict__ c, int k, int dim, float* __restrict__ norm) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= k) return;
  float s = 0.0f;
  for (int j = lane; j < dim; j += 32) {
    const float x = c[static_cast<size_t>(warp) * dim + j];
    s = fmaf(x, x, s);
  }
  s = warp_sum(s);
  if (lane == 0) norm[warp] = s;
}

// grid: ceil(n / 64) CTAs of 256 threads (16 x 16, each 4 rows x 4 centroids).
__global__ void __launch_bounds__(256) assign_kernel(const float* __restrict__ x, int n, int dim,
                                                     const float* __restrict__ c, const float* __restrict__ cnorm,
                                                     int k, int32_t* __restrict__ assign,
                                                     unsigned long long* __restrict__ changed) {
  __shared__ float xs[kDimTile][kTile + 4];
  __shared__ float cs[kDimTile][kTile + 4];
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const int r0 = blockIdx.x * kTile;
  float best[4];
  int arg[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    best[i] = INFINITY;
    arg[i] = 0;
  }
  for (int c0 = 0; c0 < k; c0 += kTile) {
    float acc[4][4] = {};
    for (int d0 = 0; d0 < dim; d0 += kDimTile) {
      // 64 rows x 32 dims of x and of c: 2048 values each, 8 per thread.
      for (int e = threadIdx.x; e < kTile * kDimTile; e += 256) {
        const int rr = e / kDimTile, dd = e % kDimTile;
        const int row = r0 + rr, cen = c0 + rr, d = d0 + dd;
        xs[dd][rr] = row < n && d < dim ? x[static_cast<size_t>(row) * dim + d] : 0.0f;
        cs[dd][rr] = cen < k && d < dim ? c[static_cast<size_t>(cen) * dim + d] : 0.0f;
      }
      __syncthreads();
#pragma unroll 8
      for (int dd = 0; dd < kDimTile; ++dd) {
        float a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          a[i] = xs[dd][ty * 4 + i];
          b[i] = cs[dd][tx * 4 + i];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int cen = c0 + tx * 4 + j;
      if (cen >= k) break;
      const float cn = cnorm[cen];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float dist = cn - 2.0f * acc[i][j];
        if (dist < best[i]) {  // centroids visited in increasing order: ties keep the lower
          best[i] = dist;
          arg[i] = cen;
        }
      }
    }
  }
  // Reduce over the 16 threads (tx) that share rows: lexicographic (dist, index).
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int off = 8; off >= 1; off >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best[i], off);
      const int oa = __shfl_xor_sync(0xffffffffu, arg[i], off);
      if (ob < best[i] || (ob == best[i] && oa < arg[i])) {
        best[i] = ob;
        arg[i] = oa;
      }
    }
  }
  if (tx == 0) {
    int ch = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = r0 + ty * 4 + i;
      if (row < n && assign[row] != arg[i]) {
        assign[row] = arg[i];
        ++ch;
      }
    }
    if (ch) atomicAdd(changed, static_cast<unsigned long long>(ch));
  }
}

__global__ void iota_kernel(int32_t* v, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) v[i] = i;
}

__global__ void count_kernel(const int32_t* __restrict__ assign, int n, int k, int32_t* counts, int* bad) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int a = assign[i];
  if (a < 0 || a >= k) {
    atomicOr(bad, 1);
    return;
  }
  atomicAdd(counts + a, 1);
}

// One warp per cluster: float64 sums of its rows in row order.
__global__ void centroid_mean_kernel(const float* __restrict__ x, int dim, const int32_t* __restrict__ members,
                                     const int32_t* __restrict__ begin, const int32_t* __restrict__ counts, int k,
                                     float* __restrict__ c) {
  const int cl = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (cl >= k) return;
  const int cnt = counts[cl];
  if (cnt == 0) return;
  const int32_t* m = members + begin[cl];
  for (int j0 = 0; j0 < dim; j0 += 32) {
    const int j = j0 + lane;
    if (j >= dim) break;
    double s = 0;
    for (int i = 0; i < cnt; ++i) s += x[static_cast<size_t>(m[i]) * dim + j];
    c[static_cast<size_t>(cl) * dim + j] = static_cast<float>(s / cnt);
  }
}

__global__ void centroid_score_kernel(const float* __restrict__ c, int k, int dim, const float* __restrict__ q,
                                      int n_q, float* __restrict__ scores) {
  const int cl = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (cl >= k) return;
  for (int h = 0; h < n_q; ++h) {
    float s = 0.0f;
    for (int j = lane; j < dim; j += 32) s = fmaf(q[static_cast<size_t>(h) * dim + j], c[static_cast<size_t>(cl) * dim + j], s);
    s = warp_sum(s);
    if (lane == 0) scores[static_cast<size_t>(h) * k + cl] = s;
  }
}

void check_args(const char* fn, const float* x, int n, int dim, const float* centroids, int k) {
  if (n < 0) throw Error(fmt::format("{}: n={} must be >= 0", fn, n));
  if (dim < 1) throw Error(fmt::format("{}: dim={} must be >= 1", fn, dim));
  if (k < 1) throw Error(fmt::format("{}: k={} must be >= 1", fn, k));
  if (n > 0 && x == nullptr) throw Error(fmt::format("{}: x must be non-null (n={})", fn, n));
  if (centroids == nullptr) throw Error(fmt::format("{}: centroids must be non-null", fn));
}

}  // namespace

void kmeans_group(const int32_t* assign, int n, int k, int32_t* members, int32_t* begin, int32_t* counts,
                  cudaStream_t s) {
  // counts (atomic adds of ints: deterministic), begin = exclusive scan, members = rows
  // stably sorted by cluster (ascending row within a cluster).
  DeviceBuffer bad(sizeof(int));
  bad.fill_bytes(0);
  CUMULUS_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(k) * sizeof(int32_t), s));
  if (n > 0) {
    count_kernel<<<ceil_div(n, 256), 256, 0, s>>>(assign, n, k, counts, bad.as<int>());
    CUMULUS_CUDA_LAUNCH("count_kernel");
  }
  size_t scan_bytes = 0;
  CUMULUS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, counts, begin, k + 0, s));
  DeviceBuffer scan_tmp(std::max<size_t>(scan_bytes, 1));
  CUMULUS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_tmp.data(), scan_bytes, counts, begin, k, s));
  if (n > 0) {
    DeviceBuffer rows(static_cast<size_t>(n) * sizeof(int32_t)), keys_out(static_cast<size_t>(n) * sizeof(int32_t));
    iota_kernel<<<ceil_div(n, 256), 256, 0, s>>>(rows.as<int32_t>(), n);
    CUMULUS_CUDA_LAUNCH("iota_kernel");
    int end_bit = 1;
    while ((1LL << end_bit) < k) ++end_bit;
    size_t sort_bytes = 0;
    CUMULUS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, assign, keys_out.as<int32_t>(),
                                                       rows.as<int32_t>(), members, n, 0, end_bit, s));
    DeviceBuffer sort_tmp(std::max<size_t>(sort_bytes, 1));
    CUMULUS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_tmp.data(), sort_bytes, assign, keys_out.as<int32_t>(),
                                                       rows.as<int32_t>(), members, n, 0, end_bit, s));
  }
  int b = 0;
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
  bad.download(&b, sizeof(int));
  CUMULUS_CHECK(b == 0, "an assignment lies outside [0, k={})", k);
}

int64_t kmeans_assign(const float* x, int n, int dim, const float* centroids, int k, int32_t* assign, void* stream) {
  check_args(__func__, x, n, dim, centroids, k);
  CUMULUS_CHECK(n == 0 || assign != nullptr, "assign must be non-null (n={})", n);
  if (n == 0) return 0;
  const cudaStream_t s = as_stream(stream);
  DeviceBuffer norm(static_cast<size_t>(k) * sizeof(float)), changed(sizeof(unsigned long long));
  changed.fill_bytes(0);
  centroid_norm_kernel<<<ceil_div(static_cast<int64_t>(k) * 32, 256), 256, 0, s>>>(centroids, k, dim,
                                                                                   norm.as<float>());
  CUMULUS_CUDA_LAUNCH("centroid_norm_kernel");
  assign_kernel<<<ceil_div(n, kTile), 256, 0, s>>>(x, n, dim, centroids, norm.as<float>(), k, assign,
                                                   changed.as<unsigned long long>());
  CUMULUS_CUDA_LAUNCH("assign_kernel");
  unsigned long long ch = 0;
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
  changed.download(&ch, sizeof(ch));
  return static_cast<int64_t>(ch);
}

void kmeans_update(const float* x, int n, int dim, const int32_t* assign, int k, float* centroids, int32_t* counts,
                   void* stream) {
  check_args(__func__, x, n, dim, centroids, k);
  CUMULUS_CHECK(n == 0 || assign != nullptr, "assign must be non-null (n={})", n);
  CUMULUS_CHECK(counts != nullptr, "counts must be non-null");
  const cudaStream_t s = as_stream(stream);
  DeviceBuffer members(std::max<size_t>(static_cast<size_t>(n) * sizeof(int32_t), 4));
  DeviceBuffer begin(static_cast<size_t>(k) * sizeof(int32_t));
  kmeans_group(assign, n, k, members.as<int32_t>(), begin.as<int32_t>(), counts, s);
  centroid_mean_kernel<<<ceil_div(static_cast<int64_t>(k) * 32, 256), 256, 0, s>>>(
      x, dim, members.as<int32_t>(), begin.as<int32_t>(), counts, k, centroids);
  CUMULUS_CUDA_LAUNCH("centroid_mean_kernel");
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));  // members/begin are freed on return
}

void kmeans_centroid_score(const float* centroids, int k, int dim, const float* q, int n_q, float* scores,
                           void* stream) {
  check_args(__func__, nullptr, 0, dim, centroids, k);
  CUMULUS_CHECK(n_q >= 1, "n_q={} must be >= 1", n_q);
  CUMULUS_CHECK(q != nullptr && scores != nullptr, "q and scores must be non-null");
  centroid_score_kernel<<<ceil_div(static_cast<int64_t>(k) * 32, 256), 256, 0, as_stream(stream)>>>(
      centroids, k, dim, q, n_q, scores);
  CUMULUS_CUDA_LAUNCH("centroid_score_kernel");
}

}  // namespace cumulus::cuda
