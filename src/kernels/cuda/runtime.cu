// CUDA runtime pieces of the backend: error reporting, device queries, owning buffers and
// streams, and the upload of paged KV caches (one layer, a batch of sequences) into a
// device page pool with its page table and per-page key statistics.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "core/check.h"
#include "cuda_util.cuh"
#include "cumulus/kernels/cuda.h"

namespace cumulus::cuda {

void cuda_fail(cudaError_t e, const char* call, const char* file, int line) {
  // Reported here, so consumed: a failed allocation (not sticky) would otherwise surface
  // again at the next launch's check (cudaGetLastError) as that kernel's error.
  cudaGetLastError();
  const std::string what =
      fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(e), cudaGetErrorString(e), call, file, line);
  if (e == cudaErrorMemoryAllocation) throw DeviceMemoryError(what);
  throw Error(what);
}

bool device_available() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
}

DeviceInfo device_info() {
  CUMULUS_CHECK(device_available(), "no CUDA device is available");
  int dev = 0;
  CUMULUS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  CUMULUS_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  DeviceInfo info;
  info.name = p.name;
  info.cc_major = p.major;
  info.cc_minor = p.minor;
  info.sm_count = p.multiProcessorCount;
  info.memory_bytes = p.totalGlobalMem;
  info.l2_bytes = static_cast<size_t>(p.l2CacheSize);
  CUMULUS_CUDA_CHECK(cudaDriverGetVersion(&info.driver_version));
  CUMULUS_CUDA_CHECK(cudaRuntimeGetVersion(&info.runtime_version));
  return info;
}

int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    CUMULUS_CUDA_CHECK(cudaGetDevice(&dev));
    CUMULUS_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

void device_synchronize() { CUMULUS_CUDA_CHECK(cudaDeviceSynchronize()); }

// cudaMemcpy from pageable host memory, device-to-device, and cudaMemset may return before
// the device is done, and work on a non-blocking stream is not ordered after them: every
// "synchronous" call below waits for the device, so a kernel on any stream sees the data.
void memcpy_to_host(void* dst, const void* device_src, size_t bytes) {
  if (bytes > 0) CUMULUS_CUDA_CHECK(cudaMemcpy(dst, device_src, bytes, cudaMemcpyDeviceToHost));
}
void memcpy_to_device(void* device_dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  CUMULUS_CUDA_CHECK(cudaMemcpy(device_dst, src, bytes, cudaMemcpyHostToDevice));
  CUMULUS_CUDA_CHECK(cudaDeviceSynchronize());
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) CUMULUS_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);  // no throw from a destructor; a failure here is a prior fault
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}
void DeviceBuffer::upload(const void* src, size_t bytes, size_t offset) {
  CUMULUS_CHECK(offset <= bytes_ && bytes <= bytes_ - offset, "{} bytes at offset {} exceed the buffer of {} bytes",
                bytes, offset, bytes_);
  if (bytes == 0) return;
  CUMULUS_CUDA_CHECK(cudaMemcpy(static_cast<char*>(ptr_) + offset, src, bytes, cudaMemcpyHostToDevice));
  CUMULUS_CUDA_CHECK(cudaDeviceSynchronize());
}
void DeviceBuffer::download(void* dst, size_t bytes, size_t offset) const {
  CUMULUS_CHECK(offset <= bytes_ && bytes <= bytes_ - offset, "{} bytes at offset {} exceed the buffer of {} bytes",
                bytes, offset, bytes_);
  if (bytes > 0)
    CUMULUS_CUDA_CHECK(cudaMemcpy(dst, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost));
}
void DeviceBuffer::fill_bytes(int value) {
  if (bytes_ == 0) return;
  CUMULUS_CUDA_CHECK(cudaMemset(ptr_, value, bytes_));
  CUMULUS_CUDA_CHECK(cudaDeviceSynchronize());
}

void memset_async(void* device_dst, int value, size_t bytes, void* stream) {
  CUMULUS_CUDA_CHECK(cudaMemsetAsync(device_dst, value, bytes, as_stream(stream)));
}
void memcpy_device_async(void* device_dst, const void* device_src, size_t bytes, void* stream) {
  CUMULUS_CUDA_CHECK(cudaMemcpyAsync(device_dst, device_src, bytes, cudaMemcpyDeviceToDevice, as_stream(stream)));
}

EventTimer::EventTimer() {
  cudaEvent_t a = nullptr, b = nullptr;
  CUMULUS_CUDA_CHECK(cudaEventCreate(&a));
  CUMULUS_CUDA_CHECK(cudaEventCreate(&b));
  a_ = a;
  b_ = b;
}
EventTimer::~EventTimer() {
  if (a_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(a_));
  if (b_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(b_));
}
void EventTimer::start(void* stream) { CUMULUS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(a_), as_stream(stream))); }
void EventTimer::stop(void* stream) { CUMULUS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(b_), as_stream(stream))); }
float EventTimer::elapsed_ms() const {
  CUMULUS_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(b_)));
  float ms = 0;
  CUMULUS_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a_), static_cast<cudaEvent_t>(b_)));
  return ms;
}

void Graph::begin(void* stream) {
  CUMULUS_CHECK(stream != nullptr, "capture needs a created stream, not the default stream");
  CUMULUS_CUDA_CHECK(cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeThreadLocal));
}
void Graph::end(void* stream) {
  cudaGraph_t g = nullptr;
  CUMULUS_CUDA_CHECK(cudaStreamEndCapture(as_stream(stream), &g));
  graph_ = g;
  cudaGraphExec_t e = nullptr;
  CUMULUS_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  exec_ = e;
}
Graph::~Graph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_ != nullptr) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
}
Graph::Graph(Graph&& o) noexcept : graph_(o.graph_), exec_(o.exec_) {
  o.graph_ = nullptr;
  o.exec_ = nullptr;
}
Graph& Graph::operator=(Graph&& o) noexcept {
  if (this != &o) {
    this->~Graph();
    graph_ = o.graph_;
    exec_ = o.exec_;
    o.graph_ = nullptr;
    o.exec_ = nullptr;
  }
  return *this;
}
void Graph::launch(void* stream) const {
  CUMULUS_CHECK(exec_ != nullptr, "launch of an empty graph");
  CUMULUS_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), as_stream(stream)));
}

Stream::Stream() {
  cudaStream_t s = nullptr;
  CUMULUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  s_ = s;
}
Stream::~Stream() {
  if (s_ != nullptr) cudaStreamDestroy(as_stream(s_));
}
void Stream::synchronize() const { CUMULUS_CUDA_CHECK(cudaStreamSynchronize(as_stream(s_))); }

bool head_dim_supported_cuda(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

void DeviceKvView::validate(const char* fn) const {
  if (n_seqs < 1 || n_kv_heads < 1)
    throw Error(fmt::format("{}: kv.n_seqs={} and kv.n_kv_heads={} must be >= 1", fn, n_seqs, n_kv_heads));
  if (!head_dim_supported_cuda(head_dim))
    throw Error(fmt::format("{}: kv.head_dim={} is not built for the CUDA backend (64, 128, 256)", fn, head_dim));
  if (dtype != DType::f16 && dtype != DType::bf16)
    throw Error(fmt::format("{}: kv.dtype={} is not supported on the GPU (f16, bf16)", fn, dtype_name(dtype)));
  if (page_size < 1 || page_size > 256 || (1 << page_shift) != page_size)
    throw Error(fmt::format("{}: kv.page_size={} must be a power of two in [1, 256] equal to 1 << page_shift={}", fn,
                            page_size, page_shift));
  if (k == nullptr || v == nullptr || page_table == nullptr || n_tokens == nullptr)
    throw Error(fmt::format("{}: kv.k, kv.v, kv.page_table and kv.n_tokens must be non-null", fn));
  if (max_tokens < 0 || max_pages < (max_tokens + page_size - 1) / page_size)
    throw Error(fmt::format("{}: kv.max_pages={} cannot hold kv.max_tokens={}", fn, max_pages, max_tokens));
}

namespace {

// Checks the host views of one batch and returns (head_dim, dtype, page_size).
void check_views(const std::vector<std::vector<PagedHeadView>>& seqs) {
  CUMULUS_CHECK(!seqs.empty() && !seqs[0].empty(), "need at least one sequence with one kv head");
  const PagedHeadView& v0 = seqs[0][0];
  CUMULUS_CHECK(head_dim_supported_cuda(v0.head_dim), "head_dim={} is not built for the CUDA backend (64, 128, 256)",
                v0.head_dim);
  CUMULUS_CHECK(v0.dtype == DType::f16 || v0.dtype == DType::bf16, "dtype={} is not supported on the GPU (f16, bf16)",
                dtype_name(v0.dtype));
  for (size_t s = 0; s < seqs.size(); ++s) {
    CUMULUS_CHECK(seqs[s].size() == seqs[0].size(), "sequence {} has {} kv heads, sequence 0 has {}", s,
                  seqs[s].size(), seqs[0].size());
    for (size_t h = 0; h < seqs[s].size(); ++h) {
      const PagedHeadView& v = seqs[s][h];
      CUMULUS_CHECK(v.head_dim == v0.head_dim && v.dtype == v0.dtype && v.page_size == v0.page_size,
                    "seqs[{}][{}] differs from seqs[0][0] in head_dim, dtype or page_size", s, h);
      CUMULUS_CHECK(v.n_tokens == seqs[s][0].n_tokens, "seqs[{}][{}].n_tokens={} differs from its head 0 ({})", s, h,
                    v.n_tokens, seqs[s][0].n_tokens);
      CUMULUS_CHECK(v.n_tokens == 0 || (v.kmin != nullptr && v.kmax != nullptr && v.kmean != nullptr),
                    "seqs[{}][{}] has no per-page key statistics (kmin, kmax, kmean)", s, h);
    }
  }
}

}  // namespace

DeviceKvCache DeviceKvCache::upload(const std::vector<std::vector<PagedHeadView>>& seqs, uint64_t scramble_seed) {
  check_views(seqs);
  const PagedHeadView& v0 = seqs[0][0];
  const int n_seqs = static_cast<int>(seqs.size());
  const int n_kv = static_cast<int>(seqs[0].size());
  const int d = v0.head_dim;
  int max_tokens = 0;
  for (const auto& s : seqs) max_tokens = std::max(max_tokens, s[0].n_tokens);
  const int max_pages = std::max(1, (max_tokens + v0.page_size - 1) / v0.page_size);
  const size_t n_pool = static_cast<size_t>(n_seqs) * n_kv * max_pages;
  const size_t page_bytes = static_cast<size_t>(v0.page_size) * v0.row_bytes();

  // Pool page of logical page (s, h, p): in order, or a seeded permutation.
  std::vector<int32_t> table(n_pool);
  std::iota(table.begin(), table.end(), 0);
  if (scramble_seed != 0) {
    std::mt19937_64 rng(scramble_seed);
    std::shuffle(table.begin(), table.end(), rng);
  }

  DeviceKvCache c;
  c.k_ = DeviceBuffer(n_pool * page_bytes);
  c.v_ = DeviceBuffer(n_pool * page_bytes);
  const size_t meta_bytes = n_pool * d * sizeof(float);
  c.kmin_ = DeviceBuffer(meta_bytes);
  c.kmax_ = DeviceBuffer(meta_bytes);
  c.kmean_ = DeviceBuffer(meta_bytes);
  // Unscrambled, the pages of one (s, h) are consecutive pool pages: staged on the host
  // and copied at once. Scrambled (tests, small caches), page by page.
  std::vector<char> kst, vst;
  for (int s = 0; s < n_seqs; ++s) {
    for (int h = 0; h < n_kv; ++h) {
      const PagedHeadView& v = seqs[s][h];
      const int n_pages = v.n_pages();
      if (n_pages == 0) continue;
      const size_t first = (static_cast<size_t>(s) * n_kv + h) * max_pages;
      if (scramble_seed == 0) {
        kst.assign(static_cast<size_t>(n_pages) * page_bytes, 0);
        vst.assign(kst.size(), 0);
        for (int p = 0; p < n_pages; ++p) {
          const size_t bytes = static_cast<size_t>(v.page_len(p)) * v.row_bytes();
          std::memcpy(kst.data() + p * page_bytes, v.k_pages[p], bytes);
          std::memcpy(vst.data() + p * page_bytes, v.v_pages[p], bytes);
        }
        c.k_.upload(kst.data(), kst.size(), first * page_bytes);
        c.v_.upload(vst.data(), vst.size(), first * page_bytes);
        const size_t mb = static_cast<size_t>(n_pages) * d * sizeof(float), mo = first * d * sizeof(float);
        c.kmin_.upload(v.kmin, mb, mo);
        c.kmax_.upload(v.kmax, mb, mo);
        c.kmean_.upload(v.kmean, mb, mo);
        continue;
      }
      for (int p = 0; p < n_pages; ++p) {
        const size_t slot = table[first + p];
        const size_t bytes = static_cast<size_t>(v.page_len(p)) * v.row_bytes();
        c.k_.upload(v.k_pages[p], bytes, slot * page_bytes);
        c.v_.upload(v.v_pages[p], bytes, slot * page_bytes);
        c.kmin_.upload(v.kmin + static_cast<size_t>(p) * d, d * sizeof(float), slot * d * sizeof(float));
        c.kmax_.upload(v.kmax + static_cast<size_t>(p) * d, d * sizeof(float), slot * d * sizeof(float));
        c.kmean_.upload(v.kmean + static_cast<size_t>(p) * d, d * sizeof(float), slot * d * sizeof(float));
      }
    }
    c.n_tokens_.push_back(seqs[s][0].n_tokens);
  }
  c.capacity_ = c.n_tokens_;
  c.reserved_.assign(n_seqs, max_pages * v0.page_size);
  c.table_ = to_device(table);
  c.table_host_ = std::move(table);
  c.n_tok_ = to_device(std::vector<int32_t>(c.n_tokens_.begin(), c.n_tokens_.end()));
  c.kv_bytes_ = 2 * n_pool * page_bytes;
  c.bind_view(n_seqs, n_kv, d, v0.page_size, max_pages, max_tokens, v0.dtype);
  return c;
}

void DeviceKvCache::bind_view(int n_seqs, int n_kv_heads, int head_dim, int page_size, int max_pages, int max_tokens,
                              DType dtype) {
  DeviceKvView& w = view_;
  w.k = k_.data();
  w.v = v_.data();
  w.kmin = kmin_.as<float>();
  w.kmax = kmax_.as<float>();
  w.kmean = kmean_.as<float>();
  w.page_table = table_.as<int32_t>();
  w.n_tokens = n_tok_.as<int32_t>();
  w.n_seqs = n_seqs;
  w.n_kv_heads = n_kv_heads;
  w.head_dim = head_dim;
  w.page_size = page_size;
  w.page_shift = __builtin_ctz(static_cast<unsigned>(page_size));
  w.max_pages = max_pages;
  w.max_tokens = max_tokens;
  w.dtype = dtype;
}

DeviceKvCache DeviceKvCache::upload_replicated(const std::vector<PagedHeadView>& seq, int n_copies) {
  CUMULUS_CHECK(n_copies >= 1, "n_copies={} must be >= 1", n_copies);
  // Upload one copy page by page into a contiguous block, then copy that block on the
  // device: sequence s occupies pool pages [s * n_kv * max_pages, (s + 1) * n_kv * max_pages).
  DeviceKvCache one = upload({seq});
  DeviceKvCache c;
  const DeviceKvView& w1 = one.view_;
  const size_t per_seq_pages = static_cast<size_t>(w1.n_kv_heads) * w1.max_pages;
  const size_t page_bytes = static_cast<size_t>(w1.page_size) * w1.head_dim * dtype_size(w1.dtype);
  const size_t kv_seq = per_seq_pages * page_bytes, meta_seq = per_seq_pages * w1.head_dim * sizeof(float);
  c.k_ = DeviceBuffer(kv_seq * n_copies);
  c.v_ = DeviceBuffer(kv_seq * n_copies);
  c.kmin_ = DeviceBuffer(meta_seq * n_copies);
  c.kmax_ = DeviceBuffer(meta_seq * n_copies);
  c.kmean_ = DeviceBuffer(meta_seq * n_copies);
  for (int s = 0; s < n_copies; ++s) {
    CUMULUS_CUDA_CHECK(cudaMemcpy(c.k_.as<char>() + s * kv_seq, one.k_.data(), kv_seq, cudaMemcpyDeviceToDevice));
    CUMULUS_CUDA_CHECK(cudaMemcpy(c.v_.as<char>() + s * kv_seq, one.v_.data(), kv_seq, cudaMemcpyDeviceToDevice));
    CUMULUS_CUDA_CHECK(
        cudaMemcpy(c.kmin_.as<char>() + s * meta_seq, one.kmin_.data(), meta_seq, cudaMemcpyDeviceToDevice));
    CUMULUS_CUDA_CHECK(
        cudaMemcpy(c.kmax_.as<char>() + s * meta_seq, one.kmax_.data(), meta_seq, cudaMemcpyDeviceToDevice));
    CUMULUS_CUDA_CHECK(
        cudaMemcpy(c.kmean_.as<char>() + s * meta_seq, one.kmean_.data(), meta_seq, cudaMemcpyDeviceToDevice));
  }
  CUMULUS_CUDA_CHECK(cudaDeviceSynchronize());  // device-to-device copies return early
  std::vector<int32_t> table(per_seq_pages * n_copies);
  std::iota(table.begin(), table.end(), 0);
  c.table_ = to_device(table);
  c.n_tokens_.assign(n_copies, one.n_tokens_[0]);
  c.capacity_ = c.n_tokens_;
  c.reserved_.assign(n_copies, w1.max_pages * w1.page_size);
  c.table_host_ = std::move(table);
  c.n_tok_ = to_device(std::vector<int32_t>(c.n_tokens_.begin(), c.n_tokens_.end()));
  c.kv_bytes_ = 2 * kv_seq * n_copies;
  c.view_ = w1;
  DeviceKvView& w = c.view_;
  w.k = c.k_.data();
  w.v = c.v_.data();
  w.kmin = c.kmin_.as<float>();
  w.kmax = c.kmax_.as<float>();
  w.kmean = c.kmean_.as<float>();
  w.page_table = c.table_.as<int32_t>();
  w.n_tokens = c.n_tok_.as<int32_t>();
  w.n_seqs = n_copies;
  return c;
}

void DeviceKvCache::set_n_tokens(const std::vector<int>& n) {
  CUMULUS_CHECK(n.size() == capacity_.size(), "n.size()={} must equal n_seqs={}", n.size(), capacity_.size());
  for (size_t s = 0; s < n.size(); ++s)
    CUMULUS_CHECK(n[s] >= 0 && n[s] <= capacity_[s], "n[{}]={} out of range [0, {}] (tokens uploaded)", s, n[s],
                  capacity_[s]);
  n_tokens_ = n;
  n_tok_.upload(std::vector<int32_t>(n.begin(), n.end()).data(), n.size() * sizeof(int32_t));
}

}  // namespace cumulus::cuda
