#pragma once
// The squared gradient norm of spans of a chunk, taken where the gradients are (D85).
//
// The sum runs in the one order of Note [One norm wherever the gradient lives]
// (kernels/norm_body.h), so a span's value is the same bits as CpuAdam::grad_norm_sq of the same
// elements on the host, whichever CPU kernel, thread count or split that uses: where the placement
// put a chunk changes no bit of a clipped step.
//
// Contract
//  - `grads` is a contiguous 1-D Float, BFloat16 or Half tensor; each range [begin, end) lies in it.
//  - Returns a 1-D Double tensor on grads' device, one squared norm per range (a range's first element
//    is the first of its blocks): inf or NaN if any of its gradients is, inf if the sum overflows.
//  - CUDA: queued on the current stream of the current device (which must be grads'); nothing waits.
//  - Simulated device (CPU tensors): computed now, by `adam`'s kernel and threads.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_adam.h"

namespace ferry {

at::Tensor device_grad_norms_sq(const CpuAdam& adam, const at::Tensor& grads,
                                const std::vector<std::pair<int64_t, int64_t>>& ranges);

}  // namespace ferry
