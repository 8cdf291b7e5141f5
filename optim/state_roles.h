#pragma once
// The roles of an optimizer state group (StateChunks' role indices, in this order): the fp32 master,
// Adam's two moments, and with accumulate_grads the accumulated fp32 gradient.
namespace ferry::optim {

enum StateRole : int { kMasterRole = 0, kExpAvgRole, kExpAvgSqRole, kGradRole };

}  // namespace ferry::optim
