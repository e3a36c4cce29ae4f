// Paged KV cache (docs/architecture.md "Core types"; Quest section 3 for the per-page key
// min/max, PSA section 3 for the per-page mean key).
//
// Per (layer, kv head) the cache owns pages of page_size tokens:
//   K page: [page_size][head_dim], V page: [page_size][head_dim] in the storage dtype,
// carved out of 64-byte-aligned slabs that are never moved or freed before the cache is,
// so a page pointer handed out in a view stays valid while later appends add pages.
// Next to the pages it keeps float32 key statistics per page, contiguous per head:
//   kmin, kmax, kmean: [n_pages][head_dim]   (what PagedHeadView exposes)
//   ksum:              [n_pages][head_dim]   float64 running sums behind kmean
// All statistics are taken over the keys as STORED (rounded to the dtype), so Quest's
// bound sum_j max(q_j kmin_j, q_j kmax_j) >= q.k holds exactly for the keys kernels read.
#include "cumulus/kv/kv_cache.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "cumulus/core/buffer.h"

namespace cumulus {

namespace {

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

// Bytes from one page start to the next inside a slab: a K (or V) page rounded up to the
// cache line so every page begins on a 64-byte boundary.
size_t page_stride_bytes(int page_size, int head_dim, DType dtype) {
  const size_t bytes = static_cast<size_t>(page_size) * head_dim * dtype_size(dtype);
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

}  // namespace

struct KvCache::HeadStore {
  // One allocation per slab: `count` K pages followed by `count` V pages.
  std::vector<std::unique_ptr<std::byte, FreeDeleter>> slabs;
  size_t slab_bytes = 0;             // all slabs together
  std::vector<const void*> k_pages;  // [n_pages_allocated] (window layers: logical pages, nullptr = dropped)
  std::vector<const void*> v_pages;  // [n_pages_allocated]
  std::vector<std::pair<void*, void*>> free_pages;  // window layers: (K, V) pages to reuse
  AlignedVector<float> kmin, kmax, kmean;  // [n_pages_used][head_dim] (not for window layers)
  std::vector<double> ksum;                // [n_pages_used][head_dim]
};

KvCache::KvCache(const Shape& shape, const KvCacheOptions& options, std::vector<int> layer_window)
    : shape_(shape), options_(options) {
  shape_.validate();
  const int ps = options_.page_size;
  CUMULUS_CHECK(ps >= 1 && ps <= 256 && (ps & (ps - 1)) == 0, "page_size={} must be a power of two in [1, 256]",
                ps);
  CUMULUS_CHECK(options_.dtype == DType::f32 || options_.dtype == DType::f16 || options_.dtype == DType::bf16,
                "dtype={} is not one of f32, f16, bf16", static_cast<int>(options_.dtype));
  CUMULUS_CHECK(options_.max_tokens >= 1, "max_tokens={} must be >= 1", options_.max_tokens);
  CUMULUS_CHECK(layer_window.empty() || layer_window.size() == static_cast<size_t>(shape_.n_layers),
                "layer_window has {} entries for {} layers", layer_window.size(), shape_.n_layers);
  window_.assign(shape_.n_layers, 0);
  for (size_t l = 0; l < layer_window.size(); ++l) {
    CUMULUS_CHECK(layer_window[l] >= 0, "layer_window[{}]={} must be >= 0", l, layer_window[l]);
    window_[l] = layer_window[l];
  }
  window_first_page_.assign(shape_.n_layers, 0);
  n_tokens_.assign(shape_.n_layers, 0);
  generation_.assign(shape_.n_layers, 0);
  heads_.resize(static_cast<size_t>(shape_.n_layers) * shape_.n_kv_heads);
  for (auto& h : heads_) h = std::make_unique<HeadStore>();
}

KvCache::~KvCache() = default;
KvCache::KvCache(KvCache&&) noexcept = default;
KvCache& KvCache::operator=(KvCache&&) noexcept = default;

KvCache::HeadStore& KvCache::head(int layer, int kv_head) {
  return *heads_[static_cast<size_t>(layer) * shape_.n_kv_heads + kv_head];
}

const KvCache::HeadStore& KvCache::head(int layer, int kv_head) const {
  return *heads_[static_cast<size_t>(layer) * shape_.n_kv_heads + kv_head];
}

int KvCache::n_tokens(int layer) const {
  CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
  return n_tokens_[layer];
}

void KvCache::append(int layer, const float* k, const float* v, int n) { append_rows(layer, k, v, n, false); }

void KvCache::append_stored(int layer, const void* k, const void* v, int n) { append_rows(layer, k, v, n, true); }

namespace {

// Whether element i of a row in `dt` (stored bits) is finite: the exponent is not all ones.
bool stored_finite(const void* src, DType dt, size_t i) {
  switch (dt) {
    case DType::f32: return std::isfinite(static_cast<const float*>(src)[i]);
    case DType::f16: return (static_cast<const uint16_t*>(src)[i] & 0x7c00u) != 0x7c00u;
    case DType::bf16: return (static_cast<const uint16_t*>(src)[i] & 0x7f80u) != 0x7f80u;
  }
  return false;
}

}  // namespace

void KvCache::append_rows(int layer, const void* k, const void* v, int n, bool raw) {
  CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
  CUMULUS_CHECK(n >= 1, "n={} must be >= 1", n);
  CUMULUS_CHECK(k != nullptr && v != nullptr, "k={} and v={} must be non-null", k, v);
  const int t0 = n_tokens_[layer];
  CUMULUS_CHECK(static_cast<int64_t>(t0) + n <= options_.max_tokens,
                "n={} would overflow max_tokens={} (layer {} holds {} tokens)", n, options_.max_tokens, layer, t0);

  const int H = shape_.n_kv_heads;
  const int d = shape_.head_dim;
  const DType dt = options_.dtype;
  // Check everything before writing anything, so a rejected append leaves the cache as it
  // was. k, v: [n][n_kv_heads][head_dim].
  const size_t total = static_cast<size_t>(n) * H * d;
  for (const void* src : {k, v}) {
    for (size_t i = 0; i < total; ++i) {
      const bool finite = raw ? stored_finite(src, dt, i) : std::isfinite(static_cast<const float*>(src)[i]);
      if (!finite) [[unlikely]] {
        const size_t t = i / (static_cast<size_t>(H) * d);
        const size_t h = (i / d) % H;
        const size_t j = i % d;
        CUMULUS_FAIL("{}[token={}][head={}][dim={}]={} is not finite (layer {}, position {})", src == k ? "k" : "v", t,
                     h, j, raw ? dtype_load(src, dt, i) : static_cast<const float*>(src)[i], layer, t0 + t);
      }
    }
  }

  const int ps = options_.page_size;
  const int shift = std::countr_zero(static_cast<unsigned>(ps));
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(dt);
  const size_t stride = page_stride_bytes(ps, d, dt);
  const int pages_needed = (t0 + n + ps - 1) >> shift;
  const bool windowed = window_[layer] > 0;
  // The first new row (position t0) reads tokens from t0 - w + 1 on.
  if (windowed) drop_window_pages(layer, t0 - window_[layer] + 1);
  std::vector<float> stored(d);  // [head_dim] one key as it reads back from storage

  for (int h = 0; h < H; ++h) {
    HeadStore& s = head(layer, h);
    if (windowed) {
      // The new tokens' pages: reused from the dropped ones where there are any.
      for (int p = t0 >> shift; p < pages_needed; ++p)
        if (p >= static_cast<int>(s.k_pages.size()) || s.k_pages[static_cast<size_t>(p)] == nullptr) window_page_acquire(s, p);
    }
    // Grow page storage. Slabs double the page count so a long prefill makes O(log n)
    // allocations, capped by what max_tokens can still use.
    const int have = static_cast<int>(s.k_pages.size());
    if (!windowed && have < pages_needed) {
      const int max_pages = (options_.max_tokens + ps - 1) >> shift;
      int count = std::max({pages_needed - have, have, 4});
      count = std::min(count, max_pages - have);
      const size_t bytes = 2 * static_cast<size_t>(count) * stride;
      void* mem = alloc_large(bytes);  // huge pages where the slab is large enough
      std::memset(mem, 0, bytes);  // padding rows of partial pages read back as zero
      s.slabs.emplace_back(static_cast<std::byte*>(mem));
      s.slab_bytes += bytes;
      auto* base = static_cast<std::byte*>(mem);
      for (int i = 0; i < count; ++i) s.k_pages.push_back(base + static_cast<size_t>(i) * stride);
      for (int i = 0; i < count; ++i) s.v_pages.push_back(base + static_cast<size_t>(count + i) * stride);
    }
    const size_t meta = static_cast<size_t>(pages_needed) * d;
    if (!windowed && s.kmin.size() < meta) {
      s.kmin.resize(meta);
      s.kmax.resize(meta);
      s.kmean.resize(meta);
      s.ksum.resize(meta);
    }

    for (int i = 0; i < n; ++i) {
      const int t = t0 + i;
      const int p = t >> shift;
      const int row = t & (ps - 1);
      const size_t src_off = (static_cast<size_t>(i) * H + h) * d;
      auto* kdst = static_cast<std::byte*>(const_cast<void*>(s.k_pages[p])) + row * row_bytes;
      auto* vdst = static_cast<std::byte*>(const_cast<void*>(s.v_pages[p])) + row * row_bytes;
      if (raw) {
        std::memcpy(kdst, static_cast<const std::byte*>(k) + src_off * dtype_size(dt), row_bytes);
        std::memcpy(vdst, static_cast<const std::byte*>(v) + src_off * dtype_size(dt), row_bytes);
      } else {
        convert_from_f32(static_cast<const float*>(k) + src_off, kdst, dt, d);
        convert_from_f32(static_cast<const float*>(v) + src_off, vdst, dt, d);
      }
      if (windowed) continue;  // no statistics: no method reads a window layer's pages
      convert_to_f32(kdst, dt, stored.data(), d);

      float* mn = s.kmin.data() + static_cast<size_t>(p) * d;
      float* mx = s.kmax.data() + static_cast<size_t>(p) * d;
      float* mean = s.kmean.data() + static_cast<size_t>(p) * d;
      double* sum = s.ksum.data() + static_cast<size_t>(p) * d;
      if (row == 0) {  // first token of a page (also after clear(): stale values are overwritten)
        for (int j = 0; j < d; ++j) {
          mn[j] = mx[j] = stored[j];
          sum[j] = stored[j];
        }
      } else {
        for (int j = 0; j < d; ++j) {
          mn[j] = std::min(mn[j], stored[j]);
          mx[j] = std::max(mx[j], stored[j]);
          sum[j] += stored[j];
        }
      }
      // The mean is over the page's valid tokens (row + 1 of them), also for a partial page.
      const double len = row + 1;
      for (int j = 0; j < d; ++j) mean[j] = static_cast<float>(sum[j] / len);
    }
  }
  n_tokens_[layer] = t0 + n;
}

void KvCache::copy_prefix_from(const KvCache& src, int n) {
  const Shape& s = src.shape();
  CUMULUS_CHECK(s.n_layers == shape_.n_layers && s.n_kv_heads == shape_.n_kv_heads && s.head_dim == shape_.head_dim &&
                    src.page_size() == page_size() && src.dtype() == dtype() && src.window_ == window_,
                "KvCache::copy_prefix_from: the source cache (n_layers={}, n_kv_heads={}, head_dim={}, page_size={}, "
                "dtype={}) is not shaped as this one (n_layers={}, n_kv_heads={}, head_dim={}, page_size={}, dtype={}), "
                "or their windows differ",
                s.n_layers, s.n_kv_heads, s.head_dim, src.page_size(), dtype_name(src.dtype()), shape_.n_layers,
                shape_.n_kv_heads, shape_.head_dim, page_size(), dtype_name(dtype()));
  CUMULUS_CHECK(n >= 0 && n <= options_.max_tokens, "KvCache::copy_prefix_from: n={} must be in [0, {}]", n,
                options_.max_tokens);
  std::vector<int> first(static_cast<size_t>(s.n_layers), 0);
  for (int l = 0; l < s.n_layers; ++l) {
    CUMULUS_CHECK(n_tokens(l) == 0, "KvCache::copy_prefix_from into a cache whose layer {} holds {} tokens", l,
                  n_tokens(l));
    CUMULUS_CHECK(src.n_tokens(l) >= n, "KvCache::copy_prefix_from: n={} but the source's layer {} holds {} tokens", n,
                  l, src.n_tokens(l));
    first[static_cast<size_t>(l)] = first_needed(l, n);
    for (int h = 0; h < s.n_kv_heads; ++h) {
      const PagedHeadView v = src.view(l, h);
      for (int t = first[static_cast<size_t>(l)]; t < n; t += page_size())
        CUMULUS_CHECK(v.k_pages[t >> v.page_shift] != nullptr,
                      "KvCache::copy_prefix_from: the source's layer {} no longer holds token {}", l, t);
    }
  }
  // Rows go over in pieces of [chunk][n_kv_heads][head_dim], the layout append_stored takes.
  const size_t es = dtype_size(dtype()), hd = static_cast<size_t>(shape_.head_dim);
  const size_t row = static_cast<size_t>(shape_.n_kv_heads) * hd * es;
  constexpr int kChunk = 256;
  std::vector<std::byte> k(kChunk * row), v(kChunk * row);
  for (int l = 0; l < s.n_layers; ++l) {
    const int from = first[static_cast<size_t>(l)];
    if (from > 0) append_dropped(l, from);
    for (int t0 = from; t0 < n; t0 += kChunk) {
      const int c = std::min(kChunk, n - t0);
      for (int h = 0; h < s.n_kv_heads; ++h) {
        const PagedHeadView view = src.view(l, h);
        for (int i = 0; i < c; ++i) {
          const size_t at = static_cast<size_t>(i) * row + static_cast<size_t>(h) * hd * es;
          std::memcpy(k.data() + at, view.key(t0 + i), hd * es);
          std::memcpy(v.data() + at, view.value(t0 + i), hd * es);
        }
      }
      append_stored(l, k.data(), v.data(), c);
    }
  }
}

void KvCache::append_dropped(int layer, int n) {
  CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
  CUMULUS_CHECK(window_[layer] > 0, "append_dropped(layer={}): the layer keeps every token (no window)", layer);
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  const int t0 = n_tokens_[layer];
  CUMULUS_CHECK(static_cast<int64_t>(t0) + n <= options_.max_tokens,
                "n={} would overflow max_tokens={} (layer {} holds {} tokens)", n, options_.max_tokens, layer, t0);
  const int ps = options_.page_size;
  // Pages wholly before the new end hold nothing the layer reads: drop them (and any row
  // of a page cut short stays as it is: its remaining rows are the tokens appended next).
  drop_window_pages(layer, t0 + n);
  n_tokens_[layer] = t0 + n;
  const int full = (t0 + n) / ps;  // pages wholly dropped
  for (int h = 0; h < shape_.n_kv_heads; ++h) {
    HeadStore& s = head(layer, h);
    if (static_cast<int>(s.k_pages.size()) < full) {
      s.k_pages.resize(static_cast<size_t>(full), nullptr);
      s.v_pages.resize(static_cast<size_t>(full), nullptr);
    }
  }
}

int KvCache::window(int layer) const {
  CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
  return window_[layer];
}

int KvCache::first_needed(int layer) const {
  CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
  return first_needed(layer, n_tokens_[layer]);
}

int KvCache::first_needed(int layer, int n) const {
  CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
  return window_[layer] > 0 ? std::max(0, n - window_[layer] + 1) : 0;
}

bool KvCache::pinned_page(int layer, int p) const {
  if (pin_ <= 0) return false;
  const int ps = options_.page_size;
  const int lo = std::max(0, pin_ - window_[layer] + 1);  // pinned tokens [lo, pin_)
  return lo < pin_ && p >= lo / ps && p <= (pin_ - 1) / ps;
}

void KvCache::window_page_acquire(HeadStore& s, int p) {
  const int ps = options_.page_size;
  const size_t stride = page_stride_bytes(ps, shape_.head_dim, options_.dtype);
  if (s.free_pages.empty()) {
    // A new slab: as many pages as the head holds live, at least 4 (so the live set, which
    // a window bounds, is allocated in O(log) slabs), capped by max_tokens.
    size_t live = 0;
    for (const void* k : s.k_pages) live += k != nullptr;
    const int max_pages = (options_.max_tokens + ps - 1) / ps;
    const int count = std::max(1, std::min(std::max<int>(static_cast<int>(live), 4), max_pages));
    const size_t bytes = 2 * static_cast<size_t>(count) * stride;
    void* mem = alloc_large(bytes);
    std::memset(mem, 0, bytes);
    s.slabs.emplace_back(static_cast<std::byte*>(mem));
    s.slab_bytes += bytes;
    auto* base = static_cast<std::byte*>(mem);
    for (int i = count - 1; i >= 0; --i)
      s.free_pages.emplace_back(base + static_cast<size_t>(i) * stride, base + static_cast<size_t>(count + i) * stride);
  } else {
    // A reused page reads back as a fresh one: zero (the padding rows of a partial page).
    std::memset(s.free_pages.back().first, 0, stride);
    std::memset(s.free_pages.back().second, 0, stride);
  }
  const auto [k, v] = s.free_pages.back();
  s.free_pages.pop_back();
  if (p >= static_cast<int>(s.k_pages.size())) {
    s.k_pages.resize(static_cast<size_t>(p) + 1, nullptr);
    s.v_pages.resize(static_cast<size_t>(p) + 1, nullptr);
  }
  s.k_pages[static_cast<size_t>(p)] = k;
  s.v_pages[static_cast<size_t>(p)] = v;
}

void KvCache::window_page_release(HeadStore& s, int p) {
  if (p >= static_cast<int>(s.k_pages.size()) || s.k_pages[static_cast<size_t>(p)] == nullptr) return;
  s.free_pages.emplace_back(const_cast<void*>(s.k_pages[static_cast<size_t>(p)]), const_cast<void*>(s.v_pages[static_cast<size_t>(p)]));
  s.k_pages[static_cast<size_t>(p)] = nullptr;
  s.v_pages[static_cast<size_t>(p)] = nullptr;
}

void KvCache::drop_window_pages(int layer, int keep_from) {
  const int end = std::max(0, keep_from) / options_.page_size;  // pages [0, end) hold only tokens < keep_from
  for (int p = window_first_page_[layer]; p < end; ++p) {
    if (pinned_page(layer, p)) continue;
    for (int h = 0; h < shape_.n_kv_heads; ++h) window_page_release(head(layer, h), p);
  }
  window_first_page_[layer] = std::max(window_first_page_[layer], end);
}

void KvCache::pin_window(int n) {
  CUMULUS_CHECK(n >= 0, "pin_window(n={}): n must be >= 0", n);
  for (int l = 0; l < shape_.n_layers; ++l) {
    if (window_[l] == 0) continue;
    CUMULUS_CHECK(n <= n_tokens_[l], "pin_window(n={}) beyond the {} tokens cached in layer {}", n, n_tokens_[l], l);
    const int lo = std::max(0, n - window_[l] + 1);
    for (int t = lo; t < n; t += options_.page_size - t % options_.page_size)
      CUMULUS_CHECK(head(l, 0).k_pages.size() > static_cast<size_t>(t / options_.page_size) &&
                        head(l, 0).k_pages[static_cast<size_t>(t / options_.page_size)] != nullptr,
                    "pin_window(n={}): layer {} (window {}) dropped token {} already", n, l, window_[l], t);
  }
  pin_ = n;
  // Pages the previous pin kept and this one does not.
  for (int l = 0; l < shape_.n_layers; ++l)
    if (window_[l] > 0)
      for (int p = 0; p < window_first_page_[l]; ++p)
        if (!pinned_page(l, p))
          for (int h = 0; h < shape_.n_kv_heads; ++h) window_page_release(head(l, h), p);
}

size_t KvCache::bytes_allocated() const {
  size_t b = 0;
  for (const auto& s : heads_)
    b += s->slab_bytes + (s->kmin.capacity() + s->kmax.capacity() + s->kmean.capacity()) * sizeof(float) +
         s->ksum.capacity() * sizeof(double);
  return b;
}

void KvCache::clear() { truncate(0); }

uint64_t KvCache::generation(int layer) const {
  CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
  return generation_[static_cast<size_t>(layer)];
}

void KvCache::truncate(int n) {
  CUMULUS_CHECK(n >= 0, "n={} must be >= 0", n);
  for (int l = 0; l < shape_.n_layers; ++l)
    CUMULUS_CHECK(n <= n_tokens_[l], "n={} exceeds the {} tokens cached in layer {}", n, n_tokens_[l], l);
  // A window layer must still hold what the query at n reads.
  for (int l = 0; l < shape_.n_layers; ++l) {
    if (window_[l] == 0 || n == n_tokens_[l]) continue;
    const int lo = std::max(0, n - window_[l] + 1);
    for (int t = lo; t < n; t += options_.page_size - t % options_.page_size) {
      const auto& pages = head(l, 0).k_pages;
      const auto p = static_cast<size_t>(t / options_.page_size);
      CUMULUS_CHECK(p < pages.size() && pages[p] != nullptr,
                    "truncate(n={}): layer {} keeps only its window of {} tokens and dropped token {}, which the "
                    "query at {} reads (pin_window({}) keeps them)",
                    n, l, window_[l], t, n, n);
    }
  }
  const int ps = options_.page_size;
  const int d = shape_.head_dim;
  const DType dt = options_.dtype;
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(dt);
  const int p = n / ps, rows = n % ps;  // the page cut short and the rows it keeps
  std::vector<float> stored(d);
  for (int l = 0; l < shape_.n_layers; ++l) {
    const int old_n = n_tokens_[l];
    if (old_n == n) continue;
    n_tokens_[l] = n;
    // Pages below the window of n are dropped or pinned; the next appends examine them again.
    if (window_[l] > 0) window_first_page_[l] = std::min(window_first_page_[l], std::max(0, n - window_[l] + 1) / ps);
    ++generation_[l];
    for (int h = 0; h < shape_.n_kv_heads; ++h) {
      HeadStore& s = head(l, h);
      // Zero the dropped rows, as a fresh slab holds zeros: kernels may read the padding
      // rows of a partial page, and later appends must see what a fresh cache would.
      for (int t = n; t < old_n;) {
        const int r = t % ps, len = std::min(ps - r, old_n - t);
        const auto q = static_cast<size_t>(t / ps);
        if (q < s.k_pages.size() && s.k_pages[q] != nullptr)  // else a window layer's dropped page
          for (const void* page : {s.k_pages[q], s.v_pages[q]})
            std::memset(static_cast<std::byte*>(const_cast<void*>(page)) + r * row_bytes, 0, len * row_bytes);
        t += len;
      }
      if (window_[l] > 0) {
        // Pages past the new end go back to the free pages (the next appends take them).
        for (int q = (n + ps - 1) / ps; q < static_cast<int>(s.k_pages.size()); ++q) window_page_release(s, q);
        continue;  // no statistics
      }
      if (rows == 0) continue;  // page p is empty: the next append starts its statistics afresh
      float* mn = s.kmin.data() + static_cast<size_t>(p) * d;
      float* mx = s.kmax.data() + static_cast<size_t>(p) * d;
      float* mean = s.kmean.data() + static_cast<size_t>(p) * d;
      double* sum = s.ksum.data() + static_cast<size_t>(p) * d;
      for (int r = 0; r < rows; ++r) {
        convert_to_f32(static_cast<const std::byte*>(s.k_pages[p]) + r * row_bytes, dt, stored.data(), d);
        for (int j = 0; j < d; ++j) {
          mn[j] = r == 0 ? stored[j] : std::min(mn[j], stored[j]);
          mx[j] = r == 0 ? stored[j] : std::max(mx[j], stored[j]);
          sum[j] = (r == 0 ? 0.0 : sum[j]) + stored[j];
        }
      }
      for (int j = 0; j < d; ++j) mean[j] = static_cast<float>(sum[j] / rows);
    }
  }
}

PagedHeadView KvCache::view(int layer, int kv_head) const {
  CUMULUS_CHECK(layer >= 0 && layer < shape_.n_layers, "layer={} out of range [0, {})", layer, shape_.n_layers);
  CUMULUS_CHECK(kv_head >= 0 && kv_head < shape_.n_kv_heads, "kv_head={} out of range [0, {})", kv_head,
                shape_.n_kv_heads);
  const HeadStore& s = head(layer, kv_head);
  PagedHeadView v;
  v.k_pages = s.k_pages.data();
  v.v_pages = s.v_pages.data();
  const bool stats = window_[layer] == 0;
  v.kmin = stats ? s.kmin.data() : nullptr;
  v.kmax = stats ? s.kmax.data() : nullptr;
  v.kmean = stats ? s.kmean.data() : nullptr;
  v.n_tokens = n_tokens_[layer];
  v.head_dim = shape_.head_dim;
  v.page_size = options_.page_size;
  v.page_shift = std::countr_zero(static_cast<unsigned>(options_.page_size));
  v.dtype = options_.dtype;
  return v;
}

void KvCache::key_f32(int layer, int kv_head, int t, float* out) const {
  CUMULUS_CHECK(out != nullptr, "out must be non-null");
  const PagedHeadView v = view(layer, kv_head);
  CUMULUS_CHECK(t >= 0 && t < v.n_tokens, "t={} out of range [0, {})", t, v.n_tokens);
  CUMULUS_CHECK(v.k_pages[t >> v.page_shift] != nullptr, "t={}: layer {} keeps only its window of {} tokens", t, layer,
                window_[layer]);
  convert_to_f32(v.key(t), v.dtype, out, v.head_dim);
}

void KvCache::value_f32(int layer, int kv_head, int t, float* out) const {
  CUMULUS_CHECK(out != nullptr, "out must be non-null");
  const PagedHeadView v = view(layer, kv_head);
  CUMULUS_CHECK(t >= 0 && t < v.n_tokens, "t={} out of range [0, {})", t, v.n_tokens);
  CUMULUS_CHECK(v.v_pages[t >> v.page_shift] != nullptr, "t={}: layer {} keeps only its window of {} tokens", t, layer,
                window_[layer]);
  convert_to_f32(v.value(t), v.dtype, out, v.head_dim);
}

}  // namespace cumulus
