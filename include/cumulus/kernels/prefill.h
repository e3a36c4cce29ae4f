// Prefill attention ops: a chunk of C query tokens at positions [pos, pos + C) of one layer
// attends causally to a paged cache that holds at least the tokens [0, pos + C):
//   out[i] = softmax_j(scale q_i . k_j) V over the attended keys j <= pos + i.
// Three ops, each with a scalar float64 reference (ref::, never optimised) and a Highway SIMD
// version (cpu::, runtime dispatch):
//   attention_prefill_dense         every key j <= pos + i (flash-style causal attention)
//   attention_prefill_block_sparse  only the key blocks a BlockSparseLayout lists for the
//                                   query's (query head, query block); causal inside them
//   attention_prefill_projection    the causal attention of a chunk's last rows summed onto
//                                   columns (vertical) and diagonals (slash): FlexPrefill's
//                                   pattern probe (FlexPrefill, Algorithm 3 step 1, the true
//                                   distribution a^ of pattern determination)
// cpu:: dense and block-sparse split work into (kv head, query tile) tasks whose count and
// shape depend on the problem alone; every output row is computed by one task in a fixed
// order, so results are bit-identical for any number of threads. With every causal block
// listed, the block-sparse op returns exactly (bit for bit) what the dense op returns.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cumulus/core/buffer.h"
#include "cumulus/core/shape.h"
#include "cumulus/core/thread_pool.h"

namespace cumulus {

// Arguments shared by the dense and block-sparse prefill ops.
//   kv:  [n_kv_heads] views of one layer (same head_dim, dtype, page size), each holding
//        n_tokens >= pos + n_q; keys past pos + n_q - 1 are never read
//   q:   [n_q][n_q_heads][head_dim] float32 (token-major, as a projection writes it);
//        query head qh belongs to kv head qh / group; row i sits at position pos + i
//   out: [n_q][n_q_heads][head_dim] float32
//   lse: optional [n_q][n_q_heads]: log sum_j exp(scale q.k_j) over the attended keys
//        (natural log); -inf (and out = 0) for a query that attends nothing
struct PrefillAttnArgs {
  const PagedHeadView* kv = nullptr;
  int n_kv_heads = 0;
  int group = 1;
  float scale = 0.0f;
  int pos = 0;
  int n_q = 0;
  const float* q = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
};

// Which key blocks each (query head, query block) of a chunk attends. Blocks are aligned to
// absolute positions: block b holds tokens [b * block_size, (b + 1) * block_size), for keys
// and queries alike. The chunk [pos, pos + n_q) covers query blocks
//   first_q_block = pos / block_size .. (pos + n_q - 1) / block_size   (n_q_blocks of them)
// and the list of (query head h, query block first_q_block + r) is
//   blocks[offsets[h * n_q_blocks + r] .. offsets[h * n_q_blocks + r + 1])
// sorted ascending, unique, each in [0, first_q_block + r] (a later key block holds no key a
// query of block r may attend). Inside the listed blocks attention stays causal: the query
// at position p attends the listed tokens j <= p. Lists are per QUERY head (FlexPrefill
// selects per query head); the CPU kernel walks the union of a GQA group's lists so a key
// tile loaded once serves every head of the group that listed it.
struct BlockSparseLayout {
  int block_size = 128;
  int first_q_block = 0;
  int n_q_blocks = 0;
  int n_q_heads = 0;
  std::vector<int32_t> offsets;  // [n_q_heads * n_q_blocks + 1], offsets[0] = 0
  std::vector<int32_t> blocks;   // [offsets.back()]

  std::span<const int32_t> list(int q_head, int r) const {
    const size_t i = static_cast<size_t>(q_head) * n_q_blocks + r;
    return {blocks.data() + offsets[i], static_cast<size_t>(offsets[i + 1] - offsets[i])};
  }
};

// The layout that lists every causal block (what dense attention computes) for a chunk
// [pos, pos + n_q) of n_q_heads query heads.
BlockSparseLayout block_sparse_layout_causal(int pos, int n_q, int n_q_heads, int block_size);

// The last rows of a chunk against their causal prefix, projected (FlexPrefill: the true
// distribution a^ of pattern determination, and Algorithm 3 steps 1-2). One query head:
//   kv:     the query head's kv head; keys [0, n_keys) are used (kv->n_tokens >= n_keys)
//   q:      [n_rows][head_dim] float32, row i at position p_i = n_keys - n_rows + i
//           (1 <= n_rows <= n_keys)
//   A[i][j] = softmax over j <= p_i of scale * q_i . k_j        (each row sums to 1)
//   vertical: [n_keys] out, vertical[j] = sum_i A[i][j]          (column sums)
//   slash:    [n_keys] out, slash[o]    = sum_i A[i][p_i - o]     (o = distance to the
//             query: o = 0 is the diagonal; entries with p_i - o < 0 are absent)
// Both sum to n_rows.
struct PrefillProjectionArgs {
  const PagedHeadView* kv = nullptr;
  int n_keys = 0;
  float scale = 0.0f;
  const float* q = nullptr;
  int n_rows = 0;
  float* vertical = nullptr;
  float* slash = nullptr;
};

namespace ref {
void attention_prefill_dense(const PrefillAttnArgs& a);
void attention_prefill_block_sparse(const PrefillAttnArgs& a, const BlockSparseLayout& layout);
void attention_prefill_projection(const PrefillProjectionArgs& a);
}  // namespace ref

// Scratch of the cpu:: dense and block-sparse ops: the chunk's causal prefix converted to
// float32, [n_kv_heads][2][n_tokens rounded up to 64][head_dim] (at 32K tokens, 268 MB for 8
// kv heads of 128). A caller that runs the ops many times (a Session: every layer of every
// prefill chunk) passes one so the buffer is allocated once, and frees it when it is done
// (the Session after its prefill); a call without one allocates its own and frees it on
// return.
struct PrefillWorkspace {
  AlignedVector<float> prefix;
};

namespace cpu {
void attention_prefill_dense(const PrefillAttnArgs& a, ThreadPool& pool, PrefillWorkspace* workspace = nullptr);
void attention_prefill_block_sparse(const PrefillAttnArgs& a, const BlockSparseLayout& layout, ThreadPool& pool,
                                    PrefillWorkspace* workspace = nullptr);
// Single-threaded (callers run one query head per task).
void attention_prefill_projection(const PrefillProjectionArgs& a);
}  // namespace cpu

// Checks shapes, pointers, positions, non-finite q and (when given) the layout shared by
// every backend; throws Error naming the bad value.
void attention_prefill_validate(const PrefillAttnArgs& a, const BlockSparseLayout* layout);
void attention_prefill_projection_validate(const PrefillProjectionArgs& a);

}  // namespace cumulus
