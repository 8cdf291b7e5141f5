#pragma once
// The fp32-state update as one device thread runs it (adam_cuda.cu's adam_kernel), written so that the
// same code also runs on the host, one thread after another (run_on_host: tests). A thread takes
// kPerThread elements a grid's width apart (first, first + stride, ...: each access one coalesced one
// of the warp), loads all of them into registers, runs AdamLoop::one on each (the function every CPU
// kernel runs per vector lane, on the registers: the CPU loop's tail does the same through its buffer),
// then stores them. Elements past n take zeros and store nothing.
//
// Why not one element at a time, as first written: `one` reads and writes through pointers that may
// alias (the compute copy is written over the gradient), so the compiler cannot issue the next
// element's loads before this one's stores: a thread had one element's 14 B (bf16 gradient) in flight.
// With the 30-38 registers the variants take, ~1,500-1,800 threads an SM: ~3 MB across an H200, under
// HBM's bandwidth-latency product; measured 1.45x its floor (2.67 TB/s). kPerThread elements' loads
// go out together.
//
// Included inside the anonymous namespace of its users, after cuda_ops.h (internal linkage, see
// kernel_abi.h).

template <ferry::cpu_adam::GradType G, ferry::cpu_adam::LowpType L, bool kDecoupled, bool kDecay>
struct Fp32ThreadSteps {
  using Loop = AdamLoop<CudaOps, G, L, kDecoupled, kDecay>;
  using Consts = typename Loop::Consts;
  using GE = typename GradElem<G>::type;
  using Args = ferry::cpu_adam::AdamKernelArgs;
  static constexpr int kPerThread = 4;

  // The thread's elements first, first + stride, ..., first + (kPerThread - 1) * stride.
  FERRY_HD static void update(const Consts& c, const Args& a, int64_t n, int64_t first, int64_t stride) {
    float p[kPerThread], m[kPerThread], v[kPerThread];
    GE g[kPerThread];
    uint16_t lp[kPerThread];
    FERRY_UNROLL
    for (int k = 0; k < kPerThread; ++k) {
      const int64_t i = first + k * stride;
      const bool live = i < n;
      p[k] = live ? a.param[i] : 0.0f;
      m[k] = live ? a.exp_avg[i] : 0.0f;
      v[k] = live ? a.exp_avg_sq[i] : 0.0f;
      g[k] = live ? static_cast<const GE*>(a.grad)[i] : GE{0};
    }
    FERRY_UNROLL
    for (int k = 0; k < kPerThread; ++k) Loop::one(c, p + k, g, k, m + k, v + k, lp, k);
    FERRY_UNROLL
    for (int k = 0; k < kPerThread; ++k) {
      const int64_t i = first + k * stride;
      if (i >= n) return;
      a.param[i] = p[k];
      a.exp_avg[i] = m[k];
      a.exp_avg_sq[i] = v[k];
      if constexpr (L != ferry::cpu_adam::LowpType::kNone) static_cast<uint16_t*>(a.param_lowp)[i] = lp[k];
    }
  }

  // A skipped update (found_inf): only the compute copy, the master rounded (device_adam.h).
  FERRY_HD static void restore_copy(const Args& a, int64_t n, int64_t first, int64_t stride) {
    if constexpr (L != ferry::cpu_adam::LowpType::kNone) {
      FERRY_UNROLL
      for (int k = 0; k < kPerThread; ++k) {
        const int64_t i = first + k * stride;
        if (i >= n) return;
        store_lowp<CudaOps, L>(a.param_lowp, i, a.param[i]);
      }
    }
  }

  // The kernel's loop for thread t of `threads` (grid-stride: kPerThread elements per turn).
  FERRY_HD static void thread(const Consts& c, const Args& a, int64_t n, int64_t t, int64_t threads, bool skip) {
    if (skip && L == ferry::cpu_adam::LowpType::kNone) return;  // nothing to write
    for (int64_t first = t; first < n; first += kPerThread * threads) {
      if (skip) {
        restore_copy(a, n, first, threads);
      } else {
        update(c, a, n, first, threads);
      }
    }
  }

  // The whole update of n elements on the host with a grid of `threads` threads, thread by thread
  // (tests).
  static void run_on_host(const Args& a, int64_t n, int64_t threads, bool skip) {
    const Consts c = Loop::consts(a);
    for (int64_t t = 0; t < threads; ++t) thread(c, a, n, t, threads, skip);
  }
};
