#pragma once
// PhaseTimer: the last iteration's forward() and backward() as the device ran them, on its own clock
// (CopyEngine's StreamMark; D54). Each phase runs from when the device reached its first work to when it
// finished the last work the phase queued on the caller's stream. Several forwards of one iteration
// (Note [Several forwards]) are one forward phase, from the first one's start to the last one's end.
//
// Contract: not thread-safe; the thread that drives the model calls it, in this order per iteration:
// forward_begins (the iteration's first forward), forward_ends (each forward), then, with a backward,
// backward_begins, backward_queued (autograd queued its last kernel), backward_ends (the backward
// completed: the phase counts). A phase that did not run to its end reads -1. seconds() and trace()
// block until the marked work has run (cheap after a synchronisation).
#include <array>
#include <functional>
#include <memory>

#include "../chunk/copy_engine.h"

namespace ferry {

// The last iteration's phases on the device's own clock (ChunkedModel::last_phase_seconds); -1: the
// phase did not run to its end.
struct PhaseSeconds {
  double forward = -1;
  double backward = -1;
};

class PhaseTimer {
 public:
  // Its marks come from `make_mark` (ChunkStore::make_mark: the device's clock), made now: the device
  // never changes (a repack keeps it).
  explicit PhaseTimer(const std::function<std::unique_ptr<StreamMark>()>& make_mark);

  void forward_begins();
  void forward_ends();
  void backward_begins();
  void backward_queued();
  void backward_ends() { backward_marked_ = true; }
  PhaseSeconds seconds() const;
  // Writes the phases that ran to their end into the event trace on track "device", placed on the
  // host's clock by `anchor`.
  void trace(const ClockAnchor& anchor) const;

 private:
  enum Mark { kForwardBegin, kForwardEnd, kBackwardBegin, kBackwardEnd, kMarks };
  std::array<std::unique_ptr<StreamMark>, kMarks> marks_;
  bool forward_marked_ = false, backward_marked_ = false;  // which phases this iteration closed
};

}  // namespace ferry
