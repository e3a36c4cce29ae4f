// Checked reading and atomic writing of user-named files (include/cumulus/core/file.h),
// and the parsers' refusals of what a user can get wrong: directories, endless
// files, sizes claimed by a header but not present, a parameter given twice.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "cumulus/core/error.h"
#include "cumulus/core/file.h"
#include "cumulus/eval/method_spec.h"
#include "cumulus/eval/trace.h"
#include "cumulus/model/model_weights.h"
#include "cumulus/model/text.h"
#include "cumulus/model/tokenizer.h"
#include "kernel_check.h"

namespace cumulus {
namespace {

namespace fs = std::filesystem;
using check::expect_error;

class FileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("cumulus_file_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(dir_ / "ro", fs::perms::owner_all, ec);
    fs::remove_all(dir_, ec);
  }
  std::string path(const char* name) const { return (dir_ / name).string(); }
  static std::string slurp(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  fs::path dir_;
};

TEST_F(FileTest, ReadRefusesDirectoriesMissingFilesAndEndlessInput) {
  std::ofstream(path("a.txt")) << "hello";
  EXPECT_EQ(file_read(path("a.txt"), "text"), "hello");
  expect_error([&] { file_read(dir_.string(), "--text"); }, "is a directory");
  expect_error([&] { file_read(path("none"), "--text"); }, "No such file or directory");
  expect_error([&] { file_read(path("a.txt"), "--text", 4); }, "5 bytes is more than the limit of 4");
  // A device has no size: read until the cap.
  expect_error([&] { file_read("/dev/zero", "--prompt-file", 1 << 20); }, "more than the limit of 1048576");
  expect_error([&] { text_read_file(dir_.string()); }, "is a directory");
}

TEST_F(FileTest, OutputChecksNeedAWritableFolder) {
  file_check_output(path("new.json"), "--json");  // may be created
  EXPECT_FALSE(fs::exists(path("new.json")));     // and is not
  expect_error([&] { file_check_output("/nonexistent/x.json", "--json"); }, "folder '/nonexistent' does not exist");
  expect_error([&] { file_check_output(dir_.string(), "--json"); }, "is a directory");
  dir_check_output(path("plots/a/b"), "--svg-dir");  // created on writing
  EXPECT_FALSE(fs::exists(path("plots")));
  std::ofstream(path("file")) << "x";
  expect_error([&] { dir_check_output(path("file/sub"), "--svg-dir"); }, "exists and is not a folder");
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(dir_ / "ro");
    fs::permissions(dir_ / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    expect_error([&] { file_check_output(path("ro/x.md"), "--markdown"); }, "is not writable");
  }
}

TEST_F(FileTest, AtomicWriteReplacesWholeAndLeavesNoTemporaryFile) {
  file_write_atomic(path("r.json"), "first", "--json");
  EXPECT_EQ(slurp(path("r.json")), "first");
  file_write_atomic(path("r.json"), std::string(100000, 'x'), "--json");
  EXPECT_EQ(slurp(path("r.json")), std::string(100000, 'x'));
  struct stat st {};
  ASSERT_EQ(::stat(path("r.json").c_str(), &st), 0);
  EXPECT_NE(st.st_mode & S_IRUSR, 0u);
  // A failed write (the target is a folder) leaves what was there, and no temporary file.
  fs::create_directories(dir_ / "d.json");
  expect_error([&] { file_write_atomic(path("d.json"), "x", "--json"); }, "is a directory");
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);  // r.json only
}

TEST_F(FileTest, ModelFilesAreRecognisedOrNamedAsNeither) {
  std::ofstream(path("junk.bin")) << std::string(200, 'j');
  expect_error([&] { model_format_of(path("junk.bin")); }, "not a GGUF or llama2.c model");
  expect_error([&] { model_format_of(dir_.string()); }, "is a directory");
  expect_error([&] { model_config_load(path("none.gguf")); }, "No such file or directory");
  expect_error([&] { tokenizer_from_llama2c(dir_.string(), 512); }, "is a directory");
  expect_error([&] { tokenizer_from_llama2c("", 512); }, "no path given");
}

// A trace header that claims more data than the file holds is refused before allocating.
TEST_F(FileTest, TraceHeaderSizesAreCheckedAgainstTheFile) {
  const std::string h =
      R"({"n_q_heads": 32, "n_kv_heads": 8, "head_dim": 128, "n_tokens": 4000000, "prompt_tokens": 3999000,)"
      R"( "steps": 1000, "layers": [0, 1, 2, 3]})";
  std::string bytes = "CUMTRACE";
  const uint32_t version = 1, hb = static_cast<uint32_t>(h.size());
  bytes.append(reinterpret_cast<const char*>(&version), 4);
  bytes.append(reinterpret_cast<const char*>(&hb), 4);
  bytes += h;
  bytes += std::string(160000, '\0');
  std::ofstream(path("t.bin"), std::ios::binary) << bytes;
  expect_error([&] { trace_read(path("t.bin")); }, "implies");
  expect_error([&] { trace_read(dir_.string()); }, "is a directory");
  // Numbers a field's int cannot hold (the fuzzer's find: a 21-digit n_tokens, which the
  // JSON library converted without a check), floats and strings are named.
  auto header_only = [&](const std::string& json) {
    std::string b = "CUMTRACE";
    const uint32_t v = 1, n = static_cast<uint32_t>(json.size());
    b.append(reinterpret_cast<const char*>(&v), 4);
    b.append(reinterpret_cast<const char*>(&n), 4);
    b += json;
    std::ofstream(path("h.bin"), std::ios::binary) << b;
    return path("h.bin");
  };
  const std::string rest = R"(, "head_dim": 8, "prompt_tokens": 2, "steps": 1, "layers": [0]})";
  expect_error([&] { trace_read(header_only(R"({"n_q_heads": 4, "n_kv_heads": 2, "n_tokens": 910736415302060084645)" + rest)); },
               "header field n_tokens=9.107364153020601e+20 is not an integer");
  expect_error([&] { trace_read(header_only(R"({"n_q_heads": 4, "n_kv_heads": 2, "n_tokens": 4294967299)" + rest)); },
               "header field n_tokens=4294967299 is not an integer");
  expect_error([&] { trace_read(header_only(R"({"n_q_heads": 4.5, "n_kv_heads": 2, "n_tokens": 3)" + rest)); },
               "header field n_q_heads=4.5");
  expect_error([&] { trace_read(header_only(R"({"n_q_heads": "4", "n_kv_heads": 2, "n_tokens": 3)" + rest)); },
               "header field n_q_heads=\"4\"");
}

TEST(MethodSpecParse, RepeatedParametersAndLabelsAreErrors) {
  expect_error([] { method_specs_parse({"tactic"}, {"p=0.9", "p=0.8"}); }, "already set by --param 'p=0.9'");
  expect_error([] { method_specs_parse({"tactic"}, {"p=0.9", "tactic.p=0.8"}); }, "already set");
  expect_error([] { method_specs_parse({"a=tactic", "a=psa"}); }, "label 'a' is given twice");
  expect_error([] { method_specs_parse({"flexprefill"}); }, "not a decode method");
  // The same key on different entries is fine.
  const auto specs = method_specs_parse({"a=tactic", "b=tactic"}, {"a.p=0.5", "b.p=0.7"});
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0].params.at("p"), "0.5");
  EXPECT_EQ(specs[1].params.at("p"), "0.7");
  expect_error([] { key_values_parse({"gamma=0.9", "gamma=0.8"}, "--prefill-param"); }, "key 'gamma' is given twice");
  expect_error([] { prefill_spec_check("tactic", {}); }, "not a prefill method");
}

}  // namespace
}  // namespace cumulus
