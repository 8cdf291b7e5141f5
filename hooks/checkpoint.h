#pragma once
// Activation checkpointing for LibTorch C++: ferry::checkpoint(fn, inputs) runs fn(inputs) without
// keeping its intermediate activations, and reruns it in backward to get them back.
//
//   x = ferry::checkpoint([&](const std::vector<at::Tensor>& in) { return block->forward(in[0]); }, {x});
//
// Forward: fn runs under no-grad; only the inputs are kept. Backward: fn runs again with grad on, on
// detached copies of the inputs, and the incoming gradient is pushed through that recomputed graph
// (a nested backward), which accumulates the gradients of the parameters fn used and of the inputs.
// Parameter accesses inside the recompute go through ChunkedModel's hooks like any other op, so the
// chunks fn needs are brought back for it.
//
// Contract
//  - fn must compute the same function both times: no randomness (dropout) unless it reseeds itself,
//    no state changed by the first call that the second reads (BatchNorm running stats are updated
//    twice).
//  - fn returns one tensor; inputs that require grad get gradients, others none.
//  - Works with or without ChunkedModel; without grad mode on, it is just fn(inputs).
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace ferry {

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

at::Tensor checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs);

}  // namespace ferry
