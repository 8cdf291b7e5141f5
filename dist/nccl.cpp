#include "nccl.h"

#include <c10/util/Exception.h>

#ifdef FERRY_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ferry::dist::detail {

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
