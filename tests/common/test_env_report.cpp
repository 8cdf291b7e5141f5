#include <gtest/gtest.h>
#include <torch/version.h>

#include "../../common/env_report.h"
#include "../../common/gpu_info.h"

namespace ferry {
namespace {

TEST(EnvReport, NamesTheRealVersions) {
  const EnvReport r = collect_env_report();
  EXPECT_EQ(r.torch_version, TORCH_VERSION);
  EXPECT_EQ(r.torch_version.rfind("2.11", 0), 0u) << r.torch_version;
  EXPECT_FALSE(r.tbb.empty());
  EXPECT_FALSE(r.spdlog.empty());
  EXPECT_FALSE(r.cpu_isa_best.empty());
  EXPECT_EQ(r.gpu_count, query_gpus().count);
  const std::string text = format_env_report(r);
  for (const char* key : {"torch", "CUDA runtime", "NCCL", "GPU", "oneTBB", "spdlog", "OpenMP", "CPU kernels"}) {
    EXPECT_NE(text.find(key), std::string::npos) << key << "\n" << text;
  }
  const std::string json = env_report_json(r);
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
  EXPECT_NE(json.find("\"torch\":\"" + r.torch_version + "\""), std::string::npos) << json;
}

// A run under FERRY_CPU_ISA_MAX says so in the text and in the JSON; one without says nothing of a cap.
TEST(EnvReport, ACappedKernelLevelIsReported) {
  EnvReport r = collect_env_report();
  r.cpu_isa_cap.clear();
  EXPECT_EQ(format_env_report(r).find("FERRY_CPU_ISA_MAX"), std::string::npos);
  EXPECT_EQ(env_report_json(r).find("cpu_isa_cap"), std::string::npos);
  r.cpu_isa_best = "avx2";
  r.cpu_isa_cap = "avx2";
  r.cpu_isa_hardware = "avx512_bf16";
  const std::string text = format_env_report(r);
  EXPECT_NE(text.find("CPU kernels  avx2 (FERRY_CPU_ISA_MAX=avx2; the CPU has avx512_bf16)"), std::string::npos)
      << text;
  const std::string json = env_report_json(r);
  EXPECT_NE(json.find("\"cpu_isa\":\"avx2\",\"cpu_isa_cap\":\"avx2\",\"cpu_isa_hardware\":\"avx512_bf16\"}"),
            std::string::npos)
      << json;
}

TEST(EnvReport, CudaBuildReportsItsRuntime) {
#ifdef FERRY_WITH_CUDA
  const EnvReport r = collect_env_report();
  EXPECT_TRUE(r.torch_cuda_build);
  EXPECT_FALSE(r.cuda_runtime.empty());
#else
  GTEST_SKIP() << "torch without CUDA";
#endif
}

}  // namespace
}  // namespace ferry
