#pragma once
// The compact optimizer state format (opt-in; issue 48): what each role holds per parameter, and the
// update CpuAdam runs over it (CpuAdam::update(..., CompactAdamSpan, ...), kernels/compact_body.h).
//
// Note [The compact state format]
// Per parameter, beside the compute copy (2 B bf16, in the parameter chunk, where gradients land):
//   master      2 B   bf16, updated with stochastic rounding
//   exp_avg     1 B   sign + E4M3 code of exp_avg / s_m,        s_m = the block's max |exp_avg|
//   exp_avg_sq  1 B   E4M4 code of sqrt(exp_avg_sq) / s_u,      s_u = the block's max sqrt(exp_avg_sq)
//   scales      8 B per block of kCompactBlock = 256 elements (s_m, s_u as fp32): 0.03 B
// = 6.03 B per parameter with the compute copy, against 14 for the fp32 state (2 + 4 + 4 + 4).
//
// What is rounded where, per step (one element; kernels/compact_body.h has the operations):
//  - the update itself is fp32 Adam from the decoded state: m, v, the denominator and the new value p
//    in fp32 with fma/sqrt/div, beta1, sqrt(beta2) and the grad scale folded into the block's scales
//    and the (1 - beta) factors (each product rounded once, 2^-24 relative), so within a step the
//    errors that matter are the three stores;
//  - master: p rounded to bf16 stochastically (the 16 bits below bf16's added to 16 hashed bits of the
//    element's index and the step, then truncated): |error| < 1 bf16 ulp of p (2^-8 |p| at most), and
//    unbiased: E[stored] = p. Round-to-nearest would drop every update smaller than half an ulp (a
//    bias that grows as the lr decays); stochastic rounding keeps them in expectation (Zamirai et al.,
//    arXiv 2010.06192: bf16 weights with stochastic rounding or Kahan summation match fp32 within
//    -0.1..+0.2%);
//  - exp_avg: |m| / s_m rounded to nearest on a 3-bit mantissa (ties away from zero, which reads only
//    the bits down to the rounding bit: the AVX-512 kernel encodes from the top 16 bits of
//    32 values at a time): |error| <= 2^-4 |m| for |m| >=
//    2^-14 s_m, <= 2^-18 s_m below (subnormal steps); the block's largest |m| is exact;
//  - exp_avg_sq: stored as u = sqrt(v), rounded to nearest on a 4-bit mantissa (ties away, as m's):
//    |error| <= 2^-5 u for
//    u >= 2^-14 s_u, <= 2^-19 s_u below, and a u > 0 never stored as 0 (it rounds up to the smallest
//    code, 2^-18 s_u): the denominator sqrt(v) + eps is never lost, so no update is divided by eps
//    alone (the failure mode of v quantised to zero, Li et al. 2023). Storing sqrt(v) halves the
//    binades to cover; the denominator's relative error is u's (2^-5), not v's doubled.
// Why it trains like fp32 Adam: the moments are exponential averages, so a store's error enters the
// next step multiplied by beta1 (0.9) or beta2 (0.999) and is averaged out over 1/(1-beta) steps, as
// in 8-bit Adam with blockwise quantisation (Dettmers et al., arXiv 2110.02861: matches 32-bit Adam on
// language-model pretraining); the codes here are floats (3- and 4-bit mantissas over 16 binades
// below the block's maximum) instead of its dynamic tree code: the same relative precision for every
// magnitude, and encodable with integer operations that every ISA (and the GPU) runs bit for bit.
// Epsilon, bias correction, weight decay (AdamW's factor, Adam's L2) and the grad scale (clipping,
// fp16 loss scaling) act on the fp32 values as in the fp32 path (the scale through (1 - beta1) and
// (1 - beta2) where no L2 term is added to the gradient).
// Departures, said plainly: 8-bit Adam keeps an fp32 master and quantises v, not sqrt(v). FlashOptim
// (arXiv 2602.23349) keeps an 8-bit correction term beside bf16 weights instead of stochastic
// rounding; here the compute copy is also where gradients land (so it cannot be the master's high
// half), and a bf16 master plus such a term would be 7 B + scales + chunk waste, past the 7 B goal.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ferry {

constexpr int64_t kCompactStateBlock = 256;  // == cpu_adam::kCompactBlock

// Bytes the compact state holds for `numel` parameters, by role (the compute copy not included).
struct CompactStateBytes {
  int64_t master = 0, exp_avg = 0, exp_avg_sq = 0, scales = 0;
  int64_t total() const { return master + exp_avg + exp_avg_sq + scales; }
};
// Bytes the compact update moves per parameter with 16-bit gradients, read + written: the gradient 2,
// master 2 + 2, codes 2 + 2, the new value 2 (over the gradient), the block's two fp32 scales read and
// written: 12.0625. The benchmarks' floors (bench_cpu_adam, bench_device_adam, bench_gpt) divide by it.
constexpr double kCompactUpdateBytesPerParam = 12.0 + 2.0 * 2 * 4 / kCompactStateBlock;
inline int64_t compact_blocks(int64_t numel) { return (numel + kCompactStateBlock - 1) / kCompactStateBlock; }
inline CompactStateBytes compact_state_bytes(int64_t numel) {
  return {2 * numel, numel, numel, 2 * 4 * compact_blocks(numel)};
}

// One contiguous range of compact state (a chunk's): master, exp_avg, exp_avg_sq and grad have `numel`
// elements; exp_avg_scale and exp_avg_sq_scale compact_blocks(numel), block k for elements
// [256 k, 256 (k + 1)). element_offset: element 0's index in the stream of rounding bits (give spans
// of one step distinct offsets; the step count varies the stream between steps). HybridAdam gives an
// element its place in the model (Slot::first_element, D86), so that no packing changes its bits.
struct CompactAdamSpan {
  uint16_t* master = nullptr;                   // bf16 bits
  const void* grad = nullptr;                   // grad_dtype: kFloat, kBFloat16 or kHalf
  at::ScalarType grad_dtype = at::kBFloat16;
  uint8_t* exp_avg = nullptr;
  float* exp_avg_scale = nullptr;
  uint8_t* exp_avg_sq = nullptr;
  float* exp_avg_sq_scale = nullptr;
  void* param_lowp = nullptr;                   // optional compute copy: bf16 (the master's bits) or fp16
  at::ScalarType lowp_dtype = at::ScalarType::Undefined;
  int64_t numel = 0;
  uint64_t element_offset = 0;
};

// The state of a span as fp32 (any output may be null) and back (the master rounded to nearest; the
// scales the blocks' maxima; any input may be null: that role, and its scales, are left as they are):
// checkpoint conversion, state views, tests. Arrays of span.numel elements; the span needs only the
// arrays of the roles converted (a null one of those fails, naming it). Decoding and encoding
// again gives the same bits (the block's largest |m| and u are exact; sqrt(u * u) == u in fp32).
void compact_to_fp32(const CompactAdamSpan& span, float* master, float* exp_avg, float* exp_avg_sq);
void compact_from_fp32(const CompactAdamSpan& span, const float* master, const float* exp_avg,
                       const float* exp_avg_sq);

}  // namespace ferry
