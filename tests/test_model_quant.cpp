// Dequantisation of every supported ggml type, against two references nobody on this
// project wrote the decoder for:
//   1. blocks encoded here, element by element, from the format description (the encoder
//      indexes by element e, the decoder loops by sub-block, so they share no structure);
//   2. random blocks decoded by gguf-py (tests/data/quant_reference.json, written by
//      tools/reference/make_quant_fixture.py).
// The float64 reference dequantiser of the compact weights (ref::quant_dequantize_rows,
// src/kernels/ref/gemv.cpp) is checked against the same gguf-py values.
// Plus: the SmolLM2 token embeddings (Q8_0) dequantise to finite values of plausible size.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <random>
#include <set>

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/model/gguf.h"
#include "cumulus/kernels/gemv.h"
#include "cumulus/model/quant.h"
#include "cumulus/model/weight_matrix.h"
#include "fixtures.h"

using namespace cumulus;

namespace {

std::filesystem::path repo_root() { return cumulus::test::source_dir(); }

// A random f16-representable scale in [lo, hi], returned as bits and value.
struct Half {
  uint16_t bits;
  float value;
};
Half random_half(std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  const uint16_t b = f32_to_f16(u(rng));
  return {b, f16_to_f32(b)};
}

void put_half(std::vector<uint8_t>& blk, size_t at, uint16_t h) { std::memcpy(blk.data() + at, &h, 2); }

int rand_int(std::mt19937& rng, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// Encodes one block of a 32-element type with random quants; returns bytes and the values
// the format says they stand for.
void encode_simple(GgmlType t, std::mt19937& rng, std::vector<uint8_t>& blk, std::vector<float>& want) {
  const GgmlTypeInfo& info = ggml_type_info(t);
  blk.assign(info.type_size, 0);
  want.assign(32, 0.0f);
  const Half d = random_half(rng, -0.05f, 0.05f);
  const Half m = random_half(rng, -0.5f, 0.5f);
  int q[32];
  switch (t) {
    case GgmlType::q4_0:
    case GgmlType::q4_1: {
      const bool has_min = t == GgmlType::q4_1;
      put_half(blk, 0, d.bits);
      if (has_min) put_half(blk, 2, m.bits);
      uint8_t* qs = blk.data() + (has_min ? 4 : 2);
      for (int e = 0; e < 32; ++e) {
        q[e] = rand_int(rng, 0, 15);
        qs[e % 16] |= static_cast<uint8_t>(q[e] << (e < 16 ? 0 : 4));  // element e+16 in the high nibble
        want[static_cast<size_t>(e)] = has_min ? static_cast<float>(q[e]) * d.value + m.value
                                               : static_cast<float>(q[e] - 8) * d.value;
      }
      break;
    }
    case GgmlType::q5_0:
    case GgmlType::q5_1: {
      const bool has_min = t == GgmlType::q5_1;
      put_half(blk, 0, d.bits);
      if (has_min) put_half(blk, 2, m.bits);
      uint8_t* qh = blk.data() + (has_min ? 4 : 2);
      uint8_t* qs = qh + 4;
      for (int e = 0; e < 32; ++e) {
        q[e] = rand_int(rng, 0, 31);
        qs[e % 16] |= static_cast<uint8_t>((q[e] & 15) << (e < 16 ? 0 : 4));
        if (q[e] & 16) qh[e / 8] |= static_cast<uint8_t>(1 << (e % 8));  // bit e of the u32
        want[static_cast<size_t>(e)] = has_min ? static_cast<float>(q[e]) * d.value + m.value
                                               : static_cast<float>(q[e] - 16) * d.value;
      }
      break;
    }
    case GgmlType::q8_0: {
      put_half(blk, 0, d.bits);
      for (int e = 0; e < 32; ++e) {
        q[e] = rand_int(rng, -128, 127);
        blk[2 + static_cast<size_t>(e)] = static_cast<uint8_t>(static_cast<int8_t>(q[e]));
        want[static_cast<size_t>(e)] = static_cast<float>(q[e]) * d.value;
      }
      break;
    }
    default:
      FAIL() << "not a simple type";
  }
}

// Q4_K/Q5_K scales: 8 six-bit (scale, min) pairs in 12 bytes. Sub-block j < 4: scale in
// the low 6 bits of byte j, min in byte j + 4. j >= 4: low 4 bits in the low/high nibble
// of byte j + 4, top 2 bits in the top bits of byte j - 4 (scale) / byte j (min).
void pack_k_scales(const int sc[8], const int mn[8], uint8_t out[12]) {
  std::memset(out, 0, 12);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      out[j] |= static_cast<uint8_t>(sc[j]);
      out[j + 4] |= static_cast<uint8_t>(mn[j]);
    } else {
      out[j + 4] |= static_cast<uint8_t>((sc[j] & 15) | ((mn[j] & 15) << 4));
      out[j - 4] |= static_cast<uint8_t>((sc[j] >> 4) << 6);
      out[j] |= static_cast<uint8_t>((mn[j] >> 4) << 6);
    }
  }
}

void encode_k(GgmlType t, std::mt19937& rng, std::vector<uint8_t>& blk, std::vector<float>& want) {
  const GgmlTypeInfo& info = ggml_type_info(t);
  blk.assign(info.type_size, 0);
  want.assign(256, 0.0f);
  const Half d = random_half(rng, -0.01f, 0.01f);
  if (t == GgmlType::q6_k) {
    // ql[128], qh[64], i8 scales[16], f16 d. Element e: half h = e / 128, r = e % 128,
    // k = r / 32, l = r % 32: low 4 bits in ql[64h + l + 32 (k & 1)] (high nibble when
    // k >= 2), top 2 bits at bits 2k of qh[32h + l]; scale scales[e / 16].
    int8_t scales[16];
    for (auto& s : scales) s = static_cast<int8_t>(rand_int(rng, -128, 127));
    std::memcpy(blk.data() + 192, scales, 16);
    put_half(blk, 208, d.bits);
    for (int e = 0; e < 256; ++e) {
      const int q = rand_int(rng, 0, 63);
      const int h = e / 128, r = e % 128, k = r / 32, l = r % 32;
      blk[static_cast<size_t>(64 * h + l + 32 * (k & 1))] |= static_cast<uint8_t>((q & 15) << (k >= 2 ? 4 : 0));
      blk[static_cast<size_t>(128 + 32 * h + l)] |= static_cast<uint8_t>((q >> 4) << (2 * k));
      want[static_cast<size_t>(e)] = d.value * static_cast<float>(scales[e / 16]) * static_cast<float>(q - 32);
    }
    return;
  }
  const bool five = t == GgmlType::q5_k;
  const Half dmin = random_half(rng, 0.0f, 0.01f);
  put_half(blk, 0, d.bits);
  put_half(blk, 2, dmin.bits);
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) sc[j] = rand_int(rng, 0, 63), mn[j] = rand_int(rng, 0, 63);
  pack_k_scales(sc, mn, blk.data() + 4);
  uint8_t* qh = blk.data() + 16;                // Q5_K only
  uint8_t* qs = blk.data() + (five ? 48 : 16);  // 128 bytes
  // Element e: sub-block s = e / 32, in group g = e / 64; low 4 bits in qs[32 g + e % 32]
  // (high nibble for odd s); Q5_K bit 4 at bit s of qh[e % 32].
  for (int e = 0; e < 256; ++e) {
    const int q = rand_int(rng, 0, five ? 31 : 15);
    const int s = e / 32, g = e / 64;
    qs[32 * g + e % 32] |= static_cast<uint8_t>((q & 15) << (s % 2 ? 4 : 0));
    if (five && (q & 16)) qh[e % 32] |= static_cast<uint8_t>(1 << s);
    want[static_cast<size_t>(e)] = d.value * static_cast<float>(sc[s]) * static_cast<float>(q) -
                                   dmin.value * static_cast<float>(mn[s]);
  }
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  float scale = 0;
  for (float w : want) scale = std::max(scale, std::fabs(w));
  ASSERT_GT(scale, 0.0f) << what << ": all-zero reference";
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-6f * scale + 1e-12f) << what << " element " << i;
}

}  // namespace

TEST(Quant, TypeTable) {
  EXPECT_EQ(ggml_row_bytes(GgmlType::q4_1, 64), 40u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::q6_k, 512), 420u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::f16, 3), 6u);
  EXPECT_THROW(ggml_row_bytes(GgmlType::q8_0, 16), Error);
  EXPECT_EQ(ggml_type_info(4u), nullptr);
  EXPECT_EQ(ggml_type_info(99u), nullptr);
  float out[256];
  std::vector<uint8_t> blk(110);
  EXPECT_THROW(dequantize_row(GgmlType::q3_k, blk.data(), out, 256), Error);  // known, not supported
  EXPECT_THROW(dequantize_row(GgmlType::q4_0, blk.data(), out, 31), Error);
}

TEST(Quant, SimpleBlocksHandEncoded) {
  std::mt19937 rng(7);
  for (GgmlType t : {GgmlType::q4_0, GgmlType::q4_1, GgmlType::q5_0, GgmlType::q5_1, GgmlType::q8_0}) {
    // A row of 5 blocks (decode must step by the block size).
    std::vector<uint8_t> row;
    std::vector<float> want_row;
    for (int b = 0; b < 5; ++b) {
      std::vector<uint8_t> blk;
      std::vector<float> want;
      encode_simple(t, rng, blk, want);
      row.insert(row.end(), blk.begin(), blk.end());
      want_row.insert(want_row.end(), want.begin(), want.end());
    }
    std::vector<float> got(want_row.size());
    dequantize_row(t, row.data(), got.data(), got.size());
    expect_close(got, want_row, std::string(ggml_type_name(t)));
  }
}

TEST(Quant, KBlocksHandEncoded) {
  std::mt19937 rng(11);
  for (GgmlType t : {GgmlType::q4_k, GgmlType::q5_k, GgmlType::q6_k}) {
    std::vector<uint8_t> row;
    std::vector<float> want_row;
    for (int b = 0; b < 3; ++b) {
      std::vector<uint8_t> blk;
      std::vector<float> want;
      encode_k(t, rng, blk, want);
      row.insert(row.end(), blk.begin(), blk.end());
      want_row.insert(want_row.end(), want.begin(), want.end());
    }
    std::vector<float> got(want_row.size());
    dequantize_row(t, row.data(), got.data(), got.size());
    expect_close(got, want_row, std::string(ggml_type_name(t)));
  }
}

TEST(Quant, FloatTypes) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<float> x(37);
  for (auto& v : x) v = nd(rng);
  std::vector<uint16_t> h(x.size()), b(x.size());
  std::vector<float> want_h(x.size()), want_b(x.size()), got(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    h[i] = f32_to_f16(x[i]);
    b[i] = f32_to_bf16(x[i]);
    want_h[i] = f16_to_f32(h[i]);
    want_b[i] = bf16_to_f32(b[i]);
  }
  dequantize_row(GgmlType::f16, h.data(), got.data(), got.size());
  EXPECT_EQ(got, want_h);
  dequantize_row(GgmlType::bf16, b.data(), got.data(), got.size());
  EXPECT_EQ(got, want_b);
  dequantize_row(GgmlType::f32, x.data(), got.data(), got.size());
  EXPECT_EQ(got, x);
}

TEST(Quant, MatchesGgufPyReference) {
  const auto path = repo_root() / "tests/data/quant_reference.json";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path;
  const nlohmann::json j = nlohmann::json::parse(in);
  std::set<std::string> seen;
  for (const auto& c : j.at("cases")) {
    const std::string name = c.at("type");
    const GgmlTypeInfo* info = nullptr;
    for (uint32_t id = 0; id < 64 && info == nullptr; ++id) {
      const GgmlTypeInfo* ti = ggml_type_info(id);
      if (ti != nullptr && ti->name == name) info = ti;
    }
    ASSERT_NE(info, nullptr) << name;
    const std::string hex = c.at("raw_hex");
    std::vector<uint8_t> raw(hex.size() / 2);
    for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    const std::vector<double> values = c.at("values");
    std::vector<float> want(values.begin(), values.end()), got(want.size());
    ASSERT_EQ(raw.size(), want.size() / info->block_size * info->type_size) << name;
    dequantize_row(info->type, raw.data(), got.data(), got.size());
    expect_close(got, want, name + " vs gguf-py");
    seen.insert(name);
  }
  for (const char* t : {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"})
    EXPECT_TRUE(seen.count(t)) << t << " missing from the fixture";
}

TEST(Quant, ReferenceDequantizerMatchesGgufPy) {
  // Each quantised case as a one-row matrix, through WeightMatrix (as the loader makes it:
  // repacked or verbatim), dequantised by the float64 reference. gguf-py computes in float32
  // (d * sc rounded, times q, minus dmin * m rounded): within a few float32 ulp of the
  // largest |value|, which 1e-6 of it covers; a wrong code or scale misses by >= 1e-3.
  const auto path = repo_root() / "tests/data/quant_reference.json";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path;
  const nlohmann::json j = nlohmann::json::parse(in);
  std::set<std::string> seen;
  for (const auto& c : j.at("cases")) {
    const std::string name = c.at("type");
    if (name == "F16" || name == "BF16") continue;
    const GgmlTypeInfo* info = nullptr;
    for (uint32_t id = 0; id < 64 && info == nullptr; ++id) {
      const GgmlTypeInfo* ti = ggml_type_info(id);
      if (ti != nullptr && ti->name == name) info = ti;
    }
    ASSERT_NE(info, nullptr) << name;
    const std::string hex = c.at("raw_hex");
    std::vector<uint8_t> raw(hex.size() / 2);
    for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    const std::vector<double> want = c.at("values");
    const WeightMatrix w =
        WeightMatrix::from_ggml(info->type, raw, 1, static_cast<int>(want.size()), WeightStorage::compact, name);
    ASSERT_TRUE(w.quantized()) << name;
    std::vector<double> got(want.size());
    ref::quant_dequantize_rows(w.quant_view(), 0, 1, got.data());
    double scale = 0;
    for (double v : want) scale = std::max(scale, std::fabs(v));
    ASSERT_GT(scale, 0.0) << name;
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-6 * scale) << name << " element " << i;
    seen.insert(name);
  }
  for (const char* t : {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
    EXPECT_TRUE(seen.count(t)) << t << " missing from the fixture";
}

TEST(Quant, SmolLM2TokenEmbeddingsPlausible) {
  const auto path = repo_root() / "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(path)) CUMULUS_FIXTURE_MISSING(path << " missing: run scripts/fetch-model.sh");
  const GgufFile f = GgufFile::open(path.string());
  const GgufTensorInfo* t = f.find_tensor("token_embd.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->type, GgmlType::q8_0);
  ASSERT_EQ(t->ne[0], 576u);
  ASSERT_EQ(t->ne[1], 49152u);
  const size_t row_bytes = ggml_row_bytes(t->type, t->ne[0]);
  std::vector<float> row(576);
  double sum_sq = 0, max_abs = 0;
  size_t n = 0;
  for (uint64_t r = 0; r < t->ne[1]; r += 97) {
    dequantize_row(t->type, t->data + r * row_bytes, row.data(), row.size());
    for (float v : row) {
      ASSERT_TRUE(std::isfinite(v)) << "row " << r;
      sum_sq += static_cast<double>(v) * v;
      max_abs = std::max(max_abs, static_cast<double>(std::fabs(v)));
      ++n;
    }
  }
  const double rms = std::sqrt(sum_sq / static_cast<double>(n));
  EXPECT_GT(rms, 1e-3);
  EXPECT_LT(rms, 1.0);
  EXPECT_LT(max_abs, 50.0);
  // A Q4_1 matrix too.
  const GgufTensorInfo* q = f.find_tensor("blk.0.attn_q.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->type, GgmlType::q4_1);
  std::vector<float> all(static_cast<size_t>(q->n_elements));
  dequantize_row(q->type, q->data, all.data(), q->n_elements);
  double qs = 0;
  for (float v : all) {
    ASSERT_TRUE(std::isfinite(v));
    qs += static_cast<double>(v) * v;
  }
  const double q_rms = std::sqrt(qs / static_cast<double>(all.size()));
  EXPECT_GT(q_rms, 1e-3);
  EXPECT_LT(q_rms, 1.0);
}
