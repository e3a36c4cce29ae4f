// The run-time SIMD target cap (kernels/simd.h): CUMULUS_SIMD applies to this test binary
// as to every program (a global test environment), so `CUMULUS_SIMD=avx2 ctest` runs the
// model and method tests on the AVX2 code paths of an AVX-512 machine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "cumulus/kernels/simd.h"
#include "kernel_check.h"

namespace cumulus {
namespace {

class SimdFromEnv : public ::testing::Environment {
 public:
  void SetUp() override {
    try {
      cpu::simd_select_from_env();
    } catch (const Error& e) {
      FAIL() << e.what();
    }
    const char* v = std::getenv("CUMULUS_SIMD");
    if (v != nullptr && *v != '\0') std::printf("SIMD target: %s\n", cpu::simd_target_line().c_str());
  }
};
[[maybe_unused]] ::testing::Environment* const kSimdFromEnv = ::testing::AddGlobalTestEnvironment(new SimdFromEnv);

// Restores the cap CUMULUS_SIMD set, whatever a test selected.
struct SimdRestore {
  ~SimdRestore() { cpu::simd_select_from_env(); }
};

TEST(Simd, EachSupportedTargetCanBeSelected) {
  const SimdRestore restore;
  const std::vector<std::string> compiled = cpu::simd_targets_compiled();
  const std::vector<std::string> supported = cpu::simd_targets_supported();
  ASSERT_FALSE(supported.empty());
  EXPECT_EQ(supported.back(), "scalar");  // the emulated fallback runs everywhere
  for (const std::string& t : supported) {
    EXPECT_NE(std::find(compiled.begin(), compiled.end(), t), compiled.end()) << t;
    cpu::simd_select(t);
    EXPECT_EQ(cpu::simd_target(), t);
  }
  cpu::simd_select("native");
  EXPECT_EQ(cpu::simd_target(), supported.front());
}

TEST(Simd, UnknownOrUnsupportedTargetsAreErrors) {
  const SimdRestore restore;
  check::expect_error([] { cpu::simd_select("avx9"); }, "avx9 is not a SIMD target");
  check::expect_error([] { cpu::simd_select("AVX2"); }, "AVX2 is not a SIMD target");
  const std::vector<std::string> supported = cpu::simd_targets_supported();
  for (const std::string& t : cpu::simd_targets_compiled())
    if (std::find(supported.begin(), supported.end(), t) == supported.end())
      check::expect_error([&] { cpu::simd_select(t); }, "this CPU cannot run " + t);
}

}  // namespace
}  // namespace cumulus
