// Work stealing in the decode attention kernel, against the library's static split (llm.c's
// dev/cuda habit: a variant the library does not run, with its reference, its validation and
// its timing in one program). Equal chunks do not finish together: the multiprocessors do
// not get equal shares of the memory bandwidth. With stealing a chunk is only a CTA's
// starting point: its warps claim units of kUnitBlocks blocks from a per-chunk cursor
// (atomicAdd), then from the list's other chunks, so a list ends when its last unit does;
// the merge CTA resets the cursors for the next launch. Measured on an H100 at 128K tokens
// (docs/lab/cuda-log.md) it evened out the CTAs' end times but cost 2-3% on dense, so the
// library keeps the static split.
//
// The variants are hooks (attention_kernels.cuh's contract, AttnStatic there) over the
// library's kernels: static with a CTA timeline, and stealing with one. Every variant is
// checked against the float64 reference (sequence 0; normalised error <= 1e-4) and against
// the library's attention_decode (every sequence; <= 1e-5) before it is timed: CUDA graph
// replays after a 256 MiB L2 flush, median of --iters. The timeline gives each CTA's %globaltimer at
// the AttnPoint points: the spread of the CTAs' end times and where a CTA's time goes.
//
// Usage: attention_steal [--contexts 8192,131072] [--batches 1,16] [--iters 30] [--warps 8]
//          [--tensor-cores 1]   (dense attention, llama3-8b shape, f16)
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "dev_util.h"
#include "cumulus/core/error.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/synthetic.h"
#include "cumulus/kernels/attention.h"
#include "cumulus/kernels/cuda.h"
#include "cumulus/kv/cuda_kv_cache.h"
#include "cumulus/kv/kv_cache.h"
#include "cumulus/methods/method.h"
#include "kernels/cuda/attention_kernels.cuh"

namespace cumulus::cuda {
namespace {

using dev::ints;
using dev::median;

constexpr int kUnitBlocks = 4;  // blocks per claimed unit of work

// The blocks of BT list entries one warp computes, as BlockGen's (start, limit), by
// stealing: units of kUnitBlocks blocks claimed with atomicAdd on the chunk cursors, the
// CTA's own chunk first, then the other chunks of the list in turn. Lane 0 holds the
// claims; the claim of the next unit is issued when a unit starts, so its latency hides
// behind the unit's blocks. Every field but `pending` is warp-uniform.
template <int BT>
struct StealGen {
  static constexpr int kUnit = kUnitBlocks * BT;
  int pos, lim;  // next block start and the current unit's end
  bool done;
  int own_c, n_chunks, chunk_len, len, probe;  // chunk geometry, chunks tried so far
  int* cursor;                                 // the list's chunk cursors
  int pending;  // lane 0: entries claimed earlier from chunk (own_c + probe) mod n_chunks

  __device__ void init(const AttnWork& w, int* cursors) {
    done = false;
    pos = lim = 0;  // no unit yet: the first next() resolves the claim below
    pending = 0;
    own_c = w.item - w.list_first;
    n_chunks = w.n_chunks;
    chunk_len = w.own;
    len = w.len;
    probe = 0;
    cursor = cursors + w.list_first;
    if ((threadIdx.x & 31) == 0) pending = atomicAdd(cursor + own_c, kUnit);
  }
  // Lane 0: turns the pending claim into a unit, probing the list's other chunks once the
  // current one is used up; then claims the following unit ahead. Returns the unit start or
  // -1 (every chunk used up), and its end in *e.
  __device__ int claim(int* e) {
    int got = pending;
    while (probe < n_chunks) {
      int c = own_c + probe;
      if (c >= n_chunks) c -= n_chunks;
      const int cb = c * chunk_len, ce = min(len, cb + chunk_len);
      if (cb + got < ce) {
        *e = min(ce, cb + got + kUnit);
        pending = atomicAdd(cursor + c, kUnit);
        return cb + got;
      }
      if (++probe < n_chunks) {
        c = own_c + probe;
        if (c >= n_chunks) c -= n_chunks;
        got = atomicAdd(cursor + c, kUnit);
      }
    }
    return -1;
  }
  __device__ void next(int& start, int& limit) {
    if (pos >= lim && !done) {
      int b = 0, e = 0;
      if ((threadIdx.x & 31) == 0) b = claim(&e);
      b = __shfl_sync(0xffffffffu, b, 0);
      e = __shfl_sync(0xffffffffu, e, 0);
      if (b < 0) done = true;
      else pos = b, lim = e;
    }
    if (done || pos >= lim) {
      start = -1;
      limit = 0;
      return;
    }
    start = pos;
    limit = lim;
    pos += BT;
  }
};

// The variants: kSteal false is the library's split with a timeline, true the stealing one.
template <bool kSteal>
struct AttnDev {
  struct Args {
    int* cursor;                   // [max_items] entries claimed from each chunk (stealing)
    unsigned long long* timeline;  // [max_items][kAttnPoints] %globaltimer, ns
  };
  template <int BT>
  __device__ static auto blocks(const Args& a, const AttnWork& w, int warp, int warps) {
    if constexpr (kSteal) {
      StealGen<BT> g;
      g.init(w, a.cursor);
      return g;
    } else {
      return BlockGen<BT>{w.begin + warp * BT, w.end, warps * BT};
    }
  }
  __device__ static void point(const Args& a, int which) {
    if (threadIdx.x != 0) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    a.timeline[kAttnPoints * blockIdx.x + which] = t;
  }
  __device__ static void chunk_done(const Args& a, const AttnWork& w) {
    if (kSteal && threadIdx.x == 0) a.cursor[w.item] = 0;
  }
  __device__ static void list_done(const Args& a, const AttnWork& w) {
    if (kSteal)
      for (int c = threadIdx.x; c < w.n_chunks; c += blockDim.x) a.cursor[w.list_first + c] = 0;
  }
};

// One dense launch of a variant, planned as AttentionPlan plans it (attention.cu) for the
// default chunk caps.
template <class V>
struct DevLaunch {
  AttnKernel<V> kernel = nullptr;
  int warps = 8, g = 4, n_tiles = 1, n_lists = 0, target = 0, min_chunk = 0, max_chunk = 0, items = 0;
  size_t smem = 0;
  DeviceBuffer part_o, part_m, part_l, tickets, error, cursor, timeline;
  AttnParams p{};

  DevLaunch(const DeviceKvView& kv, int group, int warps_in, bool mma, const float* q, float* out, float* lse) {
    const int d = kv.head_dim;
    CUMULUS_CHECK(d == 128 && kv.dtype == DType::f16, "attention_steal: head_dim 128, f16 only (d={})", d);
    g = tile_heads(group, d);
    n_tiles = ceil_div(group, g);
    n_lists = kv.n_seqs * kv.n_kv_heads * n_tiles;
    warps = warps_in;
    const AttnKernels<V> ks = pick_g<V, 128, __half>(g, mma);
    const int block = block_tokens(d, g, mma);
    kernel = ks.contig != nullptr && kv.page_size % block == 0 ? ks.contig : ks.any;
    smem = std::max(static_cast<size_t>(warps) * g * (d + 2) * sizeof(float),
                    std::max(static_cast<size_t>(warps) * 32 * 4 * sizeof(float),
                             static_cast<size_t>(warps) * kStages * 2 * block * (d + 8) * 2));
    CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int per_sm = 0;
    CUMULUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, warps * 32, smem));
    CUMULUS_CHECK(per_sm >= 1, "attention_steal: the kernel does not fit ({} warps, {} bytes)", warps, smem);
    target = sm_count() * per_sm;
    const int step = block * warps;
    min_chunk = 2 * step;
    max_chunk = std::max(step, 32768 / step * step);
    items = std::max(target + n_lists, n_lists * (ceil_div(std::max(1, kv.max_tokens), max_chunk) + 1));
    part_o = DeviceBuffer(static_cast<size_t>(items) * g * d * sizeof(float));
    part_m = DeviceBuffer(static_cast<size_t>(items) * g * sizeof(float));
    part_l = DeviceBuffer(static_cast<size_t>(items) * g * sizeof(float));
    tickets = DeviceBuffer(static_cast<size_t>(n_lists) * sizeof(int));
    tickets.fill_bytes(0);
    error = DeviceBuffer(sizeof(int));
    error.fill_bytes(0);
    cursor = DeviceBuffer(static_cast<size_t>(items) * sizeof(int));
    cursor.fill_bytes(0);
    timeline = DeviceBuffer(static_cast<size_t>(items) * kAttnPoints * sizeof(unsigned long long));
    p.k = kv.k;
    p.v = kv.v;
    p.page_table = kv.page_table;
    p.n_tokens = kv.n_tokens;
    p.n_kv = kv.n_kv_heads;
    p.page_shift = kv.page_shift;
    p.max_pages = kv.max_pages;
    p.group = group;
    p.n_tiles = n_tiles;
    p.n_lists = n_lists;
    p.qscale = 1.0f / std::sqrt(static_cast<float>(d)) * kLog2e;
    p.q = q;
    p.out = out;
    p.lse = lse;
    p.part_o = part_o.as<float>();
    p.part_m = part_m.as<float>();
    p.part_l = part_l.as<float>();
    p.tickets = tickets.as<int>();
    p.error = error.as<int>();
    p.target_ctas = target;
    p.min_chunk = min_chunk;
    p.max_chunk = max_chunk;
    p.prefetch = 256;
  }
  void launch(cudaStream_t s) {
    kernel<<<items, warps * 32, smem, s>>>(p, typename V::Args{cursor.as<int>(), timeline.as<unsigned long long>()});
    CUMULUS_CUDA_LAUNCH("attention_steal kernel");
  }
  // The last launch's CTAs that had a chunk: ns after the earliest start, [CTA][kAttnPoints],
  // -1 where a CTA did not reach a point.
  std::vector<int64_t> read_timeline() const {
    std::vector<unsigned long long> t(static_cast<size_t>(items) * kAttnPoints);
    timeline.download(t.data(), t.size() * sizeof(unsigned long long));
    unsigned long long t0 = ~0ull;
    for (unsigned long long x : t)
      if (x != 0) t0 = std::min(t0, x);
    std::vector<int64_t> r(t.size(), -1);
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i] != 0) r[i] = static_cast<int64_t>(t[i] - t0);
    return r;
  }
};


double rel_err(const std::vector<float>& a, const std::vector<float>& ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (static_cast<double>(a[i]) - ref[i]) * (static_cast<double>(a[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The CTAs that had a chunk: quantiles of their end times, the busy share sum(end - start)
// / (CTAs x span), and the median time from a CTA's start to each point.
std::string timeline_summary(const std::vector<int64_t>& t) {
  constexpr int K = kAttnPoints;
  std::vector<double> ends;
  std::vector<std::vector<double>> at(K);
  double busy = 0, span = 0;
  for (size_t i = 0; i + K <= t.size(); i += K) {
    const int64_t s = t[i + kAttnStart], e = t[i + kAttnEnd];
    if (s < 0 || e < 0 || t[i + kAttnPlanned] < 0) continue;  // no chunk: not part of the work
    ends.push_back(1e-3 * e);
    busy += 1e-3 * (e - s);
    span = std::max(span, 1e-3 * e);
    bool full = true;
    for (int k = 0; k < K; ++k) full = full && t[i + k] >= 0;
    if (full)
      for (int k = 1; k < K; ++k) at[k].push_back(1e-3 * (t[i + k] - s));
  }
  if (ends.empty()) return "no CTA ran";
  auto quantile = [](std::vector<double> v, double f) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[static_cast<size_t>(f * (v.size() - 1) + 0.5)];
  };
  return fmt::format("{} CTAs, ends p10 {:.1f} / p50 {:.1f} / p90 {:.1f} / last {:.1f} us, busy {:.1f}%; a CTA's "
                     "median us from its start: plan {:.1f}, query {:.1f}, first block {:.1f}, warp 0 done {:.1f}, "
                     "all warps {:.1f}, end {:.1f}",
                     ends.size(), quantile(ends, 0.1), quantile(ends, 0.5), quantile(ends, 0.9), span,
                     100 * busy / (ends.size() * span), quantile(at[kAttnPlanned], 0.5), quantile(at[kAttnQuery], 0.5),
                     quantile(at[kAttnFirstBlock], 0.5), quantile(at[kAttnWarpDone], 0.5),
                     quantile(at[kAttnAllWarps], 0.5), quantile(at[kAttnEnd], 0.5));
}


int run(int argc, char** argv) {
  std::vector<int> contexts{8192, 131072}, batches{1, 16};
  int iters = 30, warps = 8;
  bool tc = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    CUMULUS_CHECK(i + 1 < argc, "option {} needs a value", a);
    const std::string v = argv[++i];
    if (a == "--contexts") contexts = ints(a, v);
    else if (a == "--batches") batches = ints(a, v);
    else if (a == "--iters") iters = dev::positive_int(a, v);
    else if (a == "--warps") warps = dev::positive_int(a, v);
    else if (a == "--tensor-cores") tc = v != "0";
    else CUMULUS_FAIL("unknown option '{}'", a);
  }
  CUMULUS_CHECK(iters >= 1, "--iters={} must be >= 1", iters);
  CUMULUS_CHECK(warps == 2 || warps == 4 || warps == 8, "--warps={} must be 2, 4 or 8", warps);
  if (!device_available()) {
    fmt::print(stderr, "attention_steal: no CUDA device\n");
    return 1;
  }
  fmt::print("device: {}; dense decode, llama3-8b shape, f16, {} warps, {}\n", device_info().name, warps,
             tc ? "tensor cores" : "SIMT");
  Stream st;
  const cudaStream_t s = static_cast<cudaStream_t>(st.handle());
  DeviceBuffer flush(size_t{256} << 20);
  ThreadPool pool(0);
  for (int n : contexts) {
    SyntheticOptions so;
    so.shape = shape_preset("llama3-8b");
    so.n_tokens = n;
    so.n_steps = 1;
    KvCache kv(so.shape, KvCacheOptions{16, DType::f16, n});
    const SyntheticWorkload w = synthetic_generate(so, kv, pool);
    std::vector<PagedHeadView> views;
    for (int h = 0; h < so.shape.n_kv_heads; ++h) views.push_back(kv.view(0, h));
    const int nq = so.shape.n_q_heads, d = so.shape.head_dim, group = so.shape.group();
    std::vector<float> ref(static_cast<size_t>(nq) * d), ref_lse(nq);
    DecodeAttnArgs ra;
    ra.kv = views.data();
    ra.n_kv_heads = so.shape.n_kv_heads;
    ra.group = group;
    ra.scale = attention_scale(d);
    ra.q = w.query(0, 0);
    ra.out = ref.data();
    ra.lse = ref_lse.data();
    ref::attention_decode_dense(ra);
    for (int b : batches) {
      DeviceKvCache dev = DeviceKvCache::upload_replicated(views, b);
      std::vector<float> qh;
      for (int i = 0; i < b; ++i) qh.insert(qh.end(), w.query(0, 0), w.query(0, 0) + static_cast<size_t>(nq) * d);
      DeviceBuffer q = to_device(qh);
      const size_t n_out = static_cast<size_t>(b) * nq * d;
      DeviceBuffer out(n_out * sizeof(float)), lse(static_cast<size_t>(b) * nq * sizeof(float));
      // The library's attention: the reference for the variants' bits.
      AttentionPlanOptions po;
      po.warps = warps;
      po.tensor_cores = tc;
      AttentionPlan plan(dev.view(), group, po);
      DeviceDecodeArgs a;
      a.kv = dev.view();
      a.group = group;
      a.scale = attention_scale(d);
      a.q = q.as<float>();
      a.out = out.as<float>();
      a.lse = lse.as<float>();
      attention_decode(a, plan, st.handle());
      plan.check(st.handle());
      const std::vector<float> lib = to_host<float>(out, n_out);
      const double bytes = static_cast<double>(b) * n * so.shape.n_kv_heads * d * 2 * 2;
      auto time = [&](auto&& fn) {
        Graph g = Graph::capture(st.handle(), fn);
        EventTimer t;
        for (int i = 0; i < 5; ++i) g.launch(st.handle());
        std::vector<double> us;
        for (int i = 0; i < iters; ++i) {
          memset_async(flush.data(), i & 0xff, flush.size(), st.handle());
          t.start(st.handle());
          g.launch(st.handle());
          t.stop(st.handle());
          us.push_back(1e3 * t.elapsed_ms());
        }
        return median(us);
      };
      const double lib_us = time([&] { attention_decode(a, plan, st.handle()); });
      fmt::print("context {} batch {}: library {:8.1f} us ({:.0f} GB/s), err vs float64 {:.1e}\n", n, b, lib_us,
                 bytes / (lib_us * 1e-6) / 1e9, rel_err(lib, ref, ref.size()));
      auto variant = [&](auto launch, const char* name) {
        launch.launch(s);
        CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
        int err = 0;
        launch.error.download(&err, sizeof(int));
        CUMULUS_CHECK(err == 0, "{}: the kernel flagged bad input ({})", name, err);
        const std::vector<float> o = to_host<float>(out, n_out);
        const double e_ref = rel_err(o, ref, ref.size()), e_lib = rel_err(o, lib, n_out);
        const bool valid = e_ref <= 1e-4 && e_lib <= 1e-5;
        const double us = time([&] { launch.launch(s); });
        launch.launch(s);  // one more, for its timeline
        CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
        fmt::print("  {:<22} {:8.1f} us (x{:.3f} the library's)  err vs float64 {:.1e}, vs library {:.1e}{}\n"
                   "  {:<22} timeline: {}\n",
                   name, us, lib_us / us, e_ref, e_lib, valid ? "" : "  INVALID", "",
                   timeline_summary(launch.read_timeline()));
      };
      variant(DevLaunch<AttnDev<false>>(dev.view(), group, warps, tc, q.as<float>(), out.as<float>(), lse.as<float>()),
              "static (+ timeline)");
      variant(DevLaunch<AttnDev<true>>(dev.view(), group, warps, tc, q.as<float>(), out.as<float>(), lse.as<float>()),
              "stealing (+ timeline)");
    }
  }
  return 0;
}

}  // namespace
}  // namespace cumulus::cuda

int main(int argc, char** argv) {
  return cumulus::cuda::dev::main_of("attention_steal", cumulus::cuda::run, argc, argv);
}
