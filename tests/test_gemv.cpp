// GEMV against block-quantised weights: the SIMD backend (on every SIMD target this binary
// carries) against the float64 reference on fresh random matrices (random codes, random
// f16 scales and mins of both signs, random x; never zeros) of awkward sizes: rows 1, 3,
// 15, 16, 17, 255, 4097 and 1 to 129 blocks of 32 per row (K-quants: 1 to 17 blocks of 256),
// in every format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). Also: the product against
// gguf-py's dequantised matrices (tests/data/quant_reference.json); the activation
// rounding is bit-identical to the reference's and within its documented bound of the
// exact product; bit-identical results for 1, 2 and 3 threads and for a row computed
// alone or in a group; dequantisation equals the reference; WeightMatrix keeps GGUF
// blocks as values equal to the GGUF dequantiser's (itself checked against gguf-py in
// test_model_quant.cpp); bad views and bad tensors are errors that name the value.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/kernels/gemv.h"
#include "kernels/cpu/gemv_pool.h"
#include "cumulus/model/quant.h"
#include "cumulus/model/weight_matrix.h"
#include "fixtures.h"
#include "kernel_check.h"

using namespace cumulus;

namespace {

// Tolerance on |y_cpu - y_ref| / sum_j |w_j x_j| per row, both computing W (dx q) from the
// same activation codes. The integer block sums are exact; what rounds is the f16 -> float
// scale times dx (2^-24), the float conversion of the block sum and the float32
// accumulation across blocks (~log2(blocks) roundings of 2^-24 relative to the running
// magnitude, bounded by sum |w x|); 1e-5 is a wide margin over the ~1e-7 seen and still
// catches any wrong code, scale or block by orders of magnitude (one wrong element among
// 4128 moves the ratio by ~1e-4).
constexpr double kTol = 1e-5;

using check::for_each_target;

// Byte offsets of the f16 scale fields in a verbatim block (set to finite values: random
// bytes could make Inf/NaN).
std::vector<size_t> f16_fields(QuantFormat f) {
  switch (f) {
    case QuantFormat::q5_0: return {0};
    case QuantFormat::q6_k: return {208};
    default: return {0, 2};  // Q5_1 d, m; Q4_K/Q5_K d, dmin
  }
}

// A random quantised matrix: codes (and Q5_x bit-4 words) are uniform bytes, scales f16 of
// magnitude [1e-3, 0.1] and either sign, mins in [-0.5, 0.5]. Repacked formats: padding
// scales beyond cols / 32 stay zero, as the layout requires. Verbatim formats: random
// blocks whose f16 fields are set likewise (K-quant sub-block scales and codes are the
// random bytes).
struct RandomMatrix {
  QuantFormat format;
  int rows, cols;
  std::vector<uint8_t> qs;
  std::vector<uint16_t> d, m;
  std::vector<uint32_t> qh;

  RandomMatrix(QuantFormat f, int r, int c, std::mt19937& rng) : format(f), rows(r), cols(c) {
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> mag(1e-3f, 0.1f), mn(-0.5f, 0.5f);
    if (!quant_format_repacked(f)) {
      const size_t tb = static_cast<size_t>(quant_block_bytes(f));
      qs.resize(static_cast<size_t>(r) * (c / quant_format_block(f)) * tb);
      for (auto& b : qs) b = static_cast<uint8_t>(byte(rng));
      for (size_t blk = 0; blk < qs.size(); blk += tb) {
        for (size_t off : f16_fields(f)) {
          const uint16_t h = f32_to_f16(off == 2 && f == QuantFormat::q5_1 ? mn(rng) : byte(rng) % 2 ? mag(rng) : -mag(rng));
          std::memcpy(&qs[blk + off], &h, 2);
        }
      }
      return;
    }
    const int nb = c / kQuantBlock, stride = quant_scale_stride(c);
    qs.resize(static_cast<size_t>(r) * nb * quant_block_bytes(f));
    for (auto& b : qs) b = static_cast<uint8_t>(byte(rng));
    const bool has_min = f == QuantFormat::q4_1 || f == QuantFormat::q5_1;
    d.assign(static_cast<size_t>(r) * stride, 0);
    if (has_min) m.assign(d.size(), 0);
    if (f == QuantFormat::q5_0 || f == QuantFormat::q5_1) {
      std::uniform_int_distribution<uint32_t> word;
      qh.resize(static_cast<size_t>(r) * nb);
      for (auto& h : qh) h = word(rng);
    }
    for (int i = 0; i < r; ++i) {
      for (int b = 0; b < nb; ++b) {
        const size_t k = static_cast<size_t>(i) * stride + b;
        d[k] = f32_to_f16(byte(rng) % 2 ? mag(rng) : -mag(rng));
        if (has_min) m[k] = f32_to_f16(mn(rng));
      }
    }
  }
  QuantMatrixView view() const {
    return {format, rows, cols, qs.data(), d.empty() ? nullptr : d.data(), m.empty() ? nullptr : m.data(),
            qh.empty() ? nullptr : qh.data()};
  }
};

std::vector<float> random_x(int n, std::mt19937& rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = g(rng);
  return x;
}

// sum_j |w_j x_j| of each row (the scale of the float32 rounding error).
std::vector<double> abs_dot(const QuantMatrixView& w, const std::vector<float>& x) {
  std::vector<double> deq(static_cast<size_t>(w.rows) * w.cols), out(static_cast<size_t>(w.rows));
  ref::quant_dequantize_rows(w, 0, w.rows, deq.data());
  for (int r = 0; r < w.rows; ++r) {
    double s = 0.0;
    for (int j = 0; j < w.cols; ++j) s += std::fabs(deq[static_cast<size_t>(r) * w.cols + j] * x[static_cast<size_t>(j)]);
    out[static_cast<size_t>(r)] = s;
  }
  return out;
}

const QuantFormat kFormats[] = {QuantFormat::q4_0, QuantFormat::q4_1, QuantFormat::q5_0, QuantFormat::q5_1,
                                QuantFormat::q8_0, QuantFormat::q4_k, QuantFormat::q5_k, QuantFormat::q6_k};
const int kRows[] = {1, 3, 15, 16, 17, 255};
// Blocks per row: cols 32, 96, 544, 1536, 4128 for the 32-element formats; 256, 768, 2304,
// 4352 for the K-quants (blocks of 256).
std::vector<int> test_cols(QuantFormat f) {
  if (quant_format_block(f) == 256) return {256, 768, 2304, 4352};
  return {32, 96, 544, 1536, 4128};
}
// A small column count valid for every format.
int small_cols(QuantFormat f) { return quant_format_block(f) == 256 ? 256 : 96; }

// The source tree as configured (not __FILE__, which ccache's base directory makes relative
// to the build folder, so the test failed when run from anywhere else).
std::filesystem::path repo_root() { return test::source_dir(); }

}  // namespace

TEST(GemvQuant, MatchesReferenceAllSizesAndFormats) {
  // Both activation widths through gemv_quant_rows on every target (8 bits: VNNI byte dot
  // products on AVX3_DL, the 16-bit path on the 8-bit codes elsewhere), and gemv_quant at the
  // width it picks for the target.
  std::mt19937 rng(2024);
  ThreadPool pool(2);
  for (QuantFormat f : kFormats) {
    for (int rows : kRows) {
      for (int cols : test_cols(f)) {
        const RandomMatrix m(f, rows, cols, rng);
        const std::vector<float> x = random_x(m.cols, rng);
        QuantActivation xq[2];
        std::vector<double> want[2];
        for (int i = 0; i < 2; ++i) {
          ref::quant_activation(x.data(), m.cols, i == 0 ? 16 : 8, xq[i]);
          want[i].resize(static_cast<size_t>(rows));
          ref::gemv_quant(m.view(), xq[i], want[i].data());
        }
        const std::vector<double> scale = abs_dot(m.view(), x);
        auto worst = [&](const std::vector<float>& got, const std::vector<double>& w) {
          double e = 0.0;
          for (int r = 0; r < rows; ++r)
            e = std::max(e, std::fabs(got[static_cast<size_t>(r)] - w[static_cast<size_t>(r)]) / scale[static_cast<size_t>(r)]);
          return e;
        };
        for_each_target([&] {
          for (int i = 0; i < 2; ++i) {
            std::vector<float> got(static_cast<size_t>(rows), std::numeric_limits<float>::quiet_NaN());
            cpu::gemv_quant_rows(m.view(), 0, rows, xq[i], got.data());
            EXPECT_LE(worst(got, want[i]), kTol) << quant_format_name(f) << " rows " << rows << " cols " << m.cols << " bits "
                                                  << xq[i].bits;
          }
          const int bits = cpu::gemv_quant_activation_bits();
          std::vector<float> got(static_cast<size_t>(rows), std::numeric_limits<float>::quiet_NaN());
          cpu::gemv_quant(m.view(), x.data(), got.data(), pool);
          EXPECT_LE(worst(got, want[bits == 16 ? 0 : 1]), kTol) << quant_format_name(f) << " rows " << rows << " cols " << m.cols;
        });
      }
    }
  }
}

TEST(GemvQuant, ProductsTakeSixteenBitActivationsOnEveryTarget) {
  // 8-bit codes are the callers' choice (quant_activation + gemv_quant_rows), never the
  // default: kernels/gemv.h says why. On every target the product the runtime takes
  // (gemv_quant) equals the rows over 16-bit codes bit for bit, and differs from the rows
  // over 8-bit codes; the width it reports is 16.
  std::mt19937 rng(7);
  ThreadPool pool(2);
  constexpr int kRowsHere = 37;
  for (QuantFormat f : kFormats) {
    const RandomMatrix m(f, kRowsHere, small_cols(f), rng);
    const std::vector<float> x = random_x(m.cols, rng);
    for_each_target([&] {
      EXPECT_EQ(cpu::gemv_quant_activation_bits(), 16);
      std::vector<float> got(kRowsHere), w16(kRowsHere), w8(kRowsHere);
      cpu::gemv_quant(m.view(), x.data(), got.data(), pool);
      QuantActivation a;
      cpu::quant_activation(x.data(), m.cols, 16, a);
      cpu::gemv_quant_rows(m.view(), 0, kRowsHere, a, w16.data());
      cpu::quant_activation(x.data(), m.cols, 8, a);
      cpu::gemv_quant_rows(m.view(), 0, kRowsHere, a, w8.data());
      EXPECT_EQ(std::memcmp(got.data(), w16.data(), got.size() * sizeof(float)), 0) << quant_format_name(f);
      EXPECT_NE(std::memcmp(got.data(), w8.data(), got.size() * sizeof(float)), 0) << quant_format_name(f);
    });
  }
}

TEST(GemvQuant, TallMatrix) {
  // 4097 rows: many tasks, a ragged last task and a ragged last row group.
  std::mt19937 rng(7);
  ThreadPool pool(2);
  for (QuantFormat f : kFormats) {
    const RandomMatrix m(f, 4097, small_cols(f), rng);
    const std::vector<float> x = random_x(m.cols, rng);
    QuantActivation xq;
    ref::quant_activation(x.data(), m.cols, cpu::gemv_quant_activation_bits(), xq);
    std::vector<double> want(4097);
    ref::gemv_quant(m.view(), xq, want.data());
    const std::vector<double> scale = abs_dot(m.view(), x);
    std::vector<float> got(4097, std::numeric_limits<float>::quiet_NaN());
    cpu::gemv_quant(m.view(), x.data(), got.data(), pool);
    for (size_t r = 0; r < got.size(); ++r)
      ASSERT_LE(std::fabs(got[r] - want[r]) / scale[r], kTol) << quant_format_name(f) << " row " << r;
  }
}

// The split the runtime uses: at most one contiguous run of whole row groups per thread (at
// least 16 rows, the shortest that covers every row); the bit-identity test below is what
// makes a split by thread count safe.
TEST(GemvQuant, TaskRowsGiveAThreadAtMostOneRunOfWholeGroups) {
  for (int rows : {1, 15, 16, 17, 192, 576, 1037, 1536, 49152, 262144}) {
    for (int threads : {1, 2, 3, 16, 64}) {
      const int per = cpu::gemv_quant_task_rows(rows, threads);
      const int tasks = (rows + per - 1) / per;
      EXPECT_EQ(per % 4, 0) << rows << " rows, " << threads << " threads";
      EXPECT_GE(per, 16) << rows << " rows, " << threads << " threads";
      EXPECT_LE(tasks, threads) << rows << " rows, " << threads << " threads";
      // The shortest such run: a group less would need more tasks than threads, or fewer
      // than 16 rows per task.
      const int less = per - 4;
      EXPECT_TRUE(less < 16 || (rows + less - 1) / less > threads) << rows << " rows, " << threads << " threads";
    }
  }
  EXPECT_EQ(cpu::gemv_quant_task_rows(576, 0), 576);  // no threads counts as one
}

TEST(GemvQuant, BitIdenticalForAnyThreadCountAndRowGrouping) {
  std::mt19937 rng(99);
  ThreadPool p1(1), p2(2), p3(3);
  for (QuantFormat f : kFormats) {
    const RandomMatrix m(f, 1037, 1536, rng);
    const std::vector<float> x = random_x(m.cols, rng);
    std::vector<float> y1(1037), y2(1037), y3(1037);
    cpu::gemv_quant(m.view(), x.data(), y1.data(), p1);
    cpu::gemv_quant(m.view(), x.data(), y2.data(), p2);
    cpu::gemv_quant(m.view(), x.data(), y3.data(), p3);
    EXPECT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)), 0) << quant_format_name(f);
    EXPECT_EQ(std::memcmp(y1.data(), y3.data(), y1.size() * sizeof(float)), 0) << quant_format_name(f);
    // Each row alone (the single-row path) equals the same row inside a group of four, at
    // both activation widths.
    for (int bits : {16, 8}) {
      QuantActivation xq;
      cpu::quant_activation(x.data(), m.cols, bits, xq);
      std::vector<float> all(1037);
      cpu::gemv_quant_rows(m.view(), 0, 1037, xq, all.data());
      if (bits == cpu::gemv_quant_activation_bits()) {
        EXPECT_EQ(std::memcmp(all.data(), y1.data(), y1.size() * sizeof(float)), 0) << quant_format_name(f);
      }
      for (int r : {0, 1, 5, 1036}) {
        float alone;
        cpu::gemv_quant_rows(m.view(), r, r + 1, xq, &alone);
        EXPECT_EQ(std::memcmp(&alone, &all[static_cast<size_t>(r)], sizeof(float)), 0)
            << quant_format_name(f) << " bits " << bits << " row " << r;
      }
    }
  }
}

TEST(GemvQuant, ActivationRoundingMatchesReferenceAndItsBound) {
  // Both widths, Q = 32767 or 127: bit-identical codes, scales and sums (and for 8 bits the
  // int8 codes and sums of 4) on every target; |dx q - x| <= 0.506 dx per element (half a
  // code, plus the float32 roundings of Q / amax and amax / Q, each 2^-24 relative, times up
  // to Q codes: < 0.006 dx), so the rounded product differs from the exact one by at most
  // sum_b 0.506 dx_b sum |w_b|.
  std::mt19937 rng(17);
  for (int bits : {16, 8}) {
    const int qmax = bits == 16 ? 32767 : 127;
    for (int blocks : {1, 3, 17, 129}) {
      std::vector<float> x = random_x(blocks * kQuantBlock, rng);
      // Awkward blocks: one all zero, one with a single non-zero, one with huge values.
      if (blocks >= 3) {
        std::fill(x.begin() + kQuantBlock, x.begin() + 2 * kQuantBlock, 0.0f);
        x[2 * kQuantBlock + 5] = -3.0f;
        for (int j = 0; j < kQuantBlock; ++j) x[static_cast<size_t>(j)] *= 1e30f;
      }
      QuantActivation want;
      ref::quant_activation(x.data(), static_cast<int>(x.size()), bits, want);
      EXPECT_EQ(want.bits, bits);
      for (size_t i = 0; i < x.size(); ++i) {
        const float dx = want.d[i / kQuantBlock];
        ASSERT_LE(std::abs(want.q[i]), qmax);
        ASSERT_LE(std::fabs(static_cast<double>(dx) * want.q[i] - x[i]), 0.506 * dx + 1e-30) << "element " << i;
      }
      if (blocks >= 3) {
        EXPECT_EQ(want.q[2 * kQuantBlock + 5], -qmax);
      }
      if (bits == 8) {
        ASSERT_EQ(want.q8.size(), x.size());
        ASSERT_EQ(want.sum4.size(), x.size() / 4);
        for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(want.q8[i], want.q[i]);
        for (size_t i = 0; i < x.size() / 4; ++i)
          ASSERT_EQ(want.sum4[i], want.q[4 * i] + want.q[4 * i + 1] + want.q[4 * i + 2] + want.q[4 * i + 3]);
      } else {
        EXPECT_TRUE(want.q8.empty() && want.sum4.empty());
      }
      for_each_target([&] {
        QuantActivation got;
        cpu::quant_activation(x.data(), static_cast<int>(x.size()), bits, got);
        EXPECT_EQ(got.bits, want.bits);
        EXPECT_EQ(got.q, want.q);
        EXPECT_EQ(got.d, want.d);
        EXPECT_EQ(got.sum, want.sum);
        EXPECT_EQ(got.q8, want.q8);
        EXPECT_EQ(got.sum4, want.sum4);
      });
    }
    // The bound on a whole product, against the exact float64 W x.
    const RandomMatrix m(QuantFormat::q4_1, 33, 17 * kQuantBlock, rng);
    const std::vector<float> x = random_x(m.cols, rng);
    QuantActivation xq;
    ref::quant_activation(x.data(), m.cols, bits, xq);
    std::vector<double> rounded(33), deq(static_cast<size_t>(33) * m.cols);
    ref::gemv_quant(m.view(), xq, rounded.data());
    ref::quant_dequantize_rows(m.view(), 0, 33, deq.data());
    for (int r = 0; r < 33; ++r) {
      double exact = 0, bound = 0;
      for (int j = 0; j < m.cols; ++j) {
        const double wj = deq[static_cast<size_t>(r) * m.cols + j];
        exact += wj * x[static_cast<size_t>(j)];
        bound += std::fabs(wj) * 0.506 * xq.d[static_cast<size_t>(j / kQuantBlock)];
      }
      EXPECT_LE(std::fabs(rounded[static_cast<size_t>(r)] - exact), bound) << "bits " << bits << " row " << r;
    }
  }
  check::expect_error([] {
    QuantActivation a;
    const std::vector<float> x(64, 1.0f);
    cpu::quant_activation(x.data(), 64, 12, a);
  }, "bits=12 must be 8 or 16");
}

TEST(GemvQuant, DequantizeMatchesReference) {
  // Repacked formats: q d (+ m) is one float32 rounding of the exact value (or two without
  // FMA): 1 ulp. Verbatim formats: scale * code - min with scale = d sc and min = dmin m each
  // rounded to float32 first, so the error is a few ulp of |d sc q| + |dmin m|, which can
  // exceed |value| when they cancel: bounded by 1e-6 of the row's largest |value| (a wrong
  // code, scale or min is off by >= 1e-3 of it).
  std::mt19937 rng(5);
  for (QuantFormat f : kFormats) {
    for (int cols : {quant_format_block(f), 17 * quant_format_block(f), test_cols(f).back()}) {
      const RandomMatrix m(f, 17, cols, rng);
      std::vector<double> want(static_cast<size_t>(m.rows) * m.cols);
      ref::quant_dequantize_rows(m.view(), 0, m.rows, want.data());
      for_each_target([&] {
        std::vector<float> got(want.size(), std::numeric_limits<float>::quiet_NaN());
        cpu::quant_dequantize_rows(m.view(), 3, 17, got.data());
        for (int r = 3; r < 17; ++r) {
          const double* wr = want.data() + static_cast<size_t>(r) * m.cols;
          const float* gr = got.data() + static_cast<size_t>(r - 3) * m.cols;
          double row_max = 0;
          for (int c = 0; c < m.cols; ++c) row_max = std::max(row_max, std::fabs(wr[c]));
          ASSERT_GT(row_max, 0.0);
          for (int c = 0; c < m.cols; ++c) {
            const double tol = quant_format_repacked(f) ? 2.4e-7 * std::fabs(wr[c]) + 1e-30 : 1e-6 * row_max;
            ASSERT_LE(std::fabs(gr[c] - wr[c]), tol) << quant_format_name(f) << " row " << r << " col " << c;
          }
        }
      });
    }
  }
}

TEST(GemvQuant, MatchesGgufPyProduct) {
  // 3-row matrices of random GGUF blocks of each format, x float32, y = W x in float64 over
  // the matrix gguf-py dequantises (tools/reference/make_quant_fixture.py). cumulus rounds
  // x to 16- or 8-bit codes, which moves y by at most sum_j |w_j| 0.506 dx_b (see
  // ActivationRoundingMatchesReferenceAndItsBound); on top, kTol of sum |w x| for float32.
  const auto path = repo_root() / "tests/data/quant_reference.json";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path;
  const nlohmann::json j = nlohmann::json::parse(in);
  ThreadPool pool(2);
  int n_cases = 0;
  for (const auto& c : j.at("gemv_cases")) {
    const std::string name = c.at("type");
    std::optional<QuantFormat> f;
    for (QuantFormat q : kFormats)
      if (quant_format_name(q) == name) f = q;
    ASSERT_TRUE(f.has_value()) << name;
    const int rows = c.at("rows"), cols = c.at("cols");
    const std::string hex = c.at("raw_hex");
    std::vector<uint8_t> raw(hex.size() / 2);
    for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    const std::vector<double> xd = c.at("x"), y = c.at("y"), abs_y = c.at("abs_y");
    const std::vector<float> x(xd.begin(), xd.end());
    ASSERT_EQ(static_cast<int>(x.size()), cols);
    // Through the loader's path: the GGUF bytes become a WeightMatrix (repacked or kept).
    const GgmlType t = *[&]() -> std::optional<GgmlType> {
      for (GgmlType g : {GgmlType::q4_0, GgmlType::q4_1, GgmlType::q5_0, GgmlType::q5_1, GgmlType::q8_0, GgmlType::q4_k,
                         GgmlType::q5_k, GgmlType::q6_k})
        if (ggml_type_name(g) == name) return g;
      return std::nullopt;
    }();
    const WeightMatrix w = WeightMatrix::from_ggml(t, raw, rows, cols, WeightStorage::compact, "fixture");
    ASSERT_EQ(w.quant_view().format, *f);
    std::vector<double> deq(static_cast<size_t>(rows) * cols);
    ref::quant_dequantize_rows(w.quant_view(), 0, rows, deq.data());
    for_each_target([&] {
      // The bound's dx: the activation width gemv_quant takes on this target.
      QuantActivation xq;
      ref::quant_activation(x.data(), cols, cpu::gemv_quant_activation_bits(), xq);
      std::vector<float> got(static_cast<size_t>(rows), std::numeric_limits<float>::quiet_NaN());
      cpu::gemv_quant(w.quant_view(), x.data(), got.data(), pool);
      for (int r = 0; r < rows; ++r) {
        double bound = kTol * abs_y[static_cast<size_t>(r)];
        for (int k = 0; k < cols; ++k)
          bound += std::fabs(deq[static_cast<size_t>(r) * cols + k]) * 0.506 * xq.d[static_cast<size_t>(k / kQuantBlock)];
        EXPECT_LE(std::fabs(got[static_cast<size_t>(r)] - y[static_cast<size_t>(r)]), bound) << name << " row " << r;
      }
    });
    ++n_cases;
  }
  EXPECT_EQ(n_cases, 8);
}

TEST(GemvQuant, WeightMatrixRepacksGgufBlocks) {
  // Random GGUF blocks (f16 scales first, then codes, as in the file) of each kept type:
  // the repacked matrix reads back what the GGUF dequantiser reads from the raw bytes, and
  // weight_matmul over it equals the float64 references (below).
  std::mt19937 rng(31);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  for (GgmlType t : {GgmlType::q4_0, GgmlType::q4_1, GgmlType::q5_0, GgmlType::q5_1, GgmlType::q8_0, GgmlType::q4_k,
                     GgmlType::q5_k, GgmlType::q6_k}) {
    const GgmlTypeInfo& info = ggml_type_info(t);
    const int rows = 19, cols = static_cast<int>(info.block_size) * (info.block_size == 32 ? 17 : 3);
    std::vector<uint8_t> raw(static_cast<size_t>(rows) * (cols / info.block_size) * info.type_size);
    // Finite f16 fields (random bytes could make Inf/NaN f16 values): d (and m / dmin) at
    // the block's start, Q6_K's d at byte 208.
    const std::vector<size_t> fields = t == GgmlType::q6_k                            ? std::vector<size_t>{208}
                                       : t == GgmlType::q4_1 || t == GgmlType::q5_1 ||
                                               t == GgmlType::q4_k || t == GgmlType::q5_k ? std::vector<size_t>{0, 2}
                                                                                       : std::vector<size_t>{0};
    for (size_t b = 0; b < raw.size(); b += info.type_size) {
      for (size_t i = 0; i < info.type_size; ++i) raw[b + i] = static_cast<uint8_t>(byte(rng));
      for (size_t off : fields) {
        const uint16_t h = f32_to_f16(scale(rng));
        std::memcpy(&raw[b + off], &h, 2);
      }
    }
    std::vector<float> want(static_cast<size_t>(rows) * cols);
    dequantize_row(t, raw.data(), want.data(), want.size());
    const WeightMatrix w = WeightMatrix::from_ggml(t, raw, rows, cols, WeightStorage::compact, "w");
    ASSERT_TRUE(w.quantized());
    EXPECT_EQ(w.storage_name(), info.name);
    const std::vector<float> got = w.to_f32();
    // Repacked formats: the same float32 operations as the GGUF dequantiser, 1 ulp. K-quants: d sc q - dmin m in another order of float32 roundings: 1e-6 of the row's
    // largest value (see DequantizeMatchesReference).
    for (int r = 0; r < rows; ++r) {
      float row_max = 0;
      for (int c = 0; c < cols; ++c) row_max = std::max(row_max, std::fabs(want[static_cast<size_t>(r) * cols + c]));
      for (int c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r) * cols + c;
        const double tol = info.block_size == 32 ? 2.4e-7 * std::fabs(want[i]) + 1e-30 : 1e-6 * row_max;
        ASSERT_LE(std::fabs(got[i] - want[i]), tol) << info.name << " element " << i;
      }
    }
    const WeightMatrix f = WeightMatrix::from_ggml(t, raw, rows, cols, WeightStorage::f32, "w");
    EXPECT_FALSE(f.quantized());
    EXPECT_EQ(f.to_f32(), want);
    EXPECT_LT(w.bytes() * 5, f.bytes() * 2) << "compact storage is not compact";
    // The verbatim formats hold exactly the tensor's bytes.
    if (!quant_format_repacked(w.quant_view().format)) {
      EXPECT_EQ(w.bytes(), raw.size()) << info.name;
    }

    // weight_matmul, the path the model runs: the compact matrix and the float32 one in one
    // call, 1 and 3 rows of x, on 1-3 threads. Compact = ref::gemv_quant over its view (the
    // activation rounding at the width the GEMV takes here), float32 = float64 sums over the dequantised values, and
    // every thread count gives the same bits, as does a caller's workspace reused by every call.
    MatmulWorkspace ws;
    for (int n_rows : {1, 3}) {
      std::vector<float> x;
      for (int r = 0; r < n_rows; ++r) {
        const std::vector<float> xr = random_x(cols, rng);
        x.insert(x.end(), xr.begin(), xr.end());
      }
      std::vector<float> first_q, first_f;
      for (int threads : {1, 2, 3}) {
        ThreadPool pool(threads);
        std::vector<float> yq(static_cast<size_t>(n_rows) * rows, std::numeric_limits<float>::quiet_NaN());
        std::vector<float> yf(yq.size(), std::numeric_limits<float>::quiet_NaN());
        const MatmulOut outs[] = {{&w, yq.data()}, {&f, yf.data()}};
        weight_matmul(pool, x.data(), n_rows, outs);
        std::vector<float> yq_ws(yq.size()), yf_ws(yf.size());
        const MatmulOut outs_ws[] = {{&w, yq_ws.data()}, {&f, yf_ws.data()}};
        weight_matmul(pool, x.data(), n_rows, outs_ws, &ws);
        EXPECT_EQ(yq_ws, yq) << info.name << " threads " << threads;
        EXPECT_EQ(yf_ws, yf) << info.name << " threads " << threads;
        if (threads == 1) {
          first_q = yq;
          first_f = yf;
        } else {
          EXPECT_EQ(yq, first_q) << info.name << " threads " << threads;
          EXPECT_EQ(yf, first_f) << info.name << " threads " << threads;
        }
      }
      for (int r = 0; r < n_rows; ++r) {
        const std::vector<float> xr(x.begin() + static_cast<ptrdiff_t>(r) * cols, x.begin() + static_cast<ptrdiff_t>(r + 1) * cols);
        QuantActivation xq;
        ref::quant_activation(xr.data(), cols, cpu::gemv_quant_activation_bits(), xq);
        std::vector<double> wq(static_cast<size_t>(rows));
        ref::gemv_quant(w.quant_view(), xq, wq.data());
        const std::vector<double> mag = abs_dot(w.quant_view(), xr);
        for (int o = 0; o < rows; ++o) {
          double exact = 0;
          for (int c = 0; c < cols; ++c) exact += static_cast<double>(want[static_cast<size_t>(o) * cols + c]) * xr[c];
          const size_t i = static_cast<size_t>(r) * rows + o;
          // n_rows == 1 is the quantised GEMV; n_rows > 1 dequantises to float32 and runs sgemm.
          const double want_q = n_rows == 1 ? wq[o] : exact;
          EXPECT_LE(std::fabs(first_q[i] - want_q) / mag[o], kTol) << info.name << " rows " << n_rows << " out " << o;
          EXPECT_LE(std::fabs(first_f[i] - exact) / mag[o], kTol) << info.name << " rows " << n_rows << " out " << o;
        }
      }
    }
  }
}

TEST(GemvQuant, BadViewsAreErrors) {
  std::mt19937 rng(1);
  const RandomMatrix m(QuantFormat::q4_1, 4, 64, rng);
  const std::vector<float> x = random_x(64, rng);
  std::vector<float> y(4);
  ThreadPool pool(1);
  auto expect_error = [&](QuantMatrixView v, const std::string& needle) {
    check::expect_error([&] { cpu::gemv_quant(v, x.data(), y.data(), pool); }, needle);
  };
  QuantMatrixView v = m.view();
  v.cols = 48;
  expect_error(v, "cols=48");
  v = m.view();
  v.rows = 0;
  expect_error(v, "rows=0");
  v = m.view();
  v.m = nullptr;
  expect_error(v, "m must be set");
  v = m.view();
  v.qs = nullptr;
  expect_error(v, "null qs");
  // Verbatim formats: cols a multiple of 256 for the K-quants, no d or m arrays.
  const RandomMatrix k(QuantFormat::q4_k, 4, 512, rng);
  v = k.view();
  v.cols = 288;
  expect_error(v, "cols=288 must be a positive multiple of 256");
  v = k.view();
  v.d = m.d.data();
  expect_error(v, "d, m and qh must be null");
  // Q5_x: the bit-4 words.
  const RandomMatrix q5(QuantFormat::q5_1, 4, 64, rng);
  v = q5.view();
  v.qh = nullptr;
  expect_error(v, "(Q5_1): qh must be set");
  v = m.view();
  v.qh = q5.qh.data();
  expect_error(v, "(Q4_1): qh must be null");

  // GGUF tensors that do not fit their type: the error names the tensor, type and value.
  check::expect_error([&] { WeightMatrix::from_ggml(GgmlType::q4_1, m.qs, 1, 40, WeightStorage::compact, "t.a"); },
                      "weight matrix 't.a' (Q4_1) [1][40]: cols=40 is not a multiple of the Q4_1 block size 32");
  check::expect_error([&] { WeightMatrix::from_ggml(GgmlType::q4_k, k.qs, 2, 640, WeightStorage::compact, "blk.0.x"); },
                      "weight matrix 'blk.0.x' (Q4_K) [2][640]: cols=640 is not a multiple of the Q4_K block size 256");
  check::expect_error([&] { WeightMatrix::from_ggml(GgmlType::q5_0, m.qs, 2, 100, WeightStorage::f32, "t.b"); },
                      "cols=100 is not a multiple of the Q5_0 block size 32");
  // Truncated: 4 rows of 512 Q4_K need 4 * 2 * 144 = 1152 bytes.
  const std::span<const uint8_t> short_data(k.qs.data(), k.qs.size() - 1);
  for (WeightStorage st : {WeightStorage::compact, WeightStorage::f32})
    check::expect_error([&] { WeightMatrix::from_ggml(GgmlType::q4_k, short_data, 4, 512, st, "blk.3.ffn_down.weight"); },
                        "weight matrix 'blk.3.ffn_down.weight' (Q4_K) [4][512] needs 1152 bytes, the tensor has 1151");
  check::expect_error([&] { WeightMatrix::from_ggml(GgmlType::q3_k, k.qs, 1, 256, WeightStorage::compact, "t.c"); },
                      "'t.c' has type Q3_K, which cannot be dequantised");
}
