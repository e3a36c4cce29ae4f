// What the CLI and the core do when the user or the machine gets in the way: outputs that
// name an input, empty paths, FIFOs, temporary names beyond the file system's limit, a
// signal during a write, a thread that cannot start, stdout that cannot be written, an
// address-space limit, a run larger than the memory, an allocation that fails
// (docs/reliability.md). The CLI cases run the built binary under `timeout`, so a hang fails
// the test by its exit code (124).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "cumulus/core/error.h"
#include "cumulus/core/file.h"
#include "cumulus/core/thread_pool.h"
#include "cli_run.h"
#include "fixtures.h"
#include "kernel_check.h"
#include "scratch_dir.h"

namespace cumulus {
namespace {

namespace fs = std::filesystem;
using check::expect_error;

// Address-space limits cannot hold a sanitizer's shadow memory: those cases run without.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

using CliRun = test::CliResult;

// `cumulus ARGS` under `timeout`, after the shell words in `pre` (e.g. "ulimit -v 100000;").
CliRun cli(const std::string& args, const std::string& pre = "", int seconds = 20) {
  return test::cli_exec(pre, args, seconds);
}

class Reliability : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return scratch_.path(name); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path(name)) << text; }
  // Copies of the fixtures in the scratch folder: a test that writes must never reach them.
  bool copy_fixtures() {
    const fs::path model = test::stories260k_dir() / "stories260K.bin";
    const fs::path text = test::shared_dir() / "data/text/tinyshakespeare_input.txt";
    if (!fs::exists(model) || !fs::exists(text)) return false;
    fs::copy_file(model, dir_ / "stories260K.bin");
    fs::copy_file(test::stories260k_dir() / "tok512.bin", dir_ / "tok512.bin");
    fs::copy_file(text, dir_ / "text.txt");
    model_ = path("stories260K.bin");
    text_ = path("text.txt");
    return true;
  }
  static void expect_rejected(const CliRun& r, const std::string& needle, const std::string& what) {
    EXPECT_NE(r.code, 0) << what << "\n" << r.output;
    EXPECT_LT(r.code, 124) << "timed out or died of a signal: " << what << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << what << "\nwanted '" << needle << "' in:\n" << r.output;
  }
  test::ScratchDir scratch_{"cumulus_reliability"};
  const fs::path dir_ = scratch_.dir();
  std::string model_, text_;
};

TEST_F(Reliability, OutputsMustNotNameAnInputOrAnotherOutput) {
  write("in.txt", "text");
  write("out.json", "old");
  fs::create_hard_link(dir_ / "in.txt", dir_ / "link.txt");
  fs::create_symlink(dir_ / "in.txt", dir_ / "sym.txt");
  const std::string in = path("in.txt");
  expect_error([&] { file_check_distinct({{"--text", in}, {"--json", in, true}}); },
               "--json '" + in + "' is the same file as --text");
  // Another spelling, a hard link, a symbolic link: the same inode.
  expect_error([&] { file_check_distinct({{"--text", in}, {"--json", (dir_ / "." / "in.txt").string(), true}}); },
               "destroy that input");
  expect_error([&] { file_check_distinct({{"--text", in}, {"--kv-save", path("link.txt"), true}}); },
               "--kv-save");
  expect_error([&] { file_check_distinct({{"--text", in}, {"--markdown", path("sym.txt"), true}}); },
               "--markdown");
  // Two outputs, the file not there yet: by the normalised path.
  expect_error([&] { file_check_distinct({{"--json", path("new.x"), true}, {"--markdown", path("./new.x"), true}}); },
               "lose one of the two outputs");
  // Distinct files, two inputs that are the same, and paths not given pass.
  file_check_distinct({{"--text", in}, {"--model", path("link.txt")}, {"--json", path("out.json"), true},
                       {"--markdown", "", true}, {"--kv-save", path("new.x"), true}});
}

TEST_F(Reliability, FifosAreRefusedBeforeOpen) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  // With no writer, open() would block forever: each must fail at once.
  expect_error([&] { file_check_regular(path("fifo"), "KV snapshot"); }, "is a FIFO (named pipe), not a regular file");
  expect_error([&] { file_check_regular("/dev/null", "model"); }, "is a character device, not a regular file");
  expect_error([&] { file_check_regular(path(""), "model"); }, "is a directory");
  expect_error([&] { file_check_regular("", "model"); }, "empty path");
  // file_read (texts, which may come from a pipe) opens without blocking: no writer reads as
  // empty.
  EXPECT_EQ(file_read(path("fifo"), "text"), "");
}

TEST_F(Reliability, OutputNamesWhoseTemporaryNameIsTooLongAreRefused) {
  const long max = ::pathconf(dir_.c_str(), _PC_NAME_MAX);
  ASSERT_GT(max, 20);
  const auto name_max = static_cast<size_t>(max);
  // The longest name whose temporary name fits is accepted, one byte more is not.
  file_check_output(path(std::string(name_max - kFileTempNameExtra, 'a')), "--json");
  file_write_atomic(path(std::string(name_max - kFileTempNameExtra, 'b')), "x", "--json");
  expect_error([&] { file_check_output(path(std::string(name_max - kFileTempNameExtra + 1, 'a')), "--json"); },
               "the file name is " + std::to_string(name_max - kFileTempNameExtra + 1) + " bytes");
  expect_error([&] { file_check_output(path(std::string(name_max + 1, 'a')), "--json"); }, "give a name of at most");
}

// A SIGINT during a write removes the temporary file and the process dies of the signal;
// the target keeps its previous content.
TEST_F(Reliability, SignalDuringAWriteRemovesTheTemporaryFile) {
  write("target", "previous");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    file_temp_cleanup_on_signals();
    file_write_atomic_stream(path("target"), "--kv-save", [](const FileAppend& append) {
      append(std::string(1 << 20, 'x'));
      ::raise(SIGINT);
      append("not reached");
    });
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "status " << status;
  EXPECT_EQ(WTERMSIG(status), SIGINT);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir_)) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"target"});
  std::ifstream f(path("target"));
  std::string content;
  std::getline(f, content);
  EXPECT_EQ(content, "previous");
}

// A thread that cannot start (here: an address-space limit too small for a thousand stacks)
// is an Error naming it, after the started ones are joined: no deadlock, no terminate.
TEST(ReliabilityThreads, ThreadPoolThatCannotStartAThreadFailsCleanly) {
  if (kSanitized) GTEST_SKIP() << "an address-space limit under the address sanitizer";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(20);  // a deadlock ends as SIGALRM
    std::ifstream status("/proc/self/status");
    std::string line;
    unsigned long vm_kb = 0;
    while (std::getline(status, line))
      if (line.rfind("VmSize:", 0) == 0) vm_kb = std::stoul(line.substr(7));
    const rlimit lim{(vm_kb + 256 * 1024) * 1024, (vm_kb + 256 * 1024) * 1024};
    if (::setrlimit(RLIMIT_AS, &lim) != 0) ::_exit(3);
    try {
      ThreadPool pool(1000);  // 8 MiB of stack each
      ::_exit(4);
    } catch (const Error& e) {
      const std::string msg = e.what();
      ::_exit(msg.find("cannot start thread ") != std::string::npos && msg.find(" of 1000") != std::string::npos ? 0
                                                                                                                : 5);
    } catch (...) {
      ::_exit(6);
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "died of signal " << WTERMSIG(status) << " (14: a deadlock)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: setrlimit failed, 4: no error, 5: the message, 6: another exception";
}

TEST_F(Reliability, CliRefusesEmptyPathsAndOutputsOverInputs) {
  if (!copy_fixtures()) CUMULUS_FIXTURE_MISSING("no stories260K or tinyshakespeare");
  const std::string gen = "generate --model " + model_ + " --quiet --max-tokens 4 ";
  const std::string ev = "eval kl --model " + model_ + " --text " + text_ + " --context 128 --steps 4 ";
  for (const std::string opt : {"--kv-load", "--kv-save", "--prompt-file", "--tokenizer"})
    expect_rejected(cli(gen + opt + " ''"), opt + ": an empty path is not allowed", opt);
  for (const std::string opt : {"--json", "--markdown", "--svg-dir", "--kv-load", "--kv-save"})
    expect_rejected(cli(ev + opt + " ''"), opt + ": an empty path is not allowed", opt);
  expect_rejected(cli("info --model ''"), "--model", "info --model ''");

  const auto size = fs::file_size(model_);
  expect_rejected(cli(ev + "--json " + model_), "--json '" + model_ + "' is the same file as --model", "json=model");
  expect_rejected(cli(ev + "--markdown " + text_), "is the same file as --text", "markdown=text");
  expect_rejected(cli(ev + "--json " + path("r") + " --markdown " + path("r")), "lose one of the two outputs",
                  "json=markdown");
  expect_rejected(cli(gen + "--kv-save " + path("tok512.bin")), "the tokenizer found beside --model",
                  "kv-save=tokenizer");
  write("prompt.txt", "Once upon a time");
  expect_rejected(cli(gen + "--prompt-file " + path("prompt.txt") + " --kv-save " + path("prompt.txt")),
                  "is the same file as --prompt-file", "kv-save=prompt");
  EXPECT_EQ(fs::file_size(model_), size);
}

TEST_F(Reliability, CliFifosStdoutAndLimitsEndInClearErrors) {
  if (!copy_fixtures()) CUMULUS_FIXTURE_MISSING("no stories260K or tinyshakespeare");
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  const std::string gen = "generate --model " + model_ + " --quiet --max-tokens 4 ";
  expect_rejected(cli(gen + "--kv-load " + path("fifo")), "is a FIFO (named pipe)", "kv-load fifo");
  expect_rejected(cli(gen + "--tokenizer " + path("fifo")), "is a FIFO (named pipe)", "tokenizer fifo");
  expect_rejected(cli("generate --model " + path("fifo")), "is a FIFO (named pipe)", "model fifo");
  expect_rejected(cli("info --model " + path("fifo")), "is a FIFO (named pipe)", "info fifo");
  // stdout on a full device: the report is lost, so the exit is not 0.
  if (fs::exists("/dev/full")) {
    expect_rejected(cli("generate --model " + model_ + " --max-tokens 4 > /dev/full"), "writing to stdout failed",
                    "generate > /dev/full");
    expect_rejected(cli("info --model " + model_ + " > /dev/full"), "writing to stdout failed", "info > /dev/full");
  }
  // An address-space limit too small for OpenBLAS's thread buffers: an error naming it, not
  // a process spinning forever.
  if (!kSanitized)
    expect_rejected(cli(gen, "ulimit -v 100000;"), "address-space limit (ulimit -v)", "ulimit -v 100000");
  // A run larger than the memory left (here: under an address-space limit), refused before
  // the model loads with the bytes needed and available: SmolLM2's 8192-token context in
  // f32 K/V for seven methods decoded in turn (30 layers x 3 kv heads x 64 dims x 2 x 4
  // bytes = 46 KB a token: 2.6 GB).
  if (!kSanitized && fs::exists(test::smollm2_gguf_path())) {
    const CliRun r = cli("generate --model " + test::smollm2_gguf_path().string() +
                          " --quiet --max-tokens 8000 --kv-dtype f32 --method dense,tactic,quest,streaming,psa,lfps,"
                          "oracle_topk",
                      // One OpenBLAS thread: on a many-core machine its threads' buffers alone
                      // would exceed the limit (the address-space check, not this one).
                      "ulimit -v 700000; OPENBLAS_NUM_THREADS=1");
    expect_rejected(r, "this run needs about 2.", "memory check");
    expect_rejected(r, "is available (the address-space limit (ulimit -v)", "memory check");
  }
  // A parameter beyond a double's range is named as such.
  expect_rejected(cli(gen + "--method tactic --param p=1e-400"), "underflows", "p=1e-400");
}

// An allocation that fails in the CLI names its size: a 250,000,000-byte prompt file (sparse:
// no disk used; file_read reserves the file's size) read whole under an address-space limit of 244 MiB, which leaves room for
// OpenBLAS's one thread buffer but not for the text. 250,000,000 / 2^20 = 238.4 MiB.
TEST_F(Reliability, CliOutOfMemoryNamesTheSizeOfTheAllocation) {
  if (kSanitized) GTEST_SKIP() << "an address-space limit under the address sanitizer";
  const fs::path model = test::stories260k_dir() / "stories260K.bin";
  if (!fs::exists(model)) CUMULUS_FIXTURE_MISSING("no " << model);
  std::ofstream(path("big.txt")).flush();
  fs::resize_file(path("big.txt"), 250000000);
  const CliRun r = cli("generate --model " + model.string() + " --threads 1 --max-tokens 2 --prompt-file " +
                           path("big.txt"),
                       "ulimit -v 250000; OPENBLAS_NUM_THREADS=1");
  expect_rejected(r, "error: out of memory: an allocation of ", "250-MB prompt under ulimit -v 250000");
  expect_rejected(r, " bytes (238.4 MiB) failed; ", "the size");
  expect_rejected(r, "is available (the address-space limit (ulimit -v)", "the room");
  EXPECT_EQ(r.output.find("std::bad_alloc"), std::string::npos) << r.output;
}

// A snapshot of a quantised run offered to `--weights f32` (which dequantises every tensor,
// so the cache cannot match) is named before the model is loaded and dequantised.
TEST_F(Reliability, SnapshotOfOtherWeightsIsRefusedBeforeLoading) {
  const std::string m = test::smollm2_gguf_path().string();
  if (!fs::exists(m)) CUMULUS_FIXTURE_MISSING("no " << m);
  const std::string gen = "generate --model " + m + " --quiet --max-tokens 2 ";
  const CliRun saved = cli(gen + "--prompt 'Hello there' --kv-save " + path("m.kvsnap"));
  ASSERT_EQ(saved.code, 0) << saved.output;
  expect_rejected(cli(gen + "--kv-load " + path("m.kvsnap") + " --weights f32"),
                  "was saved with weights=Q4_1,Q8_0 but --weights f32", "kv-load with f32");
  const CliRun loaded = cli(gen + "--kv-load " + path("m.kvsnap"));
  EXPECT_EQ(loaded.code, 0) << loaded.output;
}

// `info` refuses what `generate` refuses: a GGUF whose tensor was renamed (so one the model
// needs is missing) ends in the same error, with no tensor data read.
TEST_F(Reliability, InfoRefusesAGgufThatGenerateRefuses) {
  const fs::path m = test::smollm2_gguf_path();
  if (!fs::exists(m)) CUMULUS_FIXTURE_MISSING("no " << m);
  std::ifstream in(m, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = bytes.find("blk.3.attn_q.weight");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 10] = 'X';  // blk.3.attn_X.weight: same length, same offsets
  std::ofstream(path("renamed.gguf"), std::ios::binary) << bytes;
  const std::string want = "missing tensor 'blk.3.attn_q.weight'";
  expect_rejected(cli("generate --model " + path("renamed.gguf") + " --quiet --max-tokens 2"), want, "generate");
  const CliRun info = cli("info --model " + path("renamed.gguf"));
  expect_rejected(info, want, "info");
  EXPECT_NE(info.output.find("architecture   llama"), std::string::npos) << info.output;  // it still says what it read
  const CliRun good = cli("info --model " + m.string());
  EXPECT_EQ(good.code, 0) << good.output;
}

}  // namespace
}  // namespace cumulus
