#pragma once
// Activation checkpointing for LibTorch C++: ferry::checkpoint(fn, inputs) runs fn(inputs) without
// keeping its intermediate activations, and reruns it in backward to get them back.
//
//   x = ferry::checkpoint([&](const std::vector<at::Tensor>& in) { return block->forward(in[0]); }, {x});
//
// Forward: fn runs under no-grad; only the inputs are kept. Backward: fn runs again with grad on, on
// detached copies of the inputs, and the incoming gradient is pushed through that recomputed graph.
// Inside a ChunkedModel the parameters fn used (recorded in forward, hooks/param_use_recorder.h) are
// inputs of the checkpoint's autograd node: their gradients are computed without being accumulated
// and handed to the outer backward, which lands each parameter's once, after all its uses, so a block
// may be checkpointed twice per backward (Note [Checkpoint parameters as inputs], checkpoint.cpp).
// Without a ChunkedModel the nested backward accumulates the parameters' gradients, as LibTorch would.
// Parameter accesses inside the recompute go through ChunkedModel's hooks like any other op, so the
// chunks fn needs are brought back for it.
//
// Contract
//  - The recompute replays the first run's random generators and autocast state, as
//    torch.utils.checkpoint does by default: the CPU generator and the default generator of each CUDA
//    device the inputs are on start from where they were when the first run began (a dropout draws
//    the same mask), and are given back their states after it (the recompute draws nothing from the
//    training's stream); CPU and CUDA autocast are as they were around the first run.
//  - Beyond that, fn must compute the same function both times: a generator of its own or of a
//    device none of the inputs is on is not replayed, and no state changed by the first call may be
//    read by the second (BatchNorm running stats are updated twice).
//  - fn returns one tensor (or several: the second overload); inputs that require grad get
//    gradients, others none, and so do the managed parameters fn uses. An undefined input (an
//    optional mask not given) reaches fn undefined, at its place, both times. Inside a ChunkedModel, a tensor
//    that requires grad and that fn captures instead of taking it in `inputs` (not a parameter of a
//    wrapped module) gets its gradient from a nested backward, warned once, which refuses a parameter
//    used in two such segments of one backward: pass it in `inputs`.
//  - autograd::grad() through a segment, and a backward that creates a graph (create_graph: a
//    gradient penalty, differentiated again), need every leaf the segment reaches to be an input or a
//    recorded parameter (inside a ChunkedModel's forward, fn capturing no tensor that requires grad; or
//    a frozen segment): the recompute then runs on the inputs themselves and its gradients carry the
//    graph back to the parameters and to what made the inputs. Otherwise (plain LibTorch with
//    trainable parameters, or a captured tensor) both are refused, naming the remedy: the nested
//    backward would accumulate into .grad and make no graph.
//  - Works with or without ChunkedModel; without grad mode on, it is just fn(inputs).
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace ferry {

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
using CheckpointFns = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

at::Tensor checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs);
// Several outputs (a block's hidden state and its auxiliary loss; integer outputs get no gradient).
// fn returns the same number of defined tensors both times. Outputs the loss does not use, or that
// need no gradient, push nothing back through the segment.
std::vector<at::Tensor> checkpoint(CheckpointFns fn, const std::vector<at::Tensor>& inputs);

}  // namespace ferry
