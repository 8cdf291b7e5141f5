#include "joint_placement.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace ferry {

JointPlacementPolicy::JointPlacementPolicy(ActivationCosts costs, UpdateRates rates)
    : costs_(std::move(costs)), rates_(rates) {
  TORCH_CHECK(rates_.host_adam_bytes_per_s > 0 && rates_.copy_bytes_per_s > 0 && rates_.device_bytes_per_s > 0,
              "ferry: the joint placement needs measured rates > 0; got host Adam ", rates_.host_adam_bytes_per_s,
              " B/s, copies ", rates_.copy_bytes_per_s, " B/s, device ", rates_.device_bytes_per_s, " B/s");
}

MemoryPlanInput joint_plan_input(const PlacementInput& input, const ActivationCosts& costs, const UpdateRates& rates) {
  MemoryPlanInput plan;
  plan.segments = costs.segments;
  plan.forward_s = costs.forward_s;
  plan.backward_s = costs.backward_s;
  plan.host_behind_forward = costs.host_behind_forward;
  int64_t param_bytes = 0;
  for (const StateGroup& g : input.groups) {
    param_bytes += g.param_bytes;
    GroupCost c;
    c.held = g.held;
    c.state_bytes = g.state_bytes;
    c.param_bytes = g.param_bytes;
    const double moved = update_bytes(g.state_bytes, g.param_bytes);
    c.host_s = moved / rates.host_adam_bytes_per_s;
    c.trip_s = input.params_travel ? static_cast<double>(g.param_bytes) / rates.copy_bytes_per_s : 0.0;
    c.device_s = moved / rates.device_bytes_per_s;
    plan.groups.push_back(c);
  }
  plan.room_bytes = input.room_bytes == 0 ? -1 : std::max<int64_t>(0, input.room_bytes - param_bytes);
  return plan;
}

Placement JointPlacementPolicy::place(const PlacementInput& input) const {
  TORCH_CHECK(!input.remote_params, "ferry: the joint placement of state and activations is for one process's "
              "parameters; sharded parameters are placed first-chunks-first");
  plan_input_ = joint_plan_input(input, costs_, rates_);
  plan_ = plan_memory(plan_input_);
  planned_ = true;
  Placement out;
  out.on_device.assign(input.groups.size(), 0);
  int64_t placed = 0;
  for (size_t g = 0; g < input.groups.size() && placed < plan_.groups_on_device; ++g) {
    if (!input.groups[g].held) continue;
    out.on_device[g] = 1;
    out.device_bytes += input.groups[g].state_bytes;
    ++placed;
  }
  if (input.room_bytes != 0) {
    int64_t param_bytes = 0;
    for (const StateGroup& g : input.groups) param_bytes += g.param_bytes;
    out.margin_bytes = input.room_bytes - param_bytes;
  }
  return out;
}

}  // namespace ferry
