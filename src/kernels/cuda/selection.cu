// Selection ops on the GPU (kernels/selection.h over rows of device memory), all without a
// host round trip: a stable descending sort of each row (the cluster and page rankings of
// Tactic 4.3 and PSA 3.2), top-k, and the fewest entries reaching a share p of a row's
// mass (the top-p set of Tactic section 3), plus the bitmap compaction that turns a GQA
// group's union into a sorted index list.
//
// Top-k and top-mass are radix selections, one CTA per row: four passes over the row's
// order-preserving 32-bit keys, one 8-bit digit each, histogram the candidates (counts, and
// for top-mass float64 sums of the weights) and keep the digit at which the running count
// or mass from the top reaches the target. That yields the exact threshold key; entries
// above it are in, entries equal to it are taken in index order until the count or mass is
// reached, which is the set the reference's stable sort gives (ties to the lower index).
// Sums are float64 as in the reference, accumulated in another order, so only a prefix
// that lands within rounding of the target can differ.
// fmt (through cuda_util.cuh) comes before CUB: included after it, fmt's constexpr
// detection misfires in the host pass.
#include "core/check.h"
#include "cuda_internal.cuh"
#include "cumulus/kernels/cuda.h"

#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include <algorithm>
#include <cmath>

namespace cumulus::cuda {
namespace {

constexpr int kSortThreads = 1024;
constexpr int kSortItems = 8;
constexpr int kSortCapacity = kSortThreads * kSortItems;
using BlockSort = cub::BlockRadixSort<uint32_t, kSortThreads, kSortItems, int32_t>;

__global__ void __launch_bounds__(kSortThreads) sort_rows_block_kernel(const float* __restrict__ values,
                                                                       const int32_t* __restrict__ len, int stride,
                                                                       int32_t* __restrict__ order) {
  extern __shared__ __align__(16) unsigned char sort_smem[];
  auto& tmp = *reinterpret_cast<typename BlockSort::TempStorage*>(sort_smem);
  const int r = blockIdx.x;
  const int n = min(max(len[r], 0), stride);
  const float* row = values + static_cast<size_t>(r) * stride;
  uint32_t keys[kSortItems];
  int32_t vals[kSortItems];
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int i = threadIdx.x * kSortItems + j;  // blocked: index order = rank order of ties
    keys[j] = i < n ? float_key(row[i]) : 0u;
    vals[j] = i;
  }
  BlockSort(tmp).SortDescendingBlockedToStriped(keys, vals);
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int rank = j * kSortThreads + threadIdx.x;
    if (rank < n) order[static_cast<size_t>(r) * stride + rank] = vals[j];
  }
}

// Segmented-sort inputs: keys, row-local indices and the segment bounds.
__global__ void sort_prepare_kernel(const float* __restrict__ values, const int32_t* __restrict__ len, int n_rows,
                                    int stride, uint32_t* keys, int32_t* vals, int* begin, int* end) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<size_t>(n_rows) * stride) return;
  const int r = static_cast<int>(i / stride), c = static_cast<int>(i % stride);
  keys[i] = float_key(values[i]);
  vals[i] = c;
  if (c == 0) {
    begin[r] = r * stride;
    end[r] = r * stride + min(max(len[r], 0), stride);
  }
}

constexpr int kSelectThreads = 512;

// Radix selection of one row's threshold. Mass mode: weights, target mass; count mode:
// target count. On return (every thread): kth = the threshold key, take_ties = how many
// entries equal to it are taken (in index order).
template <bool kMass>
__device__ void radix_threshold(const float* row, int n, double want, uint32_t& kth, int& take_ties) {
  __shared__ int hc[256];
  __shared__ double hm[256];
  __shared__ uint32_t s_prefix, s_mask;
  __shared__ double s_want;
  __shared__ int s_digit_count;
  if (threadIdx.x == 0) {
    s_prefix = 0;
    s_mask = 0;
    s_want = want;
  }
  __syncthreads();
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
      hc[i] = 0;
      hm[i] = 0.0;
    }
    __syncthreads();
    const uint32_t prefix = s_prefix, mask = s_mask;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float x = row[i];
      const uint32_t key = float_key(x);
      if ((key & mask) == prefix) {
        const int d = (key >> shift) & 255;
        atomicAdd(hc + d, 1);
        if (kMass) atomicAdd(hm + d, static_cast<double>(x));
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l owns digits 255 - 8l .. 248 - 8l (descending). The owner is the first lane
      // whose running total from the top reaches the target; when rounding leaves the whole
      // mass just short of it, the lowest candidate digit (everything is taken).
      const int lane = threadIdx.x;
      double tot = 0;
      int cnt = 0;
      for (int j = 0; j < 8; ++j) {
        const int d = 255 - 8 * lane - j;
        tot += kMass ? hm[d] : static_cast<double>(hc[d]);
        cnt += hc[d];
      }
      double pre = tot;  // inclusive scan over lanes
      for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, pre, o);
        if (lane >= o) pre += y;
      }
      const double excl = pre - tot;
      const double w = s_want;
      const unsigned hit = __ballot_sync(0xffffffffu, pre >= w && cnt > 0);
      const unsigned nz = __ballot_sync(0xffffffffu, cnt > 0);
      const int owner = hit != 0 ? __ffs(hit) - 1 : 31 - __clz(nz);
      if (lane == owner) {
        double cum = excl, above = excl;
        int digit = 255 - 8 * lane;
        for (int j = 0; j < 8; ++j) {
          const int d = 255 - 8 * lane - j;
          if (hc[d] == 0) continue;
          const double c = kMass ? hm[d] : static_cast<double>(hc[d]);
          digit = d;
          above = cum;
          if (hit != 0 && cum + c >= w) break;
          cum += c;
        }
        s_want = w - above;
        s_prefix = prefix | (static_cast<uint32_t>(digit) << shift);
        s_mask = mask | (0xffu << shift);
        s_digit_count = hc[digit];
      }
    }
    __syncthreads();
  }
  kth = s_prefix;
  const double rest = s_want;  // count or mass still needed from the ties
  const int n_ties = s_digit_count;
  int t;
  if (kMass) {
    const double w = key_float(kth);
    t = w > 0 ? static_cast<int>(ceil(rest / w)) : 1;
  } else {
    t = static_cast<int>(rest + 0.5);
  }
  take_ties = min(max(t, 1), n_ties);
  __syncthreads();
}

// Writes the selected entries (key > kth, and the first take_ties entries equal to kth)
// as ascending indices. Each thread owns a contiguous segment of the row.
__device__ void select_write(const float* row, int n, uint32_t kth, int take_ties, int32_t* out, int32_t* out_len) {
  const int per = (n + blockDim.x - 1) / blockDim.x;
  const int b = min(n, static_cast<int>(threadIdx.x) * per), e = min(n, b + per);
  int gt = 0, eq = 0;
  for (int i = b; i < e; ++i) {
    const uint32_t k = float_key(row[i]);
    gt += k > kth;
    eq += k == kth;
  }
  int eq_total = 0;
  const int eq_off = block_scan_exclusive<int>(eq, &eq_total);
  const int ties_here = min(max(take_ties - eq_off, 0), eq);
  int sel_total = 0;
  int pos = block_scan_exclusive<int>(gt + ties_here, &sel_total);
  int ties_seen = eq_off;
  for (int i = b; i < e; ++i) {
    const uint32_t k = float_key(row[i]);
    bool take = k > kth;
    if (k == kth) take = ties_seen++ < take_ties;
    if (take) out[pos++] = i;
  }
  if (threadIdx.x == 0) *out_len = sel_total;
}

// k_row non-null: row r takes the k_row[r] largest (at most k, out's stride).
__global__ void __launch_bounds__(kSelectThreads) topk_kernel(const float* __restrict__ values,
                                                              const int32_t* __restrict__ len, int stride, int k,
                                                              const int32_t* __restrict__ k_row,
                                                              int32_t* __restrict__ out, int32_t* __restrict__ out_len) {
  const int r = blockIdx.x;
  const int n = min(max(len[r], 0), stride);
  const float* row = values + static_cast<size_t>(r) * stride;
  int32_t* o = out + static_cast<size_t>(r) * k;
  if (k_row != nullptr) k = min(max(k_row[r], 0), k);
  if (k == 0) {
    if (threadIdx.x == 0) out_len[r] = 0;
    return;
  }
  if (n <= k) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = i;
    if (threadIdx.x == 0) out_len[r] = n;
    return;
  }
  uint32_t kth;
  int take;
  radix_threshold<false>(row, n, static_cast<double>(k), kth, take);
  select_write(row, n, kth, take, o, out_len + r);
}

__global__ void __launch_bounds__(kSelectThreads) top_mass_kernel(const float* __restrict__ weights,
                                                                  const int32_t* __restrict__ len, int stride, double p,
                                                                  int32_t* __restrict__ out,
                                                                  int32_t* __restrict__ out_len) {
  __shared__ double s_sum[32];
  const int r = blockIdx.x;
  const int n = min(max(len[r], 0), stride);
  const float* row = weights + static_cast<size_t>(r) * stride;
  int32_t* o = out + static_cast<size_t>(r) * stride;
  if (n == 0) {
    if (threadIdx.x == 0) out_len[r] = 0;
    return;
  }
  double local = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) local += row[i];
  for (int off = 16; off >= 1; off >>= 1) local += __shfl_xor_sync(0xffffffffu, local, off);
  if ((threadIdx.x & 31) == 0) s_sum[threadIdx.x >> 5] = local;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += s_sum[w];
  // An all-zero row (target 0) yields the top key and one tie: the reference's first entry.
  const double target = p * total;
  uint32_t kth;
  int take;
  radix_threshold<true>(row, n, target > 0 ? target : 0.0, kth, take);
  select_write(row, n, kth, take, o, out_len + r);
}

constexpr int kTileWords = kBitmapTileWords;  // bitmap words per CTA of the compaction (one per thread)

// Compaction, pass 1. grid: (tiles, lists). counts[l][tile] = set bits of the tile.
__global__ void __launch_bounds__(kTileWords) bitmap_count_kernel(const uint32_t* __restrict__ bits, int words,
                                                                  int tiles, int* __restrict__ counts) {
  const int l = blockIdx.y, wi = blockIdx.x * kTileWords + threadIdx.x;
  const int c = wi < words ? __popc(bits[static_cast<size_t>(l) * words + wi]) : 0;
  const int total = block_sum<int>(c);
  if (threadIdx.x == 0) counts[static_cast<size_t>(l) * tiles + blockIdx.x] = total;
}

// Compaction, pass 2. grid: (tiles, lists). The tile's offset is the sum of the earlier
// tiles' counts; each thread writes its word's set bits in order and clears the word.
__global__ void __launch_bounds__(kTileWords) bitmap_emit_kernel(uint32_t* __restrict__ bits, int words, int tiles,
                                                                 const int* __restrict__ counts, int32_t* idx,
                                                                 int stride, int32_t* len) {
  __shared__ int s_off;
  const int l = blockIdx.y, wi = blockIdx.x * kTileWords + threadIdx.x;
  if (threadIdx.x < 32) {
    int o = 0;
    for (int t = threadIdx.x; t < static_cast<int>(blockIdx.x); t += 32) o += counts[static_cast<size_t>(l) * tiles + t];
    for (int k = 16; k >= 1; k >>= 1) o += __shfl_xor_sync(0xffffffffu, o, k);
    if (threadIdx.x == 0) s_off = o;
  }
  uint32_t* w = bits + static_cast<size_t>(l) * words;
  uint32_t x = wi < words ? w[wi] : 0u;
  int total = 0;
  int pos = block_scan_exclusive<int>(__popc(x), &total) + s_off;
  if (wi < words && x != 0) w[wi] = 0;
  int32_t* out = idx + static_cast<size_t>(l) * stride;
  while (x != 0) {
    const int bit = __ffs(x) - 1;
    x &= x - 1;
    if (pos < stride) out[pos] = wi * 32 + bit;
    ++pos;
  }
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) len[l] = min(s_off + total, stride);
}

}  // namespace

void bitmap_compact(uint32_t* bits, int n_lists, int words, int32_t* idx, int stride, int32_t* len, int* counts,
                    cudaStream_t stream) {
  const int tiles = bitmap_tiles(words);
  bitmap_count_kernel<<<dim3(tiles, n_lists), kTileWords, 0, stream>>>(bits, words, tiles, counts);
  CUMULUS_CUDA_LAUNCH("bitmap_count_kernel");
  bitmap_emit(bits, n_lists, words, idx, stride, len, counts, stream);
}

void bitmap_emit(uint32_t* bits, int n_lists, int words, int32_t* idx, int stride, int32_t* len, const int* counts,
                 cudaStream_t stream) {
  const int tiles = bitmap_tiles(words);
  bitmap_emit_kernel<<<dim3(tiles, n_lists), kTileWords, 0, stream>>>(bits, words, tiles, counts, idx, stride, len);
  CUMULUS_CUDA_LAUNCH("bitmap_emit_kernel");
}

int bitmap_tiles(int words) { return std::max(1, (words + kTileWords - 1) / kTileWords); }

int sort_rows_block_capacity() { return kSortCapacity; }

struct SortWorkspace::Impl {
  int n_rows = 0, stride = 0;
  bool segmented = false;
  DeviceBuffer keys_in, keys_out, vals_in, begin, end, temp;
  size_t temp_bytes = 0;
};

SortWorkspace::SortWorkspace(int n_rows, int stride) {
  CUMULUS_CHECK(n_rows >= 1 && stride >= 1, "n_rows={} and stride={} must be >= 1", n_rows, stride);
  auto im = std::make_unique<Impl>();
  im->n_rows = n_rows;
  im->stride = stride;
  im->segmented = stride > kSortCapacity;
  if (im->segmented) {
    const size_t n = static_cast<size_t>(n_rows) * stride;
    im->keys_in = DeviceBuffer(n * sizeof(uint32_t));
    im->keys_out = DeviceBuffer(n * sizeof(uint32_t));
    im->vals_in = DeviceBuffer(n * sizeof(int32_t));
    im->begin = DeviceBuffer(n_rows * sizeof(int));
    im->end = DeviceBuffer(n_rows * sizeof(int));
    CUMULUS_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
        nullptr, im->temp_bytes, im->keys_in.as<uint32_t>(), im->keys_out.as<uint32_t>(), im->vals_in.as<int32_t>(),
        im->vals_in.as<int32_t>(), static_cast<int64_t>(n), n_rows, im->begin.as<int>(), im->end.as<int>()));
    im->temp = DeviceBuffer(std::max<size_t>(im->temp_bytes, 1));
  } else {
    CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(sort_rows_block_kernel),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(sizeof(typename BlockSort::TempStorage))));
  }
  impl_ = im.release();
}

SortWorkspace::~SortWorkspace() { delete impl_; }

void sort_rows_desc(const float* values, const int32_t* len, int n_rows, int stride, int32_t* order, SortWorkspace& ws,
                    void* stream) {
  SortWorkspace::Impl& im = *ws.impl();
  CUMULUS_CHECK(values != nullptr && len != nullptr && order != nullptr, "values, len and order must be non-null");
  CUMULUS_CHECK(n_rows == im.n_rows && stride == im.stride,
                "n_rows={} stride={} differ from the workspace's n_rows={} stride={}", n_rows, stride, im.n_rows,
                im.stride);
  const cudaStream_t s = as_stream(stream);
  if (!im.segmented) {
    sort_rows_block_kernel<<<n_rows, kSortThreads, sizeof(typename BlockSort::TempStorage), s>>>(values, len, stride,
                                                                                                   order);
    CUMULUS_CUDA_LAUNCH("sort_rows_block_kernel");
    return;
  }
  const size_t n = static_cast<size_t>(n_rows) * stride;
  sort_prepare_kernel<<<ceil_div(static_cast<int64_t>(n), 256), 256, 0, s>>>(
      values, len, n_rows, stride, im.keys_in.as<uint32_t>(), im.vals_in.as<int32_t>(), im.begin.as<int>(),
      im.end.as<int>());
  CUMULUS_CUDA_LAUNCH("sort_prepare_kernel");
  size_t bytes = im.temp_bytes;
  CUMULUS_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      im.temp.data(), bytes, im.keys_in.as<uint32_t>(), im.keys_out.as<uint32_t>(), im.vals_in.as<int32_t>(), order,
      static_cast<int64_t>(n), n_rows, im.begin.as<int>(), im.end.as<int>(), 0, 32, s));
}

void select_topk_rows(const float* values, const int32_t* len, int n_rows, int stride, int k, int32_t* out,
                      int32_t* out_len, void* stream) {
  CUMULUS_CHECK(k >= 1, "k={} must be >= 1", k);
  CUMULUS_CHECK(n_rows >= 1 && stride >= 1, "n_rows={} and stride={} must be >= 1", n_rows, stride);
  CUMULUS_CHECK(values != nullptr && len != nullptr && out != nullptr && out_len != nullptr,
                "values, len, out and out_len must be non-null");
  topk_kernel<<<n_rows, kSelectThreads, 0, as_stream(stream)>>>(values, len, stride, k, nullptr, out, out_len);
  CUMULUS_CUDA_LAUNCH("topk_kernel");
}

void select_topk_rows_k(const float* values, const int32_t* len, int n_rows, int stride, const int32_t* k_row,
                        int k_max, int32_t* out, int32_t* out_len, cudaStream_t stream) {
  CUMULUS_CHECK(k_max >= 1 && n_rows >= 1 && stride >= 1, "k_max={}, n_rows={} and stride={} must be >= 1", k_max,
                n_rows, stride);
  topk_kernel<<<n_rows, kSelectThreads, 0, stream>>>(values, len, stride, k_max, k_row, out, out_len);
  CUMULUS_CUDA_LAUNCH("topk_kernel");
}

void select_top_mass_rows(const float* weights, const int32_t* len, int n_rows, int stride, double p, int32_t* out,
                          int32_t* out_len, void* stream) {
  CUMULUS_CHECK(p > 0 && p <= 1, "p={} must be in (0, 1]", p);
  CUMULUS_CHECK(n_rows >= 1 && stride >= 1, "n_rows={} and stride={} must be >= 1", n_rows, stride);
  CUMULUS_CHECK(weights != nullptr && len != nullptr && out != nullptr && out_len != nullptr,
                "weights, len, out and out_len must be non-null");
  top_mass_kernel<<<n_rows, kSelectThreads, 0, as_stream(stream)>>>(weights, len, stride, p, out, out_len);
  CUMULUS_CUDA_LAUNCH("top_mass_kernel");
}

}  // namespace cumulus::cuda
