// The host's bookkeeping of a two-tier KV page pool (src/kv/tier_slots.cpp; docs/cuda.md
// "Host tier"): slots [0, device_slots) are device memory, [device_slots, device_slots +
// host_slots) host memory; which hold a page, which are free, and the moves that place pages.
// The recency that picks victims lives on the device (kv/cuda_kv_pool.h: each slot's last
// step, least recently used first, ties to the lower slot); these rules pair the pages to
// place with the slots to take, so that no page is lost and no slot moves twice in one list
// of moves. Plain C++, tested on the CPU.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace cumulus {

// The pages in slots a and b exchange slots (b may be free: then the page moves and a becomes
// free). Within one list of moves no slot appears twice, so a list can be applied in any order.
struct PageMove {
  int32_t a = -1;
  int32_t b = -1;
  friend bool operator==(const PageMove&, const PageMove&) = default;
};

class TierSlots {
 public:
  // Throws Error unless device_slots >= 1, host_slots >= 0 and their sum fits int32.
  TierSlots(int64_t device_slots, int64_t host_slots);

  int32_t device_slots() const { return device_slots_; }
  int32_t host_slots() const { return host_slots_; }
  bool on_device(int32_t slot) const { return slot < device_slots_; }
  int64_t free_device() const { return static_cast<int64_t>(free_device_.size()); }
  int64_t free_host() const { return static_cast<int64_t>(free_host_.size()); }
  bool occupied(int32_t slot) const;

  // A free slot of the tier for a new page (the one freed last; at first the lowest), now
  // occupied; -1 when the tier has none.
  int32_t take_device() { return take(free_device_); }
  int32_t take_host() { return take(free_host_); }
  // The page in `slot` is gone. Throws Error for a free or out-of-range slot.
  void release(int32_t slot);

  // Promotions: host pages (slots, in the order given) move to free device slots first, then
  // over the device pages in `victims` (least recently used first), which go to the host
  // slots the promoted pages leave; at most max_promote pages (< 0: as many as there are
  // slots for). Returns the moves (a: the host slot, b: the device slot). Throws Error, before
  // any change, for a candidate that is not an occupied host slot or a victim that is not an
  // occupied device slot, or a slot named twice.
  std::vector<PageMove> promote(std::span<const int32_t> candidates, std::span<const int32_t> victims,
                                int64_t max_promote = -1);
  // Places n new pages: free device slots first, then device slots whose pages (`victims`,
  // least recently used first) move to free host slots, then free host slots. Returns the
  // slots in order and appends the demotions to `moves` (a: the device slot, b: the host
  // slot). Throws Error, before any change, when the pool has fewer than n free slots, or
  // for a bad victim as promote() does.
  std::vector<int32_t> place(int n, std::span<const int32_t> victims, std::vector<PageMove>& moves);

 private:
  int32_t take(std::vector<int32_t>& free);
  void check_slot(int32_t slot, const char* fn) const;
  void check_victims(std::span<const int32_t> victims, const char* fn) const;

  int32_t device_slots_ = 0, host_slots_ = 0;
  std::vector<uint8_t> occupied_;                 // [device_slots + host_slots]
  std::vector<int32_t> free_device_, free_host_;  // stacks, lowest slot on top at first
};

}  // namespace cumulus
