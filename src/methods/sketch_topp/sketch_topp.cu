// sketch_topp on the GPU (ours; the CPU method is src/methods/sketch_topp/sketch_topp.cpp,
// docs/methods.md "sketch_topp" gives the equations, docs/cuda.md "sketch_topp on the GPU"
// the design and the measurements). Per (sequence, kv head) a 4-bit sketch of every key in
// kernels/sketch.h's layout, built at prefill by the CPU's encoder (same operations in the
// same order, so the same codes, offsets and steps bit for bit). A decode step, all on the
// device, no host synchronisation (graph-capturable):
//   1. weights pass (one launch, many CTAs per list): the group's queries quantised to int8
//      as key_sketch_quantize_query does, every token's estimate s_jt = scale est_jt from
//      the codes (int8 mma on the nibbles), written as 16-bit fixed point below the largest of
//      its 64-token group (s = m64 + q / 1024, q in [-32767, 0]: 2^-11 at most off, a weight
//      within 0.05%; anything e^-32 below its group's largest weighs nothing here) with the
//      groups' maxima, and per CTA the flash-decoding partials (max, sum of exp) per query
//      head from the exact estimates. Tokens appended since the last step are encoded
//      first, by the CTA that owns them.
//   2. histogram pass (one launch): the partials merged (M_j, S_j), each token's key
//      max_j exp(s_jt - M_j) / S_j (2 for the sinks and recent tokens) placed in its
//      threshold bin c(t) = min{m : key >= kmax 2^(-m/64)} (m <= 2048; 2049 below), the
//      weights summed per bin and query head in 2^-31 fixed point (exact and
//      deterministic: shared-memory 32-bit atomics, then the CTAs' bins merged with global
//      64-bit atomics that each carry two 32-bit sums). The list's last
//      CTA (ticket) scans the bins: the first m where every head reaches candidate_p of
//      its total is the CPU's threshold (select_mass_threshold: kmax 2^-m/64, at least one
//      step below kmax; every token when no bin suffices), the cost rule (union above
//      dense_above of the tokens: dense), the union's weight per head for the claims.
//   3. marks (one launch): bitmap words c(t) <= m and per-tile counts; 4. the compaction's
//      emit pass (sparse_decoder's bitmap_emit) into sorted per-kv-head lists.
// Then the shared sparse attention kernel, and the claims from its log-sum-exp:
//   claim_j = A_j / (A_j + T_j - U_j),  A_j = exp(lse_j - M_j) / S_j  (normalised units);
// with rest_mean (the CPU's rest=mean) the same kernel mixes the mean value row of the
// list's tokens into the output, o_j = w o_j + (1 - w) vsum / n with w = A_j / (A_j + T_j - U_j)
// (the value sums in float64: all tokens at prefill, the appended ones at each step).
// Deviation from the CPU (docs/cuda.md): no rounds; a head whose claim falls short of p
// keeps its union.
//
// Files: sketch_topp_params.cuh (constants, SketchParams), sketch_topp_kernels.cuh (the
// device code), this file (the decoder, the download for tests, the registry attachment).
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "cumulus/methods/cuda_methods.h"
#include "methods/sketch_topp/sketch_topp_kernels.cuh"

namespace cumulus::cuda {
namespace {

template <class F>
void with_group(int g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

class SketchToppGpu final : public SparseDecoder {
 public:
  SketchToppGpu(const DeviceKvView& kv, int group, const SketchToppGpuOptions& o, const AttentionPlanOptions& po)
      : SparseDecoder(kv, group, po), o_(o) {
    base().phase_times = [this](void* stream) { return phase_times(stream); };
    CUMULUS_CHECK(o.p > 0 && o.p <= 1, "sketch_topp: p={} must be in (0, 1]", o.p);
    CUMULUS_CHECK(o.candidate_p > 0 && o.candidate_p <= 1, "sketch_topp: candidate_p={} must be in (0, 1]",
                  o.candidate_p);
    CUMULUS_CHECK(o.sinks >= 0 && o.recent >= 0 && o.min_context >= 0,
                  "sketch_topp: sinks={}, recent={} and min_context={} must be >= 0", o.sinks, o.recent,
                  o.min_context);
    CUMULUS_CHECK(o.dense_above >= 0 && o.dense_above <= 1, "sketch_topp: dense_above={} must be in [0, 1]",
                  o.dense_above);
    CUMULUS_CHECK(group >= 1 && group <= kMaxGroup, "sketch_topp: group={} must be in [1, {}] on the GPU", group,
                  kMaxGroup);
    CUMULUS_CHECK(o.weights_chunk >= 0 && o.weights_chunk % 512 == 0,
                  "sketch_topp: weights_chunk={} must be a multiple of 512", o.weights_chunk);
    CUMULUS_CHECK(o.hist_chunk >= 0 && o.hist_chunk % 512 == 0, "sketch_topp: hist_chunk={} must be a multiple of 512",
                  o.hist_chunk);
    Base& b = base();
    const int d = kv.head_dim;
    const size_t L = static_cast<size_t>(b.n_lists);
    const size_t nt = round_up(static_cast<size_t>(std::max(1, kv.max_tokens)), kTokensPerWarpStep);
    p_.kv = kv;
    p_.group = group;
    p_.n_q = b.n_q;
    p_.ts = static_cast<int>(nt);
    p_.codes_stride = nt / kSketchBlock * key_sketch_block_bytes(d);
    codes_ = DeviceBuffer(L * p_.codes_stride);
    codes_.fill_bytes(0);
    off_ = DeviceBuffer(L * nt * sizeof(uint16_t));
    step_ = DeviceBuffer(L * nt * sizeof(uint16_t));
    center_ = DeviceBuffer(L * d * sizeof(float));
    scale_ = DeviceBuffer(L * d * sizeof(float));
    sk_n_ = DeviceBuffer(L * sizeof(int32_t));
    sk_n_.fill_bytes(0);
    // Planning from the bound max_tokens, each list cut into equal chunks (multiples of 512
    // tokens) so that each pass's CTAs fit one wave of the device (as many CTAs per
    // multiprocessor as its registers and shared memory allow): a second, partial wave
    // measured as a tail of ~20% on the weights pass at 128K.
    hist_smem_ = static_cast<size_t>(kBins) * ((group + 2) / 2) * sizeof(unsigned long long);
    int occ1 = 1, occ2 = 1;
    with_group(group, [&](auto g) {
      constexpr int G = decltype(g)::value;
      const void* k2 = reinterpret_cast<const void*>(sketch_hist_kernel<G>);
      CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(k2, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(hist_smem_)));
      // Two CTAs per multiprocessor need more than the default carveout of shared memory.
      CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(k2, cudaFuncAttributePreferredSharedMemoryCarveout,
                                              static_cast<int>(cudaSharedmemCarveoutMaxShared)));
      CUMULUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ2, k2, kHistThreads, hist_smem_));
      with_head_dim_type(d, kv.dtype, [&](auto dd, auto t) {
        constexpr int D = decltype(dd)::value;
        const void* k1 = reinterpret_cast<const void*>(sketch_weights_kernel<G, D, decltype(t)>);
        CUMULUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ1, k1, kWeightsThreads, 0));
      });
    });
    const int sms = sm_count();
    auto plan = [&](int ctas, size_t least) {
      const size_t per_list = std::max<size_t>(1, static_cast<size_t>(ctas) / L);
      return static_cast<int>(std::max<size_t>(least, round_up((nt + per_list - 1) / per_list, 512)));
    };
    p_.chunk1 = o.weights_chunk > 0 ? o.weights_chunk : plan(std::max(1, occ1) * sms, 512);
    // At least 8192 tokens per histogram CTA: each CTA's fixed work (zeroing its bins, the
    // thresholds, merging its bins into the list's with global atomics) measured more than
    // the parallelism it buys below that (128K batch 1: 29 vs 36 us with 4096).
    p_.chunk2 = o.hist_chunk > 0 ? o.hist_chunk : plan(std::max(1, occ2) * sms, 8192);
    p_.n_chunks1 = static_cast<int>((nt + p_.chunk1 - 1) / p_.chunk1);
    n_chunks2_ = static_cast<int>((nt + p_.chunk2 - 1) / p_.chunk2);
    logits_ = DeviceBuffer(L * nt * group * sizeof(int16_t));
    gmax_ = DeviceBuffer(L * (nt / kGroupTokens) * group * sizeof(float));
    part_m_ = DeviceBuffer(L * p_.n_chunks1 * group * sizeof(float));
    part_s_ = DeviceBuffer(L * p_.n_chunks1 * group * sizeof(float));
    cbin_ = DeviceBuffer(L * nt * sizeof(uint16_t));
    hist_ = DeviceBuffer(L * kBins * ((group + 2) / 2) * sizeof(unsigned long long));
    hist_.fill_bytes(0);
    ticket_ = DeviceBuffer(L * sizeof(uint32_t));
    ticket_.fill_bytes(0);
    thr_ = DeviceBuffer(L * sizeof(int32_t));
    dense_ = DeviceBuffer(L * sizeof(int32_t));
    dense_.fill_bytes(0);
    st_M_ = DeviceBuffer(L * group * sizeof(float));
    st_S_ = DeviceBuffer(L * group * sizeof(double));
    st_T_ = DeviceBuffer(L * group * sizeof(double));
    st_U_ = DeviceBuffer(L * group * sizeof(double));
    if (o.rest_mean) {
      vsum_ = DeviceBuffer(L * d * sizeof(double));
      vs_n_ = DeviceBuffer(L * sizeof(int32_t));
      p_.vsum = vsum_.as<double>();
      p_.vs_n = vs_n_.as<int32_t>();
    }
    p_.codes = codes_.as<uint8_t>();
    p_.off = off_.as<uint16_t>();
    p_.step = step_.as<uint16_t>();
    p_.center = center_.as<float>();
    p_.scale = scale_.as<float>();
    p_.sk_n = sk_n_.as<int32_t>();
    p_.logits = logits_.as<int16_t>();
    p_.gmax = gmax_.as<float>();
    p_.part_m = part_m_.as<float>();
    p_.part_s = part_s_.as<float>();
    p_.cbin = cbin_.as<uint16_t>();
    p_.hist = hist_.as<unsigned long long>();
    p_.ticket = ticket_.as<uint32_t>();
    p_.thr = thr_.as<int32_t>();
    p_.dense = dense_.as<int32_t>();
    p_.st_M = st_M_.as<float>();
    p_.st_S = st_S_.as<double>();
    p_.st_T = st_T_.as<double>();
    p_.st_U = st_U_.as<double>();
    p_.attn_scale = 1.0f / std::sqrt(static_cast<float>(d));
    p_.cp = o.candidate_p;
    p_.dense_above = o.dense_above;
    p_.sinks = o.sinks;
    p_.recent = o.recent;
    p_.min_context = o.min_context;
    p_.force_dense = o.p >= 1.0 ? 1 : 0;
    const size_t kv_bytes = static_cast<size_t>(kv.n_seqs) * kv.n_kv_heads * kv.max_tokens * d * 2 * 2;
    b.dense_step = o.dense_kv_bytes > 0 && kv_bytes <= o.dense_kv_bytes;
  }

  std::string name() const override { return "sketch_topp"; }
  double select_bytes_per_token() const override {  // codes, f16 offset and step; none at p = 1
    return base().dense_step || p_.force_dense ? 0.0 : static_cast<double>(key_sketch_token_bytes(base().kv.head_dim));
  }
  int select_min_tokens() const override { return o_.min_context; }

  void prefill(void* stream, const DevicePromptQueries& /*pq*/) override {
    const cudaStream_t st = as_stream(stream);
    const Base& b = base();
    const int d = b.kv.head_dim;
    if (b.kv.dtype == DType::f16) {
      sketch_channels_kernel<__half><<<b.n_lists, d, 0, st>>>(p_);
      CUMULUS_CUDA_LAUNCH("sketch_channels_kernel");
      sketch_encode_kernel<__half><<<dim3(ceil_div(p_.ts, 128), b.n_lists), 128, 0, st>>>(p_);
    } else {
      sketch_channels_kernel<__nv_bfloat16><<<b.n_lists, d, 0, st>>>(p_);
      CUMULUS_CUDA_LAUNCH("sketch_channels_kernel");
      sketch_encode_kernel<__nv_bfloat16><<<dim3(ceil_div(p_.ts, 128), b.n_lists), 128, 0, st>>>(p_);
    }
    CUMULUS_CUDA_LAUNCH("sketch_encode_kernel");
    if (o_.rest_mean) {
      CUMULUS_CUDA_CHECK(cudaMemsetAsync(vsum_.data(), 0, vsum_.size(), st));
      const dim3 grid(ceil_div(std::max(1, b.kv.max_tokens), kVsumChunk), b.n_lists);
      if (b.kv.dtype == DType::f16) {
        sketch_vsum_prefill_kernel<__half><<<grid, d, 0, st>>>(p_);
      } else {
        sketch_vsum_prefill_kernel<__nv_bfloat16><<<grid, d, 0, st>>>(p_);
      }
      CUMULUS_CUDA_LAUNCH("sketch_vsum_prefill_kernel");
    }
    prefilled_ = true;
  }

  void select(const float* q, void* stream) override {
    CUMULUS_CHECK(prefilled_, "sketch_topp: select() before prefill() (the sketch is built there)");
    last_q_ = q;
    if (base().dense_step) return;  // the cost rule: attend() runs the dense kernel
    const cudaStream_t st = as_stream(stream);
    if (o_.rest_mean) launch_vsum(st);  // the tokens appended since the last step
    launch_weights(q, st);
    launch_hist(st);
    launch_marks(st);
    base().emit(st);
  }

  // sparse_decoder_phase_times (kernels/cuda_decoder.h), registered in the constructor.
  std::vector<std::pair<std::string, double>> phase_times(void* stream) const {
    // Each phase of the last select() again, alone between events, after one untimed run
    // of it (the caches as that run left them, no flush): where the selection's time goes.
    if (last_q_ == nullptr || base().dense_step) return {};
    const cudaStream_t st = as_stream(stream);
    auto* self = const_cast<SketchToppGpu*>(this);
    std::vector<std::pair<std::string, double>> r;
    EventTimer t;
    auto timed = [&](const char* name, auto&& before, auto&& fn) {
      before();
      fn();
      before();
      t.start(stream);
      fn();
      t.stop(stream);
      r.emplace_back(name, 1e3 * t.elapsed_ms());
    };
    const auto nothing = [] {};
    timed("weights", nothing, [&] { self->launch_weights(last_q_, st); });
    timed("hist", nothing, [&] { self->launch_hist(st); });
    timed("marks", nothing, [&] { self->launch_marks(st); });
    // The emit pass clears the bitmap it reads: the marks run (untimed) before each.
    timed("emit", [&] { self->launch_marks(st); }, [&] { self->base().emit(st); });
    return r;
  }

  const SketchParams& params() const { return p_; }

 protected:
  bool needs_lse() const override { return true; }
  void after_attend(const float* lse, float* out, float* /*mass*/, void* stream) override {
    Base& b = base();
    if (b.dense_step) return;  // stats() reports claim 1
    const int rows = b.kv.n_seqs * b.n_q;
    sketch_claims_kernel<<<rows, kClaimsThreads, 0, as_stream(stream)>>>(
        p_, lse, b.len.as<int32_t>(), b.claimed.as<float>(), b.budget.as<int32_t>(), o_.rest_mean ? out : nullptr);
    CUMULUS_CUDA_LAUNCH("sketch_claims_kernel");
  }

 private:
  void launch_weights(const float* q, cudaStream_t st) {
    const Base& b = base();
    with_group(b.group, [&](auto g) {
      constexpr int G = decltype(g)::value;
      with_head_dim_type(b.kv.head_dim, b.kv.dtype, [&](auto dd, auto t) {
        constexpr int D = decltype(dd)::value;
        sketch_weights_kernel<G, D, decltype(t)><<<dim3(p_.n_chunks1, b.n_lists), kWeightsThreads, 0, st>>>(p_, q);
      });
    });
    CUMULUS_CUDA_LAUNCH("sketch_weights_kernel");
  }
  void launch_vsum(cudaStream_t st) {
    const Base& b = base();
    if (b.kv.dtype == DType::f16) {
      sketch_vsum_kernel<__half><<<b.n_lists, b.kv.head_dim, 0, st>>>(p_);
    } else {
      sketch_vsum_kernel<__nv_bfloat16><<<b.n_lists, b.kv.head_dim, 0, st>>>(p_);
    }
    CUMULUS_CUDA_LAUNCH("sketch_vsum_kernel");
  }
  void launch_hist(cudaStream_t st) {
    const Base& b = base();
    with_group(b.group, [&](auto g) {
      constexpr int G = decltype(g)::value;
      sketch_hist_kernel<G><<<dim3(n_chunks2_, b.n_lists), kHistThreads, hist_smem_, st>>>(p_);
    });
    CUMULUS_CUDA_LAUNCH("sketch_hist_kernel");
  }
  void launch_marks(cudaStream_t st) {
    Base& b = base();
    const int tiles = bitmap_tiles(b.words);
    sketch_marks_kernel<<<dim3(tiles, b.n_lists), kBitmapTileWords, 0, st>>>(p_, b.bits.as<uint32_t>(), b.words, tiles,
                                                                           b.counts.as<int>());
    CUMULUS_CUDA_LAUNCH("sketch_marks_kernel");
  }

  SketchToppGpuOptions o_;
  SketchParams p_;
  int n_chunks2_ = 1;
  size_t hist_smem_ = 0;
  bool prefilled_ = false;
  const float* last_q_ = nullptr;
  DeviceBuffer codes_, off_, step_, center_, scale_, sk_n_, logits_, gmax_, part_m_, part_s_, cbin_, hist_,
      ticket_, thr_, dense_, st_M_, st_S_, st_T_, st_U_, vsum_, vs_n_;
};

}  // namespace

std::unique_ptr<SparseDecoder> make_sketch_topp_gpu(const DeviceKvView& kv, int group, const SketchToppGpuOptions& o,
                                                    const AttentionPlanOptions& plan) {
  return std::make_unique<SketchToppGpu>(kv, group, o, plan);
}

DeviceSketchCopy sketch_topp_gpu_download(const SparseDecoder& m, int seq, int h) {
  const auto* sk = dynamic_cast<const SketchToppGpu*>(&m);
  CUMULUS_CHECK(sk != nullptr, "sketch_topp_gpu_download: decoder '{}' is not sketch_topp", m.name());
  const SketchParams& p = sk->params();
  CUMULUS_CHECK(seq >= 0 && seq < p.kv.n_seqs && h >= 0 && h < p.kv.n_kv_heads,
                "sketch_topp_gpu_download: seq={} h={} outside the batch's {} x {}", seq, h, p.kv.n_seqs,
                p.kv.n_kv_heads);
  device_synchronize();
  const size_t l = static_cast<size_t>(seq) * p.kv.n_kv_heads + h;
  const int d = p.kv.head_dim;
  DeviceSketchCopy c;
  int32_t n = 0;
  memcpy_to_host(&n, p.sk_n + l, sizeof(n));
  c.n_tokens = n;
  const size_t blocks = (static_cast<size_t>(n) + kSketchBlock - 1) / kSketchBlock;
  c.codes.resize(blocks * key_sketch_block_bytes(d));
  c.offset.resize(blocks * kSketchBlock);
  c.step.resize(blocks * kSketchBlock);
  c.center.resize(d);
  c.scale.resize(d);
  if (blocks > 0) {
    memcpy_to_host(c.codes.data(), p.codes + l * p.codes_stride, c.codes.size());
    memcpy_to_host(c.offset.data(), p.off + l * p.ts, c.offset.size() * sizeof(uint16_t));
    memcpy_to_host(c.step.data(), p.step + l * p.ts, c.step.size() * sizeof(uint16_t));
  }
  memcpy_to_host(c.center.data(), p.center + l * d, d * sizeof(float));
  memcpy_to_host(c.scale.data(), p.scale + l * d, d * sizeof(float));
  return c;
}

// The registry's "sketch_topp" on the GPU (MethodInfo::gpu): groups of at most
// kSketchToppMaxGroup query heads; gpu_dense_mib is the GPU's cost rule.
void attach_sketch_topp_gpu(Registry& r) {
  r.attach_gpu("sketch_topp",
               {.make = [](const DeviceKvView& kv, const Shape& shape, int,
                           const Params& p) -> std::unique_ptr<SparseDecoder> {
                  SketchToppGpuOptions o;
                  options_read(p, o);
                  o.dense_kv_bytes = static_cast<size_t>(o.gpu_dense_mib) << 20;
                  return make_sketch_topp_gpu(kv, shape.group(), o);
                },
                .check = [](const Shape& shape, const Params&) {
                  CUMULUS_CHECK(shape.group() <= kSketchToppMaxGroup,
                                "--device cuda: sketch_topp takes at most {} query heads per kv head on the GPU, "
                                "this model has {}",
                                kSketchToppMaxGroup, shape.group());
                }});
}

}  // namespace cumulus::cuda
