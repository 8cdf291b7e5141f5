#include "device_adam.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include "kernels/kernel_abi.h"

#ifdef FERRY_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/adam_cuda.h"
#endif

namespace ferry {

void device_adam_update(const CpuAdam& adam, int group, const AdamSpan& span, double grad_scale, c10::Device device,
                        const at::Tensor& found_inf) {
  TORCH_CHECK(adam.step_count(group) >= 1, "ferry: device Adam: update of group ", group,
              " before advance_step() (step count is 0)");
  device_adam_update(adam, adam.freeze(group), span, grad_scale, device, found_inf);
}

namespace {
void check_found_inf(const at::Tensor& found_inf, c10::Device device) {
  TORCH_CHECK(!found_inf.defined() || (found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat &&
                                       found_inf.device() == device),
              "ferry: device Adam: expected found_inf as one Float on ", device, ", got ", found_inf.toString(),
              " with ", found_inf.numel(), " elements on ", found_inf.device());
}
}  // namespace

void device_adam_update(const CpuAdam& adam, const CpuAdam::FrozenGroup& group, const AdamSpan& span,
                        double grad_scale, c10::Device device, const at::Tensor& found_inf) {
  check_found_inf(found_inf, device);
  if (device.is_cuda()) {
#ifdef FERRY_WITH_CUDA
    const cpu_adam::AdamKernelArgs args = adam.kernel_args(group, span, grad_scale);
    const c10::cuda::CUDAGuard guard(device);  // the launch goes to the current device
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
    const char* error = cpu_adam::launch_adam_cuda(args, span.numel, found_inf.defined() ? found_inf.data_ptr<float>()
                                                                                         : nullptr,
                                                   static_cast<void*>(stream.stream()));
    TORCH_CHECK(error == nullptr, "ferry: device Adam: the CUDA launch failed: ", error ? error : "");
    return;
#else
    TORCH_CHECK(false, "ferry: device Adam: state on ", device, " but ferry was built without CUDA");
#endif
  }
  if (found_inf.defined() && found_inf.item<float>() != 0.0f) {
    if (span.param_lowp != nullptr) {  // the master's value back into the copy, as the CUDA kernel does
      const at::Tensor master = at::from_blob(span.param, {span.numel}, at::kFloat);
      at::from_blob(span.param_lowp, {span.numel}, at::TensorOptions(span.lowp_dtype)).copy_(master);
    }
    return;
  }
  adam.update(group, span, UpdateOptions{grad_scale, /*grads_checked=*/true});
}

void device_adam_update(const CpuAdam& adam, const CpuAdam::FrozenGroup& group, const CompactAdamSpan& span,
                        double grad_scale, c10::Device device, const at::Tensor& found_inf) {
  check_found_inf(found_inf, device);
  if (device.is_cuda()) {
#ifdef FERRY_WITH_CUDA
    const cpu_adam::CompactAdamArgs args = adam.compact_kernel_args(group, span, grad_scale);
    const c10::cuda::CUDAGuard guard(device);  // the launch goes to the current device
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
    const char* error = cpu_adam::launch_compact_cuda(
        args, span.numel, found_inf.defined() ? found_inf.data_ptr<float>() : nullptr, static_cast<void*>(stream.stream()));
    TORCH_CHECK(error == nullptr, "ferry: device Adam: the CUDA launch of the compact update failed: ", error ? error : "");
    return;
#else
    TORCH_CHECK(false, "ferry: device Adam: compact state on ", device, " but ferry was built without CUDA");
#endif
  }
  if (found_inf.defined() && found_inf.item<float>() != 0.0f) {
    if (span.param_lowp != nullptr) {  // the master's value back into the copy, as the CUDA kernel does
      const at::Tensor master = at::from_blob(span.master, {span.numel}, at::kBFloat16);
      at::from_blob(span.param_lowp, {span.numel}, at::TensorOptions(span.lowp_dtype)).copy_(master);
    }
    return;
  }
  adam.update(group, span, UpdateOptions{grad_scale, /*grads_checked=*/true});
}

}  // namespace ferry
