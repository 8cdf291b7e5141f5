#pragma once
// Tensor and chunk states, and the one table of legal tensor-state transitions.
//
// A tensor slot's state says what the scheduler may do with its data; a chunk's state is derived from
// its slots' states and whether it has a payload. One rule follows for moves: a chunk in COMPUTE never
// moves and is never evicted.
//
//   FREE           the slot's data is not needed (not yet produced, or already consumed)
//   HOLD           the data is needed later; the chunk may move
//   COMPUTE        an op is using the data now; the chunk is pinned where it is (the device)
//   HOLD_AFTER_FWD the data's uses in this forward are done
//   HOLD_AFTER_BWD the data's uses in this backward are done
//
// Legal transitions (everything else fails, naming both states):
//   FREE           -> HOLD (data becomes valid), COMPUTE (an op produces it)
//   HOLD           -> COMPUTE, FREE
//   COMPUTE        -> HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD
//   HOLD_AFTER_FWD -> COMPUTE (used in backward), HOLD_AFTER_BWD (no use in backward),
//                     HOLD (end of step), FREE
//   HOLD_AFTER_BWD -> COMPUTE (next micro-batch), HOLD (end of step), FREE
// A transition to the same state is not a transition and is illegal; nested uses of one tensor are
// counted by the ChunkStore, which moves the state only on the first use and the last release.
#include <array>
#include <cstdint>

namespace ferry {

enum class TensorState { kFree, kCompute, kHold, kHoldAfterFwd, kHoldAfterBwd };
constexpr int kNumTensorStates = 5;

// RELEASED: no payload on any tier. Otherwise, in order of precedence: COMPUTE if any slot is in
// COMPUTE; FREE if every slot is FREE (or there are no slots); HOLD_AFTER_FWD / HOLD_AFTER_BWD if every
// slot that is not FREE is in that state; HOLD otherwise.
enum class ChunkState { kReleased, kFree, kCompute, kHold, kHoldAfterFwd, kHoldAfterBwd };

const char* to_string(TensorState state);
const char* to_string(ChunkState state);

bool is_legal_transition(TensorState from, TensorState to);
// The one check of the table above: TORCH_CHECK naming both states (and `what`, e.g. "tensor 7").
void check_transition(TensorState from, TensorState to, const char* what = "tensor");

// How many slots of a chunk are in each state; the chunk state is derived from it.
class TensorStateCounts {
 public:
  void add(TensorState state) { ++counts_[index(state)]; }
  void remove(TensorState state);
  // Moves one slot from `from` to `to` (the transition must already have been checked).
  void move(TensorState from, TensorState to) {
    remove(from);
    add(to);
  }
  int64_t count(TensorState state) const { return counts_[index(state)]; }
  int64_t total() const;

 private:
  static int index(TensorState state) { return static_cast<int>(state); }
  std::array<int64_t, kNumTensorStates> counts_{};
};

ChunkState derive_chunk_state(bool has_payload, const TensorStateCounts& counts);

}  // namespace ferry
