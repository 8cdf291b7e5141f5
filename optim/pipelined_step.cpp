#include "pipelined_step.h"

#include <ATen/ops/all.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "../common/event_trace.h"
#include "../common/logging.h"

namespace ferry::optim {

using trace::now_ns;

void PipelinedStep::arm(bool armed) {
  const int64_t n = parts_.placement.num_chunks();
  parts_.finality.begin(parts_.model.layout(), armed);
  launched_.assign(n, 0);
  late_.assign(parts_.model.num_params(), 0);
  late_chunks_.assign(n, 0);
  if (!armed || parts_.ownership.world() == 1) return;
  // Note [A gradient after its chunk's update] at N > 1: a late landing cannot be taken (the group's
  // reduce-scatter has left), so a chunk with a trainable parameter that no backward has reached yet
  // waits for backward's end. The same on every rank: requires_grad joins the landings' fingerprint.
  // (Cost: those chunks' updates are not overlapped while it lasts, for good for a parameter that never
  // trains: it should not require grad. Told once.)
  const auto& slots = parts_.model.layout().slots();
  int64_t waiting = 0, first = -1;
  for (int64_t p = 0; p < parts_.model.num_params(); ++p) {
    if (parts_.finality.expected(p) != 0 || !parts_.model.param(p).requires_grad()) continue;
    parts_.finality.hold(slots[p].chunk);
    if (waiting++ == 0) first = p;
  }
  if (waiting > 0 && !told_unreached_) {
    told_unreached_ = true;
    log::info("ferry: backward_step: ", waiting, " parameter(s) that require grad (", parts_.model.param_name(first),
              " first) had no gradient in any backward yet; across ranks their chunks wait for backward's end until "
              "they do (a parameter that never trains should not require grad)");
  }
}

void PipelinedStep::start(Kind kind, bool cancellable) {
  const int64_t n = parts_.placement.num_chunks();
  kind_ = kind;
  cancellable_ = cancellable && kind == Kind::kEager;
  active_ = true;
  outcomes_.assign(n, ChunkOutcome{});
  device_norms_.assign(n, {});
  trip_norms_.assign(n, {});
}

std::optional<ChunkOutcome> PipelinedStep::trip_outcome(int64_t chunk, const std::vector<Span>& spans) const {
  if (chunk >= static_cast<int64_t>(trip_norms_.size()) || !trip_norms_[chunk].norms.defined()) return std::nullopt;
  if (trip_norms_[chunk].spans != spans) return std::nullopt;
  return ChunkUpdates::outcome_of(trip_norms_[chunk].norms);
}

void PipelinedStep::unlaunch(int64_t chunk) {
  launched_[chunk] = 0;
  if (chunk < static_cast<int64_t>(device_norms_.size())) device_norms_[chunk] = at::Tensor();
}

int64_t PipelinedStep::num_launched() const { return std::count(launched_.begin(), launched_.end(), 1); }

bool PipelinedStep::any_late() const {
  return std::any_of(late_chunks_.begin(), late_chunks_.end(), [](char l) { return l != 0; });
}

int64_t PipelinedStep::take_late(int64_t* first) {
  const int64_t count = std::count(late_.begin(), late_.end(), 1);
  if (first != nullptr && count > 0) {
    *first = std::find(late_.begin(), late_.end(), 1) - late_.begin();
  }
  clear_late();
  return count;
}

void PipelinedStep::clear_late() {
  late_.clear();
  late_chunks_.clear();
}

void PipelinedStep::launch(int64_t c) {
  launched_[c] = 1;
  ChunkStore& params = parts_.model.store();
  const ChunkId pc = parts_.model.param_chunk(c);
  std::vector<Span> spans = parts_.ledger.spans(parts_.model.layout(), c);
  if (parts_.placement.on_device(c)) {
    // No host stall: a move to the device only orders the compute stream after the copy.
    trace::Span span("adam", trace::enabled() ? "pipelined device adam chunk " + std::to_string(c) : std::string());
    if (params.location(pc) != Location::kDevice) params.move(pc, Location::kDevice);
    device_norms_[c] = parts_.updates.device_norms(c, params.payload(pc), spans);
    if (eager() && !spans.empty()) {
      const at::Tensor found_inf = at::logical_not(at::isfinite(device_norms_[c]).all()).to(at::kFloat);
      parts_.updates.device_update(c, 1.0, found_inf);
    }
    return;
  }
  if (!eager() && parts_.jobs.round_trips() && params.location(pc) == Location::kDevice) {
    // Note [Round trips through K buffers]: the two-phase step's norms on the device, as a device-state
    // chunk's, and no job: the chunk's one trip is its update's, queued after backward.
    device_norms_[c] = parts_.updates.device_norms(c, params.payload(pc), spans);
    return;
  }
  const HostState state = parts_.placement.host_state(c, parts_.ownership.owned(c), /*moments=*/true, parts_.model.layout());
  // Note [Norms before the trip]: eager, a chunk still on the device has its norms taken there, before
  // its move below, so that its job reads its gradients once, in the update.
  at::Tensor trip;
  if (eager() && !spans.empty() && params.location(pc) == Location::kDevice) {
    trip = parts_.updates.norms_before_the_trip(c, params.payload(pc), spans);
    trip_norms_[c] = TripNorms{trip, spans};
  }
  auto work = [this, c, spans = std::move(spans), eager = eager(), state, trip](const at::Tensor& g) {
    const ChunkOutcome out = trip.defined() ? ChunkUpdates::outcome_of(trip) : parts_.updates.host_norm(c, g, spans);
    if (eager) {
      if (out.finite) {
        parts_.updates.run_host(parts_.updates.adam_spans(spans, state, g),
                                UpdateOptions{1.0, /*grads_checked=*/true});
      } else {
        ChunkUpdates::restore_values(g, state.master_tensor, spans);
      }
    }
    outcomes_[c] = out;
  };
  // Eager, the job is the chunk's last work in the step: it may take the chunk on a round trip (Note
  // [Round trips through K buffers]); the two-phase step's chunk waits on the host for its update.
  const Trip travel = kind_ == Kind::kEager ? Trip::kRoundTrip : Trip::kStay;
  if (cancellable_) {
    parts_.jobs.launch_cancellable(params, pc, c, "pipelined host adam chunk ", std::move(work), travel);
  } else {
    parts_.jobs.put(c, parts_.jobs.launch(params, pc, c, "pipelined host adam chunk ", std::move(work),
                                          /*background_write=*/false, travel));
  }
}

bool PipelinedStep::late_landing(int64_t param, int64_t c, bool accumulation) {
  const int64_t landed = parts_.finality.landings(param);
  // The next backwards expect it (Note [Expectations only grow]).
  const int64_t saw = parts_.finality.expect(param, landed + 1);
  if (late(param)) return false;                // its update runs after backward: take every contribution
  const bool untouched = !parts_.ledger.landed(param);  // no span of the chunk's job holds it
  if (!across_ranks() && (!eager() || untouched)) {
    if (accumulation) {
      parts_.jobs.supersede(c);  // the chunk is consumed again when backward ends
    } else {
      parts_.jobs.wait(c);  // its errors surface where the jobs are joined
    }
    if (!eager()) {  // only its norm was taken: taken again after backward
      unlaunch(c);
      return false;
    }
    late_[param] = 1;
    late_chunks_[c] = 1;
    // Accumulation: the slot is consumed again when backward ends (into the accumulation chunk).
    return accumulation;
  }
  TORCH_CHECK(false, "ferry: HybridAdam::backward_step: parameter ", parts_.model.param_name(param), " got gradient "
              "contribution ", landed + 1, " after its chunk's update had started (the backward",
              accumulation ? "s" : "_steps", " before had at most ", saw, "; Note [A gradient after its chunk's "
              "update]). The next backwards expect it",
              accumulation ? "; the gradients of this one that landed wait in their slots (zero_grad() discards them)."
                           : ".");
}

bool PipelinedStep::update_unlaunched(const ChunkNorms& norms, bool accumulate_grads, StepResult& result,
                                      const std::function<bool(int64_t)>& defer_host) {
  bool all_finite = true;
  for (int64_t c = 0; c < parts_.placement.num_chunks(); ++c) {
    // A launched chunk's late part (Note [A gradient after its chunk's update]) is updated as an
    // unlaunched chunk is, on its own norm.
    const bool late_part = launched(c) && has_late(c);
    if (launched(c) && !late_part) continue;
    const std::vector<char>* only = late_part ? &late_ : nullptr;
    const std::vector<Span> spans = parts_.ledger.spans(parts_.model.layout(), c, only);
    if (spans.empty()) continue;
    const int64_t t0 = now_ns();
    if (!(late_part ? norms.late_finite[c] : norms.finite[c])) {
      all_finite = false;
      // Default mode: the slots hold gradients; they get their values back. (Accumulation chunks keep theirs.)
      if (!accumulate_grads) {
        ChunkUpdates::restore_values(parts_.updates.grad_payload(c), parts_.placement.payload(kMasterRole, c), spans);
      }
    } else if (parts_.placement.on_device(c)) {
      parts_.updates.device_update(c, 1.0, {}, only);
      result.device_update_ns += now_ns() - t0;
    } else if (!late_part && defer_host && defer_host(c)) {
      ++result.deferred_chunks;
      result.host_update_ns += now_ns() - t0;  // queueing only
    } else {
      // Accumulation: the job of the launched part wrote its values into the parameter chunk; the late
      // part's are written too, in the update's pass where the chunk is on the host, else by the write-back.
      if (late_part && accumulate_grads) parts_.updates.unmark_written(c);
      parts_.updates.host_update(c, UpdateOptions{1.0, /*grads_checked=*/true}, only);
      result.host_update_ns += now_ns() - t0;
    }
  }
  return all_finite;
}

}  // namespace ferry::optim
