// IterationStats and IterationMeter (scheduler/iteration_stats.h): counts as they happen, moves and
// peaks as the store's differences between an iteration's begin and end, the moves between two
// training iterations (the step's), and moved_over_optimal().
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

TEST(IterationMeter, TheMovesBetweenTrainingIterationsCountInTheNext) {
  // What the optimizer's step moved between two training iterations (a host update's trip) is the
  // next training iteration's between_*; a forward-only iteration in the gap passes it on.
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  ChunkStore store(o);
  const ChunkId a = store.add_chunk(ChunkRole::kParam, at::kFloat, 256, Location::kHost);  // 1 KiB
  IterationMeter meter;
  auto iteration = [&](bool forward_only, int h2d) {
    meter.begin(0, false, 4096);
    meter.baseline(store);
    for (int k = 0; k < h2d; ++k) {
      store.move(a, Location::kDevice);
      store.move(a, Location::kHost);
    }
    store.move(a, Location::kDevice);
    return meter.end(store.stats(), false, forward_only);
  };
  store.move(a, Location::kDevice);
  store.move(a, Location::kHost);  // before the first iteration: no gap to count
  IterationStats s = iteration(false, 0);
  EXPECT_EQ(s.between_h2d_bytes + s.between_d2h_bytes, 0);
  store.move(a, Location::kHost);  // the step: the chunk goes to the host
  s = iteration(true, 0);          // an evaluation
  EXPECT_EQ(s.h2d_bytes, 1024);
  EXPECT_EQ(s.between_d2h_bytes, 0) << "a forward-only iteration passes the gap on";
  store.move(a, Location::kHost);
  s = iteration(false, 1);
  EXPECT_EQ(s.h2d_bytes, 2048);
  EXPECT_EQ(s.d2h_bytes, 1024);
  EXPECT_EQ(s.between_d2h_bytes, 2048) << "both gaps since the last training iteration";
  EXPECT_EQ(s.between_h2d_bytes, 0);
  EXPECT_EQ(s.moved_bytes(), 2048 + 1024 + 2048) << "both directions, the gap included";
  EXPECT_DOUBLE_EQ(s.moved_over_optimal(), (2048 + 1024 + 2048) / 4096.0);
  s = iteration(false, 0);
  EXPECT_EQ(s.between_d2h_bytes, 0) << "counted once";
  store.move(a, Location::kHost);
  meter.store_replaced();  // a repack: the new store's earlier moves are not this run's gap
  s = iteration(false, 0);
  EXPECT_EQ(s.between_d2h_bytes, 0);
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
