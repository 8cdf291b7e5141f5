#pragma once
// What a ChunkedModel tells the objects attached to it: its GradSink (the optimizer: HybridAdam is one)
// hears of every gradient, of the user's writes and of the model's phases; its LayoutListener hears of
// repacks; its PlanAgreement makes the ranks of a data-parallel run plan their activations alike. Each
// is set on the model (set_grad_sink, set_layout_listener, set_plan_agreement), not owned by it, and
// must stay attached no longer than it lives.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "../scheduler/memory_plan.h"

namespace ferry {

// A parameter the user wrote since the model last looked (Note [Writes to parameters]): in place, its
// slot now holding what was written (`replacement` undefined); or by giving the tensor other storage
// (`set_()`, `set_data()`, torch::load), `replacement` then being that tensor, as given (any floating
// dtype, its full precision), the slot holding it in the compute dtype.
struct WrittenParam {
  int64_t param = -1;
  at::Tensor replacement;
};

// Receives each parameter's gradient during backward (on autograd's thread), already multiplied by the
// loss scale. The tensor is only valid during the call. For one landing the calls come in this order:
// before_landing, (the model writes the slot), land_grad, (the model releases the slot), after_landing.
class GradSink {
 public:
  virtual ~GradSink() = default;
  // false: land_grad gets autograd's gradient (compute dtype, on the device). true: the model first
  // writes it into the parameter's slot (Note [Gradient in the parameter slot]; a second gradient of
  // the same parameter in one backward is added there) and land_grad gets the slot.
  virtual bool grads_into_param_slots() const { return false; }
  // Before anything is written: may refuse the gradient by throwing (backward then fails).
  virtual void before_landing(int64_t /*param*/) {}
  virtual void land_grad(int64_t param, const at::Tensor& grad) = 0;
  // After the landing, with the parameter's chunk no longer held: the sink may move it.
  virtual void after_landing(int64_t /*param*/) {}
  // After an op inside this model's backward used the parameter (its chunk no longer held). A chunk may
  // still be used after all its gradients landed (a frozen layer the gradient flows through to
  // trainable ones below it): a sink that moves or locks a chunk once its gradients are final must wait
  // for its last use too.
  virtual void used_in_backward(int64_t /*param*/) {}
  // backward() has run to its end (`aborted`: it threw), before the model ends the iteration (which
  // may repack the chunks): work the sink started on the chunks during backward must be done on return.
  virtual void backward_finished(bool /*aborted*/) {}
  // Updates the sink left running on parameter chunks when its step returned (Note [Update behind the
  // next forward], optim/deferred_updates.h). await_param(p) returns once p's chunk holds its new values,
  // await_params() once every chunk does; either rethrows an error such an update threw. The model
  // calls await_param before every use of a parameter, and await_params before anything else reads,
  // writes or moves the parameters (param_values, state_dict, load_state_dict, materialize, the end of
  // an iteration, where the warm-up repack runs). Both must be cheap when nothing is running.
  virtual void await_param(int64_t /*param*/) {}
  virtual void await_params() {}
  // Parameters the user wrote (Note [Writes to parameters]), told before the model uses them again and
  // while every slot holds its value: an optimizer whose own copy of the values is the truth (fp32
  // masters) takes the writes into it, so that its next update starts from what was written.
  virtual void values_written(const std::vector<WrittenParam>& /*written*/) {}
  // Some parameter's requires_grad changed since the last forward (a layer frozen or unfrozen during
  // fine-tuning), told before the next one: gradients land from every parameter that requires grad
  // when its backward runs, so what a step receives changes.
  virtual void trainable_changed() {}
  // The activation plan changed since the last forward (hooks/activation_segments.h): a segment now
  // kept is not recomputed in backward (or one now recomputed is), so the parameters' uses in backward
  // differ from those of earlier backwards. Told before the next forward, like trainable_changed().
  virtual void backward_uses_changed() {}
  // The model is being destroyed with this sink still attached (an optimizer declared before its model
  // outlives it), after await_params(): the sink must never call the model again.
  virtual void model_gone() {}
};

// Told when the parameters have been repacked into a new layout: between iterations, at the end of
// the iteration that finished the warm-up, before the model is used again. Whoever mirrors the layout
// (HybridAdam's optimizer state) migrates to it there, with fill_layout (chunk/repack.h).
class LayoutListener {
 public:
  virtual ~LayoutListener() = default;
  virtual void layout_changed() = 0;
};

// Makes the ranks of a data-parallel run make the same activation plan at the same moment (Note [An
// activation plan agreed across ranks], dist/plan_agreement.h). Both calls are collectives: the model
// makes them on every rank, from the thread that ends the training iteration, in the same order.
class PlanAgreement {
 public:
  virtual ~PlanAgreement() = default;
  // At the end of every training iteration under activations=auto: whether every rank plans now, from
  // this rank's readiness, wish and count of segments (false on every rank when the counts differ).
  virtual bool plan_now(bool ready, bool wanted, int64_t segments) = 0;
  // The input every rank solves, from this rank's.
  virtual MemoryPlanInput agree(const MemoryPlanInput& mine) = 0;
};

}  // namespace ferry
