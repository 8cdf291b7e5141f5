#include "device_adam.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include "kernels/adam_cuda.h"  // declarations only; defined in CUDA builds, called only there
#include "kernels/kernel_abi.h"

#ifdef FERRY_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace ferry {

void device_adam_update(const CpuAdam& adam, int group, const AdamSpan& span, double grad_scale, c10::Device device,
                        const at::Tensor& found_inf) {
  TORCH_CHECK(adam.step_count(group) >= 1, "ferry: device Adam: update of group ", group,
              " before advance_step() (step count is 0)");
  device_adam_update(adam, adam.freeze(group), span, grad_scale, device, found_inf);
}

namespace {
// One update of `span` where `device` is, for either format: on CUDA `launch(stream, found_inf)` queues
// the format's kernel (a generic lambda, instantiated only in CUDA builds); on the simulated device
// CpuAdam's kernel runs here, or with found_inf set only the compute copy gets the master's value
// (`master`, of `master_dtype`), as the CUDA kernels do.
template <class Span, class Launch>
void update_on(const CpuAdam& adam, const CpuAdam::FrozenGroup& group, const Span& span, double grad_scale,
               c10::Device device, const at::Tensor& found_inf, void* master, at::ScalarType master_dtype,
               const Launch& launch) {
  TORCH_CHECK(!found_inf.defined() || (found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat &&
                                       found_inf.device() == device),
              "ferry: device Adam: expected found_inf as one Float on ", device, ", got ", found_inf.toString(),
              " with ", found_inf.numel(), " elements on ", found_inf.device());
  if (device.is_cuda()) {
#ifdef FERRY_WITH_CUDA
    const c10::cuda::CUDAGuard guard(device);  // the launch goes to the current device
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
    const float* flag = found_inf.defined() ? found_inf.data_ptr<float>() : nullptr;
    const char* error = launch(static_cast<void*>(stream.stream()), flag);
    TORCH_CHECK(error == nullptr, "ferry: device Adam: the CUDA launch failed: ", error ? error : "");
    return;
#else
    (void)launch;
    TORCH_CHECK(false, "ferry: device Adam: state on ", device, " but ferry was built without CUDA");
#endif
  }
  if (found_inf.defined() && found_inf.item<float>() != 0.0f) {
    if (span.param_lowp != nullptr) {  // the master's value back into the copy, as the CUDA kernel does
      const at::Tensor values = at::from_blob(master, {span.numel}, master_dtype);
      at::from_blob(span.param_lowp, {span.numel}, at::TensorOptions(span.lowp_dtype)).copy_(values);
    }
    return;
  }
  adam.update(group, span, UpdateOptions{grad_scale, /*grads_checked=*/true});
}
}  // namespace

void device_adam_update(const CpuAdam& adam, const CpuAdam::FrozenGroup& group, const AdamSpan& span,
                        double grad_scale, c10::Device device, const at::Tensor& found_inf) {
  update_on(adam, group, span, grad_scale, device, found_inf, span.param, at::kFloat,
            [&](void* stream, const auto* flag) {
              return cpu_adam::launch_adam_cuda(adam.kernel_args(group, span, grad_scale), span.numel, flag, stream);
            });
}

void device_adam_update(const CpuAdam& adam, const CpuAdam::FrozenGroup& group, const CompactAdamSpan& span,
                        double grad_scale, c10::Device device, const at::Tensor& found_inf) {
  update_on(adam, group, span, grad_scale, device, found_inf, span.master, at::kBFloat16,
            [&](void* stream, const auto* flag) {
              return cpu_adam::launch_compact_cuda(adam.compact_kernel_args(group, span, grad_scale), span.numel,
                                                   flag, stream);
            });
}

}  // namespace ferry
