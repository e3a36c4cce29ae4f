// Where the tests find their fixtures, wherever ctest runs from, and what a missing one
// means. models/ (scripts/fetch-model.sh) and ../shared (stories260K, texts, reference
// tokenizers) are found through the source directory compiled in (CMakeLists.txt), never
// through the working directory or __FILE__ (which ccache's base-dir rewriting makes
// relative).
//
// A missing fixture skips the test on a developer's machine; with
// CUMULUS_REQUIRE_FIXTURES=1 (set by .ci/run) it fails it, so CI cannot go green by
// skipping the golden tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace cumulus::test {

inline std::filesystem::path source_dir() { return std::filesystem::path(CUMULUS_SOURCE_DIR); }
inline std::filesystem::path shared_dir() { return std::filesystem::path(CUMULUS_SHARED_DIR); }
inline std::filesystem::path smollm2_gguf_path() { return source_dir() / "models/SmolLM2-135M-Instruct.Q4_1.gguf"; }
inline std::filesystem::path stories260k_dir() { return shared_dir() / "data/models/stories260K"; }

// stories260K's golden greedy sample (llama2.c's own output, not ours): the code block
// after "-t 0.0" in stories260K.md; empty when the file or the block is missing.
inline std::string stories260k_golden_sample() {
  std::ifstream f(stories260k_dir() / "stories260K.md");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string md = ss.str();
  const std::string cmd = "-t 0.0\n";
  size_t b = md.find(cmd);
  if (b == std::string::npos) return "";
  b += cmd.size();
  return md.substr(b, md.find("\n```", b) - b);
}

inline bool fixtures_required() {
  const char* v = std::getenv("CUMULUS_REQUIRE_FIXTURES");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace cumulus::test

// Skips the current test (or fails it under CUMULUS_REQUIRE_FIXTURES=1) because a fixture
// is missing; `msg` is streamed, e.g. CUMULUS_FIXTURE_MISSING(path << " missing").
#define CUMULUS_FIXTURE_MISSING(msg)                                                           \
  do {                                                                                         \
    if (::cumulus::test::fixtures_required()) {                                                \
      GTEST_FAIL() << msg << " (fixture required: CUMULUS_REQUIRE_FIXTURES=1)";                \
    } else {                                                                                   \
      GTEST_SKIP() << msg;                                                                     \
    }                                                                                          \
  } while (0)
