#pragma once
// What CUDA devices this process sees. Safe on machines without a GPU or driver (count 0).
#include <cstdint>
#include <string>

namespace ferry {

struct GpuInfo {
  int count = 0;                  // visible CUDA devices
  std::string name;               // device 0's name
  int64_t total_memory_bytes = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

GpuInfo query_gpus();
// Whether at least one CUDA device is usable (torch built with CUDA, driver present, device visible).
bool cuda_available();

}  // namespace ferry
