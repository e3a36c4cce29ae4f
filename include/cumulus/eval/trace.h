// Reader of the real-attention traces that `cumulus trace` writes (tools/cli/trace_command.cpp;
// format in docs/cuda.md "Traces"): per recorded layer the f16 K/V of prompt + steps tokens
// and the float32 decode queries of each step (after RoPE). Used by the GPU benchmark to
// replay real attention and by `cumulus trace --profile` to measure it on the CPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cumulus/kv/kv_cache.h"

namespace cumulus {

struct TraceFile {
  std::string header;  // the JSON header as written
  int n_q_heads = 0, n_kv_heads = 0, head_dim = 0;
  int n_tokens = 0, prompt_tokens = 0, steps = 0;  // n_tokens = prompt_tokens + steps
  std::vector<int> layers;                          // model layer of each record
  std::vector<std::vector<uint16_t>> k, v;          // [record][n_tokens][n_kv_heads][head_dim] f16 bits
  std::vector<std::vector<float>> q;                // [record][steps][n_q_heads][head_dim]

  int group() const { return n_q_heads / n_kv_heads; }
  // Step j's query attends tokens [0, prompt_tokens + j + 1).
  int attended(int step) const { return prompt_tokens + step + 1; }
  // A one-layer f16 cache holding the record's n_tokens tokens (page size 16).
  KvCache cache(int record) const;
};

// Reads a whole trace; throws Error naming the file and what is wrong (magic, version,
// header fields, truncation). Never trusts a length it reads: the header's sizes are
// bounded before any allocation.
TraceFile trace_read(const std::string& path);

}  // namespace cumulus
