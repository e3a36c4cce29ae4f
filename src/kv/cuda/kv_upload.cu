// The upload of paged KV caches (one layer, a batch of sequences) into a device page pool
// with its page table and per-page key statistics (kv/cuda_kv_cache.h).
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "core/check.h"
#include "core/cuda/cuda_util.cuh"
#include "cumulus/kv/cuda_kv_cache.h"

namespace cumulus::cuda {

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
