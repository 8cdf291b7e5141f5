// Portable kernels: the reference every SIMD kernel must match bit for bit.
#include <cmath>

#include "float16.h"
#include "kernel_abi.h"

namespace ferry::cpu_adam {
namespace {

#include "adam_body.h"

struct ScalarOps {
  using F = float;
  static constexpr int W = 1;
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static F set1(float x) { return x; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F sqrt(F a) { return std::sqrt(a); }
  static F div(F a, F b) { return a / b; }
  static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static void store_bf16(uint16_t* p, F v) { *p = f32_to_bf16(v); }
  static void store_f16(uint16_t* p, F v) { *p = f32_to_f16(v); }
  static float hsum(F v) { return v; }
};

}  // namespace

const KernelTable kScalarKernels{1, &Dispatch<ScalarOps>::adam, &Dispatch<ScalarOps>::grad_stats};

}  // namespace ferry::cpu_adam
