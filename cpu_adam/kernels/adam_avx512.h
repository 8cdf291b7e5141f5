#pragma once
// AVX-512 kernels (16 fp32 lanes), shared by adam_avx512.cpp and adam_avx512_bf16.cpp, which differ
// only in FERRY_NATIVE_BF16: with it, fp32 -> bf16 uses VCVTNEPS2BF16 (which, unlike the integer
// rounding path, flushes subnormal inputs |x| < 1.18e-38 to zero). See kernel_abi.h for the rules.
#include <immintrin.h>

#include "kernel_abi.h"

namespace ferry::cpu_adam {
namespace {

#include "adam_body.h"
#include "compact_body.h"

struct Avx512Pairs;

struct Avx512Ops {
  using F = __m512;
  static constexpr int W = 16;
  using Pairs = Avx512Pairs;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_bf16(uint16_t* p, F v) {
#if FERRY_NATIVE_BF16
    const __m256bh b = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(b));
#else
    const __m512i x = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, quiet_nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
  static void store_f16(uint16_t* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  // Integer lanes and masks (compact_body.h).
  using I = __m512i;
  using M = __mmask16;
  static I bits(F v) { return _mm512_castps_si512(v); }
  static F from_bits(I x) { return _mm512_castsi512_ps(x); }
  static I set1_i(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I iota_i() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_i(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_i(I a, I b) { return _mm512_xor_si512(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I srli(I a, int n) { return _mm512_srli_epi32(a, static_cast<unsigned>(n)); }
  static I slli(I a, int n) { return _mm512_slli_epi32(a, static_cast<unsigned>(n)); }
  static I srai(I a, int n) { return _mm512_srai_epi32(a, static_cast<unsigned>(n)); }
  static I and_or(I a, I mask, I bits) { return _mm512_ternarylogic_epi32(a, mask, bits, 0xEA); }  // a & mask | bits
  static I blend_bits(I mask, I a, I b) { return _mm512_ternarylogic_epi32(mask, a, b, 0xCA); }  // mask ? a : b, bitwise
  static M testz_i(I a, I mask) { return _mm512_testn_epi32_mask(a, mask); }
  static I max_i(I a, I b) { return _mm512_max_epi32(a, b); }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static M lt_i(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
  static M lt_f(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static I select_i(M m, I if_true, I if_false) { return _mm512_mask_blend_epi32(m, if_false, if_true); }
  static bool any(M m) { return m != 0; }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F abs(F a) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff))); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F max_abs(F a, F b) { return _mm512_range_ps(a, b, 0x0b); }  // |the larger magnitude| (finite a, b)
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store_u8(uint8_t* p, I v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v)); }
  static I load_u16(const uint16_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store_u16(uint16_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v)); }
};

// A pair of vectors is 32 consecutive elements, the even ones in `a`, the odd ones in `b`: a 16-bit
// element pair is one 32-bit lane, so bf16 widens with a shift (even) or a mask (odd) and narrows with
// one ternary-logic op per two vectors, and 8-bit codes widen to 16 bits with one shuffle per two
// vectors, where the per-vector loads and stores take a shuffle (2 uops on many cores) each.
struct Avx512Pairs {
  using F = __m512;
  using I = __m512i;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I top16() { return _mm512_set1_epi32(static_cast<int>(0xffff0000u)); }
  static void iota(I& a, I& b) {
    a = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    b = _mm512_add_epi32(a, _mm512_set1_epi32(1));
  }
  static void load_bf16(const uint16_t* p, F& a, F& b) {
    const I x = load(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(x, top16()));
  }
  template <GradType G>
  static void load_grad(const void* base, int64_t i, F& a, F& b) {
    if constexpr (G == GradType::kBf16) {
      load_bf16(static_cast<const uint16_t*>(base) + i, a, b);
    } else if constexpr (G == GradType::kF16) {
      const I x = load(static_cast<const uint16_t*>(base) + i);
      a = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
      b = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
    } else {
      const float* p = static_cast<const float*>(base) + i;
      const F lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
      I even, odd;
      iota(even, odd);
      a = _mm512_permutex2var_ps(lo, even, hi);
      b = _mm512_permutex2var_ps(lo, odd, hi);
    }
  }
  // Placed as CompactCodes wants them: the 32 codes widened to 16 bits (m sign-extended), each code
  // shifted to bit 20 (m) or 19 (u) of its lane, the odd element's from the lane's high half.
  static void load_m_codes(const uint8_t* p, I& a, I& b) {
    const I x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    a = _mm512_slli_epi32(x, 20);
    b = _mm512_slli_epi32(x, 4);
  }
  static void load_u_codes(const uint8_t* p, I& a, I& b) {
    const I x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    a = _mm512_slli_epi32(x, 19);
    b = _mm512_slli_epi32(x, 3);
  }
  // Whether any of the 32 m codes has a zero exponent (mag < 8) or any u code does (< 16).
  static bool maybe_small_codes(const uint8_t* mq, const uint8_t* uq) {
    const __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mq));
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(uq));
    return (_mm256_testn_epi8_mask(m, _mm256_set1_epi8(0x78)) | _mm256_testn_epi8_mask(u, _mm256_set1_epi8(static_cast<char>(0xf0)))) != 0;
  }
  static void store_hi16(uint16_t* p, I a, I b) {
    _mm512_storeu_si512(p, Avx512Ops::blend_bits(top16(), b, _mm512_srli_epi32(a, 16)));
  }
  static void store_f16(uint16_t* p, F a, F b) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const I ha = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(a, kRound));
    const I hb = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(b, kRound));
    _mm512_storeu_si512(p, _mm512_or_si512(ha, _mm512_slli_epi32(hb, 16)));
  }
  // The codes, from the top 16 bits of each y packed into 32 words: CompactCodes' normal-code
  // arithmetic with its constants >> 16, which is exact (their low 16 bits are zero, so the low half
  // of y neither changes the sum's top half nor the shifted-out result: ties-away rounding reads bits
  // 19 (m) or 18 (u) and up). A pair with any code below the normal range (|y| < 2^-14, its top 16
  // bits < 0x3880) takes CompactCodes' own path instead.
  static constexpr uint32_t kMRound = 0x80000u - kRebase, kURound = 0x40000u - kRebase;
  static_assert((kMRound & 0xffffu) == 0 && (kURound & 0xffffu) == 0, "the words' arithmetic is exact");
  static I top_words(F a, F b) {
    return Avx512Ops::blend_bits(top16(), _mm512_castps_si512(b), _mm512_srli_epi32(_mm512_castps_si512(a), 16));
  }
  static void store_words_as_bytes(uint8_t* p, I words) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi16_epi8(words));
  }
  static void store_codes(uint8_t* p, I a, I b) {  // codes in 0..255 in dword lanes
    store_words_as_bytes(p, Avx512Ops::blend_bits(_mm512_set1_epi32(0xffff), a, _mm512_slli_epi32(b, 16)));
  }
  static void store_m_codes(uint8_t* p, F ya, F yb) {
    const I w = top_words(ya, yb);
    const I normal_min = _mm512_set1_epi16(0x3880 << 1);  // |y| >= 2^-14: (w << 1) >= 0x7100
    if (_mm512_cmplt_epu16_mask(_mm512_slli_epi16(w, 1), normal_min) != 0) {
      store_codes(p, CompactCodes<Avx512Ops>::encode_m(ya), CompactCodes<Avx512Ops>::encode_m(yb));
      return;
    }
    const I t = _mm512_srli_epi16(_mm512_add_epi16(w, _mm512_set1_epi16(static_cast<short>(kMRound >> 16))), 4);
    store_words_as_bytes(p, Avx512Ops::blend_bits(_mm512_set1_epi16(127), t, _mm512_srli_epi16(w, 8)));
  }
  static void store_u_codes(uint8_t* p, F ya, F yb, F ua, F ub) {
    const I w = top_words(ya, yb);
    if (_mm512_cmplt_epu16_mask(w, _mm512_set1_epi16(0x3880)) != 0) {
      store_codes(p, CompactCodes<Avx512Ops>::encode_u(ya, ua), CompactCodes<Avx512Ops>::encode_u(yb, ub));
      return;
    }
    store_words_as_bytes(p, _mm512_srli_epi16(_mm512_add_epi16(w, _mm512_set1_epi16(static_cast<short>(kURound >> 16))), 3));
  }
};

}  // namespace
}  // namespace ferry::cpu_adam
