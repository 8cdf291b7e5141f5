#pragma once
// The compact state's Adam/AdamW update (Note [The compact state format], cpu_adam/compact_state.h),
// written once over the `Ops` vector abstraction of adam_body.h plus integer lanes (I) and lane masks
// (M), and instantiated by each CPU kernel file. Included inside their anonymous namespace, after
// adam_body.h (internal linkage, see kernel_abi.h).
//
// Every element takes the same IEEE fp32 operations and the same integer operations in every ISA;
// rounding to an integer is the add-1.5*2^23 idiom (exact round-to-nearest-even in fp32 arithmetic),
// not a conversion instruction whose mode could differ; block maxima are exact whatever their order.
// So all kernels give the same bits, whatever the length or thread split (splits are at block starts),
// and a kernel may lay its vectors out as it likes (Pairs below).
//
// Per element, in fp32, from the block's old scales s_m, s_u (t = step, bc = bias correction; the
// products of constants are formed once per call or per block, each rounded once):
//   p  = bf16 master, widened;   AdamW: p = p * (1 - lr wd)
//   g  = grad;  Adam with L2 decay: g = fma(wd, p, grad * grad_scale), k1 = 1 - beta1, k2 = 1 - beta2;
//               otherwise k1 = (1 - beta1) grad_scale, k2 = (1 - beta2) grad_scale^2
//   m  = fma(dec_m(code), s_m beta1, k1 g)
//   a  = dec_u(code) * (s_u sqrt(beta2))       v = fma(a, a, (k2 g) g)
//   u  = sqrt(v)                              d = fma(u, 1 / sqrt(bc2), eps)
//   p  = fma(-lr / bc1, m / d, p)
//   master = bf16 of p, rounded stochastically (below); the compute copy: those bits (bf16) or fp16(them)
// then per block s_m' = max |m|, s_u' = max u, and each element's codes enc_m(m / s_m'), enc_u(u / s_u')
// (the division as a multiply by the fp32 reciprocal). Folding beta1, sqrt(beta2) and the grad scale
// into the scales and the (1 - beta) factors saves a third of the multiplies of the fp32 kernel's
// sequence at one rounding each (2^-24 relative), far below the codes' 2^-4 and 2^-5.

// ---- the codes. m: sign + 7 bits, an E4M3 float of |m| / s_m with 1.0 at code 120 (the largest
// normal binade [1, 2) holds only 1.0), codes 1..7 subnormal steps of 2^-17, 0 zero. u: 8 bits, an
// E4M4 float of u / s_u with 1.0 at code 240, codes 1..15 subnormal steps of 2^-18; a u > 0 never
// gets code 0 (its v would decode as 0 and the next update divide by eps alone).
//
// Codes enter the update "placed" in their 32-bit lane where decoding wants them, so that a normal code
// decodes in one and-or: an m code as the int8 it is, sign-extended, in bits 20..31; a u code in bits
// 19..26, zeros above. The bits below are don't-care: a vector kernel places two vectors' codes with one
// shift each from one widening load (Pairs below), the other's code left below. The (exponent, 3 or 4
// mantissa bits) of a normal code then sit where fp32 keeps them, and the exponent's rebase, +112, sets
// bits 27..29 the code's exponent (< 16) leaves clear: an or, not an add.
constexpr uint32_t kRebase = (127u - 15u) << 23;  // the exponent's +112, in fp32's exponent field
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: x + it - it rounds x in [0, 2^22) to an integer
constexpr uint32_t kRoundMagicBits = 0x4B400000u;

template <class Ops>
struct CompactCodes {
  using F = typename Ops::F;
  using I = typename Ops::I;
  using M = typename Ops::M;

  // One code (0..255, zero-extended in its lane) placed.
  FERRY_HD static I place_m(I code) { return Ops::srai(Ops::slli(code, 24), 4); }
  FERRY_HD static I place_u(I code) { return Ops::slli(code, 19); }

  // Each code takes the same operations in every ISA; a vector with no subnormal code (almost all, past
  // the first step) skips computing that path, which changes no bit.
  FERRY_HD static F decode_m(I placed, bool maybe_small = true) {
    I value = Ops::and_or(placed, Ops::set1_i(0x87F00000u), Ops::set1_i(kRebase));
    if (!maybe_small) return Ops::from_bits(value);
    const M small = Ops::testz_i(placed, Ops::set1_i(0x07800000u));  // exponent 0: mag < 8
    if (Ops::any(small)) {
      const I mag = Ops::and_i(Ops::srli(placed, 20), Ops::set1_i(127u));
      const I sub = Ops::bits(Ops::mul(Ops::to_float(mag), Ops::set1(0x1p-17f)));
      value = Ops::select_i(small, Ops::and_or(placed, Ops::set1_i(0x80000000u), sub), value);
    }
    return Ops::from_bits(value);
  }
  // The rounding constants of a normal code: half its last place, less the rebase. Their low 16 bits
  // are zero, so a kernel may encode from the top 16 bits of y with these >> 16 (the same result).
  static constexpr uint32_t kMRound = 0x80000u - kRebase, kURound = 0x40000u - kRebase;
  static_assert((kMRound & 0xffffu) == 0 && (kURound & 0xffffu) == 0, "the codes read y's top 16 bits only");

  // y = m / s_m, |y| <= 1 (+ an ulp). Rounded to the nearest 3-bit mantissa, ties away from zero:
  // (|y|'s bits + 2^19) >> 20, which reads only bits 19 and up, less the rebase (subtracted before the
  // shift: exact, a multiple of 2^20, and every normal-coded |y| >= 2^-14 is above it). y's sign rides
  // along to bit 11, from where only the 7 magnitude bits are kept: the code's sign comes from bit 31
  // (>> 24: bit 7).
  FERRY_HD static I encode_m(F y) {
    const I yb = Ops::bits(y);
    const I t = Ops::srli(Ops::add_i(yb, Ops::set1_i(kMRound)), 20);
    I code = Ops::blend_bits(Ops::set1_i(127u), t, Ops::srli(yb, 24));
    const F af = Ops::abs(y);
    const M small = Ops::lt_f(af, Ops::set1(0x1p-14f));
    if (Ops::any(small)) {
      const I sub = Ops::sub_i(Ops::bits(Ops::add(Ops::mul(af, Ops::set1(0x1p17f)), Ops::set1(kRoundMagic))),
                               Ops::set1_i(kRoundMagicBits));
      code = Ops::select_i(small, Ops::or_i(sub, Ops::and_i(Ops::srli(yb, 24), Ops::set1_i(128u))), code);
    }
    return code;
  }
  FERRY_HD static F decode_u(I placed, bool maybe_small = true) {
    I value = Ops::and_or(placed, Ops::set1_i(0x07F80000u), Ops::set1_i(kRebase));
    if (!maybe_small) return Ops::from_bits(value);
    const M small = Ops::testz_i(placed, Ops::set1_i(0x07800000u));  // exponent 0: code < 16
    if (Ops::any(small)) {
      const I code = Ops::and_i(Ops::srli(placed, 19), Ops::set1_i(255u));
      value = Ops::select_i(small, Ops::bits(Ops::mul(Ops::to_float(code), Ops::set1(0x1p-18f))), value);
    }
    return Ops::from_bits(value);
  }
  // y = u / s_u in [0, 1] (+ an ulp); `u` itself decides whether code 0 is allowed. Rounded as
  // encode_m: (bits + 2^18) >> 19, less the rebase.
  FERRY_HD static I encode_u(F y, F u) {
    I code = Ops::srli(Ops::add_i(Ops::bits(y), Ops::set1_i(kURound)), 19);
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
  // ratio, mod 2^32: the caller steps it by the elements it advances times the ratio (the same bits as
  // a multiply per element, for one add). The bf16 is the result's top 16 bits (the low 16: don't-care).
  static constexpr uint32_t kGolden = 0x9e3779b1u;
  FERRY_HD static I round_bf16_hi(F p, I weyl) { return Ops::add_i(Ops::bits(p), Ops::srli(weyl, 16)); }
};

// The loads and stores of two vectors of a block at once (a pair: 2W elements, into or out of `a` and
// `b`), for Ops whose pairs are simply the next W elements and the W after (the scalar kernel). The
// vector kernels use EvenOddPairs (below). The update and the codes' bits do not depend on the layout.
template <class Ops>
struct ConsecutivePairs {
  using F = typename Ops::F;
  using I = typename Ops::I;
  using Codes = CompactCodes<Ops>;
  static constexpr int W = Ops::W;
  // Each lane's element, counted from the pair's first.
  static void iota(I& a, I& b) {
    a = Ops::iota_i();
    b = Ops::add_i(a, Ops::set1_i(W));
  }
  template <ferry::cpu_adam::GradType G>
  static void load_grad(const void* base, int64_t i, F& a, F& b) {
    a = ferry::cpu_adam::load_grad<Ops, G>(base, i);
    b = ferry::cpu_adam::load_grad<Ops, G>(base, i + W);
  }
  static void load_bf16(const uint16_t* p, F& a, F& b) {
    a = Ops::load_bf16(p);
    b = Ops::load_bf16(p + W);
  }
  static void load_m_codes(const uint8_t* p, I& a, I& b) {
    a = Codes::place_m(Ops::load_u8(p));
    b = Codes::place_m(Ops::load_u8(p + W));
  }
  static void load_u_codes(const uint8_t* p, I& a, I& b) {
    a = Codes::place_u(Ops::load_u8(p));
    b = Codes::place_u(Ops::load_u8(p + W));
  }
  // The top 16 bits of each lane.
  static void store_hi16(uint16_t* p, I a, I b) {
    Ops::store_u16(p, Ops::srli(a, 16));
    Ops::store_u16(p + W, Ops::srli(b, 16));
  }
  static void store_f16(uint16_t* p, F a, F b) {
    Ops::store_f16(p, a);
    Ops::store_f16(p + W, b);
  }
  // The codes of y = m / s_m (encode_m) and of y = u / s_u (encode_u), stored.
  static void store_m_codes(uint8_t* p, F ya, F yb) {
    Ops::store_u8(p, Codes::encode_m(ya));
    Ops::store_u8(p + W, Codes::encode_m(yb));
  }
  static void store_u_codes(uint8_t* p, F ya, F yb, F ua, F ub) {
    Ops::store_u8(p, Codes::encode_u(ya, ua));
    Ops::store_u8(p + W, Codes::encode_u(yb, ub));
  }
  // Whether some of the pair's codes may be subnormal (here: let each decode check its own).
  static bool maybe_small_codes(const uint8_t*, const uint8_t*) { return true; }
};

// The pair layout of the vector kernels (AVX2, AVX-512): a pair is 2W consecutive elements, the even
// ones in `a`, the odd ones in `b`. A 16-bit element pair is then one 32-bit lane, so bf16 values widen
// by a shift (even) or a mask (odd) and narrow with one bit-blend, and 8-bit codes widen to 16 bits with
// one shuffle per pair, where per-vector widening loads and narrowing stores cost a shuffle each; the
// codes are encoded from y's top 16 bits, 2W at a time in 16-bit lanes, with CompactCodes' constants
// >> 16 (the same codes: see kMRound). Ops supplies full-width loads and stores of raw bits, 16-bit
// lane arithmetic and the conversions that need its own shuffles (fp16, fp32 gradients).
template <class Ops>
struct EvenOddPairs {
  using F = typename Ops::F;
  using I = typename Ops::I;
  using Codes = CompactCodes<Ops>;
  static I top16() { return Ops::set1_i(0xffff0000u); }
  static I words(uint32_t w) { return Ops::set1_i(w * 0x10001u); }  // w in both 16-bit halves
  static void iota(I& a, I& b) {
    a = Ops::add_i(Ops::iota_i(), Ops::iota_i());
    b = Ops::add_i(a, Ops::set1_i(1u));
  }
  static void load_bf16(const uint16_t* p, F& a, F& b) {
    const I x = Ops::load_i(p);
    a = Ops::from_bits(Ops::slli(x, 16));
    b = Ops::from_bits(Ops::and_i(x, top16()));
  }
  template <ferry::cpu_adam::GradType G>
  static void load_grad(const void* base, int64_t i, F& a, F& b) {
    if constexpr (G == ferry::cpu_adam::GradType::kBf16) {
      load_bf16(static_cast<const uint16_t*>(base) + i, a, b);
    } else if constexpr (G == ferry::cpu_adam::GradType::kF16) {
      Ops::load_f16_even_odd(static_cast<const uint16_t*>(base) + i, a, b);
    } else {
      Ops::load_f32_even_odd(static_cast<const float*>(base) + i, a, b);
    }
  }
  // Placed as CompactCodes wants them: each code shifted to bit 20 (m, sign-extended) or 19 (u) of its
  // lane, the odd element's from the lane's high half (the even one's bits left below: don't-care).
  static void load_m_codes(const uint8_t* p, I& a, I& b) {
    const I x = Ops::load_s8_as_s16(p);
    a = Ops::slli(x, 20);
    b = Ops::slli(x, 4);
  }
  static void load_u_codes(const uint8_t* p, I& a, I& b) {
    const I x = Ops::load_u8_as_u16(p);
    a = Ops::slli(x, 19);
    b = Ops::slli(x, 3);
  }
  // Whether any m code has a zero exponent (mag < 8) or any u code does (< 16).
  static bool maybe_small_codes(const uint8_t* mq, const uint8_t* uq) {
    return Ops::any_byte_clear(mq, 0x78) || Ops::any_byte_clear(uq, 0xf0);
  }
  static void store_hi16(uint16_t* p, I a, I b) { Ops::store_i(p, Ops::blend_bits(top16(), b, Ops::srli(a, 16))); }
  static void store_f16(uint16_t* p, F a, F b) { Ops::store_f16_even_odd(p, a, b); }
  static void store_codes(uint8_t* p, I a, I b) {  // codes in 0..255 in 32-bit lanes
    Ops::store_u16_as_u8(p, Ops::blend_bits(Ops::set1_i(0xffffu), a, Ops::slli(b, 16)));
  }
  static I top_words(F a, F b) { return Ops::blend_bits(top16(), Ops::bits(b), Ops::srli(Ops::bits(a), 16)); }
  // A pair with a code below the normal range (|y| < 2^-14: its top word's magnitude < 0x3880) takes
  // CompactCodes' own path.
  static void store_m_codes(uint8_t* p, F ya, F yb) {
    const I w = top_words(ya, yb);
    if (Ops::any_lt_i16(Ops::and_i(w, words(0x7fffu)), words(0x3880u))) {
      store_codes(p, Codes::encode_m(ya), Codes::encode_m(yb));
      return;
    }
    const I t = Ops::srli_i16(Ops::add_i16(w, words(Codes::kMRound >> 16)), 4);
    Ops::store_u16_as_u8(p, Ops::blend_bits(words(127u), t, Ops::srli_i16(w, 8)));
  }
  static void store_u_codes(uint8_t* p, F ya, F yb, F ua, F ub) {
    const I w = top_words(ya, yb);  // y >= 0: below 0x8000
    if (Ops::any_lt_i16(w, words(0x3880u))) {
      store_codes(p, Codes::encode_u(ya, ua), Codes::encode_u(yb, ub));
      return;
    }
    Ops::store_u16_as_u8(p, Ops::srli_i16(Ops::add_i16(w, words(Codes::kURound >> 16)), 3));
  }
};

template <class Ops, ferry::cpu_adam::GradType G, ferry::cpu_adam::LowpType L, bool kDecoupled, bool kDecay>
struct CompactLoop {
  using F = typename Ops::F;
  using I = typename Ops::I;
  using Codes = CompactCodes<Ops>;
  // Where Adam with L2 decay adds wd * p to the scaled gradient, the gradient's scale is its own
  // multiply; otherwise it is folded into (1 - beta1) and (1 - beta2), which multiply the gradient anyway.
  static constexpr bool kScaleFirst = kDecay && !kDecoupled;
  struct Consts {
    F one_minus_beta1, one_minus_beta2, grad_scale, weight_decay, decay_factor, eps, neg_step_size, inv_bc2_sqrt;
    float beta1, sqrt_beta2;  // scalars: each block's old scales take them
  };
  static Consts consts(const ferry::cpu_adam::AdamKernelArgs& a) {
    const float s = a.grad_scale;
    return Consts{Ops::set1(kScaleFirst ? a.one_minus_beta1 : a.one_minus_beta1 * s),
                  Ops::set1(kScaleFirst ? a.one_minus_beta2 : a.one_minus_beta2 * s * s),
                  Ops::set1(s),
                  Ops::set1(a.weight_decay),
                  Ops::set1(a.decay_factor),
                  Ops::set1(a.eps),
                  Ops::set1(-a.step_size),
                  Ops::set1(a.inv_bias_correction2_sqrt),
                  a.beta1,
                  __builtin_sqrtf(a.beta2)};
  }
  static constexpr int W = Ops::W;
  static constexpr int64_t B = ferry::cpu_adam::kCompactBlock;
  static_assert(B % (2 * W) == 0, "a block is whole pairs of vectors");

  // One element's (one vector's) update from its loaded values (the grad and the master widened, the
  // two codes placed; `maybe_small`: whether any of them may be a subnormal code, false when the
  // caller has checked none is) and its block's old scales times beta1 and sqrt(beta2): the new master
  // (round_bf16_hi) and the new m and u = sqrt(v), before the block's new scales encode them. The CPU
  // loop below and the CUDA kernel (adam_cuda.cu) both run it: the same operations, so the same bits.
  struct Updated {
    I master;
    F m, u;
  };
  FERRY_HD static Updated element(const Consts& c, F grad, F p, I m_code, I u_code, F s_m_beta1, F s_u_beta2,
                                  I weyl, bool maybe_small = true) {
    F c1g, c2gg;  // (1 - beta1) g and (1 - beta2) g^2, g the scaled gradient (plus L2 decay)
    if constexpr (kScaleFirst) {
      const F g = Ops::fma(c.weight_decay, p, Ops::mul(grad, c.grad_scale));
      c1g = Ops::mul(c.one_minus_beta1, g);
      c2gg = Ops::mul(Ops::mul(c.one_minus_beta2, g), g);
    } else {
      if constexpr (kDecay) p = Ops::mul(p, c.decay_factor);
      c1g = Ops::mul(c.one_minus_beta1, grad);
      c2gg = Ops::mul(Ops::mul(c.one_minus_beta2, grad), grad);
    }
    const F m = Ops::fma(Codes::decode_m(m_code, maybe_small), s_m_beta1, c1g);
    const F a = Ops::mul(Codes::decode_u(u_code, maybe_small), s_u_beta2);  // sqrt(beta2) u0
    const F v = Ops::fma(a, a, c2gg);
    const F u = Ops::sqrt(v);
    const F d = Ops::fma(u, c.inv_bc2_sqrt, c.eps);
    p = Ops::fma(c.neg_step_size, Ops::div(m, d), p);
    return Updated{Codes::round_bf16_hi(p, weyl), m, u};
  }

  // A block's arrays (`index0`: its first element's counter).
  struct Block {
    uint16_t* master;
    const void* grad;
    uint8_t* mq;
    uint8_t* uq;
    void* lowp;
    float* m_scale;
    float* u_scale;
    uint32_t index0;
  };
  // A block updated whose codes are not stored yet: its new m and u (in the pair layout they came in)
  // and the reciprocals of its new scales.
  struct Uncoded {
    const float* m;
    const float* u;
    F inv_m, inv_u;
    uint8_t* mq;
    uint8_t* uq;
  };
  // The codes of pair j (elements j .. j + 2W) of an updated block.
  static void encode_pair(const Uncoded& k, int64_t j) {
    using P = typename Ops::Pairs;
    P::store_m_codes(k.mq + j, Ops::mul(Ops::load(k.m + j), k.inv_m), Ops::mul(Ops::load(k.m + j + W), k.inv_m));
    const F ua = Ops::load(k.u + j), ub = Ops::load(k.u + j + W);
    P::store_u_codes(k.uq + j, Ops::mul(ua, k.inv_u), Ops::mul(ub, k.inv_u), ua, ub);
  }

  // The update of one full block of B elements, two vectors at a time in the layout of Ops::Pairs: the
  // new master and compute copy stored, the new m and u kept in new_m, new_u, the block's new scales
  // written (its old ones are read first). Its codes need those scales, so they are a second pass over
  // new_m, new_u (encode_pair); with kEncodeBefore, that pass of the block before (`before`) runs in
  // this loop, pair by pair beside this block's update: independent work, so that the sqrt and the
  // divide of one block overlap the other's codes, where a block's own codes wait for all of its update
  // (its maxima). The same operations on each element in any order: the same bits. Which order is
  // faster depends on the core (CompactAdamArgs::overlap_blocks): llvm-mca's Ice Lake server model puts
  // the divider first (44 of ~55 cycles per 32 elements one block at a time, ~46 overlapped); on this
  // project's Zen 4 VM overlapping measured 1-10% slower streaming, 3-6% in cache (benchmarks/README.md).
  template <bool kEncodeBefore>
  static Uncoded update(const Consts& c, const Block& k, float* new_m, float* new_u, uint32_t seed,
                        const Uncoded* before) {
    using P = typename Ops::Pairs;
    const F s_m = Ops::set1(*k.m_scale * c.beta1), s_u = Ops::set1(*k.u_scale * c.sqrt_beta2);
    F max_m = Ops::set1(0.0f), max_u = Ops::set1(0.0f);
    I lane_a, lane_b;
    P::iota(lane_a, lane_b);
    const I first = Ops::set1_i(k.index0 + seed), golden = Ops::set1_i(Codes::kGolden);
    I weyl_a = Ops::mullo(Ops::add_i(first, lane_a), golden), weyl_b = Ops::mullo(Ops::add_i(first, lane_b), golden);
    const I weyl_step = Ops::set1_i(static_cast<uint32_t>(2 * W) * Codes::kGolden);
    for (int64_t j = 0; j < B; j += 2 * W) {
      F g_a, g_b, p_a, p_b;
      I m_a, m_b, u_a, u_b;
      P::template load_grad<G>(k.grad, j, g_a, g_b);
      P::load_bf16(k.master + j, p_a, p_b);
      P::load_m_codes(k.mq + j, m_a, m_b);
      P::load_u_codes(k.uq + j, u_a, u_b);
      const bool small = P::maybe_small_codes(k.mq + j, k.uq + j);
      const Updated a = element(c, g_a, p_a, m_a, u_a, s_m, s_u, weyl_a, small);
      const Updated b = element(c, g_b, p_b, m_b, u_b, s_m, s_u, weyl_b, small);
      weyl_a = Ops::add_i(weyl_a, weyl_step);
      weyl_b = Ops::add_i(weyl_b, weyl_step);
      P::store_hi16(k.master + j, a.master, b.master);
      if constexpr (L == ferry::cpu_adam::LowpType::kBf16) {
        P::store_hi16(static_cast<uint16_t*>(k.lowp) + j, a.master, b.master);
      } else if constexpr (L == ferry::cpu_adam::LowpType::kF16) {
        const I top = Ops::set1_i(0xffff0000u);
        P::store_f16(static_cast<uint16_t*>(k.lowp) + j, Ops::from_bits(Ops::and_i(a.master, top)),
                     Ops::from_bits(Ops::and_i(b.master, top)));
      }
      Ops::store(new_m + j, a.m);
      Ops::store(new_m + j + W, b.m);
      Ops::store(new_u + j, a.u);
      Ops::store(new_u + j + W, b.u);
      max_m = Ops::max_abs(max_m, Ops::max_abs(a.m, b.m));
      max_u = Ops::max(max_u, Ops::max(a.u, b.u));
      if constexpr (kEncodeBefore) encode_pair(*before, j);
    }
    const float sm = Ops::hmax(max_m), su = Ops::hmax(max_u);
    *k.m_scale = sm;
    *k.u_scale = su;
    return Uncoded{new_m, new_u, Ops::set1(sm > 0.0f ? 1.0f / sm : 0.0f), Ops::set1(su > 0.0f ? 1.0f / su : 0.0f),
                   k.mq, k.uq};
  }
  static void encode(const Uncoded& k) {
    for (int64_t j = 0; j < B; j += 2 * W) encode_pair(k, j);
  }

  // One full block alone, its codes right after its update (the arrays' partial last one, through padded
  // buffers; every block where CompactAdamArgs::overlap_blocks is off).
  static void block(const Consts& c, const Block& k, uint32_t seed) {
    alignas(64) float new_m[B];
    alignas(64) float new_u[B];
    encode(update<false>(c, k, new_m, new_u, seed, nullptr));
  }

  static void run(const ferry::cpu_adam::CompactAdamArgs& a, int64_t begin, int64_t end) {
    using GE = typename GradElem<G>::type;
    const Consts c = consts(a.hyper);
    uint16_t* lowp = static_cast<uint16_t*>(a.param_lowp);  // 16-bit copies only (bf16, fp16)
    auto at = [&](int64_t b) {
      return Block{a.master + b,          static_cast<const GE*>(a.grad) + b, a.exp_avg + b,
                   a.exp_avg_sq + b,      lowp ? lowp + b : nullptr,          a.exp_avg_scale + b / B,
                   a.exp_avg_sq_scale + b / B, a.element_offset + static_cast<uint32_t>(b)};
    };
    // The full blocks: one at a time, or each one's codes stored beside the next one's update (two
    // buffers in turn).
    const int64_t full_end = begin + (end - begin) / B * B;
    alignas(64) float buffers[2][2][B];
    Uncoded before{};
    int turn = 0;
    if (!a.overlap_blocks) {
      for (int64_t b = begin; b < full_end; b += B) block(c, at(b), a.rounding_seed);
    } else {
      for (int64_t b = begin; b < full_end; b += B, turn ^= 1) {
        before = b == begin ? update<false>(c, at(b), buffers[turn][0], buffers[turn][1], a.rounding_seed, nullptr)
                            : update<true>(c, at(b), buffers[turn][0], buffers[turn][1], a.rounding_seed, &before);
      }
      if (full_end > begin) encode(before);
    }
    if (full_end == end) return;
    // The arrays' last, partial block, through zero-padded buffers: padding has zero moments and
    // gradients, so it changes no block maximum.
    const int64_t b = full_end, len = end - b;
    const Block k = at(b);
    alignas(64) uint16_t master[B] = {};
    alignas(64) GE g[B] = {};
    alignas(64) uint8_t mq[B] = {};
    alignas(64) uint8_t uq[B] = {};
    alignas(64) uint16_t lp[B] = {};
    __builtin_memcpy(master, k.master, len * sizeof(uint16_t));
    __builtin_memcpy(g, k.grad, len * sizeof(GE));
    __builtin_memcpy(mq, k.mq, len);
    __builtin_memcpy(uq, k.uq, len);
    block(c, Block{master, g, mq, uq, lp, k.m_scale, k.u_scale, k.index0}, a.rounding_seed);
    __builtin_memcpy(k.master, master, len * sizeof(uint16_t));
    __builtin_memcpy(k.mq, mq, len);
    __builtin_memcpy(k.uq, uq, len);
    if constexpr (L != ferry::cpu_adam::LowpType::kNone) __builtin_memcpy(k.lowp, lp, len * sizeof(uint16_t));
  }
};

// The compact update of one Ops, behind the KernelTable ABI.
template <class Ops>
struct CompactDispatch {
  static void adam(const ferry::cpu_adam::CompactAdamArgs& a, int64_t b, int64_t e) {
    LoopDispatch<CompactLoop, Ops>::run(a.hyper, a, b, e);
  }
};
