#pragma once
// The roles of an optimizer state group (StateChunks' role indices, in this order): the master, Adam's
// two moments, with accumulate_grads the accumulated fp32 gradient, and in the compact format the
// moments' per-block scales last. Their dtypes and shapes by format: state_role_specs.
#include <vector>

#include "../chunk/state_chunks.h"
#include "hybrid_adam_options.h"

namespace ferry::optim {

enum StateRole : int { kMasterRole = 0, kExpAvgRole, kExpAvgSqRole, kGradRole };

// The compact format's scales role: after the last of the others (3, or 4 with accumulation).
inline int scales_role(bool accumulate_grads) { return accumulate_grads ? kGradRole + 1 : kGradRole; }

// The roles of a state group: fp32 master (initialised from the parameters) and moments (zero), or the
// compact format's bf16 master and uint8 moment codes with their fp32 scales (two per block of each
// tensor: exp_avg's, then exp_avg_sq's); with accumulation an fp32 gradient (zero).
std::vector<StateRoleSpec> state_role_specs(StateFormat format, bool accumulate_grads);

}  // namespace ferry::optim
