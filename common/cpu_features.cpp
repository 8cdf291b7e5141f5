#include "cpu_features.h"

#include <c10/util/Exception.h>
#include <cpuid.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace ferry {
namespace {

uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 1) return f;
  __cpuid(1, eax, ebx, ecx, edx);
  f.fma = ecx & bit_FMA;
  f.f16c = ecx & bit_F16C;
  const bool osxsave = ecx & bit_OSXSAVE;
  const bool avx = ecx & bit_AVX;
  if (osxsave && avx) {
    const uint64_t xcr0 = read_xcr0();
    f.os_saves_ymm = (xcr0 & 0x6) == 0x6;
    f.os_saves_zmm = (xcr0 & 0xe6) == 0xe6;
  }
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    f.avx2 = ebx & bit_AVX2;
    f.avx512f = ebx & bit_AVX512F;
    f.avx512dq = ebx & bit_AVX512DQ;
    f.avx512bw = ebx & bit_AVX512BW;
    f.avx512vl = ebx & bit_AVX512VL;
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    f.avx512_bf16 = eax & (1u << 5);
  }
  char brand[49] = {};
  // GCC's cpuid.h returns unsigned, Clang's int: the leaf is compared unsigned in both.
  if (static_cast<unsigned>(__get_cpuid_max(0x80000000, nullptr)) >= 0x80000004u) {
    for (unsigned i = 0; i < 3; ++i) {
      unsigned regs[4];
      __cpuid(0x80000002 + i, regs[0], regs[1], regs[2], regs[3]);
      std::memcpy(brand + 16 * i, regs, 16);
    }
  }
  f.brand = brand;
  while (!f.brand.empty() && f.brand.back() == ' ') f.brand.pop_back();
  f.cap = parse_cpu_isa_cap(std::getenv("FERRY_CPU_ISA_MAX"));
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

bool cpu_supports(CpuIsa isa) { return features_allow(cpu_features(), isa); }

bool above_cap(const CpuFeatures& f, CpuIsa isa) {
  return f.cap && static_cast<int>(isa) > static_cast<int>(*f.cap);
}

bool features_allow(const CpuFeatures& f, CpuIsa isa) {
  if (above_cap(f, isa)) return false;
  const bool avx2 = f.os_saves_ymm && f.avx2 && f.fma && f.f16c;
  const bool avx512 = avx2 && f.os_saves_zmm && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return avx2;
    case CpuIsa::kAvx512: return avx512;
    case CpuIsa::kAvx512Bf16: return avx512 && f.avx512_bf16;
  }
  return false;
}

CpuIsa best_cpu_isa() { return best_isa(cpu_features()); }

CpuIsa best_isa(const CpuFeatures& f) {
  for (CpuIsa isa : {CpuIsa::kAvx512Bf16, CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (features_allow(f, isa)) return isa;
  }
  return CpuIsa::kScalar;
}

const char* to_string(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
  }
  return "?";
}

std::optional<CpuIsa> parse_cpu_isa_cap(const char* value) {
  if (value == nullptr || *value == '\0') return std::nullopt;
  std::string name(value);
  for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const std::optional<CpuIsa> cap = parse_cpu_isa(name);
  TORCH_CHECK(cap.has_value(), "ferry: FERRY_CPU_ISA_MAX: expected scalar|avx2|avx512|avx512_bf16 (the highest ",
              "CPU Adam kernel level ferry may use), got '", value, "'");
  return cap;
}

std::optional<CpuIsa> parse_cpu_isa(std::string_view name) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (name == to_string(isa)) return isa;
  }
  return std::nullopt;
}

}  // namespace ferry
