#pragma once
// The Adam/AdamW update of optimizer state that lives on the device (D53), fp32 or compact.
//
// It runs the per-element function of CpuAdam's kernels (kernels/adam_body.h): on CUDA compiled by nvcc
// (kernels/adam_cuda.cu) with round-to-nearest intrinsics, on the simulated device as CpuAdam's own
// kernel. So a chunk's update gives the same bits whether its state is on the host or on the device,
// and it is one pass of 28 B per parameter with bf16 gradients: the gradient scaled in the pass, the
// bf16 value written over the gradient it replaces (`span.param_lowp`), no temporaries.
//
// Contract
//  - `span` is as for CpuAdam::update, with every array on `device`, and its gradients finite (the
//    caller checked them, or `found_inf` does).
//  - CUDA: one kernel on the current stream of the current device (which must be `device`); nothing
//    waits. `found_inf`: undefined, or a one-element float tensor on the device, which the host never
//    reads; nonzero there skips the update: the master and the moments are not written, and the
//    low-precision copy, if the span has one, gets the master's value (rounded). That copy may be
//    written over the gradient (HybridAdam's default mode), whose slot must hold the parameter's value
//    again after a skipped update, as restore_values() gives it back on the host.
//  - Simulated device (CPU tensors): CpuAdam's kernel on the calling thread; `found_inf` read here.
//  - Uses the group's options and step count (advance_step first), as CpuAdam::update does; the
//    FrozenGroup form uses the given options and step count, as CpuAdam::update(frozen, ...) does.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "cpu_adam.h"

namespace ferry {

void device_adam_update(const CpuAdam& adam, int group, const AdamSpan& span, double grad_scale, c10::Device device,
                        const at::Tensor& found_inf = {});
void device_adam_update(const CpuAdam& adam, const CpuAdam::FrozenGroup& group, const AdamSpan& span,
                        double grad_scale, c10::Device device, const at::Tensor& found_inf = {});
// The same for compact state (Note [The compact state format], compact_state.h): on CUDA the compact
// kernel (kernels/adam_cuda.cu: CompactLoop::element per thread, the block's scales by a reduction),
// bit-identical to CpuAdam's; skipped by `found_inf`, only the compute copy is written (the master's
// value). The simulated device: CpuAdam's kernel on the calling thread.
void device_adam_update(const CpuAdam& adam, const CpuAdam::FrozenGroup& group, const CompactAdamSpan& span,
                        double grad_scale, c10::Device device, const at::Tensor& found_inf = {});

}  // namespace ferry
