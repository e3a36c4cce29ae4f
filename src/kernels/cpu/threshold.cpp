// The threshold ops of kernels/selection.h on the CPU (Highway, runtime dispatch):
//   - select_mass_threshold bisects the logarithm of the threshold between max(key) * 2^-32
//     and max(key), 11 halvings down to 1/64 of an octave, each a vector pass that sums
//     every row's weights over the keys at or above the trial threshold (float32 lanes,
//     float64 across lanes). No sort. Once the bracket is 4 octaves wide, the entries
//     inside it are copied out (the band, usually a small part of the list) and the rest of
//     the halvings pass over the band alone, what lies above it summed once.
//   - select_any_above compares every row with its threshold, ORs the masks and compresses
//     the indices that pass.
// Inputs are checked in the first pass (nonnegative, finite), with the reference's messages.

// This file is compiled once per SIMD target by foreach_target.h.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/threshold.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "cumulus/kernels/selection.h"

HWY_BEFORE_NAMESPACE();
namespace cumulus::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int kMaxRows = 8;  // rows summed in one pass (a GQA group); more go in further passes

// Copying out the lanes a mask selects. AVX-512 compresses in registers (vcompressps), then
// a plain store: its compress to memory is slow on some CPUs (Zen 4). Elsewhere Highway's
// Compress permutes through a table that it copies to the stack on every call (rep movsq in
// AVX2 profiles: 70% of the group-key pass), so the lanes are copied one by one from the
// mask's bits: few lanes are selected where these functions use it. Either way the first
// count entries of the output hold the selected lanes in order, and with compress up to N
// lanes of slack after them are written.
#if HWY_TARGET <= HWY_AVX3
constexpr bool kCompressInRegisters = true;
#else
constexpr bool kCompressInRegisters = false;
#endif

// The mask's lanes as bits, lane i at bit i (N <= 64).
template <class D, class M>
HWY_INLINE uint64_t mask_bits(D d, M m) {
  uint8_t bytes[8] = {};
  hn::StoreMaskBits(d, m, bytes);
  uint64_t b = 0;
  for (int i = 7; i >= 0; --i) b = (b << 8) | bytes[i];
  return b;
}

// Appends the lanes of each of the `count` vectors v[c] that `m` selects to out[c] + at;
// returns how many lanes that is.
template <class D, class M, typename T>
HWY_INLINE size_t append_selected(D d, M m, const hn::Vec<D>* v, int count, T* const* out, size_t at) {
  if constexpr (kCompressInRegisters) {
    for (int c = 0; c < count; ++c) hn::StoreU(hn::Compress(v[c], m), d, out[c] + at);
    return hn::CountTrue(d, m);
  } else {
    HWY_ALIGN T lanes[hn::MaxLanes(d)];
    size_t n = 0;
    for (int c = 0; c < count; ++c) {
      hn::Store(v[c], d, lanes);
      n = 0;
      for (uint64_t b = mask_bits(d, m); b != 0; b &= b - 1) out[c][at + n++] = lanes[__builtin_ctzll(b)];
    }
    return n;
  }
}

// True where x is not a finite nonnegative float (NaN fails both compares).
template <class D>
HWY_INLINE auto threshold_bad(D d, hn::Vec<D> x) {
  return hn::Not(hn::And(hn::Ge(x, hn::Zero(d)), hn::Le(x, hn::Set(d, std::numeric_limits<float>::max()))));
}

// sum[j] = sum over i with key[i] >= k of w[j][i], rows [r0, r0 + R) of a [rows][stride]
// array over n entries.
// Sums are float32 in the lanes for kChunk vectors, then float64: each row's sum stays
// within about 1e-7 of its total (float32 throughout drifted by 1e-6 at 40K entries).
constexpr size_t kChunk = 16;

// sum[j] = sum over i with key[i] >= k of rows[j][i], for R rows of n entries.
template <int R>
HWY_INLINE void threshold_sums(const float* HWY_RESTRICT key, const float* const* rows, size_t n, float k,
                               double* sum) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  const auto vk = hn::Set(d, k);
  double total[R] = {};
  size_t i = 0;
  while (i + N <= n) {
    hn::Vec<decltype(d)> acc[R];
    for (int j = 0; j < R; ++j) acc[j] = hn::Zero(d);
    const size_t end = std::min(n - n % N, i + kChunk * N);
    for (; i < end; i += N) {
      const auto m = hn::Ge(hn::LoadU(d, key + i), vk);
      for (int j = 0; j < R; ++j) acc[j] = hn::Add(acc[j], hn::IfThenElseZero(m, hn::LoadU(d, rows[j] + i)));
    }
    for (int j = 0; j < R; ++j) total[j] += hn::GetLane(hn::SumOfLanes(d, acc[j]));
  }
  for (int j = 0; j < R; ++j) {
    double s = total[j];
    for (size_t t = i; t < n; ++t)
      if (key[t] >= k) s += rows[j][t];
    sum[j] = s;
  }
}

// The same for any number of rows, in tiles of up to kMaxRows (one pass over the keys each).
void threshold_row_sums(const float* key, const float* const* rows, int n_rows, size_t n, float k, double* sums) {
  for (int r0 = 0; r0 < n_rows; r0 += kMaxRows) {
    const float* const* rp = rows + r0;
    double* sum = sums + r0;
    switch (std::min(kMaxRows, n_rows - r0)) {
      case 1: threshold_sums<1>(key, rp, n, k, sum); break;
      case 2: threshold_sums<2>(key, rp, n, k, sum); break;
      case 3: threshold_sums<3>(key, rp, n, k, sum); break;
      case 4: threshold_sums<4>(key, rp, n, k, sum); break;
      case 5: threshold_sums<5>(key, rp, n, k, sum); break;
      case 6: threshold_sums<6>(key, rp, n, k, sum); break;
      case 7: threshold_sums<7>(key, rp, n, k, sum); break;
      default: threshold_sums<8>(key, rp, n, k, sum); break;
    }
  }
}

// One pass per tile of rows: the entries with key in [lo, hi) copied to band_key [m] and
// band[j] [m] (m of them, returned), and each row's sum over the keys >= hi added to above.
size_t threshold_band(const float* key, const float* const* rows, int n_rows, size_t n, float lo, float hi,
                      float* band_key, float* const* band, double* above) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  const auto vlo = hn::Set(d, lo), vhi = hn::Set(d, hi);
  size_t m = 0, i = 0;
  hn::Vec<decltype(d)> acc[kMaxRows];
  for (int r0 = 0; r0 < n_rows; r0 += kMaxRows) {
    const int R = std::min(kMaxRows, n_rows - r0);
    for (int j = 0; j < R; ++j) acc[j] = hn::Zero(d);
    m = 0;
    for (i = 0; i + N <= n; i += N) {
      if ((i / N) % kChunk == 0 && i > 0) {  // float32 lanes for kChunk vectors, then float64
        for (int j = 0; j < R; ++j) above[r0 + j] += hn::GetLane(hn::SumOfLanes(d, acc[j]));
        for (int j = 0; j < R; ++j) acc[j] = hn::Zero(d);
      }
      const auto k = hn::LoadU(d, key + i);
      const auto up = hn::Ge(k, vhi);
      const auto in = hn::And(hn::Ge(k, vlo), hn::Not(up));
      // The band's entries, copied out (append_selected); each array has N lanes of slack.
      hn::Vec<decltype(d)> x[kMaxRows + 1];
      float* dst[kMaxRows + 1];
      for (int j = 0; j < R; ++j) {
        x[j] = hn::LoadU(d, rows[r0 + j] + i);
        acc[j] = hn::Add(acc[j], hn::IfThenElseZero(up, x[j]));
        dst[j] = band[r0 + j];
      }
      if (!hn::AllFalse(d, in)) {
        x[R] = k;
        dst[R] = band_key;
        m += append_selected(d, in, x, r0 == 0 ? R + 1 : R, dst, m);
      }
    }
    for (int j = 0; j < R; ++j) above[r0 + j] += hn::GetLane(hn::SumOfLanes(d, acc[j]));
    for (size_t t = i; t < n; ++t) {
      if (key[t] >= hi) {
        for (int j = 0; j < R; ++j) above[r0 + j] += rows[r0 + j][t];
      } else if (key[t] >= lo) {
        if (r0 == 0) band_key[m] = key[t];
        for (int j = 0; j < R; ++j) band[r0 + j][m] = rows[r0 + j][t];
        ++m;
      }
    }
  }
  return m;
}

// Bisection brackets are exponents e of the threshold kmax 2^e in [kLo, 0].
constexpr float kLo = -32;
// select_group_threshold's key of the always-taken entries: above any share (at most 1).
constexpr float kAlwaysKey = 2.0f;

// The band a hint puts the bisection in: [kmax 2^e_lo, kmax 2^e_hi), 4 octaves around it.
void hint_band(float hint, float kmax, float* e_lo, float* e_hi) {
  const float e = std::log2(hint / kmax);
  *e_lo = std::max(kLo, std::floor(e) - 2);
  *e_hi = std::min(0.0f, *e_lo + 4);
}

// Throws the reference's message for the first bad key, then the first bad weight.
void threshold_check(const float* key, const float* w, size_t rows, size_t nn) {
  for (size_t t = 0; t < nn; ++t)
    CUMULUS_CHECK(std::isfinite(key[t]) && key[t] >= 0, "select_mass_threshold: key[{}]={} must be finite and >= 0", t,
                  key[t]);
  for (size_t t = 0; t < rows * nn; ++t)
    CUMULUS_CHECK(std::isfinite(w[t]) && w[t] >= 0, "select_mass_threshold: w[{}]={} must be finite and >= 0", t, w[t]);
}

float threshold_solve(const float* key, const float* w, int n_rows, int n, const double* need, double* sum_at,
                      float hint, MassThresholdWorkspace& ws, float kmax, size_t pre_band);

float select_mass_threshold_impl(const float* key, const float* w, int n_rows, int n, const double* need,
                                 double* sum_at, float hint, MassThresholdWorkspace* workspace) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  const size_t rows = static_cast<size_t>(n_rows);
  const size_t nn = static_cast<size_t>(n);
  // Pass 0: the keys checked, their largest.
  auto vmax = hn::Zero(d);
  auto bad = hn::FirstN(d, 0);
  size_t i = 0;
  for (; i + N <= nn; i += N) {
    const auto k = hn::LoadU(d, key + i);
    bad = hn::Or(bad, threshold_bad(d, k));
    vmax = hn::Max(vmax, k);
  }
  float kmax = hn::GetLane(hn::MaxOfLanes(d, vmax));
  bool any_bad = !hn::AllFalse(d, bad);
  for (; i < nn; ++i) {
    any_bad = any_bad || !(key[i] >= 0 && key[i] <= std::numeric_limits<float>::max());
    kmax = std::max(kmax, key[i]);
  }
  if (any_bad) threshold_check(key, w, 0, nn);
  // Pass 1: the weights checked, each row's total.
  // The caller's scratch (kernels/selection.h), or this call's own.
  MassThresholdWorkspace call_ws;
  MassThresholdWorkspace& ws = workspace != nullptr ? *workspace : call_ws;
  std::vector<double>& total = ws.total;  // [n_rows]
  total.assign(rows, 0.0);
  bad = hn::FirstN(d, 0);
  for (size_t j = 0; j < rows; ++j) {
    const float* x = w + j * nn;
    double t = 0;
    for (i = 0; i + N <= nn;) {
      auto acc = hn::Zero(d);
      const size_t end = std::min(nn - nn % N, i + kChunk * N);
      for (; i < end; i += N) {
        const auto v = hn::LoadU(d, x + i);
        bad = hn::Or(bad, threshold_bad(d, v));
        acc = hn::Add(acc, v);
      }
      t += hn::GetLane(hn::SumOfLanes(d, acc));
    }
    for (; i < nn; ++i) {
      any_bad = any_bad || !(x[i] >= 0 && x[i] <= std::numeric_limits<float>::max());
      t += x[i];
    }
    total[j] = t;
  }
  any_bad = any_bad || !hn::AllFalse(d, bad);
  if (any_bad) threshold_check(key, w, rows, nn);
  return threshold_solve(key, w, n_rows, n, need, sum_at, hint, ws, kmax, 0);
}

// The bisection, once ws.total holds each row's total and kmax the largest key. pre_band
// > 0: the caller's pass already copied the hint's band (hint_band) into ws.band_key /
// ws.band_rows (pre_band - 1 entries) and summed what lies above it into ws.base.
float threshold_solve(const float* key, const float* w, int n_rows, int n, const double* need, double* sum_at,
                      float hint, MassThresholdWorkspace& ws, float kmax, size_t pre_band) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  const size_t rows = static_cast<size_t>(n_rows);
  const size_t nn = static_cast<size_t>(n);
  std::vector<double>& total = ws.total;           // [n_rows]
  std::vector<double>& base = ws.base;             // [n_rows]
  std::vector<double>& sums = ws.sums;             // [n_rows]
  std::vector<const float*>& row_of = ws.row_of;  // [n_rows] the rows a pass reads
  std::vector<int>& id_of = ws.id_of;              // the rows still deciding
  // Every row's sum over the keys >= k, on the whole list (what sum_at reports).
  auto answer = [&](float k) {
    if (sum_at == nullptr) return k;
    if (k == std::numeric_limits<float>::infinity()) {
      std::fill(sum_at, sum_at + n_rows, 0.0);
    } else if (k <= 0.0f) {  // every key (-inf: the list falls short)
      std::copy(total.begin(), total.end(), sum_at);
    } else {
      row_of.resize(rows);
      for (size_t j = 0; j < rows; ++j) row_of[j] = w + j * nn;
      threshold_row_sums(key, row_of.data(), n_rows, nn, k, sum_at);
    }
    return k;
  };
  for (int j = 0; j < n_rows; ++j)
    if (total[j] < need[j]) return answer(-std::numeric_limits<float>::infinity());  // sum_at: the totals
  bool any_need = false;
  for (int j = 0; j < n_rows; ++j) any_need = any_need || need[j] > 0;
  if (!any_need) return answer(std::numeric_limits<float>::infinity());
  if (kmax <= 0) return answer(0.0f);
  // The list the passes read: every row of the whole list, then of the band (with what
  // lies above the band summed into base). Only the deciding rows are summed in a pass: a
  // row that reaches its need at a k where another does not stops deciding (the answer
  // lies below k, where it reaches its need too); usually one or two of a group decide.
  // Rows that need nothing never decide.
  const float* ck = key;
  size_t cn = nn;
  row_of.resize(rows);
  for (size_t j = 0; j < rows; ++j) row_of[j] = w + j * nn;
  id_of.clear();
  for (int j = 0; j < n_rows; ++j)
    if (need[j] > 0) id_of.push_back(j);
  if (pre_band == 0) base.assign(rows, 0.0);
  sums.resize(rows);
  std::vector<const float*>& deciding = ws.deciding;
  auto reached = [&](float k) {
    const int a = static_cast<int>(id_of.size());
    deciding.resize(static_cast<size_t>(a));
    for (int j = 0; j < a; ++j) deciding[j] = row_of[id_of[j]];
    threshold_row_sums(ck, deciding.data(), a, cn, k, sums.data());
    bool all = true;
    for (int j = 0; j < a; ++j) all = all && sums[j] + base[id_of[j]] >= need[id_of[j]];
    if (all) return true;
    int kept = 0;
    for (int j = 0; j < a; ++j)
      if (sums[j] + base[id_of[j]] < need[id_of[j]]) id_of[kept++] = id_of[j];
    id_of.resize(static_cast<size_t>(kept));
    return false;
  };
  // Bisection of the exponent e (threshold kmax 2^e) in [lo, hi] = [-32, 0], assuming
  // reach at lo and none at hi; both ends are checked only if the answer lands there:
  // at hi the largest key alone suffices (kmax 2^-1/64 is then within the contract), at
  // lo the keys below kmax 2^-32 (at most 2.3e-10 of the largest, each) are needed.
  float lo = kLo, hi = 0;
  // Halve on the whole list until the bracket is 4 octaves wide, then keep only the band
  // [kmax 2^lo, kmax 2^hi) and halve on it.
  std::vector<float>& band_key = ws.band_key;
  std::vector<float>& band_w = ws.band_w;
  std::vector<float*>& band_rows = ws.band_rows;
  bool banded = false;
  auto make_band = [&](float e_lo, float e_hi) {
    band_key.resize(nn + N);
    band_w.resize(rows * (nn + N));
    band_rows.resize(rows);
    for (size_t j = 0; j < rows; ++j) band_rows[j] = band_w.data() + j * (nn + N);
    cn = threshold_band(key, row_of.data(), n_rows, nn, kmax * std::exp2(e_lo), kmax * std::exp2(e_hi),
                        band_key.data(), band_rows.data(), base.data());
    ck = band_key.data();
    for (size_t j = 0; j < rows; ++j) row_of[j] = band_rows[j];
    banded = true;
  };
  // A hint (the caller's guess of the answer, e.g. the last step's) puts the band around it
  // at once: the band pass also sums what lies above it, which tells whether the answer is
  // inside (reach at the band's low end, none at its high end). Otherwise the band is
  // dropped and the bisection runs as without a hint, which the miss cost one pass.
  if (hint > 0 && hint <= kmax) {
    float e_lo = 0, e_hi = 0;
    hint_band(hint, kmax, &e_lo, &e_hi);
    if (pre_band > 0) {  // the caller's pass made it
      cn = pre_band - 1;
      ck = ws.band_key.data();
      for (size_t j = 0; j < rows; ++j) row_of[j] = ws.band_rows[j];
      banded = true;
    } else {
      make_band(e_lo, e_hi);
    }
    bool reach_lo = true, reach_hi = true;
    std::vector<double>& band_total = ws.band_total;
    band_total.resize(rows);
    threshold_row_sums(ck, row_of.data(), n_rows, cn, 0.0f, band_total.data());
    for (int j : id_of) {
      reach_hi = reach_hi && base[j] >= need[j];
      reach_lo = reach_lo && base[j] + band_total[j] >= need[j];
    }
    if (reach_lo && !reach_hi && e_lo < e_hi) {
      lo = e_lo;
      hi = e_hi;
    } else {  // back to the whole list
      if (reach_hi) lo = e_hi;
      if (!reach_lo) hi = e_lo;
      ck = key;
      cn = nn;
      for (size_t j = 0; j < rows; ++j) row_of[j] = w + j * nn;
      std::fill(base.begin(), base.end(), 0.0);
      banded = false;
    }
  }
  while (hi - lo > 1.0f / 64) {
    if (!banded && hi - lo <= 4) make_band(lo, hi);
    const float mid = 0.5f * (lo + hi);
    if (reached(kmax * std::exp2(mid))) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  // Never reached inside the bracket: only with the keys below kmax 2^-32, so every key.
  if (lo == kLo && !reached(kmax * std::exp2(kLo))) return answer(0.0f);
  const float k = kmax * std::exp2(lo);
  if (sum_at != nullptr) {  // every row over the band at k, plus what lies above the band
    threshold_row_sums(ck, row_of.data(), n_rows, cn, k, sum_at);
    for (size_t j = 0; j < rows; ++j) sum_at[j] += base[j];
  }
  return k;
}

// select_group_threshold's pass over R rows (kernels/selection.h): the key, stored; each
// row's total, summed as pass 1 sums it; the largest key; bad inputs; and, where lo < hi,
// the band [lo, hi) copied out (returned: its size) with each row's sum above it added to
// above, as threshold_band does.
template <int R>
size_t group_key_pass(const float* HWY_RESTRICT w, size_t nn, const float* inv, size_t a_lo, size_t a_hi,
                      float* HWY_RESTRICT key, double* total, float* kmax, bool* any_bad, float lo, float hi,
                      float* HWY_RESTRICT band_key, float* const* band, double* above) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  const bool banding = lo < hi;
  const auto vlo = hn::Set(d, lo), vhi = hn::Set(d, hi);
  hn::Vec<decltype(d)> vinv[R], tot[R], up_sum[R];
  for (int j = 0; j < R; ++j) {
    vinv[j] = hn::Set(d, inv[j]);
    tot[j] = hn::Zero(d);
    up_sum[j] = hn::Zero(d);
  }
  auto vmax = hn::Zero(d);
  auto bad = hn::FirstN(d, 0);
  size_t m = 0, i = 0;
  for (; i + N <= nn; i += N) {
    if ((i / N) % kChunk == 0 && i > 0) {  // float32 lanes for kChunk vectors, then float64
      for (int j = 0; j < R; ++j) {
        total[j] += hn::GetLane(hn::SumOfLanes(d, tot[j]));
        above[j] += hn::GetLane(hn::SumOfLanes(d, up_sum[j]));
        tot[j] = hn::Zero(d);
        up_sum[j] = hn::Zero(d);
      }
    }
    hn::Vec<decltype(d)> x[R];
    auto k = hn::Zero(d);
    for (int j = 0; j < R; ++j) {
      x[j] = hn::LoadU(d, w + j * nn + i);
      bad = hn::Or(bad, threshold_bad(d, x[j]));
      tot[j] = hn::Add(tot[j], x[j]);
      k = hn::Max(k, hn::Mul(x[j], vinv[j]));
    }
    hn::StoreU(k, d, key + i);
    if (i < a_lo || i + N > a_hi) {  // the always-taken entries
      for (size_t t = i; t < i + N; ++t)
        if (t < a_lo || t >= a_hi) key[t] = kAlwaysKey;
      k = hn::LoadU(d, key + i);
    }
    bad = hn::Or(bad, threshold_bad(d, k));
    vmax = hn::Max(vmax, k);
    if (banding) {
      const auto up = hn::Ge(k, vhi);
      const auto in = hn::And(hn::Ge(k, vlo), hn::Not(up));
      for (int j = 0; j < R; ++j) up_sum[j] = hn::Add(up_sum[j], hn::IfThenElseZero(up, x[j]));
      // Most vectors hold no key in the band, and skip the copy (append_selected).
      if (!hn::AllFalse(d, in)) {
        hn::Vec<decltype(d)> v[R + 1];
        float* dst[R + 1];
        for (int j = 0; j < R; ++j) v[j] = x[j], dst[j] = band[j];
        v[R] = k;
        dst[R] = band_key;
        m += append_selected(d, in, v, R + 1, dst, m);
      }
    }
  }
  for (int j = 0; j < R; ++j) {
    total[j] += hn::GetLane(hn::SumOfLanes(d, tot[j]));
    above[j] += hn::GetLane(hn::SumOfLanes(d, up_sum[j]));
  }
  float top = hn::GetLane(hn::MaxOfLanes(d, vmax));
  bool scalar_bad = false;
  for (; i < nn; ++i) {
    float k = 0;
    for (int j = 0; j < R; ++j) {
      const float x = w[j * nn + i];
      scalar_bad = scalar_bad || !(x >= 0 && x <= std::numeric_limits<float>::max());
      total[j] += x;
      k = std::max(k, x * inv[j]);
    }
    if (i < a_lo || i >= a_hi) k = kAlwaysKey;
    key[i] = k;
    scalar_bad = scalar_bad || !(k >= 0 && k <= std::numeric_limits<float>::max());
    top = std::max(top, k);
    if (banding && k >= hi) {
      for (int j = 0; j < R; ++j) above[j] += w[j * nn + i];
    } else if (banding && k >= lo) {
      band_key[m] = k;
      for (int j = 0; j < R; ++j) band[j][m] = w[j * nn + i];
      ++m;
    }
  }
  *kmax = top;
  *any_bad = scalar_bad || !hn::AllFalse(d, bad);
  return m;
}

float select_group_threshold_impl(const float* w, int n_rows, int n, const float* inv, int always_lo, int always_hi,
                                  float* key, const double* need, double* sum_at, float hint,
                                  MassThresholdWorkspace* workspace) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  const size_t rows = static_cast<size_t>(n_rows);
  const size_t nn = static_cast<size_t>(n);
  const size_t a_lo = static_cast<size_t>(std::clamp(always_lo, 0, n));
  const size_t a_hi = static_cast<size_t>(std::clamp(always_hi, always_lo, n));
  if (n_rows > kMaxRows) {  // the key first, then select_mass_threshold's passes
    std::fill(key, key + nn, 0.0f);
    for (size_t j = 0; j < rows; ++j)
      for (size_t t = 0; t < nn; ++t) key[t] = std::max(key[t], w[j * nn + t] * inv[j]);
    std::fill(key, key + a_lo, kAlwaysKey);
    std::fill(key + a_hi, key + nn, kAlwaysKey);
    return select_mass_threshold_impl(key, w, n_rows, n, need, sum_at, hint, workspace);
  }
  MassThresholdWorkspace call_ws;
  MassThresholdWorkspace& ws = workspace != nullptr ? *workspace : call_ws;
  // The largest key is kAlwaysKey when some entry is always taken (every other key is a share
  // of at most 1, up to rounding); the band is made for it and dropped if the pass finds otherwise.
  const float kmax_guess = a_lo > 0 || a_hi < nn ? kAlwaysKey : 0.0f;
  float lo = 0, hi = 0;
  if (hint > 0 && kmax_guess > 0 && hint <= kmax_guess) {
    float e_lo = 0, e_hi = 0;
    hint_band(hint, kmax_guess, &e_lo, &e_hi);
    lo = kmax_guess * std::exp2(e_lo);
    hi = kmax_guess * std::exp2(e_hi);
  }
  ws.total.assign(rows, 0.0);  // the pass adds to both
  ws.base.assign(rows, 0.0);
  ws.band_key.resize(nn + N);
  ws.band_w.resize(rows * (nn + N));
  ws.band_rows.resize(rows);
  for (size_t j = 0; j < rows; ++j) ws.band_rows[j] = ws.band_w.data() + j * (nn + N);
  using Pass = size_t (*)(const float*, size_t, const float*, size_t, size_t, float*, double*, float*, bool*, float,
                          float, float*, float* const*, double*);
  static constexpr Pass kPass[kMaxRows] = {group_key_pass<1>, group_key_pass<2>, group_key_pass<3>, group_key_pass<4>,
                                           group_key_pass<5>, group_key_pass<6>, group_key_pass<7>, group_key_pass<8>};
  float kmax = 0;
  bool any_bad = false;
  const size_t m = kPass[n_rows - 1](w, nn, inv, a_lo, a_hi, key, ws.total.data(), &kmax, &any_bad, lo, hi,
                                     ws.band_key.data(), ws.band_rows.data(), ws.base.data());
  if (any_bad) threshold_check(key, w, rows, nn);
  const bool pre = lo < hi && kmax == kmax_guess;
  return threshold_solve(key, w, n_rows, n, need, sum_at, hint, ws, kmax, pre ? m + 1 : 0);
}

void select_any_above_impl(const float* w, int n_rows, int n, const float* tau, int32_t base,
                           std::vector<int32_t>& out) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const size_t N = hn::Lanes(d);
  const size_t start = out.size();
  out.resize(start + static_cast<size_t>(n) + N);  // the whole-vector store's slack
  int32_t* o = out.data() + start;
  size_t count = 0;
  const auto step = hn::Set(di, static_cast<int32_t>(N));
  auto idx = hn::Add(hn::Iota(di, 0), hn::Set(di, base));
  size_t i = 0;
  for (; i + N <= static_cast<size_t>(n); i += N) {
    auto m = hn::Ge(hn::LoadU(d, w + i), hn::Set(d, tau[0]));
    for (int j = 1; j < n_rows; ++j)
      m = hn::Or(m, hn::Ge(hn::LoadU(d, w + static_cast<size_t>(j) * n + i), hn::Set(d, tau[j])));
    const auto mi = hn::RebindMask(di, m);
    int32_t* const dst[1] = {o};
    if (!hn::AllFalse(di, mi)) count += append_selected(di, mi, &idx, 1, dst, count);
    idx = hn::Add(idx, step);
  }
  for (; i < static_cast<size_t>(n); ++i) {
    bool hit = false;
    for (int j = 0; j < n_rows; ++j) hit = hit || w[static_cast<size_t>(j) * n + i] >= tau[j];
    if (hit) o[count++] = base + static_cast<int32_t>(i);
  }
  out.resize(start + count);
}

}  // namespace cumulus::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace cumulus::cpu {

HWY_EXPORT(select_mass_threshold_impl);
HWY_EXPORT(select_any_above_impl);
HWY_EXPORT(select_group_threshold_impl);

float select_mass_threshold(const float* key, const float* w, int n_rows, int n, const double* need, double* sum_at,
                            float hint, MassThresholdWorkspace* workspace) {
  CUMULUS_CHECK(n_rows >= 1 && n >= 0, "select_mass_threshold: n_rows={} must be >= 1 and n={} >= 0", n_rows, n);
  CUMULUS_CHECK(need != nullptr && (n == 0 || (key != nullptr && w != nullptr)),
                "select_mass_threshold: key, w and need must be non-null for n={}", n);
  return HWY_DYNAMIC_DISPATCH(select_mass_threshold_impl)(key, w, n_rows, n, need, sum_at, hint, workspace);
}

float select_group_threshold(const float* w, int n_rows, int n, const float* inv, int always_lo, int always_hi,
                             float* key, const double* need, double* sum_at, float hint,
                             MassThresholdWorkspace* workspace) {
  CUMULUS_CHECK(n_rows >= 1 && n >= 0, "select_group_threshold: n_rows={} must be >= 1 and n={} >= 0", n_rows, n);
  CUMULUS_CHECK(need != nullptr && inv != nullptr && (n == 0 || (key != nullptr && w != nullptr)),
                "select_group_threshold: w, inv, key and need must be non-null for n={}", n);
  for (int j = 0; j < n_rows; ++j)
    CUMULUS_CHECK(std::isfinite(inv[j]) && inv[j] > 0, "select_group_threshold: inv[{}]={} must be finite and > 0", j,
                  inv[j]);
  return HWY_DYNAMIC_DISPATCH(select_group_threshold_impl)(w, n_rows, n, inv, always_lo, always_hi, key, need, sum_at,
                                                           hint, workspace);
}

void select_any_above(const float* w, int n_rows, int n, const float* tau, int32_t base, std::vector<int32_t>& out) {
  CUMULUS_CHECK(n_rows >= 1 && n >= 0, "select_any_above: n_rows={} must be >= 1 and n={} >= 0", n_rows, n);
  CUMULUS_CHECK(n == 0 || (w != nullptr && tau != nullptr), "select_any_above: w and tau must be non-null");
  HWY_DYNAMIC_DISPATCH(select_any_above_impl)(w, n_rows, n, tau, base, out);
}

}  // namespace cumulus::cpu
#endif  // HWY_ONCE
