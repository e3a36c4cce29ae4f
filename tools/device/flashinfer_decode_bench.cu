// FlashInfer's paged batch decode, both of its kernels for a decode step: the CUDA-core one
// (`BatchDecodeWithPagedKVCache`, the wrapper's default) and the tensor-core one its docs advise
// for GQA (`use_tensor_cores=True`: the FA2 `BatchPrefillWithPagedKVCache` kernel with one query
// row per sequence), timed
// the way bench/cuda_decode_bench.cpp and tools/device/torch_sdpa_bench.py time ours and
// PyTorch's: one CUDA graph of the call, each replay preceded (outside the events) by a 256 MiB
// fill that evicts the L2, the median of --iters replays.
//
// Not part of the build: FlashInfer ships as a JIT package (flashinfer-python on PyPI) whose
// kernels are header-only C++ templates. tools/device/build_flashinfer_bench.sh downloads the
// wheel, takes its include/ and compiles this file against it, instantiating the kernel the
// package's JIT would (batch_decode_customize_config.jinja and
// batch_prefill_customize_config.jinja: the same Params structs, DefaultAttention<false, false,
// false, false>, no RoPE, the plan with use_cuda_graph). Nothing of FlashInfer is in the
// repository.
//
// Workload: q [B][Hq][D] and the paged K/V in FlashInfer's HND layout ([page][Hkv][page_size][D],
// f16), pages of every sequence in order (the friendliest placement), random values in [-1, 1).
// The output of the first sequence is checked against float64 attention on the host at the
// smallest context; the program exits non-zero if it is off.
//
// Usage: flashinfer_decode_bench [--contexts 8192,32768,131072] [--batches 1,4,16]
//          [--shape 32,8,128] [--page-size 16] [--iters 30] [--warmup 5] [--json PATH]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/page.cuh>

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "flashinfer_decode_bench: %s failed at %s:%d: %s\n", #x, __FILE__,    \
                   __LINE__, cudaGetErrorString(e_));                                             \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

using namespace flashinfer;
using DTypeQ = half;
using DTypeKV = half;
using DTypeO = half;
using IdType = int32_t;

// The Params struct of FlashInfer's JIT decode module (batch_decode_customize_config.jinja with
// the additional parameters of gen_batch_decode_module).
struct Params {
  using DTypeQ = ::DTypeQ;
  using DTypeKV = ::DTypeKV;
  using DTypeO = ::DTypeO;
  using IdType = ::IdType;
  DTypeQ* q;
  paged_kv_t<DTypeKV, IdType> paged_kv;
  DTypeO* o;
  float* lse;
  float* maybe_alibi_slopes;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;
  uint32_t padded_batch_size;
  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  int32_t window_left;
  bool enable_pdl;
  IdType* request_indices;
  IdType* kv_tile_indices;
  IdType* o_indptr;
  IdType* kv_chunk_size_ptr;
  bool* block_valid_mask;
  bool partition_kv;
  __host__ __device__ __forceinline__ int32_t get_qo_len(int32_t) const { return 1; }
  __host__ __device__ __forceinline__ int32_t get_kv_len(int32_t b) const { return paged_kv.get_length(b); }
};
using Variant = DefaultAttention<false, false, false, false>;

// The PagedParams struct of FlashInfer's JIT FA2 batch prefill module (the additional
// parameters of _gen_batch_prefill_module for fa2).
struct PagedParams {
  using DTypeQ = ::DTypeQ;
  using DTypeKV = ::DTypeKV;
  using DTypeO = ::DTypeO;
  using IdType = ::IdType;
  DTypeQ* q;
  paged_kv_t<DTypeKV, IdType> paged_kv;
  IdType* q_indptr;
  DTypeO* o;
  float* lse;
  uint_fastdiv group_size;
  uint8_t* maybe_custom_mask;
  int32_t* maybe_mask_indptr;
  float* maybe_alibi_slopes;
  uint32_t* maybe_prefix_len_ptr;
  uint16_t* maybe_token_pos_in_items_ptr;
  uint16_t* maybe_max_item_len_ptr;
  uint8_t* maybe_k_cache_sf;
  uint8_t* maybe_v_cache_sf;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;
  int64_t token_pos_in_items_len;
  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  uint32_t k_sf_stride_page;
  uint32_t k_sf_stride_n;
  uint32_t k_sf_stride_h;
  uint32_t v_sf_stride_page;
  uint32_t v_sf_stride_n;
  uint32_t v_sf_stride_h;
  int32_t window_left;
  IdType* request_indices;
  IdType* qo_tile_indices;
  IdType* kv_tile_indices;
  IdType* merge_indptr;
  IdType* o_indptr;
  bool* block_valid_mask;
  IdType* kv_chunk_size_ptr;
  uint32_t max_total_num_rows;
  uint32_t* total_num_rows;
  uint32_t padded_batch_size;
  bool partition_kv;
  __host__ __device__ __forceinline__ uint32_t get_qo_len(uint32_t b) const { return q_indptr[b + 1] - q_indptr[b]; }
  __host__ __device__ __forceinline__ uint32_t get_kv_len(uint32_t b) const { return paged_kv.get_length(b); }
};

namespace fibench {

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    const std::string item = s.substr(i, j - i);
    char* end = nullptr;
    const long x = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || x <= 0 || x > (1 << 24)) {
      std::fprintf(stderr, "flashinfer_decode_bench: '%s' in '%s' is not a positive integer\n", item.c_str(),
                   s.c_str());
      std::exit(2);
    }
    v.push_back(static_cast<int>(x));
    i = j + 1;
  }
  return v;
}

__global__ void fill_random(half* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2half((h & 0xffffff) / 8388608.0f - 1.0f);
  }
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

template <uint32_t D, uint32_t G>
struct Case {
  static void run(bool tc, int ctx, int batch, int hq, int hkv, int page, int iters, int warmup, void* flush,
                  size_t flush_bytes, bool check, FILE* js, bool& first_json, int& failures) {
    const int pages_per_seq = (ctx + page - 1) / page;
    const size_t n_pages = static_cast<size_t>(pages_per_seq) * batch;
    const size_t kv_elems = n_pages * hkv * page * D;
    half *k, *v, *q, *o;
    float* lse;
    CK(cudaMalloc(&k, kv_elems * sizeof(half)));
    CK(cudaMalloc(&v, kv_elems * sizeof(half)));
    CK(cudaMalloc(&q, static_cast<size_t>(batch) * hq * D * sizeof(half)));
    CK(cudaMalloc(&o, static_cast<size_t>(batch) * hq * D * sizeof(half)));
    CK(cudaMalloc(&lse, static_cast<size_t>(batch) * hq * sizeof(float)));
    fill_random<<<1024, 256>>>(k, kv_elems, 1u);
    fill_random<<<1024, 256>>>(v, kv_elems, 2u);
    fill_random<<<64, 256>>>(q, static_cast<size_t>(batch) * hq * D, 3u);
    std::vector<IdType> indptr(batch + 1), indices(n_pages), last(batch);
    for (int b = 0; b <= batch; ++b) indptr[b] = b * pages_per_seq;
    for (size_t i = 0; i < n_pages; ++i) indices[i] = static_cast<IdType>(i);
    for (int b = 0; b < batch; ++b) last[b] = ctx - (pages_per_seq - 1) * page;
    IdType *d_indptr, *d_indices, *d_last;
    CK(cudaMalloc(&d_indptr, indptr.size() * sizeof(IdType)));
    CK(cudaMalloc(&d_indices, indices.size() * sizeof(IdType)));
    CK(cudaMalloc(&d_last, last.size() * sizeof(IdType)));
    CK(cudaMemcpy(d_indptr, indptr.data(), indptr.size() * sizeof(IdType), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_indices, indices.data(), indices.size() * sizeof(IdType), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_last, last.data(), last.size() * sizeof(IdType), cudaMemcpyHostToDevice));

    // The plan, as flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan() makes it with
    // use_cuda_graph=True: workspaces of 128 MiB (float) and 8 MiB (int), as its docs advise.
    const size_t float_ws = size_t{128} << 20, int_ws = size_t{8} << 20;
    void *fbuf, *ibuf, *ibuf_h;
    CK(cudaMalloc(&fbuf, float_ws));
    CK(cudaMalloc(&ibuf, int_ws));
    CK(cudaMallocHost(&ibuf_h, int_ws));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    bool split_kv = false;
    std::function<void()> call;
    Params p{};
    PagedParams pp{};
    std::vector<IdType> qo_indptr(batch + 1);
    for (int b = 0; b <= batch; ++b) qo_indptr[b] = b;
    IdType* d_qo_indptr;
    CK(cudaMalloc(&d_qo_indptr, qo_indptr.size() * sizeof(IdType)));
    CK(cudaMemcpy(d_qo_indptr, qo_indptr.data(), qo_indptr.size() * sizeof(IdType), cudaMemcpyHostToDevice));
    auto* base_i = static_cast<char*>(ibuf);
    auto* base_f = static_cast<char*>(fbuf);
    const paged_kv_t<DTypeKV, IdType> kv(hkv, page, D, batch, QKVLayout::kHND, k, v, d_indices, d_indptr, d_last);
    auto set_common = [&](auto& x) {  // the fields both kernels' parameter structs share
      x.q = q;
      x.paged_kv = kv;
      x.o = o;
      x.lse = lse;
      x.sm_scale = 1.0 / std::sqrt(static_cast<double>(D));
      x.rope_rcp_scale = 1.0;
      x.rope_rcp_theta = 1.0 / 1e4;
      x.num_qo_heads = hq;
      x.q_stride_n = hq * D;
      x.q_stride_h = D;
      x.window_left = -1;
    };
    if (!tc) {
      DecodePlanInfo info;
      auto est = BatchDecodeWithPagedKVCacheWorkEstimationDispatched<G, D, PosEncodingMode::kNone, Variant, Params>;
      CK((DecodePlan<D, PosEncodingMode::kNone, Variant, Params>(fbuf, float_ws, ibuf, ibuf_h, int_ws, info,
                                                                  indptr.data(), batch, hq, page, true, st, est)));
      set_common(p);
      p.request_indices = reinterpret_cast<IdType*>(base_i + info.request_indices_offset);
      p.kv_tile_indices = reinterpret_cast<IdType*>(base_i + info.kv_tile_indices_offset);
      p.o_indptr = reinterpret_cast<IdType*>(base_i + info.o_indptr_offset);
      p.kv_chunk_size_ptr = reinterpret_cast<IdType*>(base_i + info.kv_chunk_size_ptr_offset);
      DTypeO* tmp_v = nullptr;
      float* tmp_s = nullptr;
      if (info.split_kv) {
        tmp_v = reinterpret_cast<DTypeO*>(base_f + info.v_offset);
        tmp_s = reinterpret_cast<float*>(base_f + info.s_offset);
        if (info.enable_cuda_graph) p.block_valid_mask = reinterpret_cast<bool*>(base_i + info.block_valid_mask_offset);
      }
      p.padded_batch_size = info.padded_batch_size;
      split_kv = info.split_kv;
      call = [&p, tmp_v, tmp_s, st] {
        CK((BatchDecodeWithPagedKVCacheDispatched<D, PosEncodingMode::kNone, Variant, Params>(p, tmp_v, tmp_s, false,
                                                                                             st)));
      };
    } else {
      // As BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True).plan() calls the prefill
      // planner: one query row per sequence, no fixed split, split-KV allowed.
      PrefillPlanInfo info;
      CK((PrefillPlan<IdType>(fbuf, float_ws, ibuf, ibuf_h, int_ws, info, qo_indptr.data(), indptr.data(), batch,
                              batch, hq, hkv, D, D, page, true, sizeof(DTypeO), -1, -1, false, 0, 0, st,
                              sizeof(DTypeKV))));
      set_common(pp);
      pp.q_indptr = d_qo_indptr;
      pp.group_size = uint_fastdiv(hq / hkv);
      pp.request_indices = reinterpret_cast<IdType*>(base_i + info.request_indices_offset);
      pp.qo_tile_indices = reinterpret_cast<IdType*>(base_i + info.qo_tile_indices_offset);
      pp.kv_tile_indices = reinterpret_cast<IdType*>(base_i + info.kv_tile_indices_offset);
      pp.o_indptr = reinterpret_cast<IdType*>(base_i + info.o_indptr_offset);
      pp.kv_chunk_size_ptr = reinterpret_cast<IdType*>(base_i + info.kv_chunk_size_ptr_offset);
      DTypeO* tmp_v = nullptr;
      float* tmp_s = nullptr;
      if (info.split_kv) {
        pp.merge_indptr = reinterpret_cast<IdType*>(base_i + info.merge_indptr_offset);
        tmp_v = reinterpret_cast<DTypeO*>(base_f + info.v_offset);
        tmp_s = reinterpret_cast<float*>(base_f + info.s_offset);
      }
      pp.padded_batch_size = info.padded_batch_size;
      pp.max_total_num_rows = info.total_num_rows;
      if (info.enable_cuda_graph) {
        pp.block_valid_mask = reinterpret_cast<bool*>(base_i + info.block_valid_mask_offset);
        pp.total_num_rows = reinterpret_cast<uint32_t*>(base_i + info.total_num_rows_offset);
      }
      split_kv = info.split_kv;
      const int64_t cta_tile_q = info.cta_tile_q;
      call = [&pp, tmp_v, tmp_s, st, cta_tile_q] {
        cudaError_t status = cudaErrorInvalidValue;
        DISPATCH_CTA_TILE_Q(cta_tile_q, CTA_TILE_Q, {
          status = BatchPrefillWithPagedKVCacheDispatched<true, CTA_TILE_Q, D, D, PosEncodingMode::kNone, false,
                                                          MaskMode::kNone, Variant, PagedParams>(pp, tmp_v, tmp_s,
                                                                                                 false, st);
        });
        CK(status);
      };
    }
    CK(cudaStreamSynchronize(st));
    for (int i = 0; i < 3; ++i) call();
    CK(cudaStreamSynchronize(st));

    double max_err = -1;
    if (check) {  // sequence 0, every query head, against float64 on the host
      std::vector<half> hk(static_cast<size_t>(pages_per_seq) * hkv * page * D), hv(hk.size()),
          hq_(static_cast<size_t>(hq) * D), ho(hq_.size());
      CK(cudaMemcpy(hk.data(), k, hk.size() * sizeof(half), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hv.data(), v, hv.size() * sizeof(half), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hq_.data(), q, hq_.size() * sizeof(half), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ho.data(), o, ho.size() * sizeof(half), cudaMemcpyDeviceToHost));
      max_err = 0;
      std::vector<double> s(ctx);
      for (int h = 0; h < hq; ++h) {
        const int kh = h / (hq / hkv);
        auto row = [&](const std::vector<half>& x, int t) {
          return &x[((static_cast<size_t>(t / page) * hkv + kh) * page + t % page) * D];
        };
        double mx = -1e300;
        for (int t = 0; t < ctx; ++t) {
          double acc = 0;
          const half* kr = row(hk, t);
          for (uint32_t e = 0; e < D; ++e) acc += static_cast<double>(__half2float(hq_[h * D + e])) * __half2float(kr[e]);
          s[t] = acc / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, s[t]);
        }
        double sum = 0;
        for (int t = 0; t < ctx; ++t) sum += (s[t] = std::exp(s[t] - mx));
        for (uint32_t e = 0; e < D; ++e) {
          double acc = 0;
          for (int t = 0; t < ctx; ++t) acc += s[t] * __half2float(row(hv, t)[e]);
          max_err = std::max(max_err, std::abs(acc / sum - __half2float(ho[h * D + e])));
        }
      }
      if (!(max_err < 2e-3)) {
        std::fprintf(stderr, "flashinfer_decode_bench: ctx %d batch %d: max |out - float64| = %.3g\n", ctx, batch,
                     max_err);
        ++failures;
      }
    }

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    call();
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < warmup; ++i) CK(cudaGraphLaunch(exec, st));
    std::vector<double> us;
    for (int i = 0; i < iters; ++i) {
      CK(cudaMemsetAsync(flush, i & 0xff, flush_bytes, st));
      CK(cudaEventRecord(e0, st));
      CK(cudaGraphLaunch(exec, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(1e3 * ms);
    }
    const double med = median(us);
    const double bytes = 2.0 * static_cast<double>(batch) * ctx * hkv * D * sizeof(half);
    std::printf("%-8s %8d %6d %10.1f %10.1f %6s %10.3g\n", tc ? "tc" : "cuda", ctx, batch, med, bytes / (med * 1e-6) / 1e9,
                split_kv ? "yes" : "no", max_err);
    std::fflush(stdout);
    std::fprintf(js, "%s    {\"kernel\": \"%s\", \"context\": %d, \"batch\": %d, \"us_median\": %.3f, \"kv_bytes\": %.0f, \"split_kv\": %s, "
                     "\"max_err_vs_f64\": %.6g, \"us_samples\": [",
                 first_json ? "" : ",\n", tc ? "tensor_cores" : "cuda_cores", ctx, batch, med, bytes, split_kv ? "true" : "false", max_err);
    for (size_t i = 0; i < us.size(); ++i) std::fprintf(js, "%s%.3f", i ? ", " : "", us[i]);
    std::fprintf(js, "]}");
    first_json = false;
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaStreamDestroy(st));
    CK(cudaFreeHost(ibuf_h));
    for (void* x : {static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(q), static_cast<void*>(o),
                    static_cast<void*>(lse), fbuf, ibuf, static_cast<void*>(d_indptr), static_cast<void*>(d_indices),
                    static_cast<void*>(d_last), static_cast<void*>(d_qo_indptr)})
      CK(cudaFree(x));
  }
};

double copy_bandwidth(int iters) {
  const size_t bytes = size_t{1} << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> gbps;
  for (int i = 0; i < iters + 3; ++i) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) gbps.push_back(2.0 * bytes / (ms * 1e-3) / 1e9);
  }
  CK(cudaFree(a));
  CK(cudaFree(b));
  return median(gbps);
}

}  // namespace fibench

using namespace fibench;

int main(int argc, char** argv) {
  std::vector<int> contexts{8192, 32768, 131072}, batches{1, 4, 16}, shape{32, 8, 128};
  int page = 16, iters = 30, warmup = 5;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "flashinfer_decode_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--contexts") contexts = parse_list(next());
    else if (a == "--batches") batches = parse_list(next());
    else if (a == "--shape") shape = parse_list(next());
    else if (a == "--page-size") page = parse_list(next()).at(0);
    else if (a == "--iters") iters = parse_list(next()).at(0);
    else if (a == "--warmup") warmup = parse_list(next()).at(0);
    else if (a == "--json") json_path = next();
    else {
      std::fprintf(stderr, "flashinfer_decode_bench: unknown option '%s'\n", a.c_str());
      return 2;
    }
  }
  if (shape.size() != 3 || shape[0] % shape[1] != 0) {
    std::fprintf(stderr, "flashinfer_decode_bench: --shape must be QUERY_HEADS,KV_HEADS,HEAD_DIM with KV_HEADS "
                         "dividing QUERY_HEADS\n");
    return 2;
  }
  const int hq = shape[0], hkv = shape[1], d = shape[2], g = hq / hkv;
  using Fn = void (*)(bool, int, int, int, int, int, int, int, void*, size_t, bool, FILE*, bool&, int&);
  Fn fn = nullptr;
  if (d == 128 && g == 4) fn = Case<128, 4>::run;
  else if (d == 64 && g == 3) fn = Case<64, 3>::run;
  else if (d == 256 && g == 4) fn = Case<256, 4>::run;
  if (fn == nullptr) {
    std::fprintf(stderr, "flashinfer_decode_bench: shape %d,%d,%d is not instantiated (32,8,128; 9,3,64; 4,1,256)\n",
                 hq, hkv, d);
    return 2;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  const double bw = copy_bandwidth(10);
  std::printf("flashinfer_decode_bench: %s, %d SMs, copy bandwidth %.0f GB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, bw);
  std::printf("FlashInfer paged decode, f16, shape %d/%d/%d, page %d, HND; kernel cuda = BatchDecodeWithPagedKVCache "
              "(CUDA cores), tc = BatchPrefillWithPagedKVCache (FA2, tensor cores)\n",
              hq, hkv, d, page);
  std::printf("%-8s %8s %6s %10s %10s %6s %10s\n", "kernel", "context", "batch", "us", "GB/s", "split", "err_f64");
  const size_t flush_bytes = size_t{256} << 20;
  void* flush;
  CK(cudaMalloc(&flush, flush_bytes));
  FILE* js = std::tmpfile();
  bool first = true;
  int failures = 0;
  const int check_ctx = *std::min_element(contexts.begin(), contexts.end());
  for (int ctx : contexts)
    for (int b : batches)
      for (bool tc : {false, true})
        fn(tc, ctx, b, hq, hkv, page, iters, warmup, flush, flush_bytes, ctx == check_ctx && b == batches.front(), js,
           first, failures);
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << "{\"device\": \"" << prop.name << "\", \"copy_gbps\": " << bw << ", \"shape\": [" << hq << ", " << hkv << ", "
      << d << "], \"page_size\": " << page << ", \"iters\": " << iters << ", \"flush_bytes\": " << flush_bytes
      << ", \"rows\": [\n";
    std::rewind(js);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, js)) > 0) f.write(buf, static_cast<std::streamsize>(n));
    f << "\n]}\n";
  }
  CK(cudaFree(flush));
  if (failures) std::fprintf(stderr, "flashinfer_decode_bench: %d output check(s) failed\n", failures);
  return failures ? 1 : 0;
}
