// Paged decode attention on the GPU, dense and sparse over per-kv-head token lists, for a
// batch of sequences (the CPU contract of kernels/attention.h with a batch dimension).
//
// Work split (split-KV, "flash decoding"): a *list* is one (sequence, kv head, head tile):
// the token range [0, n_tokens) when dense, or the kv head's index list when sparse. Every
// CTA of the one launch reads all list lengths, cuts every list into equal chunks sized so
// that the chunks of all lists together fill one balanced wave of the GPU (attn_plan) and
// takes chunk number blockIdx.x. Lists of different
// lengths (heads that selected more tokens than others) simply get more chunks: Tactic
// section 4.6's per-kv-head subrequests, which turn head imbalance into sequence imbalance,
// planned on the device so a decode step needs no host round trip. A CTA writes a partial
// (max m, sum l, unnormalised output o) per query head; the last CTA of a list to finish
// (a ticket counter) merges the list's partials by log-sum-exp and writes out and lse.
//
// Equal chunks do not finish together (the multiprocessors do not get equal shares of the
// memory bandwidth); work stealing, where a CTA's warps claim units from the list's other
// chunks once theirs is used up, evens out their end times but measured slower on an H100
// (docs/lab/cuda-log.md), so each CTA computes exactly its chunk. That variant, and the CTA
// timeline that measured it, are dev/cuda/attention_steal.cu, over the kernels of
// attention_kernels.cuh (its hooks: AttnStatic).
//
// Inside a CTA each warp takes blocks of tokens in turn and streams them through its own
// shared-memory ring with cp.async, kStages blocks in flight (attn_pipeline). Each K/V row
// is read from memory once for all query heads of its kv head in the tile (GQA): up to
// G = 8 heads per tile, larger groups take several tiles. Two kernels compute a block:
//   - SIMT: CUDA-core FMAs, 16 bytes of a row per lane, dot products reduced by shuffles;
//   - tensor cores: mma.sync m16n8k16 with the block's 16 tokens as the rows and the tile's
//     heads as the columns, Q and the softmax weights split into 16-bit parts so the result
//     keeps float32 accuracy.
// With a GQA group of 4 the SIMT kernel needs ~4 FMAs per byte read, about what an H200's
// CUDA cores can feed at its memory bandwidth; the tensor-core kernel leaves them idle.
// Scores are scaled by scale * log2(e) once in q so the online softmax uses exp2.
//
// Files: attention_params.cuh (AttnParams, the block shapes, a CTA's work),
// attention_kernels.cuh (the device code), this file (AttentionPlan and the launch).
#include <algorithm>
#include <cmath>

#include "attention_kernels.cuh"
#include "core/check.h"
#include "cumulus/kernels/cuda.h"

namespace cumulus::cuda {

struct AttentionPlan::Impl {
  DeviceKvView kv;
  int group = 1, g = 1, n_tiles = 1, n_lists = 0, warps = 4, target = 0, min_chunk = 0, max_chunk = 0, max_items = 0;
  int max_chunk_lists = 0, items_dense = 0, items_lists = 0;  // index lists' cap; each call's grid
  bool mma = false;
  size_t smem = 0;
  AttnKernel<AttnStatic> kernel = nullptr;
  AttnKernel<AttnStatic> kernel_contig = nullptr;  // dense calls whose pages hold whole blocks (null: none, or off)
  int block = 16;                      // tokens per warp block (the contiguous kernel's page-size unit)
  int prefetch = 256;
  DeviceBuffer part_o, part_m, part_l, tickets, error;
};

AttentionPlan::AttentionPlan(const DeviceKvView& kv, int group, const AttentionPlanOptions& o) {
  kv.validate("AttentionPlan");
  CUMULUS_CHECK(group >= 1, "group={} must be >= 1", group);
  CUMULUS_CHECK(o.warps == 2 || o.warps == 4 || o.warps == 8, "options.warps={} must be 2, 4 or 8", o.warps);
  CUMULUS_CHECK(o.ctas_per_sm >= 0 && o.ctas_per_sm <= 32, "options.ctas_per_sm={} must be in [0, 32]",
                o.ctas_per_sm);
  CUMULUS_CHECK(o.min_chunk >= 0, "options.min_chunk={} must be >= 0", o.min_chunk);
  CUMULUS_CHECK(o.max_chunk >= 0, "options.max_chunk={} must be >= 0", o.max_chunk);
  CUMULUS_CHECK(o.max_chunk_lists >= 0, "options.max_chunk_lists={} must be >= 0", o.max_chunk_lists);
  CUMULUS_CHECK(o.l2_prefetch == 0 || o.l2_prefetch == 128 || o.l2_prefetch == 256,
                "options.l2_prefetch={} must be 0, 128 or 256", o.l2_prefetch);
  auto im = std::make_unique<Impl>();
  im->kv = kv;
  im->group = group;
  im->g = tile_heads(group, kv.head_dim);
  im->n_tiles = ceil_div(group, im->g);
  im->n_lists = kv.n_seqs * kv.n_kv_heads * im->n_tiles;
  CUMULUS_CHECK(im->n_lists <= kMaxLists,
                "n_seqs={} x n_kv_heads={} x head tiles={} = {} lists exceed the kernel's limit of {}", kv.n_seqs,
                kv.n_kv_heads, im->n_tiles, im->n_lists, kMaxLists);
  im->mma = o.tensor_cores && kv.head_dim <= 128;  // head_dim 256: SIMT (see attn_kernel_ptr)
  const AttnKernels<AttnStatic> ks = kv.dtype == DType::f16
                                          ? pick_d<AttnStatic, __half>(kv.head_dim, im->g, im->mma)
                                          : pick_d<AttnStatic, __nv_bfloat16>(kv.head_dim, im->g, im->mma);
  im->kernel = ks.any;
  im->block = block_tokens(kv.head_dim, im->g, im->mma);
  if (o.contiguous_dense) im->kernel_contig = ks.contig;  // taken per call, where its page size allows
  // Dynamic shared memory: the warps' cp.async rings; the warps' results and the merge
  // scratch (a float per thread, a float4 per thread) reuse them.
  auto smem_of = [&](int warps) {
    const size_t merge = std::max(static_cast<size_t>(warps) * im->g * (kv.head_dim + 2) * sizeof(float),
                                  static_cast<size_t>(warps) * 32 * 4 * sizeof(float));
    const size_t ring = static_cast<size_t>(warps) * kStages * 2 * block_tokens(kv.head_dim, im->g, im->mma) *
                        (kv.head_dim + 8) * 2;  // padded rows of 16-bit values
    return std::max(merge, ring);
  };
  // The rings must fit one multiprocessor's shared memory. At head_dim 256 a SIMT warp's
  // ring holds 3 blocks of 8 tokens' 512-byte K and V rows, 25.3 KB: 8 warps (203 KB) fit
  // an H100 (227 KB) but not an A100 (163 KB). The plan then takes the most warps of 8, 4,
  // 2, at most options.warps, whose rings fit (warps() says which); at head_dim 64 and 128
  // every option fits.
  cudaFuncAttributes fa{};
  CUMULUS_CUDA_CHECK(cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(im->kernel)));
  int dev = 0, optin = 0;
  CUMULUS_CUDA_CHECK(cudaGetDevice(&dev));
  CUMULUS_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  im->warps = o.warps;
  while (im->warps > 2 && smem_of(im->warps) + fa.sharedSizeBytes > static_cast<size_t>(optin)) im->warps /= 2;
  CUMULUS_CHECK(smem_of(im->warps) + fa.sharedSizeBytes <= static_cast<size_t>(optin),
                "the attention kernel's rings (head_dim={}, {} warps, {}) need {} bytes of shared memory, the device "
                "allows {}",
                kv.head_dim, im->warps, im->mma ? "tensor cores" : "SIMT", smem_of(im->warps) + fa.sharedSizeBytes,
                optin);
  im->smem = smem_of(im->warps);
  for (AttnKernel<AttnStatic> k : {im->kernel, im->kernel_contig})
    if (k != nullptr)
      CUMULUS_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(k),
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(im->smem)));
  int per_sm = 0;
  CUMULUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, im->kernel, im->warps * 32, im->smem));
  CUMULUS_CHECK(per_sm >= 1, "the attention kernel does not fit a multiprocessor (warps={}, smem={})", im->warps,
                im->smem);
  im->target = sm_count() * (o.ctas_per_sm > 0 ? std::min(o.ctas_per_sm, per_sm) : per_sm);
  im->min_chunk = o.min_chunk > 0 ? o.min_chunk : 2 * block_tokens(kv.head_dim, im->g, im->mma) * im->warps;
  // A grid that holds every chunk: one wave when the cap allows, else each list cut into
  // chunks of at most max_chunk entries.
  const int step = block_tokens(kv.head_dim, im->g, im->mma) * im->warps;
  im->max_chunk = std::max(step, (o.max_chunk > 0 ? o.max_chunk : 32768) / step * step);
  im->max_chunk_lists = std::max(step, (o.max_chunk_lists > 0 ? o.max_chunk_lists : 8192) / step * step);
  auto grid_for = [&](int cap) {
    return std::max(im->target + im->n_lists, im->n_lists * (ceil_div(std::max(1, kv.max_tokens), cap) + 1));
  };
  im->items_dense = grid_for(im->max_chunk);
  im->items_lists = grid_for(im->max_chunk_lists);
  im->max_items = std::max(im->items_dense, im->items_lists);
  const size_t gd = static_cast<size_t>(im->g) * kv.head_dim;
  im->part_o = DeviceBuffer(im->max_items * gd * sizeof(float));
  im->part_m = DeviceBuffer(static_cast<size_t>(im->max_items) * im->g * sizeof(float));
  im->part_l = DeviceBuffer(static_cast<size_t>(im->max_items) * im->g * sizeof(float));
  im->tickets = DeviceBuffer(static_cast<size_t>(im->n_lists) * sizeof(int));
  im->tickets.fill_bytes(0);
  im->prefetch = o.l2_prefetch;
  im->error = DeviceBuffer(sizeof(int));
  im->error.fill_bytes(0);
  impl_ = im.release();
}

AttentionPlan::~AttentionPlan() { delete impl_; }

int AttentionPlan::warps() const { return impl_->warps; }
bool AttentionPlan::tensor_cores() const { return impl_->mma; }

void AttentionPlan::check(void* stream) {
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  int err = 0;
  impl_->error.download(&err, sizeof(int));
  if (err != 0) {
    impl_->error.fill_bytes(0);
    throw Error(fmt::format("attention_decode: {}{}", (err & 1) ? "a list holds a token index outside [0, n_tokens) " : "",
                            (err & 2) ? "a list length is negative or exceeds idx_stride" : ""));
  }
}

void attention_decode(const DeviceDecodeArgs& a, AttentionPlan& plan, void* stream) {
  AttentionPlan::Impl& im = *plan.impl();
  a.kv.validate(__func__);
  CUMULUS_CHECK(a.kv.n_seqs == im.kv.n_seqs && a.kv.n_kv_heads == im.kv.n_kv_heads &&
                    a.kv.head_dim == im.kv.head_dim && a.kv.dtype == im.kv.dtype && a.group == im.group,
                "the plan was made for n_seqs={} n_kv_heads={} head_dim={} dtype={} group={}, the call has {} {} {} {} {}",
                im.kv.n_seqs, im.kv.n_kv_heads, im.kv.head_dim, dtype_name(im.kv.dtype), im.group, a.kv.n_seqs,
                a.kv.n_kv_heads, a.kv.head_dim, dtype_name(a.kv.dtype), a.group);
  CUMULUS_CHECK(std::isfinite(a.scale) && a.scale > 0.0f, "scale={} must be finite and > 0", a.scale);
  CUMULUS_CHECK(a.q != nullptr && a.out != nullptr && a.lse != nullptr, "q, out and lse must be non-null");
  CUMULUS_CHECK((a.idx == nullptr) == (a.idx_len == nullptr), "idx and idx_len must be both set or both null");
  CUMULUS_CHECK(a.idx == nullptr || a.idx_stride >= 1, "idx_stride={} must be >= 1 with a list", a.idx_stride);
  CUMULUS_CHECK((a.mass == nullptr) == (a.lse_ref == nullptr), "mass and lse_ref must be both set or both null");
  AttnParams p{};
  p.k = a.kv.k;
  p.v = a.kv.v;
  p.page_table = a.kv.page_table;
  p.n_tokens = a.kv.n_tokens;
  p.n_kv = a.kv.n_kv_heads;
  p.page_shift = a.kv.page_shift;
  p.max_pages = a.kv.max_pages;
  p.group = a.group;
  p.n_tiles = im.n_tiles;
  p.n_lists = im.n_lists;
  p.qscale = a.scale * kLog2e;
  p.q = a.q;
  p.idx = a.idx;
  p.idx_len = a.idx_len;
  p.idx_stride = a.idx_stride;
  p.out = a.out;
  p.lse = a.lse;
  p.lse_ref = a.lse_ref;
  p.mass = a.mass;
  p.part_o = im.part_o.as<float>();
  p.part_m = im.part_m.as<float>();
  p.part_l = im.part_l.as<float>();
  p.tickets = im.tickets.as<int>();
  p.prefetch = im.prefetch;
  p.error = im.error.as<int>();
  p.target_ctas = im.target;
  p.min_chunk = im.min_chunk;
  p.max_chunk = a.idx != nullptr ? im.max_chunk_lists : im.max_chunk;
  // The contiguous kernel reads a block's rows from one page: only where the call's pages
  // hold whole blocks (the plan's view may have had another page size).
  const bool contig = a.idx == nullptr && im.kernel_contig != nullptr && a.kv.page_size % im.block == 0;
  const AttnKernel<AttnStatic> kernel = contig ? im.kernel_contig : im.kernel;
  const int items = a.idx != nullptr ? im.items_lists : im.items_dense;
  kernel<<<items, im.warps * 32, im.smem, as_stream(stream)>>>(p, AttnStatic::Args{});
  CUMULUS_CUDA_LAUNCH("attention_kernel");
}

}  // namespace cumulus::cuda

