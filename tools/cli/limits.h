// What the process may use, checked before any work: memory against what a run needs, the
// address-space limit against what OpenBLAS's threads take, and stdout's writes at exit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "cumulus/core/dtype.h"
#include "cumulus/model/model_weights.h"

namespace cumulus::cli {

// OpenBLAS's per-thread buffer (BUFFER_SIZE on x86-64): every BLAS thread maps one, and one
// that cannot retries forever (a process under `ulimit -v` then spins and never exits).
inline constexpr size_t kBlasThreadBuffer = size_t{128} << 20;

// Memory the process can still take: the least of MemAvailable (/proc/meminfo) and the
// address-space limit (RLIMIT_AS) less the address space in use; `source` says which.
struct MemoryRoom {
  uint64_t bytes = UINT64_MAX;
  std::string source;
};
MemoryRoom memory_room();

// Throws Error when the address-space limit leaves less than one OpenBLAS thread buffer
// free: OpenBLAS's threads, started before main, retry their buffers forever. The CLI calls
// it first, and exits without running the library destructors (which join those threads).
void address_space_check();

// Bytes a CPU run of `model` holds: its weights as `storage` keeps them (compact: the file's
// size bounds the block formats and float tensors; f32: 4 bytes a parameter), and the K/V
// of `tokens` tokens in `kv_dtype` for each of `sessions` sessions.
uint64_t memory_weights_bytes(const std::string& model_path, const ModelConfig& config, WeightStorage storage);
uint64_t memory_kv_bytes(const ModelConfig& config, DType kv_dtype, int64_t tokens, int sessions);
// Throws Error naming the bytes needed (and of what) and the memory available when `need`
// does not fit: before the model is loaded, as the GPU runner checks device memory.
void memory_check(std::string_view what, uint64_t weights, uint64_t kv, uint64_t other, std::string_view detail);

// At exit: flushes stdout and throws Error when a write to it failed (a full disk, /dev/full,
// a closed pipe), so a truncated report never exits 0.
void stdout_check();

}  // namespace cumulus::cli
