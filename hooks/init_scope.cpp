#include "init_scope.h"

#include <c10/core/DefaultDtype.h>
#include <c10/util/Exception.h>

namespace ferry {

InitScope::InitScope(at::ScalarType dtype, bool parallel_init) : previous_(c10::get_default_dtype()) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "ferry: InitScope builds parameters in fp32, bf16 or fp16, got ", dtype);
  c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(dtype));
  if (parallel_init) parallel_.emplace();
}

InitScope::InitScope(Precision precision, bool parallel_init)
    : InitScope(precision == Precision::kBf16 ? at::kBFloat16 : precision == Precision::kFp16 ? at::kHalf : at::kFloat,
                parallel_init) {}

InitScope::~InitScope() { c10::set_default_dtype(previous_); }

}  // namespace ferry
