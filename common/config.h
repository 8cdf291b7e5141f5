#pragma once
// ferry's one configuration struct, parsed and validated in one place (config.cpp).
//
// Sources, later ones win: built-in defaults < environment (launchers' RANK/WORLD_SIZE/LOCAL_RANK or
// SLURM's task variables, MASTER_ADDR/MASTER_PORT, torchrun's TORCHELASTIC_USE_AGENT_STORE,
// CUDA_VISIBLE_DEVICES's count, GLOO_SOCKET_IFNAME, FERRY_DIST_TIMEOUT and FERRY_LOG_LEVEL) < command
// line (--key=value).
// No other file of ferry reads the environment (the CUDA allocator's settings, which are torch's, are
// read here too: cuda_allocator_configured).
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "logging.h"

namespace ferry {

// Where "device" chunks live.
enum class DeviceKind {
  kAuto,       // CUDA if a GPU is present, else the simulated device
  kCuda,       // the current CUDA device; an error where there is none
  kSimulated,  // device tier simulated in host memory, same API and budgets (CPU-only machines, CI)
};

// dtype of the compute copy of parameters.
enum class Precision { kFp32, kBf16, kFp16 };

// What ferry::checkpoint segments do with their activations (hooks/activation_segments.h): recompute
// them in backward (every segment, as torch.utils.checkpoint), keep them (as if not checkpointed), or
// auto: measured in the warm-up and planned against the device's room together with the optimizer
// state's placement (scheduler/memory_plan.h).
enum class ActivationPolicy { kRecompute, kKeep, kAuto };

// How the CPU Adam shares a span among its threads (cpu_adam/thread_split.h): dynamic, the threads
// claim fixed grains as they go, so one slowed by another thread on its core does less of the span;
// static, each thread gets an equal run of grains up front. The same bits either way.
enum class CpuSplit { kDynamic, kStatic };

// What set rank and world size (Config::from_env, Config::set; docs/ARCHITECTURE.md D97).
enum class Launcher {
  kNone,           // nothing: one process
  kRankVariables,  // RANK / WORLD_SIZE / LOCAL_RANK in the environment (torchrun, or by hand)
  // A task srun started (SLURM_STEP_NUM_TASKS is set): rank SLURM_PROCID of SLURM_STEP_NUM_TASKS,
  // local rank SLURM_LOCALID; without MASTER_ADDR / MASTER_PORT, the rendezvous is the first node of
  // SLURM_STEP_NODELIST at port 15000 + SLURM_JOB_ID % 10000.
  kSlurmStep,
  // SLURM's batch script itself (SLURM_PROCID without a step): world size SLURM_NTASKS, but this is
  // one process and no other rank will come, so dist::connect refuses a world size > 1 here, naming
  // srun (or --world-size=1 to run alone) instead of waiting dist-timeout for them.
  kSlurmBatch,
  kArguments,  // --rank / --world-size on the command line
};

struct Config {
  DeviceKind device = DeviceKind::kAuto;
  Precision precision = Precision::kFp32;
  ActivationPolicy activations = ActivationPolicy::kRecompute;
  // Bytes per chunk of the compute copy; 0 (the default, "auto" on the command line): the size with
  // the least packing waste for the model, at most a sixteenth of the device's room for chunks (the
  // budget, else the capacity; per rank's share of a gathered group) so that prefetch has room ahead
  // of the chunks in use (auto_chunk_size in chunk/layout.h, D99).
  int64_t chunk_size_bytes = 0;
  int64_t device_budget_bytes = 0;               // bytes for chunks on the device; 0 = no limit
  // The device's memory for chunks and everything else (activations, temporaries); 0 = the GPU's
  // (all but max(2 GiB, 5%) of it: default_gpu_capacity_bytes) on CUDA, unknown on the simulated device. ferry keeps chunks within
  // capacity - non-model memory at every moment, and within device_budget_bytes always.
  int64_t device_capacity_bytes = 0;
  int64_t host_budget_bytes = 0;                 // bytes for chunks on the host; 0 = no limit
  int cpu_threads = 0;                           // CPU Adam threads; 0 = all of OpenMP's
  std::string cpu_isa = "auto";                  // CPU Adam kernel: auto|scalar|avx2|avx512|avx512_bf16
  CpuSplit cpu_split = CpuSplit::kDynamic;       // how a CPU Adam update is shared among its threads
  log::Level log_level = log::Level::kInfo;

  // Launch (read from the environment; overridable on the command line).
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  // How many GPUs CUDA_VISIBLE_DEVICES names (-1: not set). Exactly one means the launcher gave this
  // process a GPU of its own (srun --gpus-per-task=1 or --gpu-bind, a per-process CUDA_VISIBLE_DEVICES):
  // dist::connect then binds that one, device 0, whatever the local rank.
  int visible_gpus = -1;
  // Rendezvous of a multi-process run (world_size > 1; dist/process_group.h): the TCPStore of rank 0
  // (or of torchrun's agent) at master_addr:master_port.
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Where ferry found master_addr when no one gave it (e.g. "SLURM_STEP_NODELIST=node[01-04]"), for
  // the rendezvous' log and errors; "" when it was given (MASTER_ADDR, --master-addr) or the default.
  std::string master_addr_from;
  // torchrun already serves the store at MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): every rank
  // is a client. Otherwise rank 0 serves it.
  bool agent_store = false;
  // The network interfaces Gloo binds (GLOO_SOCKET_IFNAME, comma-separated, as torch.distributed reads
  // it); empty: the loopback where master_addr is one, else the address this host's name resolves to.
  std::vector<std::string> gloo_interfaces;
  std::string dist_backend = "auto";  // auto (nccl on CUDA, gloo otherwise) | gloo | nccl
  // Seconds a rendezvous or a collective may wait for the other ranks before failing (a dead rank).
  double dist_timeout_s = 300.0;

  // Defaults overridden by the environment `env` (pass read_environment() in programs).
  static Config from_env(const std::map<std::string, std::string>& env);
  // from_env(read_environment()), then --key=value arguments. argv[0] is skipped. Arguments that are
  // not ferry's (do not start with --, or name no known key) are returned in `rest` when given,
  // otherwise they are an error.
  static Config from_args(int argc, const char* const* argv, std::vector<std::string>* rest = nullptr);

  // Applies one "key=value" (the form of --key=value without the dashes). Fails on an unknown key or
  // a bad value, naming both.
  void set(std::string_view key, std::string_view value);

  // TORCH_CHECKs every field; called by from_env/from_args/set.
  void validate() const;
  // One line per field, for logs and reports.
  std::string to_string() const;
  // The --key=value options this struct understands, with a one-line help each.
  static std::string help();
};

// The process environment as a map (only the variables Config reads).
std::map<std::string, std::string> read_environment();
// Whether the user configured the CUDA caching allocator: PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF
// is set (cli::prefer_expandable_segments then leaves it alone).
bool cuda_allocator_configured();

// "64MiB", "1.5GiB", "512MB", "4096" (bytes) -> bytes. Binary (KiB/MiB/GiB/TiB, K/M/G/T) and
// decimal (KB/MB/GB/TB) units. Fails on anything else, negative or overflowing values.
int64_t parse_bytes(std::string_view text);
// 67108864 -> "64.0 MiB".
std::string format_bytes(int64_t bytes);
log::Level parse_log_level(std::string_view text);
const char* to_string(DeviceKind kind);
const char* to_string(Precision precision);
const char* to_string(ActivationPolicy policy);
const char* to_string(CpuSplit split);
const char* to_string(Launcher launcher);

}  // namespace ferry
