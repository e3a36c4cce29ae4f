// A test's scratch folder: created under the system's temporary folder, named by a prefix,
// the process id and the running test's name (so tests and parallel ctest processes never
// share one), and removed with everything in it when the ScratchDir goes out of scope.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace cumulus::test {

class ScratchDir {
 public:
  // `prefix`, e.g. "cumulus_reliability": the folder is PREFIX_PID_TESTNAME (PREFIX_PID
  // outside a test).
  explicit ScratchDir(const std::string& prefix) {
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           (prefix + "_" + std::to_string(::getpid()) + (info != nullptr ? std::string("_") + info->name() : ""));
    std::filesystem::create_directories(dir_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  // NAME inside the folder.
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

 private:
  std::filesystem::path dir_;
};

}  // namespace cumulus::test
