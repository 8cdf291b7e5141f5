#pragma once
// CudaOps: the scalar Ops (adam_body.h, compact_body.h) of the device kernels (adam_cuda.cu), one
// element per thread. On the device each arithmetic op is the IEEE round-to-nearest intrinsic that is
// never fused or reordered (__fmul_rn, __fmaf_rn, __fdiv_rn, __fsqrt_rn, __fadd_rn, __int2float_rn);
// compiled for the host (tests: test_cuda_kernels_on_host), the same IEEE operation in fp32 (files
// built with -ffp-contract=off, so a multiply and an add stay two roundings). So the device kernels'
// logic runs and is checked bit for bit on a machine without a GPU; what only a GPU can show is that
// the intrinsics do what their names say.
//
// Included inside the anonymous namespace of its users, after float16.h, adam_body.h and
// compact_body.h (internal linkage, see kernel_abi.h).

#if defined(__CUDA_ARCH__)
#define FERRY_CUDA_OR_HOST(device, host) device
#else
#define FERRY_CUDA_OR_HOST(device, host) host
#endif

struct CudaOps {
  using F = float;
  static constexpr int W = 1;
  FERRY_HD static F load(const float* p) { return *p; }
  FERRY_HD static void store(float* p, F v) { *p = v; }
  FERRY_HD static F set1(float x) { return x; }
  FERRY_HD static F mul(F a, F b) { return FERRY_CUDA_OR_HOST(__fmul_rn(a, b), a * b); }
  FERRY_HD static F fma(F a, F b, F c) { return FERRY_CUDA_OR_HOST(__fmaf_rn(a, b, c), __builtin_fmaf(a, b, c)); }
  FERRY_HD static F sqrt(F a) { return FERRY_CUDA_OR_HOST(__fsqrt_rn(a), __builtin_sqrtf(a)); }
  FERRY_HD static F div(F a, F b) { return FERRY_CUDA_OR_HOST(__fdiv_rn(a, b), a / b); }
  FERRY_HD static F add(F a, F b) { return FERRY_CUDA_OR_HOST(__fadd_rn(a, b), a + b); }
  FERRY_HD static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  FERRY_HD static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  FERRY_HD static void store_bf16(uint16_t* p, F v) { *p = f32_to_bf16(v); }
  FERRY_HD static void store_f16(uint16_t* p, F v) { *p = f32_to_f16(v); }
  // Integer lanes and masks for the compact codes (compact_body.h), as adam_scalar.cpp's ScalarOps.
  using I = uint32_t;
  using M = bool;
  FERRY_HD static I bits(F v) { return f32_bits(v); }
  FERRY_HD static F from_bits(I x) { return bits_f32(x); }
  FERRY_HD static I set1_i(uint32_t x) { return x; }
  FERRY_HD static I add_i(I a, I b) { return a + b; }
  FERRY_HD static I sub_i(I a, I b) { return a - b; }
  FERRY_HD static I and_i(I a, I b) { return a & b; }
  FERRY_HD static I or_i(I a, I b) { return a | b; }
  FERRY_HD static I srli(I a, int n) { return a >> n; }
  FERRY_HD static I slli(I a, int n) { return a << n; }
  FERRY_HD static I srai(I a, int n) { return static_cast<I>(static_cast<int32_t>(a) >> n); }
  FERRY_HD static I and_or(I a, I mask, I bits) { return (a & mask) | bits; }
  FERRY_HD static I blend_bits(I mask, I a, I b) { return (a & mask) | (b & ~mask); }
  FERRY_HD static M testz_i(I a, I mask) { return (a & mask) == 0; }
  FERRY_HD static I max_i(I a, I b) { return static_cast<int32_t>(a) > static_cast<int32_t>(b) ? a : b; }
  FERRY_HD static F to_float(I a) {
    return FERRY_CUDA_OR_HOST(__int2float_rn(static_cast<int32_t>(a)), static_cast<float>(static_cast<int32_t>(a)));
  }
  FERRY_HD static M lt_i(I a, I b) { return static_cast<int32_t>(a) < static_cast<int32_t>(b); }
  FERRY_HD static M lt_f(F a, F b) { return a < b; }
  FERRY_HD static I select_i(M m, I if_true, I if_false) { return m ? if_true : if_false; }
  FERRY_HD static bool any(M m) { return m; }
  FERRY_HD static F abs(F a) { return bits_f32(f32_bits(a) & 0x7fffffffu); }
  FERRY_HD static F max(F a, F b) { return a > b ? a : b; }  // as ScalarOps::max (inputs never NaN)
};

#undef FERRY_CUDA_OR_HOST
