#pragma once
// The process group of a multi-process run, on PyTorch's distributed engine: a c10d TCPStore for the
// rendezvous and a c10d backend for the collectives (docs/ARCHITECTURE.md D44, D49):
//  - nccl (ProcessGroupNCCL): the default where the chunks live on CUDA. Each process binds the GPU of
//    its local rank (LOCAL_RANK / SLURM_LOCALID / --local-rank), or the one GPU its launcher left it
//    (CUDA_VISIBLE_DEVICES naming one: srun --gpus-per-task=1), before anything is placed; chunks on
//    that GPU are reduced and gathered in place, CPU tensors are staged through it.
//  - gloo (ProcessGroupGloo): the CPU and the simulated device (CPU tensors); on CUDA it can be asked
//    for, and the chunks are then staged on the host. It binds the interfaces GLOO_SOCKET_IFNAME names,
//    else the loopback (a loopback master) or the address the host name resolves to.
// dist-backend=auto picks between them; asking for one this build or this device cannot serve fails
// naming why.
//
//   ferry::Config config = ferry::Config::from_args(argc, argv);   // RANK, WORLD_SIZE, MASTER_ADDR, ...
//   std::shared_ptr<ferry::dist::Communicator> comm = ferry::dist::connect(config);  // null when world size 1
//   ferry::HybridAdamOptions o; o.communicator = comm;
//
// Launchers (Config reads their environment):
//  - torchrun --nproc-per-node=N --no-python PROGRAM ...: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//    MASTER_PORT; torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE=True).
//  - SLURM: `srun PROGRAM ...` (one task per rank): SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID;
//    the rendezvous is MASTER_ADDR / MASTER_PORT where exported, otherwise the first node of
//    SLURM_STEP_NODELIST (where srun starts task 0) at port 15000 + SLURM_JOB_ID % 10000; rank 0
//    serves the store. A program run by the batch script itself (SLURM_PROCID without a step) is one
//    process: connect() refuses SLURM_NTASKS > 1 there at once, naming srun (or --world-size=1).
//  - By hand: --rank, --world-size, --master-addr, --master-port on each process.
//
// connect() checks the launch before anything else runs, and fails with a clear error, within
// Config::dist_timeout_s, when: rank 0's store cannot be reached; not all ranks arrive; two processes
// claim the same rank; ranks disagree on the world size; at once when a SLURM batch script asks for
// several ranks.
#include <memory>

#include "../common/config.h"
#include "communicator.h"

namespace ferry::dist {

// The communicator of this process's rank. Blocks until every rank has joined. Null when
// config.world_size == 1, unless `even_alone`: then a group of one (a launch or backend smoke test;
// HybridAdam runs unsharded over it).
std::shared_ptr<Communicator> connect(const Config& config, bool even_alone = false);

// Whether this build of ferry has Gloo (c10d's ProcessGroupGloo headers were found at build time).
bool have_gloo();
// Whether it has NCCL (a CUDA build of LibTorch and nccl.h were found at build time).
bool have_nccl();

}  // namespace ferry::dist
