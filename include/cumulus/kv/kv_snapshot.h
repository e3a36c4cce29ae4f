// KV snapshots (docs/kv_snapshot.md): the cache of a prompt after its
// prefill, with what a Session needs to decode from it exactly as after that prefill: the
// prompt's tokens, the logits after its last token and its last queries. One long prefill
// then serves many evaluation runs (`--kv-save FILE` / `--kv-load FILE`).
//
// File (little-endian; every section starts at a multiple of 64 bytes, zero padded):
//   header [128]   magic "CUMKVSNP", version, model id, shapes, dtype, counts
//   setup          [setup_bytes] text: how the cache was made besides the model
//   first          uint32 [n_layers] (versions 2, 3) the first token of each layer's K/V below:
//                  0, or for a sliding-window layer the first its next query reads
//   tokens         int32 [n_tokens]
//   logits         float32 [vocab_size]
//   prompt_q       float32 [n_layers][prompt_q_rows][n_heads][head_dim]
//   kv             per layer: K [n_tokens - first][n_kv_heads][head_dim], V the same, in dtype
//   checksum       uint64 XXH3-64 of every byte before it (versions 1 and 2: FNV-1a 64)
// Version 2 files (the same with FNV-1a) and version 1 files (no `first`: every layer from
// token 0) are read as well.
//
// Reading copies the file into memory (a mapping dies of SIGBUS when the file is truncated
// under it) and checks all of it (magic, version, each field's range, the
// file's size against what the fields imply, the checksum, finite values, token ids)
// before anything of it is used or any size read from it is allocated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cumulus/core/dtype.h"
#include "cumulus/kv/kv_cache.h"

namespace cumulus {

inline constexpr uint32_t kKvSnapshotVersion = 3;  // written; versions 1, 2 and 3 are read
// Prompt queries a saving run keeps at least, so that a method that learns from them
// (lfps, s = 32 by default) can start from the snapshot.
inline constexpr int kKvSnapshotPromptQueries = 64;

// What a snapshot says about itself and about what made it.
struct KvSnapshotInfo {
  uint64_t model_id = 0;  // model_identity() of the model that prefilled (model/model_identity.h)
  std::string setup;      // the rest of what shaped the cache, e.g. "weights=Q4_1,Q8_0 prefill=dense"
  int n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int vocab_size = 0;
  int page_size = 0;
  DType dtype = DType::f16;
  int n_tokens = 0;       // prompt tokens cached in every layer
  int prompt_q_rows = 0;  // the prompt's last queries kept per layer
  // [n_layers] the first token whose K/V the file holds per layer (read from the file; the
  // writer takes it from the cache: 0, or n_tokens - w + 1 for a window-w layer).
  std::vector<int> first_token{};
};

// FNV-1a 64, continued from `h` (start with kFnv1a64Basis): versions 1 and 2's checksum,
// and model_identity's hash (model/model_identity.h).
inline constexpr uint64_t kFnv1a64Basis = 14695981039346656037ull;
uint64_t fnv1a64(const void* data, size_t n, uint64_t h = kFnv1a64Basis);

// A snapshot's checksum of its first n bytes (every byte before the checksum) as `version`
// computes it: XXH3-64 (seed 0) from version 3, FNV-1a 64 before. XXH3 hashes at memory
// speed, so a 16 GiB snapshot does not wait on its checksum; FNV-1a goes a byte at a time.
uint64_t kv_snapshot_checksum(const void* data, size_t n, uint32_t version);

// Writes a snapshot of `kv` to `path` atomically (core/file.h): the first info.n_tokens
// tokens of every layer (of a sliding-window layer, those of them the query at n_tokens
// reads: [n_tokens - w + 1, n_tokens)), with the prompt's tokens [n_tokens], logits
// [vocab_size] and per layer its last queries prompt_q[layer] [prompt_q_rows][n_heads]
// [head_dim]. The shape, page size and dtype fields of `info` must match `kv` (its
// first_token is ignored). Throws Error for inconsistent sizes, a window layer that dropped
// those tokens, or a failing write (the previous file, if any, is then unchanged).
void kv_snapshot_write(const std::string& path, const KvSnapshotInfo& info, std::span<const int32_t> tokens,
                       std::span<const float> logits, const std::vector<std::vector<float>>& prompt_q,
                       const KvCache& kv);

// A snapshot file, read into memory and checked completely by open().
class KvSnapshot {
 public:
  // Throws Error naming the file, the field and its value for: a file that cannot be read or
  // is smaller than the header, a wrong magic, another version, a field out of range, a file
  // size other than the fields imply (truncated or extended), a checksum mismatch, non-zero
  // reserved bytes, a token id outside [0, vocab_size), a non-finite logit, query, key or
  // value.
  static KvSnapshot open(const std::string& path);
  KvSnapshot(KvSnapshot&&) noexcept;
  KvSnapshot& operator=(KvSnapshot&&) noexcept;
  ~KvSnapshot();

  const std::string& path() const { return path_; }
  const KvSnapshotInfo& info() const { return info_; }
  size_t file_bytes() const { return size_; }
  uint64_t checksum() const { return checksum_; }

  std::span<const int32_t> tokens() const;  // [n_tokens]
  std::span<const float> logits() const;    // [vocab_size]
  // [prompt_q_rows][n_heads][head_dim] of `layer`.
  std::span<const float> prompt_q(int layer) const;
  // [n_tokens - info().first_token[layer]][n_kv_heads][head_dim] of `layer` in info().dtype:
  // its tokens from first_token on.
  const void* keys(int layer) const;
  const void* values(int layer) const;

  // Throws Error naming the file, the field and both values when the snapshot does not fit
  // `expect`: model_id, setup, n_layers, n_heads, n_kv_heads, head_dim, vocab_size,
  // page_size and dtype must be equal (n_tokens and prompt_q_rows are not compared).
  void check(const KvSnapshotInfo& expect) const;
  // Appends every layer's n_tokens tokens to `kv`, which must be empty and of the
  // snapshot's shape, page size and dtype: afterwards it holds bit for bit what the cache
  // that was saved held for the query at n_tokens, its per-page key statistics included (a
  // sliding-window layer of `kv` gets the tokens before its window counted, not stored).
  // Throws when a layer of `kv` reads tokens the file does not hold (a sliding-window
  // snapshot into a cache that keeps every token).
  void restore(KvCache& kv) const;

 private:
  KvSnapshot() = default;
  struct Mapping;
  std::unique_ptr<Mapping> map_;
  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  uint64_t checksum_ = 0;
  KvSnapshotInfo info_;
  size_t off_tokens_ = 0, off_logits_ = 0, off_prompt_q_ = 0;
  std::vector<size_t> off_kv_;  // [n_layers] each layer's K, then its V
};

}  // namespace cumulus
