#include "ferry/hooks/init_scope.h"

#include <c10/core/DefaultDtype.h>
#include <c10/util/Exception.h>

namespace ferry {

InitScope::InitScope(at::ScalarType dtype) : previous_(c10::get_default_dtype()) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "ferry: InitScope builds parameters in fp32, bf16 or fp16, got ", dtype);
  c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(dtype));
}

InitScope::InitScope(Precision precision)
    : InitScope(precision == Precision::kBf16 ? at::kBFloat16 : precision == Precision::kFp16 ? at::kHalf : at::kFloat) {}

InitScope::~InitScope() { c10::set_default_dtype(previous_); }

}  // namespace ferry
