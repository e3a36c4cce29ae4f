// Sums of Algorithm 1's fitted estimates (Tactic, Appendix B) in closed form: the
// estimates past the exactly scored head of a list are w_i = max(0, a / (i + 1) + b) for
// list positions i in [n0, L) (never negative where the curve crosses zero), and the budget
// needs their prefix sums and the first prefix that reaches a target. Over the range
// [s, e) where the curve is positive, sum_{i=lo..hi-1} (a / (i + 1) + b) = a (H(hi) - H(lo))
// + b (hi - lo) with H the harmonic numbers, so a sum costs O(1) and the budget a
// bisection, not a pass over the list (the same values as adding the estimates one by one,
// up to rounding). How the sums are taken is ours; the method is the paper's.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace cumulus {

// h[x] = sum_{m=1..x} 1/m for x in [0, n]; extends h where it is shorter.
inline void tactic_harmonic(std::vector<double>& h, int n) {
  if (h.empty()) h.push_back(0.0);
  while (static_cast<int>(h.size()) <= n) h.push_back(h.back() + 1.0 / static_cast<double>(h.size()));
}

struct TacticFit {
  double a = 0, b = 0;
  int n0 = 0, L = 0;
  int s = 0, e = 0;                  // [s, e): the positions of [n0, L) where a / (i + 1) + b > 0
  const double* harmonic = nullptr;  // tactic_harmonic's table, at least L + 1 entries

  TacticFit(double a_, double b_, int n0_, int L_, const double* h) : a(a_), b(b_), n0(n0_), L(L_), harmonic(h) {
    s = e = n0;
    auto f = [&](int i) { return a / (i + 1) + b; };
    auto clamp_i = [&](double x) {
      return static_cast<int>(std::clamp(x, static_cast<double>(n0), static_cast<double>(L)));
    };
    const double cut = -a / b;  // the curve changes sign at i + 1 = cut
    if (a >= 0 && b >= 0) {
      e = L;
    } else if (a >= 0 && b < 0) {  // decreasing: positive below the cut
      e = clamp_i(std::ceil(cut) - 1);
      while (e > n0 && f(e - 1) <= 0) --e;  // a step or two: the cut's rounding
      while (e < L && f(e) > 0) ++e;
    } else if (a < 0 && b > 0) {  // increasing: positive above the cut
      s = clamp_i(std::floor(cut));
      while (s > n0 && f(s - 1) > 0) --s;
      while (s < L && f(s) <= 0) ++s;
      e = L;
    }  // else (or NaN): never positive
  }
  // The estimates' sum over [n0, m), m in [n0, L].
  double sum(int m) const {
    const int top = std::min(m, e);
    if (top <= s) return 0.0;
    return a * (harmonic[top] - harmonic[s]) + b * (top - s);
  }
  // The smallest m in [n0, L] with known + sum(m) >= target; L when none reaches.
  int first_reaching(double known, double target) const {
    if (known >= target) return n0;
    int lo = n0, hi = L;  // known + sum(lo) < target
    if (known + sum(hi) < target) return L;
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      (known + sum(mid) >= target ? hi : lo) = mid;
    }
    return hi;
  }
};

}  // namespace cumulus
