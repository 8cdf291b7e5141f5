#include "state.h"

#include <c10/util/Exception.h>

namespace ferry {

const char* to_string(TensorState state) {
  switch (state) {
    case TensorState::kFree: return "FREE";
    case TensorState::kCompute: return "COMPUTE";
    case TensorState::kHold: return "HOLD";
    case TensorState::kHoldAfterFwd: return "HOLD_AFTER_FWD";
    case TensorState::kHoldAfterBwd: return "HOLD_AFTER_BWD";
  }
  return "?";
}

const char* to_string(ChunkState state) {
  switch (state) {
    case ChunkState::kReleased: return "RELEASED";
    case ChunkState::kFree: return "FREE";
    case ChunkState::kCompute: return "COMPUTE";
    case ChunkState::kHold: return "HOLD";
    case ChunkState::kHoldAfterFwd: return "HOLD_AFTER_FWD";
    case ChunkState::kHoldAfterBwd: return "HOLD_AFTER_BWD";
  }
  return "?";
}

bool is_legal_transition(TensorState from, TensorState to) {
  using S = TensorState;
  switch (from) {
    case S::kFree: return to == S::kHold || to == S::kCompute;
    case S::kHold: return to == S::kCompute || to == S::kFree;
    case S::kCompute: return to == S::kHold || to == S::kHoldAfterFwd || to == S::kHoldAfterBwd;
    case S::kHoldAfterFwd:
      return to == S::kCompute || to == S::kHoldAfterBwd || to == S::kHold || to == S::kFree;
    case S::kHoldAfterBwd: return to == S::kCompute || to == S::kHold || to == S::kFree;
  }
  return false;
}

void check_transition(TensorState from, TensorState to, const char* what) {
  TORCH_CHECK(is_legal_transition(from, to), "ferry: illegal state transition of ", what, ": ",
              to_string(from), " -> ", to_string(to));
}

void TensorStateCounts::remove(TensorState state) {
  TORCH_INTERNAL_ASSERT(counts_[index(state)] > 0, "no slot in state ", to_string(state));
  --counts_[index(state)];
}

int64_t TensorStateCounts::total() const {
  int64_t sum = 0;
  for (int64_t c : counts_) sum += c;
  return sum;
}

ChunkState derive_chunk_state(bool has_payload, const TensorStateCounts& counts) {
  if (!has_payload) return ChunkState::kReleased;
  if (counts.count(TensorState::kCompute) > 0) return ChunkState::kCompute;
  const int64_t live = counts.total() - counts.count(TensorState::kFree);
  if (live == 0) return ChunkState::kFree;
  if (counts.count(TensorState::kHoldAfterFwd) == live) return ChunkState::kHoldAfterFwd;
  if (counts.count(TensorState::kHoldAfterBwd) == live) return ChunkState::kHoldAfterBwd;
  return ChunkState::kHold;
}

}  // namespace ferry
