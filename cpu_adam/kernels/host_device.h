#pragma once
// FERRY_HD marks the functions the CUDA kernel (adam_cuda.cu) shares with the CPU kernels: the
// conversions of float16.h and the per-element update of adam_body.h. Empty for the host compiler.
#if defined(__CUDACC__)
#define FERRY_HD __host__ __device__
#else
#define FERRY_HD
#endif
