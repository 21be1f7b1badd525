// Framework-free helpers shared by CUDA kernels and their CPU twins.
// Anything marked RAGATTN_HD compiles for both host and device, so the CPU tests
// exercise the same per-element arithmetic the GPU runs.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RAGATTN_HD __host__ __device__ __forceinline__
#else
#define RAGATTN_HD inline
#endif
