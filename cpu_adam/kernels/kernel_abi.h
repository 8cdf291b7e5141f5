#pragma once
// The interface between cpu_adam.cpp (validation, threads) and the per-ISA kernel files.
//
// Kernel files are compiled with ISA flags (-mavx2, -mavx512f, ...). They include only this header,
// host_device.h, float16.h, adam_body.h, compact_body.h and <immintrin.h> (the CUDA file also
// cuda_ops.h, compact_cuda_block.h, fp32_cuda_thread.h and norm_cuda_grain.h): no torch or other C++
// headers with inline functions whose ISA-flagged copies the linker could pick for the whole program
// (ODR), which would put AVX-512 code on CPUs without it. Everything they define has internal linkage
// except their KernelTable.
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

// The gradient's squared norm, in one order of operations wherever it is computed (Note [One norm
// wherever the gradient lives], norm_body.h): every CPU kernel, any thread count or split, and the
// device's kernel give the same bits for the same span. A span is cut into grains of kNormGrain
// elements (thread_split.h's grains), a grain into blocks of kNormBlock, a block into rows of
// kNormLanes; lane l of a block sums the squares of its rows' l-th elements in fp32 (fma), the lanes
// are folded in a fixed tree, a grain adds its blocks' fp32 totals in fp64 and the span its grains'.
constexpr int64_t kNormLanes = 16;
constexpr int64_t kNormBlock = 64 * kNormLanes;
constexpr int64_t kNormGrain = int64_t{1} << 15;
static_assert(kNormGrain % kNormBlock == 0, "a grain is whole norm blocks");

struct GradStats {
  double sum_sq = 0.0;     // sum of (grad * grad_scale)^2 in the order above
  bool nonfinite = false;  // any inf or NaN
};

// The compact state's update (Note [The compact state format], cpu_adam/compact_state.h): bf16 master
// (stochastic rounding), moments as 8-bit codes with one fp32 scale per block of kCompactBlock elements.
// Blocks start at element 0 of the arrays; `begin` is a multiple of kCompactBlock, `end` one or the
// arrays' end. The hyper-parameters are `hyper`'s (its pointers unused).
constexpr int64_t kCompactBlock = 256;
struct CompactAdamArgs {
  uint16_t* master = nullptr;          // bf16 bits, updated in place
  const void* grad = nullptr;          // hyper.grad_type elements
  uint8_t* exp_avg = nullptr;          // signed codes of exp_avg / its block's scale
  float* exp_avg_scale = nullptr;      // per block: max |exp_avg|
  uint8_t* exp_avg_sq = nullptr;       // codes of sqrt(exp_avg_sq) / its block's scale
  float* exp_avg_sq_scale = nullptr;   // per block: max sqrt(exp_avg_sq)
  void* param_lowp = nullptr;          // the compute copy, written when hyper.lowp_type != kNone
  uint32_t rounding_seed = 0;          // this step's stream of rounding bits
  uint32_t element_offset = 0;         // (low 32 bits of) element 0's index in the stream
  // CPU kernels: a block's codes stored right after its own update (false), or beside the next block's
  // update (true: the divider's work of one block beside the other's codes; predicted faster where the
  // divider bounds the update, Intel's cores, slower as measured on Zen 4; the default once measured
  // there: bench_cpu_adam --compact-ab). The same bits either way.
  bool overlap_blocks = false;
  AdamKernelArgs hyper;
};

using AdamFn = void (*)(const AdamKernelArgs& args, int64_t begin, int64_t end);
using CompactAdamFn = void (*)(const CompactAdamArgs& args, int64_t begin, int64_t end);
// The norm of elements [begin, end) of `grad`, blocks of kNormBlock from element 0: `begin` is a
// multiple of kNormBlock (a grain's start), `end` any; the sum of one grain's blocks.
using GradStatsFn = GradStats (*)(const void* grad, GradType type, float grad_scale, int64_t begin, int64_t end);

struct KernelTable {
  int vector_width;  // fp32 lanes
  AdamFn adam;
  GradStatsFn grad_stats;
  CompactAdamFn compact_adam;
};

// The compact state of `n` elements as fp32 and back, with the kernels' codes (adam_scalar.cpp; no ISA
// flags): decode writes master, exp_avg, exp_avg_sq (any may be null); encode rounds the master to
// nearest (a conversion, not an update) and sets each block's scales to its maxima, for the inputs
// given (any may be null: that role is left as it is).
struct CompactStateView {
  uint16_t* master = nullptr;
  uint8_t* exp_avg = nullptr;
  float* exp_avg_scale = nullptr;
  uint8_t* exp_avg_sq = nullptr;
  float* exp_avg_sq_scale = nullptr;
};
void compact_decode(const CompactStateView& state, int64_t n, float* master, float* exp_avg, float* exp_avg_sq);
void compact_encode(const CompactStateView& state, int64_t n, const float* master, const float* exp_avg,
                    const float* exp_avg_sq);

// Defined in kernels/adam_<isa>.cpp; only call one whose ISA ferry::cpu_supports().
extern const KernelTable kScalarKernels;
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;
extern const KernelTable kAvx512Bf16Kernels;

}  // namespace ferry::cpu_adam
