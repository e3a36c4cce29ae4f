// SIMD prefill attention (Highway, runtime dispatch), flash-style: tiles of queries against
// tiles of keys with an online softmax. Same contract as src/kernels/ref/prefill.cpp (see
// kernels/prefill.h); accumulation is float32.
//
// Per call, the keys and values of the chunk's causal prefix [0, pos + n_q) are first
// converted to float32 once per kv head (a parallel pass), the keys transposed per key tile
// of kTk = 64 tokens: kt [n_tiles][head_dim][kTk], v [n_tiles * kTk][head_dim]. Every query
// tile then reads them from cache without converting again.
//
// Work split: one task = (kv head, up to 64 of its query heads, a query tile of T tokens):
// rows = heads x tokens (head-major, at most 128, so a GQA group shares every key tile it
// loads). T is a power of two chosen from the group size alone; query tiles are aligned to
// multiples of T (and, for the block-sparse op, cut at block boundaries). A task walks a list
// of key ranges, each inside one key tile, each with the mask of its heads that attend it:
//   dense:        [0, 64), [64, 128), ... up to the tile's last position
//   block-sparse: the union of the group's listed blocks, consecutive blocks with the same
//                 head mask merged, cut at multiples of kTk
// Per range and per group of up to 4 rows of one head: S = Q Kt (the score of each key is
// one FMA chain over the head dimension, in order), masked causally, online softmax (running
// max m, sum l, rescale alpha), then O = alpha O + P V. Each output row depends only on its
// own ranges (fixed by the problem) and never on the tiling, the task order or the thread
// count, and all-blocks-listed block-sparse sees exactly the dense ranges: bit-identical.

// This file is compiled once per SIMD target by foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/prefill.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cumulus/core/buffer.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/prefill.h"
#include "kernels/cpu/row_load-inl.h"

#ifndef CUMULUS_KERNELS_CPU_PREFILL_ONCE
#define CUMULUS_KERNELS_CPU_PREFILL_ONCE
namespace cumulus::cpu {

constexpr int kTk = 64;          // keys per tile; no key range crosses a multiple of kTk
constexpr int kMaxRows = 128;    // query rows (heads x tokens) per task
constexpr int kMaxHeads = 64;    // query heads per task (one bit each in a range's mask)
constexpr int kPadFloats = 64;   // slack after buffers: vector reads may run past a tile's end

// Keys [begin, end) of one key tile; bit g of `heads` set when the task's head g attends them.
struct PrefillKeyRange {
  int begin = 0, end = 0;
  uint64_t heads = 0;
};

// One task (see the file comment).
struct PrefillTask {
  const float* kt = nullptr;  // converted keys of the kv head: [n_tiles][head_dim][kTk]
  const float* v = nullptr;   // converted values: [n_tiles * kTk][head_dim]
  int head_dim = 0;
  const float* q = nullptr;   // the chunk's q, [n_q][n_q_heads][head_dim]
  float* out = nullptr;       // [n_q][n_q_heads][head_dim]
  float* lse = nullptr;       // [n_q][n_q_heads] or null
  int n_q_heads = 0;
  int head0 = 0, n_heads = 0;  // query heads [head0, head0 + n_heads)
  int pos = 0;                 // the chunk's first position
  int p0 = 0, p1 = 0;          // the tile's positions [p0, p1)
  float scale = 0.0f;
  const PrefillKeyRange* ranges = nullptr;
  int n_ranges = 0;
};

// Keys [begin, end) (end - begin <= kTk) of one view converted: kt [head_dim][kTk]
// transposed, v [kTk][head_dim] (either may be null); columns / rows past end are zero.
struct PrefillConvert {
  const PagedHeadView* kv = nullptr;
  int begin = 0, end = 0;
  float* kt = nullptr;
  float* v = nullptr;
};

}  // namespace cumulus::cpu
#endif

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace {

template <DType kT, class D>
void convert_typed(D d, const PrefillConvert& c) {
  const size_t N = hn::Lanes(d);
  const PagedHeadView& kv = *c.kv;
  const size_t dim = static_cast<size_t>(kv.head_dim);
  HWY_ALIGN float tmp[256];
  const int n = c.end - c.begin;
  for (int t = 0; t < n; ++t) {
    if (c.kt != nullptr) {
      const void* kr = kv.key(c.begin + t);
      for (size_t j = 0; j < dim; j += N) hn::Store(load_row<kT>(d, kr, j), d, tmp + j);
      for (size_t j = 0; j < dim; ++j) c.kt[j * kTk + t] = tmp[j];
    }
    if (c.v != nullptr) {
      const void* vr = kv.value(c.begin + t);
      float* dst = c.v + static_cast<size_t>(t) * dim;
      for (size_t j = 0; j < dim; j += N) hn::StoreU(load_row<kT>(d, vr, j), d, dst + j);
    }
  }
  for (int t = n; t < kTk; ++t) {
    if (c.kt != nullptr)
      for (size_t j = 0; j < dim; ++j) c.kt[j * kTk + t] = 0.0f;
    if (c.v != nullptr) std::memset(c.v + static_cast<size_t>(t) * dim, 0, dim * sizeof(float));
  }
}

// S [RB][ncols] (row stride s_stride) = Q [RB][dim] (row stride dim) times Kt [dim][ncols]
// (row stride kt_stride). ncols is a multiple of Lanes(d). Each score is one FMA chain over
// j = 0..dim-1, so its value does not depend on the vector width.
template <int RB, class D>
HWY_INLINE void prefill_qk(D d, const float* HWY_RESTRICT q, size_t dim, const float* HWY_RESTRICT kt,
                           size_t kt_stride, size_t ncols, float* HWY_RESTRICT s, size_t s_stride) {
  using V = hn::Vec<D>;
  const size_t N = hn::Lanes(d);
  size_t c = 0;
  for (; c + 2 * N <= ncols; c += 2 * N) {
    V a0[RB], a1[RB];
    for (int i = 0; i < RB; ++i) a0[i] = a1[i] = hn::Zero(d);
    for (size_t j = 0; j < dim; ++j) {
      const V k0 = hn::LoadU(d, kt + j * kt_stride + c);
      const V k1 = hn::LoadU(d, kt + j * kt_stride + c + N);
      for (int i = 0; i < RB; ++i) {
        const V qb = hn::Set(d, q[i * dim + j]);
        a0[i] = hn::MulAdd(qb, k0, a0[i]);
        a1[i] = hn::MulAdd(qb, k1, a1[i]);
      }
    }
    for (int i = 0; i < RB; ++i) {
      hn::StoreU(a0[i], d, s + i * s_stride + c);
      hn::StoreU(a1[i], d, s + i * s_stride + c + N);
    }
  }
  if (c < ncols) {
    V a[RB];
    for (int i = 0; i < RB; ++i) a[i] = hn::Zero(d);
    for (size_t j = 0; j < dim; ++j) {
      const V k0 = hn::LoadU(d, kt + j * kt_stride + c);
      for (int i = 0; i < RB; ++i) a[i] = hn::MulAdd(hn::Set(d, q[i * dim + j]), k0, a[i]);
    }
    for (int i = 0; i < RB; ++i) hn::StoreU(a[i], d, s + i * s_stride + c);
  }
}

// O [RB][dim] = alpha[i] * O + P [RB][nt] (row stride p_stride) times V [nt][dim]. Each
// output element is one FMA chain over t = 0..nt-1.
template <int RB, class D>
HWY_INLINE void prefill_pv(D d, const float* HWY_RESTRICT p, size_t p_stride, const float* HWY_RESTRICT v, size_t dim,
                           int nt, const float* alpha, float* HWY_RESTRICT o) {
  using V = hn::Vec<D>;
  const size_t N = hn::Lanes(d);
  size_t j = 0;
  for (; j + 2 * N <= dim; j += 2 * N) {
    V a0[RB], a1[RB];
    for (int i = 0; i < RB; ++i) {
      const V al = hn::Set(d, alpha[i]);
      a0[i] = hn::Mul(hn::LoadU(d, o + i * dim + j), al);
      a1[i] = hn::Mul(hn::LoadU(d, o + i * dim + j + N), al);
    }
    for (int t = 0; t < nt; ++t) {
      const V v0 = hn::LoadU(d, v + t * dim + j);
      const V v1 = hn::LoadU(d, v + t * dim + j + N);
      for (int i = 0; i < RB; ++i) {
        const V w = hn::Set(d, p[i * p_stride + t]);
        a0[i] = hn::MulAdd(w, v0, a0[i]);
        a1[i] = hn::MulAdd(w, v1, a1[i]);
      }
    }
    for (int i = 0; i < RB; ++i) {
      hn::StoreU(a0[i], d, o + i * dim + j);
      hn::StoreU(a1[i], d, o + i * dim + j + N);
    }
  }
  for (; j < dim; j += N) {
    V a[RB];
    for (int i = 0; i < RB; ++i) a[i] = hn::Mul(hn::LoadU(d, o + i * dim + j), hn::Set(d, alpha[i]));
    for (int t = 0; t < nt; ++t) {
      const V v0 = hn::LoadU(d, v + t * dim + j);
      for (int i = 0; i < RB; ++i) a[i] = hn::MulAdd(hn::Set(d, p[i * p_stride + t]), v0, a[i]);
    }
    for (int i = 0; i < RB; ++i) hn::StoreU(a[i], d, o + i * dim + j);
  }
}

// Masked maximum of s[0, n_valid) (n_valid >= 1) read over [0, ncols).
template <class D>
HWY_INLINE float prefill_row_max(D d, const float* s, int n_valid, size_t ncols) {
  const size_t N = hn::Lanes(d);
  const auto neg = hn::Set(d, -std::numeric_limits<float>::infinity());
  auto vmax = neg;
  for (size_t c = 0; c < ncols; c += N) {
    const size_t valid = n_valid > static_cast<int>(c) ? static_cast<size_t>(n_valid) - c : 0;
    vmax = hn::Max(vmax, hn::IfThenElse(hn::FirstN(d, valid), hn::LoadU(d, s + c), neg));
  }
  return hn::GetLane(hn::MaxOfLanes(d, vmax));
}

// s[c] = exp(s[c] - m) for c < n_valid, 0 for n_valid <= c < ncols; returns the sum.
template <class D>
HWY_INLINE float prefill_row_exp(D d, float* s, int n_valid, size_t ncols, float m) {
  const size_t N = hn::Lanes(d);
  const auto neg = hn::Set(d, -std::numeric_limits<float>::infinity());
  const auto vm = hn::Set(d, m);
  auto sum = hn::Zero(d);
  for (size_t c = 0; c < ncols; c += N) {
    const size_t valid = n_valid > static_cast<int>(c) ? static_cast<size_t>(n_valid) - c : 0;
    const auto x = hn::IfThenElse(hn::FirstN(d, valid), hn::LoadU(d, s + c), neg);
    const auto e = hn::Exp(d, hn::Sub(x, vm));  // exp(-inf) = 0 for masked lanes
    hn::StoreU(e, d, s + c);
    sum = hn::Add(sum, e);
  }
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

// One group of RB rows of one head against one key range: scores, online softmax, values.
//   q, o: [RB][dim]; s: [RB][kTk]; m, l: [RB] running max and sum; n_valid[i] >= 1 keys of
//   the range row i attends (ascending in i); kt at the range's first column.
template <int RB, class D, class DV>
HWY_INLINE void prefill_rows(D d, DV dv, size_t dim, const float* q, const float* kt, const float* v,
                             const int* n_valid, float* s, float* m, float* l, float* o) {
  const size_t N = hn::Lanes(d);
  const int vg = n_valid[RB - 1];
  const size_t ncols = (static_cast<size_t>(vg) + N - 1) / N * N;
  prefill_qk<RB>(d, q, dim, kt, kTk, ncols, s, kTk);
  float alpha[RB];
  for (int i = 0; i < RB; ++i) {
    float* si = s + i * kTk;
    const float m_new = std::max(m[i], prefill_row_max(d, si, n_valid[i], ncols));
    alpha[i] = std::exp(m[i] - m_new);  // 0 while m was -inf
    l[i] = l[i] * alpha[i] + prefill_row_exp(d, si, n_valid[i], ncols, m_new);
    m[i] = m_new;
  }
  prefill_pv<RB>(dv, s, kTk, v, dim, vg, alpha, o);
}

template <class D, class DV>
void prefill_tile_run(D d, DV dv, const PrefillTask& t) {
  const size_t dim = static_cast<size_t>(t.head_dim);
  const int T = t.p1 - t.p0;
  const int R = t.n_heads * T;
  // Scratch: Q [R][dim] (scaled), O [R][dim], S [R][kTk], m [R], l [R].
  thread_local AlignedVector<float> buf;
  const size_t need = 2 * static_cast<size_t>(R) * dim + static_cast<size_t>(R) * kTk + 2 * R + kPadFloats;
  if (buf.size() < need) buf.resize(need);
  float* Q = buf.data();
  float* O = Q + R * dim;
  float* S = O + R * dim;
  float* M = S + static_cast<size_t>(R) * kTk;
  float* Lsum = M + R;
  const size_t q_stride = static_cast<size_t>(t.n_q_heads) * dim;
  for (int g = 0; g < t.n_heads; ++g)
    for (int i = 0; i < T; ++i) {
      const float* src = t.q + static_cast<size_t>(t.p0 - t.pos + i) * q_stride + (t.head0 + g) * dim;
      float* dst = Q + (static_cast<size_t>(g) * T + i) * dim;
      for (size_t j = 0; j < dim; ++j) dst[j] = src[j] * t.scale;
    }
  std::fill(O, O + static_cast<size_t>(R) * dim, 0.0f);
  std::fill(M, M + R, -std::numeric_limits<float>::infinity());
  std::fill(Lsum, Lsum + R, 0.0f);

  for (int ri = 0; ri < t.n_ranges; ++ri) {
    const PrefillKeyRange& rg = t.ranges[ri];
    const int nk = rg.end - rg.begin;
    const int tile = rg.begin / kTk;
    const float* kt = t.kt + static_cast<size_t>(tile) * dim * kTk + (rg.begin - tile * kTk);
    const float* v = t.v + static_cast<size_t>(rg.begin) * dim;
    // Row i (position p0 + i) attends keys [begin, min(end, p0 + i + 1)) of the range.
    const int i_first = std::max(0, rg.begin - t.p0);
    for (int g = 0; g < t.n_heads; ++g) {
      if (((rg.heads >> g) & 1u) == 0) continue;
      for (int i = i_first; i < T; i += 4) {
        const int rb = std::min(4, T - i);
        int n_valid[4];
        for (int k = 0; k < rb; ++k) n_valid[k] = std::min(nk, t.p0 + i + k - rg.begin + 1);
        const size_t row = static_cast<size_t>(g) * T + i;
        float* s = S + row * kTk;
        switch (rb) {
          case 4: prefill_rows<4>(d, dv, dim, Q + row * dim, kt, v, n_valid, s, M + row, Lsum + row, O + row * dim); break;
          case 3: prefill_rows<3>(d, dv, dim, Q + row * dim, kt, v, n_valid, s, M + row, Lsum + row, O + row * dim); break;
          case 2: prefill_rows<2>(d, dv, dim, Q + row * dim, kt, v, n_valid, s, M + row, Lsum + row, O + row * dim); break;
          default: prefill_rows<1>(d, dv, dim, Q + row * dim, kt, v, n_valid, s, M + row, Lsum + row, O + row * dim);
        }
      }
    }
  }

  for (int g = 0; g < t.n_heads; ++g)
    for (int i = 0; i < T; ++i) {
      const size_t row = static_cast<size_t>(g) * T + i;
      const size_t tok = static_cast<size_t>(t.p0 - t.pos + i);
      float* dst = t.out + tok * q_stride + (t.head0 + g) * dim;
      const float l = Lsum[row];
      if (l > 0.0f) {
        const float inv = 1.0f / l;
        for (size_t j = 0; j < dim; ++j) dst[j] = O[row * dim + j] * inv;
      } else {
        std::fill(dst, dst + dim, 0.0f);
      }
      if (t.lse != nullptr)
        t.lse[tok * t.n_q_heads + t.head0 + g] =
            l > 0.0f ? M[row] + std::log(l) : -std::numeric_limits<float>::infinity();
    }
}

// The widest float vector for the key axis (kTk = 64 lanes at most), and for the head
// dimension the widest one whose lane count divides head_dim (a multiple of 8).
template <class Fn>
HWY_INLINE void prefill_with_tags(int head_dim, const Fn& fn) {
  const hn::ScalableTag<float> df;
  if (head_dim % static_cast<int>(hn::Lanes(df)) == 0) {
    fn(df, df);
  } else {
    fn(df, hn::CappedTag<float, 8>());
  }
}

template <class D>
void convert_dispatch(D d, const PrefillConvert& c) {
  switch (c.kv->dtype) {
    case DType::f32: convert_typed<DType::f32>(d, c); break;
    case DType::f16: convert_typed<DType::f16>(d, c); break;
    case DType::bf16: convert_typed<DType::bf16>(d, c); break;
  }
}

}  // namespace

void prefill_convert_impl(const PrefillConvert& c) {
  prefill_with_tags(c.kv->head_dim, [&](auto, auto dv) { convert_dispatch(dv, c); });
}

void prefill_tile_impl(const PrefillTask& t) {
  prefill_with_tags(t.head_dim, [&](auto d, auto dv) { prefill_tile_run(d, dv, t); });
}

void prefill_projection_impl(const PrefillProjectionArgs& a) {
  prefill_with_tags(a.kv->head_dim, [&](auto d, auto dv) {
    const size_t N = hn::Lanes(d);
    const size_t dim = static_cast<size_t>(a.kv->head_dim);
    const int L = a.n_rows, n = a.n_keys;
    const int n_tiles = (n + kTk - 1) / kTk;
    const size_t stride = static_cast<size_t>(n_tiles) * kTk;
    // Scratch: Q [L][dim] scaled, S [L][stride] scores then probabilities, kt [dim][kTk].
    thread_local AlignedVector<float> buf;
    const size_t need = static_cast<size_t>(L) * dim + static_cast<size_t>(L) * stride + dim * kTk + kPadFloats;
    if (buf.size() < need) buf.resize(need);
    float* Q = buf.data();
    float* S = Q + static_cast<size_t>(L) * dim;
    float* kt = S + static_cast<size_t>(L) * stride;
    for (size_t i = 0; i < static_cast<size_t>(L) * dim; ++i) Q[i] = a.q[i] * a.scale;
    const int p_first = n - L;  // position of row 0
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int k0 = tile * kTk, k1 = std::min(n, k0 + kTk);
      convert_dispatch(dv, PrefillConvert{a.kv, k0, k1, kt, nullptr});
      // Rows whose position reaches this tile: p_first + i >= k0.
      for (int i = std::max(0, k0 - p_first); i < L; i += 4) {
        const int rb = std::min(4, L - i);
        const int last_valid = std::min(k1 - k0, p_first + i + rb - 1 - k0 + 1);
        const size_t ncols = (static_cast<size_t>(last_valid) + N - 1) / N * N;
        const float* qi = Q + static_cast<size_t>(i) * dim;
        float* si = S + static_cast<size_t>(i) * stride + k0;
        switch (rb) {
          case 4: prefill_qk<4>(d, qi, dim, kt, kTk, ncols, si, stride); break;
          case 3: prefill_qk<3>(d, qi, dim, kt, kTk, ncols, si, stride); break;
          case 2: prefill_qk<2>(d, qi, dim, kt, kTk, ncols, si, stride); break;
          default: prefill_qk<1>(d, qi, dim, kt, kTk, ncols, si, stride);
        }
      }
    }
    std::fill(a.vertical, a.vertical + n, 0.0f);
    std::fill(a.slash, a.slash + n, 0.0f);
    for (int i = 0; i < L; ++i) {
      const int p = p_first + i;
      float* si = S + static_cast<size_t>(i) * stride;
      const size_t ncols = (static_cast<size_t>(p) + 1 + N - 1) / N * N;
      const float m = prefill_row_max(d, si, p + 1, ncols);
      const float inv = 1.0f / prefill_row_exp(d, si, p + 1, ncols, m);
      for (int j = 0; j <= p; ++j) {
        const float w = si[j] * inv;
        a.vertical[j] += w;
        a.slash[p - j] += w;
      }
    }
  });
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cumulus::cpu {

HWY_EXPORT(prefill_convert_impl);
HWY_EXPORT(prefill_tile_impl);
HWY_EXPORT(prefill_projection_impl);

namespace {

// Query rows per task: heads per task G = min(group, kMaxHeads) and tokens per tile T, a
// power of two with G * T <= kMaxRows (1 <= T <= 64).
struct TaskShape {
  int heads = 1, slices = 1, tokens = 1;
};

TaskShape task_shape(int group) {
  TaskShape s;
  s.heads = std::min(group, kMaxHeads);
  s.slices = (group + s.heads - 1) / s.heads;
  s.tokens = 1;
  while (s.tokens < 64 && 2 * s.tokens * s.heads <= kMaxRows) s.tokens *= 2;
  return s;
}

struct TileSpan {
  int p0, p1;
};

// Query tiles of the chunk [pos, end): aligned to multiples of `tokens`, cut at multiples of
// block (0: no blocks). Returned last first: the tiles with the most keys start first.
std::vector<TileSpan> query_tiles(int pos, int end, int tokens, int block) {
  std::vector<TileSpan> tiles;
  for (int s = pos; s < end;) {
    int e = std::min(end, (s / tokens + 1) * tokens);
    if (block > 0) e = std::min(e, (s / block + 1) * block);
    tiles.push_back({s, e});
    s = e;
  }
  std::reverse(tiles.begin(), tiles.end());
  return tiles;
}

// Appends keys [b, e) with head mask `heads`, merging into the previous range when it ends
// at b inside the same key tile with the same mask, and cutting at multiples of kTk.
void push_keys(std::vector<PrefillKeyRange>& out, int b, int e, uint64_t heads) {
  while (b < e) {
    const int cut = std::min(e, (b / kTk + 1) * kTk);
    if (!out.empty() && out.back().end == b && out.back().heads == heads && out.back().begin / kTk == b / kTk) {
      out.back().end = cut;
    } else {
      out.push_back({b, cut, heads});
    }
    b = cut;
  }
}

// Runs the tasks of a dense (layout == nullptr) or block-sparse call; inputs validated.
void prefill_run(const PrefillAttnArgs& a, const BlockSparseLayout* layout, ThreadPool& pool, PrefillWorkspace* ws) {
  const int dim = a.kv[0].head_dim;
  const size_t udim = static_cast<size_t>(dim);
  const int n_keys = a.pos + a.n_q;
  const int n_tiles = (n_keys + kTk - 1) / kTk;
  const int n_q_heads = a.n_kv_heads * a.group;

  // Converted keys and values per kv head: kt [n_tiles][dim][kTk] then v [n_tiles * kTk][dim].
  const size_t head_floats = 2 * static_cast<size_t>(n_tiles) * kTk * udim;
  PrefillWorkspace call_ws;  // freed on return when the caller passes none
  AlignedVector<float>& conv = (ws != nullptr ? *ws : call_ws).prefix;
  if (conv.size() < head_floats * a.n_kv_heads + kPadFloats) conv.resize(head_floats * a.n_kv_heads + kPadFloats);
  float* base = conv.data();
  auto kt_of = [&](int h) { return base + h * head_floats; };
  auto v_of = [&](int h) { return base + h * head_floats + static_cast<size_t>(n_tiles) * kTk * udim; };
  pool.parallel_for(static_cast<int64_t>(a.n_kv_heads) * n_tiles, [&](int64_t task, int) {
    const int h = static_cast<int>(task / n_tiles), tile = static_cast<int>(task % n_tiles);
    const int k0 = tile * kTk;
    PrefillConvert c{&a.kv[h], k0, std::min(n_keys, k0 + kTk), kt_of(h) + static_cast<size_t>(tile) * udim * kTk,
                     v_of(h) + static_cast<size_t>(k0) * udim};
    HWY_DYNAMIC_DISPATCH(prefill_convert_impl)(c);
  });

  const TaskShape shape = task_shape(a.group);
  const std::vector<TileSpan> tiles =
      query_tiles(a.pos, n_keys, shape.tokens, layout != nullptr ? layout->block_size : 0);
  const int64_t per_tile = static_cast<int64_t>(a.n_kv_heads) * shape.slices;
  pool.parallel_for(static_cast<int64_t>(tiles.size()) * per_tile, [&](int64_t task, int) {
    const TileSpan& tile = tiles[static_cast<size_t>(task / per_tile)];
    const int h = static_cast<int>(task % per_tile) / shape.slices;
    const int slice = static_cast<int>(task % per_tile) % shape.slices;
    const int g0 = slice * shape.heads;
    const int n_heads = std::min(shape.heads, a.group - g0);
    const uint64_t all = n_heads == 64 ? ~uint64_t{0} : (uint64_t{1} << n_heads) - 1;
    thread_local std::vector<PrefillKeyRange> ranges;
    thread_local std::vector<uint64_t> mask;
    ranges.clear();
    if (layout == nullptr) {
      push_keys(ranges, 0, tile.p1, all);
    } else {
      const int b = layout->block_size;
      const int r_abs = tile.p0 / b;
      mask.assign(static_cast<size_t>(r_abs) + 1, 0);
      for (int g = 0; g < n_heads; ++g)
        for (int32_t c : layout->list(h * a.group + g0 + g, r_abs - layout->first_q_block)) mask[c] |= uint64_t{1} << g;
      for (int c = 0; c <= r_abs; ++c)
        if (mask[c] != 0) push_keys(ranges, c * b, std::min((c + 1) * b, tile.p1), mask[c]);
    }
    PrefillTask t;
    t.kt = kt_of(h);
    t.v = v_of(h);
    t.head_dim = dim;
    t.q = a.q;
    t.out = a.out;
    t.lse = a.lse;
    t.n_q_heads = n_q_heads;
    t.head0 = h * a.group + g0;
    t.n_heads = n_heads;
    t.pos = a.pos;
    t.p0 = tile.p0;
    t.p1 = tile.p1;
    t.scale = a.scale;
    t.ranges = ranges.data();
    t.n_ranges = static_cast<int>(ranges.size());
    HWY_DYNAMIC_DISPATCH(prefill_tile_impl)(t);
  });
}

}  // namespace

void attention_prefill_dense(const PrefillAttnArgs& a, ThreadPool& pool, PrefillWorkspace* workspace) {
  attention_prefill_validate(a, nullptr);
  prefill_run(a, nullptr, pool, workspace);
}

void attention_prefill_block_sparse(const PrefillAttnArgs& a, const BlockSparseLayout& layout, ThreadPool& pool,
                                    PrefillWorkspace* workspace) {
  attention_prefill_validate(a, &layout);
  prefill_run(a, &layout, pool, workspace);
}

void attention_prefill_projection(const PrefillProjectionArgs& a) {
  attention_prefill_projection_validate(a);
  HWY_DYNAMIC_DISPATCH(prefill_projection_impl)(a);
}

}  // namespace cumulus::cpu
#endif  // HWY_ONCE
