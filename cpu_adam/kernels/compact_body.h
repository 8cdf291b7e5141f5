#pragma once
// The compact state's Adam/AdamW update (Note [The compact state format], cpu_adam/compact_state.h),
// written once over the `Ops` vector abstraction of adam_body.h plus integer lanes (I) and lane masks
// (M), and instantiated by each CPU kernel file. Included inside their anonymous namespace, after
// adam_body.h (internal linkage, see kernel_abi.h).
//
// Every element takes the same IEEE fp32 operations and the same integer operations in every ISA;
// rounding to an integer is the add-1.5*2^23 idiom (exact round-to-nearest-even in fp32 arithmetic),
// not a conversion instruction whose mode could differ; block maxima are exact whatever their order.
// So all kernels give the same bits, whatever the length or thread split (splits are at block starts).
//
// Per element, in fp32, from the block's old scales s_m, s_u (t = step, bc = bias correction):
//   p  = bf16 master, widened                 m0 = dec_m(code) * s_m        u0 = dec_u(code) * s_u
//   g  = grad * grad_scale;  g = fma(wd, p, g) (Adam, L2);  p = p * (1 - lr wd) (AdamW)
//   m  = fma(beta1, m0, (1 - beta1) g)        v = fma(beta2, u0 * u0, ((1 - beta2) g) g)
//   u  = sqrt(v)                              d = fma(u, 1 / sqrt(bc2), eps)
//   p  = fma(-lr / bc1, m / d, p)
//   master = bf16 of p, rounded stochastically (below); the compute copy: those bits (bf16) or fp16(them)
// then per block s_m' = max |m|, s_u' = max u, and each element's codes enc_m(m / s_m'), enc_u(u / s_u')
// (the division as a multiply by the fp32 reciprocal).

// ---- the codes. m: sign + 7 bits, an E4M3 float of |m| / s_m with 1.0 at code 120 (the largest
// normal binade [1, 2) holds only 1.0), codes 1..7 subnormal steps of 2^-17, 0 zero. u: 8 bits, an
// E4M4 float of u / s_u with 1.0 at code 240, codes 1..15 subnormal steps of 2^-18; a u > 0 never
// gets code 0 (its v would decode as 0 and the next update divide by eps alone).
constexpr uint32_t kMBias = 896;    // (127 - 15) << 3: fp32 exponent/mantissa bits >> 20, rebased
constexpr uint32_t kUBias = 1792;   // (127 - 15) << 4: >> 19
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: x + it - it rounds x in [0, 2^22) to an integer
constexpr uint32_t kRoundMagicBits = 0x4B400000u;

template <class Ops>
struct CompactCodes {
  using F = typename Ops::F;
  using I = typename Ops::I;
  using M = typename Ops::M;

  // Each code takes the same operations in every ISA; a vector with no subnormal code (almost all, past
  // the first step) skips computing that path, which changes no bit.
  FERRY_HD static F decode_m(I code) {
    const I mag = Ops::and_i(code, Ops::set1_i(127u));
    I value = Ops::slli(Ops::add_i(mag, Ops::set1_i(kMBias)), 20);
    const M small = Ops::lt_i(mag, Ops::set1_i(8u));
    if (Ops::any(small)) value = Ops::select_i(small, Ops::bits(Ops::mul(Ops::to_float(mag), Ops::set1(0x1p-17f))), value);
    return Ops::from_bits(Ops::or_i(value, Ops::slli(Ops::and_i(code, Ops::set1_i(128u)), 24)));
  }
  // y = m / s_m, |y| <= 1 (+ an ulp).
  FERRY_HD static I encode_m(F y) {
    const I yb = Ops::bits(y);
    const I sign = Ops::and_i(Ops::srli(yb, 24), Ops::set1_i(128u));
    const I a = Ops::and_i(yb, Ops::set1_i(0x7fffffffu));
    const I rounded = Ops::add_i(Ops::add_i(a, Ops::set1_i(0x7ffffu)), Ops::and_i(Ops::srli(a, 20), Ops::set1_i(1u)));
    I mag = Ops::sub_i(Ops::srli(rounded, 20), Ops::set1_i(kMBias));
    const F af = Ops::from_bits(a);
    const M small = Ops::lt_f(af, Ops::set1(0x1p-14f));
    if (Ops::any(small)) {
      const I sub = Ops::sub_i(Ops::bits(Ops::add(Ops::mul(af, Ops::set1(0x1p17f)), Ops::set1(kRoundMagic))),
                               Ops::set1_i(kRoundMagicBits));
      mag = Ops::select_i(small, sub, mag);
    }
    return Ops::or_i(mag, sign);
  }
  FERRY_HD static F decode_u(I code) {
    I value = Ops::slli(Ops::add_i(code, Ops::set1_i(kUBias)), 19);
    const M small = Ops::lt_i(code, Ops::set1_i(16u));
    if (Ops::any(small)) value = Ops::select_i(small, Ops::bits(Ops::mul(Ops::to_float(code), Ops::set1(0x1p-18f))), value);
    return Ops::from_bits(value);
  }
  // y = u / s_u in [0, 1] (+ an ulp); `u` itself decides whether code 0 is allowed.
  FERRY_HD static I encode_u(F y, F u) {
    const I a = Ops::bits(y);
    const I rounded = Ops::add_i(Ops::add_i(a, Ops::set1_i(0x3ffffu)), Ops::and_i(Ops::srli(a, 19), Ops::set1_i(1u)));
    I code = Ops::sub_i(Ops::srli(rounded, 19), Ops::set1_i(kUBias));
    const M small = Ops::lt_f(y, Ops::set1(0x1p-14f));
    if (!Ops::any(small)) return code;  // every u >= 2^-14 s_u > 0: no code is 0
    const I sub = Ops::sub_i(Ops::bits(Ops::add(Ops::mul(y, Ops::set1(0x1p18f)), Ops::set1(kRoundMagic))),
                             Ops::set1_i(kRoundMagicBits));
    code = Ops::select_i(small, sub, code);
    const I floor = Ops::select_i(Ops::lt_f(Ops::set1(0.0f), u), Ops::set1_i(1u), Ops::set1_i(0u));
    return Ops::max_i(code, floor);
  }
  // Stochastic rounding of p to bf16: the 16 bits below bf16's are compared with 16 random bits by
  // adding them and truncating, so p rounds away from zero with probability (its distance from the
  // bf16 below) / (one bf16 ulp): unbiased. The bits: the top 16 of (index + the step's seed) times
  // the golden ratio, a Weyl sequence: over consecutive elements equidistributed (each 1/65536 of the
  // unit interval visited in turn, better spread than independent draws), and for one element shifted
  // by the step's seed (a hash of the step count) from step to step. `weyl` is (index + seed) times the
  // ratio, mod 2^32: the caller steps it by W times the ratio per vector (the same bits as a multiply
  // per element, for one add).
  static constexpr uint32_t kGolden = 0x9e3779b1u;
  FERRY_HD static I round_bf16(F p, I weyl) {
    return Ops::srli(Ops::add_i(Ops::bits(p), Ops::srli(weyl, 16)), 16);
  }
};

template <class Ops, ferry::cpu_adam::GradType G, ferry::cpu_adam::LowpType L, bool kDecoupled, bool kDecay>
struct CompactLoop {
  using F = typename Ops::F;
  using I = typename Ops::I;
  using Codes = CompactCodes<Ops>;
  using Consts = typename AdamLoop<Ops, G, L, kDecoupled, kDecay>::Consts;
  static constexpr int W = Ops::W;
  static constexpr int64_t B = ferry::cpu_adam::kCompactBlock;
  static_assert(B % W == 0, "a block is whole vectors");

  // One element's (one vector's) update from its loaded values (the grad widened, the master's bf16
  // bits, the two codes) and its block's old scales: the new master bits and the new m and u = sqrt(v),
  // before the block's new scales encode them. The CPU loop below and the CUDA kernel (adam_cuda.cu)
  // both run it: the same operations, so the same bits.
  struct Updated {
    I master;
    F m, u;
  };
  FERRY_HD static Updated element(const Consts& c, F grad, I master_bits, I m_code, I u_code, F s_m, F s_u,
                                  I weyl) {
    F g = Ops::mul(grad, c.grad_scale);
    F p = Ops::from_bits(Ops::slli(master_bits, 16));
    if constexpr (kDecay && !kDecoupled) g = Ops::fma(c.weight_decay, p, g);
    if constexpr (kDecay && kDecoupled) p = Ops::mul(p, c.decay_factor);
    const F m0 = Ops::mul(Codes::decode_m(m_code), s_m);
    const F u0 = Ops::mul(Codes::decode_u(u_code), s_u);
    const F m = Ops::fma(c.beta1, m0, Ops::mul(c.one_minus_beta1, g));
    const F v = Ops::fma(c.beta2, Ops::mul(u0, u0), Ops::mul(Ops::mul(c.one_minus_beta2, g), g));
    const F u = Ops::sqrt(v);
    const F d = Ops::fma(u, c.inv_bc2_sqrt, c.eps);
    p = Ops::fma(c.neg_step_size, Ops::div(m, d), p);
    return Updated{Codes::round_bf16(p, weyl), m, u};
  }

  // One full block of B elements at these pointers (`index0`: its first element's counter).
  static void block(const Consts& c, uint16_t* master, const void* grad, uint8_t* mq, uint8_t* uq, void* lowp,
                    float* m_scale, float* u_scale, uint32_t index0, uint32_t seed) {
    alignas(64) float new_m[B];
    alignas(64) float new_u[B];
    const F s_m = Ops::set1(*m_scale), s_u = Ops::set1(*u_scale);
    F max_m = Ops::set1(0.0f), max_u = Ops::set1(0.0f);
    I weyl = Ops::mullo(Ops::add_i(Ops::set1_i(index0 + seed), Ops::iota_i()), Ops::set1_i(Codes::kGolden));
    const I weyl_step = Ops::set1_i(static_cast<uint32_t>(W) * Codes::kGolden);
    for (int64_t j = 0; j < B; j += W) {
      const Updated e = element(c, load_grad<Ops, G>(grad, j), Ops::load_u16(master + j), Ops::load_u8(mq + j),
                                Ops::load_u8(uq + j), s_m, s_u, weyl);
      weyl = Ops::add_i(weyl, weyl_step);
      Ops::store_u16(master + j, e.master);
      if constexpr (L == ferry::cpu_adam::LowpType::kBf16) {
        Ops::store_u16(static_cast<uint16_t*>(lowp) + j, e.master);
      } else if constexpr (L == ferry::cpu_adam::LowpType::kF16) {
        Ops::store_f16(static_cast<uint16_t*>(lowp) + j, Ops::from_bits(Ops::slli(e.master, 16)));
      }
      Ops::store(new_m + j, e.m);
      Ops::store(new_u + j, e.u);
      max_m = Ops::max(max_m, Ops::abs(e.m));
      max_u = Ops::max(max_u, e.u);
    }
    const float sm = Ops::hmax(max_m), su = Ops::hmax(max_u);
    const F inv_m = Ops::set1(sm > 0.0f ? 1.0f / sm : 0.0f), inv_u = Ops::set1(su > 0.0f ? 1.0f / su : 0.0f);
    for (int64_t j = 0; j < B; j += W) {
      Ops::store_u8(mq + j, Codes::encode_m(Ops::mul(Ops::load(new_m + j), inv_m)));
      const F u = Ops::load(new_u + j);
      Ops::store_u8(uq + j, Codes::encode_u(Ops::mul(u, inv_u), u));
    }
    *m_scale = sm;
    *u_scale = su;
  }

  static void run(const ferry::cpu_adam::CompactAdamArgs& a, int64_t begin, int64_t end) {
    using GE = typename GradElem<G>::type;
    const Consts c = AdamLoop<Ops, G, L, kDecoupled, kDecay>::consts(a.hyper);
    for (int64_t b = begin; b < end; b += B) {
      const int64_t len = end - b < B ? end - b : B;
      const uint32_t index0 = a.element_offset + static_cast<uint32_t>(b);
      float* m_scale = a.exp_avg_scale + b / B;
      float* u_scale = a.exp_avg_sq_scale + b / B;
      const GE* grad = static_cast<const GE*>(a.grad) + b;
      uint16_t* lowp = static_cast<uint16_t*>(a.param_lowp);  // 16-bit copies only (bf16, fp16)
      if (len == B) {
        block(c, a.master + b, grad, a.exp_avg + b, a.exp_avg_sq + b, lowp ? lowp + b : nullptr, m_scale, u_scale,
              index0, a.rounding_seed);
        continue;
      }
      // The arrays' last, partial block, through zero-padded buffers: padding has zero moments and
      // gradients, so it changes no block maximum.
      alignas(64) uint16_t master[B] = {};
      alignas(64) GE g[B] = {};
      alignas(64) uint8_t mq[B] = {};
      alignas(64) uint8_t uq[B] = {};
      alignas(64) uint16_t lp[B] = {};
      __builtin_memcpy(master, a.master + b, len * sizeof(uint16_t));
      __builtin_memcpy(g, grad, len * sizeof(GE));
      __builtin_memcpy(mq, a.exp_avg + b, len);
      __builtin_memcpy(uq, a.exp_avg_sq + b, len);
      block(c, master, g, mq, uq, lp, m_scale, u_scale, index0, a.rounding_seed);
      __builtin_memcpy(a.master + b, master, len * sizeof(uint16_t));
      __builtin_memcpy(a.exp_avg + b, mq, len);
      __builtin_memcpy(a.exp_avg_sq + b, uq, len);
      if constexpr (L != ferry::cpu_adam::LowpType::kNone) __builtin_memcpy(lowp + b, lp, len * sizeof(uint16_t));
    }
  }
};

// The compact update of one Ops, behind the KernelTable ABI.
template <class Ops>
struct CompactDispatch {
  static void adam(const ferry::cpu_adam::CompactAdamArgs& a, int64_t b, int64_t e) {
    LoopDispatch<CompactLoop, Ops>::run(a.hyper, a, b, e);
  }
};
