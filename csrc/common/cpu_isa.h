// Runtime ISA dispatch for CPU twins: the extension is built for the baseline x86-64 ISA (SSE2),
// so a hot loop compiled a second time with RAGATTN_TARGET_AVX2 (and chosen with cpu_has_avx2())
// gets 8-wide FMA code where the CPU has it, without requiring AVX2 to load the library.
// Helpers called from such a loop are RAGATTN_ALWAYS_INLINE so they compile for the caller's ISA.
#pragma once

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDACC__)
#define RAGATTN_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define RAGATTN_HAVE_AVX2_VARIANT 1
#else
#define RAGATTN_TARGET_AVX2
#define RAGATTN_HAVE_AVX2_VARIANT 0
#endif

#if defined(__GNUC__)
#define RAGATTN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define RAGATTN_ALWAYS_INLINE inline
#endif

namespace ragattn {

inline bool cpu_has_avx2() {
#if RAGATTN_HAVE_AVX2_VARIANT
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

}  // namespace ragattn
