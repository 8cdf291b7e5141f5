#include "env_report.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <dlfcn.h>
#include <omp.h>
#include <oneapi/tbb/version.h>
#include <torch/version.h>

#include <sstream>
#include <thread>

#include "cpu_features.h"
#include "gpu_info.h"
#include "logging.h"
#include "version.h"

namespace ferry {
namespace {

std::string dotted(long v, long major_div, long minor_div, long minor_mod) {
  std::ostringstream os;
  os << v / major_div << '.' << (v / minor_div) % minor_mod;
  return os.str();
}

// NCCL as loaded by torch in this process (no nccl.h needed: torch_cuda brings libnccl in).
std::string nccl_version() {
  using Fn = int (*)(int*);
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "ncclGetVersion"));
  if (!fn) return "";
  int v = 0;
  if (fn(&v) != 0) return "";
  std::ostringstream os;
  os << v / 10000 << '.' << (v / 100) % 100 << '.' << v % 100;  // NCCL >= 2.9 encoding
  return os.str();
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

}  // namespace

const char* version() { return FERRY_VERSION_STRING; }

EnvReport collect_env_report() {
  EnvReport r;
  r.ferry_version = version();
  r.torch_version = TORCH_VERSION;
  const auto& hooks = at::detail::getCUDAHooks();
  r.torch_cuda_build = hooks.hasCUDART();
  if (r.torch_cuda_build) {
    const long rt = hooks.versionCUDART();  // 13000 -> 13.0
    if (rt > 0) r.cuda_runtime = dotted(rt, 1000, 10, 100);
    const long dnn = hooks.versionCuDNN();  // 91900 -> 9.19.0
    if (dnn > 0) {
      std::ostringstream os;
      os << dnn / 10000 << '.' << (dnn / 100) % 100 << '.' << dnn % 100;
      r.cudnn = os.str();
    }
  }
  r.nccl = nccl_version();
  const GpuInfo gpu = query_gpus();
  r.gpu_count = gpu.count;
  r.gpu_name = gpu.name;
  r.gpu_memory_bytes = gpu.total_memory_bytes;
  r.tbb = TBB_runtime_version();
  r.spdlog = log::spdlog_version();
  {
    std::ostringstream os;
    os << "_OPENMP=" << _OPENMP << ", " << omp_get_max_threads() << " threads";
    r.openmp = os.str();
  }
  const CpuFeatures& f = cpu_features();
  r.cpu_brand = f.brand;
  r.cpu_isa_best = to_string(best_cpu_isa());
  if (f.cap) {
    CpuFeatures uncapped = f;
    uncapped.cap.reset();
    r.cpu_isa_cap = to_string(*f.cap);
    r.cpu_isa_hardware = to_string(best_isa(uncapped));
  }
  std::ostringstream flags;
  const std::pair<const char*, bool> named[] = {
      {"avx2", f.avx2},         {"fma", f.fma},           {"f16c", f.f16c},
      {"avx512f", f.avx512f},   {"avx512bw", f.avx512bw}, {"avx512vl", f.avx512vl},
      {"avx512dq", f.avx512dq}, {"avx512_bf16", f.avx512_bf16}};
  for (const auto& [name, present] : named) {
    if (present) flags << (flags.tellp() > 0 ? " " : "") << name;
  }
  r.cpu_flags = flags.str();
  r.logical_cpus = static_cast<int>(std::thread::hardware_concurrency());
  return r;
}

std::string format_env_report(const EnvReport& r) {
  auto or_none = [](const std::string& s) { return s.empty() ? std::string("none") : s; };
  std::ostringstream os;
  os << "ferry        " << r.ferry_version << "\n"
     << "torch        " << r.torch_version << (r.torch_cuda_build ? " (CUDA build)" : " (CPU build)") << "\n"
     << "CUDA runtime " << or_none(r.cuda_runtime) << "\n"
     << "cuDNN        " << or_none(r.cudnn) << "\n"
     << "NCCL         " << or_none(r.nccl) << "\n"
     << "GPU          ";
  if (r.gpu_count > 0) {
    os << r.gpu_count << " x " << r.gpu_name << " (" << (r.gpu_memory_bytes >> 20) << " MiB)";
  } else {
    os << "none available (device chunks use the simulated device)";
  }
  os << "\n"
     << "oneTBB       " << r.tbb << "\n"
     << "spdlog       " << r.spdlog << "\n"
     << "OpenMP       " << r.openmp << "\n"
     << "CPU          " << r.cpu_brand << ", " << r.logical_cpus << " logical CPUs\n"
     << "CPU features " << or_none(r.cpu_flags) << "\n"
     << "CPU kernels  " << r.cpu_isa_best
     << (r.cpu_isa_cap.empty() ? std::string()
                               : " (FERRY_CPU_ISA_MAX=" + r.cpu_isa_cap + "; the CPU has " + r.cpu_isa_hardware + ")")
     << "\n";
  return os.str();
}

std::string env_report_json(const EnvReport& r) {
  std::ostringstream os;
  os << "{\"ferry\":\"" << json_escape(r.ferry_version) << "\",\"torch\":\"" << json_escape(r.torch_version)
     << "\",\"torch_cuda_build\":" << (r.torch_cuda_build ? "true" : "false") << ",\"cuda_runtime\":\""
     << json_escape(r.cuda_runtime) << "\",\"cudnn\":\"" << json_escape(r.cudnn) << "\",\"nccl\":\""
     << json_escape(r.nccl) << "\",\"gpu_count\":" << r.gpu_count << ",\"gpu_name\":\"" << json_escape(r.gpu_name)
     << "\",\"gpu_memory_bytes\":" << r.gpu_memory_bytes << ",\"tbb\":\"" << json_escape(r.tbb)
     << "\",\"spdlog\":\"" << json_escape(r.spdlog) << "\",\"openmp\":\"" << json_escape(r.openmp)
     << "\",\"cpu\":\"" << json_escape(r.cpu_brand) << "\",\"logical_cpus\":" << r.logical_cpus
     << ",\"cpu_features\":\"" << json_escape(r.cpu_flags) << "\",\"cpu_isa\":\"" << json_escape(r.cpu_isa_best)
     << "\"";
  if (!r.cpu_isa_cap.empty()) {  // only where set: results of capped runs say so
    os << ",\"cpu_isa_cap\":\"" << json_escape(r.cpu_isa_cap) << "\",\"cpu_isa_hardware\":\""
       << json_escape(r.cpu_isa_hardware) << "\"";
  }
  os << "}";
  return os.str();
}

}  // namespace ferry
