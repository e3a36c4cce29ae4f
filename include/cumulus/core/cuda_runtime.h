// The CUDA runtime every CUDA library of cumulus stands on (src/core/cuda, library
// cumulus_core_cuda; docs/cuda.md): device queries, owning device buffers, streams, events
// and graphs, and DeviceKvView, the plain description of one layer of paged K/V on the
// device through which the device cache (kv/cuda_kv_cache.h) hands its pages to the kernels
// (kernels/cuda.h), as PagedHeadView does on the host. Plain C++: this header includes no
// CUDA header; device memory is owned by DeviceBuffer and handed on as plain pointers, a
// stream is an opaque handle (a cudaStream_t as void*, nullptr = the default stream). Every
// CUDA call is checked: a failure throws cumulus::Error naming the call, the file and the
// line. Built only with CUMULUS_CUDA=ON.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"

namespace cumulus::cuda {

// ---- runtime ----------------------------------------------------------------------------

// True when a CUDA device can be used (never throws; false without a driver or device).
bool device_available() noexcept;

struct DeviceInfo {
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t memory_bytes = 0;
  size_t l2_bytes = 0;
  int driver_version = 0, runtime_version = 0;
};
DeviceInfo device_info();

// Bytes of device memory free now (cudaMemGetInfo).
size_t device_free_bytes();

// Waits for all work on the device.
void device_synchronize();

// Synchronous copies between host memory and device memory (device_* are device pointers).
void memcpy_to_host(void* dst, const void* device_src, size_t bytes);
void memcpy_to_device(void* device_dst, const void* src, size_t bytes);

// What a failed device allocation throws: an Error (callers that need not tell it apart
// catch Error), so that a caller can answer "does not fit" to exactly that failure.
class DeviceMemoryError : public Error {
 public:
  using Error::Error;
};

// Owning device allocation (cudaMalloc), move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  // Synchronous (the device is done when they return, whatever stream runs next); offset
  // and bytes are checked against size().
  void upload(const void* src, size_t bytes, size_t offset = 0);
  void download(void* dst, size_t bytes, size_t offset = 0) const;
  void fill_bytes(int value);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <class T>
DeviceBuffer to_device(const std::vector<T>& v) {
  DeviceBuffer b(v.size() * sizeof(T));
  if (!v.empty()) b.upload(v.data(), v.size() * sizeof(T));
  return b;
}
template <class T>
std::vector<T> to_host(const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  if (n > 0) b.download(v.data(), n * sizeof(T));
  return v;
}

// A created stream (cudaStreamNonBlocking); neither copied nor moved.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* handle() const { return s_; }
  void synchronize() const;

 private:
  void* s_ = nullptr;
};

// An event for ordering work across streams (no timing): after record(a), work enqueued on
// stream b after wait(b) starts only when a's work before the record is done. Neither
// copied nor moved.
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(void* stream = nullptr);
  void wait(void* stream = nullptr) const;

 private:
  void* e_ = nullptr;
};

// Asynchronous fill and device-to-device copy on a stream (benchmarks: cache flushes and
// the copy-bandwidth reference).
void memset_async(void* device_dst, int value, size_t bytes, void* stream = nullptr);
void memcpy_device_async(void* device_dst, const void* device_src, size_t bytes, void* stream = nullptr);

// The median bandwidth (GB/s, 1e9 bytes per second) of `reps` copies of `bytes` from pinned
// host memory to the device, after one more that warms up: the PCIe reference of the host
// tier's benchmarks (kv/cuda_kv_pool.h).
double host_to_device_gbps(size_t bytes, int reps = 5);

// A pair of CUDA events around work on a stream; elapsed_ms() waits for the stop event.
class EventTimer {
 public:
  EventTimer();
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start(void* stream = nullptr);
  void stop(void* stream = nullptr);
  float elapsed_ms() const;

 private:
  void* a_ = nullptr;
  void* b_ = nullptr;
};

// Work captured from a stream (which must not be the legacy default stream) and replayed
// as one CUDA graph: how a serving loop launches a decode step without per-kernel gaps.
class Graph {
 public:
  // Captures everything `fn` enqueues on `stream`.
  template <class Fn>
  static Graph capture(void* stream, Fn&& fn) {
    Graph g;
    g.begin(stream);
    fn();
    g.end(stream);
    return g;
  }
  Graph() = default;
  ~Graph();
  Graph(Graph&& o) noexcept;
  Graph& operator=(Graph&& o) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void launch(void* stream) const;

 private:
  void begin(void* stream);
  void end(void* stream);
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};

// ---- paged KV on the device, as the kernels read it ---------------------------------------

// One layer of a batch of paged caches on the device (device pointers; plain data).
//   k, v:              [n_pool_pages][page_size][head_dim] in dtype (f16 or bf16)
//   kmin, kmax, kmean: [n_pool_pages][head_dim] float32 per-page key statistics
//   page_table:        [n_seqs][n_kv_heads][max_pages] pool page of each logical page
//   n_tokens:          [n_seqs] tokens cached per sequence (every kv head holds them all)
// max_tokens is a host-side bound of n_tokens (grids and scratch are sized from it).
struct DeviceKvView {
  const void* k = nullptr;
  const void* v = nullptr;
  const float* kmin = nullptr;
  const float* kmax = nullptr;
  const float* kmean = nullptr;
  const int32_t* page_table = nullptr;
  const int32_t* n_tokens = nullptr;
  int n_seqs = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int page_size = 16;
  int page_shift = 4;
  int max_pages = 0;
  int max_tokens = 0;
  DType dtype = DType::f16;

  // Throws Error naming the first bad field (null pointer, unsupported head_dim or dtype).
  void validate(const char* fn) const;
};

// Head dims the CUDA decode kernels are built for: 64, 128 and 256 (the prefill kernels:
// 64 and 128, checked by the functions of cuda_prefill.h).
bool head_dim_supported_cuda(int head_dim);

}  // namespace cumulus::cuda
