// The tensor-state transition table, checked against a hand-written list, and chunk-state derivation.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "../../chunk/state.h"

namespace ferry {
namespace {

constexpr TensorState kAll[] = {TensorState::kFree, TensorState::kCompute, TensorState::kHold,
                                TensorState::kHoldAfterFwd, TensorState::kHoldAfterBwd};

TEST(TensorState, TableIsExactlyTheDocumentedOne) {
  const std::set<std::string> legal = {
      "FREE->HOLD",           "FREE->COMPUTE",          "HOLD->COMPUTE",
      "HOLD->FREE",           "COMPUTE->HOLD",          "COMPUTE->HOLD_AFTER_FWD",
      "COMPUTE->HOLD_AFTER_BWD", "HOLD_AFTER_FWD->COMPUTE", "HOLD_AFTER_FWD->HOLD_AFTER_BWD",
      "HOLD_AFTER_FWD->HOLD", "HOLD_AFTER_FWD->FREE",   "HOLD_AFTER_BWD->COMPUTE",
      "HOLD_AFTER_BWD->HOLD", "HOLD_AFTER_BWD->FREE"};
  int count = 0;
  for (TensorState from : kAll) {
    for (TensorState to : kAll) {
      const std::string name = std::string(to_string(from)) + "->" + to_string(to);
      EXPECT_EQ(is_legal_transition(from, to), legal.count(name) == 1) << name;
      count += is_legal_transition(from, to);
    }
  }
  EXPECT_EQ(count, static_cast<int>(legal.size()));
}

TEST(TensorState, IllegalTransitionNamesBothStates) {
  try {
    check_transition(TensorState::kHold, TensorState::kHoldAfterBwd, "tensor 7");
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("tensor 7: HOLD -> HOLD_AFTER_BWD"), std::string::npos) << msg;
  }
  EXPECT_THROW(check_transition(TensorState::kCompute, TensorState::kCompute), c10::Error);
  EXPECT_NO_THROW(check_transition(TensorState::kHold, TensorState::kCompute));
}

TEST(ChunkState, DerivedFromSlots) {
  TensorStateCounts counts;
  EXPECT_EQ(derive_chunk_state(false, counts), ChunkState::kReleased);
  EXPECT_EQ(derive_chunk_state(true, counts), ChunkState::kFree);  // no slots
  counts.add(TensorState::kFree);
  counts.add(TensorState::kHoldAfterFwd);
  counts.add(TensorState::kHoldAfterFwd);
  EXPECT_EQ(derive_chunk_state(true, counts), ChunkState::kHoldAfterFwd);  // FREE slots do not count
  counts.move(TensorState::kHoldAfterFwd, TensorState::kHoldAfterBwd);
  EXPECT_EQ(derive_chunk_state(true, counts), ChunkState::kHold);  // mixed
  counts.move(TensorState::kHoldAfterFwd, TensorState::kHoldAfterBwd);
  EXPECT_EQ(derive_chunk_state(true, counts), ChunkState::kHoldAfterBwd);
  counts.move(TensorState::kHoldAfterBwd, TensorState::kCompute);
  EXPECT_EQ(derive_chunk_state(true, counts), ChunkState::kCompute);  // COMPUTE wins
  EXPECT_EQ(derive_chunk_state(false, counts), ChunkState::kReleased);
  EXPECT_EQ(counts.total(), 3);
}

}  // namespace
}  // namespace ferry
