#pragma once
// The CPU's vector features, detected once per process (cpuid + xgetbv: an instruction set counts
// only if the OS also saves its registers), and the instruction-set levels ferry's kernels target.
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
};

// Detected on first call; thread-safe.
const CpuFeatures& cpu_features();
// Whether this CPU (and OS) can run kernels of `isa`.
bool cpu_supports(CpuIsa isa);
// The highest level this CPU supports.
CpuIsa best_cpu_isa();

const char* to_string(CpuIsa isa);
// "scalar", "avx2", "avx512", "avx512_bf16"; std::nullopt for anything else.
std::optional<CpuIsa> parse_cpu_isa(std::string_view name);

}  // namespace ferry
