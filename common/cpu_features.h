#pragma once
// The CPU's vector features, detected once per process (cpuid + xgetbv: an instruction set counts
// only if the OS also saves its registers), and the instruction-set levels ferry's kernels target.
//
// FERRY_CPU_ISA_MAX=scalar|avx2|avx512|avx512_bf16 (read once, with the features) caps the levels
// ferry uses below what the CPU has: this machine then picks and allows the kernels a machine with
// only that level would (AVX2-only machines are common; the test suite is meant to pass on them, and
// `FERRY_CPU_ISA_MAX=avx2 ctest` checks it on an AVX-512 one). torch's own kernels are not affected
// (ATEN_CPU_CAPABILITY is torch's). Any other value is an error at the first use.
#include <optional>
#include <string>
#include <string_view>

namespace ferry {

// Kernel levels, ordered: a higher level needs every feature of the lower ones.
enum class CpuIsa {
  kScalar,      // portable C++
  kAvx2,        // AVX2 + FMA + F16C
  kAvx512,      // AVX-512 F/BW/VL/DQ (bf16 rounding done with integer ops)
  kAvx512Bf16,  // kAvx512 + AVX512_BF16 (native fp32 -> bf16 conversion)
};

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512_bf16 = false;
  bool os_saves_ymm = false;  // XCR0 has SSE+AVX state
  bool os_saves_zmm = false;  // XCR0 has opmask+ZMM state
  std::string brand;          // e.g. "AMD EPYC 9654 96-Core Processor"
  std::optional<CpuIsa> cap;  // FERRY_CPU_ISA_MAX, if set
};

// Detected on first call; thread-safe.
const CpuFeatures& cpu_features();
// Whether this CPU (and OS) can run kernels of `isa`, and FERRY_CPU_ISA_MAX allows it.
bool cpu_supports(CpuIsa isa);
// The highest level cpu_supports().
CpuIsa best_cpu_isa();
// Whether the features `f` allow `isa` (the hardware and f.cap); cpu_supports() of cpu_features().
bool features_allow(const CpuFeatures& f, CpuIsa isa);
// Whether f.cap (FERRY_CPU_ISA_MAX) rules `isa` out, whatever the hardware has.
bool above_cap(const CpuFeatures& f, CpuIsa isa);
// The highest level `f` allows.
CpuIsa best_isa(const CpuFeatures& f);
// FERRY_CPU_ISA_MAX's value as a cap: std::nullopt for null or empty; an error naming the variable,
// the levels and the value for anything else.
std::optional<CpuIsa> parse_cpu_isa_cap(const char* value);

const char* to_string(CpuIsa isa);
// "scalar", "avx2", "avx512", "avx512_bf16"; std::nullopt for anything else.
std::optional<CpuIsa> parse_cpu_isa(std::string_view name);

}  // namespace ferry
