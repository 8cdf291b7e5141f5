#include "gpu_info.h"

#include <ATen/detail/CUDAHooksInterface.h>

#ifdef FERRY_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace ferry {

bool cuda_available() {
  const auto& hooks = at::detail::getCUDAHooks();
  return hooks.hasCUDA() && hooks.getNumGPUs() > 0;
}

GpuInfo query_gpus() {
  GpuInfo info;
  if (!cuda_available()) return info;
  info.count = at::detail::getCUDAHooks().getNumGPUs();
#ifdef FERRY_WITH_CUDA
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(0);
  info.name = prop->name;
  info.total_memory_bytes = static_cast<int64_t>(prop->totalGlobalMem);
  info.compute_major = prop->major;
  info.compute_minor = prop->minor;
#endif
  return info;
}

}  // namespace ferry
