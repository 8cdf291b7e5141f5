#pragma once
// FERRY_HD marks the functions the CUDA kernel (adam_cuda.cu) shares with the CPU kernels: the
// conversions of float16.h and the per-element update of adam_body.h. Empty for the host compiler.
// FERRY_UNROLL asks nvcc to unroll the loop that follows (a loop whose trip count is a constant);
// nothing for the host compiler, which unrolls as it sees fit.
#if defined(__CUDACC__)
#define FERRY_HD __host__ __device__
#define FERRY_UNROLL _Pragma("unroll")
#else
#define FERRY_HD
#define FERRY_UNROLL
#endif
