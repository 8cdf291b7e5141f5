#include "slot_accumulation.h"

#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "../common/event_trace.h"

namespace ferry::optim {

void SlotAccumulation::before_landing(int64_t param, int64_t c) {
  if (pipeline_.active() && pipeline_.eager() && pipeline_.launched(c)) {
    if (pipeline_.late_landing(param, c, /*accumulation=*/true)) consumed_[c] = 0;
    return;
  }
  if (!armed_ || !consumed_[c]) return;
  // A landing this backward did not have last time, on a chunk already consumed: its job (which
  // holds the chunk on the host) ends first; the chunk is consumed again when backward ends. In the
  // two-phase step only the chunk's norm was taken: the step takes it again.
  parts_.jobs.supersede(c);
  consumed_[c] = 0;
  if (pipeline_.active() && pipeline_.launched(c)) pipeline_.unlaunch(c);
}

void SlotAccumulation::land(int64_t param) {
  if (!armed_) {
    // With no previous backward every count is 0: no chunk is final early, end_backward consumes all.
    // Armed at the first landing: the uses seen before it are left out (Note [A chunk final before its
    // last use]).
    parts_.finality.begin(parts_.model.layout(), /*count_down=*/true, /*sized=*/true);
    in_slot_.assign(parts_.model.num_params(), 0);
    consumed_.assign(parts_.placement.num_chunks(), 0);
    armed_ = true;
  }
  in_slot_[param] = 1;
}

void SlotAccumulation::consume_final(int64_t c) {
  // backward_step of the last micro-batch: the chunk's norm follows its accumulation, and its host
  // update too unless clipping or loss scaling make the step two-phase.
  consume(c, !pipeline_.active() ? Then::kNothing : pipeline_.eager() ? Then::kNormAndUpdate : Then::kNorm);
}

std::exception_ptr SlotAccumulation::end_backward() {
  if (!armed_) return nullptr;
  // Chunks not final during backward (the first backward: all) are consumed now, an aborted backward's
  // too: what landed is accumulated, as the per-parameter add did.
  for (int64_t c = 0; c < parts_.placement.num_chunks(); ++c) {
    if (!consumed_[c]) consume(c, Then::kNothing);
  }
  // What the next backward expects (Note [Expectations only grow]); an aborted one's landings are a
  // part of what it would have had.
  parts_.finality.learn_landings(/*complete=*/true);
  armed_ = false;
  // The accumulation jobs are the only ones queued in this mode: their errors surface here.
  return parts_.jobs.join();
}

void SlotAccumulation::consume(int64_t c, Then then) {
  consumed_[c] = 1;
  std::vector<Span> spans;
  for (int64_t t : parts_.model.layout().chunks()[c].tensors) {
    const Slot& slot = parts_.model.layout().slots()[t];
    if (!in_slot_[t] || slot.numel == 0) continue;
    spans.push_back({parts_.ledger.group_of(t), slot.offset, slot.offset + slot.numel});
    in_slot_[t] = 0;
    parts_.model.clear_grad_slot(t);  // its value is back before anything can read the slot again
  }
  if (spans.empty()) return;
  trace::Span span("adam", trace::enabled() ? "accumulate chunk " + std::to_string(c) : std::string());
  at::Tensor acc = parts_.placement.payload(kGradRole, c);  // allocated where the state lives (D46)
  ChunkStore& params = parts_.model.store();
  const ChunkId pc = parts_.model.param_chunk(c);
  if (!parts_.ownership.owned(c)) {
    // No master here: the slots keep the gradients until the values come from their owners (N > 1).
    TORCH_INTERNAL_ASSERT(!parts_.placement.on_device(c), "device state for chunk ", c, ", which rank ", parts_.ownership.rank(),
                          " does not own");
    parts_.jobs.put(c, parts_.jobs.launch(params, pc, c, "accumulate chunk ", [acc, spans = std::move(spans)](const at::Tensor& g) {
      for (const Span& sp : spans) acc.slice(0, sp.begin, sp.end).add_(g.slice(0, sp.begin, sp.end));
    }));
    return;
  }
  if (parts_.placement.on_device(c)) {  // queued on the compute stream: no host stall
    if (params.location(pc) != Location::kDevice) params.move(pc, Location::kDevice);
    const at::Tensor g = params.payload(pc);
    for (const Span& sp : spans) acc.slice(0, sp.begin, sp.end).add_(g.slice(0, sp.begin, sp.end));
    ChunkUpdates::restore_values(g, parts_.placement.payload(kMasterRole, c), spans);
    if (then == Then::kNorm) {  // the eager step updates device chunks after backward
      pipeline_.set_device_norms(c, parts_.updates.device_norms(c, acc, parts_.ledger.spans(parts_.model.layout(), c)));
      pipeline_.mark_launched(c);
    }
    return;
  }
  // The norm step() would take of this chunk (the same spans of the same accumulated gradients): the
  // chunk's landings in this backward are complete, and a later one is refused or, before any update
  // started, makes the step take it again (before_landing).
  std::vector<Span> landed;
  if (then != Then::kNothing) {
    landed = parts_.ledger.spans(parts_.model.layout(), c);
    pipeline_.mark_launched(c);
  }
  const bool update = then == Then::kNormAndUpdate;
  const HostState state = parts_.placement.host_state(c, /*held=*/true, /*moments=*/update, parts_.model.layout());
  parts_.jobs.put(c, parts_.jobs.launch(
                   params, pc, c, update ? "accumulate + host adam chunk " : "accumulate chunk ",
                   [this, c, acc, spans = std::move(spans), landed = std::move(landed), then, update,
                    state](const at::Tensor& g) {
                     // add_ widens the bf16/fp16 gradients into fp32, as the per-parameter add did.
                     for (const Span& sp : spans) acc.slice(0, sp.begin, sp.end).add_(g.slice(0, sp.begin, sp.end));
                     ChunkOutcome out;
                     if (then != Then::kNothing) {
                       out = parts_.updates.host_norm(c, acc, landed);
                       pipeline_.set_outcome(c, out);
                     }
                     if (!update || !out.finite) {
                       // the slots get their values back (round(master))
                       ChunkUpdates::restore_values(g, state.master_tensor, spans);
                       return;
                     }
                     // The update writes the new values into the slots in its own pass (fp32: copied
                     // after): the chunk is locked on the host for this job, so no write-back pass is
                     // needed for it.
                     const bool lowp = g.scalar_type() != at::kFloat;
                     parts_.updates.run_host(parts_.updates.adam_spans(landed, state, acc,
                                                           lowp ? g : at::Tensor()),
                                       UpdateOptions{1.0, /*grads_checked=*/true});
                     if (!lowp) ChunkUpdates::restore_values(g, state.master_tensor, landed);
                     parts_.updates.mark_written(c);
                   }));
}

}  // namespace ferry::optim
