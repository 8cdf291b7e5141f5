#pragma once
// The PlacementPolicy of activations=auto (Config::activations): where optimizer state lives and which
// checkpointed segments keep their activations, decided together by the memory plan
// (scheduler/memory_plan.h) from the warm-up's measured segments and phases and measured rates. The
// state's half is the Placement it returns (the first m held groups, as Note [Which state goes to the
// device] wants them); the segments' half is plan(), which the caller applies to the model.
//
// Note [The update costs of a state group]
// A group's update on the host reads and writes its state (2 x state bytes: master and moments), reads
// its gradient and writes the new compute copy (2 x parameter bytes), at the host-Adam rate; when its
// parameter chunk travels (the default mode) the gradient goes to the host before the update and the
// new values come back before the next forward uses them: one way each, parameter bytes at the
// measured copy rate (the plan's timeline puts them before and after the update: Note [The timeline
// of the host updates], memory_plan.cpp). On the device it moves the same bytes at the device's
// measured copy rate, and nothing crosses the bus. These are floors of the moved bytes, not timings of
// ferry's kernels: the plan compares placements by what they make move. The host-Adam rate is the one
// the host updates reached inside the steps before, where there were any (UpdateRates).
#include <string>
#include <vector>

#include "memory_plan.h"
#include "placement_policy.h"

namespace ferry {

// The bytes a group's update reads and writes, on the host or the device (the note above): master and
// moments both ways, the gradient in and the new compute copy out.
inline double update_bytes(int64_t state_bytes, int64_t param_bytes) {
  return 2.0 * static_cast<double>(state_bytes) + 2.0 * static_cast<double>(param_bytes);
}

// What the joint plan adds to a placement's input.
struct ActivationCosts {
  std::vector<SegmentCost> segments;  // the model's checkpoint segments, measured in the warm-up
  double forward_s = 0;
  double backward_s = 0;              // with every segment recomputed
  bool host_behind_forward = false;   // host updates may run behind the next forward
};

// Bytes per second, measured in this process (optim/rate_probe.h); each > 0.
struct UpdateRates {
  // The host Adam's: measured in the steps before, beside the GPU's work, where host updates ran
  // (Engine's Note [The joint placement]); else alone, by the probe.
  double host_adam_bytes_per_s = 0;
  double copy_bytes_per_s = 0;        // host <-> device, one way
  double device_bytes_per_s = 0;      // device memory, read + write counted
};

// What the last joint placement weighed: the rates it used, and the host Adam's rate both ways it was
// measured before it (alone, by the probe; inside the steps before, beside the GPU's work: 0 where no
// host update ran there); and the rate its own placement's steps reached since (scheduler/joint_solves.h).
// All 0 before a joint placement.
struct JointRates {
  UpdateRates used;
  double host_adam_alone_bytes_per_s = 0;
  double host_adam_in_steps_bytes_per_s = 0;
  double host_adam_under_plan_bytes_per_s = 0;  // in the last measured steps under it (0: none yet)
  int64_t solves = 0;  // joint solves so far in this layout (Note [The joint placement], optim/engine.cpp)
};

class JointPlacementPolicy final : public PlacementPolicy {
 public:
  JointPlacementPolicy(ActivationCosts costs, UpdateRates rates);
  std::string name() const override { return "joint with the activation plan"; }
  // The first `plan().groups_on_device` held groups; margin_bytes as first-chunks-first's. Remembers the
  // plan and its input. Not for sharded parameters (remote_params): refused.
  Placement place(const PlacementInput& input) const override;
  bool planned() const { return planned_; }
  const MemoryPlan& plan() const { return plan_; }
  const MemoryPlanInput& plan_input() const { return plan_input_; }

 private:
  ActivationCosts costs_;
  UpdateRates rates_;
  mutable bool planned_ = false;
  mutable MemoryPlan plan_;
  mutable MemoryPlanInput plan_input_;
};

// The memory plan's input for `input` (Note [The update costs of a state group]): the groups' costs, the
// room after every parameter chunk (-1: no limit), the segments and phases of `costs`.
MemoryPlanInput joint_plan_input(const PlacementInput& input, const ActivationCosts& costs, const UpdateRates& rates);

}  // namespace ferry
