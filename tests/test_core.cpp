// Core: dtype conversions against known bit patterns, thread-pool determinism, errors,
// selection_normalize against sort + unique.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cumulus/core/buffer.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/core/selection.h"
#include "cumulus/core/shape.h"
#include "cumulus/core/thread_pool.h"

using namespace cumulus;

TEST(DType, F16KnownValues) {
  // Bit patterns from IEEE 754 binary16.
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(f32_to_f16(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(6.103515625e-05f), 0x0400);        // smallest normal
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(1.0f + 1.0f / 2048.0f), 0x3c00);  // tie rounds to even
  EXPECT_EQ(f32_to_f16(1.0f + 3.0f / 2048.0f), 0x3c02);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
  EXPECT_EQ(f16_to_f32(0x0001), 5.960464477539063e-08f);
}

TEST(DType, F16RoundTripAllHalfs) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << "h=" << h;
  }
}

TEST(DType, F16RoundingIsNearest) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  for (int i = 0; i < 100000; ++i) {
    float x = u(rng) * (i % 2 ? 1e-4f : 1.0f);
    float r = f16_to_f32(f32_to_f16(x));
    if (std::isinf(r)) {
      ASSERT_GE(std::fabs(x), 65504.0f);
      continue;
    }
    // No other half lies closer: check both neighbours.
    uint16_t h = f32_to_f16(x);
    float up = f16_to_f32(static_cast<uint16_t>(h + 1));
    float dn = f16_to_f32(static_cast<uint16_t>(h - 1));
    if (!std::isnan(up) && !std::isinf(up)) {
      ASSERT_LE(std::fabs(r - x), std::fabs(up - x)) << x;
    }
    if (!std::isnan(dn) && !std::isinf(dn) && (h & 0x7fff) != 0) {
      ASSERT_LE(std::fabs(r - x), std::fabs(dn - x)) << x;
    }
  }
}

TEST(DType, Bf16) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(-3.0f), 0xc040);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);  // tie to even
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3f82);  // tie to even (up)
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(dtype_from_name("bf16"), DType::bf16);
  EXPECT_THROW(dtype_from_name("f8"), Error);
}

TEST(ThreadPool, RunsEveryTaskOnce) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    std::vector<std::atomic<int>> hits(1000);
    for (int rep = 0; rep < 5; ++rep) pool.parallel_for(1000, [&](int64_t t, int) { hits[t]++; });
    for (auto& h : hits) ASSERT_EQ(h.load(), 5);
  }
}

TEST(ThreadPool, PropagatesErrors) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_for(10, [](int64_t t, int) {
    if (t == 7) throw Error("boom");
  }),
               Error);
  int64_t sum = 0;
  pool.parallel_for(1, [&](int64_t t, int) { sum += t + 1; });
  EXPECT_EQ(sum, 1);
}

TEST(Shape, ValidateNamesTheValue) {
  Shape s{1, 32, 8, 128};
  EXPECT_NO_THROW(s.validate());
  EXPECT_EQ(s.group(), 4);
  try {
    Shape{1, 9, 4, 64}.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_q_heads=9"), std::string::npos) << e.what();
  }
  EXPECT_THROW((Shape{1, 0, 1, 64}.validate()), Error);
  EXPECT_THROW((Shape{1, 8, 8, 0}.validate()), Error);
  EXPECT_THROW((Shape{1, 8, 8, 12}.validate()), Error);
  EXPECT_THROW((Shape{0, 8, 8, 64}.validate()), Error);
}

// alloc_large: 2 MiB-aligned from 2 MiB up (what MADV_HUGEPAGE needs to back the range
// with huge pages), 64-byte aligned below; every byte writable.
TEST(Buffer, AllocLargeAlignment) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4096}, (size_t{2} << 20) - 1, size_t{2} << 20,
                       (size_t{5} << 20) + 3}) {
    auto* p = static_cast<unsigned char*>(alloc_large(bytes));
    ASSERT_NE(p, nullptr) << bytes;
    const auto addr = reinterpret_cast<uintptr_t>(p);
    EXPECT_EQ(addr % kAlignment, 0u) << bytes;
    if (bytes >= (size_t{2} << 20)) {
      EXPECT_EQ(addr % (size_t{2} << 20), 0u) << bytes;
    }
    std::memset(p, 0xab, bytes);
    if (bytes > 0) {
      EXPECT_EQ(p[bytes - 1], 0xab) << bytes;
    }
    std::free(p);
  }
}

// selection_normalize sorts and de-duplicates; it takes a bitmap path for dense lists and
// sorts sparse ones: both must give exactly std::sort + std::unique, at every size and
// spread (duplicates, negative and extreme values included).
TEST(Selection, NormalizeEqualsSortUnique) {
  std::mt19937 rng(77);
  for (int n : {0, 1, 2, 63, 64, 65, 1000, 20000}) {
    for (int64_t spread : {int64_t{1}, int64_t{100}, int64_t{40000}, int64_t{1} << 31}) {
      for (int64_t base : {int64_t{0}, int64_t{-5000}, int64_t{INT32_MIN}}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " spread=" + std::to_string(spread) + " base=" + std::to_string(base));
        std::uniform_int_distribution<int64_t> pick(0, spread - 1);
        std::vector<int32_t> idx(n);
        for (auto& x : idx) x = static_cast<int32_t>(std::min<int64_t>(base + pick(rng), INT32_MAX));
        std::vector<int32_t> want = idx;
        std::sort(want.begin(), want.end());
        want.erase(std::unique(want.begin(), want.end()), want.end());
        selection_normalize(idx);
        ASSERT_EQ(idx, want);
      }
    }
  }
}
