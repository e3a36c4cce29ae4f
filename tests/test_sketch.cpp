// The 4-bit key sketch (kernels/sketch.h) and the threshold ops (kernels/selection.h):
//   - the per-channel statistics against float64 sums computed here;
//   - the estimate of the float64 reference against the exact q . k of the stored keys,
//     within the bound the quantisation allows (half a step per channel, half an int8 step
//     of the query), on keys with an outlier channel and an offset;
//   - the CPU estimate against the reference on every SIMD target (AVX-512 VNNI included:
//     this file is compiled for it too), awkward sizes, every storage dtype, 1..8 queries,
//     ranges that start past 0;
//   - select_mass_threshold: the reference against a brute force over every distinct key,
//     the CPU backend against the reference within its stated contract, edge cases;
//   - select_any_above: CPU equals the reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kernels/selection.h"
#include "cumulus/kernels/sketch.h"
#include "cumulus/kv/kv_cache.h"
#include "kernel_check.h"

using namespace cumulus;

namespace {

using check::expect_error;
using check::for_each_target;

// Keys with the features real ones have: a per-channel offset, one channel 20x larger
// than the rest (RoPE'd keys have such), Gaussian otherwise. Never zero.
KvCache outlier_cache(int n, int head_dim, DType dt, std::mt19937& rng) {
  KvCacheOptions opt;
  opt.dtype = dt;
  KvCache kv(Shape{1, 1, 1, head_dim}, opt);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(head_dim)), v(k.size());
  for (int t = 0; t < n; ++t) {
    for (int c = 0; c < head_dim; ++c) {
      k[c] = nd(rng) * (c == 3 ? 20.0f : 1.0f) + 0.5f * static_cast<float>(c % 7) - 1.0f;
      v[c] = nd(rng);
    }
    kv.append(0, k.data(), v.data(), 1);
  }
  return kv;
}

struct Sketch {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> offset, step;
  std::vector<float> center, scale;
  int n = 0, d = 0;
  KeySketchView view() const { return {codes.data(), offset.data(), step.data(), center.data(), scale.data(), n, d}; }
};

Sketch build(const PagedHeadView& v) {
  Sketch s;
  s.n = v.n_tokens;
  s.d = v.head_dim;
  const size_t blocks = static_cast<size_t>((s.n + kSketchBlock - 1) / kSketchBlock);
  s.codes.assign(blocks * key_sketch_block_bytes(s.d), 0);
  s.offset.assign(blocks * kSketchBlock, 0);
  s.step.assign(blocks * kSketchBlock, 0);
  s.center.resize(static_cast<size_t>(s.d));
  s.scale.resize(static_cast<size_t>(s.d));
  key_sketch_channels(v, s.center.data(), s.scale.data());
  // In two calls, the second starting inside a block, as decode steps append.
  const int mid = s.n / 2 + 1 < s.n ? s.n / 2 + 1 : s.n;
  key_sketch_encode(v, 0, mid, s.center.data(), s.scale.data(), {s.codes.data(), s.offset.data(), s.step.data()});
  key_sketch_encode(v, mid, s.n, s.center.data(), s.scale.data(), {s.codes.data(), s.offset.data(), s.step.data()});
  return s;
}

std::vector<float> random_q(int n_q, int d, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n_q) * d);
  for (auto& x : q) x = nd(rng);
  return q;
}

// Code u of dim c of token t, read back from the documented layout.
int code_at(const Sketch& s, int t, int c) {
  const uint8_t b = s.codes[static_cast<size_t>(t / 16) * key_sketch_block_bytes(s.d) + (c / 8) * 64 + (t % 16) * 4 + c % 4];
  return (c % 8) < 4 ? (b & 0x0F) : (b >> 4);
}

}  // namespace

TEST(KeySketch, ChannelsAreTheKeysMeanAndDeviation) {
  std::mt19937 rng(5);
  KvCache kv = outlier_cache(300, 64, DType::f32, rng);
  const PagedHeadView v = kv.view(0, 0);
  std::vector<float> center(64), scale(64), k(64);
  key_sketch_channels(v, center.data(), scale.data());
  for (int c = 0; c < 64; ++c) {
    double s = 0, s2 = 0;
    for (int t = 0; t < 300; ++t) {
      kv.key_f32(0, 0, t, k.data());
      s += k[c];
    }
    const double mean = s / 300;
    for (int t = 0; t < 300; ++t) {
      kv.key_f32(0, 0, t, k.data());
      s2 += (k[c] - mean) * (k[c] - mean);
    }
    EXPECT_NEAR(center[c], mean, 1e-5 * (1 + std::abs(mean)));
    EXPECT_NEAR(scale[c], std::sqrt(s2 / 300), 1e-4 * std::sqrt(s2 / 300));
  }
  EXPECT_GT(scale[3], 10 * scale[4]);  // the outlier channel
}

// The reference's estimate against the exact q . k of the stored keys (float64), within
//   sum_c |q_c scale_c| step_t / 2 + step_t (qstep / 2) sum_c u_tc
// (each channel's code is within half a step of its normalised value, and q' within half
// an int8 step of qstep q8), plus float32 rounding of the normalisation.
TEST(KeySketch, EstimateIsWithinTheQuantisationBound) {
  std::mt19937 rng(11);
  for (int d : {8, 64, 128, 256}) {
    KvCache kv = outlier_cache(257, d, DType::f16, rng);
    const PagedHeadView v = kv.view(0, 0);
    const Sketch s = build(v);
    const std::vector<float> q = random_q(3, d, rng);
    std::vector<float> est(3 * 257), top(3);
    ref::key_sketch_score(s.view(), q.data(), 3, 0, 257, est.data(), top.data());
    std::vector<float> k(static_cast<size_t>(d));
    std::vector<int8_t> q8(static_cast<size_t>(d));
    int tight = 0;
    for (int j = 0; j < 3; ++j) {
      const float* qj = q.data() + j * d;
      const SketchQuery sq = key_sketch_quantize_query(s.view(), qj, q8.data());
      float best = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < 257; ++t) {
        kv.key_f32(0, 0, t, k.data());
        double exact = 0, qabs = 0, usum = 0, kabs = 0;
        for (int c = 0; c < d; ++c) {
          exact += static_cast<double>(qj[c]) * k[c];
          qabs += std::abs(static_cast<double>(qj[c]) * s.scale[c]);
          usum += code_at(s, t, c);
          kabs += std::abs(static_cast<double>(qj[c]) * k[c]);
        }
        const double stp = f16_to_f32(s.step[t]);
        const double bound = qabs * stp / 2 + stp * sq.qstep / 2 * usum + 1e-5 * (kabs + qabs);
        const double err = std::abs(est[j * 257 + t] - exact);
        EXPECT_LE(err, bound) << "d=" << d << " q " << j << " token " << t;
        tight += err > 0.1 * bound ? 1 : 0;
        best = std::max(best, est[j * 257 + t]);
      }
      EXPECT_EQ(top[j], best);
    }
    EXPECT_GT(tight, 0) << "the bound is never approached: the test would not see a wrong estimate";
  }
}

TEST(KeySketch, CpuMatchesReference) {
  std::mt19937 rng(23);
  for_each_target([&] {
    for (DType dt : {DType::f16, DType::bf16, DType::f32}) {
      for (int n : {1, 3, 15, 16, 17, 255, 4097}) {
        for (int d : {8, 64, 128, 256}) {
          if (n == 4097 && d != 128) continue;
          KvCache kv = outlier_cache(n, d, dt, rng);
          const Sketch s = build(kv.view(0, 0));
          for (int n_q : {1, 3, 4, 8, 9}) {
            const std::vector<float> q = random_q(n_q, d, rng);
            for (int t0 : {0, 16}) {
              if (t0 > n) continue;
              const int m = n - t0;
              std::vector<float> want(static_cast<size_t>(n_q) * m), got(want.size());
              std::vector<float> top_want(n_q), top_got(n_q);
              ref::key_sketch_score(s.view(), q.data(), n_q, t0, n, want.data(), top_want.data());
              cpu::key_sketch_score(s.view(), q.data(), n_q, t0, n, got.data(), top_got.data());
              // Both compute the same integer dot product; only the float32 affine terms
              // round differently (relative to the terms' size, not the result's).
              for (size_t i = 0; i < want.size(); ++i)
                ASSERT_NEAR(got[i], want[i], 1e-5 * (1 + std::abs(want[i])) * d)
                    << "n=" << n << " d=" << d << " n_q=" << n_q << " t0=" << t0 << " i=" << i;
              for (int j = 0; j < n_q; ++j) {
                if (m == 0) {
                  ASSERT_EQ(top_got[j], -std::numeric_limits<float>::infinity());
                } else {
                  ASSERT_NEAR(top_got[j], top_want[j], 1e-5 * (1 + std::abs(top_want[j])) * d);
                }
              }
            }
          }
        }
      }
    }
  });
}

// The weights: CPU (estimate and a degree-5 exp polynomial) against the reference
// (float64 exp of its estimates) within 1e-4 relative (the estimates' float32 rounding
// times the exponent's size, plus the polynomial's 3e-6), sums within 1e-5, and top;
// shifts at, below and above each query's largest estimate (the clamp included).
TEST(KeySketch, WeightsCpuMatchesReference) {
  std::mt19937 rng(29);
  for_each_target([&] {
    for (int n : {1, 17, 255, 4097}) {
      for (int d : {64, 128, 256}) {
        KvCache kv = outlier_cache(n, d, DType::f16, rng);
        const Sketch s = build(kv.view(0, 0));
        for (int n_q : {1, 3, 4, 9}) {
          const std::vector<float> q = random_q(n_q, d, rng);
          const float scale = 1.0f / std::sqrt(static_cast<float>(d));
          std::vector<float> est(static_cast<size_t>(n_q) * n), top0(n_q);
          ref::key_sketch_score(s.view(), q.data(), n_q, 0, n, est.data(), top0.data());
          for (float offset : {0.0f, -5.0f, 20.0f, -100.0f}) {
            std::vector<float> shift(n_q);
            for (int j = 0; j < n_q; ++j) shift[j] = scale * top0[j] + offset;
            std::vector<float> want(est.size()), got(est.size()), tw(n_q), tg(n_q);
            std::vector<double> sw(n_q), sg(n_q);
            ref::key_sketch_weights(s.view(), q.data(), n_q, 0, n, scale, shift.data(), want.data(), n, sw.data(),
                                    tw.data());
            cpu::key_sketch_weights(s.view(), q.data(), n_q, 0, n, scale, shift.data(), got.data(), n, sg.data(),
                                    tg.data());
            SCOPED_TRACE(::testing::Message() << "n=" << n << " d=" << d << " n_q=" << n_q << " offset=" << offset);
            for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4 * want[i] + 1e-37) << i;
            for (int j = 0; j < n_q; ++j) {
              ASSERT_NEAR(sg[j], sw[j], 1e-5 * sw[j] + 1e-37);
              ASSERT_NEAR(tg[j], tw[j], 1e-4 * (1 + std::abs(tw[j])));
              ASSERT_NEAR(tw[j], -offset, 1e-4 * (1 + std::abs(offset)));
            }
          }
        }
      }
    }
  });
}

TEST(KeySketch, BadArgumentsNameTheValue) {
  std::mt19937 rng(3);
  KvCache kv = outlier_cache(40, 64, DType::f16, rng);
  const Sketch s = build(kv.view(0, 0));
  std::vector<float> q(64, 1.0f), out(64 * 40);
  expect_error([&] { cpu::key_sketch_score(s.view(), q.data(), 1, 3, 40, out.data()); }, "multiple of 16");
  expect_error([&] { cpu::key_sketch_score(s.view(), q.data(), 1, 0, 41, out.data()); }, "41");
  expect_error([&] { ref::key_sketch_score(s.view(), q.data(), 0, 0, 40, out.data()); }, "n_q=0");
}

namespace {

// The definition, by brute force: the largest distinct key k at which every row's sum
// over keys >= k reaches its need.
float brute_threshold(const std::vector<float>& key, const std::vector<float>& w, int rows, const std::vector<double>& need) {
  const int n = static_cast<int>(key.size());
  bool any = false;
  for (double x : need) any = any || x > 0;
  if (!any) return std::numeric_limits<float>::infinity();
  std::vector<float> distinct(key);
  std::sort(distinct.begin(), distinct.end(), std::greater<>());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  for (float k : distinct) {
    bool all = true;
    for (int j = 0; j < rows; ++j) {
      double s = 0;
      for (int i = 0; i < n; ++i)
        if (key[i] >= k) s += w[static_cast<size_t>(j) * n + i];
      all = all && s >= need[j];
    }
    if (all) return k;
  }
  return -std::numeric_limits<float>::infinity();
}

std::vector<double> sums_at(const std::vector<float>& key, const std::vector<float>& w, int rows, float k) {
  const int n = static_cast<int>(key.size());
  std::vector<double> s(rows, 0.0);
  for (int j = 0; j < rows; ++j)
    for (int i = 0; i < n; ++i)
      if (key[i] >= k) s[j] += w[static_cast<size_t>(j) * n + i];
  return s;
}

// Heavy-tailed weights (log-normal of spread `sigma`), key = max over rows of the share.
void heavy_rows(int rows, int n, double sigma, std::mt19937& rng, std::vector<float>& key, std::vector<float>& w) {
  std::normal_distribution<double> nd(0.0, sigma);
  w.resize(static_cast<size_t>(rows) * n);
  for (auto& x : w) x = static_cast<float>(std::exp(nd(rng) - 3 * sigma));
  key.assign(static_cast<size_t>(n), 0.0f);
  for (int j = 0; j < rows; ++j) {
    double tot = 0;
    for (int i = 0; i < n; ++i) tot += w[static_cast<size_t>(j) * n + i];
    for (int i = 0; i < n; ++i) key[i] = std::max(key[i], static_cast<float>(w[static_cast<size_t>(j) * n + i] / tot));
  }
}

}  // namespace

TEST(SelectMassThreshold, ReferenceIsTheLargestKeyThatReaches) {
  std::mt19937 rng(7);
  for (int rows : {1, 3, 4}) {
    for (int n : {1, 2, 17, 300}) {
      std::vector<float> key, w;
      heavy_rows(rows, n, 2.0, rng, key, w);
      if (n > 2) key[1] = key[2];  // a tie: both enter together
      for (double p : {0.1, 0.5, 0.9, 0.999, 1.0}) {
        std::vector<double> need(rows);
        const std::vector<double> tot = sums_at(key, w, rows, 0.0f);
        for (int j = 0; j < rows; ++j) need[j] = p * tot[j];
        std::vector<double> at(rows);
        const float k = ref::select_mass_threshold(key.data(), w.data(), rows, n, need.data(), at.data());
        EXPECT_EQ(k, brute_threshold(key, w, rows, need)) << "rows=" << rows << " n=" << n << " p=" << p;
        const std::vector<double> want = sums_at(key, w, rows, k);
        for (int j = 0; j < rows; ++j) EXPECT_NEAR(at[j], want[j], 1e-9 * want[j]);
      }
    }
  }
}

// The CPU backend's contract, up to the rounding of its sums (float32 within chunks of
// 256 entries, float64 across; within eps = 1e-6 of each row's total here): k_cpu lies in
// [k_lo 2^(-1/64), k_hi], where k_lo is the reference's answer for the needs raised by
// eps x total and k_hi for the needs lowered by it (or k_cpu = 0 when k_lo lies below
// max(key) 2^-32); at k_cpu every row reaches its need within eps; sum_at is right. A
// caller's workspace, reused across every size below, gives the same answer bit for bit.
TEST(SelectMassThreshold, CpuIsWithinItsContract) {
  std::mt19937 rng(9);
  constexpr double kEps = 1e-6;
  for_each_target([&] {
    MassThresholdWorkspace ws;
    for (int rows : {1, 3, 4, 8, 9}) {
      for (int n : {1, 3, 15, 16, 17, 255, 4097, 40000}) {
        for (double sigma : {0.5, 2.0, 6.0}) {
          std::vector<float> key, w;
          heavy_rows(rows, n, sigma, rng, key, w);
          const std::vector<double> tot = sums_at(key, w, rows, 0.0f);
          float kmax = 0;
          for (float k : key) kmax = std::max(kmax, k);
          for (double p : {0.05, 0.9, 0.97, 0.9999}) {
            std::vector<double> need(rows), up(rows), down(rows);
            for (int j = 0; j < rows; ++j) {
              need[j] = p * tot[j];
              up[j] = std::min(tot[j], need[j] + kEps * tot[j]);
              down[j] = need[j] - kEps * tot[j];
            }
            std::vector<double> at(rows);
            const float k_lo = ref::select_mass_threshold(key.data(), w.data(), rows, n, up.data());
            const float k_hi = ref::select_mass_threshold(key.data(), w.data(), rows, n, down.data());
            const float k_ref = ref::select_mass_threshold(key.data(), w.data(), rows, n, need.data());
            // No hint, a right one, and wrong ones above and below.
            for (float hint : {0.0f, k_ref, k_ref * 1024.0f, k_ref / 1024.0f}) {
            const float kc = cpu::select_mass_threshold(key.data(), w.data(), rows, n, need.data(), at.data(), hint);
            SCOPED_TRACE(::testing::Message() << "rows=" << rows << " n=" << n << " sigma=" << sigma << " p=" << p
                                              << " hint=" << hint);
            std::vector<double> at_ws(rows);
            ASSERT_EQ(cpu::select_mass_threshold(key.data(), w.data(), rows, n, need.data(), at_ws.data(), hint, &ws),
                      kc);
            ASSERT_EQ(at_ws, at);
            ASSERT_LE(kc, k_hi);
            if (k_lo >= kmax * std::exp2(-32.0f)) {
              ASSERT_GE(kc, k_lo * std::exp2(-1.0f / 64) * (1 - 1e-6f));
            } else {
              ASSERT_GE(kc, 0.0f);
            }
            const std::vector<double> want = sums_at(key, w, rows, kc);
            for (int j = 0; j < rows; ++j) {
              ASSERT_GE(want[j], need[j] - kEps * tot[j]);
              ASSERT_NEAR(at[j], want[j], kEps * tot[j]);
            }
            }
          }
        }
      }
    }
  });
}

TEST(SelectMassThreshold, EdgeCases) {
  for_each_target([&] {
    const std::vector<float> key = {0.5f, 0.25f, 0.0f, 0.25f};
    const std::vector<float> w = {4, 2, 1, 2};
    std::vector<double> need = {0.0}, at(1);
    // Nothing needed: +inf, sums 0.
    EXPECT_EQ(cpu::select_mass_threshold(key.data(), w.data(), 1, 4, need.data(), at.data()),
              std::numeric_limits<float>::infinity());
    EXPECT_EQ(at[0], 0.0);
    EXPECT_EQ(ref::select_mass_threshold(key.data(), w.data(), 1, 4, need.data()), std::numeric_limits<float>::infinity());
    // More than there is: -inf, sums = totals.
    need = {9.5};
    EXPECT_EQ(cpu::select_mass_threshold(key.data(), w.data(), 1, 4, need.data(), at.data()),
              -std::numeric_limits<float>::infinity());
    EXPECT_EQ(at[0], 9.0);
    EXPECT_EQ(ref::select_mass_threshold(key.data(), w.data(), 1, 4, need.data()), -std::numeric_limits<float>::infinity());
    // The zero key's weight needed: threshold 0.
    need = {9.0};
    EXPECT_EQ(cpu::select_mass_threshold(key.data(), w.data(), 1, 4, need.data()), 0.0f);
    EXPECT_EQ(ref::select_mass_threshold(key.data(), w.data(), 1, 4, need.data()), 0.0f);
    // The largest key alone suffices.
    need = {4.0};
    EXPECT_GE(cpu::select_mass_threshold(key.data(), w.data(), 1, 4, need.data()), 0.5f * std::exp2(-1.0f / 64));
    // A weight far below the largest key that is needed: every positive key.
    const std::vector<float> key2 = {1.0f, 1e-20f};
    const std::vector<float> w2 = {1.0f, 1.0f};
    need = {2.0};
    const float k2 = cpu::select_mass_threshold(key2.data(), w2.data(), 1, 2, need.data());
    EXPECT_LE(k2, 1e-20f);
    // Bad values name themselves.
    const std::vector<float> bad = {1.0f, -1.0f};
    need = {1.0};
    expect_error([&] { cpu::select_mass_threshold(bad.data(), w2.data(), 1, 2, need.data()); }, "key[1]=-1");
    expect_error([&] { cpu::select_mass_threshold(key2.data(), bad.data(), 1, 2, need.data()); }, "w[1]=-1");
    expect_error([&] { ref::select_mass_threshold(bad.data(), w2.data(), 1, 2, need.data()); }, "key[1]=-1");
  });
}

// select_group_threshold computes the group key (max_j w[j][t] inv[j], 2 on the always-taken
// ends) and the threshold in one pass: the key, the answer and sum_at equal, bit for bit,
// the key computed here and cpu::select_mass_threshold on it (whose contract against the
// reference is checked above); with no hint, good hints, bad hints, and keys above 2 (the
// pass's band, made for a largest key of 2, is then dropped).
TEST(SelectGroupThreshold, EqualsTheKeyThenSelectMassThreshold) {
  std::mt19937 rng(21);
  for_each_target([&] {
    MassThresholdWorkspace ws, ws_ref;
    for (int rows : {1, 3, 4, 8, 9}) {
      for (int n : {1, 15, 17, 300, 4097, 40000}) {
        std::vector<float> unused, w;
        heavy_rows(rows, n, 2.0, rng, unused, w);
        const std::vector<double> tot = sums_at(unused, w, rows, 0.0f);
        for (const bool shares : {true, false}) {
          std::vector<float> inv(rows);
          for (int j = 0; j < rows; ++j) inv[j] = shares ? static_cast<float>(1.0 / tot[j]) : 1e6f;
          for (const auto& [lo, hi] : {std::pair{0, n}, std::pair{std::min(4, n), std::max(std::min(4, n), n - 64)},
                                      std::pair{0, n - 1}}) {
            std::vector<float> key_ref(n, 0.0f);
            for (int j = 0; j < rows; ++j)
              for (int t = 0; t < n; ++t) key_ref[t] = std::max(key_ref[t], w[static_cast<size_t>(j) * n + t] * inv[j]);
            std::fill(key_ref.begin(), key_ref.begin() + lo, 2.0f);
            std::fill(key_ref.begin() + hi, key_ref.end(), 2.0f);
            for (double p : {0.5, 0.92, 0.9999}) {
              std::vector<double> need(rows);
              for (int j = 0; j < rows; ++j) need[j] = p * tot[j];
              const float k0 = cpu::select_mass_threshold(key_ref.data(), w.data(), rows, n, need.data());
              for (float hint : {0.0f, k0, k0 * 1.01f, k0 * 64.0f, k0 / 64.0f}) {
                SCOPED_TRACE(::testing::Message() << "rows=" << rows << " n=" << n << " shares=" << shares
                                                  << " lo=" << lo << " hi=" << hi << " p=" << p << " hint=" << hint);
                std::vector<double> at_ref(rows), at(rows);
                const float want = cpu::select_mass_threshold(key_ref.data(), w.data(), rows, n, need.data(),
                                                              at_ref.data(), hint, &ws_ref);
                std::vector<float> key(n, -1.0f);
                const float got = cpu::select_group_threshold(w.data(), rows, n, inv.data(), lo, hi, key.data(),
                                                              need.data(), at.data(), hint, &ws);
                ASSERT_EQ(got, want);
                ASSERT_EQ(at, at_ref);
                ASSERT_EQ(key, key_ref);
              }
            }
          }
        }
      }
    }
    // Bad input names itself.
    const std::vector<float> w = {1.0f, -1.0f};
    const std::vector<float> good = {1.0f, 1.0f};
    std::vector<float> key(2);
    std::vector<double> need = {1.0};
    float inv = 1.0f;
    expect_error([&] { cpu::select_group_threshold(w.data(), 1, 2, &inv, 0, 2, key.data(), need.data()); },
                 "w[1]=-1");
    inv = 0.0f;
    expect_error([&] { cpu::select_group_threshold(good.data(), 1, 2, &inv, 0, 2, key.data(), need.data()); },
                 "inv[0]=0");
  });
}

TEST(SelectAnyAbove, CpuEqualsReference) {
  std::mt19937 rng(13);
  for_each_target([&] {
    for (int rows : {1, 3, 4}) {
      for (int n : {0, 1, 15, 16, 17, 1000}) {
        std::vector<float> key, w;
        heavy_rows(rows, std::max(n, 1), 1.0, rng, key, w);
        std::vector<float> tau(rows);
        for (int j = 0; j < rows; ++j) tau[j] = w[static_cast<size_t>(j) * std::max(n, 1)] * 0.9f;
        if (rows > 1) tau[1] = std::numeric_limits<float>::infinity();  // that row selects nothing
        std::vector<int32_t> want = {-5}, got = {-5};                  // appended after what is there
        ref::select_any_above(w.data(), rows, n, tau.data(), 100, want);
        cpu::select_any_above(w.data(), rows, n, tau.data(), 100, got);
        EXPECT_EQ(got, want) << "rows=" << rows << " n=" << n;
        if (n == 1000) {
          EXPECT_GT(want.size(), 1u);
        }
      }
    }
  });
}
