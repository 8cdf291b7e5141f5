#include "nccl.h"

#include <c10/util/Exception.h>

#ifdef FERRY_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif
#ifdef FERRY_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ferry::dist::detail {

#ifdef FERRY_WITH_CUDA

c10::Device bind_cuda_device(int local_rank, bool may_share) {
  const int count = static_cast<int>(c10::cuda::device_count());
  if (may_share && count > 0 && local_rank >= count) local_rank %= count;
  TORCH_CHECK(local_rank >= 0 && local_rank < count, "ferry: local rank ", local_rank, " needs CUDA device ",
              local_rank, ", but this host has ", count, " (one rank per GPU: launch at most ", count,
              " processes per node, e.g. torchrun --nproc-per-node=", count, ")");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank));
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

#else

c10::Device bind_cuda_device(int local_rank, bool) {
  TORCH_CHECK(false, "ferry: local rank ", local_rank, " asks for a CUDA device, but ferry was built without CUDA");
}

#endif

#ifdef FERRY_WITH_NCCL

bool have_nccl() { return true; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int world_size, std::chrono::milliseconds timeout,
                                                    const c10::Device& device) {
  TORCH_CHECK(device.is_cuda() && device.has_index(), "ferry: NCCL needs an indexed CUDA device, got ", device);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
  // Bound to this rank's device, and its communicator made now (torch.distributed's device_id=).
  pg->setBoundDeviceId(device);
  pg->eagerConnectSingleDevice(device);
  return pg;
}

#else  // !FERRY_WITH_NCCL

bool have_nccl() { return false; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                    std::chrono::milliseconds, const c10::Device&) {
  TORCH_CHECK(false, "ferry was built without NCCL (it needs a CUDA build of LibTorch and nccl.h, which the torch "
              "wheel's nvidia-nccl package ships); use dist-backend=gloo");
}

#endif

}  // namespace ferry::dist::detail
