// Running the built `cumulus` binary (CUMULUS_CLI_PATH, CMakeLists.txt) from a test: the
// command under `timeout`, its stdout and stderr together, its exit status (128 + signal
// when a signal ended it).
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace cumulus::test {

struct CliResult {
  int code = -1;
  std::string output;  // stdout and stderr together
};

// `cumulus ARGS` after the shell words in `pre` (environment assignments, or commands such
// as "ulimit -v 100000;"), in a subshell, killed after `seconds`.
inline CliResult cli_exec(const std::string& pre, const std::string& args, int seconds) {
  const std::string cmd = "(" + pre + " timeout " + std::to_string(seconds) + " " + std::string(CUMULUS_CLI_PATH) +
                          " " + args + ") 2>&1";
  CliResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

}  // namespace cumulus::test
