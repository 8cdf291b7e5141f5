// The memory plan (scheduler/memory_plan.h): the exact solver against a brute force over every set of
// kept segments and every count of device state groups, on many random small instances (up to 12
// segments, up to 6 groups, random rooms); the plan never exceeds the room; the bounded heuristic
// (forced by a front of one entry) within its stated bound and saving at least half the optimum's;
// the joint trade-off worked out by hand both ways (state on the device beats kept activations, and the
// reverse); the step-time model; bad input refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "../../scheduler/memory_plan.h"
#include "../test_util.h"

namespace ferry {
namespace {

struct Best {
  double t = std::numeric_limits<double>::infinity();
  double saved_s = 0;
};

int64_t held_count(const MemoryPlanInput& in) {
  int64_t n = 0;
  for (const GroupCost& g : in.groups) n += g.held ? 1 : 0;
  return n;
}

// Every subset of segments, every prefix of held groups, within the room.
Best brute_force(const MemoryPlanInput& in) {
  Best best;
  const size_t n = in.segments.size();
  for (uint32_t mask = 0; mask < (1u << n); ++mask) {
    std::vector<char> keep(n);
    bool ok = true;
    for (size_t k = 0; k < n; ++k) {
      keep[k] = static_cast<char>((mask >> k) & 1u);
      if (keep[k] != 0 && in.segments[k].saved_bytes < 0) ok = false;  // unmeasured: recomputed
    }
    if (!ok) continue;
    for (int64_t m = 0; m <= held_count(in); ++m) {
      if (in.room_bytes >= 0 && planned_device_bytes(in, keep, m) > in.room_bytes) continue;
      best.t = std::min(best.t, predicted_step_s(in, keep, m));
    }
  }
  return best;
}

MemoryPlanInput random_input(std::mt19937& rng) {
  std::uniform_int_distribution<int> nseg(0, 12), ngroups(0, 6), kind(0, 9);
  std::uniform_int_distribution<int64_t> bytes(0, 1000);
  std::uniform_real_distribution<double> secs(0.0, 1.0);
  MemoryPlanInput in;
  double recompute = 0;
  const int n = nseg(rng);
  const bool identical = kind(rng) < 3;  // a transformer's blocks: the same costs
  const SegmentCost block{bytes(rng), secs(rng)};
  for (int k = 0; k < n; ++k) {
    SegmentCost s = identical ? block : SegmentCost{bytes(rng), secs(rng)};
    if (kind(rng) == 0) s.saved_bytes = -1;  // not measured
    if (kind(rng) == 1) s.recompute_s = 0;
    if (s.saved_bytes >= 0) recompute += s.recompute_s;
    in.segments.push_back(s);
  }
  const int g = ngroups(rng);
  for (int i = 0; i < g; ++i) in.groups.push_back({bytes(rng), 2 * secs(rng), 0.1 * secs(rng), kind(rng) != 0});
  in.forward_s = secs(rng);
  in.backward_s = recompute + secs(rng);
  in.host_behind_forward = kind(rng) < 5;
  in.room_bytes = kind(rng) == 0 ? -1 : bytes(rng) * 4;
  return in;
}

TEST(MemoryPlan, ExactSolverMatchesBruteForceAndStaysWithinRoom) {
  std::mt19937 rng(20261127);
  for (int trial = 0; trial < 600; ++trial) {
    const MemoryPlanInput in = random_input(rng);
    const MemoryPlan plan = plan_memory(in);
    const Best want = brute_force(in);
    ASSERT_TRUE(plan.exact) << "trial " << trial;
    EXPECT_NEAR(plan.predicted_step_s, want.t, 1e-9) << "trial " << trial;
    EXPECT_DOUBLE_EQ(plan.predicted_step_s, predicted_step_s(in, plan.keep, plan.groups_on_device)) << "trial " << trial;
    EXPECT_EQ(plan.bound_s, plan.predicted_step_s);
    const int64_t used = planned_device_bytes(in, plan.keep, plan.groups_on_device);
    EXPECT_EQ(used, plan.kept_bytes + plan.state_device_bytes) << "trial " << trial;
    if (in.room_bytes >= 0) {
      EXPECT_LE(used, in.room_bytes) << "trial " << trial;
    }
    for (size_t k = 0; k < in.segments.size(); ++k) {
      if (in.segments[k].saved_bytes < 0) {
        EXPECT_EQ(plan.keep[k], 0) << "trial " << trial << ": unmeasured kept";
      }
    }
  }
}

TEST(MemoryPlan, HeuristicStaysWithinItsBound) {
  std::mt19937 rng(7);
  MemoryPlanOptions tiny;
  tiny.max_front = 1;  // every instance with a segment worth keeping falls to the heuristic
  int heuristic = 0;
  for (int trial = 0; trial < 600; ++trial) {
    MemoryPlanInput in = random_input(rng);
    in.groups.clear();  // segments only: the saving is then the knapsack's, comparable to the optimum's
    in.host_behind_forward = false;
    const MemoryPlan plan = plan_memory(in, tiny);
    const Best want = brute_force(in);
    if (in.room_bytes >= 0) {
      EXPECT_LE(plan.kept_bytes, in.room_bytes) << "trial " << trial;
    }
    EXPECT_GE(plan.predicted_step_s, want.t - 1e-9) << "trial " << trial;  // never better than optimal
    EXPECT_LE(plan.bound_s, want.t + 1e-9) << "trial " << trial;            // the bound is a lower bound
    if (plan.exact) continue;
    ++heuristic;
    // Saving at least half of the optimum's: T = F + B - saved here.
    const double opt_saving = in.forward_s + in.backward_s - want.t;
    const double saving = in.forward_s + in.backward_s - plan.predicted_step_s;
    EXPECT_GE(saving, opt_saving / 2 - 1e-9) << "trial " << trial;
  }
  EXPECT_GT(heuristic, 100);
}

// Two segments of 40 bytes saving 0.3 s each, two state groups of 50 bytes whose host update takes 1 s
// (device 0.01 s), room 100: either both segments kept (80 B) or one group on the device (+ one segment).
MemoryPlanInput trade_off(double group_host_s) {
  MemoryPlanInput in;
  in.segments = {{40, 0.3}, {40, 0.3}};
  in.groups = {{50, group_host_s, 0.01, true}, {50, group_host_s, 0.01, true}};
  in.room_bytes = 100;
  in.forward_s = 0.5;
  in.backward_s = 1.0;  // 0.6 of it the recomputes
  return in;
}

TEST(MemoryPlan, StateOnTheDeviceWhenTheHostUpdateIsExposed) {
  // Host 2 s per group: the host work (4 s with both segments kept, 2 s with one group on the device and
  // one segment) dwarfs backward, so both groups take the room: T = F + B + D = 0.5 + 1.0 + 0.02.
  const MemoryPlan plan = plan_memory(trade_off(2.0));
  EXPECT_EQ(plan.groups_on_device, 2);
  EXPECT_EQ(plan.keep, (std::vector<char>{0, 0}));
  EXPECT_NEAR(plan.predicted_step_s, 1.52, 1e-12);
  EXPECT_NEAR(predicted_step_s(trade_off(2.0), {1, 0}, 1), 0.5 + 0.7 + 0.01 + (2.0 - 0.7), 1e-12);
  EXPECT_NEAR(predicted_step_s(trade_off(2.0), {1, 1}, 0), 0.5 + 0.4 + (4.0 - 0.4), 1e-12);
}

TEST(MemoryPlan, ActivationsKeptWhenTheHostUpdateHides) {
  // Host 0.1 s per group: hidden behind backward either way, so the room goes to the activations.
  const MemoryPlan plan = plan_memory(trade_off(0.1));
  EXPECT_EQ(plan.groups_on_device, 0);
  EXPECT_EQ(plan.keep, (std::vector<char>{1, 1}));
  EXPECT_EQ(plan.kept_bytes, 80);
  EXPECT_NEAR(plan.predicted_step_s, 0.5 + 0.4, 1e-12);
  EXPECT_NEAR(plan.recompute_s, 0.0, 1e-12);
}

TEST(MemoryPlan, NoLimitKeepsEverythingMeasured) {
  MemoryPlanInput in = trade_off(2.0);
  in.room_bytes = -1;
  in.segments.push_back({-1, 0.0});  // unmeasured: recomputed
  const MemoryPlan plan = plan_memory(in);
  EXPECT_EQ(plan.keep, (std::vector<char>{1, 1, 0}));
  EXPECT_EQ(plan.groups_on_device, 2);
}

TEST(MemoryPlan, HostUpdatesBehindTheNextForwardWidenTheWindow) {
  MemoryPlanInput in = trade_off(0.5);
  in.room_bytes = 0;
  EXPECT_NEAR(plan_memory(in).predicted_step_s, 0.5 + 1.0, 1e-12);  // H = 1.0 <= B: hidden
  in.groups[0].host_s = in.groups[1].host_s = 0.7;                   // H = 1.4: 0.4 s exposed
  EXPECT_NEAR(plan_memory(in).predicted_step_s, 0.5 + 1.4, 1e-12);
  in.host_behind_forward = true;  // the window is F + B = 1.5: hidden again
  EXPECT_NEAR(plan_memory(in).predicted_step_s, 1.5, 1e-12);
}

TEST(MemoryPlan, RefusesBadInput) {
  MemoryPlanInput in = trade_off(1.0);
  in.segments[0].recompute_s = -1;
  EXPECT_ERROR_HAS(plan_memory(in), "negative recompute time");
  in = trade_off(1.0);
  in.backward_s = 0.1;
  EXPECT_ERROR_HAS(plan_memory(in), "shorter than the recomputes");
  in = trade_off(1.0);
  in.room_bytes = -5;
  EXPECT_ERROR_HAS(plan_memory(in), "room must be >= 0");
  in = trade_off(1.0);
  in.groups[1].state_bytes = -1;
  EXPECT_ERROR_HAS(plan_memory(in), "state group 1 has a negative cost");
  EXPECT_ERROR_HAS(predicted_step_s(trade_off(1.0), {1}, 0), "1 decisions for 2 segments");
  EXPECT_ERROR_HAS(predicted_step_s(trade_off(1.0), {1, 1}, 3), "3 groups on the device, of 2 held");
}

}  // namespace
}  // namespace ferry
