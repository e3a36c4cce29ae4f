// cumulus command line: bench | eval | generate | info | methods | trace.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#include "cli.h"
#include "cumulus/core/error.h"
#include "cumulus/core/file.h"
#include "cumulus/kernels/simd.h"
#include "limits.h"
#include "paths.h"

namespace {

// The error operator new throws in this program: a std::bad_alloc that carries the size
// asked for, so the message names the allocation that failed (the size travels with the
// exception: never that of an earlier failure a caller handled, such as a nothrow new's).
// what() says it too, for code that turns an exception into its text.
class AllocFailed : public std::bad_alloc {
 public:
  explicit AllocFailed(size_t bytes) : bytes_(bytes) {
    std::snprintf(what_, sizeof what_, "out of memory: an allocation of %zu bytes failed", bytes);
  }
  size_t bytes() const { return bytes_; }
  const char* what() const noexcept override { return what_; }

 private:
  size_t bytes_;
  char what_[80];
};

// Flushes what was printed and ends the process without the library destructors: after an
// error OpenBLAS's threads may be stuck retrying a buffer the address-space limit refuses,
// and its destructor would join them forever.
[[noreturn]] void exit_now(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(code);
}

}  // namespace

// operator new is replaced in this program (not in the library) only to throw AllocFailed.
// A std::set_new_handler handler would not do: it is given no size, and it is called again
// for nothrow new, whose failure the caller handles. Ending the process from the handler
// would also skip the unwinding that removes the temporary files of writes in flight
// (core/file.h); throwing from it is what the default does. The aligned forms (over-aligned
// types) are replaced too; operator delete stays the library's, which frees what malloc and
// posix_memalign gave, and the nothrow forms are the library's, which call these.
#if !defined(__SANITIZE_ADDRESS__)
void* operator new(size_t n) {
  for (;;) {
    if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
    const std::new_handler h = std::get_new_handler();
    if (h == nullptr) throw AllocFailed(n);
    h();
  }
}
void* operator new[](size_t n) { return ::operator new(n); }
void* operator new(size_t n, std::align_val_t align) {
  const size_t a = std::max(static_cast<size_t>(align), sizeof(void*));
  for (;;) {
    void* p = nullptr;
    if (::posix_memalign(&p, a, n == 0 ? 1 : n) == 0) return p;
    const std::new_handler h = std::get_new_handler();
    if (h == nullptr) throw AllocFailed(n);
    h();
  }
}
void* operator new[](size_t n, std::align_val_t align) { return ::operator new(n, align); }
#endif

int main(int argc, char** argv) {
  CLI::App app{"cumulus: adaptive sparse attention for long-context LLM inference"};
  app.require_subcommand(1);
  cumulus::cli::add_methods_command(app);
  cumulus::cli::add_bench_command(app);
  cumulus::cli::add_generate_command(app);
  cumulus::cli::add_eval_command(app);
  cumulus::cli::add_info_command(app);
  cumulus::cli::add_trace_command(app);
  cumulus::cli::options_numbers_decimal(app);
  cumulus::cli::paths_refuse_empty(app);
  // An interrupted --kv-save, --json, ... leaves no temporary file behind.
  cumulus::file_temp_cleanup_on_signals();
  // CLI11 answers an unknown first word with "A subcommand is required"; name it instead.
  if (argc > 1 && argv[1][0] != '-') {
    std::string known;
    bool found = false;
    for (const CLI::App* sub : app.get_subcommands({})) {
      known += (known.empty() ? "" : ", ") + sub->get_name();
      found = found || sub->get_name() == argv[1];
    }
    if (!found) {
      fmt::print(stderr, "error: unknown subcommand '{}' (known: {}; see --help)\n", argv[1], known);
      return 1;
    }
  }
  try {
    // Before anything else: an address-space limit too small for OpenBLAS's threads.
    cumulus::cli::address_space_check();
    // CUMULUS_SIMD caps the CPU kernels' SIMD target (kernels/simd.h) before any runs.
    cumulus::cpu::simd_select_from_env();
    app.parse(argc, argv);
    // A report cut short by a full disk or a closed pipe must not exit 0.
    cumulus::cli::stdout_check();
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const cumulus::Error& e) {
    // The message names the option, file or value; the library function that found it is
    // shown only with CUMULUS_DEBUG set (e.g. "error: file_check_input: ...").
    const char* debug = std::getenv("CUMULUS_DEBUG");
    fmt::print(stderr, "error: {}\n", debug != nullptr && *debug != '\0' ? std::string(e.what()) : e.message());
    exit_now(1);
  } catch (const AllocFailed& e) {
    const cumulus::cli::MemoryRoom room = cumulus::cli::memory_room();
    fmt::print(stderr,
               "error: out of memory: an allocation of {} bytes ({:.1f} MiB) failed; {:.1f} MiB is available ({})\n",
               e.bytes(), e.bytes() / 1048576.0, room.bytes / 1048576.0, room.source);
    exit_now(1);
  } catch (const std::bad_alloc&) {
    // The aligned buffers (the weights, the K/V cache, the prefill's scratch: core/buffer.h)
    // are not allocated through operator new, so their size is not known here.
    const cumulus::cli::MemoryRoom room = cumulus::cli::memory_room();
    fmt::print(stderr,
               "error: out of memory: an aligned buffer (weights, K/V cache or prefill scratch) could not be "
               "allocated; {:.1f} MiB is available ({})\n",
               room.bytes / 1048576.0, room.source);
    exit_now(1);
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    exit_now(1);
  }
  return 0;
}
