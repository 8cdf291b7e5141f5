#pragma once
// TraceState: the scheduler's access trace through its life. The first `warmup_iterations` iterations
// record; the last recording becomes the trace in use; while an iteration matches it the scheduler
// follows it (OPT eviction, prefetch); the first use that does not match marks the iteration diverged
// and the next one is recorded again (a re-trace). It also counts iterations, numbers each adopted
// trace (its version: what every rank must agree on before forward releases follow it) and says once,
// after the warm-up, that the layout should be repacked in first-use order.
//
// A forward-only (evaluation) recording becomes the trace only while there is none from a training
// iteration: evaluation between training steps would otherwise flip the trace back and forth.
//
// Contract: not thread-safe (the Scheduler calls it with its mutex held). Call order per iteration:
// begin_iteration, then per use next_position (and matches while following()), record while
// recording(), end_iteration. Finalizing an adopted trace (chunk remap, next-use index) is the caller's.
#include <cstdint>
#include <memory>

#include "access_trace.h"

namespace ferry {

class TraceState {
 public:
  explicit TraceState(int warmup_iterations) : warmup_iterations_(warmup_iterations) {}

  // An iteration begins; returns whether it records (warm-up, no trace yet, or a re-trace).
  bool begin_iteration();
  // The position of the next use in this iteration (0, 1, ...).
  int64_t next_position() { return position_++; }
  int64_t position() const { return position_; }
  // Whether this iteration follows the trace: there is one, it records nothing, and it has matched so far.
  bool following() const { return trace_ && !recording_ && !diverged_; }
  // While following(): whether `param` is the trace's parameter at `position`. If not, the iteration is
  // diverged from here on (said in the log, once per process unless the trace was an evaluation's) and
  // the next one is recorded.
  bool matches(int64_t position, int64_t param);
  // The recording of this iteration, or null when it does not record.
  AccessTrace* recording() const { return recording_.get(); }
  // Ends the iteration (`forward_only`: no backward). Returns whether its recording was adopted as a
  // trace that is complete (the warm-up is done): the caller then finalizes it against its chunks.
  bool end_iteration(bool aborted, bool forward_only);

  // The trace in use: the finalized one (null before the warm-up ends).
  const std::shared_ptr<AccessTrace>& trace() const { return trace_; }
  bool trace_is_forward_only() const { return trace_ && trace_forward_only_; }
  // Incremented whenever a recording is adopted as the trace.
  int64_t trace_version() const { return trace_version_; }
  // The warm-up just ended: the layout should be repacked (once); repacked() clears it.
  bool repack_wanted() const { return repack_wanted_; }
  void repacked() { repack_wanted_ = false; }
  // The caller changed what an iteration does (an activation plan): the next one records a new trace.
  void retrace() {
    if (trace_) retrace_next_ = true;
  }
  // Iterations ended so far.
  int64_t iterations() const { return iteration_; }

 private:
  int warmup_iterations_;
  std::shared_ptr<AccessTrace> trace_;      // the finalized trace in use (null before the warm-up ends)
  std::shared_ptr<AccessTrace> recording_;  // the trace being recorded this iteration (null if following)
  int64_t position_ = 0;
  int64_t iteration_ = 0;
  int warmups_done_ = 0;
  bool retrace_next_ = false;
  bool repack_wanted_ = false;
  bool diverged_ = false;
  bool trace_forward_only_ = false;
  int64_t trace_version_ = 0;
};

}  // namespace ferry
