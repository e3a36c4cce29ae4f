// The two-tier pool's slot bookkeeping and placement rules (kv/tier_slots.h).
#include "cumulus/kv/tier_slots.h"

#include <algorithm>
#include <limits>

#include "core/check.h"

namespace cumulus {

TierSlots::TierSlots(int64_t device_slots, int64_t host_slots) {
  CUMULUS_CHECK(device_slots >= 1, "TierSlots: device_slots={} must be >= 1", device_slots);
  CUMULUS_CHECK(host_slots >= 0, "TierSlots: host_slots={} must be >= 0", host_slots);
  CUMULUS_CHECK(device_slots + host_slots <= std::numeric_limits<int32_t>::max(),
                "TierSlots: {} device + {} host slots exceed int32", device_slots, host_slots);
  device_slots_ = static_cast<int32_t>(device_slots);
  host_slots_ = static_cast<int32_t>(host_slots);
  occupied_.assign(static_cast<size_t>(device_slots_) + host_slots_, 0);
  free_device_.resize(device_slots_);
  for (int32_t i = 0; i < device_slots_; ++i) free_device_[i] = device_slots_ - 1 - i;
  free_host_.resize(host_slots_);
  for (int32_t i = 0; i < host_slots_; ++i) free_host_[i] = device_slots_ + host_slots_ - 1 - i;
}

void TierSlots::check_slot(int32_t slot, const char* fn) const {
  CUMULUS_CHECK(slot >= 0 && slot < device_slots_ + host_slots_, "TierSlots::{}: slot {} is not in [0, {})", fn, slot,
                device_slots_ + host_slots_);
}

bool TierSlots::occupied(int32_t slot) const {
  check_slot(slot, "occupied");
  return occupied_[slot] != 0;
}

int32_t TierSlots::take(std::vector<int32_t>& free) {
  if (free.empty()) return -1;
  const int32_t s = free.back();
  free.pop_back();
  occupied_[s] = 1;
  return s;
}

void TierSlots::release(int32_t slot) {
  check_slot(slot, "release");
  CUMULUS_CHECK(occupied_[slot] != 0, "TierSlots::release: slot {} is free", slot);
  occupied_[slot] = 0;
  (on_device(slot) ? free_device_ : free_host_).push_back(slot);
}

void TierSlots::check_victims(std::span<const int32_t> victims, const char* fn) const {
  for (const int32_t v : victims) {
    check_slot(v, fn);
    CUMULUS_CHECK(on_device(v) && occupied_[v] != 0, "TierSlots::{}: victim {} is not an occupied device slot", fn, v);
  }
  std::vector<int32_t> s(victims.begin(), victims.end());
  std::sort(s.begin(), s.end());
  const auto dup = std::adjacent_find(s.begin(), s.end());
  CUMULUS_CHECK(dup == s.end(), "TierSlots::{}: victim {} is named twice", fn, dup == s.end() ? 0 : *dup);
}

std::vector<PageMove> TierSlots::promote(std::span<const int32_t> candidates, std::span<const int32_t> victims,
                                         int64_t max_promote) {
  for (const int32_t c : candidates) {
    check_slot(c, "promote");
    CUMULUS_CHECK(!on_device(c) && occupied_[c] != 0, "TierSlots::promote: candidate {} is not an occupied host slot",
                  c);
  }
  std::vector<int32_t> s(candidates.begin(), candidates.end());
  std::sort(s.begin(), s.end());
  const auto dup = std::adjacent_find(s.begin(), s.end());
  CUMULUS_CHECK(dup == s.end(), "TierSlots::promote: candidate {} is named twice", dup == s.end() ? 0 : *dup);
  check_victims(victims, "promote");
  std::vector<PageMove> moves;
  size_t next_victim = 0;
  for (const int32_t h : candidates) {
    if (max_promote >= 0 && static_cast<int64_t>(moves.size()) >= max_promote) break;
    int32_t d = take_device();
    if (d >= 0) {
      occupied_[h] = 0;  // the host slot empties
      free_host_.push_back(h);
    } else if (next_victim < victims.size()) {
      d = victims[next_victim++];  // its page takes the host slot h
    } else {
      break;
    }
    moves.push_back({h, d});
  }
  return moves;
}

std::vector<int32_t> TierSlots::place(int n, std::span<const int32_t> victims, std::vector<PageMove>& moves) {
  CUMULUS_CHECK(n >= 0, "TierSlots::place: n={} must be >= 0", n);
  CUMULUS_CHECK(n <= free_device() + free_host(),
                "TierSlots::place: {} pages asked for, the pool has {} free ({} on the device, {} on the host)", n,
                free_device() + free_host(), free_device(), free_host());
  check_victims(victims, "place");
  std::vector<int32_t> r;
  r.reserve(n);
  size_t next_victim = 0;
  for (int i = 0; i < n; ++i) {
    int32_t s = take_device();
    if (s < 0 && next_victim < victims.size() && free_host() > 0) {
      s = victims[next_victim++];
      moves.push_back({s, take_host()});  // the victim's page goes to the host; s is the new page's
    }
    if (s < 0) s = take_host();
    r.push_back(s);
  }
  return r;
}

}  // namespace cumulus
