// KV cache: stored keys and values are the inputs rounded to the storage dtype, and the
// per-page key min, max and mean ([n_pages][head_dim] per head) equal a recomputation from
// key_f32 after appends of 1 and many tokens that cross page boundaries and leave partial
// last pages; page pointers stay put as the cache grows; bad input names the bad value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kv/kv_cache.h"
#include "kernel_check.h"

using namespace cumulus;

namespace {

using check::expect_error;

// Random K and V rows [n][n_kv_heads][head_dim], never zero, with an offset per dimension
// so page min/max/mean differ from dimension to dimension.
void random_kv(std::mt19937& rng, const Shape& s, int n, std::vector<float>& k, std::vector<float>& v) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t total = static_cast<size_t>(n) * s.n_kv_heads * s.head_dim;
  k.resize(total);
  v.resize(total);
  for (size_t i = 0; i < total; ++i) {
    k[i] = 2.0f * nd(rng) + 0.1f * static_cast<float>(i % s.head_dim);
    v[i] = nd(rng);
  }
}

// Checks every stored key/value against the dtype-rounded inputs, and every page's
// statistics against a recomputation from key_f32.
//   inputs_k, inputs_v: [n_tokens][n_kv_heads][head_dim] everything appended to `layer`
void check_cache(const KvCache& kv, int layer, const std::vector<float>& inputs_k,
                 const std::vector<float>& inputs_v) {
  const Shape& s = kv.shape();
  const int d = s.head_dim;
  const int n = kv.n_tokens(layer);
  ASSERT_EQ(static_cast<size_t>(n) * s.n_kv_heads * d, inputs_k.size());
  std::vector<float> row(d);
  for (int h = 0; h < s.n_kv_heads; ++h) {
    const PagedHeadView v = kv.view(layer, h);
    ASSERT_EQ(v.n_tokens, n);
    ASSERT_EQ(v.page_size, kv.page_size());
    ASSERT_EQ(1 << v.page_shift, v.page_size);
    ASSERT_EQ(v.dtype, kv.dtype());
    std::vector<std::vector<float>> keys(n, std::vector<float>(d));
    for (int t = 0; t < n; ++t) {
      kv.key_f32(layer, h, t, keys[t].data());
      kv.value_f32(layer, h, t, row.data());
      const size_t off = (static_cast<size_t>(t) * s.n_kv_heads + h) * d;
      for (int j = 0; j < d; ++j) {
        ASSERT_EQ(keys[t][j], dtype_round(inputs_k[off + j], kv.dtype())) << "t=" << t << " h=" << h << " j=" << j;
        ASSERT_EQ(row[j], dtype_round(inputs_v[off + j], kv.dtype())) << "t=" << t << " h=" << h << " j=" << j;
      }
      // The view addresses the same bytes key_f32 reads.
      std::vector<float> via_view(d);
      convert_to_f32(v.key(t), v.dtype, via_view.data(), d);
      ASSERT_EQ(via_view, keys[t]);
      ASSERT_EQ(reinterpret_cast<uintptr_t>(v.k_pages[t >> v.page_shift]) % 64, 0u);
      ASSERT_EQ(reinterpret_cast<uintptr_t>(v.v_pages[t >> v.page_shift]) % 64, 0u);
    }
    ASSERT_EQ(v.n_pages(), (n + kv.page_size() - 1) / kv.page_size());
    for (int p = 0; p < v.n_pages(); ++p) {
      const int t0 = p * v.page_size;
      const int len = v.page_len(p);
      for (int j = 0; j < d; ++j) {
        float mn = keys[t0][j], mx = keys[t0][j];
        double sum = 0;
        for (int t = t0; t < t0 + len; ++t) {
          mn = std::min(mn, keys[t][j]);
          mx = std::max(mx, keys[t][j]);
          sum += keys[t][j];
        }
        const size_t m = static_cast<size_t>(p) * d + j;
        ASSERT_EQ(v.kmin[m], mn) << "page " << p << " dim " << j;
        ASSERT_EQ(v.kmax[m], mx) << "page " << p << " dim " << j;
        ASSERT_EQ(v.kmean[m], static_cast<float>(sum / len)) << "page " << p << " dim " << j;
      }
    }
  }
}

}  // namespace

TEST(KvCache, MetadataMatchesRecomputationAcrossPagesDtypesAndAppendSizes) {
  const Shape s{2, 6, 3, 24};  // head_dim 24: not a multiple of a 16-lane vector
  for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
    for (int ps : {1, 16, 256}) {
      std::mt19937 rng(100 + ps + static_cast<int>(dt));
      KvCacheOptions opt;
      opt.page_size = ps;
      opt.dtype = dt;
      opt.max_tokens = 4096;
      KvCache kv(s, opt);
      std::vector<float> all_k[2], all_v[2], k, v;
      // Appends of 1 and many tokens, crossing page boundaries, ending on partial pages.
      // Layer 1 fills on a different schedule to show layers are independent.
      const int sizes0[] = {1, 1, 3, 15, 17, 1, 255, 16, 2};
      const int sizes1[] = {40, 1, 300};
      for (int n : sizes0) {
        random_kv(rng, s, n, k, v);
        kv.append(0, k.data(), v.data(), n);
        all_k[0].insert(all_k[0].end(), k.begin(), k.end());
        all_v[0].insert(all_v[0].end(), v.begin(), v.end());
        check_cache(kv, 0, all_k[0], all_v[0]);
      }
      for (int n : sizes1) {
        random_kv(rng, s, n, k, v);
        kv.append(1, k.data(), v.data(), n);
        all_k[1].insert(all_k[1].end(), k.begin(), k.end());
        all_v[1].insert(all_v[1].end(), v.begin(), v.end());
      }
      check_cache(kv, 1, all_k[1], all_v[1]);
      check_cache(kv, 0, all_k[0], all_v[0]);
      EXPECT_EQ(kv.n_tokens(0), 311);
      EXPECT_EQ(kv.n_tokens(1), 341);
      EXPECT_EQ(kv.bytes_per_token_head(), 2u * 24u * dtype_size(dt));
    }
  }
}

TEST(KvCache, PagePointersStayStableAcrossAppends) {
  const Shape s{1, 2, 2, 64};
  std::mt19937 rng(7);
  KvCacheOptions opt;
  opt.page_size = 16;
  KvCache kv(s, opt);
  std::vector<float> k, v;
  random_kv(rng, s, 20, k, v);
  kv.append(0, k.data(), v.data(), 20);
  const PagedHeadView before = kv.view(0, 1);
  const void* k0 = before.k_pages[0];
  const void* v1 = before.v_pages[1];
  std::vector<float> key5(64);
  kv.key_f32(0, 1, 5, key5.data());
  for (int i = 0; i < 50; ++i) {  // many appends, forcing several new slabs
    random_kv(rng, s, 17, k, v);
    kv.append(0, k.data(), v.data(), 17);
  }
  const PagedHeadView after = kv.view(0, 1);
  EXPECT_EQ(after.k_pages[0], k0);
  EXPECT_EQ(after.v_pages[1], v1);
  std::vector<float> again(64);
  convert_to_f32(static_cast<const char*>(k0) + 5 * after.row_bytes(), after.dtype, again.data(), 64);
  EXPECT_EQ(again, key5);
}

TEST(KvCache, ClearThenRefillRecomputesMetadata) {
  const Shape s{1, 4, 2, 32};
  std::mt19937 rng(3);
  KvCacheOptions opt;
  opt.page_size = 16;
  opt.dtype = DType::bf16;
  KvCache kv(s, opt);
  std::vector<float> k, v;
  random_kv(rng, s, 40, k, v);
  kv.append(0, k.data(), v.data(), 40);
  kv.clear();
  EXPECT_EQ(kv.n_tokens(0), 0);
  EXPECT_EQ(kv.view(0, 0).n_pages(), 0);
  // Fresh, different keys: stale page statistics must not leak into the new ones.
  random_kv(rng, s, 21, k, v);
  for (auto& x : k) x *= -3.0f;
  kv.append(0, k.data(), v.data(), 21);
  check_cache(kv, 0, k, v);
}

TEST(KvCache, TruncateThenAppendEqualsAFreshCache) {
  // Truncation points inside a page, on a page boundary and at 0; dropped rows must read
  // back as zero (the padding of a fresh partial page) and statistics must be recomputed.
  const Shape s{2, 4, 2, 24};
  for (DType dt : {DType::f16, DType::f32}) {
    for (int cut : {0, 5, 16, 37}) {
      std::mt19937 rng(11 + cut);
      KvCacheOptions opt;
      opt.page_size = 16;
      opt.dtype = dt;
      KvCache kv(s, opt), fresh(s, opt);
      std::vector<float> k, v, keep_k, keep_v, more_k, more_v;
      random_kv(rng, s, 60, k, v);
      for (int l = 0; l < 2; ++l) kv.append(l, k.data(), v.data(), 60);
      kv.truncate(cut);
      EXPECT_EQ(kv.n_tokens(0), cut);
      EXPECT_EQ(kv.n_tokens(1), cut);
      const size_t row = static_cast<size_t>(s.n_kv_heads) * s.head_dim;
      keep_k.assign(k.begin(), k.begin() + cut * row);
      keep_v.assign(v.begin(), v.begin() + cut * row);
      random_kv(rng, s, 9, more_k, more_v);  // ends inside a page for every cut
      for (auto& x : more_k) x *= -2.0f;
      for (int l = 0; l < 2; ++l) {
        if (cut > 0) fresh.append(l, keep_k.data(), keep_v.data(), cut);
        fresh.append(l, more_k.data(), more_v.data(), 9);
        kv.append(l, more_k.data(), more_v.data(), 9);
      }
      keep_k.insert(keep_k.end(), more_k.begin(), more_k.end());
      keep_v.insert(keep_v.end(), more_v.begin(), more_v.end());
      for (int l = 0; l < 2; ++l) {
        check_cache(kv, l, keep_k, keep_v);
        for (int h = 0; h < s.n_kv_heads; ++h) {
          const PagedHeadView a = kv.view(l, h), b = fresh.view(l, h);
          for (int p = 0; p < a.n_pages(); ++p) {  // whole pages, padding rows included
            EXPECT_EQ(std::memcmp(a.k_pages[p], b.k_pages[p], a.page_size * a.row_bytes()), 0) << "cut " << cut;
            EXPECT_EQ(std::memcmp(a.v_pages[p], b.v_pages[p], a.page_size * a.row_bytes()), 0) << "cut " << cut;
          }
        }
      }
    }
  }
  KvCache kv(Shape{1, 4, 2, 32}, {});
  expect_error([&] { kv.truncate(1); }, "n=1 exceeds the 0 tokens cached in layer 0");
  expect_error([&] { kv.truncate(-1); }, "n=-1 must be >= 0");
}

// generation(layer) moves when the layer loses tokens and only then, so a method holding
// per-token state can tell a cut followed by appends from appends alone.
TEST(KvCache, GenerationMovesOnlyWhenTokensAreLost) {
  const Shape s{2, 4, 2, 24};
  std::mt19937 rng(3);
  KvCache kv(s, {});
  std::vector<float> k, v;
  random_kv(rng, s, 20, k, v);
  const uint64_t g0 = kv.generation(0);
  for (int l = 0; l < 2; ++l) kv.append(l, k.data(), v.data(), 20);
  EXPECT_EQ(kv.generation(0), g0);
  kv.truncate(20);  // nothing lost
  EXPECT_EQ(kv.generation(0), g0);
  kv.truncate(12);
  const uint64_t g1 = kv.generation(0);
  EXPECT_NE(g1, g0);
  EXPECT_EQ(kv.generation(1), g1);
  for (int l = 0; l < 2; ++l) kv.append(l, k.data(), v.data(), 8);  // back to 20 tokens
  EXPECT_EQ(kv.generation(0), g1);
  kv.clear();
  EXPECT_NE(kv.generation(0), g1);
  expect_error([&] { (void)kv.generation(2); }, "layer=2");
}

TEST(KvCache, BadInputNamesTheValue) {
  const Shape s{2, 4, 2, 32};
  for (int ps : {0, 3, 512, -16}) {
    KvCacheOptions opt;
    opt.page_size = ps;
    expect_error([&] { KvCache kv(s, opt); }, "page_size=" + std::to_string(ps) + " must be a power of two in [1, 256]");
  }
  expect_error([&] { KvCache kv(Shape{1, 9, 4, 64}); }, "n_q_heads=9");
  expect_error([&] { KvCache kv(Shape{1, 8, 2, 12}); }, "head_dim=12");
  KvCacheOptions opt;
  opt.max_tokens = 40;
  opt.page_size = 16;
  KvCache kv(s, opt);
  std::mt19937 rng(5);
  std::vector<float> k, v;
  random_kv(rng, s, 3, k, v);
  k[(2 * 2 + 1) * 32 + 7] = std::nanf("");  // token 2, head 1, dim 7
  expect_error([&] { kv.append(0, k.data(), v.data(), 3); }, "k[token=2][head=1][dim=7]=nan");
  EXPECT_EQ(kv.n_tokens(0), 0) << "a rejected append must leave the cache unchanged";
  random_kv(rng, s, 3, k, v);
  v[(1 * 2 + 0) * 32 + 31] = -INFINITY;
  expect_error([&] { kv.append(0, k.data(), v.data(), 3); }, "v[token=1][head=0][dim=31]=-inf");
  random_kv(rng, s, 3, k, v);
  expect_error([&] { kv.append(2, k.data(), v.data(), 3); }, "layer=2");
  expect_error([&] { kv.append(-1, k.data(), v.data(), 3); }, "layer=-1");
  expect_error([&] { kv.append(0, k.data(), v.data(), 0); }, "n=0");
  expect_error([&] { kv.append(0, nullptr, v.data(), 3); }, "must be non-null");
  random_kv(rng, s, 39, k, v);
  kv.append(0, k.data(), v.data(), 39);
  random_kv(rng, s, 2, k, v);
  expect_error([&] { kv.append(0, k.data(), v.data(), 2); }, "n=2 would overflow max_tokens=40");
  EXPECT_EQ(kv.n_tokens(0), 39);
  kv.append(0, k.data(), v.data(), 1);  // exactly full is fine
  EXPECT_EQ(kv.n_tokens(0), 40);
  std::vector<float> out(32);
  expect_error([&] { kv.key_f32(0, 0, 40, out.data()); }, "t=40");
  expect_error([&] { kv.value_f32(0, 2, 0, out.data()); }, "kv_head=2");
  expect_error([&] { kv.view(5, 0); }, "layer=5");
  expect_error([&] { kv.n_tokens(2); }, "layer=2");
}

namespace {

// The rows of (layer, head) tokens [t0, t1) of two caches are the same bytes, and so are the
// whole pages from the first that starts at or after t0 (padding rows included: a kernel may
// read those of the last page).
void expect_same_rows(const KvCache& a, const KvCache& b, int layer, int t0, int t1, const std::string& where) {
  for (int h = 0; h < a.shape().n_kv_heads; ++h) {
    const PagedHeadView va = a.view(layer, h), vb = b.view(layer, h);
    ASSERT_EQ(va.n_tokens, vb.n_tokens) << where;
    for (int t = t0; t < t1; ++t) {
      ASSERT_NE(va.k_pages[t >> va.page_shift], nullptr) << where << " token " << t;
      ASSERT_EQ(std::memcmp(va.key(t), vb.key(t), va.row_bytes()), 0) << where << " token " << t;
      ASSERT_EQ(std::memcmp(va.value(t), vb.value(t), va.row_bytes()), 0) << where << " token " << t;
    }
    for (int p = (t0 + va.page_size - 1) >> va.page_shift; t1 > t0 && p <= (t1 - 1) >> va.page_shift; ++p) {
      ASSERT_EQ(std::memcmp(va.k_pages[p], vb.k_pages[p], va.page_size * va.row_bytes()), 0) << where << " page " << p;
      ASSERT_EQ(std::memcmp(va.v_pages[p], vb.v_pages[p], va.page_size * va.row_bytes()), 0) << where << " page " << p;
    }
  }
}

}  // namespace

TEST(KvCache, WindowLayerKeepsOnlyItsWindowBitForBit) {
  // Layer 0 is a sliding-window layer (window 37 tokens), layer 1 keeps every token. After
  // each append of [t0, t0 + n), the window layer holds exactly the rows a full cache holds
  // for [t0 - 36, t0 + n) (what the chunk's rows attend), its pages wholly before that are
  // dropped, it has no statistics, and its memory stays bounded however long the sequence.
  const Shape s{2, 4, 2, 24};
  for (int ps : {1, 8, 16}) {
    std::mt19937 rng(40 + ps);
    KvCacheOptions opt;
    opt.page_size = ps;
    opt.max_tokens = 4096;
    KvCache kv(s, opt, {37, 0}), full(s, opt);
    std::vector<float> k, v, all_k, all_v;
    const int sizes[] = {1, 5, 40, 1, 1, 100, 3, 60, 17, 1, 256, 1, 1, 1, 30, 500, 7, 1};
    int t0 = 0;
    for (int n : sizes) {
      random_kv(rng, s, n, k, v);
      for (int l = 0; l < 2; ++l) {
        kv.append(l, k.data(), v.data(), n);
        full.append(l, k.data(), v.data(), n);
      }
      all_k.insert(all_k.end(), k.begin(), k.end());
      all_v.insert(all_v.end(), v.begin(), v.end());
      const int from = std::max(0, t0 - 36);
      expect_same_rows(kv, full, 0, from, t0 + n, "ps " + std::to_string(ps) + " t0 " + std::to_string(t0));
      for (int h = 0; h < s.n_kv_heads; ++h) {
        const PagedHeadView w = kv.view(0, h);
        EXPECT_EQ(w.kmin, nullptr);
        for (int p = 0; p < from / ps; ++p) ASSERT_EQ(w.k_pages[p], nullptr) << "page " << p << " t0 " << t0;
      }
      EXPECT_EQ(kv.first_needed(0), std::max(0, t0 + n - 36));
      EXPECT_EQ(kv.first_needed(1), 0);
      t0 += n;
    }
    check_cache(kv, 1, all_k, all_v);  // the full layer as ever
    // The window layer's K/V: at most the largest chunk plus the window, in pages, twice over
    // (slabs grow by doubling), against the full layer's every token.
    const size_t page_bytes = 2 * ((static_cast<size_t>(ps) * s.head_dim * 2 + 63) / 64 * 64) * s.n_kv_heads;
    KvCache two_windows(s, opt, {37, 37}), two_full(s, opt);
    random_kv(rng, s, 3000, k, v);
    for (int l = 0; l < 2; ++l)
      for (int t = 0; t < 3000; t += 100)
        for (KvCache* c : {&two_windows, &two_full})
          c->append(l, k.data() + static_cast<size_t>(t) * 48, v.data() + static_cast<size_t>(t) * 48, 100);
    EXPECT_LE(two_windows.bytes_allocated(), 2 * 2 * (static_cast<size_t>((36 + 100) / ps) + 2) * page_bytes) << "ps " << ps;
    EXPECT_LT(two_windows.bytes_allocated() * 10, two_full.bytes_allocated()) << "ps " << ps;
  }
}

TEST(KvCache, WindowPinKeepsWhatTruncateReturnsTo) {
  // A prompt of 50 tokens, pinned, then 100 decoded one at a time: truncate(50) returns to
  // the prompt's window and later appends equal a cache that never decoded; without the pin
  // the tokens are gone and truncate says so.
  const Shape s{1, 4, 2, 24};
  KvCacheOptions opt;
  opt.page_size = 8;
  std::mt19937 rng(9);
  std::vector<float> pk, pv, dk, dv, mk, mv;
  random_kv(rng, s, 50, pk, pv);
  random_kv(rng, s, 100, dk, dv);
  random_kv(rng, s, 12, mk, mv);
  const size_t row = static_cast<size_t>(s.n_kv_heads) * s.head_dim;
  for (bool pin : {true, false}) {
    KvCache kv(s, opt, {20}), fresh(s, opt, {20});
    kv.append(0, pk.data(), pv.data(), 50);
    fresh.append(0, pk.data(), pv.data(), 50);
    if (pin) kv.pin_window(50);
    for (int i = 0; i < 100; ++i) kv.append(0, dk.data() + i * row, dv.data() + i * row, 1);
    if (!pin) {
      expect_error([&] { kv.truncate(50); }, "truncate(n=50): layer 0 keeps only its window of 20 tokens and dropped token 31");
      expect_error([&] { kv.pin_window(50); }, "pin_window(n=50): layer 0 (window 20) dropped token 31 already");
      continue;
    }
    // The pinned pages and the current window's: bounded, not the 150 tokens'.
    int live = 0;
    for (int p = 0; p < kv.view(0, 0).n_pages(); ++p) live += kv.view(0, 0).k_pages[p] != nullptr;
    EXPECT_LE(live, 2 * (20 / 8 + 2));
    kv.truncate(50);
    expect_same_rows(kv, fresh, 0, 31, 50, "after truncate");
    kv.append(0, mk.data(), mv.data(), 12);
    fresh.append(0, mk.data(), mv.data(), 12);
    expect_same_rows(kv, fresh, 0, 43, 62, "after truncate and 12 more");
    std::vector<float> out(24);
    expect_error([&] { kv.key_f32(0, 0, 3, out.data()); }, "t=3: layer 0 keeps only its window of 20 tokens");
  }
}

TEST(KvCache, WindowAppendDroppedThenTheWindow) {
  // What a KV snapshot restore does: the tokens before the window counted, not stored,
  // then the window's rows; afterwards the layer equals one that appended everything.
  const Shape s{1, 4, 2, 24};
  KvCacheOptions opt;
  opt.page_size = 16;
  std::mt19937 rng(12);
  std::vector<float> k, v, mk, mv;
  random_kv(rng, s, 300, k, v);
  random_kv(rng, s, 5, mk, mv);
  const size_t row = static_cast<size_t>(s.n_kv_heads) * s.head_dim;
  KvCache a(s, opt, {20}), b(s, opt, {20});
  a.append(0, k.data(), v.data(), 300);
  b.append_dropped(0, 281);
  b.append(0, k.data() + 281 * row, v.data() + 281 * row, 19);
  EXPECT_EQ(b.n_tokens(0), 300);
  EXPECT_EQ(b.first_needed(0), 281);
  a.append(0, mk.data(), mv.data(), 5);
  b.append(0, mk.data(), mv.data(), 5);
  expect_same_rows(a, b, 0, 286, 305, "restored");
  KvCache f(s, KvCacheOptions{});
  expect_error([&] { f.append_dropped(0, 3); }, "append_dropped(layer=0): the layer keeps every token (no window)");
  expect_error([&] { KvCache kv(s, {}, {20, 0}); }, "layer_window has 2 entries for 1 layers");
  expect_error([&] { KvCache kv(s, {}, {-1}); }, "layer_window[0]=-1 must be >= 0");
}
