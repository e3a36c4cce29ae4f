// The rules of a step's op sequence (kernels/select_ops.h), checked the same way by every
// backend before it does any work for an op: scores before a choice, a choice of the
// current scores before marking it, a mass (choice or claim) only over token scores, k >= 1,
// p in (0, 1], ends >= 0. Errors name the backend (or method), the op and the value.
// Internal to the kernels layer; plain C++ (the CUDA backend includes it too).
#pragma once

#include <string>

#include "core/check.h"

namespace cumulus::kernels {

class SelectOpsCheck {
 public:
  enum class Units { kNone, kTokens, kPages };

  explicit SelectOpsCheck(std::string who) : who_(std::move(who)) {}
  // A new step: no scores, nothing chosen.
  void begin() { units_ = chosen_ = Units::kNone; }
  Units units() const { return units_; }

  void score(Units u) {
    units_ = u;
    chosen_ = Units::kNone;  // a choice belongs to the scores it was made from
  }
  void choose_topk(int k) {
    CUMULUS_CHECK(units_ != Units::kNone, "{}: choose_topk before any scores", who_);
    CUMULUS_CHECK(k >= 1, "{}: choose_topk k={} must be >= 1", who_, k);
    chosen_ = units_;
  }
  void choose_top_mass(double p) {
    CUMULUS_CHECK(units_ == Units::kTokens, "{}: choose_top_mass needs token scores", who_);
    CUMULUS_CHECK(p > 0 && p <= 1, "{}: choose_top_mass p={} must be in (0, 1]", who_, p);
    chosen_ = units_;
  }
  void mark_chosen(bool claim_mass) {
    CUMULUS_CHECK(units_ != Units::kNone, "{}: mark_chosen before any scores", who_);
    CUMULUS_CHECK(!claim_mass || units_ == Units::kTokens, "{}: a mass claim needs token scores", who_);
    CUMULUS_CHECK(chosen_ == units_,
                  "{}: mark_chosen before a choice (choose_topk or choose_top_mass) of the current scores", who_);
  }
  void mark_ends(int head, int tail) const {
    CUMULUS_CHECK(head >= 0 && tail >= 0, "{}: mark_ends head={}, tail={} must be >= 0", who_, head, tail);
  }

 private:
  std::string who_;
  Units units_ = Units::kNone, chosen_ = Units::kNone;
};

}  // namespace cumulus::kernels
