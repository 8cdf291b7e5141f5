#pragma once
// dist's CUDA side, kept in its own translation unit (ProcessGroupNCCL's headers pull in ATen and the
// CUDA runtime): the NCCL backend of c10d. (The GPU a rank runs on is bound by its Device,
// chunk/device.h.) Internal to dist/; the public entry point is dist::connect (dist/process_group.h).
//
// Built when LibTorch is a CUDA build and nccl.h is found (the torch wheel's nvidia-nccl package ships
// it); otherwise have_nccl() is false and the other functions fail naming why.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace ferry::dist::detail {

// Whether this build of ferry has c10d's NCCL backend.
bool have_nccl();

// c10d's ProcessGroupNCCL over `store`, bound to `device` (its communicator is created now, so a bad
// launch fails here and not in the first collective). Collectives that outlive `timeout` make NCCL's
// watchdog abort the communicator; a wait with that timeout then throws.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int world_size, std::chrono::milliseconds timeout,
                                                    const c10::Device& device);

}  // namespace ferry::dist::detail
