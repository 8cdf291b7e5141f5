#include "thread_split.h"

#include <c10/util/Exception.h>
#include <omp.h>

#include <algorithm>

#include "kernels/kernel_abi.h"

namespace ferry {

static_assert(kGrainElements % 16 == 0, "a grain is whole cache lines of fp32");
static_assert(kGrainElements % cpu_adam::kCompactBlock == 0, "a grain is whole compact blocks");
static_assert(kGrainElements == cpu_adam::kNormGrain, "the norm's grains are the threads' (norm_body.h)");

int64_t grain_count(int64_t n) { return (n + kGrainElements - 1) / kGrainElements; }

void for_each_grain(int64_t n, int threads, CpuSplit split, const std::function<void(int64_t, int64_t, int64_t)>& f) {
  TORCH_CHECK(n >= 0, "for_each_grain: expected n >= 0, got ", n);
  const int64_t grains = grain_count(n);
  const int t = static_cast<int>(std::min<int64_t>(std::max(threads, 1), grains));
  auto run = [&](int64_t g) { f(g * kGrainElements, std::min(n, (g + 1) * kGrainElements), g); };
  if (t <= 1) {
    for (int64_t g = 0; g < grains; ++g) run(g);
    return;
  }
  if (split == CpuSplit::kDynamic) {
#pragma omp parallel for num_threads(t) schedule(dynamic, 1)
    for (int64_t g = 0; g < grains; ++g) run(g);
  } else {
#pragma omp parallel for num_threads(t) schedule(static)
    for (int64_t g = 0; g < grains; ++g) run(g);
  }
}

}  // namespace ferry
