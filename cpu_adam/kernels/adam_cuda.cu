// The Adam/AdamW update of device-resident state: each thread a few elements a grid's width apart
// (grid-stride; fp32_cuda_thread.h), each running adam_body.h's AdamLoop::one, the function every CPU
// kernel runs per vector lane. The operations are the intrinsics that round to nearest and are never
// fused or reordered (cuda_ops.h), and the bf16/fp16 conversions are float16.h's own, so a chunk gets
// the same bits on the GPU as on the host (D53).
//
// With the found_inf flag set, the update is skipped and only the low-precision copy is written: the
// master rounded (6 B per element), so that a copy written over the gradient holds the value again.
//
// Traffic per element: the grad (2 B bf16 / 4 B fp32) and master, exp_avg, exp_avg_sq (12 B) read, the
// three written back (12 B) and the bf16 copy written over the grad (2 B): 28 B with bf16 grads, the
// floor for mixed-precision Adam. Accesses are coalesced; a thread's elements' loads are in flight
// together (fp32_cuda_thread.h says why one at a time was not enough).
#include <cuda_runtime.h>

#include <algorithm>

#include "adam_cuda.h"
#include "float16.h"

namespace ferry::cpu_adam {
namespace {

#include "adam_body.h"
#include "compact_body.h"

#pragma nv_diag_suppress 177  // W: read by AdamLoop's host-only loop, which this file never instantiates
#include "cuda_ops.h"
#include "compact_cuda_block.h"
#include "fp32_cuda_thread.h"
#include "norm_cuda_grain.h"

constexpr int kThreads = 256;

template <GradType G, LowpType L, bool kDecoupled, bool kDecay>
__global__ void __launch_bounds__(kThreads, 4)
    adam_kernel(typename AdamLoop<CudaOps, G, L, kDecoupled, kDecay>::Consts c, AdamKernelArgs a, int64_t n,
                const float* found_inf) {
  // Skipped: master and moments stay; the low-precision copy, which may stand where the gradient was,
  // gets the master's value back (device_adam.h).
  const bool skip = found_inf != nullptr && *found_inf != 0.0f;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  Fp32ThreadSteps<G, L, kDecoupled, kDecay>::thread(c, a, n, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                                                    threads, skip);
}

template <GradType G, LowpType L, bool kDecoupled, bool kDecay>
void launch(const AdamKernelArgs& a, int64_t n, const float* found_inf, cudaStream_t stream, int blocks) {
  using Loop = AdamLoop<CudaOps, G, L, kDecoupled, kDecay>;
  adam_kernel<G, L, kDecoupled, kDecay><<<blocks, kThreads, 0, stream>>>(Loop::consts(a), a, n, found_inf);
}

// The compact update (compact_body.h): one warp per block of kCompactBlock elements (grid-stride over
// blocks, kCompactWarps warps to a block of threads), in the steps of compact_cuda_block.h: each lane's
// elements, the block's maxima by xor shuffles, each lane's stores (the same steps run on the host in
// test_cuda_kernels_on_host). No shared memory, no barrier.
constexpr int kCompactWarps = 8;
constexpr int kCompactThreads = 32 * kCompactWarps;

template <GradType G, LowpType L, bool kDecoupled, bool kDecay>
__global__ void __launch_bounds__(kCompactThreads, 4)
    compact_kernel(typename CompactLoop<CudaOps, G, L, kDecoupled, kDecay>::Consts c, CompactAdamArgs a, int64_t n,
                   const float* found_inf) {
  using Steps = CompactWarpSteps<G, L, kDecoupled, kDecay>;
  static_assert(Steps::kLanes == 32, "one lane per thread of a warp");
  const int64_t blocks = (n + kCompactBlock - 1) / kCompactBlock;
  const bool skip = found_inf != nullptr && *found_inf != 0.0f;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kCompactWarps;
  // Warp-uniform: every lane of a warp takes the same blocks, so the shuffles see the whole warp.
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kCompactWarps + threadIdx.x / 32; b < blocks; b += warps) {
    if (skip) {
      Steps::restore_copy(a, n, b, lane);
      continue;
    }
    typename Steps::Lane k;
    Steps::update(c, a, n, b, lane, k);
    for (int off = 16; off > 0; off /= 2) {
      Steps::fold(k, __shfl_xor_sync(0xffffffffu, k.max_m, off), __shfl_xor_sync(0xffffffffu, k.max_u, off));
    }
    Steps::store(a, n, b, lane, k, k.max_m, k.max_u);
    if (lane == 0) Steps::store_scales(a, b, k.max_m, k.max_u);
  }
}

template <GradType G, LowpType L, bool kDecoupled, bool kDecay>
void launch_compact(const CompactAdamArgs& a, int64_t n, const float* found_inf, cudaStream_t stream, int blocks) {
  using Loop = CompactLoop<CudaOps, G, L, kDecoupled, kDecay>;
  compact_kernel<G, L, kDecoupled, kDecay><<<blocks, kCompactThreads, 0, stream>>>(Loop::consts(a.hyper), a, n,
                                                                                    found_inf);
}

// The gradient norm (Note [One norm wherever the gradient lives], norm_body.h) of up to kNormRanges
// ranges of one gradient array per launch (a chunk's spans: one launch pair for all of them, not two
// per span): one block of threads per grain of any range (grid-stride over them all), one thread per
// lane of each of the grain's norm blocks, in the steps of norm_cuda_grain.h (run on the host in
// test_cuda_kernels_on_host); then one block per range sums its grains in order (staged in shared
// memory, added by one thread: NormGrainSteps::stage, add_tile). Reads: the gradients
// once, 16 consecutive elements per half-warp and row (whole 32-byte sectors for bf16 and fp32).
constexpr int kNormThreads = NormGrainSteps<GradType::kF32>::kThreads;

template <GradType G>
__global__ void __launch_bounds__(kNormThreads)
    norm_grain_kernel(const void* grad, float scale, NormRanges r, double* grain_totals) {
  using Steps = NormGrainSteps<G>;
  using GE = typename GradElem<G>::type;
  constexpr int kLanes = Steps::kLanes;
  __shared__ float block_totals[Steps::kBlocks];
  const int t = static_cast<int>(threadIdx.x);
  int k = 0;
  for (int64_t g = blockIdx.x; g < r.grains(); g += gridDim.x) {
    k = r.range_of(g, k);
    const void* base = static_cast<const GE*>(grad) + r.begin[k];
    const int64_t q = g - r.first_grain[k];
    float s = Steps::lane_sum(base, scale, r.n[k], q, t);
    for (int h = kLanes / 2; h > 0; h /= 2) s = Steps::fold(s, __shfl_down_sync(0xffffffffu, s, h, kLanes));
    if (t % kLanes == 0) block_totals[t / kLanes] = s;
    __syncthreads();
    if (t == 0) grain_totals[g] = Steps::grain_total(block_totals, r.n[k], q);
    __syncthreads();  // thread 0 read every total before the next grain's land there
  }
}

using RangeSteps = NormGrainSteps<GradType::kF32>;  // the range's steps do not depend on the gradient type

__global__ void __launch_bounds__(RangeSteps::kRangeThreads)
    norm_range_kernel(const double* grain_totals, NormRanges r, double* out) {
  __shared__ double tile[RangeSteps::kRangeTile];
  const int k = static_cast<int>(blockIdx.x);
  if (k >= r.count) return;  // the whole block: no barrier is left waiting
  const int t = static_cast<int>(threadIdx.x);
  const double* totals = grain_totals + r.first_grain[k];
  const int64_t grains = r.first_grain[k + 1] - r.first_grain[k];
  double total = 0.0;
  for (int64_t at = 0; at < grains; at += RangeSteps::kRangeTile) {
    const int64_t len = grains - at < RangeSteps::kRangeTile ? grains - at : RangeSteps::kRangeTile;
    RangeSteps::stage(tile, totals, at, len, t);
    __syncthreads();
    if (t == 0) total = RangeSteps::add_tile(total, tile, len);
    __syncthreads();  // thread 0 has read the tile before the next one lands there
  }
  if (t == 0) out[k] = total;
}

template <GradType G>
void launch_norm(const void* grad, float scale, const NormRanges& r, double* grain_totals, double* out,
                 cudaStream_t stream, int blocks) {
  if (r.grains() > 0) norm_grain_kernel<G><<<blocks, kNormThreads, 0, stream>>>(grad, scale, r, grain_totals);
  norm_range_kernel<<<r.count > 0 ? r.count : 1, RangeSteps::kRangeThreads, 0, stream>>>(grain_totals, r, out);
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
  constexpr int64_t kPerBlock = int64_t{kThreads} * Fp32ThreadSteps<GradType::kF32, LowpType::kNone, true, true>::kPerThread;
  if (const char* error = grid_for((n + kPerBlock - 1) / kPerBlock, kThreads, &blocks)) return error;
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
  const int64_t compact_blocks = (n + kCompactBlock - 1) / kCompactBlock;
  if (const char* error = grid_for((compact_blocks + kCompactWarps - 1) / kCompactWarps, kCompactThreads, &blocks)) {
    return error;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  for_kernel_mode(a.hyper, [&](auto g, auto l, auto decoupled, auto decay) {
    launch_compact<decltype(g)::value, decltype(l)::value, decltype(decoupled)::value, decltype(decay)::value>(
        a, n, found_inf, s, blocks);
  });
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

const char* launch_grad_norms_cuda(const void* grad, GradType type, float grad_scale, const int64_t* begins,
                                   const int64_t* ends, int64_t count, double* grain_totals, double* out,
                                   void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  for (int64_t first = 0; first < count; first += kNormRanges) {  // kNormRanges ranges per launch pair
    const NormRanges r = NormRanges::batch(begins, ends, count, first);
    int blocks = 1;
    if (r.grains() > 0) {
      if (const char* error = grid_for(r.grains(), kNormThreads, &blocks)) return error;
    }
    switch (type) {
      case GradType::kF32: launch_norm<GradType::kF32>(grad, grad_scale, r, grain_totals, out + first, s, blocks); break;
      case GradType::kBf16: launch_norm<GradType::kBf16>(grad, grad_scale, r, grain_totals, out + first, s, blocks); break;
      case GradType::kF16: launch_norm<GradType::kF16>(grad, grad_scale, r, grain_totals, out + first, s, blocks); break;
    }
    grain_totals += r.grains();
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return cudaGetErrorString(e);
  }
  return nullptr;
}

}  // namespace ferry::cpu_adam
