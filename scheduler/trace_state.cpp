// TraceState (see trace_state.h).
#include "trace_state.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "../common/logging.h"

namespace ferry {

TraceState::TraceState(int warmup_iterations, bool align) : warmup_iterations_(warmup_iterations), align_(align) {}

bool TraceState::begin_iteration() {
  diverged_ = false;
  uses_ = 0;
  alignment_.reset();
  const bool record = !trace_ || retrace_next_ || warmups_done_ < warmup_iterations_;
  if (record) {
    recording_ = std::make_shared<AccessTrace>();
  } else {
    recording_.reset();
    // A training iteration after an evaluation's trace is expected to differ: it is traced anew.
    if (align_ && !trace_forward_only_) alignment_.emplace(*trace_);
  }
  return record;
}

int64_t TraceState::cursor() const { return alignment_ ? alignment_->cursor() : uses_; }

std::shared_ptr<const std::vector<char>> TraceState::begin_backward() {
  if (recording_) recording_->mark_backward_start();
  return alignment_ && !diverged_ ? alignment_->begin_backward() : nullptr;
}

std::shared_ptr<const std::vector<char>> TraceState::pass_over(const std::vector<TensorId>& params) {
  return alignment_ && !diverged_ ? alignment_->pass_over(params) : nullptr;
}

int64_t TraceState::use(int64_t param, ChunkId chunk, const std::vector<TensorId>& in_use) {
  const int64_t position = uses_++;
  if (!following()) return -1;
  if (alignment_) {
    const int64_t at = alignment_->align(param, chunk, in_use);
    // Uses of parameters the trace never had (a part its recording skipped) are merged, never given up for.
    const int64_t limit = std::max<int64_t>(kGiveUpMin, trace_->size() / 4);
    const int64_t beyond = alignment_->unforeseen() - alignment_->unforeseen_absent();
    if (at < 0 && beyond > limit) {
      give_up("ferry scheduler: " + std::to_string(beyond) +
              " uses in this iteration of parameters the recorded trace holds found no position in it (more than " +
              std::to_string(limit) + "; the last: parameter " + std::to_string(param) +
              "); evicting by LRU for the rest of this iteration and re-tracing the next one. The program's "
              "order of parameter uses has changed (another model path, changed shapes or a different loss)");
    }
    return at;
  }
  if (position < trace_->size() && trace_->tensor_at(position) == param) return position;
  give_up("ferry scheduler: the parameter access order differs from the recorded trace at position " +
          std::to_string(position) + " (expected parameter " +
          (position < trace_->size() ? std::to_string(trace_->tensor_at(position))
                                     : std::string("none: the trace ended")) +
          ", got parameter " + std::to_string(param) +
          "); evicting by LRU for the rest of this iteration and re-tracing the next one. Conditional "
          "branches, changed shapes or a different loss cause this.");
  return -1;
}

void TraceState::give_up(const std::string& why) {
  diverged_ = true;
  retrace_next_ = true;
  alignment_.reset();
  if (trace_forward_only_) {
    // Not a surprise: the trace came from an evaluation iteration (no backward), this one trains.
    log::info("ferry scheduler: the trace was recorded by a forward-only (evaluation) iteration; this "
              "iteration has a backward, so the next one is traced as a training iteration");
  } else {
    log::warn_once("scheduler-diverged", why);
  }
}

void TraceState::adopt(std::shared_ptr<AccessTrace> trace) {
  trace_ = std::move(trace);
  ++trace_version_;
  last_used_.assign(static_cast<size_t>(trace_->size()), trained_);
}

void TraceState::merge_departures(IterationEnd& end) {
  ++trained_;
  const TraceAlignment& a = *alignment_;
  const int64_t n = trace_->size();
  std::vector<char> keep(static_cast<size_t>(n), 1);
  int64_t pruned = 0;
  for (int64_t q = 0; q < n; ++q) {
    if (a.used(q)) last_used_[q] = trained_;
    if (trained_ - last_used_[q] >= kPruneAfter) {
      keep[q] = 0;
      ++pruned;
    }
  }
  end.skipped = a.skipped();
  end.unforeseen = a.unforeseen();
  end.hinted = a.hinted();
  end.hints_broken = a.hints_broken();
  if (end.hints_broken > 0) {
    log::write_once(log::Level::kWarn, "scheduler-hint-broken",
                    log::detail::concat("ferry scheduler: ", end.hints_broken, " of the ", end.hinted,
                                        " trace uses said skipped in this iteration (ferry::will_skip) came "
                                        "anyway; their chunks were not prefetched. Say a skip only for a part "
                                        "the step will not run (said once per process; the count is in "
                                        "IterationStats::trace_hints_broken)"));
  }
  if (end.unforeseen == 0 && pruned == 0) return;
  TraceAlignment::Merged merged = a.merged_trace(keep);
  // A trace more than twice an iteration's uses is more skip than guide: record one afresh.
  if (merged.trace->size() > 2 * uses_ + kGiveUpMin) {
    log::info("ferry scheduler: merging this iteration's departures would make a trace of ", merged.trace->size(),
              " uses for an iteration of ", uses_, "; the next iteration is traced anew");
    retrace_next_ = true;
    return;
  }
  std::vector<int64_t> last_used(merged.origin.size());
  for (size_t i = 0; i < merged.origin.size(); ++i) {
    last_used[i] = merged.origin[i] >= 0 ? last_used_[merged.origin[i]] : trained_;
  }
  log::write_once(log::Level::kInfo, "scheduler-merged",
                  log::detail::concat("ferry scheduler: an iteration's parameter uses departed from the recorded "
                                      "trace (", end.skipped, " trace uses skipped, ", end.unforeseen,
                                      " not in it: skipped layers, unused experts, a branch taken anew); the "
                                      "trace now holds what recent iterations used and is followed on (later "
                                      "merges at debug level)"));
  log::debug("ferry scheduler: trace merged: ", n, " -> ", merged.trace->size(), " uses (", end.unforeseen,
             " inserted, ", pruned, " unused for ", kPruneAfter, " iterations dropped)");
  alignment_.reset();  // it refers to the trace being replaced
  adopt(std::move(merged.trace));
  last_used_ = std::move(last_used);
  end.adopted = end.merged = true;
}

TraceState::IterationEnd TraceState::end_iteration(bool aborted, bool forward_only) {
  IterationEnd end;
  // A forward-only (evaluation) recording never replaces a training trace: evaluation between training
  // steps would otherwise flip the trace back and forth. It is used only while there is no other.
  const bool keep = recording_ && !aborted && (!forward_only || !trace_ || trace_forward_only_);
  if (recording_ && !aborted && !keep) {
    log::debug("ferry scheduler: an evaluation iteration was not used as the trace (a training trace exists)");
  }
  if (keep) {
    trace_forward_only_ = forward_only;
    if (trace_ && retrace_next_) log::info("ferry scheduler: re-traced (", recording_->size(), " accesses)");
    adopt(recording_);
    retrace_next_ = false;
    ++warmups_done_;
    if (warmups_done_ >= warmup_iterations_) {
      end.adopted = true;
      if (warmups_done_ == warmup_iterations_) repack_wanted_ = true;
    } else {
      trace_.reset();  // more warm-up to record
    }
  } else if (alignment_ && !aborted && !forward_only) {
    merge_departures(end);
  }
  recording_.reset();
  alignment_.reset();
  ++iteration_;
  return end;
}

}  // namespace ferry
