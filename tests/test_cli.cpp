// The `cumulus` command line on bad input: every bad option, method, parameter or
// path gives an Error naming it and a non-zero exit before any model is loaded or any work
// starts. Each case runs the built binary (CUMULUS_CLI_PATH) under `timeout`, so an option
// checked only after the work (a hang, a two-minute prefill) fails the test by its exit
// code (124) instead of passing late.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>

#include "cli_run.h"
#include "cumulus/methods/registry.h"
#include "fixtures.h"
#include "scratch_dir.h"

namespace cumulus {
namespace {

namespace fs = std::filesystem;

using test::CliResult;

// Runs `cumulus ARGS` from a scratch folder with a time limit of `seconds`.
CliResult cli_run(const std::string& args, int seconds = 20) { return test::cli_exec("", args, seconds); }

// The same with environment assignments before the command ("A=1 B=2").
CliResult cli_run_env(const std::string& env, const std::string& args, int seconds = 20) {
  return test::cli_exec(env, args, seconds);
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = (test::stories260k_dir() / "stories260K.bin").string();
    text_ = (test::shared_dir() / "data/text/tinyshakespeare_input.txt").string();
    if (!fs::exists(model_) || !fs::exists(text_)) CUMULUS_FIXTURE_MISSING("no " << model_ << " or " << text_);
  }
  // Exit code 1 or CLI11's own (105: validation) and the message naming what is wrong.
  static void expect_rejected(const std::string& args, const std::string& needle) {
    const CliResult r = cli_run(args);
    EXPECT_NE(r.code, 0) << args << "\n" << r.output;
    EXPECT_NE(r.code, 124) << "timed out (the check came after the work): " << args;
    EXPECT_NE(r.output.find(needle), std::string::npos) << args << "\nwanted '" << needle << "' in:\n" << r.output;
  }
  std::string gen(const std::string& rest) const {
    return "generate --model " + model_ + " --quiet --max-tokens 4 " + rest;
  }
  std::string eval(const std::string& task, const std::string& rest) const {
    return "eval " + task + " --model " + model_ + " --text " + text_ + " " + rest;
  }
  std::string model_, text_;
  test::ScratchDir scratch_{"cumulus_cli_test"};
  const fs::path dir_ = scratch_.dir();
};

// Defect 1: --bench contexts are checked against the model's context (512 tokens).
TEST_F(Cli, BenchContextBeyondTheModelIsRejected) {
  expect_rejected(gen("--prompt-file " + text_ + " --bench --bench-context 100000 --bench-decode 2"),
                  "--bench-context 100000 + --bench-decode 2 exceeds the context");
  expect_rejected(gen("--bench --bench-context 512 --bench-decode 2"), "exceeds the context");
  expect_rejected("generate --model " + model_ + " --max-tokens 600", "--max-tokens 600 leaves no room");
  expect_rejected(eval("kl", "--context 100000"), "context=100000 exceeds the model's context of 512");
  expect_rejected(eval("niah", "--lengths 1024"), "length=1024 exceeds the model's context of 512");
}

// Defect 2: methods, parameters and output paths before any work.
TEST_F(Cli, MethodsAndOutputPathsAreCheckedFirst) {
  expect_rejected(gen("--method dense,tactic,x=nosuch"), "nosuch");
  expect_rejected(gen("--method dense,flexprefill"), "not a decode method");
  expect_rejected(gen("--prefill nosuch"), "nosuch");
  expect_rejected(eval("kl", "--markdown /nonexistent/x.md"), "--markdown '/nonexistent/x.md': folder '/nonexistent'");
  expect_rejected(eval("kl", "--json /nonexistent/x.json"), "--json '/nonexistent/x.json'");
  expect_rejected(eval("kl", "--svg-dir /dev/null/plots"), "--svg-dir '/dev/null/plots'");
  expect_rejected(eval("kl", "--json " + dir_.string()), "is a directory");
  expect_rejected(eval("kl", "--method tactic --param tactic.nokey=1"), "nokey");
  expect_rejected("bench --json /nonexistent/x.json", "--json '/nonexistent/x.json'");
  expect_rejected(gen("--bench --bench-context 64 --bench-decode 2 --json /nonexistent/x.json"),
                  "--json '/nonexistent/x.json'");
}

// Every method's parameters, ranges and relations (decode and prefill) are checked as the
// method's constructor would check them, and those that need the model against its header,
// before the weights are loaded: the model here has a tokenizer that cannot be read, so a
// check that came after the load would report the tokenizer instead (and before a run
// writes its snapshot).
TEST_F(Cli, MethodRelationsAreCheckedBeforeTheModelLoads) {
  const fs::path model = dir_ / "stories260K.bin";
  fs::copy_file(model_, model);
  std::ofstream(dir_ / "tok512.bin") << "not a tokenizer";
  const std::string g = "generate --model " + model.string() + " --quiet --max-tokens 4 --prompt Once ";
  const std::string e = "eval kl --model " + model.string() + " --text " + text_ + " --steps 2 ";
  const std::string relation = "max_budget=64 is below min_budget=2048";
  expect_rejected(g + "--method dense", "llama2c tokenizer");  // what the load meets
  expect_rejected(g + "--method dense,tactic --param tactic.p1=0.9", "p1=0.9 and p2=0.6 need p1 < p2");
  const fs::path snap = dir_ / "p.kvsnap";
  expect_rejected(g + "--method dense,sketch_topp --param sketch_topp.rest=foo --kv-save " + snap.string(),
                  "rest='foo' must be none or mean");
  EXPECT_FALSE(fs::exists(snap));
  expect_rejected(g + "--method dense,lfps --param lfps.r=1", "r=1 must be in [0, 1)");
  expect_rejected(g + "--prefill flexprefill --prefill-param min_budget=2048 --prefill-param max_budget=64", relation);
  expect_rejected(g + "--method quest --param quest.dense_layers=6", "dense_layers=6 exceeds the model's 5 layers");
  expect_rejected(e + "--method tactic --prefill flexprefill --prefill-param min_budget=2048 --prefill-param "
                      "max_budget=64",
                  relation);
  expect_rejected(e + "--method tactic --sweep tactic.p1=0.5,0.7", "p1=0.7 and p2=0.6 need p1 < p2");
  expect_rejected(e + "--method quest --param quest.dense_layers=6", "dense_layers=6 exceeds the model's 5 layers");
  // bench: before the workload is built and before the device is asked for.
  expect_rejected("bench --device cuda --param lfps.r=1", "r=1 must be in [0, 1)");
}

// generate takes label=method as eval does (one parser, eval/method_spec.h).
TEST_F(Cli, GenerateRunsLabelledMethods) {
  const CliResult r = cli_run("generate --model " + model_ + " --prompt 'Once upon' --max-tokens 3 "
                              "--method dense,x=tactic --param x.p=0.5",
                              60);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("--- x ---"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--- dense ---"), std::string::npos) << r.output;
}

// generate decodes its methods in turn, a token of each at a time: each method's text (greedy)
// is the text it generates when it runs alone.
TEST_F(Cli, GenerateDecodesMethodsInTurnAsIfAlone) {
  const std::string base = "generate --model " + model_ + " --prompt 'Once upon a time' --max-tokens 24 ";
  const std::string dense = "dense", window = "s=streaming --param s.window=8 --param s.sinks=2";
  // The text under a method's header; empty when the output has no such section.
  auto text_of = [](const std::string& out, const std::string& label) {
    const std::string head = "--- " + label + " ---\n";
    const size_t at = out.find(head);
    if (at == std::string::npos) return std::string();
    const size_t from = at + head.size();
    return out.substr(from, out.find('\n', from) - from);
  };
  const CliResult both = cli_run(base + "--method " + dense + "," + window, 60);
  ASSERT_EQ(both.code, 0) << both.output;
  for (const auto& [label, method] : {std::pair{std::string("dense"), dense}, std::pair{std::string("s"), window}}) {
    const CliResult alone = cli_run(base + "--method " + method, 60);
    ASSERT_EQ(alone.code, 0) << alone.output;
    const std::string t = text_of(alone.output, label);
    EXPECT_GT(t.size(), 20u) << alone.output;
    EXPECT_EQ(text_of(both.output, label), t) << label;
  }
  // A window of 8 tokens and 2 sinks forgets the prompt: the texts differ, so the test
  // would see a run that took the other's state.
  EXPECT_NE(text_of(both.output, "dense"), text_of(both.output, "s"));
}

// generate --bench prints a sparse prefill method's block share under its row (one function
// for both devices' tables, generate_command.cpp's prefill_line).
TEST_F(Cli, BenchPrintsThePrefillBlockShare) {
  const CliResult r = cli_run("generate --model " + model_ + " --bench --bench-context 300 --bench-decode 2 "
                              "--repetitions 1 --prefill flexprefill --prefill-param block_size=64 "
                              "--prefill-param min_budget=64",
                              60);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("prefill flexprefill: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("% of causal blocks"), std::string::npos) << r.output;
}

// --device: cuda in a build without the CUDA backend, or on a machine without a GPU, is an
// error naming the reason and a non-zero exit before the model is loaded; an unknown
// device is an error. (On a GPU machine with a CUDA build the run succeeds: skipped.)
TEST_F(Cli, DeviceCudaWithoutBackendOrGpuIsRejected) {
  expect_rejected(gen("--device tpu"), "--device=tpu must be cpu or cuda");
  const CliResult r = cli_run(gen("--device cuda"));
  if (r.code == 0) GTEST_SKIP() << "this build has CUDA and the machine a GPU: --device cuda runs";
  EXPECT_NE(r.code, 124) << "timed out (the check came after the work)";
  const bool named = r.output.find("--device cuda: this build of cumulus has no CUDA backend") != std::string::npos ||
                     r.output.find("--device cuda: no CUDA device is available") != std::string::npos;
  EXPECT_TRUE(named) << r.output;
  // The same for `bench --device cuda`, before the workload is built.
  expect_rejected("bench --device tpu", "--device=tpu must be cpu or cuda");
  const CliResult b = cli_run("bench --device cuda --context 4096 --steps 1");
  EXPECT_NE(b.code, 0) << b.output;
  EXPECT_TRUE(b.output.find("--device cuda: this build of cumulus has no CUDA backend") != std::string::npos ||
              b.output.find("--device cuda: no CUDA device is available") != std::string::npos)
      << b.output;
  // And for `eval --device cuda`, before the model is loaded; mass and KV snapshots are the
  // CPU's whatever the build.
  expect_rejected(eval("kl", "--device tpu"), "--device=tpu must be cpu or cuda");
  expect_rejected(eval("mass", "--device cuda"), "eval mass --device cuda: mass runs variants with no GPU pipeline");
  expect_rejected(eval("kl", "--device cuda --kv-save " + (dir_ / "x.kv").string()),
                  "eval --device cuda: --kv-save/--kv-load are the CPU's only");
  const CliResult e = cli_run(eval("kl", "--device cuda --steps 2"));
  EXPECT_NE(e.code, 0) << e.output;
  EXPECT_TRUE(e.output.find("--device cuda: this build of cumulus has no CUDA backend") != std::string::npos ||
              e.output.find("--device cuda: no CUDA device is available") != std::string::npos)
      << e.output;
}

// Defect 3: a directory is not a text, a prompt, a tokenizer or a model.
TEST_F(Cli, DirectoriesAreRejected) {
  expect_rejected(gen("--prompt-file " + dir_.string()), "is a directory");
  expect_rejected("eval kl --model " + model_ + " --text " + dir_.string(), "is a directory");
  expect_rejected(gen("--tokenizer " + dir_.string()), "is a directory");
  expect_rejected("generate --model " + dir_.string(), "is a directory");
}

// Defect 4: reads are capped.
TEST_F(Cli, EndlessPromptFileIsCapped) {
  expect_rejected(gen("--prompt-file /dev/zero"), "more than the limit");
}

// Defect 5: errors say what the file is and why it cannot be used.
TEST_F(Cli, ErrorsNameTheCause) {
  const fs::path junk = dir_ / "junk.bin";
  std::ofstream(junk) << "this is not a model, just 58 bytes of text; no magic at all";
  expect_rejected("generate --model " + junk.string(), "not a GGUF or llama2.c model");
  expect_rejected("generate --model " + (dir_ / "none.gguf").string(), "No such file or directory");
  const fs::path lonely = dir_ / "stories260K.bin";  // no tok512.bin beside it
  fs::copy_file(model_, lonely);
  expect_rejected("generate --model " + lonely.string(), "has no tokenizer beside it");
  expect_rejected("frobnicate --model x", "unknown subcommand 'frobnicate'");
  // The message speaks of the user's option and file, not of the library function that
  // found the fault (that one shows with CUMULUS_DEBUG set).
  const CliResult r = cli_run("generate --model " + (dir_ / "none.gguf").string());
  EXPECT_NE(r.output.find("error: model '"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("file_check_regular"), std::string::npos) << r.output;
  const CliResult with_where = cli_run_env("CUMULUS_DEBUG=1", "generate --model " + (dir_ / "none.gguf").string());
  EXPECT_NE(with_where.output.find("error: file_check_regular: model '"), std::string::npos) << with_where.output;
}

// A fixed budget that covers the whole context runs dense attention under the method's
// name: generate and eval say so before the work.
TEST_F(Cli, BudgetCoveringTheContextIsWarned) {
  const CliResult g = cli_run(gen("--prompt 'Once upon a time' --method quest,tactic"));
  EXPECT_EQ(g.code, 0) << g.output;
  EXPECT_NE(g.output.find("warning: quest: budget=2048 covers the whole"), std::string::npos) << g.output;
  EXPECT_EQ(g.output.find("warning: tactic"), std::string::npos) << g.output;  // adaptive: no budget
  const CliResult small =
      cli_run(gen("--prompt-file " + text_ + " --prompt-tokens 200 --method quest --param quest.budget=64"));
  EXPECT_EQ(small.output.find("warning:"), std::string::npos) << small.output;
}

// Defect 6: one range and one meaning per option.
TEST_F(Cli, InconsistentOptionsAreRejected) {
  for (const char* cmd : {"generate", "eval", "bench"}) {
    const std::string base = std::string(cmd) == "generate" ? gen("")
                             : std::string(cmd) == "eval"   ? eval("kl", "")
                                                            : std::string("bench");
    expect_rejected(base + " --threads 0", "--threads");
    expect_rejected(base + " --threads 257", "--threads");
    expect_rejected(base + " --seed -1", "--seed");
  }
  expect_rejected(gen("--json " + (dir_ / "x.json").string()), "add --bench or drop --json");
  expect_rejected(gen("--method tactic --param p=0.9 --param p=0.8"), "already set by --param 'p=0.9'");
  expect_rejected(gen("--method tactic --param p=0.9 --param tactic.p=0.8"), "already set");
  expect_rejected(gen("--prefill flexprefill --prefill-param gamma=0.9 --prefill-param gamma=0.8"),
                  "key 'gamma' is given twice");
  expect_rejected("bench --param quest.budget=64 --param quest.budget=128", "already set");
  expect_rejected("bench --membw-mib 100000000", "--membw-mib=100000000 must be in [64, 16384]");
  expect_rejected(eval("kl", "--method dense=tactic"), "the label 'dense' is the dense reference's");
  expect_rejected(eval("kl", "--method a=tactic,a=psa"), "label 'a' is given twice");
  expect_rejected(eval("matched", "--method quest"), "quest is not an adaptive method");
}

// Numbers are decimal in every option and parameter, never clamped, and an error names the
// option, the value and what is wrong with it.
TEST_F(Cli, NumbersAreDecimalAndNeverClamped) {
  // Leading zeros are decimal: 0600 is 600 (octal would be 384, which fits the context).
  expect_rejected("generate --model " + model_ + " --max-tokens 0600", "--max-tokens 600 leaves no room");
  expect_rejected(eval("kl", "--context 0600"), "context=600 exceeds the model's context of 512");
  expect_rejected(gen("--max-tokens 0b11"), "--max-tokens: '0b11' is not a decimal integer");
  expect_rejected(gen("--max-tokens 0x10"), "--max-tokens: '0x10' is not a decimal integer");
  expect_rejected(gen("--max-tokens 2147483648"), "--max-tokens: '2147483648' is out of range [-2147483648, 2147483647]");
  expect_rejected(gen("--bench --bench-context 64,0x40"), "--bench-context: '0x40' is not a decimal integer");
  expect_rejected(gen("--threads 010x"), "--threads: '010x' is not a decimal integer");
  expect_rejected(gen("--seed 18446744073709551616"), "--seed: '18446744073709551616' is out of range [0, 18446744073709551615]");
  expect_rejected(gen("--seed 0x10"), "--seed: '0x10' is not a non-negative decimal integer");
  expect_rejected(gen("--temperature 0x1p3"), "--temperature: '0x1p3' is not a decimal number");
  expect_rejected(gen("--temperature 1e400"), "--temperature: '1e400' is out of range");
  expect_rejected(gen("--top-p 1e-400 --temperature 1"), "--top-p: '1e-400' underflows");
  expect_rejected(gen("--temperature nan"), "--temperature: 'nan' is not a finite number");
  expect_rejected(gen("--device-kv-gib nan"), "--device-kv-gib: 'nan' is not a finite number");
  expect_rejected(gen("--device-kv-gib -1"), "--device-kv-gib=-1 must be >= 0");
  expect_rejected(gen("--method tactic --param p=1e-400"), "parameter p='1e-400' underflows");
  expect_rejected(gen("--method tactic --param p=0x1p-1"), "parameter p='0x1p-1' is not a decimal number");
  expect_rejected(gen("--method quest --param budget=99999999999"), "parameter budget='99999999999' is out of range");
  expect_rejected(gen("--method quest --param budget=1e3"), "parameter budget='1e3' is not a decimal integer");
  // A parameter's leading zeros are decimal too: budget=0600 is 600, beyond 512.
  const CliResult r = cli_run(gen("--prompt 'Once upon a time' --method quest --param budget=0600"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: quest: budget=600 covers the whole"), std::string::npos) << r.output;
}

// Options that contradict each other or would do nothing are refused before any work.
TEST_F(Cli, ContradictoryOrIdleOptionsAreRejected) {
  expect_rejected(gen("--bench-decode 4"), "--bench-decode is a --bench option: add --bench or drop --bench-decode");
  expect_rejected(gen("--bench-context 64"), "--bench-context is a --bench option");
  expect_rejected(gen("--repetitions 2"), "--repetitions is a --bench option");
  expect_rejected(gen("--top-p 0.9"), "--top-p 0.9 samples, but --temperature 0 decodes greedily");
  expect_rejected(gen("--device-kv-gib 4"), "--device-kv-gib=4 needs --device cuda (not cpu)");
  expect_rejected(eval("kl", "--device-kv-gib 4"), "device_kv_gib=4 needs device cuda (not cpu)");
  expect_rejected(gen("--method dense,"), "--method 'dense,': empty method name in the list");
  expect_rejected(gen("--method dense,,tactic"), "empty method name");
  expect_rejected(eval("kl", "--method dense,"), "empty method name");
  expect_rejected(eval("kl", "--method tactic --sweep tactic.p=0.5,0.9 --param tactic.p=0.8"),
                  "--sweep 'tactic.p=0.5,0.9' and --param 'tactic.p=0.8' both set tactic's parameter 'p'");
  expect_rejected(eval("kl", "--method tactic --sweep p=0.5,0.9,0.50"), "values '0.5' and '0.50' are the same value");
  expect_rejected(eval("kl", "--method tactic --sweep p=0.5,0.5"), "the same value");
  expect_rejected(gen("--prompt ''"), "--prompt is empty");
  const fs::path empty = dir_ / "empty.txt", only_header = dir_ / "header.txt";
  std::ofstream(empty).flush();
  std::ofstream(only_header) << "Title\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\n\n"
                                "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicense\n";
  expect_rejected(gen("--prompt-file " + empty.string()), "holds no text");
  expect_rejected(gen("--prompt-file " + only_header.string()), "holds no text");
  // Still accepted: no prompt at all (BOS), --top-p when sampling, --bench with its options.
  EXPECT_EQ(cli_run(gen("")).code, 0);
  EXPECT_EQ(cli_run(gen("--prompt Hi --temperature 0.8 --top-p 0.9")).code, 0);
}

// Every comma list refuses an empty item, naming the option and the value (CLI11's own
// splitting dropped it: "--lengths 256," ran 256 alone), before any work.
TEST_F(Cli, ListsRefuseEmptyItems) {
  const std::string empty_item = "' has an empty item";
  expect_rejected(gen("--bench --bench-context 64,,128 --bench-decode 2"), "--bench-context: '64,,128" + empty_item);
  expect_rejected(gen("--bench --bench-context 64, --bench-decode 2"), "--bench-context: '64," + empty_item);
  expect_rejected(eval("niah", "--lengths 256, --depths 0.5"), "--lengths: '256," + empty_item);
  expect_rejected(eval("niah", "--lengths 256 --depths ,0.5"), "--depths: ',0.5" + empty_item);
  expect_rejected(eval("mass", "--targets 0.5,,0.9"), "--targets: '0.5,,0.9" + empty_item);
  expect_rejected(eval("matched", "--baselines quest,"), "--baselines: 'quest," + empty_item);
  expect_rejected("bench --methods dense,,tactic", "--methods: 'dense,,tactic" + empty_item);
  expect_rejected("trace --model " + model_ + " --text " + text_ + " --layers 1,,2", "--layers: '1,,2" + empty_item);
  expect_rejected(eval("niah", "--lengths ''"), "--lengths: ''" + empty_item.substr(1));
  // A repeated option keeps every item, in order; the numbers are read as every number is.
  expect_rejected(eval("niah", "--lengths 256 --lengths 300,1024"), "length=1024 exceeds the model's context of 512");
  expect_rejected(eval("niah", "--lengths 256,0x100"), "--lengths: '0x100' is not a decimal integer");
  expect_rejected(eval("niah", "--depths 0.5,0x1p-1"), "--depths: '0x1p-1' is not a decimal number");
  expect_rejected(gen("--bench --bench-context 64,2147483648"), "--bench-context: '2147483648' is out of range");
}

// An eval text that is empty or only whitespace once a Gutenberg header and footer are
// stripped is refused before the model loads: the model here has a tokenizer that cannot be
// read, so a check after the load would report the tokenizer instead.
TEST_F(Cli, BlankEvalTextIsRejectedBeforeTheModelLoads) {
  const fs::path model = dir_ / "stories260K.bin";
  fs::copy_file(model_, model);
  std::ofstream(dir_ / "tok512.bin") << "not a tokenizer";
  const fs::path blank = dir_ / "blank.txt", empty = dir_ / "empty.txt", only_header = dir_ / "header.txt";
  std::ofstream(blank) << " \n\t\r\n  \n";
  std::ofstream(empty).flush();
  std::ofstream(only_header) << "Title\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\n \n\n"
                                "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicense\n";
  const std::string e = "eval kl --model " + model.string() + " --context 128 --steps 4 --text ";
  expect_rejected(e + blank.string(), "--text '" + blank.string() + "' holds no text: only 8 bytes of whitespace");
  expect_rejected(e + empty.string(), "--text '" + empty.string() + "' holds no text: it is empty");
  expect_rejected(e + only_header.string(), "holds no text: it is empty (once a Gutenberg header");
  expect_rejected("eval niah --model " + model.string() + " --text " + blank.string(), "holds no text");
  expect_rejected(e + text_, "llama2c tokenizer");  // a real text gets as far as the load
}

// --tokenizer belongs to llama2.c models; a GGUF model carries its own.
TEST_F(Cli, TokenizerWithGgufIsRejected) {
  const fs::path gguf = test::smollm2_gguf_path();
  if (!fs::exists(gguf)) CUMULUS_FIXTURE_MISSING(gguf << " missing: run scripts/fetch-model.sh");
  const fs::path tok = test::stories260k_dir() / "tok512.bin";
  expect_rejected("generate --model " + gguf.string() + " --tokenizer " + tok.string(), "drop --tokenizer");
}

// `cumulus methods` prints each parameter's type and its range or choices. The values below
// are those the options structs declare (tactic.h: p in ParamRange::left_open(0, 1), mode one
// of {"fit", "cluster_optimal"}; lfps.h: r in right_open(0, 1); flexprefill.h: block_size in
// closed(8, 4096)); then every parameter of the registry is found with its declared bounds.
TEST(CliMethods, ListsParametersWithTheirRangesAndChoices) {
  const CliResult r = test::cli_exec("", "methods", 20);
  ASSERT_EQ(r.code, 0) << r.output;
  // (method, "--param key=default") -> the rest of its line, with runs of spaces made one.
  std::map<std::pair<std::string, std::string>, std::string> rows;
  std::istringstream in(r.output);
  std::string line, method;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != ' ') method = line.substr(0, line.find(' '));
    const size_t flag = line.find("--");
    if (line.rfind("  ", 0) != 0 || flag == std::string::npos) continue;
    std::istringstream words(line.substr(flag));
    std::string f, key, w, rest;
    words >> f >> key;
    while (words >> w) rest += (rest.empty() ? "" : " ") + w;
    rows[{method, f + " " + key}] = rest;
  }
  const auto row = [&](const std::string& m, const std::string& key) {
    const auto it = rows.find({m, key});
    return it == rows.end() ? std::string("(no row '" + key + "' for " + m + ")") : it->second;
  };
  EXPECT_EQ(row("tactic", "--param p=0.9").rfind("float (0, 1] ", 0), 0u) << row("tactic", "--param p=0.9");
  EXPECT_EQ(row("tactic", "--param mode=fit").rfind("choice fit|cluster_optimal ", 0), 0u)
      << row("tactic", "--param mode=fit");
  EXPECT_EQ(row("lfps", "--param r=0.95").rfind("float [0, 1) ", 0), 0u) << row("lfps", "--param r=0.95");
  EXPECT_EQ(row("flexprefill", "--prefill-param block_size=128").rfind("int [8, 4096] ", 0), 0u)
      << row("flexprefill", "--prefill-param block_size=128");

  // Every parameter, its bounds written here from the registry's declared numbers.
  const auto bound = [](double v) -> std::string {
    if (std::fabs(v) >= 1e300) return v < 0 ? "-inf" : "inf";
    if (v == std::floor(v)) return std::to_string(static_cast<long long>(v));
    char buf[32];
    return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  };
  size_t checked = 0;
  for (const MethodInfo& m : Registry::builtin().list())
    for (const ParamSpec& p : m.params) {
      std::string want;
      if (p.type == ParamType::kInt || p.type == ParamType::kDouble) {
        want = std::string(p.type == ParamType::kInt ? "int " : "float ") + (p.min_exclusive ? "(" : "[") +
               bound(p.min) + ", " + bound(p.max) + (p.max_exclusive ? ")" : "]");
      } else if (p.type == ParamType::kChoice) {
        want = "choice";
        for (size_t i = 0; i < p.choices.size(); ++i) want += (i == 0 ? " " : "|") + p.choices[i];
      } else {
        continue;
      }
      const std::string key = std::string(m.make_decode ? "--param " : "--prefill-param ") + p.name + "=" +
                              p.default_value;
      EXPECT_EQ(row(m.name, key).rfind(want + " ", 0), 0u) << m.name << " " << key << ": wanted '" << want
                                                            << "', got '" << row(m.name, key) << "'";
      ++checked;
    }
  EXPECT_GE(checked, 40u);
}

// Gemma 3 270M through the command line: info shows its layer pattern, generate
// continues a prompt with llama.cpp's greedy tokens (llamacpp_logits on the same GGUF, ids
// 2 818 5279 529 7001 563: " the capital of the country of France. It is the largest").
TEST(CliGemma3, InfoAndGreedyGenerate) {
  const fs::path model = test::source_dir() / "models/gemma-3-270m-q4_k_m.gguf";
  if (!fs::exists(model)) CUMULUS_FIXTURE_MISSING(model << " missing: run scripts/fetch-model.sh gemma3-270m");
  const CliResult info = cli_run("info --model " + model.string());
  ASSERT_EQ(info.code, 0) << info.output;
  EXPECT_NE(info.output.find("architecture   gemma3"), std::string::npos) << info.output;
  EXPECT_NE(info.output.find("15 local (sliding window 512, rope theta 10000), global: 5, 11, 17"), std::string::npos)
      << info.output;
  const CliResult gen =
      cli_run("generate --model " + model.string() + " --prompt 'The capital of France is' --max-tokens 12", 60);
  ASSERT_EQ(gen.code, 0) << gen.output;
  EXPECT_NE(gen.output.find(" the capital of the country of France. It is the largest"), std::string::npos)
      << gen.output;
}

}  // namespace
}  // namespace cumulus
