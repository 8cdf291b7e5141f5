#pragma once
// The Adam/AdamW loop and the grad-stats loop, written once over an `Ops` vector abstraction and
// instantiated by each ISA file (scalar: W = 1, AVX2: W = 8, AVX-512: W = 16).
//
// Every element takes the same sequence of IEEE operations in every ISA (mul, fma, sqrt, div; no
// approximate reciprocals), and tails run through zero-padded stack buffers of one vector, so all
// kernels produce bit-identical results whatever the length, alignment or thread split.
//
// Per element, in fp32 (t = step, bc = bias correction):
//   g  = grad * grad_scale
//   g  = fma(wd, p, g)                      Adam (L2), when wd != 0
//   p  = p * (1 - lr * wd)                  AdamW, when wd != 0
//   m  = fma(beta1, m, (1 - beta1) * g)
//   v  = fma(beta2, v, ((1 - beta2) * g) * g)
//   d  = fma(sqrt(v), 1 / sqrt(bc2), eps)
//   p  = fma(-lr / bc1, m / d, p)
//   lowp = round_to_nearest_even(p)         when a low-precision copy is requested
//
// Included inside an anonymous namespace of each kernel file (internal linkage, see kernel_abi.h); uses
// compiler builtins instead of std:: inline functions for the same reason. The CUDA kernel
// (adam_cuda.cu) runs the same `AdamLoop::one` per element with IEEE round-to-nearest intrinsics, so a
// chunk updated on the GPU gets the bits the CPU kernels give it (D53).

template <ferry::cpu_adam::GradType G>
struct GradElem {
  using type = uint16_t;
};
template <>
struct GradElem<ferry::cpu_adam::GradType::kF32> {
  using type = float;
};

template <class Ops, ferry::cpu_adam::GradType G>
FERRY_HD inline typename Ops::F load_grad(const void* base, int64_t i) {
  using ferry::cpu_adam::GradType;
  if constexpr (G == GradType::kF32) {
    return Ops::load(static_cast<const float*>(base) + i);
  } else if constexpr (G == GradType::kBf16) {
    return Ops::load_bf16(static_cast<const uint16_t*>(base) + i);
  } else {
    return Ops::load_f16(static_cast<const uint16_t*>(base) + i);
  }
}

template <class Ops, ferry::cpu_adam::LowpType L>
FERRY_HD inline void store_lowp(void* base, int64_t i, typename Ops::F p) {
  using ferry::cpu_adam::LowpType;
  if constexpr (L == LowpType::kBf16) {
    Ops::store_bf16(static_cast<uint16_t*>(base) + i, p);
  } else if constexpr (L == LowpType::kF16) {
    Ops::store_f16(static_cast<uint16_t*>(base) + i, p);
  }
}

template <class Ops, ferry::cpu_adam::GradType G, ferry::cpu_adam::LowpType L, bool kDecoupled, bool kDecay>
struct AdamLoop {
  using F = typename Ops::F;
  static constexpr int W = Ops::W;

  struct Consts {
    F grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor,
        neg_step_size, inv_bc2_sqrt;
  };

  FERRY_HD static inline void one(const Consts& c, float* p_ptr, const void* g_base, int64_t gi, float* m_ptr,
                                  float* v_ptr, void* lp_base, int64_t li) {
    F g = Ops::mul(load_grad<Ops, G>(g_base, gi), c.grad_scale);
    F p = Ops::load(p_ptr);
    if constexpr (kDecay && !kDecoupled) g = Ops::fma(c.weight_decay, p, g);
    if constexpr (kDecay && kDecoupled) p = Ops::mul(p, c.decay_factor);
    const F m = Ops::fma(c.beta1, Ops::load(m_ptr), Ops::mul(c.one_minus_beta1, g));
    const F v = Ops::fma(c.beta2, Ops::load(v_ptr), Ops::mul(Ops::mul(c.one_minus_beta2, g), g));
    const F d = Ops::fma(Ops::sqrt(v), c.inv_bc2_sqrt, c.eps);
    p = Ops::fma(c.neg_step_size, Ops::div(m, d), p);
    Ops::store(m_ptr, m);
    Ops::store(v_ptr, v);
    Ops::store(p_ptr, p);
    store_lowp<Ops, L>(lp_base, li, p);
  }

  static Consts consts(const ferry::cpu_adam::AdamKernelArgs& a) {
    return Consts{Ops::set1(a.grad_scale),   Ops::set1(a.beta1),        Ops::set1(a.one_minus_beta1),
                  Ops::set1(a.beta2),        Ops::set1(a.one_minus_beta2), Ops::set1(a.eps),
                  Ops::set1(a.weight_decay), Ops::set1(a.decay_factor), Ops::set1(-a.step_size),
                  Ops::set1(a.inv_bias_correction2_sqrt)};
  }

  static void run(const ferry::cpu_adam::AdamKernelArgs& a, int64_t begin, int64_t end) {
    const Consts c = consts(a);
    int64_t i = begin;
    for (; i + W <= end; i += W) {
      one(c, a.param + i, a.grad, i, a.exp_avg + i, a.exp_avg_sq + i, a.param_lowp, i);
    }
    const int64_t n = end - i;
    if (n <= 0) return;
    using GE = typename GradElem<G>::type;
    alignas(64) float p[W] = {};
    alignas(64) float m[W] = {};
    alignas(64) float v[W] = {};
    alignas(64) GE g[W] = {};
    alignas(64) uint16_t lp[W] = {};
    __builtin_memcpy(p, a.param + i, n * sizeof(float));
    __builtin_memcpy(m, a.exp_avg + i, n * sizeof(float));
    __builtin_memcpy(v, a.exp_avg_sq + i, n * sizeof(float));
    __builtin_memcpy(g, static_cast<const GE*>(a.grad) + i, n * sizeof(GE));
    one(c, p, g, 0, m, v, lp, 0);
    __builtin_memcpy(a.param + i, p, n * sizeof(float));
    __builtin_memcpy(a.exp_avg + i, m, n * sizeof(float));
    __builtin_memcpy(a.exp_avg_sq + i, v, n * sizeof(float));
    if constexpr (L != ferry::cpu_adam::LowpType::kNone) {
      __builtin_memcpy(static_cast<uint16_t*>(a.param_lowp) + i, lp, n * sizeof(uint16_t));
    }
  }
};

#include "norm_body.h"  // grad_stats_loop: the gradient norm, in its one order

// A compile-time value passed as a function argument (no <type_traits> here: see kernel_abi.h).
template <class T, T v>
struct Constant {
  static constexpr T value = v;
};

// f(Constant<GradType, G>, Constant<LowpType, L>, Constant<bool, decoupled>, Constant<bool, decay>) for
// the grad type, compute-copy type and decay mode `h` names: every combination instantiated, one called.
// The one place that turns kernel arguments into template arguments, for the CPU loops (LoopDispatch)
// and the CUDA launches (adam_cuda.cu) alike.
template <class F>
void for_kernel_mode(const ferry::cpu_adam::AdamKernelArgs& h, F&& f) {
  using ferry::cpu_adam::GradType;
  using ferry::cpu_adam::LowpType;
  const auto with_mode = [&](auto g, auto l) {
    using Yes = Constant<bool, true>;
    using No = Constant<bool, false>;
    const bool decay = h.weight_decay != 0.0f || h.decay_factor != 1.0f;
    if (h.decoupled_decay) {
      decay ? f(g, l, Yes{}, Yes{}) : f(g, l, Yes{}, No{});
    } else {
      decay ? f(g, l, No{}, Yes{}) : f(g, l, No{}, No{});
    }
  };
  const auto with_lowp = [&](auto g) {
    switch (h.lowp_type) {
      case LowpType::kNone: return with_mode(g, Constant<LowpType, LowpType::kNone>{});
      case LowpType::kBf16: return with_mode(g, Constant<LowpType, LowpType::kBf16>{});
      case LowpType::kF16: return with_mode(g, Constant<LowpType, LowpType::kF16>{});
    }
  };
  switch (h.grad_type) {
    case GradType::kF32: return with_lowp(Constant<GradType, GradType::kF32>{});
    case GradType::kBf16: return with_lowp(Constant<GradType, GradType::kBf16>{});
    case GradType::kF16: return with_lowp(Constant<GradType, GradType::kF16>{});
  }
}

// Loop<Ops, G, L, decoupled, decay>::run(args, b, e) for the mode `h` names (the fp32 and the compact
// loops).
template <template <class, ferry::cpu_adam::GradType, ferry::cpu_adam::LowpType, bool, bool> class Loop, class Ops>
struct LoopDispatch {
  template <class Args>
  static void run(const ferry::cpu_adam::AdamKernelArgs& h, const Args& a, int64_t b, int64_t e) {
    for_kernel_mode(h, [&](auto g, auto l, auto decoupled, auto decay) {
      Loop<Ops, decltype(g)::value, decltype(l)::value, decltype(decoupled)::value, decltype(decay)::value>::run(a, b,
                                                                                                                  e);
    });
  }
};

// The fp32 update and the grad statistics of one Ops, behind the KernelTable ABI.
template <class Ops>
struct Dispatch {
  using GradType = ferry::cpu_adam::GradType;

  static void adam(const ferry::cpu_adam::AdamKernelArgs& a, int64_t b, int64_t e) {
    LoopDispatch<AdamLoop, Ops>::run(a, a, b, e);
  }

  static ferry::cpu_adam::GradStats grad_stats(const void* g, GradType t, float s, int64_t b, int64_t e) {
    switch (t) {
      case GradType::kF32: return grad_stats_loop<Ops, GradType::kF32>(g, s, b, e);
      case GradType::kBf16: return grad_stats_loop<Ops, GradType::kBf16>(g, s, b, e);
      case GradType::kF16: return grad_stats_loop<Ops, GradType::kF16>(g, s, b, e);
    }
    return {};
  }
};
