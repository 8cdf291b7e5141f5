// JointPlacementPolicy (scheduler/joint_placement.h): the groups' update costs as Note [The update
// costs of a state group] states them, worked out by hand; the room after every parameter chunk; the
// policy puts state on the device when the host update would show and keeps activations when it hides;
// a placement that agrees with its own plan; sharded parameters and unmeasured rates refused.
#include <gtest/gtest.h>

#include <vector>

#include "../../scheduler/joint_placement.h"
#include "../test_util.h"

namespace ferry {
namespace {

// Two groups of 100 parameter bytes and 600 state bytes; room 1000 (800 after the parameters).
PlacementInput two_groups() {
  PlacementInput in;
  in.groups = {{100, 600, true}, {100, 600, true}};
  in.room_bytes = 1000;
  return in;
}

// Two segments of 400 bytes, 0.3 s of recompute each, in a 0.5 s forward and 1.0 s backward.
ActivationCosts two_segments() {
  ActivationCosts c;
  c.segments = {{400, 0.3}, {400, 0.3}};
  c.forward_s = 0.5;
  c.backward_s = 1.0;
  return c;
}

TEST(JointPlacement, GroupCostsFollowTheMovedBytes) {
  const UpdateRates rates{1000.0, 100.0, 10000.0};
  const MemoryPlanInput in = joint_plan_input(two_groups(), two_segments(), rates);
  ASSERT_EQ(in.groups.size(), 2u);
  // host: (2 x 600 + 2 x 100) / 1000; each way of the trip 100 / 100; device: 1400 / 10000
  EXPECT_DOUBLE_EQ(in.groups[0].host_s, 1.4);
  EXPECT_DOUBLE_EQ(in.groups[0].trip_s, 1.0);
  EXPECT_DOUBLE_EQ(in.groups[0].device_s, 0.14);
  EXPECT_EQ(in.groups[0].param_bytes, 100);
  EXPECT_EQ(in.room_bytes, 800);
  EXPECT_EQ(in.segments.size(), 2u);
  PlacementInput accumulate = two_groups();
  accumulate.params_travel = false;  // gradients stay in the state chunks: no round trip
  EXPECT_DOUBLE_EQ(joint_plan_input(accumulate, two_segments(), rates).groups[0].host_s, 1.4);
  EXPECT_DOUBLE_EQ(joint_plan_input(accumulate, two_segments(), rates).groups[0].trip_s, 0.0);
  PlacementInput unlimited = two_groups();
  unlimited.room_bytes = 0;
  EXPECT_EQ(joint_plan_input(unlimited, two_segments(), rates).room_bytes, -1);
}

TEST(JointPlacement, StateGoesToTheDeviceWhenItsHostUpdateShows) {
  // 1.4 s per group and 1 s each way: one group on the device, nothing kept, waits 2.9 - 1.14 s for
  // group 1 (final at 0.5 s, on the host at 1.5 s); both on the host with both segments kept, 4.0 - 0.4.
  const JointPlacementPolicy slow_host(two_segments(), UpdateRates{1000.0, 100.0, 10000.0});
  const Placement p = slow_host.place(two_groups());
  ASSERT_TRUE(slow_host.planned());
  EXPECT_EQ(slow_host.plan().groups_on_device, 1);  // 600 of the 800 bytes; one segment no longer fits
  EXPECT_EQ(p.on_device, (std::vector<char>{1, 0}));
  EXPECT_EQ(p.device_bytes, 600);
  EXPECT_EQ(p.margin_bytes, 800);
  EXPECT_EQ(slow_host.plan().kept(), 0);
}

TEST(JointPlacement, ActivationsKeptWhenTheHostUpdateHides) {
  const JointPlacementPolicy fast_host(two_segments(), UpdateRates{1e9, 1e9, 1e10});
  const Placement p = fast_host.place(two_groups());
  EXPECT_EQ(fast_host.plan().groups_on_device, 0);
  EXPECT_EQ(p.on_device, (std::vector<char>{0, 0}));
  EXPECT_EQ(fast_host.plan().keep, (std::vector<char>{1, 1}));
  EXPECT_LE(fast_host.plan().kept_bytes, 800);
}

TEST(JointPlacement, RefusesWhatItCannotPlan) {
  EXPECT_ERROR_HAS(JointPlacementPolicy(two_segments(), UpdateRates{0.0, 1.0, 1.0}), "needs measured rates > 0");
  const JointPlacementPolicy policy(two_segments(), UpdateRates{1.0, 1.0, 1.0});
  PlacementInput sharded = two_groups();
  sharded.remote_params = true;
  EXPECT_ERROR_HAS(policy.place(sharded), "sharded parameters are placed first-chunks-first");
}

}  // namespace
}  // namespace ferry
