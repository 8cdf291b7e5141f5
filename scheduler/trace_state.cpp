// TraceState (see trace_state.h).
#include "trace_state.h"

#include <string>

#include "../common/logging.h"

namespace ferry {

bool TraceState::begin_iteration() {
  diverged_ = false;
  position_ = 0;
  const bool record = !trace_ || retrace_next_ || warmups_done_ < warmup_iterations_;
  if (record) {
    recording_ = std::make_shared<AccessTrace>();
  } else {
    recording_.reset();
  }
  return record;
}

bool TraceState::matches(int64_t position, int64_t param) {
  if (position < trace_->size() && trace_->tensor_at(position) == param) return true;
  diverged_ = true;
  retrace_next_ = true;
  if (trace_forward_only_) {
    // Not a surprise: the trace came from an evaluation iteration (no backward), this one trains.
    log::info("ferry scheduler: the trace was recorded by a forward-only (evaluation) iteration; this "
              "iteration has a backward, so the next one is traced as a training iteration");
  } else {
    log::warn_once("scheduler-diverged",
                   "ferry scheduler: the parameter access order differs from the recorded trace at position " +
                       std::to_string(position) + " (expected parameter " +
                       (position < trace_->size() ? std::to_string(trace_->tensor_at(position))
                                                  : std::string("none: the trace ended")) +
                       ", got parameter " + std::to_string(param) +
                       "); evicting by LRU for the rest of this iteration and re-tracing the next one. "
                       "Conditional branches, changed shapes or a different loss cause this.");
  }
  return false;
}

bool TraceState::end_iteration(bool aborted, bool forward_only) {
  // A forward-only (evaluation) recording never replaces a training trace: evaluation between training
  // steps would otherwise flip the trace back and forth. It is used only while there is no other.
  const bool keep = recording_ && !aborted && (!forward_only || !trace_ || trace_forward_only_);
  if (recording_ && !aborted && !keep) {
    log::debug("ferry scheduler: an evaluation iteration was not used as the trace (a training trace exists)");
  }
  bool complete = false;
  if (keep) {
    trace_forward_only_ = forward_only;
    if (trace_ && retrace_next_) log::info("ferry scheduler: re-traced (", recording_->size(), " accesses)");
    trace_ = recording_;
    ++trace_version_;
    retrace_next_ = false;
    ++warmups_done_;
    if (warmups_done_ >= warmup_iterations_) {
      complete = true;
      if (warmups_done_ == warmup_iterations_) repack_wanted_ = true;
    } else {
      trace_.reset();  // more warm-up to record
    }
  }
  recording_.reset();
  ++iteration_;
  return complete;
}

}  // namespace ferry
