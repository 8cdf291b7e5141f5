// AVX-512 kernels with native fp32 -> bf16 conversion (AVX512_BF16).
#define FERRY_NATIVE_BF16 1
#include "adam_avx512.h"

namespace ferry::cpu_adam {
const KernelTable kAvx512Bf16Kernels{16, &Dispatch<Avx512Ops>::adam,
                                     &Dispatch<Avx512Ops>::grad_stats,
                                     &CompactDispatch<Avx512Ops>::adam};
}  // namespace ferry::cpu_adam
