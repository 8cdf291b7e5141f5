// ReleasePlan (scheduler/release_plan.h), without a scheduler: from a trace and a fake set of remote
// groups, which group is given up where, how far an iteration has released, and the confirmation
// per trace version.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../../scheduler/release_plan.h"

namespace ferry {
namespace {

// Chunks 2g and 2g+1 form group g; release() only records.
struct PairGroups final : RemoteChunks {
  bool remote(ChunkId) const override { return false; }
  void fetch(ChunkId) override {}
  void prefetch(ChunkId) override {}
  std::vector<ChunkId> group(ChunkId c) const override { return {c / 2 * 2, c / 2 * 2 + 1}; }
  void release(ChunkId c) override { released.push_back(c); }
  bool any_remote() const override { return false; }
  void fetch_all() override {}
  void release_all() override {}
  std::vector<ChunkId> released;
};

// Forward uses `fwd` (chunk per position), then backward `bwd`.
AccessTrace trace_of(const std::vector<ChunkId>& fwd, const std::vector<ChunkId>& bwd) {
  AccessTrace t;
  for (ChunkId c : fwd) t.record(c, c, 0);
  t.mark_backward_start();
  for (ChunkId c : bwd) t.record(c, c, 0);
  t.finalize(4);
  return t;
}

TEST(ReleasePlan, AGroupGoesAfterItsLastForwardUseWhenItsNextUseIsFar) {
  // Group 0 (chunks 0, 1): forward at 0-1, next use at 6: a gap of 4 from position 2.
  // Group 1 (chunks 2, 3): forward at 2-3, next use at 4: a gap of 0.
  const AccessTrace trace = trace_of({0, 1, 2, 3}, {3, 2, 1, 0});
  PairGroups remote;
  ReleasePlan plan(/*reshard_after_forward=*/true, /*reshard_min_gap=*/1);
  const auto& at = plan.plan(trace, 4, remote);
  ASSERT_EQ(at.size(), 9u) << "one entry per position and one past the end";
  EXPECT_EQ(at[2], (std::vector<ChunkId>{0})) << "group 0, named by its first member, right after its forward";
  for (size_t q = 0; q < at.size(); ++q) {
    if (q != 2) {
      EXPECT_TRUE(at[q].empty()) << "position " << q;
    }
  }
  ReleasePlan far(/*reshard_after_forward=*/true, /*reshard_min_gap=*/4);
  EXPECT_EQ(far.plan(trace, 4, remote)[2], (std::vector<ChunkId>{0})) << "a gap of 4 is far enough for 4";
  ReleasePlan farther(/*reshard_after_forward=*/true, /*reshard_min_gap=*/5);
  EXPECT_TRUE(farther.plan(trace, 4, remote)[2].empty()) << "the gap is 4 positions, less than 5";
  ReleasePlan near(/*reshard_after_forward=*/true, /*reshard_min_gap=*/0);
  EXPECT_EQ(near.plan(trace, 4, remote)[4], (std::vector<ChunkId>{2})) << "group 1's gap of 0 is enough for 0";
}

TEST(ReleasePlan, NothingIsPlannedWhenReshardingIsOffOrAGroupIsNotUsedAgain) {
  PairGroups remote;
  ReleasePlan off(/*reshard_after_forward=*/false, /*reshard_min_gap=*/0);
  for (const auto& at : off.plan(trace_of({0, 1, 2, 3}, {3, 2, 1, 0}), 4, remote)) EXPECT_TRUE(at.empty());
  // Group 1 is used only in forward: kept (its gradients would fetch it again at the end of backward).
  ReleasePlan plan(/*reshard_after_forward=*/true, /*reshard_min_gap=*/0);
  const auto& at = plan.plan(trace_of({0, 1, 2, 3}, {1, 0}), 4, remote);
  EXPECT_EQ(at[2], (std::vector<ChunkId>{0}));
  EXPECT_TRUE(at[4].empty());
}

TEST(ReleasePlan, ReleasesEachPlannedGroupOncePerIteration) {
  const AccessTrace trace = trace_of({0, 1, 2, 3}, {3, 2, 1, 0});
  PairGroups remote;
  ReleasePlan plan(/*reshard_after_forward=*/true, /*reshard_min_gap=*/1);
  plan.begin_iteration();
  plan.release_until(1, trace, 4, remote);
  EXPECT_TRUE(remote.released.empty()) << "not yet: group 0 goes at position 2";
  plan.release_until(3, trace, 4, remote);
  plan.release_until(7, trace, 4, remote);
  plan.release_until(100, trace, 4, remote);  // past the end: clamped
  EXPECT_EQ(remote.released, (std::vector<ChunkId>{0})) << "once";
  plan.begin_iteration();
  plan.release_until(2, trace, 4, remote);
  EXPECT_EQ(remote.released, (std::vector<ChunkId>{0, 0})) << "again in the next iteration";
}

TEST(ReleasePlan, AllowedPerTraceVersionAndReplannedWhenInvalidated) {
  ReleasePlan plan(/*reshard_after_forward=*/true, /*reshard_min_gap=*/1);
  EXPECT_FALSE(plan.allowed(0)) << "no trace confirmed at first";
  plan.allow(3, true);
  EXPECT_TRUE(plan.allowed(3));
  EXPECT_FALSE(plan.allowed(4)) << "a later trace must be confirmed again";
  plan.allow(3, false);
  EXPECT_FALSE(plan.allowed(3));
  PairGroups remote;
  EXPECT_EQ(plan.plan(trace_of({0, 1, 2, 3}, {3, 2, 1, 0}), 4, remote)[2], (std::vector<ChunkId>{0}));
  // A new trace: the old plan stands until invalidated.
  const AccessTrace other = trace_of({2, 3, 0, 1}, {1, 0, 3, 2});
  EXPECT_EQ(plan.plan(other, 4, remote)[2], (std::vector<ChunkId>{0}));
  plan.invalidate();
  EXPECT_EQ(plan.plan(other, 4, remote)[2], (std::vector<ChunkId>{2})) << "group 1 leads now";
}

}  // namespace
}  // namespace ferry
