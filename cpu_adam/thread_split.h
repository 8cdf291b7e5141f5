#pragma once
// How CpuAdam shares one span among its OpenMP threads.
//
// A span of n elements is cut into grains of kGrainElements (the last one shorter), the same grains
// whatever the thread count or split, and every grain is handed to exactly one thread:
//  - CpuSplit::kDynamic: threads claim the next grain as they finish one (OpenMP's dynamic schedule).
//    A thread that shares its core with another busy thread (autograd's, the training thread's, the
//    copy engine's, another process's) claims fewer grains instead of holding the whole update back:
//    inside a step the host Adam is never alone on the CPU, and under a static split its slowest
//    thread sets the time of every update (measured: bench_cpu_adam's "split" rows).
//  - CpuSplit::kStatic: each thread takes one run of consecutive grains, equal to within one grain
//    (how ferry split spans before the dynamic split; kept to measure the two in one run).
// Grain boundaries are multiples of kGrainElements, itself a multiple of every kernel's alignment
// (16 fp32 elements, one cache line, and the compact state's blocks), so no two threads write one
// cache line and a compact block never straddles two grains. A result reduced per grain (the gradient
// norm) is summed in grain order: the same bits whatever the thread count or split.
#include <cstdint>
#include <functional>

#include "../common/config.h"

namespace ferry {

// 32K elements: ~1 MB of fp32 state, tens of microseconds of work per grain, so that claiming one
// (an atomic increment) costs well under 1% and a span of one chunk (tens of millions of elements)
// still has hundreds of grains to balance over.
constexpr int64_t kGrainElements = int64_t{1} << 15;

// ceil(n / kGrainElements); 0 for n == 0.
int64_t grain_count(int64_t n);

// Calls f(begin, end, grain) once for every grain of [0, n), on up to `threads` OpenMP threads (fewer
// when there are fewer grains; a single grain runs on the calling thread). f must not throw (it runs
// inside an OpenMP region) and may run on any thread.
void for_each_grain(int64_t n, int threads, CpuSplit split, const std::function<void(int64_t, int64_t, int64_t)>& f);

}  // namespace ferry
