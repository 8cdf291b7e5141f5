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

struct Avx512Ops {
  using F = __m512;
  static constexpr int W = 16;
  using Pairs = EvenOddPairs<Avx512Ops>;
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
  // For EvenOddPairs (compact_body.h): 32 elements of 16 bits or 8 bits at a time.
  static I load_i(const void* p) { return _mm512_loadu_si512(p); }
  static void store_i(void* p, I v) { _mm512_storeu_si512(p, v); }
  static I add_i16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I srli_i16(I a, int n) { return _mm512_srli_epi16(a, static_cast<unsigned>(n)); }
  static bool any_lt_i16(I a, I b) { return _mm512_cmplt_epi16_mask(a, b) != 0; }
  static I load_s8_as_s16(const uint8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I load_u8_as_u16(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store_u16_as_u8(uint8_t* p, I w) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi16_epi8(w)); }
  static bool any_byte_clear(const uint8_t* p, uint8_t mask) {
    return _mm256_testn_epi8_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                  _mm256_set1_epi8(static_cast<char>(mask))) != 0;
  }
  static void load_f16_even_odd(const uint16_t* p, F& a, F& b) {
    const I x = load_i(p);
    a = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
    b = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
  }
  static void load_f32_even_odd(const float* p, F& a, F& b) {
    const F lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
    const I even = _mm512_add_epi32(iota_i(), iota_i());
    a = _mm512_permutex2var_ps(lo, even, hi);
    b = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, set1_i(1u)), hi);
  }
  static void store_f16_even_odd(uint16_t* p, F a, F b) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const I ha = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(a, kRound));
    const I hb = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(b, kRound));
    store_i(p, _mm512_or_si512(ha, _mm512_slli_epi32(hb, 16)));
  }
};

}  // namespace
}  // namespace ferry::cpu_adam
