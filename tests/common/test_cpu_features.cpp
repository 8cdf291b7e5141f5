#include <gtest/gtest.h>
#include <c10/util/Exception.h>

#include <cstdlib>
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

// FERRY_CPU_ISA_MAX: no level above the cap, and below it exactly what the hardware has.
TEST(CpuFeatures, ACapAllowsNoLevelAboveIt) {
  CpuFeatures hardware = cpu_features();
  hardware.cap.reset();
  const CpuIsa levels[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16};
  for (CpuIsa cap : levels) {
    CpuFeatures capped = hardware;
    capped.cap = cap;
    for (CpuIsa isa : levels) {
      const bool below = static_cast<int>(isa) <= static_cast<int>(cap);
      EXPECT_EQ(features_allow(capped, isa), below && features_allow(hardware, isa))
          << to_string(isa) << " under a cap of " << to_string(cap);
    }
    EXPECT_LE(static_cast<int>(best_isa(capped)), static_cast<int>(cap)) << to_string(cap);
    EXPECT_TRUE(features_allow(capped, best_isa(capped)));
  }
  EXPECT_EQ(best_isa(hardware), best_isa([&] {
              CpuFeatures c = hardware;
              c.cap = CpuIsa::kAvx512Bf16;  // the top level caps nothing
              return c;
            }()));
}

TEST(CpuFeatures, ParsesTheCapStrictly) {
  EXPECT_FALSE(parse_cpu_isa_cap(nullptr).has_value());
  EXPECT_FALSE(parse_cpu_isa_cap("").has_value());
  EXPECT_EQ(parse_cpu_isa_cap("avx2"), CpuIsa::kAvx2);
  EXPECT_EQ(parse_cpu_isa_cap("AVX512_BF16"), CpuIsa::kAvx512Bf16);  // as --cpu-isa: any case
  EXPECT_EQ(parse_cpu_isa_cap("scalar"), CpuIsa::kScalar);
  for (const char* bad : {"avx2 ", "sse4", "avx-512", "auto"}) {
    try {
      parse_cpu_isa_cap(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("FERRY_CPU_ISA_MAX"), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("'") + bad + "'"), std::string::npos) << what;
    }
  }
}

// Run by ctest also with FERRY_CPU_ISA_MAX=scalar (test_cpu_features_capped): the process's own
// features carry the environment's cap, and nothing above it is supported.
TEST(CpuFeatures, TheEnvironmentsCapHolds) {
  const std::optional<CpuIsa> cap = parse_cpu_isa_cap(std::getenv("FERRY_CPU_ISA_MAX"));
  EXPECT_EQ(cpu_features().cap, cap);
  if (!cap) GTEST_SKIP() << "FERRY_CPU_ISA_MAX is not set";
  EXPECT_LE(static_cast<int>(best_cpu_isa()), static_cast<int>(*cap));
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (above_cap(cpu_features(), isa)) {
      EXPECT_FALSE(cpu_supports(isa)) << to_string(isa);
    }
    EXPECT_EQ(above_cap(cpu_features(), isa), static_cast<int>(isa) > static_cast<int>(*cap)) << to_string(isa);
  }
}

TEST(CpuFeatures, NamesRoundTrip) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    EXPECT_EQ(parse_cpu_isa(to_string(isa)), isa);
  }
  EXPECT_FALSE(parse_cpu_isa("sse9").has_value());
}

}  // namespace
}  // namespace ferry
