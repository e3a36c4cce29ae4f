// FlexPrefill's block selection (the FlexPrefill paper's "Query-Aware Sparse Pattern Determination" and
// "Cumulative-Attention Based Index Selection", Algorithms 3 and 4) on the host: the
// functions of flexprefill_select.h, which the method (src/methods/flexprefill/flexprefill.cpp) and the
// CUDA port's host half (src/kernels/cuda/prefill.cu) share. docs/methods.md "flexprefill"
// states every step and each deviation from the paper and its reference code.
#include "cumulus/kernels/flexprefill_select.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/check.h"
#include "cumulus/core/dtype.h"

namespace cumulus {
namespace flexprefill {

std::string_view pattern_name(Pattern p) {
  switch (p) {
    case Pattern::dense: return "dense";
    case Pattern::query_aware: return "query_aware";
    case Pattern::vertical_slash: return "vertical_slash";
  }
  return "?";
}

void validate(const Config& c) {
  CUMULUS_CHECK(c.gamma > 0.0 && c.gamma <= 1.0, "flexprefill: gamma={} must be in (0, 1]", c.gamma);
  CUMULUS_CHECK(c.tau >= 0.0 && c.tau <= 1.0, "flexprefill: tau={} must be in [0, 1]", c.tau);
  CUMULUS_CHECK(c.block_size >= 8 && c.block_size <= 4096, "flexprefill: block_size={} must be in [8, 4096]",
                c.block_size);
  CUMULUS_CHECK(c.min_budget >= 0, "flexprefill: min_budget={} must be >= 0", c.min_budget);
  CUMULUS_CHECK(c.max_budget >= 0, "flexprefill: max_budget={} must be >= 0 (0 = no maximum)", c.max_budget);
  CUMULUS_CHECK(c.max_budget == 0 || c.max_budget >= c.min_budget,
                "flexprefill: max_budget={} is below min_budget={} (0 = no maximum)", c.max_budget, c.min_budget);
}

namespace {

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Blocks of the min budget, at least 1, at most n_blocks.
int min_blocks(const Config& c, int n_blocks) { return std::min(n_blocks, std::max(1, ceil_div(c.min_budget, c.block_size))); }

// The fewest entries of x (largest first, ties to the lower index) whose sum reaches gamma:
// appends their indices to `taken` (in no particular order) and returns how many; all n if
// none does. x >= 0. Linear time instead of a full sort: entries are bucketed by the top bits
// of their float64 representation (monotone for x >= 0: 5 mantissa bits, ~3% wide), whole
// buckets are taken from the top while the running sum stays below gamma, and only the
// bucket where it crosses gamma is sorted. The running sum adds whole buckets, so it can
// differ from a sorted-order sum at float64 rounding (a near-exact tie at the cut).
template <class T>
int64_t cover_indices(const T* x, int64_t n, double gamma, std::vector<int64_t>* taken) {
  constexpr int kShift = 47;
  constexpr size_t kBuckets = size_t{1} << (63 - kShift);
  auto key = [](double v) {
    uint64_t u;
    std::memcpy(&u, &v, sizeof u);
    return static_cast<size_t>(u >> kShift);
  };
  std::vector<double> bsum(kBuckets, 0.0);
  std::vector<int64_t> bcnt(kBuckets, 0);
  for (int64_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    const size_t b = key(v);
    bsum[b] += v;
    ++bcnt[b];
  }
  double acc = 0.0;
  int64_t count = 0;
  size_t cross = kBuckets;
  for (size_t b = kBuckets; b-- > 0;) {
    if (bcnt[b] == 0) continue;
    if (acc + bsum[b] >= gamma) {
      cross = b;
      break;
    }
    acc += bsum[b];
    count += bcnt[b];
  }
  std::vector<std::pair<double, int64_t>> edge;
  for (int64_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    const size_t b = key(v);
    if (cross == kBuckets || b > cross) {
      if (taken != nullptr) taken->push_back(i);
    } else if (b == cross) {
      edge.emplace_back(v, i);
    }
  }
  if (cross == kBuckets) return n;
  std::sort(edge.begin(), edge.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  for (const auto& [v, i] : edge) {
    acc += v;
    ++count;
    if (taken != nullptr) taken->push_back(i);
    if (acc >= gamma) break;
  }
  return count;
}

int cover_count(const float* x, int n, double gamma) { return static_cast<int>(cover_indices(x, n, gamma, nullptr)); }

// Index 0 plus the k - 1 largest of score[1..n) (ties to the lower index).
std::vector<int32_t> top_with_first(const std::vector<double>& score, int k) {
  const int n = static_cast<int>(score.size());
  std::vector<int32_t> idx(static_cast<size_t>(n) - 1);
  std::iota(idx.begin(), idx.end(), 1);
  const int take = std::min(k - 1, n - 1);
  std::partial_sort(idx.begin(), idx.begin() + take, idx.end(), [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  idx.resize(static_cast<size_t>(take));
  idx.insert(idx.begin(), 0);
  return idx;
}

// softmax over x [n] in place (float64).
void softmax_inplace(std::vector<double>& x) {
  const double m = *std::max_element(x.begin(), x.end());
  double l = 0.0;
  for (double& v : x) l += (v = std::exp(v - m));
  for (double& v : x) v /= l;
}

double dot(const double* a, const float* b, int n) {
  double s = 0.0;
  for (int j = 0; j < n; ++j) s += a[j] * static_cast<double>(b[j]);
  return s;
}

// Mean of the head's chunk rows [i0, i1): out [head_dim].
void mean_rows(const HeadInputs& in, int i0, int i1, std::vector<double>& out) {
  out.assign(static_cast<size_t>(in.head_dim), 0.0);
  for (int i = i0; i < i1; ++i)
    for (int j = 0; j < in.head_dim; ++j) out[j] += in.q[static_cast<size_t>(i) * in.q_stride + j];
  for (double& v : out) v /= (i1 - i0);
}

// 0 log(0 / m) = 0.
double kl_term(double p, double m) { return p > 0.0 ? p * std::log(p / m) : 0.0; }

}  // namespace

bool selects_everything(const Config& c, const Geometry& g) {
  const int nb = g.n_k_blocks();
  return c.gamma >= 1.0 || nb <= 2 || min_blocks(c, nb) >= nb;
}

HeadSelection select_head(const Config& c, const Geometry& g, const HeadInputs& in) {
  const int B = g.block_size, n = g.n_keys(), nb = g.n_k_blocks();
  const int r0 = g.first_q_block(), nqb = g.n_q_blocks();
  const double scale = 1.0 / std::sqrt(static_cast<double>(in.head_dim));
  HeadSelection sel;
  sel.lists.resize(static_cast<size_t>(nqb));
  if (selects_everything(c, g)) {
    sel.pattern = Pattern::dense;
    for (int r = 0; r < nqb; ++r) {
      sel.lists[r].resize(static_cast<size_t>(r0 + r) + 1);
      std::iota(sel.lists[r].begin(), sel.lists[r].end(), 0);
    }
    sel.n_vertical = sel.n_slash = nb;
    return sel;
  }
  const int L = g.n_rows();

  // The probe's block distribution a^ (sum-pooled, pattern determination) and its slash
  // counterpart:
  // vb[c] = mass on key block c, sb[s] = mass on distances [s B, (s + 1) B).
  std::vector<double> vb(static_cast<size_t>(nb), 0.0), sb(static_cast<size_t>(nb), 0.0);
  for (int j = 0; j < n; ++j) {
    vb[j / B] += in.vertical[j] / L;
    sb[j / B] += in.slash[j] / L;
  }

  // The estimate a-bar = softmax(avgpool(Q^) avgpool(K)^T / sqrt(d)) over every key block.
  std::vector<double> qbar, est(static_cast<size_t>(nb));
  if (in.q_probe_mean != nullptr) {
    qbar.assign(in.q_probe_mean, in.q_probe_mean + in.head_dim);
  } else {
    mean_rows(in, g.n_q - L, g.n_q, qbar);
  }
  for (int b = 0; b < nb; ++b) est[b] = scale * dot(qbar.data(), in.k_block_mean + static_cast<size_t>(b) * in.head_dim, in.head_dim);
  softmax_inplace(est);
  double js = 0.0;
  for (int b = 0; b < nb; ++b) {
    const double m = 0.5 * (est[b] + vb[b]);
    js += 0.5 * kl_term(est[b], m) + 0.5 * kl_term(vb[b], m);
  }
  sel.js_distance = std::sqrt(std::max(0.0, js));
  const bool query_aware = sel.js_distance < c.tau;
  sel.pattern = query_aware ? Pattern::query_aware : Pattern::vertical_slash;

  // Budgets (blocks): from the token-level cover of the probe (Algorithm 3 line 4), clamped
  // to [min, max]; query-aware heads keep only the min budget of each.
  const int kmin = min_blocks(c, nb);
  const int kmax = c.max_budget > 0 ? std::min(nb, std::max(kmin, ceil_div(c.max_budget, B))) : nb;
  auto clamp_budget = [&](int k) { return std::min(kmax, std::max(kmin, k)); };
  if (query_aware) {
    sel.n_vertical = sel.n_slash = kmin;
  } else {
    std::vector<float> norm(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) norm[j] = in.vertical[j] / static_cast<float>(L);
    sel.n_vertical = clamp_budget(cover_count(norm.data(), n, c.gamma) / B + 1);
    for (int j = 0; j < n; ++j) norm[j] = in.slash[j] / static_cast<float>(L);
    sel.n_slash = clamp_budget(cover_count(norm.data(), n, c.gamma) / B + 1);
  }
  const std::vector<int32_t> vertical = top_with_first(vb, sel.n_vertical);
  const std::vector<int32_t> slash = top_with_first(sb, sel.n_slash);

  // Extension to every query block of the chunk: key block c for every c in vertical, key
  // block r - s for every distance s in slash (causal blocks only).
  std::vector<std::vector<uint8_t>> marks(static_cast<size_t>(nqb));
  for (int r = r0; r < r0 + nqb; ++r) {
    auto& m = marks[static_cast<size_t>(r - r0)];
    m.assign(static_cast<size_t>(r) + 1, 0);
    for (int32_t b : vertical)
      if (b <= r) m[b] = 1;
    for (int32_t s : slash)
      if (s <= r) m[r - s] = 1;
    m[0] = m[r] = 1;  // the first block and the diagonal, whatever the budgets
  }

  // Query-aware search (Algorithm 4): pooled queries of every query block of the chunk against
  // pooled keys, a row softmax over the causal key blocks, all pairs flattened and
  // normalised (each row sums to 1, so by the row count), the fewest reaching gamma added.
  if (query_aware) {
    // Pairs in (r, b) order, which is also the tie order: a[i] for pair (pr[i], pb[i]).
    const int D = in.head_dim;
    std::vector<double> kbar(static_cast<size_t>(nb) * D);
    std::copy_n(in.k_block_mean, kbar.size(), kbar.begin());
    const size_t n_pairs = static_cast<size_t>(nqb) * r0 + static_cast<size_t>(nqb) * (nqb + 1) / 2;
    std::vector<double> a;
    std::vector<int32_t> pr, pb;
    a.reserve(n_pairs);
    pr.reserve(n_pairs);
    pb.reserve(n_pairs);
    std::vector<double> row;
    for (int r = r0; r < r0 + nqb; ++r) {
      if (in.q_block_mean != nullptr) {
        const float* m = in.q_block_mean + static_cast<size_t>(r - r0) * D;
        qbar.assign(m, m + D);
      } else {
        mean_rows(in, std::max(g.pos, r * B) - g.pos, std::min(n, (r + 1) * B) - g.pos, qbar);
      }
      row.resize(static_cast<size_t>(r) + 1);
      for (int b = 0; b <= r; ++b) {
        // Four partial sums: independent chains the compiler can keep in one vector register.
        const double* kb = kbar.data() + static_cast<size_t>(b) * D;
        double s4[4] = {0.0, 0.0, 0.0, 0.0};
        int j = 0;
        for (; j + 4 <= D; j += 4)
          for (int u = 0; u < 4; ++u) s4[u] += qbar[j + u] * kb[j + u];
        for (; j < D; ++j) s4[0] += qbar[j] * kb[j];
        row[b] = scale * ((s4[0] + s4[1]) + (s4[2] + s4[3]));
      }
      softmax_inplace(row);
      for (int b = 0; b <= r; ++b) {
        a.push_back(row[b] / nqb);
        pr.push_back(r);
        pb.push_back(b);
      }
    }
    std::vector<int64_t> taken;
    cover_indices(a.data(), static_cast<int64_t>(a.size()), c.gamma, &taken);
    for (const int64_t i : taken) {
      auto& m = marks[static_cast<size_t>(pr[i] - r0)];
      if (!m[pb[i]]) ++sel.n_query_aware;
      m[pb[i]] = 1;
    }
  }
  for (int r = r0; r < r0 + nqb; ++r) {
    const auto& m = marks[static_cast<size_t>(r - r0)];
    for (int b = 0; b <= r; ++b)
      if (m[b]) sel.lists[static_cast<size_t>(r - r0)].push_back(b);
  }
  return sel;
}

void key_block_means(const PagedHeadView& kv, int n_keys, int block_size, bool exact, float* out) {
  const int dim = kv.head_dim;
  const int nb = (n_keys + block_size - 1) / block_size;
  std::vector<double> acc(static_cast<size_t>(dim));
  std::vector<float> row(static_cast<size_t>(dim));
  const bool pages = !exact && kv.kmean != nullptr && block_size % kv.page_size == 0;
  for (int b = 0; b < nb; ++b) {
    std::fill(acc.begin(), acc.end(), 0.0);
    const int t0 = b * block_size, t1 = std::min(n_keys, t0 + block_size);
    if (pages) {
      // Page means weighted by their lengths: pages never straddle a block here.
      for (int p = t0 >> kv.page_shift; p < ((t1 - 1) >> kv.page_shift) + 1; ++p) {
        const int len = std::min(t1, (p + 1) * kv.page_size) - p * kv.page_size;
        const float* m = kv.kmean + static_cast<size_t>(p) * dim;
        for (int j = 0; j < dim; ++j) acc[j] += static_cast<double>(m[j]) * len;
      }
    } else {
      for (int t = t0; t < t1; ++t) {
        convert_to_f32(kv.key(t), kv.dtype, row.data(), static_cast<size_t>(dim));
        for (int j = 0; j < dim; ++j) acc[j] += row[j];
      }
    }
    for (int j = 0; j < dim; ++j) out[static_cast<size_t>(b) * dim + j] = static_cast<float>(acc[j] / (t1 - t0));
  }
}

LayerSelection select_layer(const Config& c, const Geometry& g, const PagedHeadView* kv, int n_kv_heads, int group,
                            const float* q, ThreadPool& pool, bool reference) {
  const int n_q_heads = n_kv_heads * group;
  const int dim = kv[0].head_dim;
  const int n = g.n_keys(), nb = g.n_k_blocks(), L = g.n_rows();
  const size_t q_stride = static_cast<size_t>(n_q_heads) * dim;
  LayerSelection out;
  out.heads.resize(static_cast<size_t>(n_q_heads));
  const bool all = selects_everything(c, g);
  std::vector<float> kmeans;
  if (!all) {
    kmeans.resize(static_cast<size_t>(n_kv_heads) * nb * dim);
    pool.parallel_for(n_kv_heads, [&](int64_t h, int) {
      key_block_means(kv[h], n, g.block_size, reference, kmeans.data() + static_cast<size_t>(h) * nb * dim);
    });
  }
  pool.parallel_for(n_q_heads, [&](int64_t qh, int) {
    const int h = static_cast<int>(qh) / group;
    HeadInputs in;
    in.q = q + static_cast<size_t>(qh) * dim;
    in.q_stride = q_stride;
    in.head_dim = dim;
    std::vector<float> rows, vertical, slash;
    if (!all) {
      rows.resize(static_cast<size_t>(L) * dim);
      for (int i = 0; i < L; ++i)
        std::copy_n(in.q + static_cast<size_t>(g.n_q - L + i) * q_stride, dim, rows.data() + static_cast<size_t>(i) * dim);
      vertical.resize(static_cast<size_t>(n));
      slash.resize(static_cast<size_t>(n));
      PrefillProjectionArgs pa;
      pa.kv = &kv[h];
      pa.n_keys = n;
      pa.scale = 1.0f / std::sqrt(static_cast<float>(dim));  // attention_scale (methods/method.h)
      pa.q = rows.data();
      pa.n_rows = L;
      pa.vertical = vertical.data();
      pa.slash = slash.data();
      if (reference) {
        ref::attention_prefill_projection(pa);
      } else {
        cpu::attention_prefill_projection(pa);
      }
      in.vertical = vertical.data();
      in.slash = slash.data();
      in.k_block_mean = kmeans.data() + static_cast<size_t>(h) * nb * dim;
    }
    out.heads[static_cast<size_t>(qh)] = select_head(c, g, in);
  });
  out.layout = layout_of(g, out.heads);
  return out;
}

BlockSparseLayout layout_of(const Geometry& g, const std::vector<HeadSelection>& heads) {
  BlockSparseLayout lay;
  lay.block_size = g.block_size;
  lay.first_q_block = g.first_q_block();
  lay.n_q_blocks = g.n_q_blocks();
  lay.n_q_heads = static_cast<int>(heads.size());
  lay.offsets.assign(1, 0);
  for (const HeadSelection& s : heads)
    for (const auto& list : s.lists) {
      lay.blocks.insert(lay.blocks.end(), list.begin(), list.end());
      lay.offsets.push_back(static_cast<int32_t>(lay.blocks.size()));
    }
  return lay;
}

}  // namespace flexprefill

}  // namespace cumulus
