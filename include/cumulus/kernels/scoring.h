// Scoring ops: how much a query likes a page (Quest's bound, PSA's mean key) or a token.
// Scores are raw dot products, not scaled by 1/sqrt(head_dim).
#pragma once

#include <cstdint>

#include "cumulus/core/shape.h"

namespace cumulus {

namespace ref {
// Quest's upper bound of q.k over page p: sum_j max(q_j * kmin[p][j], q_j * kmax[p][j]).
//   q: [head_dim]; scores: [kv.n_pages()]
void page_score_bound(const PagedHeadView& kv, const float* q, float* scores);
// q . kmean[p]. scores: [kv.n_pages()]
void page_score_mean(const PagedHeadView& kv, const float* q, float* scores);
// The same for n_q queries. q: [n_q][head_dim]; scores: [n_q][kv.n_pages()]
void page_score_mean(const PagedHeadView& kv, const float* q, int n_q, float* scores);
// scores[h][i] = q[h] . k[idx[i]] for h in [0, n_q).
//   q: [n_q][head_dim]; idx: [n] token indices, or nullptr for tokens 0..n-1;
//   scores: [n_q][n]
void token_score(const PagedHeadView& kv, const float* q, int n_q, const int32_t* idx, int n, float* scores);
// Softmax pieces over raw scores x [n]: the largest value (-inf for n = 0), and
// out[i] = exp(scale * x[i] - shift) [n] with their sum (float64) returned.
float score_max(const float* x, int n);
double score_exp(const float* x, int n, float scale, float shift, float* out);
}  // namespace ref

namespace cpu {
void page_score_bound(const PagedHeadView& kv, const float* q, float* scores);
// The bound for n_q queries (a GQA group) in one pass over the page metadata.
//   q: [n_q][head_dim]; scores: [n_q][kv.n_pages()]
void page_score_bound(const PagedHeadView& kv, const float* q, int n_q, float* scores);
void page_score_mean(const PagedHeadView& kv, const float* q, float* scores);
// One pass over the page means for a group (the key rows of token_score's loop).
void page_score_mean(const PagedHeadView& kv, const float* q, int n_q, float* scores);
void token_score(const PagedHeadView& kv, const float* q, int n_q, const int32_t* idx, int n, float* scores);
float score_max(const float* x, int n);
double score_exp(const float* x, int n, float scale, float shift, float* out);
}  // namespace cpu

}  // namespace cumulus
