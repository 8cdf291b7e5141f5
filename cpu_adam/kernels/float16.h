#pragma once
// Scalar fp32 <-> bf16 / fp16 conversions, bit-exact with the SIMD paths of the kernels:
// round-to-nearest-even, subnormals kept, NaN stays a quiet NaN of the same sign. Also compiled for
// the GPU (FERRY_HD), where they give the same bits.
// Internal linkage on purpose (see kernel_abi.h).
#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace ferry::cpu_adam {
namespace {

FERRY_HD inline uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
#endif
}
FERRY_HD inline float bits_f32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(x);
#else
  float f;
  std::memcpy(&f, &x, 4);
  return f;
#endif
}

FERRY_HD inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

FERRY_HD inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN -> quiet
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

FERRY_HD inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

FERRY_HD inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));  // NaN
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf (>= 65520)
  if (x < 0x38800000u) {                                               // below 2^-14: subnormal or 0
    if (x <= 0x33000000u) return sign;                                 // <= 2^-25 rounds to 0
    const uint32_t mant = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - (x >> 23);  // 14..24
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t r = x + 0xfffu + ((x >> 13) & 1u) - 0x38000000u;  // round, rebias 127 -> 15
  return static_cast<uint16_t>(sign | (r >> 13));
}

}  // namespace
}  // namespace ferry::cpu_adam
