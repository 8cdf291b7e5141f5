// IterationStats and IterationMeter (scheduler/iteration_stats.h): counts as they happen, moves and
// peaks as the store's differences between an iteration's begin and end, and moved_over_optimal().
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../scheduler/iteration_stats.h"

namespace ferry {
namespace {

TEST(IterationMeter, CountsAndTheStoresDifferencesMakeTheIteration) {
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  ChunkStore store(o);
  const ChunkId a = store.add_chunk(ChunkRole::kParam, at::kFloat, 256, Location::kHost);  // 1 KiB
  store.move(a, Location::kDevice);
  store.move(a, Location::kHost);  // before the iteration: not counted
  IterationMeter meter;
  meter.begin(/*index=*/7, /*traced=*/true, /*optimal_bytes=*/2048);
  meter.baseline(store);
  meter.count_access();
  meter.count_access();
  meter.count_prefetch();
  meter.diverged();
  store.move(a, Location::kDevice);
  store.move(a, Location::kHost);
  store.move(a, Location::kDevice);
  const IterationStats s = meter.end(store.stats(), /*aborted=*/false, /*forward_only=*/true);
  EXPECT_EQ(s.index, 7);
  EXPECT_TRUE(s.traced);
  EXPECT_TRUE(s.diverged);
  EXPECT_FALSE(s.aborted);
  EXPECT_TRUE(s.forward_only);
  EXPECT_EQ(s.accesses, 2);
  EXPECT_EQ(s.prefetches, 1);
  EXPECT_EQ(s.h2d_bytes, 2048);
  EXPECT_EQ(s.d2h_bytes, 1024);
  EXPECT_EQ(s.device_peak_bytes, 1024) << "peaks are reset at the baseline";
  EXPECT_EQ(s.optimal_bytes, 2048);
  EXPECT_DOUBLE_EQ(s.moved_over_optimal(), 1.5);
  EXPECT_EQ(meter.last().h2d_bytes, 2048) << "the last iteration is kept";
  meter.begin(8, false, 2048);
  EXPECT_EQ(meter.last().index, 7) << "until the next one ends";
}

TEST(IterationStats, MovedOverOptimalWithoutATraceOrWithNothingToMove) {
  IterationStats s;
  EXPECT_EQ(s.moved_over_optimal(), -1.0) << "no trace yet";
  s.optimal_bytes = 0;
  EXPECT_EQ(s.moved_over_optimal(), 1.0) << "nothing to move, nothing moved";
  s.h2d_bytes = 1;
  EXPECT_EQ(s.moved_over_optimal(), -1.0) << "moved where the optimum moves nothing";
}

}  // namespace
}  // namespace ferry
