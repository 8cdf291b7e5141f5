#pragma once
// IterationFloor: the fewest parameter chunk bytes an iteration's own uses could have moved, given the
// chunks on the device when it began (SchedulerOptions::measure_iteration_floor; a benchmark's measure).
//
// The Belady reference (IterationStats::optimal_bytes) counts the trace an iteration follows, repeated:
// the uses a departing iteration skipped too, and none of those it made unforeseen (Note [A run that
// departs from its trace]). Under LayerDrop it is then no floor for that iteration (moved / optimal
// reads below 1). This one is: the uses the iteration made, in the order it made them, with the chunks
// in use beside each, one Belady pass over them (belady_moves_from) from the chunks resident at its
// start, at the largest chunk budget any of its moments had (no moment had more room), the round trips
// it ran with leaving after their last use. With chunks of one size no schedule of those uses moves fewer
// bytes from that start: a prefetch for a block that was then skipped, a chunk given up that came back,
// each shows as moved bytes over the floor.
//
// Against IterationStats::moved_bytes(): that counts the moves between this iteration and the one
// before (the step's round trips, sent to the host in the unpipelined step after the iteration's end),
// this floor the round trips of this iteration's uses; summed over iterations the two differ by one
// iteration's round trips at the ends, so compare sums over many iterations.
//
// Contract: not thread-safe (the Scheduler calls it with its mutex held). Cost when on: one record per
// use, and one pass at the iteration's end of O(uses x resident chunks) (log-time next uses).
#include <cstdint>
#include <vector>

#include "../chunk/chunk_store.h"
#include "access_trace.h"

namespace ferry {

class IterationFloor {
 public:
  // The iteration begins with `store` as it is now; `round_trips` (empty: none; else one entry per
  // chunk): the chunks that leave the device after their last use in it.
  void begin(const ChunkStore& store, const std::vector<char>& round_trips);
  // A parameter use (`param` in `chunk`, with the parameters in `in_use` beside it), at a moment whose
  // chunk budget is `budget_bytes` (0: no limit).
  void use(TensorId param, ChunkId chunk, const std::vector<TensorId>& in_use, int64_t budget_bytes);
  // The floor of the uses since begin(), with `store`'s chunk sizes; -1 when not begun.
  int64_t end(const ChunkStore& store);

 private:
  bool begun_ = false;
  AccessTrace uses_;
  std::vector<ChunkId> resident_;  // at the start
  std::vector<char> round_trips_;
  int64_t room_ = -1;  // the largest budget of the uses' moments (0: no limit; -1: no use yet)
};

}  // namespace ferry
