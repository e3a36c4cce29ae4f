// tactic on the GPU (Tactic, section 4, Algorithm 1; the CPU method is src/methods/tactic/tactic.cpp
// and docs/methods.md gives the equations). Prefill, per (sequence, kv head): k-means of
// the stored keys (k = ceil(n / cluster_size) centroids sampled with the CPU's seeded
// partial Fisher-Yates, assignment as a matrix product, deterministic means, until no
// assignment changes or max_iter), empty clusters dropped, members grouped by cluster in
// ascending token order. A decode step, all on the device with no host synchronisation:
//   1. centroid scores q . c for every query head (4.3), each centroid row read once for
//      its whole GQA group (centroids kept in f16 for this read: half the bytes);
//   2. clusters of every query head sorted by score, descending, ties to the lower index;
//   3. one CTA per query head: list positions of the ranked clusters (prefix sums of their
//      sizes), the first N = ceil(init_ratio L) positions and the windows around p1 L and
//      p2 L scored exactly, y = a/x + b fitted through the two window means, the budget k
//      = minimal prefix reaching P of the estimated total (Alg. 1 line 11), the claim, and
//      the head's first k list entries (plus the dense tail of tokens appended after
//      prefill) marked in its kv head's bitmap (the group's union, 4.5);
//   4. the bitmaps compacted into sorted lists for the sparse attention kernel (4.6).
// With the options sinks / recent (ours, as on the CPU) the first and last clustered
// tokens are filtered out of the clusters' members at prefill and join the dense tail.
// Launches per step: centroid scores (wide); the ranking with the list positions and the
// exactly scored positions' pool rows, one CTA per query head (a bucket sort in shared
// memory up to 8192 clusters, else a radix sort and a positions kernel); exact scores (many
// CTAs per head); fit and budget (one CTA per head, the fitted sum in closed form, the
// budget found by a warp in 4 rounds of 32 candidates); the marks (by token range: whole
// bitmap words and the tiles' counts, then the compaction's emit pass; or by ranked
// cluster, shared-memory or global atomics, then both compaction passes).
//
// Files: tactic_params.cuh (TacticParams), tactic_kernels.cuh (the device code), this file
// (the decoder: prefill's k-means, the step's launches; the registry attachment).
#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "cumulus/methods/cuda_methods.h"
#include "methods/tactic/tactic_gpu_paths.h"
#include "methods/tactic/tactic_kernels.cuh"

namespace cumulus::cuda {
namespace {

class TacticGpu final : public SparseDecoder {
 public:
  TacticGpu(const DeviceKvView& kv, int group, const TacticGpuOptions& o, const TacticGpuPaths& bo,
            const AttentionPlanOptions& po)
      : SparseDecoder(kv, group, po), o_(o) {
    CUMULUS_CHECK(o.p > 0 && o.p <= 1, "tactic: p={} must be in (0, 1]", o.p);
    CUMULUS_CHECK(o.cluster_size >= 1, "tactic: cluster_size={} must be >= 1", o.cluster_size);
    CUMULUS_CHECK(o.max_iter >= 1, "tactic: max_iter={} must be >= 1", o.max_iter);
    CUMULUS_CHECK(o.init_ratio >= 0 && o.init_ratio <= 1, "tactic: init_ratio={} must be in [0, 1]", o.init_ratio);
    CUMULUS_CHECK(o.window >= 1, "tactic: window={} must be >= 1", o.window);
    CUMULUS_CHECK(o.p1 >= 0 && o.p1 < o.p2 && o.p2 <= 1, "tactic: p1={} and p2={} need 0 <= p1 < p2 <= 1", o.p1, o.p2);
    CUMULUS_CHECK(o.sinks >= 0 && o.recent >= 0, "tactic: sinks={} and recent={} must be >= 0", o.sinks, o.recent);
    CUMULUS_CHECK(bo.mark_slices >= 0 && bo.mark_slices <= 1024, "tactic: mark_slices={} must be in [0, 1024]",
                  bo.mark_slices);
    const Base& b = base();
    const int n_lists = b.n_lists, rows = kv.n_seqs * b.n_q, mt = std::max(1, kv.max_tokens);
    kc_max_ = std::max(1, tactic_cluster_count(mt, o.cluster_size));
    max_exact_ = 1;
    for (int L = 1; L <= mt; ++L)
      max_exact_ = std::max(max_exact_, tactic_windows(L, o.init_ratio, o.window, o.p1, o.p2).n_exact);
    cent_ = DeviceBuffer(static_cast<size_t>(n_lists) * kc_max_ * kv.head_dim * sizeof(__half));
    csize_ = DeviceBuffer(static_cast<size_t>(n_lists) * kc_max_ * sizeof(int32_t));
    cbeg_ = DeviceBuffer(static_cast<size_t>(n_lists) * kc_max_ * sizeof(int32_t));
    members_ = DeviceBuffer(static_cast<size_t>(n_lists) * mt * sizeof(int32_t));
    n_clu_ = DeviceBuffer(n_lists * sizeof(int32_t));
    n_clu_.fill_bytes(0);
    n_idx_ = DeviceBuffer(n_lists * sizeof(int32_t));
    n_idx_.fill_bytes(0);
    cscore_ = DeviceBuffer(static_cast<size_t>(rows) * kc_max_ * sizeof(float));
    crowlen_ = DeviceBuffer(rows * sizeof(int32_t));
    tok_ = DeviceBuffer(static_cast<size_t>(rows) * max_exact_ * sizeof(int32_t));
    exact_ = DeviceBuffer(static_cast<size_t>(rows) * max_exact_ * sizeof(float));
    order_ = DeviceBuffer(static_cast<size_t>(rows) * kc_max_ * sizeof(int32_t));
    pos_ = DeviceBuffer(static_cast<size_t>(rows) * (kc_max_ + 1) * sizeof(int32_t));
    bucket_ = bo.bucket_ranking && kc_max_ <= kRankMaxClusters;
    if (bucket_) {
      // About two clusters per bin: crowded bins are what costs (each is sorted by one
      // thread); measured at 128K tokens: 8 per bin took 50 us, 2 per bin 15 us.
      rank_bins_ = 32;
      while (rank_bins_ * 2 < kc_max_) rank_bins_ *= 2;
      rank_smem_ = tactic_rank_smem(kc_max_, rank_bins_, &rank_sz_off_);
      CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(tactic_rank_kernel),
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(rank_smem_)));
      // The marks in shared memory (the bitmap of up to kRankMaxClusters * cluster_size
      // tokens fits unless cluster_size is large): slices enough for two CTAs per
      // multiprocessor over the batch's kv heads, at most 32 per kv head. Measured on an
      // H100 at 128K tokens, batch 1: 23 us under Nsight Compute, no faster than the
      // global-atomic kernel (21 us): every slice ORs its bitmap's non-zero words into
      // global memory, so the number of global atomics stays about the same. Fewer slices
      // (fewer atomics, less parallel marking) is the untried next step.
      const int words = b.words;
      if (words <= kMarkSmemMaxWords && group <= 64) {
        mark_slices_ = bo.mark_slices > 0 ? bo.mark_slices : std::clamp(2 * sm_count() / std::max(1, n_lists), 1, 32);
        mark_smem_ = static_cast<size_t>(words) * sizeof(uint32_t);
      }
      // The marks by token range need the group's start arrays in shared memory.
      range_smem_ = static_cast<size_t>(group) * kc_max_ * sizeof(int32_t);
      // CTAs per list: the batch's lists over the multiprocessors (one CTA fits on each:
      // the staged starts take most of the shared memory), at most one per tile. A CTA that
      // must walk more than kRangeTilesMax tiles is slower than the marks by cluster
      // (measured on an H100: 16 tiles per CTA at 128K tokens, batch 16, cost 77 us more a
      // step; 4 tiles at 32K, batch 16, 11.5 us less), so those batches keep them.
      range_ctas_ = std::clamp(sm_count() / std::max(1, n_lists), 1, bitmap_tiles(b.words));
      const int tiles_per_cta = ceil_div(bitmap_tiles(b.words), range_ctas_);
      if (bo.token_marks && group <= 64 && range_smem_ <= kRangeSmemMax && tiles_per_cta <= kRangeTilesMax) {
        range_marks_ = true;
        cid_ = DeviceBuffer(static_cast<size_t>(n_lists) * mt * sizeof(int32_t));
        midx_ = DeviceBuffer(static_cast<size_t>(n_lists) * mt * sizeof(int32_t));
        CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(tactic_mark_range_kernel),
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(range_smem_)));
      }
    } else {
      sort_ = std::make_unique<SortWorkspace>(rows, kc_max_);
      CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(tactic_positions_kernel),
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(kPosSmemBytes)));
    }
  }
  std::string name() const override { return "tactic"; }
  double select_bytes_per_token() const override {  // the centroids (float32, one per cluster_size tokens)
    return static_cast<double>(base().kv.head_dim) * sizeof(float) / o_.cluster_size;
  }

  void prefill(void* stream, const DevicePromptQueries& /*pq*/) override {
    const Base& b = base();
    const DeviceKvView& kv = b.kv;
    const cudaStream_t s = as_stream(stream);
    const int D = kv.head_dim, n_kv = kv.n_kv_heads;
    std::vector<int32_t> n_tok(kv.n_seqs);
    CUMULUS_CUDA_CHECK(cudaMemcpyAsync(n_tok.data(), kv.n_tokens, kv.n_seqs * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<int32_t> n_clu(b.n_lists, 0), n_idx(b.n_lists, 0);
    for (int seq = 0; seq < kv.n_seqs; ++seq) {
      for (int h = 0; h < n_kv; ++h) {
        const int list = seq * n_kv + h;
        n_idx[list] = n_tok[seq];
        n_clu[list] = cluster(seq, h, n_tok[seq], s);
      }
    }
    (void)D;
    n_clu_.upload(n_clu.data(), n_clu.size() * sizeof(int32_t));
    n_idx_.upload(n_idx.data(), n_idx.size() * sizeof(int32_t));
    // Step 3b covers the exact entries and the tail that later appends can add (up to the
    // cache's capacity): its grid is fixed here, so a step needs no host decision.
    const int min_idx = *std::min_element(n_idx.begin(), n_idx.end());
    max_exact_ctas_ = std::max(
        1, ceil_div(static_cast<int64_t>(max_exact_) + std::max(0, kv.max_tokens - min_idx) + o_.sinks + o_.recent,
                    kExactItems));
    tail_part_ = DeviceBuffer(static_cast<size_t>(kv.n_seqs) * b.n_q * max_exact_ctas_ * sizeof(float2));
    const int rows = kv.n_seqs * b.n_q;
    crow_len_kernel<<<ceil_div(rows, 256), 256, 0, s>>>(n_clu_.as<int32_t>(), rows, b.n_q, b.group, n_kv,
                                                        crowlen_.as<int32_t>());
    CUMULUS_CUDA_LAUNCH("crow_len_kernel");
    CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
    prefilled_ = true;
  }

  void select(const float* q, void* stream) override {
    CUMULUS_CHECK(prefilled_, "tactic: select before prefill built the clusters");
    Base& b = base();
    const cudaStream_t s = as_stream(stream);
    TacticParams p = params(q);
    const int rows = b.kv.n_seqs * b.n_q;
    const int bt = (32 / (b.kv.head_dim / 8)) * kCentRows;
    const dim3 grid(ceil_div(kc_max_, kCentWarps * bt), b.kv.n_kv_heads, b.kv.n_seqs);
    with_head_dim(b.kv.head_dim,
                  [&](auto d) { centroid_score_step_kernel<decltype(d)::value><<<grid, kCentWarps * 32, 0, s>>>(p); });
    CUMULUS_CUDA_LAUNCH("centroid_score_step_kernel");
    if (bucket_) {
      tactic_rank_kernel<<<rows, kRankThreads, rank_smem_, s>>>(p);
      CUMULUS_CUDA_LAUNCH("tactic_rank_kernel");
    } else {
      sort_rows_desc(cscore_.as<float>(), crowlen_.as<int32_t>(), rows, kc_max_, order_.as<int32_t>(), *sort_,
                     stream);
      tactic_positions_kernel<<<rows, kPosThreads, kPosSmemBytes, s>>>(p);
      CUMULUS_CUDA_LAUNCH("tactic_positions_kernel");
    }
    const dim3 egrid(max_exact_ctas_, rows);
    auto launch = [&](auto kernel) { kernel<<<egrid, kExactThreads, 0, s>>>(p); };
    with_head_dim_type(b.kv.head_dim, b.kv.dtype,
                       [&](auto d, auto t) { launch(tactic_exact_kernel<decltype(d)::value, decltype(t)>); });
    CUMULUS_CUDA_LAUNCH("tactic_exact_kernel");
    tactic_budget_kernel<<<rows, kBudgetThreads, 0, s>>>(p);
    CUMULUS_CUDA_LAUNCH("tactic_budget_kernel");
    if (range_marks_) {
      tactic_mark_range_kernel<<<dim3(range_ctas_, b.n_lists), kMarkRangeThreads, range_smem_, s>>>(p);
      CUMULUS_CUDA_LAUNCH("tactic_mark_range_kernel");
      b.emit(s);
      return;
    }
    if (mark_slices_ > 0) {
      tactic_mark_smem_kernel<<<dim3(mark_slices_, b.n_lists), kMarkSmemThreads, mark_smem_, s>>>(p);
      CUMULUS_CUDA_LAUNCH("tactic_mark_smem_kernel");
    } else {
      tactic_mark_kernel<<<dim3(ceil_div(kc_max_, kMarkRanks), rows), kMarkRanks, 0, s>>>(p);
      CUMULUS_CUDA_LAUNCH("tactic_mark_kernel");
    }
    b.compact(s);
  }

 private:
  TacticParams params(const float* q) {
    Base& b = base();
    TacticParams p{};
    p.kv = b.kv;
    p.group = b.group;
    p.n_q = b.n_q;
    p.kc_max = kc_max_;
    p.max_exact = max_exact_;
    p.scale = 1.0f / std::sqrt(static_cast<float>(b.kv.head_dim));
    p.p = o_.p;
    p.init_ratio = o_.init_ratio;
    p.p1 = o_.p1;
    p.p2 = o_.p2;
    p.window = o_.window;
    p.sinks = o_.sinks;
    p.recent = o_.recent;
    p.q = q;
    p.cent = cent_.as<__half>();
    p.csize = csize_.as<int32_t>();
    p.cbeg = cbeg_.as<int32_t>();
    p.members = members_.as<int32_t>();
    p.n_clu = n_clu_.as<int32_t>();
    p.n_idx = n_idx_.as<int32_t>();
    p.cscore = cscore_.as<float>();
    p.order = order_.as<int32_t>();
    p.pos = pos_.as<int32_t>();
    p.tok = tok_.as<int32_t>();
    p.exact = exact_.as<float>();
    p.tail_part = tail_part_.as<float2>();
    p.max_exact_ctas = max_exact_ctas_;
    p.bits = b.bits.as<uint32_t>();
    p.words = b.words;
    p.cid = cid_.as<int32_t>();
    p.midx = midx_.as<int32_t>();
    p.counts = b.counts.as<int>();
    p.claimed = b.claimed.as<float>();
    p.budget = b.budget.as<int32_t>();
    p.rank_bins = rank_bins_;
    p.rank_sz_off = rank_sz_off_;
    return p;
  }

  // K-means of tokens [0, n) of (seq, h); returns the number of non-empty clusters.
  int cluster(int seq, int h, int n, cudaStream_t s) {
    if (n <= 0) return 0;
    const DeviceKvView& kv = base().kv;
    const int D = kv.head_dim, list = seq * kv.n_kv_heads + h;
    const int k = tactic_cluster_count(n, o_.cluster_size);
    DeviceBuffer x(static_cast<size_t>(n) * D * sizeof(float));
    const int blocks = ceil_div(static_cast<int64_t>(n) * D, 256);
    if (kv.dtype == DType::f16)
      gather_keys_kernel<__half><<<blocks, 256, 0, s>>>(kv, seq, h, n, x.as<float>());
    else
      gather_keys_kernel<__nv_bfloat16><<<blocks, 256, 0, s>>>(kv, seq, h, n, x.as<float>());
    CUMULUS_CUDA_LAUNCH("gather_keys_kernel");
    // The CPU's initial sample: seeded by (seed, layer, kv head, segment start 0).
    std::vector<int32_t> perm;
    tactic_initial_sample(o_.seed, o_.layer, h, 0, n, k, perm);
    perm.resize(k);
    DeviceBuffer init = to_device(perm);
    DeviceBuffer cent(static_cast<size_t>(k) * D * sizeof(float));
    gather_rows_kernel<<<ceil_div(static_cast<int64_t>(k) * D, 256), 256, 0, s>>>(x.as<float>(), D,
                                                                                  init.as<int32_t>(), k,
                                                                                  cent.as<float>());
    CUMULUS_CUDA_LAUNCH("gather_rows_kernel");
    DeviceBuffer assign(static_cast<size_t>(n) * sizeof(int32_t)), counts(static_cast<size_t>(k) * sizeof(int32_t));
    CUMULUS_CUDA_CHECK(cudaMemsetAsync(assign.data(), 0xff, assign.size(), s));
    for (int it = 0; it < o_.max_iter; ++it) {
      if (kmeans_assign(x.as<float>(), n, D, cent.as<float>(), k, assign.as<int32_t>(), s) == 0) break;
      kmeans_update(x.as<float>(), n, D, assign.as<int32_t>(), k, cent.as<float>(), counts.as<int32_t>(), s);
    }
    DeviceBuffer begin(static_cast<size_t>(k) * sizeof(int32_t));
    int32_t* members = members_.as<int32_t>() + static_cast<size_t>(list) * std::max(1, kv.max_tokens);
    kmeans_group(assign.as<int32_t>(), n, k, members, begin.as<int32_t>(), counts.as<int32_t>(), s);
    std::vector<int32_t> cnt = to_host<int32_t>(counts, k), beg = to_host<int32_t>(begin, k);
    // sinks / recent: the members outside [lo, hi) leave their clusters (the centroids stay
    // as k-means left them, as on the CPU); the decode step adds them to the dense tail.
    const TacticSpan sp = tactic_span(n, n, o_.sinks, o_.recent);
    const bool filter = sp.lo > 0 || sp.hi < n;
    std::vector<int32_t> kept;  // the members on the host, when something here needs them
    if (filter || range_marks_) {
      kept.resize(n);
      CUMULUS_CUDA_CHECK(cudaMemcpyAsync(kept.data(), members, n * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
      CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    if (filter) {
      const std::vector<int32_t> all = std::move(kept);
      kept.clear();
      kept.reserve(static_cast<size_t>(sp.len));
      for (int c = 0; c < k; ++c) {
        const int b0 = static_cast<int>(kept.size());
        for (int j = beg[c]; j < beg[c] + cnt[c]; ++j)
          if (all[j] >= sp.lo && all[j] < sp.hi) kept.push_back(all[j]);
        beg[c] = b0;
        cnt[c] = static_cast<int>(kept.size()) - b0;
      }
      if (!kept.empty()) CUMULUS_CUDA_CHECK(cudaMemcpyAsync(members, kept.data(), kept.size() * sizeof(int32_t),
                                                            cudaMemcpyHostToDevice, s));
      CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    // Drop empty clusters (they rank nothing), keeping cluster order.
    std::vector<int32_t> keep, sizes, begins;
    for (int c = 0; c < k; ++c)
      if (cnt[c] > 0) keep.push_back(c), sizes.push_back(cnt[c]), begins.push_back(beg[c]);
    const int kk = static_cast<int>(keep.size());
    if (range_marks_) {
      // Each clustered token's cluster (after the drop) and index among its members.
      std::vector<int32_t> cid(n, -1), midx(n, 0);
      for (int j = 0; j < kk; ++j)
        for (int i = 0; i < sizes[j]; ++i) {
          const int32_t t = kept[begins[j] + i];
          cid[t] = j;
          midx[t] = i;
        }
      const size_t off = static_cast<size_t>(list) * std::max(1, kv.max_tokens) * sizeof(int32_t);
      cid_.upload(cid.data(), cid.size() * sizeof(int32_t), off);
      midx_.upload(midx.data(), midx.size() * sizeof(int32_t), off);
    }
    csize_.upload(sizes.data(), kk * sizeof(int32_t), static_cast<size_t>(list) * kc_max_ * sizeof(int32_t));
    cbeg_.upload(begins.data(), kk * sizeof(int32_t), static_cast<size_t>(list) * kc_max_ * sizeof(int32_t));
    DeviceBuffer keep_d = to_device(keep);
    rows_to_half_kernel<<<ceil_div(static_cast<int64_t>(kk) * D, 256), 256, 0, s>>>(
        cent.as<float>(), D, keep_d.as<int32_t>(), kk, cent_.as<__half>() + static_cast<size_t>(list) * kc_max_ * D);
    CUMULUS_CUDA_LAUNCH("rows_to_half_kernel");
    CUMULUS_CUDA_CHECK(cudaStreamSynchronize(s));
    return kk;
  }

  TacticGpuOptions o_;
  int kc_max_ = 1, max_exact_ = 1, max_exact_ctas_ = 1;
  bool bucket_ = false;
  bool range_marks_ = false;  // tactic_mark_range_kernel (see the constructor)
  size_t range_smem_ = 0;
  int range_ctas_ = 1;  // CTAs per list of tactic_mark_range_kernel
  DeviceBuffer cid_, midx_;
  int mark_slices_ = 0;  // > 0: tactic_mark_smem_kernel with this many slices per kv head
  size_t mark_smem_ = 0;
  int rank_bins_ = 0, rank_sz_off_ = 0;
  size_t rank_smem_ = 0;
  bool prefilled_ = false;
  DeviceBuffer cent_, csize_, cbeg_, members_, n_clu_, n_idx_, cscore_, crowlen_, order_, pos_, tok_, exact_, tail_part_;
  std::unique_ptr<SortWorkspace> sort_;
};

}  // namespace

std::unique_ptr<SparseDecoder> make_tactic_gpu_paths(const DeviceKvView& kv, int group, const TacticGpuOptions& o,
                                                     const TacticGpuPaths& paths,
                                                     const AttentionPlanOptions& plan) {
  return std::make_unique<TacticGpu>(kv, group, o, paths, plan);
}

std::unique_ptr<SparseDecoder> make_tactic_gpu(const DeviceKvView& kv, int group, const TacticGpuOptions& o,
                                               const AttentionPlanOptions& plan) {
  return make_tactic_gpu_paths(kv, group, o, TacticGpuPaths{}, plan);
}

// The registry's "tactic" on the GPU (MethodInfo::gpu): mode=fit only; the runtime
// re-clusters every recluster_interval tokens.
void attach_tactic_gpu(Registry& r) {
  r.attach_gpu("tactic", {.make = [](const DeviceKvView& kv, const Shape& shape, int layer,
                                     const Params& p) -> std::unique_ptr<SparseDecoder> {
                            TacticGpuOptions o;
                            options_read(p, o);
                            o.layer = layer;
                            return make_tactic_gpu(kv, shape.group(), o);
                          },
                          .check = [](const Shape&, const Params& p) {
                            CUMULUS_CHECK(!options_read<TacticOptions>(p).cluster_optimal,
                                          "--device cuda: tactic mode='{}' is not on cuda (the GPU pipeline "
                                          "implements mode=fit)",
                                          p.get_string("mode"));
                          },
                          .reindex_interval = [](const Params& p) { return options_read<TacticOptions>(p).recluster_interval; }});
}

}  // namespace cumulus::cuda
