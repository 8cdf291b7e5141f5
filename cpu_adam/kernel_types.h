#pragma once
// torch's dtypes as the kernels name them (kernels/kernel_abi.h): the gradient's and the compute
// copy's. Anything else is refused by name (TORCH_CHECK). Defined in cpu_adam.cpp.
#include <c10/core/ScalarType.h>

#include "kernels/kernel_abi.h"

namespace ferry {

cpu_adam::GradType grad_type_of(at::ScalarType t);  // Float, BFloat16, Half
cpu_adam::LowpType lowp_type_of(at::ScalarType t);  // BFloat16, Half, or Undefined (none)

}  // namespace ferry
