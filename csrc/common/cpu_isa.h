// Runtime ISA dispatch for the CPU kernels, one style for all of them: the extension is built for
// the baseline x86-64 ISA (SSE2), and a hot function marked RAGATTN_CPU_CLONES is compiled twice,
// for baseline x86-64 and for x86-64-v3 (AVX2, FMA, F16C), with GCC's target_clones: an ifunc
// resolver picks the variant once, at load time, so AVX2 is used where the CPU has it and never
// required to load the library. Helpers called from such a function are RAGATTN_ALWAYS_INLINE,
// so they compile for the caller's ISA (and no 32-byte vector crosses a call). Other compilers
// (clang, MSVC) and non-x86 targets get the baseline build only.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(__CUDACC__)
#define RAGATTN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define RAGATTN_CPU_CLONES
#endif

#if defined(__GNUC__)
#define RAGATTN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define RAGATTN_ALWAYS_INLINE inline
#endif
