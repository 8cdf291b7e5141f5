#pragma once
// The compact update of one block of kCompactBlock elements as the device runs it (adam_cuda.cu's
// compact_kernel: one thread per element), written as the steps between its barriers so that the same
// code also runs on the host, one thread after another (run_on_host: tests). Each thread runs
// CompactLoop::element; the block's new scales are the maxima of |m| and u over its elements (a tree
// in shared memory: maxima are exact in any order, and the gradients are finite, so no NaN decides
// one); then each thread encodes its own element. Threads past the end of a partial last block take
// zero moments and gradients, as the CPU loop's zero-padded buffer does, and store nothing.
//
// Included inside the anonymous namespace of its users, after cuda_ops.h (internal linkage, see
// kernel_abi.h).

template <ferry::cpu_adam::GradType G, ferry::cpu_adam::LowpType L, bool kDecoupled, bool kDecay>
struct CompactBlockSteps {
  using Loop = CompactLoop<CudaOps, G, L, kDecoupled, kDecay>;
  using Codes = CompactCodes<CudaOps>;
  using Consts = typename Loop::Consts;
  using Updated = typename Loop::Updated;
  using Args = ferry::cpu_adam::CompactAdamArgs;
  static constexpr int kThreads = static_cast<int>(ferry::cpu_adam::kCompactBlock);

  // An update skipped for a non-finite gradient: master, moments and scales stay; the compute copy,
  // which may stand where the gradient was, gets the master's value back (device_adam.h).
  FERRY_HD static void restore_copy(const Args& a, int64_t n, int64_t b, int t) {
    const int64_t i = b * kThreads + t;
    if (i >= n) return;
    if constexpr (L == ferry::cpu_adam::LowpType::kBf16) {
      static_cast<uint16_t*>(a.param_lowp)[i] = a.master[i];
    } else if constexpr (L == ferry::cpu_adam::LowpType::kF16) {
      static_cast<uint16_t*>(a.param_lowp)[i] = f32_to_f16(bf16_to_f32(a.master[i]));
    }
  }

  // Step 1, thread t of block b: its element's update, and its |m| and u at max_m[t], max_u[t].
  FERRY_HD static Updated update(const Consts& c, const Args& a, int64_t n, int64_t b, int t, float* max_m,
                                 float* max_u) {
    const int64_t i = b * kThreads + t;
    const bool live = i < n;
    const uint32_t index = a.element_offset + static_cast<uint32_t>(i) + a.rounding_seed;
    const Updated e = Loop::element(
        c, live ? load_grad<CudaOps, G>(a.grad, i) : 0.0f, live ? bf16_to_f32(a.master[i]) : 0.0f,
        Codes::place_m(live ? a.exp_avg[i] : 0u), Codes::place_u(live ? a.exp_avg_sq[i] : 0u),
        CudaOps::mul(a.exp_avg_scale[b], c.beta1), CudaOps::mul(a.exp_avg_sq_scale[b], c.sqrt_beta2),
        index * Codes::kGolden);
    max_m[t] = live ? CudaOps::abs(e.m) : 0.0f;
    max_u[t] = live ? e.u : 0.0f;
    return e;
  }

  // Step 2, for half = kThreads / 2, kThreads / 4, ..., 1, a barrier after each: thread t < half folds
  // t + half into t. max_*[0] is then the block's maximum.
  FERRY_HD static void fold(int t, int half, float* max_m, float* max_u) {
    if (t >= half) return;
    max_m[t] = CudaOps::max(max_m[t], max_m[t + half]);
    max_u[t] = CudaOps::max(max_u[t], max_u[t + half]);
  }

  // Step 3, thread t: its element stored, the moments encoded with the block's new scales sm, su.
  FERRY_HD static void store(const Args& a, int64_t n, int64_t b, int t, const Updated& e, float sm, float su) {
    const int64_t i = b * kThreads + t;
    if (i >= n) return;
    const float inv_m = sm > 0.0f ? CudaOps::div(1.0f, sm) : 0.0f, inv_u = su > 0.0f ? CudaOps::div(1.0f, su) : 0.0f;
    const uint16_t master = static_cast<uint16_t>(e.master >> 16);
    a.master[i] = master;
    if constexpr (L == ferry::cpu_adam::LowpType::kBf16) {
      static_cast<uint16_t*>(a.param_lowp)[i] = master;
    } else if constexpr (L == ferry::cpu_adam::LowpType::kF16) {
      static_cast<uint16_t*>(a.param_lowp)[i] = f32_to_f16(bf16_to_f32(master));
    }
    a.exp_avg[i] = static_cast<uint8_t>(Codes::encode_m(CudaOps::mul(e.m, inv_m)));
    a.exp_avg_sq[i] = static_cast<uint8_t>(Codes::encode_u(CudaOps::mul(e.u, inv_u), e.u));
  }

  // Step 4, thread 0 after a barrier (every thread has read max_*[0]): the block's new scales.
  FERRY_HD static void store_scales(const Args& a, int64_t b, float sm, float su) {
    a.exp_avg_scale[b] = sm;
    a.exp_avg_sq_scale[b] = su;
  }

  // The whole update of n elements on the host, block by block and thread by thread in the steps'
  // order: what the device kernel computes (tests).
  static void run_on_host(const Args& a, int64_t n, bool skip) {
    const Consts c = Loop::consts(a.hyper);
    float max_m[kThreads], max_u[kThreads];
    Updated e[kThreads];
    for (int64_t b = 0; b * kThreads < n; ++b) {
      if (skip) {
        for (int t = 0; t < kThreads; ++t) restore_copy(a, n, b, t);
        continue;
      }
      for (int t = 0; t < kThreads; ++t) e[t] = update(c, a, n, b, t, max_m, max_u);
      for (int half = kThreads / 2; half > 0; half /= 2) {
        for (int t = 0; t < kThreads; ++t) fold(t, half, max_m, max_u);
      }
      const float sm = max_m[0], su = max_u[0];
      for (int t = 0; t < kThreads; ++t) store(a, n, b, t, e[t], sm, su);
      store_scales(a, b, sm, su);
    }
  }
};
