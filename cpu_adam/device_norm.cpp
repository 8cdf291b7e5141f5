#include "device_norm.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "kernel_types.h"
#include "kernels/adam_cuda.h"  // declarations only; defined in CUDA builds, called only there
#include "kernels/kernel_abi.h"

#ifdef FERRY_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace ferry {

at::Tensor device_grad_norms_sq(const CpuAdam& adam, const at::Tensor& grads,
                                const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  TORCH_CHECK(grads.defined() && grads.dim() == 1 && grads.is_contiguous(),
              "ferry: gradient norm: expected a contiguous 1-D tensor, got ",
              grads.defined() ? grads.toString() : "undefined", grads.defined() ? " of dim " : "",
              grads.defined() ? grads.dim() : 0);
  const at::ScalarType dtype = grads.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "ferry: gradient norm: expected Float, BFloat16 or Half gradients, got ", dtype);
  for (const auto& [begin, end] : ranges) {
    TORCH_CHECK(0 <= begin && begin <= end && end <= grads.numel(), "ferry: gradient norm: expected a range in [0, ",
                grads.numel(), "], got [", begin, ", ", end, ")");
  }
  const int64_t k = static_cast<int64_t>(ranges.size());
  const int64_t elem = static_cast<int64_t>(grads.element_size());
  const char* base = static_cast<const char*>(grads.data_ptr());
  if (grads.is_cuda()) {
#ifdef FERRY_WITH_CUDA
    const c10::cuda::CUDAGuard guard(grads.device());
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
    // Scratch for every range's grain totals, in one allocation from the caching allocator: freed
    // (returned for reuse in stream order) when this function returns, after the kernels are queued.
    // Two launches for up to 64 ranges (a chunk's parameters), whatever their count below that.
    int64_t grains = 0;
    for (const auto& [begin, end] : ranges) grains += (end - begin + cpu_adam::kNormGrain - 1) / cpu_adam::kNormGrain;
    const at::Tensor out = at::empty({k}, grads.options().dtype(at::kDouble));
    const at::Tensor scratch = at::empty({grains > 0 ? grains : 1}, grads.options().dtype(at::kDouble));
    const cpu_adam::GradType type = grad_type_of(dtype);
    std::vector<int64_t> begins, ends;
    for (const auto& [begin, end] : ranges) {
      begins.push_back(begin);
      ends.push_back(end);
    }
    const char* error = cpu_adam::launch_grad_norms_cuda(base, type, 1.0f, begins.data(), ends.data(), k,
                                                         scratch.data_ptr<double>(), out.data_ptr<double>(),
                                                         stream.stream());
    TORCH_CHECK(error == nullptr, "ferry: gradient norm: the CUDA launch failed: ", error ? error : "");
    return out;
#else
    TORCH_CHECK(false, "ferry: gradient norm: gradients on ", grads.device(), " but ferry was built without CUDA");
#endif
  }
  TORCH_CHECK(grads.device().is_cpu(), "ferry: gradient norm: expected gradients on CUDA or the CPU, got ",
              grads.device());
  at::Tensor out = at::empty({k}, grads.options().dtype(at::kDouble));
  double* v = out.data_ptr<double>();
  for (int64_t r = 0; r < k; ++r) {
    const auto [begin, end] = ranges[static_cast<size_t>(r)];
    v[r] = adam.grad_norm_sq(base + begin * elem, dtype, end - begin).sum_sq;
  }
  return out;
}

}  // namespace ferry
