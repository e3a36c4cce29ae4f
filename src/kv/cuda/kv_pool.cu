// The two-tier KV page pool (kv/cuda_kv_pool.h). Each array (K, V, key min, max, mean) is
// one reserved range of device addresses: its first part is mapped to device memory, the
// rest to pinned host memory (the driver's virtual memory management, reached through
// cudaGetDriverEntryPointByVersion so that nothing links libcuda), so slot s of either tier
// is at base + s * bytes_per_page for every kernel. Each slot's epoch is the last step its
// page was read or placed: the mark kernel sets it (its old value tells a page's first read
// in a step, and a host page read in two steps running, the candidates to promote), a radix
// sort of the device slots by age gives the least recently used, TierSlots pairs them, and
// one kernel swaps the bytes (and epochs) of each move and writes the page-table entries.
#include <cuda.h>
#include <fmt/format.h>

#include <cub/cub.cuh>

#include <algorithm>
#include <chrono>
#include <numeric>

#include "core/check.h"
#include "core/cuda/cuda_util.cuh"
#include "cumulus/core/host_memory.h"
#include "cumulus/kv/cuda_kv_pool.h"
#include "cumulus/kv/tier_slots.h"

namespace cumulus::cuda {
namespace {

// The driver entry points the pool uses, looked up once.
struct Driver {
  CUresult (*mem_address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*mem_address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) =
      nullptr;
  CUresult (*mem_release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*mem_unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*mem_granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
};

template <class F>
void lookup(const char* name, F*& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
  CUMULUS_CHECK(e == cudaSuccess && q == cudaDriverEntryPointSuccess && p != nullptr,
                "KvPagePool: the CUDA driver has no {} (it needs virtual memory management, CUDA 12 or later)", name);
  fn = reinterpret_cast<F*>(p);
}

const Driver& driver() {
  static const Driver d = [] {
    CUMULUS_CUDA_CHECK(cudaFree(nullptr));  // the primary context
    Driver r;
    lookup("cuMemAddressReserve", r.mem_address_reserve);
    lookup("cuMemAddressFree", r.mem_address_free);
    lookup("cuMemCreate", r.mem_create);
    lookup("cuMemRelease", r.mem_release);
    lookup("cuMemMap", r.mem_map);
    lookup("cuMemUnmap", r.mem_unmap);
    lookup("cuMemSetAccess", r.mem_set_access);
    lookup("cuMemGetAllocationGranularity", r.mem_granularity);
    lookup("cuGetErrorString", r.error_string);
    return r;
  }();
  return d;
}

std::string cu_error(CUresult r) {
  const char* s = nullptr;
  if (driver().error_string != nullptr) driver().error_string(r, &s);
  return fmt::format("CUDA driver error {} ({})", static_cast<int>(r), s != nullptr ? s : "unknown");
}

int current_device() {
  int dev = 0;
  CUMULUS_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

CUmemAllocationProp prop_of(bool host) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = host ? 0 : current_device();
  return p;
}

size_t granularity(bool host) {
  const CUmemAllocationProp p = prop_of(host);
  size_t g = 0;
  const CUresult r = driver().mem_granularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  CUMULUS_CHECK(r == CUDA_SUCCESS && g > 0, "KvPagePool: no mapping granularity for {} memory: {}",
                host ? "host" : "device", cu_error(r));
  return g;
}

size_t gib(size_t bytes) { return bytes >> 30; }

// Bytes of one page in each array: K, V, kmin, kmax, kmean (0: not kept).
void array_page_bytes(int head_dim, DType dtype, int page_size, bool key_stats, size_t (&b)[5]) {
  b[0] = b[1] = static_cast<size_t>(page_size) * head_dim * dtype_size(dtype);
  b[2] = b[3] = b[4] = key_stats ? static_cast<size_t>(head_dim) * sizeof(float) : 0;
}

void check_options(const KvPoolOptions& o) {
  CUMULUS_CHECK(head_dim_supported_cuda(o.head_dim), "KvPagePool: head_dim={} is not supported (64, 128, 256)",
                o.head_dim);
  CUMULUS_CHECK(o.dtype == DType::f16 || o.dtype == DType::bf16, "KvPagePool: dtype={} is not supported (f16, bf16)",
                dtype_name(o.dtype));
  CUMULUS_CHECK(o.page_size >= 1 && o.page_size <= 256 && (o.page_size & (o.page_size - 1)) == 0,
                "KvPagePool: page_size={} must be a power of two in [1, 256]", o.page_size);
  CUMULUS_CHECK(o.device_pages >= 1, "KvPagePool: device_pages={} must be >= 1", o.device_pages);
  CUMULUS_CHECK(o.host_pages >= 0, "KvPagePool: host_pages={} must be >= 0", o.host_pages);
  CUMULUS_CHECK(o.promote_reads == 1 || o.promote_reads == 2, "KvPagePool: promote_reads={} must be 1 or 2",
                o.promote_reads);
  CUMULUS_CHECK(o.stage_pages >= 0, "KvPagePool: stage_pages={} must be >= 0", o.stage_pages);
  CUMULUS_CHECK(o.stage_sets == 1 || o.stage_sets == 2, "KvPagePool: stage_sets={} must be 1 or 2", o.stage_sets);
}

// ---- kernels ----

constexpr int32_t kFreeEpoch = 0x7fffffff;  // a free slot: never read, never a victim
// counters_: [0] candidates, [1] K/V rows read from host slots, [2] hits, [3] misses (mark);
// [4] rows staged, [5] host pages left unstaged (stage()).
constexpr int kCounters = 6;

// Block-wide sum of one value per thread, added to *dst by thread 0.
__device__ void block_add(unsigned long long v, unsigned long long* dst) {
  __shared__ unsigned long long part[32];
  v = __reduce_add_sync(0xffffffffu, static_cast<unsigned>(v)) +
      (static_cast<unsigned long long>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(v >> 32))) << 32);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long t = 0;
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) t += part[w];
    if (t != 0) atomicAdd(dst, t);
  }
  __syncthreads();  // part[] is read before the next call writes it
}

// Grid (n_lists, chunks), 256 threads: the pages list l reads (every cached page when idx is
// null) get this step's epoch. A page's first read in the step counts a hit (device slot) or a
// miss (host slot); a host page whose epoch was the previous step's, or any host page when
// promote_reads is 1, joins the candidates. counters: [0] candidates, [1] K/V rows read
// from host slots, [2] hits, [3] misses.
__global__ void tier_mark_kernel(DeviceKvView kv, const int32_t* __restrict__ idx, const int32_t* __restrict__ len,
                                 int stride, int32_t device_pages, const int32_t* __restrict__ step, int promote_reads,
                                 int32_t* epochs, int32_t* cands, unsigned long long* counters) {
  const int l = blockIdx.x, s = l / kv.n_kv_heads;
  const int32_t epoch = *step;  // read on the device: a captured step replays with the current one
  const int n_tok = kv.n_tokens[s];
  const int32_t* pt = kv.page_table + static_cast<size_t>(l) * kv.max_pages;
  unsigned long long host_rows = 0, hits = 0, misses = 0;
  auto first_read = [&](int32_t slot) {
    const int32_t old = atomicExch(epochs + slot, epoch);
    if (old == epoch) return;
    if (slot < device_pages) {
      ++hits;
      return;
    }
    ++misses;
    if (promote_reads == 1 || old == epoch - 1) cands[atomicAdd(counters, 1ull)] = slot;
  };
  if (idx == nullptr) {
    const int n_pages = (n_tok + kv.page_size - 1) >> kv.page_shift;
    for (int p = blockIdx.y * blockDim.x + threadIdx.x; p < n_pages; p += gridDim.y * blockDim.x) {
      const int32_t slot = pt[p];
      if (slot >= device_pages) host_rows += min(kv.page_size, n_tok - (p << kv.page_shift));
      first_read(slot);
    }
  } else {
    const int32_t* li = idx + static_cast<size_t>(l) * stride;
    const int n = len[l];
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < n; i += gridDim.y * blockDim.x) {
      const int p = li[i] >> kv.page_shift;
      const int32_t slot = pt[p];
      if (slot >= device_pages) ++host_rows;
      if (i > 0 && (li[i - 1] >> kv.page_shift) == p) continue;  // sorted: the page's first row reads it
      first_read(slot);
    }
  }
  block_add(host_rows, counters + 1);
  block_add(hits, counters + 2);
  block_add(misses, counters + 3);
}

// Grid (n_lists, chunks): the pages that list l reads get touched[l][page] = 1.
__global__ void tier_touch_kernel(DeviceKvView kv, const int32_t* __restrict__ idx, const int32_t* __restrict__ len,
                                  int stride, uint8_t* touched) {
  const int l = blockIdx.x;
  const int32_t* li = idx + static_cast<size_t>(l) * stride;
  uint8_t* t = touched + static_cast<size_t>(l) * kv.max_pages;
  const int n = len[l];
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < n; i += gridDim.y * blockDim.x) t[li[i] >> kv.page_shift] = 1;
}

// One thread per page-table entry of the layer: staged[i] is the entry's own slot, or, for a
// cached page in a host slot that the step reads (touched, or every one when touched is
// null), the next staging slot while there is one (warp-aggregated; which page gets which
// staging slot does not matter, every copy holds the same bytes).
__global__ void tier_stage_assign_kernel(DeviceKvView kv, const uint8_t* __restrict__ touched, int32_t host_begin,
                                         int32_t host_end, int32_t stage_begin, int32_t stage_pages,
                                         int32_t* __restrict__ staged, unsigned long long* next,
                                         unsigned long long* counters) {
  const size_t total = static_cast<size_t>(kv.n_seqs) * kv.n_kv_heads * kv.max_pages;
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool want = false;
  int32_t slot = -1;
  if (i < total) {
    const int l = static_cast<int>(i / kv.max_pages), p = static_cast<int>(i % kv.max_pages);
    const int n_pages = (kv.n_tokens[l / kv.n_kv_heads] + kv.page_size - 1) >> kv.page_shift;
    slot = kv.page_table[i];
    want = p < n_pages && slot >= host_begin && slot < host_end && (touched == nullptr || touched[i] != 0);
  }
  const unsigned mask = __ballot_sync(0xffffffffu, want);
  const int lane = threadIdx.x & 31;
  unsigned long long base = 0;
  if (mask != 0) {
    const int leader = __ffs(mask) - 1;
    if (lane == leader) base = atomicAdd(next, static_cast<unsigned long long>(__popc(mask)));
    base = __shfl_sync(0xffffffffu, base, leader);
  }
  if (i >= total) return;
  if (want) {
    const unsigned long long j = base + __popc(mask & ((1u << lane) - 1u));
    if (j < static_cast<unsigned long long>(stage_pages))
      slot = stage_begin + static_cast<int32_t>(j);
    else
      atomicAdd(counters + 5, 1ull);
  }
  staged[i] = slot;
}

// Grid (n_lists, chunks): each row that list l reads (every row of every cached page when idx
// is null) whose page got a staging slot is copied there, K and V, to the same row; one
// thread per 16 bytes of a row, so consecutive threads read one row's bytes together.
__global__ void tier_stage_copy_kernel(DeviceKvView kv, const int32_t* __restrict__ idx,
                                       const int32_t* __restrict__ len, int stride,
                                       const int32_t* __restrict__ staged, KvPoolArrays arr,
                                       unsigned long long* counters) {
  const int l = blockIdx.x;
  const int n_tok = kv.n_tokens[l / kv.n_kv_heads];
  const int row_bytes = arr.bytes[0] >> kv.page_shift;
  const int per_row = row_bytes / 16;
  const int32_t* pt = kv.page_table + static_cast<size_t>(l) * kv.max_pages;
  const int32_t* st = staged + static_cast<size_t>(l) * kv.max_pages;
  const int32_t* li = idx != nullptr ? idx + static_cast<size_t>(l) * stride : nullptr;
  const int n = li != nullptr ? len[l] : ((n_tok + kv.page_size - 1) >> kv.page_shift) << kv.page_shift;
  const long long total = static_cast<long long>(n) * per_row;
  unsigned long long rows = 0;
  for (long long c = static_cast<long long>(blockIdx.y) * blockDim.x + threadIdx.x; c < total;
       c += static_cast<long long>(gridDim.y) * blockDim.x) {
    const int e = static_cast<int>(c / per_row), o = static_cast<int>(c % per_row);
    const int t = li != nullptr ? li[e] : e;
    const int p = t >> kv.page_shift;
    const int32_t from = pt[p], to = st[p];
    if (from == to) continue;
    const size_t r = static_cast<size_t>(t & (kv.page_size - 1)) * row_bytes + static_cast<size_t>(o) * 16;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const uint4 w = __ldcs(reinterpret_cast<const uint4*>(arr.base[x] + static_cast<size_t>(from) * arr.bytes[x] + r));
      *reinterpret_cast<uint4*>(arr.base[x] + static_cast<size_t>(to) * arr.bytes[x] + r) = w;
    }
    rows += o == 0 && t < n_tok;  // a whole page's padding rows are copied, not counted
  }
  block_add(rows, counters + 4);
}

// Blocks per list for the kernels that walk a layer's lists (one list can be a million
// tokens at batch 1): eight per multiprocessor in all, enough to keep PCIe reads in flight.
unsigned list_chunks(int n_lists) {
  return static_cast<unsigned>(std::clamp(8 * sm_count() / std::max(n_lists, 1), 1, 65535));
}

// Sort keys of the device slots, least recently used first: 0xfffe - min(age, 0xfffe) for a
// slot read before `epoch` (age = epoch - its epoch >= 1), 0xffff for a free slot or one read
// in this step (never a victim). Ages of 0xfffe steps and more count as equal.
__global__ void tier_age_kernel(const int32_t* __restrict__ epochs, int32_t n, int32_t epoch, uint16_t* keys,
                                int32_t* slots) {
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t e = epochs[i];
  uint16_t k = 0xffff;
  if (e != kFreeEpoch && e < epoch) k = static_cast<uint16_t>(0xfffe - min(epoch - e, 0xfffe));
  keys[i] = k;
  slots[i] = i;
}

__global__ void tier_set_step_kernel(int32_t* step, int32_t value) { *step = value; }

// The epochs of the slots listed become `epoch` (new pages).
__global__ void tier_set_epoch_kernel(const int32_t* __restrict__ slots, int n, int32_t epoch, int32_t* epochs) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) epochs[slots[i]] = epoch;
}

struct MoveDesc {
  int32_t a, b;
  int32_t* entry_a;  // the page-table entry of the page now in slot a (null: a is free)
  int32_t* entry_b;
};

using Arrays = KvPoolArrays;

// One block per move: the two slots' bytes of every array, and their epochs, exchange. Each
// thread swaps its own 16-byte words, so no word is read after another thread wrote it.
__global__ void tier_move_kernel(const MoveDesc* __restrict__ moves, Arrays arr, int32_t* epochs) {
  const MoveDesc m = moves[blockIdx.x];
#pragma unroll 1
  for (int x = 0; x < 5; ++x) {
    if (arr.bytes[x] == 0) continue;  // an array the pool does not keep
    const int n = arr.bytes[x] / 16;
    uint4* pa = reinterpret_cast<uint4*>(arr.base[x] + static_cast<size_t>(m.a) * arr.bytes[x]);
    uint4* pb = reinterpret_cast<uint4*>(arr.base[x] + static_cast<size_t>(m.b) * arr.bytes[x]);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const uint4 a = pa[i], b = pb[i];
      pa[i] = b;
      pb[i] = a;
    }
  }
  if (threadIdx.x == 0) {
    if (m.entry_a != nullptr) *m.entry_a = m.a;
    if (m.entry_b != nullptr) *m.entry_b = m.b;
    const int32_t e = epochs[m.a];
    epochs[m.a] = epochs[m.b];
    epochs[m.b] = e;
  }
}

// One block per slot: every array's bytes of the slot become zero, its epoch free.
__global__ void tier_zero_kernel(const int32_t* __restrict__ slots, Arrays arr, int32_t* epochs) {
  const int32_t s = slots[blockIdx.x];
  if (threadIdx.x == 0) epochs[s] = kFreeEpoch;
#pragma unroll 1
  for (int x = 0; x < 5; ++x) {
    if (arr.bytes[x] == 0) continue;
    uint4* p = reinterpret_cast<uint4*>(arr.base[x] + static_cast<size_t>(s) * arr.bytes[x]);
    for (int i = threadIdx.x; i < arr.bytes[x] / 16; i += blockDim.x) p[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

size_t KvPagePool::page_bytes(int head_dim, DType dtype, int page_size, bool key_stats) {
  size_t b[5];
  array_page_bytes(head_dim, dtype, page_size, key_stats, b);
  return b[0] + b[1] + b[2] + b[3] + b[4];
}

size_t KvPagePool::overhead_bytes(int64_t device_pages, int64_t host_pages) {
  const size_t d = static_cast<size_t>(device_pages), h = static_cast<size_t>(host_pages);
  // epochs, the step, candidates, counters, the staging slot counters; the sort's keys and
  // values twice, its scratch
  return 4 * (d + h) + 4 + 4 * h + 8 * kCounters + 16 + 16 * d + (size_t{1} << 20);
}

int64_t KvPagePool::device_pages_granule(int head_dim, DType dtype, int page_size, bool key_stats) {
  size_t b[5];
  array_page_bytes(head_dim, dtype, page_size, key_stats, b);
  const size_t g = std::max(granularity(false), granularity(true));
  size_t pages = 1;
  for (size_t x : b)
    if (x > 0) pages = std::lcm(pages, g / std::gcd(g, x));
  return static_cast<int64_t>(pages);
}

KvPagePool::KvPagePool(const KvPoolOptions& o) : o_(o), slots_(o.device_pages, o.host_pages) {}

std::shared_ptr<KvPagePool> KvPagePool::create(const KvPoolOptions& options) {
  check_options(options);
  const Driver& drv = driver();
  KvPoolOptions o = options;
  const int64_t granule = device_pages_granule(o.head_dim, o.dtype, o.page_size, o.key_stats);
  const int64_t dev_pages = o.device_pages / granule * granule;
  CUMULUS_CHECK(dev_pages >= 1, "KvPagePool: device_pages={} is below one mapping granule of {} pages",
                o.device_pages, granule);
  o.device_pages = dev_pages;
  o.host_pages = (o.host_pages + granule - 1) / granule * granule;
  if (o.host_pages == 0) o.stage_pages = 0;  // nothing to stage
  const int64_t kv_granule = device_pages_granule(o.head_dim, o.dtype, o.page_size, false);
  o.stage_pages = (o.stage_pages + kv_granule - 1) / kv_granule * kv_granule;
  CUMULUS_CHECK(o.device_pages + o.host_pages + o.stage_sets * o.stage_pages <= INT32_MAX,
                "KvPagePool: {} device + {} host + {} x {} staging pages exceed int32", o.device_pages, o.host_pages,
                o.stage_sets, o.stage_pages);
  const size_t stage_slots = static_cast<size_t>(o.stage_sets) * static_cast<size_t>(o.stage_pages);
  std::shared_ptr<KvPagePool> pool(new KvPagePool(o));
  size_t b[5];
  array_page_bytes(o.head_dim, o.dtype, o.page_size, o.key_stats, b);
  const size_t g = std::max(granularity(false), granularity(true));
  const size_t per_page = b[0] + b[1] + b[2] + b[3] + b[4];
  const size_t dev_total =
      per_page * static_cast<size_t>(o.device_pages) + (b[0] + b[1]) * stage_slots;
  const size_t host_total = per_page * static_cast<size_t>(o.host_pages);
  const size_t dev_free = device_free_bytes();
  if (dev_total > dev_free)
    throw DeviceMemoryError(fmt::format("KvPagePool: the device tier needs {} bytes ({} GiB) for {} pages; {} bytes "
                                        "({} GiB) are free on the device",
                                        dev_total, gib(dev_total), o.device_pages, dev_free, gib(dev_free)));
  const size_t host_free = host_available_bytes();
  if (host_total > 0 && host_free > 0 && host_total > host_free)
    throw Error(fmt::format("KvPagePool: the host tier needs {} bytes ({} GiB) of pinned memory for {} pages; the host "
                            "has {} bytes ({} GiB) available (MemAvailable)",
                            host_total, gib(host_total), o.host_pages, host_free, gib(host_free)));
  const int dev = current_device();
  for (int x = 0; x < 5; ++x) {
    Array& a = pool->arr_[x];
    if (b[x] == 0) continue;  // key statistics not kept
    a.bytes_per_page = b[x];
    a.dev_bytes = b[x] * static_cast<size_t>(o.device_pages);
    a.host_bytes = b[x] * static_cast<size_t>(o.host_pages);
    a.stage_bytes = x < 2 ? b[x] * stage_slots : 0;  // K and V only
    a.reserved = a.dev_bytes + a.host_bytes + a.stage_bytes;
    CUdeviceptr va = 0;
    CUresult r = drv.mem_address_reserve(&va, a.reserved, g, 0, 0);
    CUMULUS_CHECK(r == CUDA_SUCCESS, "KvPagePool: reserving {} bytes of device addresses: {}", a.reserved,
                  cu_error(r));
    a.va = reinterpret_cast<void*>(va);
    const CUmemAllocationProp pd = prop_of(false);
    CUmemGenericAllocationHandle h = 0;
    r = drv.mem_create(&h, a.dev_bytes, &pd, 0);
    if (r != CUDA_SUCCESS)
      throw DeviceMemoryError(fmt::format("KvPagePool: the device tier's {} bytes for one array: {}", a.dev_bytes,
                                          cu_error(r)));
    a.dev_handle = h;
    r = drv.mem_map(va, a.dev_bytes, 0, h, 0);
    CUMULUS_CHECK(r == CUDA_SUCCESS, "KvPagePool: mapping the device tier: {}", cu_error(r));
    if (a.host_bytes > 0) {
      const CUmemAllocationProp ph = prop_of(true);
      r = drv.mem_create(&h, a.host_bytes, &ph, 0);
      CUMULUS_CHECK(r == CUDA_SUCCESS,
                    "KvPagePool: cannot pin {} bytes ({} GiB) of host memory for the host tier's {} pages: {} (the "
                    "whole host tier is {} GiB)",
                    a.host_bytes, gib(a.host_bytes), o.host_pages, cu_error(r), gib(host_total));
      a.host_handle = h;
      r = drv.mem_map(va + a.dev_bytes, a.host_bytes, 0, h, 0);
      CUMULUS_CHECK(r == CUDA_SUCCESS, "KvPagePool: mapping the host tier into device addresses: {}", cu_error(r));
    }
    if (a.stage_bytes > 0) {
      r = drv.mem_create(&h, a.stage_bytes, &pd, 0);
      if (r != CUDA_SUCCESS)
        throw DeviceMemoryError(fmt::format("KvPagePool: the staging area's {} bytes for one array: {}",
                                            a.stage_bytes, cu_error(r)));
      a.stage_handle = h;
      r = drv.mem_map(va + a.dev_bytes + a.host_bytes, a.stage_bytes, 0, h, 0);
      CUMULUS_CHECK(r == CUDA_SUCCESS, "KvPagePool: mapping the staging area: {}", cu_error(r));
    }
    CUmemAccessDesc acc{};
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = drv.mem_set_access(va, a.reserved, &acc, 1);
    CUMULUS_CHECK(r == CUDA_SUCCESS, "KvPagePool: giving the device access to the pool: {}", cu_error(r));
    // Free slots hold zeros (padding rows of partial pages read back as zero); the moves
    // keep it so, since a page only ever exchanges places with a free slot or another page.
    CUMULUS_CUDA_CHECK(cudaMemset(a.va, 0, a.reserved));
  }
  const size_t slots = static_cast<size_t>(o.device_pages + o.host_pages);
  pool->owner_dev_.assign(slots, nullptr);
  pool->owner_host_.assign(slots, nullptr);
  pool->epoch_ = to_device(std::vector<int32_t>(slots, kFreeEpoch));
  if (o.host_pages > 0) pool->cands_ = DeviceBuffer(static_cast<size_t>(o.host_pages) * sizeof(int32_t));
  pool->step_ = to_device(std::vector<int32_t>{static_cast<int32_t>(pool->time_)});
  pool->counters_ = DeviceBuffer(kCounters * sizeof(unsigned long long));
  pool->counters_.fill_bytes(0);
  if (stage_slots > 0) pool->stage_next_ = DeviceBuffer(2 * sizeof(unsigned long long));
  CUMULUS_CUDA_CHECK(cudaDeviceSynchronize());
  return pool;
}

KvPagePool::~KvPagePool() {
  // No throw from a destructor: failures here would be a prior fault.
  cudaDeviceSynchronize();
  const Driver& drv = driver();
  for (Array& a : arr_) {
    if (a.va == nullptr) continue;
    const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(a.va);
    if (a.dev_handle != 0) {
      drv.mem_unmap(va, a.dev_bytes);
      drv.mem_release(a.dev_handle);
    }
    if (a.host_handle != 0) {
      drv.mem_unmap(va + a.dev_bytes, a.host_bytes);
      drv.mem_release(a.host_handle);
    }
    if (a.stage_handle != 0) {
      drv.mem_unmap(va + a.dev_bytes + a.host_bytes, a.stage_bytes);
      drv.mem_release(a.stage_handle);
    }
    drv.mem_address_free(va, a.reserved);
  }
}

size_t KvPagePool::device_bytes() const {
  return page_bytes(o_.head_dim, o_.dtype, o_.page_size, o_.key_stats) * static_cast<size_t>(o_.device_pages) +
         page_bytes(o_.head_dim, o_.dtype, o_.page_size, false) * static_cast<size_t>(o_.stage_sets) *
             static_cast<size_t>(o_.stage_pages);
}
size_t KvPagePool::host_bytes() const {
  return page_bytes(o_.head_dim, o_.dtype, o_.page_size, o_.key_stats) * static_cast<size_t>(o_.host_pages);
}

std::vector<int32_t> KvPagePool::victims(int64_t k) {
  if (k <= 0) return {};
  const int32_t n = static_cast<int32_t>(o_.device_pages);
  if (sort_keys_.size() == 0) {
    sort_keys_ = DeviceBuffer(2 * static_cast<size_t>(n) * sizeof(uint16_t));
    sort_vals_ = DeviceBuffer(2 * static_cast<size_t>(n) * sizeof(int32_t));
    size_t temp = 0;
    CUMULUS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp, sort_keys_.as<uint16_t>(),
                                                       sort_keys_.as<uint16_t>() + n, sort_vals_.as<int32_t>(),
                                                       sort_vals_.as<int32_t>() + n, n, 0, 16));
    sort_temp_ = DeviceBuffer(std::max<size_t>(temp, 1));
  }
  uint16_t* keys = sort_keys_.as<uint16_t>();
  int32_t* vals = sort_vals_.as<int32_t>();
  tier_age_kernel<<<ceil_div(n, 256), 256>>>(epoch_.as<int32_t>(), n, static_cast<int32_t>(time_), keys, vals);
  CUMULUS_CUDA_LAUNCH("tier_age_kernel");
  size_t temp = sort_temp_.size();
  // Stable: among slots of one age the lower comes first.
  CUMULUS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_temp_.data(), temp, keys, keys + n, vals, vals + n, n, 0, 16));
  const int64_t m = std::min<int64_t>(k, n);
  std::vector<uint16_t> kh(static_cast<size_t>(m));
  std::vector<int32_t> r(static_cast<size_t>(m));
  memcpy_to_host(kh.data(), keys + n, kh.size() * sizeof(uint16_t));
  memcpy_to_host(r.data(), vals + n, r.size() * sizeof(int32_t));
  const auto end = std::find(kh.begin(), kh.end(), uint16_t{0xffff});  // the first that is no victim
  r.resize(static_cast<size_t>(end - kh.begin()));
  return r;
}

void KvPagePool::wait_last_step() {
  if (last_stream_set_) CUMULUS_CUDA_CHECK(cudaStreamSynchronize(as_stream(last_stream_)));
  last_stream_set_ = false;
}

void KvPagePool::allocate(int n, int32_t* const* device_entries, int32_t* const* host_entries) {
  CUMULUS_CHECK(n >= 0, "KvPagePool::allocate: n={} must be >= 0", n);
  wait_last_step();  // the last step's moves, enqueued on its stream
  CUMULUS_CHECK(n <= slots_.free_device() + slots_.free_host(),
                "KvPagePool::allocate: {} pages asked for, the pool has {} free ({} on the device, {} on the host)", n,
                slots_.free_device() + slots_.free_host(), slots_.free_device(), slots_.free_host());
  // Device slots beyond the free ones come from the least recently used pages, which go to
  // free host slots.
  const int64_t short_by = std::min<int64_t>(n - slots_.free_device(), slots_.free_host());
  const std::vector<int32_t> vict = victims(short_by);
  std::vector<PageMove> moves;
  const std::vector<int32_t> placed = slots_.place(n, vict, moves);
  for (const PageMove& m : moves) {  // the demoted page now lives in slot b
    owner_dev_[m.b] = owner_dev_[m.a];
    owner_host_[m.b] = owner_host_[m.a];
    *owner_host_[m.b] = m.b;
  }
  for (int i = 0; i < n; ++i) {
    owner_dev_[placed[i]] = device_entries[i];
    owner_host_[placed[i]] = host_entries[i];
    *host_entries[i] = placed[i];
  }
  totals_.moved_bytes += apply(moves, nullptr);
  if (!placed.empty()) {  // the new pages are placed now
    const DeviceBuffer list = to_device(placed);
    tier_set_epoch_kernel<<<ceil_div(n, 256), 256>>>(list.as<int32_t>(), n, static_cast<int32_t>(time_),
                                                     epoch_.as<int32_t>());
    CUMULUS_CUDA_LAUNCH("tier_set_epoch_kernel");
  }
  CUMULUS_CUDA_CHECK(cudaDeviceSynchronize());
}

void KvPagePool::release(const std::vector<int32_t>& slots) {
  if (slots.empty()) return;
  wait_last_step();
  for (int32_t s : slots) {
    CUMULUS_CHECK(s >= 0 && s < o_.device_pages + o_.host_pages && owner_host_[s] != nullptr,
                  "KvPagePool::release: slot {} holds no page", s);
  }
  // Free slots hold zeros: the released pages are cleared before they can be handed out.
  DeviceBuffer list = to_device(slots);
  tier_zero_kernel<<<static_cast<unsigned>(slots.size()), 256>>>(list.as<int32_t>(), arrays(), epoch_.as<int32_t>());
  CUMULUS_CUDA_LAUNCH("tier_zero_kernel");
  CUMULUS_CUDA_CHECK(cudaDeviceSynchronize());
  for (int32_t s : slots) {
    slots_.release(s);
    owner_dev_[s] = nullptr;
    owner_host_[s] = nullptr;
  }
}

KvPagePool::Arrays KvPagePool::arrays() const {
  Arrays arr{};
  for (int x = 0; x < 5; ++x) {
    arr.base[x] = static_cast<char*>(arr_[x].va);
    arr.bytes[x] = static_cast<int>(arr_[x].bytes_per_page);
  }
  return arr;
}

int64_t KvPagePool::apply(const std::vector<PageMove>& moves, void* stream) {
  if (moves.empty()) return 0;
  int64_t moved = 0;
  std::vector<MoveDesc> d(moves.size());
  size_t per_page = 0;
  for (const Array& a : arr_) per_page += a.bytes_per_page;
  for (size_t i = 0; i < moves.size(); ++i) {
    const PageMove& m = moves[i];
    d[i] = {m.a, m.b, owner_dev_[m.a], owner_dev_[m.b]};
    moved += static_cast<int64_t>(per_page) * ((owner_dev_[m.a] != nullptr) + (owner_dev_[m.b] != nullptr));
  }
  const size_t bytes = d.size() * sizeof(MoveDesc);
  if (moves_.size() < bytes) moves_ = DeviceBuffer(std::max(bytes, moves_.size() * 2));
  CUMULUS_CUDA_CHECK(cudaMemcpyAsync(moves_.data(), d.data(), bytes, cudaMemcpyHostToDevice, as_stream(stream)));
  // The host vector d must outlive the copy: wait for it (pageable memory copies are staged,
  // but the wait keeps this obviously right at the cost of one short sync per step).
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  tier_move_kernel<<<static_cast<unsigned>(moves.size()), 256, 0, as_stream(stream)>>>(moves_.as<MoveDesc>(), arrays(),
                                                                                      epoch_.as<int32_t>());
  CUMULUS_CUDA_LAUNCH("tier_move_kernel");
  return moved;
}

void KvPagePool::mark(const DeviceKvView& kv, const int32_t* idx, const int32_t* len, int stride, void* stream) {
  CUMULUS_CHECK(kv.k == arr_[0].va, "KvPagePool::mark: the view's pages are not this pool's");
  CUMULUS_CHECK(idx == nullptr || (len != nullptr && stride >= 1),
                "KvPagePool::mark: lists need len and a stride >= 1 (stride={})", stride);
  if (o_.host_pages == 0) return;  // one tier: nothing to decide
  const int n_lists = kv.n_seqs * kv.n_kv_heads;
  tier_mark_kernel<<<dim3(n_lists, list_chunks(n_lists)), 256, 0, as_stream(stream)>>>(
      kv, idx, len, stride, static_cast<int32_t>(o_.device_pages), step_.as<int32_t>(), o_.promote_reads,
      epoch_.as<int32_t>(), cands_.as<int32_t>(), counters_.as<unsigned long long>());
  CUMULUS_CUDA_LAUNCH("tier_mark_kernel");
}

void KvPagePool::reserve_stage(const DeviceKvView& kv) {
  if (stage_pages() == 0) return;
  const size_t entries = static_cast<size_t>(kv.n_seqs) * kv.n_kv_heads * kv.max_pages;
  staged_table_.resize(static_cast<size_t>(o_.stage_sets));
  touched_.resize(staged_table_.size());
  for (size_t x = 0; x < staged_table_.size(); ++x) {
    if (staged_table_[x].size() < entries * sizeof(int32_t)) staged_table_[x] = DeviceBuffer(entries * sizeof(int32_t));
    if (touched_[x].size() < entries) touched_[x] = DeviceBuffer(entries);
  }
}

const int32_t* KvPagePool::stage(const DeviceKvView& kv, const int32_t* idx, const int32_t* len, int stride,
                                 void* stream, int set) {
  CUMULUS_CHECK(kv.k == arr_[0].va, "KvPagePool::stage: the view's pages are not this pool's");
  CUMULUS_CHECK(idx == nullptr || (len != nullptr && stride >= 1),
                "KvPagePool::stage: lists need len and a stride >= 1 (stride={})", stride);
  CUMULUS_CHECK(set >= 0 && set < o_.stage_sets, "KvPagePool::stage: set={} out of range [0, {})", set,
                o_.stage_sets);
  if (stage_pages() == 0) return kv.page_table;
  const size_t entries = static_cast<size_t>(kv.n_seqs) * kv.n_kv_heads * kv.max_pages;
  CUMULUS_CHECK(static_cast<size_t>(set) < staged_table_.size() && staged_table_[set].size() >= entries * sizeof(int32_t),
                "KvPagePool::stage: reserve_stage() was not called for views of {} page-table entries", entries);
  const DeviceBuffer& table = staged_table_[set];
  const DeviceBuffer& touched = touched_[set];
  const cudaStream_t st = as_stream(stream);
  const int n_lists = kv.n_seqs * kv.n_kv_heads;
  const unsigned chunks = list_chunks(n_lists);
  if (idx != nullptr) {
    CUMULUS_CUDA_CHECK(cudaMemsetAsync(touched.data(), 0, entries, st));
    tier_touch_kernel<<<dim3(n_lists, chunks), 256, 0, st>>>(kv, idx, len, stride, touched.as<uint8_t>());
    CUMULUS_CUDA_LAUNCH("tier_touch_kernel");
  }
  unsigned long long* c = counters_.as<unsigned long long>();
  unsigned long long* next = stage_next_.as<unsigned long long>() + set;
  CUMULUS_CUDA_CHECK(cudaMemsetAsync(next, 0, sizeof(unsigned long long), st));
  const int32_t host_begin = static_cast<int32_t>(o_.device_pages);
  const int32_t host_end = static_cast<int32_t>(o_.device_pages + o_.host_pages);
  tier_stage_assign_kernel<<<static_cast<unsigned>(ceil_div(static_cast<int64_t>(entries), 256)), 256, 0, st>>>(
      kv, idx != nullptr ? touched.as<uint8_t>() : nullptr, host_begin, host_end,
      host_end + static_cast<int32_t>(set * o_.stage_pages), static_cast<int32_t>(o_.stage_pages),
      table.as<int32_t>(), next, c);
  CUMULUS_CUDA_LAUNCH("tier_stage_assign_kernel");
  tier_stage_copy_kernel<<<dim3(n_lists, chunks), 256, 0, st>>>(kv, idx, len, stride, table.as<int32_t>(), arrays(),
                                                                c);
  CUMULUS_CUDA_LAUNCH("tier_stage_copy_kernel");
  return table.as<int32_t>();
}

TierStats KvPagePool::end_step(void* stream) {
  const auto t0 = std::chrono::steady_clock::now();
  auto t1 = t0;
  TierStats s;
  s.steps = 1;
  if (o_.host_pages > 0) {
    unsigned long long c[kCounters];
    const cudaStream_t st = as_stream(stream);
    CUMULUS_CUDA_CHECK(cudaMemcpyAsync(c, counters_.data(), sizeof(c), cudaMemcpyDeviceToHost, st));
    CUMULUS_CUDA_CHECK(cudaStreamSynchronize(st));
    t1 = std::chrono::steady_clock::now();
    CUMULUS_CUDA_CHECK(cudaMemsetAsync(counters_.data(), 0, counters_.size(), st));
    // Every candidate, in slot order (the atomics' order is not reproducible), less any whose
    // page was released since it was read; then at most max_promote of them.
    cands_host_.resize(o_.max_promote == 0 ? 0 : static_cast<size_t>(c[0]));  // none wanted: none read
    if (!cands_host_.empty()) memcpy_to_host(cands_host_.data(), cands_.data(), cands_host_.size() * sizeof(int32_t));
    std::sort(cands_host_.begin(), cands_host_.end());
    std::erase_if(cands_host_, [&](int32_t x) { return slots_.on_device(x) || !slots_.occupied(x); });
    int64_t k = static_cast<int64_t>(cands_host_.size());
    if (o_.max_promote >= 0) k = std::min<int64_t>(k, o_.max_promote);
    const std::vector<int32_t> vict = victims(k - std::min<int64_t>(k, slots_.free_device()));
    const std::vector<PageMove> moves = slots_.promote(cands_host_, vict, o_.max_promote);
    for (const PageMove& m : moves) {  // a (host) <-> b (device)
      std::swap(owner_dev_[m.a], owner_dev_[m.b]);
      std::swap(owner_host_[m.a], owner_host_[m.b]);
      if (owner_host_[m.a] != nullptr) *owner_host_[m.a] = m.a;
      if (owner_host_[m.b] != nullptr) *owner_host_[m.b] = m.b;
    }
    s.moved_bytes = apply(moves, stream);
    last_stream_ = stream;
    last_stream_set_ = true;
    s.hits = static_cast<int64_t>(c[2]);
    s.misses = static_cast<int64_t>(c[3]);
    s.host_rows = static_cast<int64_t>(c[1]);
    s.staged_rows = static_cast<int64_t>(c[4]);
    s.unstaged_pages = static_cast<int64_t>(c[5]);
    s.promoted = static_cast<int64_t>(moves.size());
    for (const PageMove& m : moves) s.demoted += owner_dev_[m.a] != nullptr;
  }
  ++time_;
  if (o_.host_pages > 0) {
    tier_set_step_kernel<<<1, 1, 0, as_stream(stream)>>>(step_.as<int32_t>(), static_cast<int32_t>(time_));
    CUMULUS_CUDA_LAUNCH("tier_set_step_kernel");
    last_stream_ = stream;
    last_stream_set_ = true;
  }
  s.wait_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  s.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
  totals_ += s;
  return s;
}

std::vector<int32_t> KvPagePool::device_epochs() const {
  return to_host<int32_t>(epoch_, static_cast<size_t>(o_.device_pages + o_.host_pages));
}

}  // namespace cumulus::cuda
