#pragma once
// The environment report: what ferry runs on. Printed by ferry_info and logged by examples.
#include <string>

namespace ferry {

struct EnvReport {
  std::string ferry_version;
  std::string torch_version;   // TORCH_VERSION of the headers built against
  bool torch_cuda_build = false;
  std::string cuda_runtime;    // "13.0" (torch's CUDA runtime), empty without CUDA
  std::string cudnn;           // "9.19.0", empty if none
  std::string nccl;            // "2.28.9" as loaded in this process, empty if none
  int gpu_count = 0;
  std::string gpu_name;        // device 0
  long long gpu_memory_bytes = 0;
  std::string tbb;             // oneTBB runtime version
  std::string spdlog;
  std::string openmp;          // "_OPENMP=201511, 16 threads"
  std::string cpu_brand;
  std::string cpu_isa_best;    // best kernel level ferry will use
  std::string cpu_isa_cap;     // FERRY_CPU_ISA_MAX, empty if not set
  std::string cpu_isa_hardware;  // with a cap: the best level the CPU itself has
  std::string cpu_flags;       // "avx2 fma f16c ..."
  int logical_cpus = 0;
};

EnvReport collect_env_report();
// Human-readable block, one "key: value" per line.
std::string format_env_report(const EnvReport& report);
// One JSON object (for benchmark result files).
std::string env_report_json(const EnvReport& report);

}  // namespace ferry
