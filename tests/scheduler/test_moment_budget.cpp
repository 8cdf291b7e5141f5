// MomentBudget (scheduler/moment_budget.h) on simulated stores sharing one device accountant: the chunk
// budget after other stores' bytes, the capacity's cap at a moment, the floor of one chunk, the room
// a repack may build in, admitting other stores' bytes, and giving the store its budget only on change.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>

#include "../../scheduler/moment_budget.h"
#include "../test_util.h"

namespace ferry {
namespace {

struct Stores {
  Stores() {
    ChunkStoreOptions o;
    o.device = DeviceKind::kSimulated;
    o.accountant = accountant;
    params = std::make_unique<ChunkStore>(o);
    state = std::make_unique<ChunkStore>(o);
  }
  // Puts `bytes` of the other store (optimizer state) on the device.
  void others_hold(int64_t bytes) { state->add_chunk(ChunkRole::kMaster, at::kFloat, bytes / 4, Location::kDevice); }
  std::shared_ptr<DeviceAccountant> accountant = std::make_shared<DeviceAccountant>();
  std::unique_ptr<ChunkStore> params, state;
};

TEST(MomentBudget, TheChunkBudgetIsWhatOtherStoresLeave) {
  Stores s;
  const MomentBudget none(DeviceBudget{0, 0}, 0);
  EXPECT_EQ(none.chunk_budget(*s.params), 0) << "no budget: no limit";
  const MomentBudget b(DeviceBudget{1000, 0}, 1000);
  EXPECT_EQ(b.chunk_budget(*s.params), 1000);
  s.others_hold(400);
  EXPECT_EQ(b.chunk_budget(*s.params), 600);
  s.others_hold(800);
  EXPECT_EQ(b.chunk_budget(*s.params), 1) << "never 0, which would mean no limit";
}

TEST(MomentBudget, AMomentIsCappedByTheCapacityButKeepsRoomForOneChunk) {
  Stores s;
  MomentBudget b(DeviceBudget{1000, 1200}, 1000);
  b.set_largest_chunk(100);
  EXPECT_EQ(b.at_moment(-1, *s.params), 1000) << "non-model memory unknown: the budget alone";
  EXPECT_EQ(b.at_moment(100, *s.params), 1000) << "1200 - 100 leaves more than the budget";
  EXPECT_EQ(b.at_moment(500, *s.params), 700);
  s.others_hold(200);
  EXPECT_EQ(b.at_moment(500, *s.params), 500) << "capacity - others - non-model";
  EXPECT_EQ(b.at_moment(1200, *s.params), 100) << "the floor: one chunk (said once in the log)";
  const MomentBudget unlimited(DeviceBudget{0, 1200}, 0);
  EXPECT_EQ(unlimited.at_moment(500, *s.params), 500) << "no budget, a known capacity: the capacity's room";
  EXPECT_EQ(unlimited.at_moment(-1, *s.params), 0);
}

TEST(MomentBudget, TheRoomAtTheWorstMomentIsTheBudgetCappedByTheCapacity) {
  EXPECT_EQ(MomentBudget(DeviceBudget{1000, 0}, 0).room_at_worst(5000), 1000) << "capacity unknown";
  EXPECT_EQ(MomentBudget(DeviceBudget{1000, 1200}, 0).room_at_worst(500), 700);
  EXPECT_EQ(MomentBudget(DeviceBudget{0, 1200}, 0).room_at_worst(500), 700);
  EXPECT_EQ(MomentBudget(DeviceBudget{0, 0}, 0).room_at_worst(500), 0) << "no limit";
  EXPECT_EQ(MomentBudget(DeviceBudget{1000, 1200}, 0).room_at_worst(2000), 0);
}

TEST(MomentBudget, AdmittingOtherBytesMustLeaveTheLargestChunk) {
  Stores s;
  MomentBudget b(DeviceBudget{1000, 0}, 1000);
  b.set_largest_chunk(300);
  EXPECT_EQ(b.admitting(600, *s.params), 400);
  s.others_hold(400);
  EXPECT_EQ(b.admitting(200, *s.params), 400);
  const std::string e = test::error_of([&] { b.admitting(400, *s.params); });
  EXPECT_NE(e.find("would leave 200 B for parameter chunks, less than the largest chunk (300 B)"), std::string::npos)
      << e;
  EXPECT_NE(test::error_of([&] { b.admitting(-1, *s.params); }).find("must be >= 0"), std::string::npos);
  EXPECT_EQ(MomentBudget(DeviceBudget{0, 0}, 0).admitting(1 << 30, *s.params), 0) << "no budget: nothing to make";
}

TEST(MomentBudget, TheStoreGetsItsBudgetOnlyWhenItChanges) {
  Stores s;
  MomentBudget b(DeviceBudget{1000, 0}, s.params->stats().device.budget_bytes);
  b.apply(*s.params, 800);
  EXPECT_EQ(s.params->stats().device.budget_bytes, 800);
  EXPECT_EQ(b.store_budget(), 800);
  // Changed behind its back: the record is what it gave, so the same value is not given again.
  s.params->set_device_budget(900);
  b.apply(*s.params, 800);
  EXPECT_EQ(s.params->stats().device.budget_bytes, 900) << "no store call when the budget is unchanged";
  b.store_replaced(900);
  b.apply(*s.params, 800);
  EXPECT_EQ(s.params->stats().device.budget_bytes, 800);
  // A budget the store cannot keep to (a chunk in COMPUTE) fails and changes neither.
  const ChunkId c = s.params->add_chunk(ChunkRole::kParam, at::kFloat, 150, Location::kDevice);
  const TensorId t = s.params->add_tensor(c, 0, {150});
  s.params->access(t);
  EXPECT_THROW(b.apply(*s.params, 100), c10::Error);
  EXPECT_EQ(b.store_budget(), 800);
  EXPECT_EQ(s.params->stats().device.budget_bytes, 800);
  s.params->release(t, TensorState::kHold);
}

TEST(MomentBudget, TheOptimalMovesAreStaleOnceOtherStoresHoldAnotherAmount) {
  MomentBudget b(DeviceBudget{1000, 0}, 0);
  EXPECT_EQ(b.optimal_bytes(), -1) << "no trace yet";
  b.set_optimal(4096, 200);
  EXPECT_EQ(b.optimal_bytes(), 4096);
  EXPECT_FALSE(b.optimal_stale(200));
  EXPECT_TRUE(b.optimal_stale(300));
}

}  // namespace
}  // namespace ferry
