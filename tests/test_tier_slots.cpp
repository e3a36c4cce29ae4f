// The host tier's slot bookkeeping (kv/tier_slots.h), on the CPU: hand-worked placements and
// promotions whose every slot follows from the rules (free device slots first, then the
// victims in the order given, then host slots); a long random run in which every page's
// contents are followed through the moves, so no page is lost, no slot moves twice in one
// list and occupancy always matches the contents; the limits; and bad input. Which pages are
// least recently used is the device's to say (kv/cuda_kv_pool.h), tested on the GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "cumulus/core/error.h"
#include "cumulus/kv/tier_slots.h"
#include "kernel_check.h"

using namespace cumulus;

namespace {

using check::expect_error;

// Applies one list of moves to slot contents (labels; 0 = empty).
void apply_moves(std::vector<int>& data, const std::vector<PageMove>& moves) {
  std::vector<int32_t> seen;
  for (const PageMove& m : moves) {
    seen.push_back(m.a);
    seen.push_back(m.b);
    std::swap(data[m.a], data[m.b]);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "a slot moved twice in one list";
}

TEST(TierSlots, HandWorkedPlacementAndPromotion) {
  // 3 device slots (0-2) and 3 host slots (3-5).
  TierSlots t(3, 3);
  std::vector<PageMove> mv;
  EXPECT_EQ(t.place(2, {}, mv), (std::vector<int32_t>{0, 1}));  // free device slots, lowest first
  EXPECT_TRUE(mv.empty());
  // Three more with victim 1: slot 2 is free; then 1's page goes to host slot 3 and the new
  // page takes 1; the last goes to host slot 4 (no victim left).
  EXPECT_EQ(t.place(3, std::vector<int32_t>{1}, mv), (std::vector<int32_t>{2, 1, 4}));
  EXPECT_EQ(mv, (std::vector<PageMove>{{1, 3}}));
  EXPECT_EQ(t.free_device(), 0);
  EXPECT_EQ(t.free_host(), 1);
  // Host pages 4 and 3 are promoted over victims 2 then 0 (in the order given), at most 1.
  EXPECT_EQ(t.promote(std::vector<int32_t>{4, 3}, std::vector<int32_t>{2, 0}, 1), (std::vector<PageMove>{{4, 2}}));
  // Slot 0's page is dropped: a free device slot is used before any victim.
  t.release(0);
  EXPECT_EQ(t.promote(std::vector<int32_t>{3, 4}, std::vector<int32_t>{1}), (std::vector<PageMove>{{3, 0}, {4, 1}}));
  EXPECT_FALSE(t.occupied(3));  // it left for the free slot 0
  EXPECT_TRUE(t.occupied(4));   // 1's page came here
  EXPECT_EQ(t.free_host(), 2);
  // No slot for a candidate when there is neither a free device slot nor a victim.
  EXPECT_TRUE(t.promote(std::vector<int32_t>{4}, {}).empty());
  expect_error([&] { t.place(3, {}, mv); }, "the pool has 2 free (0 on the device, 2 on the host)");
}

TEST(TierSlots, RandomRunFollowsEveryPage) {
  constexpr int D = 16, H = 24;
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    std::mt19937 rng(seed);
    TierSlots t(D, H);
    std::vector<int> data(D + H, 0);
    std::map<int, int32_t> where;  // page label -> slot
    int next = 1;
    auto occupied_device = [&] {
      std::vector<int32_t> v;
      for (int32_t s = 0; s < D; ++s)
        if (data[s] != 0) v.push_back(s);
      std::shuffle(v.begin(), v.end(), rng);
      v.resize(std::min<size_t>(v.size(), rng() % 6));
      return v;
    };
    for (int op = 0; op < 4000; ++op) {
      const int kind = static_cast<int>(rng() % 10);
      std::vector<PageMove> mv;
      if (kind < 3) {
        const int n = std::min<int>(static_cast<int>(rng() % 4), static_cast<int>(t.free_device() + t.free_host()));
        const bool device_free = t.free_device() > 0;
        const std::vector<int32_t> victims = occupied_device();
        const std::vector<int32_t> slots = t.place(n, victims, mv);
        apply_moves(data, mv);
        for (const PageMove& m : mv) {
          EXPECT_LT(m.a, D);
          EXPECT_GE(m.b, D);
          EXPECT_NE(std::find(victims.begin(), victims.end(), m.a), victims.end());
        }
        if (device_free && n > 0) {
          EXPECT_LT(slots[0], D);
          EXPECT_TRUE(mv.empty() || mv[0].a != slots[0]);
        }
        for (const int32_t s : slots) {
          EXPECT_EQ(data[s], 0) << "placed a page over a page";
          data[s] = next++;
        }
      } else if (kind < 4 && !where.empty()) {
        auto it = where.begin();
        std::advance(it, rng() % where.size());
        t.release(it->second);
        data[it->second] = 0;
      } else {
        std::vector<int32_t> cands;
        for (int32_t s = D; s < D + H; ++s)
          if (data[s] != 0 && rng() % 3 == 0) cands.push_back(s);
        const std::vector<int32_t> victims = occupied_device();
        const int64_t limit = rng() % 2 ? -1 : static_cast<int64_t>(rng() % 3);
        const int64_t free_dev = t.free_device();
        const std::vector<int> before = data;
        mv = t.promote(cands, victims, limit);
        const int64_t room = free_dev + static_cast<int64_t>(victims.size());
        int64_t expect = std::min<int64_t>(static_cast<int64_t>(cands.size()), room);
        if (limit >= 0) expect = std::min(expect, limit);
        EXPECT_EQ(static_cast<int64_t>(mv.size()), expect);
        for (size_t i = 0; i < mv.size(); ++i) {
          EXPECT_EQ(mv[i].a, cands[i]);  // in the order given
          EXPECT_LT(mv[i].b, D);
          // Free device slots first, then the victims in order.
          if (static_cast<int64_t>(i) < free_dev) {
            EXPECT_EQ(before[mv[i].b], 0);
          } else {
            EXPECT_EQ(mv[i].b, victims[i - free_dev]);
          }
        }
        apply_moves(data, mv);
      }
      where.clear();
      for (int32_t s = 0; s < D + H; ++s) {
        ASSERT_EQ(t.occupied(s), data[s] != 0) << "seed " << seed << " op " << op << " slot " << s;
        if (data[s] != 0) {
          ASSERT_TRUE(where.emplace(data[s], s).second) << "page " << data[s] << " in two slots";
        }
      }
      int64_t free_d = 0, free_h = 0;
      for (int32_t s = 0; s < D + H; ++s)
        if (data[s] == 0) ++(s < D ? free_d : free_h);
      ASSERT_EQ(t.free_device(), free_d);
      ASSERT_EQ(t.free_host(), free_h);
    }
  }
}

TEST(TierSlots, BadInput) {
  expect_error([] { TierSlots(0, 4); }, "device_slots=0");
  expect_error([] { TierSlots(4, -1); }, "host_slots=-1");
  expect_error([] { TierSlots(int64_t{1} << 31, 1); }, "exceed int32");
  TierSlots t(2, 2);
  std::vector<PageMove> mv;
  expect_error([&] { t.release(1); }, "slot 1 is free");
  expect_error([&] { t.release(4); }, "slot 4 is not in [0, 4)");
  t.place(3, {}, mv);  // slots 0, 1, 2
  expect_error([&] { t.promote(std::vector<int32_t>{0}, {}); }, "candidate 0 is not an occupied host slot");
  expect_error([&] { t.promote(std::vector<int32_t>{3}, {}); }, "candidate 3 is not an occupied host slot");
  expect_error([&] { t.promote(std::vector<int32_t>{2, 2}, {}); }, "candidate 2 is named twice");
  expect_error([&] { t.promote(std::vector<int32_t>{2}, std::vector<int32_t>{2}); }, "victim 2 is not");
  expect_error([&] { t.promote(std::vector<int32_t>{2}, std::vector<int32_t>{1, 1}); }, "victim 1 is named twice");
  expect_error([&] { t.place(-1, {}, mv); }, "n=-1");
  EXPECT_EQ(t.free_host(), 1);  // the refusals changed nothing
}

}  // namespace
