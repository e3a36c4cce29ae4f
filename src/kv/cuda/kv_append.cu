// The device KV cache filled on the device: an empty page pool with a
// free list, page tables per (sequence, kv head) assigned on the host between steps, and
// the append of a step's (or a prefill chunk's) K/V written by kernels that read each
// sequence's position on the device, so a decode step needs no host round trip. The
// per-page key statistics follow KvCache (src/kv/kv_cache.cpp): over the keys as stored,
// min and max per dimension and the mean as a float64 sum in row order / page length, so
// a cache filled here equals, bit for bit, a host cache filled with the same rows and
// uploaded.
#include <algorithm>
#include <new>

#include "core/check.h"
#include "core/cuda/cuda_util.cuh"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/kv/cuda_kv_pool.h"

namespace cumulus::cuda {
namespace {

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Grid (n_new * n_kv_heads, n_seqs), head_dim threads: row n_tokens[s] + i of (s, h).
//   k, v: [n_seqs][n_new][n_kv][d] float32
template <class T>
__global__ void kv_write_kernel(const float* __restrict__ k, const float* __restrict__ v, int n_new, int n_kv, int d,
                                int page_shift, int max_pages, const int32_t* __restrict__ table,
                                const int32_t* __restrict__ n_tok, T* kpool, T* vpool) {
  const int s = blockIdx.y, i = blockIdx.x / n_kv, h = blockIdx.x % n_kv, j = threadIdx.x;
  const int t = n_tok[s] + i;
  const int ps = 1 << page_shift;
  const int32_t slot = table[(static_cast<size_t>(s) * n_kv + h) * max_pages + (t >> page_shift)];
  const size_t dst = (static_cast<size_t>(slot) * ps + (t & (ps - 1))) * d + j;
  const size_t src = ((static_cast<size_t>(s) * n_new + i) * n_kv + h) * d + j;
  kpool[dst] = from_float<T>(k[src]);
  vpool[dst] = from_float<T>(v[src]);
}

// Recomputes the statistics of the pages holding tokens [first, end) of (s, h), with
// first = n_tok[s] + first_off and end = n_tok[s] + end_off (end_off < 0: end = first_off
// absolute, used by truncate with n_tok already set). Grid (n_kv, n_seqs, pages), head_dim
// threads; block z handles the z-th page from first's.
template <class T>
__global__ void kv_meta_kernel(int first_off, int end_off, bool absolute, int n_kv, int d, int page_shift,
                               int max_pages, const int32_t* __restrict__ table, const int32_t* __restrict__ n_tok,
                               const T* __restrict__ kpool, float* kmin, float* kmax, float* kmean) {
  const int s = blockIdx.y, h = blockIdx.x, j = threadIdx.x;
  const int base = absolute ? 0 : n_tok[s];
  const int first = base + first_off, end = base + end_off;
  if (end <= first) return;
  const int p = (first >> page_shift) + static_cast<int>(blockIdx.z);
  if (p > ((end - 1) >> page_shift)) return;
  const int ps = 1 << page_shift;
  const int len = min(ps, end - (p << page_shift));
  const int32_t slot = table[(static_cast<size_t>(s) * n_kv + h) * max_pages + p];
  const T* rows = kpool + static_cast<size_t>(slot) * ps * d + j;
  float mn = to_float(rows[0]), mx = mn;
  double sum = mn;
  for (int r = 1; r < len; ++r) {
    const float x = to_float(rows[static_cast<size_t>(r) * d]);
    mn = fminf(mn, x);
    mx = fmaxf(mx, x);
    sum += x;
  }
  const size_t m = static_cast<size_t>(slot) * d + j;
  kmin[m] = mn;
  kmax[m] = mx;
  kmean[m] = static_cast<float>(sum / len);
}

__global__ void kv_advance_kernel(int32_t* n_tok, int n_seqs, int n_new) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s < n_seqs) n_tok[s] += n_new;
}

// Zeroes rows [n, old) of (s, every h): grid (rows, n_kv), head_dim threads.
template <class T>
__global__ void kv_zero_kernel(int s, int n, int n_kv, int d, int page_shift, int max_pages,
                               const int32_t* __restrict__ table, T* kpool, T* vpool) {
  const int h = blockIdx.y, t = n + static_cast<int>(blockIdx.x), j = threadIdx.x;
  const int ps = 1 << page_shift;
  const int32_t slot = table[(static_cast<size_t>(s) * n_kv + h) * max_pages + (t >> page_shift)];
  const size_t dst = (static_cast<size_t>(slot) * ps + (t & (ps - 1))) * d + j;
  kpool[dst] = from_float<T>(0.0f);
  vpool[dst] = from_float<T>(0.0f);
}

void check_create(int n_seqs, int n_kv_heads, int head_dim, DType dtype, int page_size, int max_tokens,
                  int pool_pages) {
  CUMULUS_CHECK(n_seqs >= 1 && n_kv_heads >= 1, "DeviceKvCache::create: n_seqs={} and n_kv_heads={} must be >= 1",
                n_seqs, n_kv_heads);
  CUMULUS_CHECK(head_dim >= 1 && head_dim <= 1024,
                "DeviceKvCache::create: head_dim={} must be in [1, 1024] (the attention kernels need 64, 128 or 256)",
                head_dim);
  CUMULUS_CHECK(dtype == DType::f16 || dtype == DType::bf16,
                "DeviceKvCache::create: dtype={} is not supported on the GPU (f16, bf16)", dtype_name(dtype));
  CUMULUS_CHECK(page_size >= 1 && page_size <= 256 && (page_size & (page_size - 1)) == 0,
                "DeviceKvCache::create: page_size={} must be a power of two in [1, 256]", page_size);
  CUMULUS_CHECK(max_tokens >= 1, "DeviceKvCache::create: max_tokens={} must be >= 1", max_tokens);
  CUMULUS_CHECK(pool_pages >= 0, "DeviceKvCache::create: pool_pages={} must be >= 0", pool_pages);
}

size_t pool_pages_of(int n_seqs, int n_kv_heads, int page_size, int max_tokens, int pool_pages) {
  const size_t max_pages = (static_cast<size_t>(max_tokens) + page_size - 1) / page_size;
  return pool_pages > 0 ? static_cast<size_t>(pool_pages) : static_cast<size_t>(n_seqs) * n_kv_heads * max_pages;
}

}  // namespace

size_t DeviceKvCache::create_bytes(int n_seqs, int n_kv_heads, int head_dim, DType dtype, int page_size,
                                   int max_tokens, int pool_pages) {
  check_create(n_seqs, n_kv_heads, head_dim, dtype, page_size, max_tokens, pool_pages);
  const size_t n_pool = pool_pages_of(n_seqs, n_kv_heads, page_size, max_tokens, pool_pages);
  const size_t max_pages = (static_cast<size_t>(max_tokens) + page_size - 1) / page_size;
  return n_pool * (2 * static_cast<size_t>(page_size) * head_dim * dtype_size(dtype) + 3 * head_dim * sizeof(float)) +
         static_cast<size_t>(n_seqs) * n_kv_heads * max_pages * sizeof(int32_t) + n_seqs * sizeof(int32_t);
}

DeviceKvCache DeviceKvCache::create(int n_seqs, int n_kv_heads, int head_dim, DType dtype, int page_size,
                                    int max_tokens, int pool_pages) {
  check_create(n_seqs, n_kv_heads, head_dim, dtype, page_size, max_tokens, pool_pages);
  const size_t n_pool = pool_pages_of(n_seqs, n_kv_heads, page_size, max_tokens, pool_pages);
  CUMULUS_CHECK(n_pool <= static_cast<size_t>(INT32_MAX), "DeviceKvCache::create: {} pool pages exceed int32", n_pool);
  const int max_pages = (max_tokens + page_size - 1) / page_size;
  const size_t page_bytes = static_cast<size_t>(page_size) * head_dim * dtype_size(dtype);
  DeviceKvCache c;
  c.k_ = DeviceBuffer(n_pool * page_bytes);
  c.v_ = DeviceBuffer(n_pool * page_bytes);
  c.k_.fill_bytes(0);  // padding rows of partial pages read back as zero, as on the host
  c.v_.fill_bytes(0);
  const size_t meta_bytes = n_pool * head_dim * sizeof(float);
  c.kmin_ = DeviceBuffer(meta_bytes);
  c.kmax_ = DeviceBuffer(meta_bytes);
  c.kmean_ = DeviceBuffer(meta_bytes);
  // Unassigned entries point at page 0, so a stray read stays inside the pool; the host
  // copy keeps -1 to know which entries are assigned.
  c.table_host_.assign(static_cast<size_t>(n_seqs) * n_kv_heads * max_pages, -1);
  c.table_ = to_device(std::vector<int32_t>(c.table_host_.size(), 0));
  // The free list hands out the lowest page first (pop_back of a descending list).
  c.free_.resize(n_pool);
  for (size_t i = 0; i < n_pool; ++i) c.free_[i] = static_cast<int32_t>(n_pool - 1 - i);
  c.n_tokens_.assign(n_seqs, 0);
  c.capacity_.assign(n_seqs, 0);
  c.reserved_.assign(n_seqs, 0);
  c.n_tok_ = to_device(std::vector<int32_t>(n_seqs, 0));
  c.kv_bytes_ = 2 * n_pool * page_bytes;
  c.bind_view(n_seqs, n_kv_heads, head_dim, page_size, max_pages, max_tokens, dtype);
  return c;
}

DeviceKvCache DeviceKvCache::create(std::shared_ptr<KvPagePool> pool, int n_seqs, int n_kv_heads, int max_tokens) {
  CUMULUS_CHECK(pool != nullptr, "DeviceKvCache::create: the pool is null");
  const KvPoolOptions& o = pool->options();
  check_create(n_seqs, n_kv_heads, o.head_dim, o.dtype, o.page_size, max_tokens, 0);
  const int max_pages = (max_tokens + o.page_size - 1) / o.page_size;
  DeviceKvCache c;
  c.table_host_.assign(static_cast<size_t>(n_seqs) * n_kv_heads * max_pages, -1);
  c.table_ = to_device(std::vector<int32_t>(c.table_host_.size(), 0));
  c.n_tokens_.assign(n_seqs, 0);
  c.capacity_.assign(n_seqs, 0);
  c.reserved_.assign(n_seqs, 0);
  c.n_tok_ = to_device(std::vector<int32_t>(n_seqs, 0));
  c.bind_view(n_seqs, n_kv_heads, o.head_dim, o.page_size, max_pages, max_tokens, o.dtype);
  c.view_.k = pool->k();
  c.view_.v = pool->v();
  c.view_.kmin = pool->kmin();
  c.view_.kmax = pool->kmax();
  c.view_.kmean = pool->kmean();
  c.pool_ = std::move(pool);
  return c;
}

int DeviceKvCache::free_pages() const {
  if (pool_ != nullptr)
    return static_cast<int>(std::min<int64_t>(pool_->free_device_pages() + pool_->free_host_pages(), INT32_MAX));
  return static_cast<int>(free_.size());
}

std::vector<int32_t> DeviceKvCache::assigned_slots() const {
  std::vector<int32_t> r;
  for (const int32_t s : table_host_)
    if (s >= 0) r.push_back(s);
  return r;
}

DeviceKvCache::~DeviceKvCache() {
  if (pool_ == nullptr) return;
  try {
    pool_->release(assigned_slots());
  } catch (...) {  // no throw from a destructor; the pool outlives a failed release
  }
}

DeviceKvCache& DeviceKvCache::operator=(DeviceKvCache&& o) noexcept {
  if (this != &o) {
    DeviceKvCache old(std::move(*this));  // releases this cache's pages when it goes
    this->~DeviceKvCache();               // a moved-from cache: holds nothing
    new (this) DeviceKvCache(std::move(o));
  }
  return *this;
}

void DeviceKvCache::reserve(int seq, int n) {
  const DeviceKvView& w = view_;
  CUMULUS_CHECK(seq >= 0 && seq < w.n_seqs, "DeviceKvCache::reserve: seq={} out of range [0, {})", seq, w.n_seqs);
  CUMULUS_CHECK(n >= 0 && n <= w.max_pages * w.page_size,
                "DeviceKvCache::reserve: n={} exceeds the {} tokens a sequence can hold", n, w.max_pages * w.page_size);
  if (n <= reserved_[seq]) return;
  const int have = reserved_[seq] / w.page_size, need = (n + w.page_size - 1) / w.page_size;
  const int more = (need - have) * w.n_kv_heads;
  if (pool_ != nullptr) {
    std::vector<int32_t*> dev_entries, host_entries;
    for (int h = 0; h < w.n_kv_heads; ++h) {
      const size_t row = (static_cast<size_t>(seq) * w.n_kv_heads + h) * w.max_pages;
      for (int p = have; p < need; ++p) {
        dev_entries.push_back(table_.as<int32_t>() + row + p);
        host_entries.push_back(table_host_.data() + row + p);
      }
    }
    const int64_t free = pool_->free_device_pages() + pool_->free_host_pages();
    CUMULUS_CHECK(more <= free,
                  "DeviceKvCache::reserve: sequence {} needs {} more pages for {} tokens, the pool has {} free ({} on "
                  "the device, {} on the host)",
                  seq, more, n, free, pool_->free_device_pages(), pool_->free_host_pages());
    pool_->allocate(more, dev_entries.data(), host_entries.data());
  } else {
    CUMULUS_CHECK(more <= static_cast<int>(free_.size()),
                  "DeviceKvCache::reserve: sequence {} needs {} more pages for {} tokens, the pool has {} free", seq,
                  more, n, free_.size());
  }
  for (int h = 0; h < w.n_kv_heads; ++h) {
    const size_t row = (static_cast<size_t>(seq) * w.n_kv_heads + h) * w.max_pages;
    if (pool_ == nullptr) {
      for (int p = have; p < need; ++p) {
        table_host_[row + p] = free_.back();
        free_.pop_back();
      }
    }
    table_.upload(table_host_.data() + row + have, (need - have) * sizeof(int32_t), (row + have) * sizeof(int32_t));
  }
  reserved_[seq] = need * w.page_size;
  capacity_[seq] = std::max(capacity_[seq], std::min(reserved_[seq], w.max_tokens));
}

void DeviceKvCache::append(const float* k, const float* v, int n_new, void* stream) {
  const DeviceKvView& w = view_;
  CUMULUS_CHECK(k != nullptr && v != nullptr, "DeviceKvCache::append: k and v must be non-null");
  CUMULUS_CHECK(n_new >= 1, "DeviceKvCache::append: n_new={} must be >= 1", n_new);
  for (int s = 0; s < w.n_seqs; ++s)
    CUMULUS_CHECK(static_cast<int64_t>(n_tokens_[s]) + n_new <= reserved_[s],
                  "DeviceKvCache::append: sequence {} holds {} tokens, {} more exceed the {} its pages hold (reserve)",
                  s, n_tokens_[s], n_new, reserved_[s]);
  cudaStream_t st = as_stream(stream);
  const dim3 grid_w(static_cast<unsigned>(n_new * w.n_kv_heads), static_cast<unsigned>(w.n_seqs));
  // Pages touched: those of [n, n + n_new), at most ceil(n_new / ps) + 1 of them.
  const dim3 grid_m(static_cast<unsigned>(w.n_kv_heads), static_cast<unsigned>(w.n_seqs),
                    static_cast<unsigned>((n_new + w.page_size - 1) / w.page_size + 1));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    kv_write_kernel<T><<<grid_w, w.head_dim, 0, st>>>(k, v, n_new, w.n_kv_heads, w.head_dim, w.page_shift,
                                                       w.max_pages, w.page_table, w.n_tokens, pool_k<T>(), pool_v<T>());
    CUMULUS_CUDA_LAUNCH("kv_write_kernel");
    if (w.kmin == nullptr) return;  // a pool without key statistics
    kv_meta_kernel<T><<<grid_m, w.head_dim, 0, st>>>(0, n_new, false, w.n_kv_heads, w.head_dim, w.page_shift,
                                                      w.max_pages, w.page_table, w.n_tokens, pool_k<T>(),
                                                      const_cast<float*>(w.kmin), const_cast<float*>(w.kmax),
                                                      const_cast<float*>(w.kmean));
    CUMULUS_CUDA_LAUNCH("kv_meta_kernel");
  };
  if (w.dtype == DType::f16)
    run(__half{});
  else
    run(__nv_bfloat16{});
  kv_advance_kernel<<<ceil_div(w.n_seqs, 128), 128, 0, st>>>(n_tok_.as<int32_t>(), w.n_seqs, n_new);
  CUMULUS_CUDA_LAUNCH("kv_advance_kernel");
  append_replayed(n_new);  // the host counts, as after a replay
}

void DeviceKvCache::append_replayed(int n_new) {
  CUMULUS_CHECK(n_new >= 1, "DeviceKvCache::append_replayed: n_new={} must be >= 1", n_new);
  for (int s = 0; s < view_.n_seqs; ++s)
    CUMULUS_CHECK(static_cast<int64_t>(n_tokens_[s]) + n_new <= reserved_[s],
                  "DeviceKvCache::append_replayed: sequence {} holds {} tokens, {} more exceed the {} its pages hold",
                  s, n_tokens_[s], n_new, reserved_[s]);
  for (int s = 0; s < view_.n_seqs; ++s) {
    n_tokens_[s] += n_new;
    capacity_[s] = std::max(capacity_[s], n_tokens_[s]);
  }
}

void DeviceKvCache::truncate(int seq, int n) {
  const DeviceKvView& w = view_;
  CUMULUS_CHECK(seq >= 0 && seq < w.n_seqs, "DeviceKvCache::truncate: seq={} out of range [0, {})", seq, w.n_seqs);
  CUMULUS_CHECK(n >= 0 && n <= n_tokens_[seq], "DeviceKvCache::truncate: n={} exceeds the {} tokens of sequence {}",
                n, n_tokens_[seq], seq);
  const int old = n_tokens_[seq];
  if (n == old) return;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    kv_zero_kernel<T><<<dim3(old - n, w.n_kv_heads), w.head_dim>>>(seq, n, w.n_kv_heads, w.head_dim, w.page_shift,
                                                                   w.max_pages, w.page_table, pool_k<T>(), pool_v<T>());
    CUMULUS_CUDA_LAUNCH("kv_zero_kernel");
    if (n % w.page_size != 0 && w.kmin != nullptr) {
      // The page cut short: its statistics over rows [page start, n). Only sequence seq's
      // blocks do work: the grid's y covers it alone through a shifted table and counts.
      kv_meta_kernel<T><<<dim3(w.n_kv_heads, 1, 1), w.head_dim>>>(
          n - 1, n, true, w.n_kv_heads, w.head_dim, w.page_shift, w.max_pages,
          w.page_table + static_cast<size_t>(seq) * w.n_kv_heads * w.max_pages, w.n_tokens + seq, pool_k<T>(),
          const_cast<float*>(w.kmin), const_cast<float*>(w.kmax), const_cast<float*>(w.kmean));
      CUMULUS_CUDA_LAUNCH("kv_meta_kernel");
    }
  };
  if (w.dtype == DType::f16)
    run(__half{});
  else
    run(__nv_bfloat16{});
  CUMULUS_CUDA_CHECK(cudaDeviceSynchronize());
  // Pages past the one holding token n - 1 go back to the pool.
  const int keep = (n + w.page_size - 1) / w.page_size, had = reserved_[seq] / w.page_size;
  std::vector<int32_t> dropped;
  for (int h = 0; h < w.n_kv_heads; ++h) {
    const size_t row = (static_cast<size_t>(seq) * w.n_kv_heads + h) * w.max_pages;
    for (int p = had - 1; p >= keep; --p) {
      if (table_host_[row + p] < 0) continue;
      dropped.push_back(table_host_[row + p]);
      table_host_[row + p] = -1;
    }
  }
  if (pool_ != nullptr) {
    pool_->release(dropped);
  } else {
    free_.insert(free_.end(), dropped.begin(), dropped.end());
  }
  reserved_[seq] = keep * w.page_size;
  n_tokens_[seq] = n;
  n_tok_.upload(&n, sizeof(int32_t), static_cast<size_t>(seq) * sizeof(int32_t));
}

DeviceKvHeadCopy DeviceKvCache::download_head(int seq, int h) const {
  const DeviceKvView& w = view_;
  CUMULUS_CHECK(seq >= 0 && seq < w.n_seqs && h >= 0 && h < w.n_kv_heads,
                "DeviceKvCache::download_head: seq={} h={} out of range ({} sequences, {} kv heads)", seq, h, w.n_seqs,
                w.n_kv_heads);
  CUMULUS_CHECK(dtype_size(w.dtype) == 2, "DeviceKvCache::download_head: 16-bit storage only");
  DeviceKvHeadCopy c;
  c.n_tokens = n_tokens_[seq];
  const int d = w.head_dim, n_pages = (c.n_tokens + w.page_size - 1) / w.page_size;
  c.k.resize(static_cast<size_t>(c.n_tokens) * d);
  c.v.resize(c.k.size());
  c.kmin.resize(w.kmin != nullptr ? static_cast<size_t>(n_pages) * d : 0);
  c.kmax.resize(c.kmin.size());
  c.kmean.resize(c.kmin.size());
  const size_t row = (static_cast<size_t>(seq) * w.n_kv_heads + h) * w.max_pages;
  const size_t page_bytes = static_cast<size_t>(w.page_size) * d * 2;
  for (int p = 0; p < n_pages; ++p) {
    const int32_t slot = table_host_[row + p];
    CUMULUS_CHECK(slot >= 0, "DeviceKvCache::download_head: page {} of (seq {}, head {}) is not assigned", p, seq, h);
    const int len = std::min(w.page_size, c.n_tokens - p * w.page_size);
    const size_t off = static_cast<size_t>(p) * w.page_size * d;
    const auto* kb = static_cast<const char*>(w.k);
    const auto* vb = static_cast<const char*>(w.v);
    memcpy_to_host(c.k.data() + off, kb + slot * page_bytes, static_cast<size_t>(len) * d * 2);
    memcpy_to_host(c.v.data() + off, vb + slot * page_bytes, static_cast<size_t>(len) * d * 2);
    const size_t mo = static_cast<size_t>(slot) * d;
    if (w.kmin == nullptr) continue;
    memcpy_to_host(c.kmin.data() + static_cast<size_t>(p) * d, w.kmin + mo, d * sizeof(float));
    memcpy_to_host(c.kmax.data() + static_cast<size_t>(p) * d, w.kmax + mo, d * sizeof(float));
    memcpy_to_host(c.kmean.data() + static_cast<size_t>(p) * d, w.kmean + mo, d * sizeof(float));
  }
  return c;
}

}  // namespace cumulus::cuda
