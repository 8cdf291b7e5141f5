#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "../../common/cpu_features.h"

namespace ferry {
namespace {

// The kernel's view of the CPU (/proc/cpuinfo flags) is an independent reference for cpuid.
std::string proc_cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0) return " " + line.substr(line.find(':') + 1) + " ";
  }
  return "";
}

TEST(CpuFeatures, AgreesWithProcCpuinfo) {
  const std::string flags = proc_cpu_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags line";
  auto has = [&](const char* f) { return flags.find(std::string(" ") + f + " ") != std::string::npos; };
  const CpuFeatures& c = cpu_features();
  EXPECT_EQ(c.avx2, has("avx2"));
  EXPECT_EQ(c.fma, has("fma"));
  EXPECT_EQ(c.f16c, has("f16c"));
  EXPECT_EQ(c.avx512f, has("avx512f"));
  EXPECT_EQ(c.avx512bw, has("avx512bw"));
  EXPECT_EQ(c.avx512_bf16, has("avx512_bf16"));
}

TEST(CpuFeatures, LevelsAreOrdered) {
  EXPECT_TRUE(cpu_supports(CpuIsa::kScalar));
  if (cpu_supports(CpuIsa::kAvx512Bf16)) {
    EXPECT_TRUE(cpu_supports(CpuIsa::kAvx512));
  }
  if (cpu_supports(CpuIsa::kAvx512)) {
    EXPECT_TRUE(cpu_supports(CpuIsa::kAvx2));
  }
  EXPECT_TRUE(cpu_supports(best_cpu_isa()));
}

TEST(CpuFeatures, NamesRoundTrip) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    EXPECT_EQ(parse_cpu_isa(to_string(isa)), isa);
  }
  EXPECT_FALSE(parse_cpu_isa("sse9").has_value());
}

}  // namespace
}  // namespace ferry
