#pragma once
// IterationStats: the counters of one scheduler iteration, and IterationMeter, which takes them: the
// uses and prefetches counted as they happen, the moves, evictions, waits and peaks as the difference of
// the parameter store's statistics between the iteration's begin and end.
//
// Contract: IterationMeter is not thread-safe (the Scheduler calls it with its mutex held). Call order:
// begin, baseline (after anything at the iteration's start that moves chunks), counts, end. Between
// two iterations the store must be the same one, or store_replaced() called.
#include <cstdint>

#include "../chunk/chunk_store.h"

namespace ferry {

// Counters of one iteration (sums of bytes unless a count).
struct IterationStats {
  int64_t index = 0;
  bool traced = false;      // this iteration recorded the trace (warm-up or re-trace)
  // It gave the trace up (too many uses the trace lacks, or any difference where alignment is off):
  // LRU and no prefetch for its rest, and the next iteration re-traces (TraceState).
  bool diverged = false;
  // Departures from the trace it followed (Note [A run that departs from its trace]): trace positions
  // it did not use, uses the trace did not have (counts), and whether its end merged them into the
  // trace (a new trace version, no recording).
  int64_t trace_skipped = 0;
  int64_t trace_unforeseen = 0;
  bool trace_merged = false;
  // Trace positions passed over on the model's word (ferry::will_skip, Note [Skips said ahead]), and
  // those of them used anyway (a hint proven wrong: its chunk may have come on demand). Counts.
  int64_t trace_hinted = 0;
  int64_t trace_hints_broken = 0;
  bool aborted = false;     // an exception ended it
  int64_t accesses = 0;     // pre-use events (count)
  int64_t h2d_bytes = 0;
  int64_t prefetched_bytes = 0;  // ... of h2d_bytes moved ahead of their use (MoveStats::prefetch_h2d_bytes)
  int64_t d2h_bytes = 0;
  int64_t evictions = 0;    // count
  int64_t prefetches = 0;   // prefetch moves started (count)
  int64_t wait_ns = 0;      // host time blocked on copies
  int64_t device_peak_bytes = 0;  // chunk bytes on the device, peak
  // The largest set of chunk bytes one op needed on the device at once: the smallest device budget
  // this iteration could have run with at this chunk size (ChunkStoreStats::compute_peak_bytes).
  int64_t working_set_peak_bytes = 0;
  bool forward_only = false;      // no backward in this iteration (evaluation)
  int64_t optimal_bytes = -1;     // Belady moves per iteration of the trace at this budget, long run (-1: no trace yet)
  // Parameter chunk bytes moved outside any iteration since the last training iteration ended (a
  // training iteration's only; 0 in a forward-only one, whose gap goes to the next): the optimizer's
  // step of the iteration before, which sends host-updated chunks to the host (Note [The step's round
  // trips in the reference]), and whatever else ran between (a read of the state).
  int64_t between_h2d_bytes = 0;
  int64_t between_d2h_bytes = 0;
  // The parameter chunk bytes this iteration moved, both ways, its between-iterations share included:
  // what optimal_bytes counts.
  int64_t moved_bytes() const { return h2d_bytes + d2h_bytes + between_h2d_bytes + between_d2h_bytes; }
  // moved_bytes() / optimal_bytes: 1 when eviction and prefetch moved what Belady would (-1: no
  // reference). Where Belady's iterations cycle through several resident sets one iteration's ratio
  // swings around 1 (belady_moves, D104): sum the moves over iterations to compare.
  double moved_over_optimal() const;
  // With SchedulerOptions::measure_iteration_floor: the fewest bytes this iteration's own uses could have
  // moved from the chunks on the device when it began (IterationFloor; -1: not measured). Unlike
  // optimal_bytes a floor also where the iteration departed from its trace; sum it over iterations
  // against moved_bytes() (the round trips fall one iteration apart in the two).
  int64_t floor_bytes = -1;
  // Host->device bytes a use had to wait for (moved when it came, not ahead of it).
  int64_t demand_h2d_bytes() const { return h2d_bytes - prefetched_bytes; }
};

class IterationMeter {
 public:
  // Iteration `index` begins (`traced`: it records the trace; `optimal_bytes`: IterationStats's).
  void begin(int64_t index, bool traced, int64_t optimal_bytes);
  // The store's statistics now are the iteration's start; its peaks are reset. What it moved since the
  // last iteration's end counts as between the iterations.
  void baseline(ChunkStore& store);
  // The parameters were repacked into a new store: what it moved before this begin is not counted.
  void store_replaced() { have_end_ = false; }
  void count_access() { ++current_.accesses; }
  void count_prefetch() { ++current_.prefetches; }
  void diverged() { current_.diverged = true; }
  void departures(int64_t skipped, int64_t unforeseen, bool merged, int64_t hinted = 0, int64_t hints_broken = 0) {
    current_.trace_skipped = skipped;
    current_.trace_unforeseen = unforeseen;
    current_.trace_merged = merged;
    current_.trace_hinted = hinted;
    current_.trace_hints_broken = hints_broken;
  }
  void floor(int64_t bytes) { current_.floor_bytes = bytes; }
  // Closes the iteration with the store's statistics now; the result is also last().
  const IterationStats& end(const ChunkStoreStats& now, bool aborted, bool forward_only);
  // The last iteration ended (zeros before the first).
  const IterationStats& last() const { return last_; }

 private:
  IterationStats current_;
  IterationStats last_;
  ChunkStoreStats at_begin_;
  ChunkStoreStats at_end_;  // the store's statistics at the last iteration's end
  bool have_end_ = false;
  int64_t between_h2d_ = 0, between_d2h_ = 0;  // since the last training iteration's end
};

}  // namespace ferry
