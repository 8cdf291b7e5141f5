#pragma once
// The roles of an optimizer state group (StateChunks' role indices, in this order): the master, Adam's
// two moments, with accumulate_grads the accumulated fp32 gradient, and in the compact format the
// moments' per-block scales last. Their dtypes and shapes by format: state_role_specs.
#include <vector>

#include "../chunk/state_chunks.h"
#include "hybrid_adam_options.h"

namespace ferry::optim {

enum StateRole : int { kMasterRole = 0, kExpAvgRole, kExpAvgSqRole, kGradRole };

// Whether `state` has the compact format's roles (its master is bf16), and their scales role: the
// last (3, or 4 with accumulation).
inline bool is_compact(const StateChunks& state) { return state.spec(kMasterRole).dtype == at::kBFloat16; }
inline int scales_role(const StateChunks& state) { return state.num_roles() - 1; }

// The roles of a state group: fp32 master (initialised from the parameters) and moments (zero), or the
// compact format's bf16 master and uint8 moment codes with their fp32 scales (two per block of each
// tensor: exp_avg's, then exp_avg_sq's); with accumulation an fp32 gradient (zero).
std::vector<StateRoleSpec> state_role_specs(StateFormat format, bool accumulate_grads);

}  // namespace ferry::optim
