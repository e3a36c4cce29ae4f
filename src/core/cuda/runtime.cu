// The CUDA runtime (core/cuda_runtime.h): error reporting, device queries, owning buffers,
// streams, events and graphs, and the checks of a DeviceKvView.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "core/check.h"
#include "core/cuda/cuda_util.cuh"
#include "cumulus/core/cuda_runtime.h"

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

size_t device_free_bytes() {
  size_t free_b = 0, total_b = 0;
  CUMULUS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return free_b;
}

double host_to_device_gbps(size_t bytes, int reps) {
  CUMULUS_CHECK(bytes > 0 && reps >= 1, "host_to_device_gbps: bytes={} and reps={} must be >= 1", bytes, reps);
  void* host = nullptr;
  CUMULUS_CUDA_CHECK(cudaMallocHost(&host, bytes));
  std::memset(host, 1, bytes);
  double best = 0;
  try {
    DeviceBuffer dst(bytes);
    EventTimer t;
    std::vector<double> gbps;
    for (int r = 0; r < reps + 1; ++r) {  // the first copy warms up
      t.start();
      CUMULUS_CUDA_CHECK(cudaMemcpyAsync(dst.data(), host, bytes, cudaMemcpyHostToDevice, nullptr));
      t.stop();
      if (r > 0) gbps.push_back(static_cast<double>(bytes) / (1e6 * t.elapsed_ms()));
    }
    std::sort(gbps.begin(), gbps.end());
    best = gbps[gbps.size() / 2];
  } catch (...) {
    cudaFreeHost(host);
    throw;
  }
  cudaFreeHost(host);
  return best;
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

Event::Event() {
  cudaEvent_t e = nullptr;
  CUMULUS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  e_ = e;
}
Event::~Event() {
  if (e_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(e_));
}
void Event::record(void* stream) { CUMULUS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e_), as_stream(stream))); }
void Event::wait(void* stream) const {
  CUMULUS_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(e_), 0));
}

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

}  // namespace cumulus::cuda
