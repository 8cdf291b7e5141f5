// AVX-512 F/BW/VL/DQ kernels; bf16 rounding with integer ops.
#define FERRY_NATIVE_BF16 0
#include "adam_avx512.h"

namespace ferry::cpu_adam {
const KernelTable kAvx512Kernels{16, &Dispatch<Avx512Ops>::adam, &Dispatch<Avx512Ops>::grad_stats,
                                     &CompactDispatch<Avx512Ops>::adam};
}  // namespace ferry::cpu_adam
