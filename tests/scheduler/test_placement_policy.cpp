// PlacementPolicy (scheduler/placement_policy.h): first-chunks-first against placements worked out by hand
// for several rooms (no limit, room for all, a group that does not fit ending the placement, a negative
// margin) and against a brute force over every prefix of random inputs; groups not held here skipped; the
// fixed count; host_cache_bytes_for with and without travelling and remote parameters and round-trip
// slots; and place_state() with a real Scheduler on the simulated device, which fills in the room and
// makes it on the device, or throws changing nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../../chunk/chunk_store.h"
#include "../../scheduler/memory_probe.h"
#include "../../scheduler/opt_policy.h"
#include "../../scheduler/placement_policy.h"
#include "../../scheduler/scheduler.h"
#include "../test_util.h"

namespace ferry {
namespace {

// Groups in layout order: {param_bytes, state_bytes, held}.
PlacementInput input(const std::vector<StateGroup>& groups, int64_t room) {
  PlacementInput in;
  in.groups = groups;
  in.room_bytes = room;
  return in;
}

struct Expected {
  std::vector<char> on_device;
  int64_t device_bytes;
  int64_t margin_bytes;
};
void expect_placement(const Placement& got, const Expected& want, const std::string& what) {
  EXPECT_EQ(got.on_device, want.on_device) << what;
  EXPECT_EQ(got.device_bytes, want.device_bytes) << what;
  EXPECT_EQ(got.margin_bytes, want.margin_bytes) << what;
  EXPECT_EQ(got.count(), std::count(want.on_device.begin(), want.on_device.end(), 1)) << what;
}

TEST(PlacementPolicy, FirstChunksFirstAsWorkedOutByHand) {
  const auto policy = make_first_chunks_first_policy();
  EXPECT_EQ(policy->name(), "first chunks first");
  // Parameters 350 B in all; states 300, 300, 150, 300.
  const std::vector<StateGroup> groups = {{100, 300}, {100, 300}, {50, 150}, {100, 300}};
  struct Case {
    int64_t room;
    Expected want;
  };
  const Case cases[] = {
      {0, {{1, 1, 1, 1}, 1050, -1}},       // no limit: everything, no margin computed
      {1400, {{1, 1, 1, 1}, 1050, 1050}},  // margin 1050: exactly all
      {1399, {{1, 1, 1, 0}, 750, 1049}},   // the last no longer fits
      {1000, {{1, 1, 0, 0}, 600, 650}},    // 300 + 300 <= 650 < 750
      {650, {{1, 0, 0, 0}, 300, 300}},     // margin 300: the first exactly
      {649, {{0, 0, 0, 0}, 0, 299}},       // not even the first
      {200, {{0, 0, 0, 0}, 0, -150}},      // the parameters alone do not fit: a negative margin
  };
  for (const Case& c : cases) {
    expect_placement(policy->place(input(groups, c.room)), c.want, "room " + std::to_string(c.room));
  }
  // The first group that does not fit ends the placement, although a later, smaller one would fit: the
  // state of the last chunks is the host's (Note [Which state goes to the device]).
  expect_placement(policy->place(input({{100, 300}, {100, 400}, {100, 100}}, 900)), {{1, 0, 0}, 300, 600},
                   "a small group after one that does not fit");
}

TEST(PlacementPolicy, GroupsNotHeldHereAreSkipped) {
  const auto policy = make_first_chunks_first_policy();
  // Group 0 is another rank's: skipped, its parameters still count against the room.
  const std::vector<StateGroup> groups = {{100, 300, false}, {100, 300}, {100, 300}, {100, 300, false}};
  expect_placement(policy->place(input(groups, 0)), {{0, 1, 1, 0}, 600, -1}, "no limit");
  expect_placement(policy->place(input(groups, 1000)), {{0, 1, 1, 0}, 600, 600}, "room 1000");
  expect_placement(policy->place(input(groups, 999)), {{0, 1, 0, 0}, 300, 599}, "room 999");
}

TEST(PlacementPolicy, FixedCountTakesTheFirstHeldGroupsWhateverTheRoom) {
  const std::vector<StateGroup> groups = {{100, 300, false}, {100, 300}, {50, 150}, {100, 300}};
  EXPECT_EQ(make_fixed_count_policy(2)->name(), "fixed count 2");
  expect_placement(make_fixed_count_policy(2)->place(input(groups, 1)), {{0, 1, 1, 0}, 450, -1}, "2 of 3 held");
  expect_placement(make_fixed_count_policy(0)->place(input(groups, 0)), {{0, 0, 0, 0}, 0, -1}, "none");
  expect_placement(make_fixed_count_policy(10)->place(input(groups, 0)), {{0, 1, 1, 1}, 750, -1}, "more than held");
  const std::string err = test::error_of([] { make_fixed_count_policy(-1); });
  EXPECT_NE(err.find("a fixed count of device state groups must be >= 0, got -1"), std::string::npos) << err;
}

// Brute force: every prefix of the held groups, the longest whose state fits in room - all parameters.
TEST(PlacementPolicy, FirstChunksFirstIsTheLongestPrefixThatFits) {
  std::mt19937 rng(53);
  const auto policy = make_first_chunks_first_policy();
  for (int round = 0; round < 500; ++round) {
    std::vector<StateGroup> groups(1 + rng() % 8);
    int64_t params = 0;
    for (StateGroup& g : groups) {
      g.param_bytes = 1 + rng() % 100;
      g.state_bytes = 1 + rng() % 300;
      g.held = rng() % 4 != 0;
      params += g.param_bytes;
    }
    const int64_t room = 1 + static_cast<int64_t>(rng() % 2000);
    std::vector<int64_t> held;  // indices of the held groups, in order
    for (size_t g = 0; g < groups.size(); ++g) {
      if (groups[g].held) held.push_back(static_cast<int64_t>(g));
    }
    Expected want{std::vector<char>(groups.size(), 0), 0, room - params};
    for (size_t k = held.size(); k > 0; --k) {
      int64_t bytes = 0;
      for (size_t i = 0; i < k; ++i) bytes += groups[held[i]].state_bytes;
      if (bytes > room - params) continue;
      for (size_t i = 0; i < k; ++i) want.on_device[held[i]] = 1;
      want.device_bytes = bytes;
      break;
    }
    expect_placement(policy->place(input(groups, room)), want, "round " + std::to_string(round));
  }
}

TEST(PlacementPolicy, HostCacheBytesForTheTravellingParameterChunks) {
  // Held groups off the device travel; the cache holds them plus the largest parameter chunk.
  PlacementInput in = input({{100, 300}, {200, 600}, {50, 150}}, 0);
  Placement p;
  p.on_device = {1, 0, 0};
  EXPECT_EQ(host_cache_bytes_for(in, p), 200 + 50 + 200);
  p.on_device = {1, 1, 1};
  EXPECT_EQ(host_cache_bytes_for(in, p), 0) << "nothing travels";
  in.params_travel = false;  // accumulation keeps its gradients in state chunks
  p.on_device = {0, 0, 0};
  EXPECT_EQ(host_cache_bytes_for(in, p), 0);
  // A group not held here: its parameters travel only when sharded parameters are fetched every step.
  in = input({{100, 300}, {200, 600, false}, {50, 150}}, 0);
  p.on_device = {1, 0, 0};
  EXPECT_EQ(host_cache_bytes_for(in, p), 50 + 200) << "without remote parameters: group 2 only";
  in.remote_params = true;
  EXPECT_EQ(host_cache_bytes_for(in, p), 50 + 200 + 200) << "with them: group 1's too";
  // Round trips through K buffers (D84): K of the largest parameter chunk at most.
  in = input({{100, 300}, {200, 600}, {50, 150}, {100, 300}}, 0);
  p.on_device = {0, 0, 0, 0};
  EXPECT_EQ(host_cache_bytes_for(in, p), 450 + 200);
  in.round_trip_slots = 2;
  EXPECT_EQ(host_cache_bytes_for(in, p), 2 * 200);
  in.round_trip_slots = 8;
  EXPECT_EQ(host_cache_bytes_for(in, p), 450 + 200) << "more slots than travel: as without them";
}

// A policy that answers as first-chunks-first and keeps the input it was asked with.
class Recording final : public PlacementPolicy {
 public:
  std::string name() const override { return "recording"; }
  Placement place(const PlacementInput& in) const override {
    asked = in;
    return inner->place(in);
  }
  mutable PlacementInput asked;
  std::unique_ptr<PlacementPolicy> inner = make_first_chunks_first_policy();
};

// Four 100 B parameter chunks on the simulated device, a device budget of 300 B, three chunks resident;
// `warm_up`: one iteration using each once (the trace: the largest chunk and the non-model peak known).
struct SchedulerFixture {
  explicit SchedulerFixture(bool warm_up) {
    ChunkStoreOptions o;
    o.device = DeviceKind::kSimulated;
    o.device_budget_bytes = 300;
    auto policy = std::make_shared<OptEvictionPolicy>();
    o.policy = policy;
    store = std::make_unique<ChunkStore>(o);
    std::vector<TensorId> tensors;
    std::vector<ChunkId> chunks;
    for (int i = 0; i < 4; ++i) {
      chunks.push_back(store->add_chunk(ChunkRole::kParam, at::kFloat, 25, Location::kHost));
      tensors.push_back(store->add_tensor(chunks.back(), 0, {25}));
    }
    for (int i = 0; i < 3; ++i) store->move(chunks[i], Location::kDevice);
    SchedulerOptions so;
    so.device_budget_bytes = 300;
    scheduler = std::make_unique<Scheduler>(*store, policy, make_memory_probe(DeviceKind::kSimulated), so, tensors,
                                            chunks);
    if (!warm_up) return;
    scheduler->begin_iteration();
    for (int64_t p = 0; p < 4; ++p) {
      scheduler->pre_use(p);
      scheduler->post_use(p, TensorState::kHoldAfterFwd);
    }
    scheduler->end_iteration();
  }
  std::unique_ptr<ChunkStore> store;
  std::unique_ptr<Scheduler> scheduler;
};

TEST(PlacementPolicy, PlaceStateFillsTheRoomAndMakesItOnTheDevice) {
  Recording policy;
  {  // before any trace: the non-model peak is unknown
    SchedulerFixture f(/*warm_up=*/false);
    place_state(*f.scheduler, policy, input({{25, 50}}, 0));
    EXPECT_EQ(policy.asked.non_model_peak_bytes, -1) << "no trace yet";
  }
  SchedulerFixture f(/*warm_up=*/true);
  ASSERT_GE(f.scheduler->non_model_peak(), 0);
  // Parameters 100 B in all (the input's, not the store's), states 50 B each: margin 200, all four fit.
  const Placement placed = place_state(*f.scheduler, policy, input({{25, 50}, {25, 50}, {25, 50}, {25, 50}}, 12345));
  EXPECT_EQ(policy.asked.room_bytes, 300) << "the scheduler's room (its budget: no capacity known), not the input's";
  EXPECT_EQ(policy.asked.non_model_peak_bytes, f.scheduler->non_model_peak());
  expect_placement(placed, {{1, 1, 1, 1}, 200, 200}, "room 300");
  EXPECT_EQ(placed.host_cache_bytes, 0) << "nothing travels";
  EXPECT_EQ(f.store->stats().device.budget_bytes, 100) << "the parameter chunks get what the state leaves";
  EXPECT_LE(f.store->stats().device.current_bytes, 100) << "evicted down to it";
  // Part of the state on the host: the host cache is sized for the travelling chunks.
  SchedulerFixture g(/*warm_up=*/true);
  const Placement some = place_state(*g.scheduler, policy, input({{25, 50}, {25, 160}, {25, 50}, {25, 50}}, 0));
  expect_placement(some, {{1, 0, 0, 0}, 50, 200}, "room 300, a large second group");
  EXPECT_EQ(some.host_cache_bytes, 3 * 25 + 25);
  EXPECT_EQ(g.store->stats().device.budget_bytes, 250);
}

TEST(PlacementPolicy, PlaceStateThatLeavesLessThanAChunkThrowsChangingNothing) {
  SchedulerFixture f(/*warm_up=*/true);
  const int64_t resident = f.store->stats().device.current_bytes;
  const auto all = make_fixed_count_policy(4);
  const std::string err =
      test::error_of([&] { place_state(*f.scheduler, *all, input({{25, 60}, {25, 60}, {25, 60}, {25, 60}}, 0)); });
  EXPECT_NE(err.find("would leave"), std::string::npos) << err;
  EXPECT_NE(err.find("less than the largest chunk"), std::string::npos) << err;
  EXPECT_EQ(f.store->stats().device.budget_bytes, 300) << "unchanged";
  EXPECT_EQ(f.store->stats().device.current_bytes, resident) << "nothing evicted";
}

}  // namespace
}  // namespace ferry
