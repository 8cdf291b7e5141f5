// Portable kernels: the reference every SIMD kernel must match bit for bit.
#include <cmath>

#include "float16.h"
#include "kernel_abi.h"

namespace ferry::cpu_adam {
namespace {

#include "adam_body.h"
#include "compact_body.h"

struct ScalarOps {
  using F = float;
  static constexpr int W = 1;
  using Pairs = ConsecutivePairs<ScalarOps>;
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static F set1(float x) { return x; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F sqrt(F a) { return std::sqrt(a); }
  static F div(F a, F b) { return a / b; }
  static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static void store_bf16(uint16_t* p, F v) { *p = f32_to_bf16(v); }
  static void store_f16(uint16_t* p, F v) { *p = f32_to_f16(v); }
  static float hsum(F v) { return v; }
  // Integer lanes and masks (compact_body.h).
  using I = uint32_t;
  using M = bool;
  static I bits(F v) { return f32_bits(v); }
  static F from_bits(I x) { return bits_f32(x); }
  static I set1_i(uint32_t x) { return x; }
  static I iota_i() { return 0; }
  static I add_i(I a, I b) { return a + b; }
  static I sub_i(I a, I b) { return a - b; }
  static I and_i(I a, I b) { return a & b; }
  static I or_i(I a, I b) { return a | b; }
  static I xor_i(I a, I b) { return a ^ b; }
  static I mullo(I a, I b) { return a * b; }
  static I srli(I a, int n) { return a >> n; }
  static I slli(I a, int n) { return a << n; }
  static I srai(I a, int n) { return static_cast<I>(static_cast<int32_t>(a) >> n); }  // arithmetic (C++20, and GCC/Clang before)
  static I and_or(I a, I mask, I bits) { return (a & mask) | bits; }
  static I blend_bits(I mask, I a, I b) { return (a & mask) | (b & ~mask); }
  static M testz_i(I a, I mask) { return (a & mask) == 0; }
  static I max_i(I a, I b) { return static_cast<int32_t>(a) > static_cast<int32_t>(b) ? a : b; }
  static F to_float(I a) { return static_cast<float>(static_cast<int32_t>(a)); }
  static M lt_i(I a, I b) { return static_cast<int32_t>(a) < static_cast<int32_t>(b); }
  static M lt_f(F a, F b) { return a < b; }
  static I select_i(M m, I if_true, I if_false) { return m ? if_true : if_false; }
  static bool any(M m) { return m; }
  static F add(F a, F b) { return a + b; }
  static F abs(F a) { return bits_f32(f32_bits(a) & 0x7fffffffu); }
  static F max(F a, F b) { return a > b ? a : b; }  // as MAXPS: the second when either is NaN
  static F max_abs(F a, F b) { return max(abs(a), abs(b)); }  // for finite a, b
  static float hmax(F v) { return v; }
  static I load_u8(const uint8_t* p) { return *p; }
  static void store_u8(uint8_t* p, I v) { *p = static_cast<uint8_t>(v); }
  static I load_u16(const uint16_t* p) { return *p; }
  static void store_u16(uint16_t* p, I v) { *p = static_cast<uint16_t>(v); }
};

}  // namespace

void compact_decode(const CompactStateView& s, int64_t n, float* master, float* exp_avg, float* exp_avg_sq) {
  using Codes = CompactCodes<ScalarOps>;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = i / kCompactBlock;
    if (master) master[i] = bf16_to_f32(s.master[i]);
    if (exp_avg) exp_avg[i] = Codes::decode_m(Codes::place_m(s.exp_avg[i])) * s.exp_avg_scale[block];
    if (exp_avg_sq) {
      const float u = Codes::decode_u(Codes::place_u(s.exp_avg_sq[i])) * s.exp_avg_sq_scale[block];
      exp_avg_sq[i] = u * u;
    }
  }
}

void compact_encode(const CompactStateView& s, int64_t n, const float* master, const float* exp_avg,
                    const float* exp_avg_sq) {
  using Codes = CompactCodes<ScalarOps>;
  for (int64_t b = 0; b < n; b += kCompactBlock) {
    const int64_t e = n - b < kCompactBlock ? n : b + kCompactBlock;
    float max_m = 0.0f, max_u = 0.0f;
    for (int64_t i = b; i < e; ++i) {
      if (master) s.master[i] = f32_to_bf16(master[i]);
      if (exp_avg) max_m = ScalarOps::max(max_m, ScalarOps::abs(exp_avg[i]));
      if (exp_avg_sq) max_u = ScalarOps::max(max_u, std::sqrt(exp_avg_sq[i]));
    }
    const float inv_m = max_m > 0.0f ? 1.0f / max_m : 0.0f, inv_u = max_u > 0.0f ? 1.0f / max_u : 0.0f;
    for (int64_t i = b; i < e; ++i) {
      if (exp_avg) s.exp_avg[i] = static_cast<uint8_t>(Codes::encode_m(exp_avg[i] * inv_m));
      if (!exp_avg_sq) continue;
      const float u = std::sqrt(exp_avg_sq[i]);
      s.exp_avg_sq[i] = static_cast<uint8_t>(Codes::encode_u(u * inv_u, u));
    }
    if (exp_avg) s.exp_avg_scale[b / kCompactBlock] = max_m;
    if (exp_avg_sq) s.exp_avg_sq_scale[b / kCompactBlock] = max_u;
  }
}

const KernelTable kScalarKernels{1, &Dispatch<ScalarOps>::adam, &Dispatch<ScalarOps>::grad_stats,
                                 &CompactDispatch<ScalarOps>::adam};

}  // namespace ferry::cpu_adam
