// PhaseTimer (see phase_timer.h).
#include "phase_timer.h"

#include <c10/util/Exception.h>

#include "../common/event_trace.h"

namespace ferry {

PhaseTimer::PhaseTimer(const std::function<std::unique_ptr<StreamMark>()>& make_mark) {
  for (auto& mark : marks_) {
    mark = make_mark();
    TORCH_CHECK(mark != nullptr, "ferry: PhaseTimer needs marks, got none");
  }
}

void PhaseTimer::forward_begins() {
  forward_marked_ = backward_marked_ = false;
  marks_[kForwardBegin]->record();
}

void PhaseTimer::forward_ends() {
  marks_[kForwardEnd]->record();
  forward_marked_ = true;
}

void PhaseTimer::backward_begins() { marks_[kBackwardBegin]->record(); }

void PhaseTimer::backward_queued() { marks_[kBackwardEnd]->record(); }

PhaseSeconds PhaseTimer::seconds() const {
  PhaseSeconds s;
  if (forward_marked_) s.forward = marks_[kForwardEnd]->seconds_since(*marks_[kForwardBegin]);
  if (backward_marked_) s.backward = marks_[kBackwardEnd]->seconds_since(*marks_[kBackwardBegin]);
  return s;
}

void PhaseTimer::trace(const ClockAnchor& anchor) const {
  auto host_ns = [&](Mark m) { return anchor.host_ns(*marks_[m]); };
  if (forward_marked_) trace::complete_on("device", "device", "forward", host_ns(kForwardBegin), host_ns(kForwardEnd));
  if (backward_marked_) {
    trace::complete_on("device", "device", "backward", host_ns(kBackwardBegin), host_ns(kBackwardEnd));
  }
}

}  // namespace ferry
