#pragma once
// The interface between cpu_adam.cpp (validation, threads) and the per-ISA kernel files.
//
// Kernel files are compiled with ISA flags (-mavx2, -mavx512f, ...). They include only this header,
// host_device.h, float16.h, adam_body.h and <immintrin.h>: no torch or other C++ headers with inline functions whose
// ISA-flagged copies the linker could pick for the whole program (ODR), which would put AVX-512 code
// on CPUs without it. Everything they define has internal linkage except their KernelTable.
#include <cstdint>
#include <cstring>

#include "host_device.h"


namespace ferry::cpu_adam {

enum class GradType : uint8_t { kF32, kBf16, kF16 };
enum class LowpType : uint8_t { kNone, kBf16, kF16 };

// One Adam/AdamW update of elements [begin, end) of these arrays. Pointers may be unaligned.
struct AdamKernelArgs {
  float* param = nullptr;         // fp32 master, updated in place
  const void* grad = nullptr;     // grad_type elements
  float* exp_avg = nullptr;       // updated in place
  float* exp_avg_sq = nullptr;    // updated in place
  void* param_lowp = nullptr;     // written with the updated param when lowp_type != kNone
  GradType grad_type = GradType::kF32;
  LowpType lowp_type = LowpType::kNone;
  bool decoupled_decay = true;    // AdamW (true) or Adam with L2 (false)
  float grad_scale = 1.0f;        // grads are multiplied by this (clip_coef / loss_scale)
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;      // L2 coefficient (Adam)
  float decay_factor = 1.0f;      // 1 - lr * weight_decay (AdamW)
  float step_size = 1e-3f;        // lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt = 1.0f;  // 1 / sqrt(1 - beta2^t)
};

struct GradStats {
  double sum_sq = 0.0;     // sum of (grad * grad_scale)^2 over finite elements' blocks
  bool nonfinite = false;  // any inf or NaN
};

using AdamFn = void (*)(const AdamKernelArgs& args, int64_t begin, int64_t end);
using GradStatsFn = GradStats (*)(const void* grad, GradType type, float grad_scale, int64_t begin, int64_t end);

struct KernelTable {
  int vector_width;  // fp32 lanes
  AdamFn adam;
  GradStatsFn grad_stats;
};

// Defined in kernels/adam_<isa>.cpp; only call one whose ISA ferry::cpu_supports().
extern const KernelTable kScalarKernels;
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;
extern const KernelTable kAvx512Bf16Kernels;

}  // namespace ferry::cpu_adam
