#pragma once
// The CUDA launch of the Adam/AdamW update (adam_cuda.cu): AdamLoop::one of adam_body.h per element,
// with IEEE round-to-nearest intrinsics and no contraction, so its results are bit-identical to the
// CPU kernels' (D53). No torch or CUDA headers here: the caller passes its stream as a pointer.
#include <cstdint>

#include "kernel_abi.h"

namespace ferry::cpu_adam {

// Queues the update of elements [0, n) of `args` (device pointers) on `stream` (a cudaStream_t of the
// current device) and returns without waiting. `found_inf`: null, or a device float; when it holds a
// nonzero value the kernel writes nothing (the host never reads it). Returns null, or the text of the
// CUDA error the launch raised.
const char* launch_adam_cuda(const AdamKernelArgs& args, int64_t n, const float* found_inf, void* stream);
// The same for the compact state's update (compact_body.h) of elements [0, n) of `args`, blocks of
// kCompactBlock from element 0: the bits the CPU kernels give. With `found_inf` set, only the compute
// copy is written (the master's value), as the fp32 launch does.
const char* launch_compact_cuda(const CompactAdamArgs& args, int64_t n, const float* found_inf, void* stream);
// Queues the squared norms of grad * grad_scale over the ranges [begins[k], ends[k]) of `grad`, k <
// count (Note [One norm wherever the gradient lives]: the bits of CpuAdam::grad_norm_sq of each range),
// written to the device doubles out[0 .. count): two kernels per 64 ranges. `grain_totals` is device
// scratch of sum over k of ceil((ends[k] - begins[k]) / kNormGrain) doubles that must live until they ran.
const char* launch_grad_norms_cuda(const void* grad, GradType type, float grad_scale, const int64_t* begins,
                                   const int64_t* ends, int64_t count, double* grain_totals, double* out,
                                   void* stream);

}  // namespace ferry::cpu_adam
