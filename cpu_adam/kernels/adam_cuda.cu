// The Adam/AdamW update of device-resident state: one thread per element (grid-stride), each running
// adam_body.h's AdamLoop::one, the function every CPU kernel runs per vector lane. The operations are
// the intrinsics that round to nearest and are never fused or reordered (__fmul_rn, __fmaf_rn,
// __fdiv_rn, __fsqrt_rn), and the bf16/fp16 conversions are float16.h's own, so a chunk gets the same
// bits on the GPU as on the host (D53).
//
// With the found_inf flag set, the update is skipped and only the low-precision copy is written: the
// master rounded (6 B per element), so that a copy written over the gradient holds the value again.
//
// Traffic per element: the grad (2 B bf16 / 4 B fp32) and master, exp_avg, exp_avg_sq (12 B) read, the
// three written back (12 B) and the bf16 copy written over the grad (2 B): 28 B with bf16 grads, the
// floor for mixed-precision Adam. Accesses are coalesced; with every thread of the device resident,
// about 5 MB of loads are in flight, more than HBM's bandwidth-latency product, so one scalar element
// per thread and iteration reaches the memory roof without vector loads.
#include <cuda_runtime.h>

#include <algorithm>

#include "adam_cuda.h"
#include "float16.h"

namespace ferry::cpu_adam {
namespace {

#include "adam_body.h"

#pragma nv_diag_suppress 177  // W: read by AdamLoop's host-only loop, which this file never instantiates
struct CudaOps {
  using F = float;
  static constexpr int W = 1;
  __device__ static F load(const float* p) { return *p; }
  __device__ static void store(float* p, F v) { *p = v; }
  FERRY_HD static F set1(float x) { return x; }
  __device__ static F mul(F a, F b) { return __fmul_rn(a, b); }
  __device__ static F fma(F a, F b, F c) { return __fmaf_rn(a, b, c); }
  __device__ static F sqrt(F a) { return __fsqrt_rn(a); }
  __device__ static F div(F a, F b) { return __fdiv_rn(a, b); }
  __device__ static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  __device__ static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  __device__ static void store_bf16(uint16_t* p, F v) { *p = f32_to_bf16(v); }
  __device__ static void store_f16(uint16_t* p, F v) { *p = f32_to_f16(v); }
};

constexpr int kThreads = 256;

template <GradType G, LowpType L, bool kDecoupled, bool kDecay>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(typename AdamLoop<CudaOps, G, L, kDecoupled, kDecay>::Consts c, float* param, const void* grad,
                float* exp_avg, float* exp_avg_sq, void* param_lowp, int64_t n, const float* found_inf) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (found_inf != nullptr && *found_inf != 0.0f) {
    // Skipped: master and moments stay; the low-precision copy, which may stand where the gradient was,
    // gets the master's value back (device_adam.h).
    if constexpr (L != LowpType::kNone) {
      for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        store_lowp<CudaOps, L>(param_lowp, i, param[i]);
      }
    }
    return;
  }
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    AdamLoop<CudaOps, G, L, kDecoupled, kDecay>::one(c, param + i, grad, i, exp_avg + i, exp_avg_sq + i, param_lowp,
                                                      i);
  }
}

template <GradType G, LowpType L, bool kDecoupled, bool kDecay>
void launch(const AdamKernelArgs& a, int64_t n, const float* found_inf, cudaStream_t stream, int blocks) {
  using Loop = AdamLoop<CudaOps, G, L, kDecoupled, kDecay>;
  adam_kernel<G, L, kDecoupled, kDecay><<<blocks, kThreads, 0, stream>>>(
      Loop::consts(a), a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.param_lowp, n, found_inf);
}

template <GradType G, LowpType L>
void by_mode(const AdamKernelArgs& a, int64_t n, const float* found_inf, cudaStream_t s, int blocks) {
  const bool decay = a.weight_decay != 0.0f || a.decay_factor != 1.0f;  // as the CPU kernels decide
  if (a.decoupled_decay) {
    decay ? launch<G, L, true, true>(a, n, found_inf, s, blocks) : launch<G, L, true, false>(a, n, found_inf, s, blocks);
  } else {
    decay ? launch<G, L, false, true>(a, n, found_inf, s, blocks)
          : launch<G, L, false, false>(a, n, found_inf, s, blocks);
  }
}

template <GradType G>
void by_lowp(const AdamKernelArgs& a, int64_t n, const float* found_inf, cudaStream_t s, int blocks) {
  switch (a.lowp_type) {
    case LowpType::kNone: return by_mode<G, LowpType::kNone>(a, n, found_inf, s, blocks);
    case LowpType::kBf16: return by_mode<G, LowpType::kBf16>(a, n, found_inf, s, blocks);
    case LowpType::kF16: return by_mode<G, LowpType::kF16>(a, n, found_inf, s, blocks);
  }
}

}  // namespace

const char* launch_adam_cuda(const AdamKernelArgs& a, int64_t n, const float* found_inf, void* stream) {
  if (n <= 0) return nullptr;
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  // Enough blocks to fill every SM, no more (the grid-stride loop covers the rest).
  const int64_t full = static_cast<int64_t>(sms) * (per_sm / kThreads);
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, full)));
  const auto s = static_cast<cudaStream_t>(stream);
  switch (a.grad_type) {
    case GradType::kF32: by_lowp<GradType::kF32>(a, n, found_inf, s, blocks); break;
    case GradType::kBf16: by_lowp<GradType::kBf16>(a, n, found_inf, s, blocks); break;
    case GradType::kF16: by_lowp<GradType::kF16>(a, n, found_inf, s, blocks); break;
  }
  e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace ferry::cpu_adam
