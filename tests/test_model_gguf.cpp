// GGUF parser: a hand-built file with every metadata value type parses to what was
// written; every kind of corruption (truncation at every offset, bad magic and version,
// huge lengths and counts, bad n_dims, dims overflow, offsets out of range, unknown types,
// random byte flips) throws cumulus::Error naming the file -- never crashes (this suite
// also runs under ASan/UBSan).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include <unistd.h>

#include "cumulus/core/dtype.h"
#include "cumulus/core/error.h"
#include "cumulus/model/gguf.h"
#include "test_model_gguf_writer.h"

using namespace cumulus;
using cumulus::test::GgufWriter;

namespace {

// A file exercising every value type, nested arrays and three tensors of three types.
GgufWriter make_good_writer(uint32_t version = 3) {
  GgufWriter w;
  w.version = version;
  w.kv_string("general.architecture", "llama");
  w.kv_u8("t.u8", 200);
  w.kv_i8("t.i8", -100);
  w.kv_u16("t.u16", 60000);
  w.kv_i16("t.i16", -30000);
  w.kv_u32("t.u32", 4000000000u);
  w.kv_i32("t.i32", -2000000000);
  w.kv_u64("t.u64", 1ull << 40);
  w.kv_i64("t.i64", -(1ll << 40));
  w.kv_f32("t.f32", 0.25f);
  w.kv_f64("t.f64", -1.5);
  w.kv_bool("t.bool", true);
  w.kv_string("t.string", "hello \xE2\x96\x81 world");
  w.kv_array<int32_t>("t.arr_i32", GgufWriter::I32, {1, -2, 3});
  w.kv_array<float>("t.arr_f32", GgufWriter::F32, {0.5f, 1.5f});
  w.kv_array<uint8_t>("t.arr_empty", GgufWriter::U8, {});
  w.kv_string_array("t.arr_str", {"a", "", "ccc"});
  w.kv_nested_i32("t.arr_nested", {{1, 2}, {}, {3}});
  std::vector<float> f32 = {1, 2, 3, 4, 5, 6, 7, 8};
  w.tensor("a.f32", {4, 2}, 0, GgufWriter::as_bytes(f32));
  std::vector<uint16_t> f16;
  for (int i = 0; i < 8; ++i) f16.push_back(f32_to_f16(static_cast<float>(i) * 0.5f));
  w.tensor("b.f16", {8}, 1, GgufWriter::as_bytes(f16));
  // One Q8_0 block of 32: d = 0.5, q = -16..15.
  std::vector<uint8_t> q8(34);
  const uint16_t d = f32_to_f16(0.5f);
  std::memcpy(q8.data(), &d, 2);
  for (int i = 0; i < 32; ++i) q8[2 + static_cast<size_t>(i)] = static_cast<uint8_t>(static_cast<int8_t>(i - 16));
  w.tensor("c.q8_0", {32}, 8, q8);
  return w;
}

GgufFile parse(std::vector<uint8_t> bytes, const std::string& name = "test.gguf") {
  return GgufFile::from_bytes(name, std::move(bytes));
}

template <typename T>
void poke(std::vector<uint8_t>& b, size_t at, T v) {
  ASSERT_LE(at + sizeof(T), b.size());
  std::memcpy(b.data() + at, &v, sizeof(T));
}

// Expects parse to throw cumulus::Error whose message contains the file name and `needle`.
void expect_error(const std::vector<uint8_t>& bytes, const std::string& needle) {
  try {
    parse(bytes, "corrupt.gguf");
    ADD_FAILURE() << "no error; wanted one containing '" << needle << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("corrupt.gguf"), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << msg;
  }
}

}  // namespace

TEST(Gguf, GoodFileAllValueTypes) {
  for (uint32_t version : {2u, 3u}) {
    GgufWriter w = make_good_writer(version);
    const GgufFile f = parse(w.bytes());
    EXPECT_EQ(f.version(), version);
    EXPECT_EQ(f.alignment(), 32u);
    EXPECT_EQ(f.data_offset() % 32, 0u);
    EXPECT_EQ(f.get_string("general.architecture"), "llama");
    EXPECT_EQ(f.get_u64("t.u8"), 200u);
    EXPECT_EQ(f.find("t.i8")->i, -100);
    EXPECT_EQ(f.get_u64("t.u16"), 60000u);
    EXPECT_EQ(f.find("t.i16")->i, -30000);
    EXPECT_EQ(f.get_u64("t.u32"), 4000000000u);
    EXPECT_EQ(f.find("t.i32")->i, -2000000000);
    EXPECT_EQ(f.get_u64("t.u64"), 1ull << 40);
    EXPECT_EQ(f.find("t.i64")->i, -(1ll << 40));
    EXPECT_THROW(f.get_u64("t.i64"), Error);  // negative
    EXPECT_EQ(f.get_f64("t.f32"), 0.25);
    EXPECT_EQ(f.get_f64("t.f64"), -1.5);
    EXPECT_TRUE(f.get_bool_or("t.bool", false));
    EXPECT_EQ(f.get_string("t.string"), "hello \xE2\x96\x81 world");
    EXPECT_EQ(f.get_int_array("t.arr_i32"), (std::vector<int64_t>{1, -2, 3}));
    EXPECT_EQ(f.get_float_array("t.arr_f32"), (std::vector<double>{0.5, 1.5}));
    EXPECT_TRUE(f.get_int_array("t.arr_empty").empty());
    const auto strs = f.get_string_array("t.arr_str");
    ASSERT_EQ(strs.size(), 3u);
    EXPECT_EQ(strs[0], "a");
    EXPECT_EQ(strs[1], "");
    EXPECT_EQ(strs[2], "ccc");
    const GgufValue* nested = f.find("t.arr_nested");
    ASSERT_NE(nested, nullptr);
    ASSERT_EQ(nested->arrays.size(), 3u);
    EXPECT_EQ(nested->arrays[0].count, 2u);
    EXPECT_EQ(nested->arrays[1].count, 0u);
    EXPECT_EQ(nested->arrays[2].count, 1u);
    // Typed getters refuse the wrong type and name the key.
    EXPECT_THROW(f.get_string("t.u8"), Error);
    EXPECT_THROW(f.get_f64("t.string"), Error);
    EXPECT_THROW(f.get_u64("missing.key"), Error);
    EXPECT_EQ(f.get_u64_or("missing.key", 7), 7u);

    ASSERT_EQ(f.tensors().size(), 3u);
    const GgufTensorInfo* a = f.find_tensor("a.f32");
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(a->n_dims, 2u);
    EXPECT_EQ(a->ne[0], 4u);
    EXPECT_EQ(a->ne[1], 2u);
    EXPECT_EQ(a->n_elements, 8u);
    EXPECT_EQ(a->n_bytes, 32u);
    float row[8];
    dequantize_row(a->type, a->data, row, 8);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(row[i], static_cast<float>(i + 1));
    const GgufTensorInfo* b = f.find_tensor("b.f16");
    ASSERT_NE(b, nullptr);
    dequantize_row(b->type, b->data, row, 8);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(row[i], static_cast<float>(i) * 0.5f);
    const GgufTensorInfo* c = f.find_tensor("c.q8_0");
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->type, GgmlType::q8_0);
    EXPECT_EQ(c->n_bytes, 34u);
    float q[32];
    dequantize_row(c->type, c->data, q, 32);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(q[i], static_cast<float>(i - 16) * 0.5f);
    EXPECT_EQ(f.find_tensor("nope"), nullptr);
  }
}

TEST(Gguf, CustomAlignment) {
  GgufWriter w = make_good_writer();
  w.alignment = 64;
  w.kv_u32("general.alignment", 64);
  const GgufFile f = parse(w.bytes());
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  for (const auto& t : f.tensors()) EXPECT_EQ(t.offset % 64, 0u);
}

TEST(Gguf, BadAlignmentValues) {
  for (uint32_t a : {0u, 3u, 48u}) {
    GgufWriter w = make_good_writer();
    w.kv_u32("general.alignment", a);
    expect_error(w.bytes(), "general.alignment");
  }
  GgufWriter w = make_good_writer();
  w.kv_string("general.alignment", "32");
  expect_error(w.bytes(), "general.alignment");
}

TEST(Gguf, NoTensorsNoData) {
  GgufWriter w;
  w.kv_string("general.architecture", "llama");
  const GgufFile f = parse(w.bytes());
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.metadata().size(), 1u);
}

TEST(Gguf, TruncatedAtEveryOffset) {
  GgufWriter w = make_good_writer();
  const std::vector<uint8_t> good = w.bytes();
  ASSERT_NO_THROW(parse(good));
  for (size_t n = 0; n < good.size(); ++n) {
    std::vector<uint8_t> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(parse(cut), Error) << "truncated to " << n << " of " << good.size() << " bytes";
  }
}

TEST(Gguf, TruncationMessageNamesOffset) {
  GgufWriter w = make_good_writer();
  std::vector<uint8_t> b = w.bytes();
  b.resize(w.marks["kv_count"] + 3);
  expect_error(b, "offset " + std::to_string(w.marks["kv_count"]));
}

TEST(Gguf, WrongMagic) {
  GgufWriter w = make_good_writer();
  std::vector<uint8_t> b = w.bytes();
  b[0] = 'X';
  expect_error(b, "bad magic");
  expect_error(std::vector<uint8_t>{'G', 'G', 'U'}, "truncated");
  expect_error(std::vector<uint8_t>{}, "truncated");
}

TEST(Gguf, UnsupportedVersion) {
  for (uint32_t v : {0u, 1u, 4u, 0x03000000u}) {
    GgufWriter w = make_good_writer();
    w.version = v;
    expect_error(w.bytes(), "unsupported version " + std::to_string(v));
  }
}

TEST(Gguf, HugeStringLength) {
  for (uint64_t len : {std::numeric_limits<uint64_t>::max(), uint64_t{1} << 62, uint64_t{100000}}) {
    GgufWriter w = make_good_writer();
    std::vector<uint8_t> b = w.bytes();
    poke(b, w.marks["kv:t.string.len"], len);
    expect_error(b, "has length " + std::to_string(len));
    // The same on a key and on a tensor name.
    b = w.bytes();
    poke(b, w.marks["key:t.u8"], len);
    expect_error(b, "has length " + std::to_string(len));
    b = w.bytes();
    poke(b, w.marks["tensor:b.f16.name"], len);
    expect_error(b, "has length " + std::to_string(len));
  }
}

TEST(Gguf, HugeCounts) {
  for (const char* key : {"kv:t.arr_i32.count", "kv:t.arr_str.count", "kv_count", "tensor_count"}) {
    for (uint64_t n : {std::numeric_limits<uint64_t>::max(), uint64_t{1} << 61, uint64_t{1} << 32}) {
      GgufWriter w = make_good_writer();
      std::vector<uint8_t> b = w.bytes();
      poke(b, w.marks[key], n);
      expect_error(b, std::to_string(n));
    }
  }
}

TEST(Gguf, BadNDims) {
  for (uint32_t nd : {0u, 5u, 1000u, 0xFFFFFFFFu}) {
    GgufWriter w = make_good_writer();
    std::vector<uint8_t> b = w.bytes();
    poke(b, w.marks["tensor:a.f32.n_dims"], nd);
    expect_error(b, "n_dims=" + std::to_string(nd));
  }
}

TEST(Gguf, DimsOverflowAndZero) {
  GgufWriter w;
  w.tensor("big", {uint64_t{1} << 32, uint64_t{1} << 32}, 0, {});
  expect_error(w.bytes(), "overflows");
  GgufWriter w2;
  w2.tensor("big", {uint64_t{1} << 40, uint64_t{1} << 20, 16, 16}, 0, {});
  expect_error(w2.bytes(), "overflows");
  GgufWriter w3;
  w3.tensor("zero", {4, 0}, 0, std::vector<uint8_t>(16));
  expect_error(w3.bytes(), "ne[1]=0");
  GgufWriter w4;
  w4.tensor("neg", {std::numeric_limits<uint64_t>::max()}, 0, {});
  expect_error(w4.bytes(), "ne[0]=");
}

TEST(Gguf, TensorDataOutOfRange) {
  GgufWriter w = make_good_writer();
  std::vector<uint8_t> good = w.bytes();
  for (uint64_t off : {uint64_t{1} << 20, std::numeric_limits<uint64_t>::max() - 31, uint64_t{96}}) {
    std::vector<uint8_t> b = good;
    poke(b, w.marks["tensor:c.q8_0.offset"], off);
    expect_error(b, "past the end");
  }
  // Misaligned offset.
  std::vector<uint8_t> b = good;
  poke(b, w.marks["tensor:a.f32.offset"], uint64_t{4});
  expect_error(b, "alignment");
  // Shape larger than the data.
  b = good;
  poke(b, w.marks["tensor:b.f16.dim0"], uint64_t{1} << 30);
  expect_error(b, "past the end");
}

TEST(Gguf, UnknownTypes) {
  for (uint32_t t : {4u, 5u, 31u, 99u, 0xFFFFFFFFu}) {
    GgufWriter w = make_good_writer();
    std::vector<uint8_t> b = w.bytes();
    poke(b, w.marks["tensor:a.f32.type"], t);
    expect_error(b, "unknown ggml type " + std::to_string(t));
  }
  GgufWriter w = make_good_writer();
  std::vector<uint8_t> b = w.bytes();
  poke(b, w.marks["type:t.u8"], uint32_t{13});
  expect_error(b, "unknown value type 13");
  // Block types need ne[0] to be a multiple of the block size.
  GgufWriter w2;
  w2.tensor("q", {16}, 8, std::vector<uint8_t>(34));
  expect_error(w2.bytes(), "block size");
}

TEST(Gguf, BadValues) {
  GgufWriter w;
  w.kv_raw("b", GgufWriter::BOOL, {2});
  expect_error(w.bytes(), "bool value 2");
  GgufWriter w2;
  w2.kv_u8("k", 1);
  w2.kv_u8("k", 2);
  expect_error(w2.bytes(), "duplicate metadata key 'k'");
  GgufWriter w3;
  w3.tensor("t", {4}, 0, std::vector<uint8_t>(16));
  w3.tensor("t", {4}, 0, std::vector<uint8_t>(16));
  expect_error(w3.bytes(), "duplicate tensor name 't'");
  // Array with an unknown element type.
  GgufWriter w4;
  std::vector<uint8_t> raw(12, 0);
  raw[0] = 77;
  w4.kv_raw("a", GgufWriter::ARRAY, raw);
  expect_error(w4.bytes(), "unknown array element type 77");
}

TEST(Gguf, DeeplyNestedArraysRejected) {
  // 100 levels of array-of-array, each with one element.
  std::vector<uint8_t> raw;
  auto put32 = [&](uint32_t v) { for (int i = 0; i < 4; ++i) raw.push_back(static_cast<uint8_t>(v >> (8 * i))); };
  auto put64 = [&](uint64_t v) { for (int i = 0; i < 8; ++i) raw.push_back(static_cast<uint8_t>(v >> (8 * i))); };
  for (int i = 0; i < 100; ++i) {
    put32(GgufWriter::ARRAY);
    put64(1);
  }
  put32(GgufWriter::U8);
  put64(0);
  GgufWriter w;
  // kv_raw writes the outer ARRAY type; raw starts with its element type.
  w.kv_raw("deep", GgufWriter::ARRAY, std::vector<uint8_t>(raw.begin(), raw.end()));
  expect_error(w.bytes(), "nested deeper");
}

TEST(Gguf, RandomCorruptionNeverCrashes) {
  GgufWriter w = make_good_writer();
  const std::vector<uint8_t> good = w.bytes();
  std::mt19937 rng(1234);
  int errors = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<uint8_t> b = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t at = rng() % b.size();
      b[at] = static_cast<uint8_t>(rng() % 3 == 0 ? 0xFF : rng());
    }
    try {
      const GgufFile f = parse(b);
      // Whatever parsed must be self-consistent: every tensor inside the file.
      for (const auto& t : f.tensors()) {
        ASSERT_LE(f.data_offset() + t.offset + t.n_bytes, f.file_size());
      }
    } catch (const Error&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 100);
}

TEST(Gguf, OpenFromDiskAndMissingFile) {
  GgufWriter w = make_good_writer();
  const std::vector<uint8_t> b = w.bytes();
  const auto path = std::filesystem::temp_directory_path() / ("cumulus_gguf_test_" + std::to_string(::getpid()) + ".gguf");
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }
  {
    const GgufFile f = GgufFile::open(path.string());
    EXPECT_EQ(f.file_size(), b.size());
    EXPECT_EQ(f.tensors().size(), 3u);
    EXPECT_TRUE(gguf_has_magic(path.string()));
  }
  std::filesystem::remove(path);
  try {
    GgufFile::open(path.string());
    ADD_FAILURE() << "opened a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
}
