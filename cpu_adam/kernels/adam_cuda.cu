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
#include "compact_body.h"

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
  // Integer lanes and masks for the compact codes (compact_body.h), as adam_scalar.cpp's ScalarOps.
  using I = uint32_t;
  using M = bool;
  __device__ static I bits(F v) { return f32_bits(v); }
  __device__ static F from_bits(I x) { return bits_f32(x); }
  FERRY_HD static I set1_i(uint32_t x) { return x; }
  __device__ static I add_i(I a, I b) { return a + b; }
  __device__ static I sub_i(I a, I b) { return a - b; }
  __device__ static I and_i(I a, I b) { return a & b; }
  __device__ static I or_i(I a, I b) { return a | b; }
  __device__ static I srli(I a, int n) { return a >> n; }
  __device__ static I slli(I a, int n) { return a << n; }
  __device__ static I srai(I a, int n) { return static_cast<I>(static_cast<int32_t>(a) >> n); }
  __device__ static I and_or(I a, I mask, I bits) { return (a & mask) | bits; }
  __device__ static I blend_bits(I mask, I a, I b) { return (a & mask) | (b & ~mask); }
  __device__ static M testz_i(I a, I mask) { return (a & mask) == 0; }
  __device__ static I max_i(I a, I b) { return static_cast<int32_t>(a) > static_cast<int32_t>(b) ? a : b; }
  __device__ static F to_float(I a) { return __int2float_rn(static_cast<int32_t>(a)); }
  __device__ static M lt_i(I a, I b) { return static_cast<int32_t>(a) < static_cast<int32_t>(b); }
  __device__ static M lt_f(F a, F b) { return a < b; }
  __device__ static I select_i(M m, I if_true, I if_false) { return m ? if_true : if_false; }
  __device__ static bool any(M m) { return m; }
  __device__ static F add(F a, F b) { return __fadd_rn(a, b); }
  __device__ static F abs(F a) { return bits_f32(f32_bits(a) & 0x7fffffffu); }
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

// The compact update (compact_body.h): one block of threads per block of kCompactBlock elements (grid-
// stride over blocks), one element per thread. Each thread runs CompactLoop::element; the block's new
// scales are the maxima of |m| and u over its elements (a shared-memory reduction: maxima are exact in
// any order, and the gradients are finite, so no NaN decides one), then each thread encodes its own.
// A partial last block: threads past the end take zero moments and gradients, as the CPU loop's
// zero-padded buffer does, and store nothing.
constexpr int kCompactThreads = static_cast<int>(kCompactBlock);

__device__ inline float max_rn(float a, float b) { return a > b ? a : b; }  // as ScalarOps::max

template <GradType G, LowpType L, bool kDecoupled, bool kDecay>
__global__ void __launch_bounds__(kCompactThreads)
    compact_kernel(typename CompactLoop<CudaOps, G, L, kDecoupled, kDecay>::Consts c, CompactAdamArgs a, int64_t n,
                   const float* found_inf) {
  using Loop = CompactLoop<CudaOps, G, L, kDecoupled, kDecay>;
  using Codes = CompactCodes<CudaOps>;
  __shared__ float max_m[kCompactThreads];
  __shared__ float max_u[kCompactThreads];
  const int64_t blocks = (n + kCompactBlock - 1) / kCompactBlock;
  const bool skip = found_inf != nullptr && *found_inf != 0.0f;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int t = static_cast<int>(threadIdx.x);
    const int64_t i = b * kCompactBlock + t;
    const bool live = i < n;
    if (skip) {
      // Skipped: master, moments and scales stay; the compute copy, which may stand where the gradient
      // was, gets the master's value back (device_adam.h).
      if constexpr (L == LowpType::kBf16) {
        if (live) static_cast<uint16_t*>(a.param_lowp)[i] = a.master[i];
      } else if constexpr (L == LowpType::kF16) {
        if (live) static_cast<uint16_t*>(a.param_lowp)[i] = f32_to_f16(bf16_to_f32(a.master[i]));
      }
      continue;
    }
    const uint32_t index = a.element_offset + static_cast<uint32_t>(i) + a.rounding_seed;
    const typename Loop::Updated e =
        Loop::element(c, live ? load_grad<CudaOps, G>(a.grad, i) : 0.0f, live ? bf16_to_f32(a.master[i]) : 0.0f,
                      Codes::place_m(live ? a.exp_avg[i] : 0u), Codes::place_u(live ? a.exp_avg_sq[i] : 0u),
                      __fmul_rn(a.exp_avg_scale[b], c.beta1), __fmul_rn(a.exp_avg_sq_scale[b], c.sqrt_beta2),
                      index * Codes::kGolden);
    max_m[t] = live ? __int_as_float(__float_as_int(e.m) & 0x7fffffff) : 0.0f;
    max_u[t] = live ? e.u : 0.0f;
    __syncthreads();
    for (int half = kCompactThreads / 2; half > 0; half /= 2) {
      if (t < half) {
        max_m[t] = max_rn(max_m[t], max_m[t + half]);
        max_u[t] = max_rn(max_u[t], max_u[t + half]);
      }
      __syncthreads();
    }
    const float sm = max_m[0], su = max_u[0];
    const float inv_m = sm > 0.0f ? __fdiv_rn(1.0f, sm) : 0.0f, inv_u = su > 0.0f ? __fdiv_rn(1.0f, su) : 0.0f;
    if (live) {
      const uint16_t master = static_cast<uint16_t>(e.master >> 16);
      a.master[i] = master;
      if constexpr (L == LowpType::kBf16) {
        static_cast<uint16_t*>(a.param_lowp)[i] = master;
      } else if constexpr (L == LowpType::kF16) {
        static_cast<uint16_t*>(a.param_lowp)[i] = f32_to_f16(bf16_to_f32(master));
      }
      a.exp_avg[i] = static_cast<uint8_t>(Codes::encode_m(__fmul_rn(e.m, inv_m)));
      a.exp_avg_sq[i] = static_cast<uint8_t>(Codes::encode_u(__fmul_rn(e.u, inv_u), e.u));
    }
    __syncthreads();  // every thread read max_*[0] before the next block's values land there
    if (t == 0) {
      a.exp_avg_scale[b] = sm;
      a.exp_avg_sq_scale[b] = su;
    }
  }
}

template <GradType G, LowpType L, bool kDecoupled, bool kDecay>
void launch_compact(const CompactAdamArgs& a, int64_t n, const float* found_inf, cudaStream_t stream, int blocks) {
  using Loop = CompactLoop<CudaOps, G, L, kDecoupled, kDecay>;
  compact_kernel<G, L, kDecoupled, kDecay><<<blocks, kCompactThreads, 0, stream>>>(Loop::consts(a.hyper), a, n,
                                                                                    found_inf);
}

const char* grid_for(int64_t units, int threads, int* blocks) {
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  // Enough blocks to fill every SM, no more (the grid-stride loop covers the rest).
  const int64_t full = static_cast<int64_t>(sms) * (per_sm / threads);
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(units, full)));
  return nullptr;
}

}  // namespace

const char* launch_adam_cuda(const AdamKernelArgs& a, int64_t n, const float* found_inf, void* stream) {
  if (n <= 0) return nullptr;
  int blocks = 0;
  if (const char* error = grid_for((n + kThreads - 1) / kThreads, kThreads, &blocks)) return error;
  const auto s = static_cast<cudaStream_t>(stream);
  for_kernel_mode(a, [&](auto g, auto l, auto decoupled, auto decay) {
    launch<decltype(g)::value, decltype(l)::value, decltype(decoupled)::value, decltype(decay)::value>(a, n, found_inf,
                                                                                                      s, blocks);
  });
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

const char* launch_compact_cuda(const CompactAdamArgs& a, int64_t n, const float* found_inf, void* stream) {
  if (n <= 0) return nullptr;
  int blocks = 0;
  if (const char* error = grid_for((n + kCompactBlock - 1) / kCompactBlock, kCompactThreads, &blocks)) return error;
  const auto s = static_cast<cudaStream_t>(stream);
  for_kernel_mode(a.hyper, [&](auto g, auto l, auto decoupled, auto decay) {
    launch_compact<decltype(g)::value, decltype(l)::value, decltype(decoupled)::value, decltype(decay)::value>(
        a, n, found_inf, s, blocks);
  });
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace ferry::cpu_adam
