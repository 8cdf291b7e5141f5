#pragma once
// The rates the joint placement of state and activations weighs (scheduler/joint_placement.h),
// measured in this process when it places: the host Adam kernel over scratch state, a copy host ->
// device -> host, and a copy within the device, each over `bytes` (best of 3 runs; tens of
// milliseconds in all on a GPU box). Measured rather than assumed: the same kind of machine has read
// 92 and 125 GB/s of host Adam on two leases (benchmarks/README.md).
#include <cstdint>

#include "../chunk/device.h"
#include "../cpu_adam/cpu_adam.h"
#include "../scheduler/joint_placement.h"

namespace ferry::optim {

// `pinned_host`: the host side of the copies page-locked, as the parameter chunks' buffers are on CUDA.
UpdateRates measure_update_rates(const CpuAdam& adam, const Device& device, bool pinned_host, int64_t bytes);

}  // namespace ferry::optim
