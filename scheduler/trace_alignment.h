#pragma once
// TraceAlignment: one iteration's parameter uses aligned against the trace it follows, and the trace
// that iteration leaves behind (Note [A run that departs from its trace]).
//
// Note [A run that departs from its trace]
// A model whose uses differ from one iteration to the next is common: layers skipped at random
// (LayerDrop, stochastic depth), experts that receive no token this step, an auxiliary head used every
// k-th step. Until D98 the first use that differed from the trace ended the following: LRU and no
// prefetch for the rest of the iteration, and the next iteration recorded again (LRU, no prefetch
// either), so such a model never had a prefetch in a whole iteration. Now each use is aligned:
//  - the expected position (the cursor) matches: it advances;
//  - else the position nearest to the cursor, ahead or behind, that holds the parameter and was not
//    used in this iteration yet matches, and the cursor goes to just after it: ahead, the positions
//    passed over were skipped (a branch not taken, however long: an early exit); behind, the uses came
//    in another order. Nearest, not ahead first: a parameter used again later (tied weights, its
//    backward use) must not pull the cursor past uses that are merely swapped;
//  - else (the trace has no unused position of it left) the use is unforeseen: served on demand (no
//    prefetch brought it), remembered with the cursor it came at, and the cursor stays.
// OPT, prefetch and the per-moment budget read the matched position, so the next chunks keep moving
// in ahead of their uses. When backward begins, the trace's backward uses of parameters this forward
// did not use are known not to come (autograd computes no gradient for them): OPT does not keep their
// chunks for them and prefetch passes them over (begin_backward()). The iteration's end merges what it
// saw into the trace (merged_trace()): each unforeseen use is inserted before the position it came at;
// positions no training iteration used for TraceState::kPruneAfter iterations in a row are dropped.
// The trace becomes the order of what recent iterations used, a superset of each: a skipped forward
// use costs a prefetch that was not needed, an unforeseen use a demand move.
// The caller (TraceState) gives up aligning (the old rule: LRU, record the next iteration) when
// unforeseen uses of parameters the trace holds pile up: the trace is no longer this program's. Uses
// of parameters it never had do not count: recording afresh would not serve them better than the merge
// (a step of LayerDrop records a trace without its skipped blocks; later steps bring them).
//
// What it buys and costs, measured: docs/ARCHITECTURE.md D98.
//
// Note [Skips said ahead]
// A skip learnt only when it comes is paid for by then: the prefetches issued in ahead of the skipped
// block have moved its chunks in, and pushed out others (D106 measured 8-13 % more bytes than the
// departing steps' own floors). A model that draws its skips when the step begins (LayerDrop draws
// every block's at once) can say them then: ferry::will_skip(block) (hooks/skip_hint.h) ->
// Scheduler::will_not_use -> pass_over(), which marks every position of the block's parameters passed
// over, forward and backward, so prefetch walks past them and OPT counts no next use there, as
// begin_backward() does for backward alone. What a hint can get wrong changes no result and no use:
// a hinted parameter that is used anyway still matches its position (its chunk may have to come on
// demand: counted in hints_broken()), and begin_backward() recomputes backward's passed-over
// positions from the uses forward made, hints or not.
//
// Contract: not thread-safe (TraceState calls it with the scheduler's mutex held). The trace must
// outlive the alignment and stay unchanged while it aligns.
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "access_trace.h"

namespace ferry {

class TraceAlignment {
 public:
  explicit TraceAlignment(const AccessTrace& trace);

  // Aligns the next use of `param` (its chunk now: `chunk`; `in_use`: the parameters in use beside it, as
  // AccessTrace::record takes them). Returns the trace position it matched, or -1: unforeseen
  // (remembered with `in_use`, so that the merged trace pins their chunks at it too).
  int64_t align(TensorId param, ChunkId chunk, const std::vector<TensorId>& in_use = {});
  // The backward pass begins: unforeseen uses from here on are backward's. When the iteration departed
  // from the trace before it, a parameter it did not use has no gradient to compute (autograd only
  // reaches what forward used), so the trace's backward positions of such parameters will not come:
  // returns them (one entry per position, 1 where passed over), or null when there are none (always
  // when nothing departed); passed_over() has them from then on. They can still match.
  std::shared_ptr<const std::vector<char>> begin_backward();
  // The model says, ahead, that this iteration will not use `params` (a block it skips: ferry::will_skip,
  // Note [Skips said ahead]): their positions are passed over from now on, forward and backward, as
  // begin_backward() passes over the backward positions of a parameter forward did not use. Ignored in
  // backward (begin_backward() knows what forward used) and for a parameter this iteration used already
  // (its backward comes). Returns passed_over() (unchanged when nothing was added). The positions can
  // still match: a hint proven wrong costs moves, never a use.
  std::shared_ptr<const std::vector<char>> pass_over(const std::vector<TensorId>& params);
  // The passed-over positions (one entry per position, 1 where passed over; null: none so far).
  const std::shared_ptr<const std::vector<char>>& passed_over() const { return passed_over_; }
  // Positions passed over on the model's word (pass_over), and those of them matched anyway (count).
  int64_t hinted() const { return hinted_; }
  int64_t hints_broken() const { return hints_broken_; }

  // The trace position expected next (size() of the trace: past its end).
  int64_t cursor() const { return cursor_; }
  int64_t matched() const { return matched_; }                  // uses matched (count)
  int64_t unforeseen() const { return static_cast<int64_t>(unforeseen_.size()); }  // count
  // ... of them, uses of parameters the trace has no position of at all (a part its recording skipped:
  // LayerDrop in the step that recorded it; a branch taken for the first time). Count.
  int64_t unforeseen_absent() const { return unforeseen_absent_; }
  // Whether trace position q was used in this iteration.
  bool used(int64_t position) const { return used_[position] != 0; }
  // Trace positions not used in this iteration (count).
  int64_t skipped() const { return trace_->size() - matched_; }

  // The trace after this iteration: its unforeseen uses inserted (each before the position expected when it came;
  // several there in the order they came), and the positions where `keep` is false dropped (keep: one entry per
  // position of the trace). An inserted use's non-model bytes are the larger of its neighbours', its tensors in use
  // those align() was given. origin[i]: the old position of new position i, or -1 where inserted.
  struct Merged {
    std::shared_ptr<AccessTrace> trace;
    std::vector<int64_t> origin;
  };
  Merged merged_trace(const std::vector<char>& keep) const;

 private:
  struct Unforeseen {
    int64_t before;  // the cursor when it came
    TensorId param;
    ChunkId chunk;
    bool backward;
    std::vector<TensorId> in_use;  // the parameters in use beside it
  };
  // The unused position holding `param` nearest to the cursor (ahead first at equal distance); -1 if
  // none (within kWalk used positions of it on each side of the cursor).
  int64_t find_nearest(TensorId param);
  static constexpr int64_t kWalk = 64;
  void take(int64_t position);
  // The trace's positions of `param`, ascending (a range of by_param_, sorted when first needed).
  std::pair<std::vector<int64_t>::const_iterator, std::vector<int64_t>::const_iterator> positions_of(TensorId param);

  const AccessTrace* trace_;
  int64_t cursor_ = 0;
  int64_t matched_ = 0;
  bool in_backward_ = false;
  std::vector<char> used_;
  std::vector<int64_t> by_param_;  // the trace's positions ordered by (parameter, position); made when first needed
  std::vector<Unforeseen> unforeseen_;
  int64_t unforeseen_absent_ = 0;
  std::shared_ptr<const std::vector<char>> passed_over_;  // set by pass_over() and begin_backward()
  std::vector<char> hinted_at_;                           // per position: passed over by pass_over()
  int64_t hinted_ = 0, hints_broken_ = 0;
};

}  // namespace ferry
