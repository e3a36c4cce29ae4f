// The part every GPU sparse method shares (kernels/cuda_decoder.h): union bitmaps compacted
// into per-kv-head lists, sparse attention over them, host statistics; and the selection
// ops' CUDA backend (kernels/select_ops.h, make_ops_gpu), which runs the methods written
// once against them (methods/policy.h: quest, oracle_topp, oracle_topk, streaming).
#include <cmath>
#include <limits>

#include "core/check.h"
#include "cuda_internal.cuh"
#include "cumulus/kernels/cuda_decoder.h"
#include "kernels/select_ops_check.h"

namespace cumulus::cuda {

SparseDecoder::Base::Base(const DeviceKvView& v, int g, const AttentionPlanOptions& po) : kv(v), group(g) {
  kv.validate("SparseDecoder");
  CUMULUS_CHECK(g >= 1, "group={} must be >= 1", g);
  n_q = kv.n_kv_heads * g;
  n_lists = kv.n_seqs * kv.n_kv_heads;
  stride = std::max(1, kv.max_tokens);
  words = (stride + 31) / 32;
  bits = DeviceBuffer(static_cast<size_t>(n_lists) * words * sizeof(uint32_t));
  bits.fill_bytes(0);
  idx = DeviceBuffer(static_cast<size_t>(n_lists) * stride * sizeof(int32_t));
  len = DeviceBuffer(static_cast<size_t>(n_lists) * sizeof(int32_t));
  len.fill_bytes(0);
  claimed = DeviceBuffer(static_cast<size_t>(kv.n_seqs) * n_q * sizeof(float));
  budget = DeviceBuffer(static_cast<size_t>(kv.n_seqs) * n_q * sizeof(int32_t));
  counts = DeviceBuffer(static_cast<size_t>(n_lists) * bitmap_tiles(words) * sizeof(int));
  lse_own = DeviceBuffer(static_cast<size_t>(kv.n_seqs) * n_q * sizeof(float));
  plan = std::make_unique<AttentionPlan>(kv, g, po);
}

SparseDecoder::SparseDecoder(const DeviceKvView& kv, int group, const AttentionPlanOptions& plan)
    : base_(std::make_unique<Base>(kv, group, plan)) {}
SparseDecoder::~SparseDecoder() = default;

std::vector<std::pair<std::string, double>> sparse_decoder_phase_times(const SparseDecoder& m, void* stream) {
  const SparseDecoder::Base& b = SparseDecoder::Base::of(m);
  if (!b.phase_times) return {};
  return b.phase_times(stream);
}

void SparseDecoder::attend(const float* q, float* out, float* lse, const float* lse_ref, float* mass, void* stream) {
  Base& b = *base_;
  DeviceDecodeArgs a;
  a.kv = b.kv;
  if (b.attend_table != nullptr) a.kv.page_table = b.attend_table;
  a.group = b.group;
  a.scale = 1.0f / std::sqrt(static_cast<float>(b.kv.head_dim));
  a.q = q;
  a.idx = b.dense_step ? nullptr : b.idx.as<int32_t>();  // a dense step attends every token
  a.idx_len = b.dense_step ? nullptr : b.len.as<int32_t>();
  a.idx_stride = b.stride;
  a.out = out;
  if (lse == nullptr && needs_lse()) lse = b.lse_own.as<float>();
  a.lse = lse;
  a.lse_ref = lse_ref;
  a.mass = mass;
  attention_decode(a, *b.plan, stream);
  if (needs_lse()) after_attend(lse, out, mass, stream);
}

void SparseDecoder::set_attend_page_table(const int32_t* table) { base_->attend_table = table; }
const int32_t* SparseDecoder::list_idx() const { return base_->idx.as<int32_t>(); }
bool SparseDecoder::dense_step() const { return base().dense_step; }
const int32_t* SparseDecoder::list_len() const { return base_->len.as<int32_t>(); }
int SparseDecoder::list_stride() const { return base_->stride; }

namespace {

// One CTA: the step's sums (accumulate_stats) reduced in a fixed order, added to acc by
// thread 0. len and claimed null: a dense step (every token, claim 1).
constexpr int kStatsThreads = 256;
__global__ void __launch_bounds__(kStatsThreads)
    stats_accumulate_kernel(const int32_t* __restrict__ len, const int32_t* __restrict__ n_tokens,
                            const float* __restrict__ claimed, const int* __restrict__ bypass, int n_seqs, int n_kv,
                            int group, double extra, int min_tokens, double* acc) {
  __shared__ double red[4][kStatsThreads];
  double v[4] = {0, 0, 0, 0};
  for (int i = threadIdx.x; i < n_seqs * n_kv; i += kStatsThreads) {
    const int n = n_tokens[i / n_kv];
    const int l = len != nullptr ? len[i] : n;
    int heads = group;  // a bypassed head attended no set
    if (bypass != nullptr)
      for (int j = 0; j < group; ++j) heads -= bypass[i * group + j] != 0;
    v[0] += static_cast<double>(l) * heads;
    v[3] += n > 0 ? (static_cast<double>(l) / n + (n > min_tokens ? extra : 0.0)) / n_kv : 0.0;
  }
  for (int r = threadIdx.x; r < n_seqs * n_kv * group; r += kStatsThreads) {
    const float c = claimed != nullptr ? claimed[r] : 1.0f;
    if (!isnan(c)) {
      v[1] += c;
      v[2] += 1;
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) red[k][threadIdx.x] = v[k];
  __syncthreads();
  for (int w = kStatsThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w)
#pragma unroll
      for (int k = 0; k < 4; ++k) red[k][threadIdx.x] += red[k][threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0)
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[k] += red[k][0];
}

}  // namespace

void SparseDecoder::accumulate_stats(double* acc, void* stream) const {
  const Base& b = *base_;
  const bool dense = b.dense_step;
  stats_accumulate_kernel<<<1, kStatsThreads, 0, as_stream(stream)>>>(
      dense ? nullptr : b.len.as<int32_t>(), b.kv.n_tokens, dense ? nullptr : b.claimed.as<float>(),
      dense ? nullptr : b.bypass, b.kv.n_seqs,
      b.kv.n_kv_heads, b.group, select_bytes_per_token() / (2.0 * b.kv.head_dim * dtype_size(b.kv.dtype)),
      select_min_tokens(), acc);
  CUMULUS_CUDA_LAUNCH("stats_accumulate_kernel");
}

SparseStepStats SparseDecoder::stats(void* stream) const {
  CUMULUS_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  const Base& b = *base_;
  SparseStepStats st;
  if (b.dense_step) {  // every token of every list, claim 1
    std::vector<int> n(static_cast<size_t>(b.kv.n_seqs));
    memcpy_to_host(n.data(), b.kv.n_tokens, n.size() * sizeof(int));
    for (int s = 0; s < b.kv.n_seqs; ++s) {
      st.tokens.insert(st.tokens.end(), static_cast<size_t>(b.kv.n_kv_heads), n[s]);
      st.budget.insert(st.budget.end(), static_cast<size_t>(b.n_q), n[s]);
    }
    st.claimed.assign(static_cast<size_t>(b.kv.n_seqs) * b.n_q, 1.0f);
    return st;
  }
  st.tokens = to_host<int>(b.len, b.n_lists);
  st.claimed = to_host<float>(b.claimed, static_cast<size_t>(b.kv.n_seqs) * b.n_q);
  st.budget = to_host<int>(b.budget, static_cast<size_t>(b.kv.n_seqs) * b.n_q);
  if (b.bypass != nullptr) {
    std::vector<int> by(static_cast<size_t>(b.kv.n_seqs) * b.n_q);
    memcpy_to_host(by.data(), b.bypass, by.size() * sizeof(int));
    st.bypass.assign(by.begin(), by.end());
  }
  return st;
}

void SparseDecoder::check(void* stream) { base_->plan->check(stream); }

namespace {

// rowlen[s * n_q + qh] = pages (per_page) or tokens of sequence s.
__global__ void row_len_kernel(const int32_t* __restrict__ n_tokens, int n_seqs, int n_q, int page_size,
                               int page_shift, int per_page, int32_t* __restrict__ rowlen) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_seqs * n_q) return;
  const int n = n_tokens[i / n_q];
  rowlen[i] = per_page ? (n + page_size - 1) >> page_shift : n;
}

// One CTA per (seq, q head) row: the chosen pages' tokens into the group's bitmap.
__global__ void quest_mark_kernel(const int32_t* __restrict__ pages, const int32_t* __restrict__ n_chosen, int k,
                                  const int32_t* __restrict__ n_tokens, int n_q, int group, int n_kv, int page_size,
                                  uint32_t* bits, int words, float* claimed, int32_t* budget) {
  const int row = blockIdx.x;
  const int s = row / n_q, qh = row % n_q;
  const int n = n_tokens[s];
  uint32_t* w = bits + (static_cast<size_t>(s) * n_kv + qh / group) * words;
  const int c = n_chosen[row];
  for (int i = threadIdx.x; i < c; i += blockDim.x) {
    const int p = pages[static_cast<size_t>(row) * k + i];
    bitmap_set_range(w, p * page_size, min(n, (p + 1) * page_size));
  }
  if (threadIdx.x == 0) {
    claimed[row] = __int_as_float(0x7fc00000);  // NaN: a fixed budget makes no claim
    budget[row] = c;
  }
}

// weights[row][i] = exp(scale * (s_i - max_i s)) over the row's valid tokens, in place.
__global__ void softmax_weights_kernel(float* __restrict__ scores, const int32_t* __restrict__ rowlen, int stride,
                                       float scale) {
  __shared__ float s_max[32];
  const int row = blockIdx.x;
  const int n = rowlen[row];
  float* r = scores + static_cast<size_t>(row) * stride;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, r[i]);
  mx = warp_max(mx);
  if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) mx = fmaxf(mx, s_max[w]);
  for (int i = threadIdx.x; i < n; i += blockDim.x) r[i] = expf(scale * (r[i] - mx));
}

// One CTA per (seq, q head) row: the chosen tokens into the group's bitmap, and the row's
// claim: the chosen tokens' share of the row's weights (claim_mass), else NaN.
__global__ void token_mark_kernel(const float* __restrict__ weights, const int32_t* __restrict__ rowlen, int stride,
                                  const int32_t* __restrict__ chosen, int chosen_stride,
                                  const int32_t* __restrict__ n_chosen, int n_q, int group, int n_kv, uint32_t* bits,
                                  int words, int claim_mass, float* claimed, int32_t* budget) {
  __shared__ double s_part[2][32];
  const int row = blockIdx.x;
  const int s = row / n_q, qh = row % n_q;
  const int n = rowlen[row], c = n_chosen[row];
  const float* wr = weights + static_cast<size_t>(row) * stride;
  const int32_t* ch = chosen + static_cast<size_t>(row) * chosen_stride;
  uint32_t* w = bits + (static_cast<size_t>(s) * n_kv + qh / group) * words;
  double tot = 0, sel = 0;
  if (claim_mass)
    for (int i = threadIdx.x; i < n; i += blockDim.x) tot += wr[i];
  for (int i = threadIdx.x; i < c; i += blockDim.x) {
    const int t = ch[i];
    if (claim_mass) sel += wr[t];
    atomicOr(w + (t >> 5), 1u << (t & 31));
  }
  for (int o = 16; o >= 1; o >>= 1) {
    tot += __shfl_xor_sync(0xffffffffu, tot, o);
    sel += __shfl_xor_sync(0xffffffffu, sel, o);
  }
  if ((threadIdx.x & 31) == 0) {
    s_part[0][threadIdx.x >> 5] = tot;
    s_part[1][threadIdx.x >> 5] = sel;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0, sl = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) t += s_part[0][i], sl += s_part[1][i];
    // An empty row claims 0, as the host backends (the chosen tokens' share of nothing).
    claimed[row] = !claim_mass ? __int_as_float(0x7fc00000) : t > 0 ? static_cast<float>(sl / t) : 0.0f;
    budget[row] = c;
  }
}

// One CTA per (seq, kv head): tokens [0, min(head, n)) and [max(0, n - tail), n) into its
// bitmap, a word per thread; its group's rows claim `claim` (NaN: none) and count the
// tokens marked.
__global__ void ends_mark_kernel(const int32_t* __restrict__ n_tokens, int n_kv, int group, int head, int tail,
                                 float claim, uint32_t* bits, int words, float* claimed, int32_t* budget) {
  const int list = blockIdx.x;
  const int s = list / n_kv;
  const int n = n_tokens[s];
  const int a1 = min(head, n), b0 = max(a1, n - tail);  // [0, a1) and [b0, n), disjoint
  uint32_t* w = bits + static_cast<size_t>(list) * words;
  auto bits_of = [](int word, int t0, int t1) -> uint32_t {  // bits of [t0, t1) in `word`
    const int lo = max(t0 - word * 32, 0), hi = min(t1 - word * 32, 32);
    if (lo >= hi) return 0u;
    return (hi - lo == 32 ? 0xffffffffu : ((1u << (hi - lo)) - 1u)) << lo;
  };
  for (int i = threadIdx.x; i < (n + 31) / 32; i += blockDim.x) {
    const uint32_t m = bits_of(i, 0, a1) | bits_of(i, b0, n);
    if (m != 0) atomicOr(w + i, m);
  }
  for (int j = threadIdx.x; j < group; j += blockDim.x) {
    claimed[list * group + j] = claim;
    budget[list * group + j] = a1 + (n - b0);
  }
}

// A decode method written once against the selection ops (kernels/select_ops.h): the
// decoder is the ops' CUDA backend. The constructor runs the step once without launching
// anything to learn which buffers it needs (the ops of a step do not depend on the data);
// select() then enqueues each op's kernels and compacts the unions.
class OpsDecoder final : public SparseDecoder, public SelectOps {
 public:
  OpsDecoder(const DeviceKvView& kv, int group, std::string name, SelectStep step, const AttentionPlanOptions& po)
      : SparseDecoder(kv, group, po), name_(std::move(name)), step_(std::move(step)), check_(name_) {
    CUMULUS_CHECK(step_ != nullptr, "{}: the select step must be set", name_);
    check_.begin();
    step_(*this);  // sizing: records what the ops need, and checks them before any launch
    sizing_ = false;
    const size_t rows = static_cast<size_t>(kv.n_seqs) * base().n_q;
    scores_ = DeviceBuffer(rows * std::max(1, max_units_) * sizeof(float));
    rowlen_ = DeviceBuffer(rows * sizeof(int32_t));
    chosen_ = DeviceBuffer(rows * std::max(1, max_chosen_) * sizeof(int32_t));
    n_chosen_ = DeviceBuffer(rows * sizeof(int32_t));
  }
  std::string name() const override { return name_; }
  double select_bytes_per_token() const override { return select_bytes_; }

  void select(const float* q, void* stream) override {
    q_ = q;
    stream_ = as_stream(stream);
    check_.begin();
    weights_ = false;
    // Every mark op writes every row's claim and budget; a step with none leaves the claims
    // NaN and the budgets 0, as the host ops do.
    if (!marks_) {
      Base& b = base();
      memset_async(b.claimed.data(), 0xff, static_cast<size_t>(b.kv.n_seqs) * b.n_q * sizeof(float), stream);
      memset_async(b.budget.data(), 0, static_cast<size_t>(b.kv.n_seqs) * b.n_q * sizeof(int32_t), stream);
    }
    step_(*this);
    base().compact(stream_);
  }

  int page_size() const override { return base().kv.page_size; }

  void score_tokens() override { score(Units::kTokens); }
  void score_pages_bound() override { score(Units::kPages); }

  void choose_topk(int k) override {
    check_.choose_topk(k);
    chosen_stride_ = std::min(k, units_stride());
    if (sizing_) {
      max_chosen_ = std::max(max_chosen_, chosen_stride_);
      return;
    }
    check_sized();
    const Base& b = base();
    select_topk_rows(scores_.as<float>(), rowlen_.as<int32_t>(), b.kv.n_seqs * b.n_q, units_stride(), chosen_stride_,
                     chosen_.as<int32_t>(), n_chosen_.as<int32_t>(), stream_);
  }

  void choose_top_mass(double p) override {
    check_.choose_top_mass(p);
    chosen_stride_ = units_stride();
    if (sizing_) {
      max_chosen_ = std::max(max_chosen_, chosen_stride_);
      return;
    }
    check_sized();
    const Base& b = base();
    to_weights();
    select_top_mass_rows(scores_.as<float>(), rowlen_.as<int32_t>(), b.kv.n_seqs * b.n_q, units_stride(), p,
                         chosen_.as<int32_t>(), n_chosen_.as<int32_t>(), stream_);
  }

  void mark_chosen(bool claim_mass) override {
    check_.mark_chosen(claim_mass);
    marks_ = marks_ || sizing_;
    if (sizing_) return;
    Base& b = base();
    const int rows = b.kv.n_seqs * b.n_q;
    if (check_.units() == Units::kPages) {
      quest_mark_kernel<<<rows, 128, 0, stream_>>>(chosen_.as<int32_t>(), n_chosen_.as<int32_t>(), chosen_stride_,
                                                   b.kv.n_tokens, b.n_q, b.group, b.kv.n_kv_heads, b.kv.page_size,
                                                   b.bits.as<uint32_t>(), b.words, b.claimed.as<float>(),
                                                   b.budget.as<int32_t>());
      CUMULUS_CUDA_LAUNCH("quest_mark_kernel");
      return;
    }
    if (claim_mass) to_weights();
    token_mark_kernel<<<rows, 256, 0, stream_>>>(scores_.as<float>(), rowlen_.as<int32_t>(), units_stride(),
                                                 chosen_.as<int32_t>(), chosen_stride_, n_chosen_.as<int32_t>(),
                                                 b.n_q, b.group, b.kv.n_kv_heads, b.bits.as<uint32_t>(), b.words,
                                                 claim_mass ? 1 : 0, b.claimed.as<float>(), b.budget.as<int32_t>());
    CUMULUS_CUDA_LAUNCH("token_mark_kernel");
  }

  void mark_ends(int head, int tail) override {
    check_.mark_ends(head, tail);
    ends(head, tail, std::numeric_limits<float>::quiet_NaN());
  }
  void mark_all() override { ends(std::numeric_limits<int>::max(), 0, 1.0f); }

 private:
  using Units = kernels::SelectOpsCheck::Units;

  int units_stride() const { return check_.units() == Units::kPages ? base().kv.max_pages : base().stride; }

  // A step must issue the ops the sizing pass saw: its buffers hold no more.
  void check_sized() const {
    CUMULUS_CHECK(units_stride() <= max_units_ && chosen_stride_ <= max_chosen_,
                  "{}: this step's ops need {} scores and {} chosen per row, the decoder was sized for {} and {} (a "
                  "policy must issue the same ops at every step)",
                  name_, units_stride(), chosen_stride_, max_units_, max_chosen_);
  }

  void score(Units u) {
    check_.score(u);
    weights_ = false;
    const Base& b = base();
    if (u == Units::kPages)
      CUMULUS_CHECK(b.kv.kmin != nullptr && b.kv.kmax != nullptr, "{}: score_pages_bound needs kv.kmin and kv.kmax",
                    name_);
    if (sizing_) {
      max_units_ = std::max(max_units_, units_stride());
      // Bytes per cached token the scoring reads, as the host backends count them: every
      // key, or the pages' key min and max in float32.
      select_bytes_ += u == Units::kPages ? 2.0 * b.kv.head_dim * sizeof(float) / b.kv.page_size
                                          : static_cast<double>(b.kv.head_dim) * dtype_size(b.kv.dtype);
      return;
    }
    const int rows = b.kv.n_seqs * b.n_q;
    row_len_kernel<<<ceil_div(rows, 256), 256, 0, stream_>>>(b.kv.n_tokens, b.kv.n_seqs, b.n_q, b.kv.page_size,
                                                             b.kv.page_shift, u == Units::kPages ? 1 : 0,
                                                             rowlen_.as<int32_t>());
    CUMULUS_CUDA_LAUNCH("row_len_kernel");
    check_sized();
    if (u == Units::kPages) {
      page_score(b.kv, b.group, PageScoreKind::kBound, q_, scores_.as<float>(), stream_);
    } else {
      token_score(b.kv, b.group, q_, nullptr, nullptr, 0, scores_.as<float>(), b.stride, stream_);
    }
  }

  // The token scores become softmax weights (in place; monotone, so a later top-k ranks
  // as the scores would, up to exp's ties).
  void to_weights() {
    if (weights_) return;
    weights_ = true;
    const Base& b = base();
    softmax_weights_kernel<<<b.kv.n_seqs * b.n_q, 512, 0, stream_>>>(
        scores_.as<float>(), rowlen_.as<int32_t>(), b.stride, 1.0f / std::sqrt(static_cast<float>(b.kv.head_dim)));
    CUMULUS_CUDA_LAUNCH("softmax_weights_kernel");
  }

  void ends(int head, int tail, float claim) {
    marks_ = marks_ || sizing_;
    if (sizing_) return;
    Base& b = base();
    ends_mark_kernel<<<b.n_lists, 256, 0, stream_>>>(b.kv.n_tokens, b.kv.n_kv_heads, b.group, head, tail, claim,
                                                     b.bits.as<uint32_t>(), b.words, b.claimed.as<float>(),
                                                     b.budget.as<int32_t>());
    CUMULUS_CUDA_LAUNCH("ends_mark_kernel");
  }

  std::string name_;
  SelectStep step_;
  bool sizing_ = true;
  bool marks_ = false;  // the step has a mark op (seen by the sizing pass)
  int max_units_ = 0, max_chosen_ = 0;
  double select_bytes_ = 0;
  // The step being enqueued.
  const float* q_ = nullptr;
  cudaStream_t stream_ = nullptr;
  kernels::SelectOpsCheck check_;  // the ops of the step being issued
  bool weights_ = false;
  int chosen_stride_ = 1;
  DeviceBuffer scores_, rowlen_, chosen_, n_chosen_;
};

}  // namespace

std::unique_ptr<SparseDecoder> make_ops_gpu(const DeviceKvView& kv, int group, std::string name, SelectStep step,
                                            const AttentionPlanOptions& plan) {
  return std::make_unique<OpsDecoder>(kv, group, std::move(name), std::move(step), plan);
}

}  // namespace cumulus::cuda
