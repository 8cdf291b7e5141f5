// The CUDA device (see device.h). Compiled only in CUDA builds of ferry.
#ifdef FERRY_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include "../common/gpu_info.h"
#include "device.h"

namespace ferry {
namespace {

class CudaDevice final : public Device {
 public:
  const char* name() const override { return "cuda"; }
  c10::Device torch_device() const override { return c10::Device(c10::kCUDA, c10::cuda::current_device()); }
  std::unique_ptr<CopyEngine> make_copy_engine() const override { return make_cuda_copy_engine(); }
  int64_t default_capacity_bytes(int64_t /*budget_bytes*/, bool /*counts_host_memory*/) const override {
    return default_gpu_capacity_bytes(query_gpus().total_memory_bytes);
  }
  int64_t allocated_bytes() const override {
    // getDeviceStats asserts if CUDA was not initialised yet (see copy_engine_cuda.cpp); once it was,
    // this is a flag test.
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
  void synchronize() const override { c10::cuda::device_synchronize(); }
  const char* collective_backend() const override { return "nccl"; }
  c10::Device bind_local_rank(int local_rank, bool may_share) const override {
    const int count = static_cast<int>(c10::cuda::device_count());
    if (may_share && count > 0 && local_rank >= count) local_rank %= count;
    TORCH_CHECK(local_rank >= 0 && local_rank < count, "ferry: local rank ", local_rank, " needs CUDA device ",
                local_rank, ", but this process sees ", count, " (one rank per GPU: launch at most ", count,
                " processes per node, e.g. torchrun --nproc-per-node=", count,
                ", or leave each process one GPU of its own: srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES)");
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank));
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  }
};

}  // namespace

std::shared_ptr<const Device> make_cuda_device() { return std::make_shared<CudaDevice>(); }

}  // namespace ferry
#endif  // FERRY_WITH_CUDA
