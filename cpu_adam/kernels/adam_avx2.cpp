// AVX2 + FMA + F16C kernels (8 fp32 lanes). Compiled with -mavx2 -mfma -mf16c; see kernel_abi.h.
#include <immintrin.h>

#include "kernel_abi.h"

namespace ferry::cpu_adam {
namespace {

#include "adam_body.h"
#include "compact_body.h"

struct Avx2Ops {
  using F = __m256;
  static constexpr int W = 8;
  using Pairs = EvenOddPairs<Avx2Ops>;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store_bf16(uint16_t* p, F v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, quiet_nan, is_nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store_f16(uint16_t* p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Integer lanes and masks (compact_body.h); a mask is all-ones lanes.
  using I = __m256i;
  using M = __m256i;
  static I bits(F v) { return _mm256_castps_si256(v); }
  static F from_bits(I x) { return _mm256_castsi256_ps(x); }
  static I set1_i(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I iota_i() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_i(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_i(I a, I b) { return _mm256_xor_si256(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I srli(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I slli(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I srai(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I and_or(I a, I mask, I bits) { return _mm256_or_si256(_mm256_and_si256(a, mask), bits); }
  static I blend_bits(I mask, I a, I b) { return _mm256_or_si256(_mm256_and_si256(a, mask), _mm256_andnot_si256(mask, b)); }
  static M testz_i(I a, I mask) { return _mm256_cmpeq_epi32(_mm256_and_si256(a, mask), _mm256_setzero_si256()); }
  static I max_i(I a, I b) { return _mm256_max_epi32(a, b); }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static M lt_i(I a, I b) { return _mm256_cmpgt_epi32(b, a); }
  static M lt_f(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static I select_i(M m, I if_true, I if_false) { return _mm256_blendv_epi8(if_false, if_true, m); }
  static bool any(M m) { return _mm256_testz_si256(m, m) == 0; }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F abs(F a) { return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7fffffff))); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F max_abs(F a, F b) { return max(abs(a), abs(b)); }  // for finite a, b
  static float hmax(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static void store_u8(uint8_t* p, I v) {
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  static I load_u16(const uint16_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store_u16(uint16_t* p, I v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
  }
  // For EvenOddPairs (compact_body.h): 16 elements of 16 bits or 8 bits at a time.
  static I load_i(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store_i(void* p, I v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
  static I add_i16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I srli_i16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static bool any_lt_i16(I a, I b) { return _mm256_movemask_epi8(_mm256_cmpgt_epi16(b, a)) != 0; }
  static __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  static I load_s8_as_s16(const uint8_t* p) { return _mm256_cvtepi8_epi16(load16(p)); }
  static I load_u8_as_u16(const uint8_t* p) { return _mm256_cvtepu8_epi16(load16(p)); }
  static void store_u16_as_u8(uint8_t* p, I w) {  // words in 0..255
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
  }
  static bool any_byte_clear(const uint8_t* p, uint8_t mask) {
    const __m128i clear = _mm_cmpeq_epi8(_mm_and_si128(load16(p), _mm_set1_epi8(static_cast<char>(mask))), _mm_setzero_si128());
    return _mm_movemask_epi8(clear) != 0;
  }
  static void load_f16_even_odd(const uint16_t* p, F& a, F& b) {
    // Even and odd halves gathered into the low and high 8 bytes of each 128-bit lane, then joined.
    const I split = _mm256_shuffle_epi8(load_i(p), _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                                    0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const I joined = _mm256_permute4x64_epi64(split, _MM_SHUFFLE(3, 1, 2, 0));
    a = _mm256_cvtph_ps(_mm256_castsi256_si128(joined));
    b = _mm256_cvtph_ps(_mm256_extracti128_si256(joined, 1));
  }
  static void load_f32_even_odd(const float* p, F& a, F& b) {
    const F lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
    auto join = [](F x) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), _MM_SHUFFLE(3, 1, 2, 0))); };
    a = join(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)));
    b = join(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  static void store_f16_even_odd(uint16_t* p, F a, F b) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m128i ha = _mm256_cvtps_ph(a, kRound), hb = _mm256_cvtps_ph(b, kRound);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_unpacklo_epi16(ha, hb));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm_unpackhi_epi16(ha, hb));
  }
};

}  // namespace

const KernelTable kAvx2Kernels{8, &Dispatch<Avx2Ops>::adam, &Dispatch<Avx2Ops>::grad_stats,
                               &CompactDispatch<Avx2Ops>::adam};

}  // namespace ferry::cpu_adam
