// IterationFloor (see iteration_floor.h).
#include "iteration_floor.h"

#include <algorithm>

namespace ferry {

void IterationFloor::begin(const ChunkStore& store, const std::vector<char>& round_trips) {
  begun_ = true;
  uses_.clear();
  resident_.clear();
  for (ChunkId c = 0; c < store.num_chunks(); ++c) {
    if (store.location(c) == Location::kDevice) resident_.push_back(c);
  }
  round_trips_ = round_trips.size() == static_cast<size_t>(store.num_chunks()) ? round_trips : std::vector<char>{};
  room_ = -1;
}

void IterationFloor::use(TensorId param, ChunkId chunk, const std::vector<TensorId>& in_use, int64_t budget_bytes) {
  if (!begun_) return;
  uses_.record(param, chunk, 0, in_use);
  room_ = room_ == 0 || budget_bytes == 0 ? 0 : std::max(room_, budget_bytes);
}

int64_t IterationFloor::end(const ChunkStore& store) {
  if (!begun_) return -1;
  begun_ = false;
  std::vector<int64_t> bytes(static_cast<size_t>(store.num_chunks()));
  for (ChunkId c = 0; c < store.num_chunks(); ++c) bytes[c] = store.chunk_info(c).nbytes;
  return belady_moves_from(uses_, bytes, std::max<int64_t>(room_, 0), resident_, round_trips_).total();
}

}  // namespace ferry
