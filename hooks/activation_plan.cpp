// ChunkedModel's activation plan (Config::activations = auto): when and from what it is made.
#include <algorithm>
#include <sstream>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

#include "../common/event_trace.h"
#include "../common/logging.h"
#include "chunked_model.h"

namespace ferry {

// Note [When the activation plan is made]
// The plan needs every segment measured (a forward and backward under auto recomputes and measures
// each one) and the device's room as the rest of the step will leave it: the parameter chunks, the
// optimizer state the optimizer placed on the device, and the non-model memory the trace saw with every
// segment recomputed. HybridAdam places its state at the first step after the warm-up (optim/
// state_placement.h), so the plan waits for one iteration past the warm-up and the kept segments take
// the room the state left (asked to, plan_state_with_activations, HybridAdam then decides the state's
// place and the segments again in one solve at the end of the next step and replaces this plan: Note
// [The joint placement], optim/engine.cpp); a model without an optimizer attached plans at the end of
// its warm-up. A changed plan changes the uses backward makes (a kept segment is not recomputed) and
// the non-model memory at each moment, so the scheduler records the next iteration as a new trace.
// At world size > 1 the ranks decide together when to plan and from what (Note [An activation plan
// agreed across ranks], dist/plan_agreement.h): the PlanAgreement HybridAdam sets votes at the end of
// every training iteration, on every rank, whatever this rank wants.
void ChunkedModel::plan_activations_if_wanted() {
  if (activations_.policy() != ActivationPolicy::kAuto) return;
  const bool ranks = config_.world_size > 1;
  if (ranks && plan_agreement_ == nullptr) {
    log::warn_once("activations-auto-dist", "ferry: activations=auto with " + std::to_string(config_.world_size) +
                                                " ranks needs an optimizer that agrees the plan across them "
                                                "(HybridAdam does); until one is attached every segment is "
                                                "recomputed (as activations=recompute)");
    return;
  }
  const int64_t after_warmup = options_.scheduler.warmup_iterations + (grad_sink_ != nullptr ? 1 : 0);
  const bool ready = layout_final() && scheduler_->iterations() >= after_warmup;
  const bool wanted = activations_.plan_wanted();
  if (!(ranks ? plan_agreement_->plan_now(ready, wanted, activations_.count()) : ready && wanted)) return;

  ActivationCosts costs = activation_costs();
  MemoryPlanInput input;
  input.segments = std::move(costs.segments);
  input.forward_s = costs.forward_s;
  input.backward_s = costs.backward_s;
  const int64_t capacity = options_.scheduler.device_capacity_bytes;
  if (capacity > 0) {
    const int64_t budget = options_.scheduler.device_budget_bytes;
    const int64_t params = layout().num_chunks() * chunk_size_bytes();
    int64_t chunks = params + scheduler_->other_device_bytes();
    if (budget > 0) chunks = std::min(chunks, budget);
    input.room_bytes = std::max<int64_t>(0, capacity - std::max<int64_t>(scheduler_->non_model_peak(), 0) - chunks);
  }
  if (ranks) input = plan_agreement_->agree(input);
  apply_activation_plan(plan_memory(input), input);
}

ActivationCosts ChunkedModel::activation_costs() const {
  ActivationCosts c;
  c.segments = activations_.costs();
  const PhaseSeconds phases = last_phase_seconds();
  c.forward_s = std::max(phases.forward, 0.0);
  double recompute = 0;
  for (const SegmentCost& s : c.segments) recompute += s.saved_bytes >= 0 ? s.recompute_s : 0.0;
  c.backward_s = std::max(phases.backward, recompute);
  return c;
}

void ChunkedModel::apply_activation_plan(const MemoryPlan& plan, const MemoryPlanInput& input) {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: an activation plan applies between iterations; the model is in ",
              to_string(phase_.load()));
  if (activations_.apply(plan, input)) scheduler_->retrace();
  log::info("ferry: ", activations_.table());
  if (trace::enabled()) {  // the plan in the event trace, beside the step it shapes
    std::ostringstream args;
    args << "\"kept\": " << plan.kept() << ", \"segments\": " << plan.keep.size() << ", \"kept_bytes\": "
         << plan.kept_bytes << ", \"room_bytes\": " << input.room_bytes << ", \"groups_on_device\": "
         << plan.groups_on_device << ", \"predicted_step_s\": " << plan.predicted_step_s << ", \"keep\": \"";
    for (char k : plan.keep) args << (k != 0 ? 'K' : 'r');
    args << "\"";
    trace::instant("plan", "activation plan", args.str());
  }
}

}  // namespace ferry
