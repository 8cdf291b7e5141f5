#pragma once
// TraceState: the scheduler's access trace through its life. The first `warmup_iterations` iterations
// record; the last recording becomes the trace in use; later iterations follow it, each use aligned
// against it (TraceAlignment, Note [A run that departs from its trace]): uses the iteration skips,
// takes in another order or makes unforeseen keep the following going, and the iteration's end merges
// them into the trace (a new version). When unforeseen uses of parameters the trace holds pile up
// (more than max(16, a quarter of the trace)), or in strict mode at the first use that differs, the iteration gives up the trace
// (diverged) and the next one is recorded again (a re-trace). It also counts iterations, numbers each
// trace (its version: what every rank must agree on before forward releases follow it) and says once,
// after the warm-up, that the layout should be repacked in first-use order.
//
// Strict mode (align false: SchedulerOptions::align_to_trace): positions are the uses' indices and any
// difference gives up, as before D98. Both modes are functions of the uses (and hints) alone, so ranks
// that use the parameters alike follow alike (sharded groups are fetched by collectives in that order).
//
// A forward-only (evaluation) recording becomes the trace only while there is none from a training
// iteration: evaluation between training steps would otherwise flip the trace back and forth. An
// evaluation that follows a training trace changes nothing in it (its missing backward is not a skip),
// and a training iteration that follows an evaluation's trace gives up at its first difference.
//
// Contract: not thread-safe (the Scheduler calls it with its mutex held). Call order per iteration:
// begin_iteration, then per use use() (and the recording's record while recording()), begin_backward
// when backward starts, end_iteration. Finalizing a trace it adopted (chunk remap, next-use index) is
// the caller's.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "access_trace.h"
#include "trace_alignment.h"

namespace ferry {

class TraceState {
 public:
  // `align` (SchedulerOptions::align_to_trace): false is strict mode.
  TraceState(int warmup_iterations, bool align);

  // An iteration begins; returns whether it records (warm-up, no trace yet, or a re-trace).
  bool begin_iteration();
  // A use of `param` (in chunk `chunk` now; `in_use`: the parameters in use beside it, kept with an
  // unforeseen use for the merged trace). While following(): aligned against the trace; returns the
  // trace position it matched, or -1 (an unforeseen use, or the iteration gave up the trace here: see
  // following()). -1 also while not following. Uses of a diverged iteration are said in the log once
  // per process (unless the trace was an evaluation's).
  int64_t use(int64_t param, ChunkId chunk, const std::vector<TensorId>& in_use = {});
  // Uses so far in this iteration.
  int64_t position() const { return uses_; }
  // While following(): the trace position expected next.
  int64_t cursor() const;
  // The backward pass begins (recorded in a recording; unforeseen uses from here are backward's).
  // While following: the trace's positions this backward will not come to (TraceAlignment), or null.
  std::shared_ptr<const std::vector<char>> begin_backward();
  // The model says this iteration will not use `params` (TraceAlignment::pass_over, Note [Skips said
  // ahead]). While following aligning: the positions passed over since; else null (nothing to pass over:
  // recording, strict mode, given up).
  std::shared_ptr<const std::vector<char>> pass_over(const std::vector<TensorId>& params);
  // The positions passed over (pass_over, begin_backward) to the iteration's end (null: none, or not following).
  const std::vector<char>* passed_over() const {
    return following() && alignment_ ? alignment_->passed_over().get() : nullptr;
  }
  // Whether this iteration follows the trace: there is one, it records nothing, and it has not given up.
  bool following() const { return trace_ && !recording_ && !diverged_; }
  // The recording of this iteration, or null when it does not record.
  AccessTrace* recording() const { return recording_.get(); }

  struct IterationEnd {
    bool adopted = false;     // a new trace is in use (a complete recording, or a merge): finalize it
    bool merged = false;      // ... made by merging this iteration's departures (no recording)
    int64_t skipped = 0;      // trace positions this training iteration did not use (count)
    int64_t unforeseen = 0;   // uses the trace did not have (count)
    int64_t hinted = 0;       // positions passed over on the model's word (TraceAlignment::hinted)
    int64_t hints_broken = 0; // ... of them used anyway
  };
  // Ends the iteration (`forward_only`: no backward).
  IterationEnd end_iteration(bool aborted, bool forward_only);

  // The trace in use: the finalized one (null before the warm-up ends).
  const std::shared_ptr<AccessTrace>& trace() const { return trace_; }
  bool trace_is_forward_only() const { return trace_ && trace_forward_only_; }
  // Incremented whenever a trace is adopted (recorded or merged).
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

  // A position no training iteration used for this many in a row is dropped from the trace.
  static constexpr int64_t kPruneAfter = 4;
  // Giving up: more unforeseen uses in one iteration than max(this, a quarter of the trace), not
  // counting those of parameters the trace has no position of (TraceAlignment::unforeseen_absent).
  static constexpr int64_t kGiveUpMin = 16;

 private:
  void give_up(const std::string& why);
  void adopt(std::shared_ptr<AccessTrace> trace);
  // Ends a training iteration that followed the trace; fills `end`.
  void merge_departures(IterationEnd& end);

  int warmup_iterations_;
  bool align_;
  std::shared_ptr<AccessTrace> trace_;      // the finalized trace in use (null before the warm-up ends)
  std::shared_ptr<AccessTrace> recording_;  // the trace being recorded this iteration (null if following)
  std::optional<TraceAlignment> alignment_;  // this iteration's, while it follows aligning
  int64_t uses_ = 0;
  int64_t iteration_ = 0;
  int64_t trained_ = 0;              // training iterations that followed the trace to their end
  std::vector<int64_t> last_used_;   // per trace position: the value of trained_ when it was last used
  int warmups_done_ = 0;
  bool retrace_next_ = false;
  bool repack_wanted_ = false;
  bool diverged_ = false;
  bool trace_forward_only_ = false;
  int64_t trace_version_ = 0;
};

}  // namespace ferry
