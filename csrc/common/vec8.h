// 8 float lanes for the CPU kernels: GCC/clang vector extensions (explicit SIMD that does not
// depend on the auto-vectoriser; one ymm register in an AVX2 variant, two xmm registers on
// baseline x86-64), the one branch-free exp the CPU paths share, horizontal sums and the bf16
// widening load. Helpers are always inlined
// (cpu_isa.h) so they compile for their caller's ISA and no 32-byte vector crosses a call.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/cpu_isa.h"

namespace ragattn {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

// exp(min(x, 0)) of 8 lanes, about 1 ulp: Cody-Waite reduction x = n ln2 + r and Cephes'
// degree-6 expf polynomial. Lanes below -87.3 (where expf is under 2^-126), -inf and NaN give 0;
// positive lanes give 1 (callers pass score - running max, which is <= 0).
RAGATTN_ALWAYS_INLINE v8f exp8_nonpositive(v8f x) {
  v8f lo = x < -87.3f ? v8f{} - 87.3f : x;  // GCC: vector ?: selects lanes
  lo = lo > 0.0f ? v8f{} : lo;
  const v8f shifter = v8f{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const v8f t = lo * 1.44269504088896341f + shifter;
  const v8f n = t - shifter;
  v8f r = lo - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v8f p = v8f{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8f y = p * r * r + r + 1.0f;
  v8i yi, ti;
  std::memcpy(&yi, &y, sizeof(y));
  std::memcpy(&ti, &t, sizeof(t));
  yi += (ti - 0x4B400000) << 23;  // y * 2^n, n in [-126, 0]
  v8f out;
  std::memcpy(&out, &yi, sizeof(out));
  return x >= -87.3f ? out : v8f{};  // NaN compares false: 0
}

// Sum of the 8 lanes, pairwise.
RAGATTN_ALWAYS_INLINE float hsum8(v8f a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

#if defined(__clang__)
#define RAGATTN_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define RAGATTN_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// Lane i of the result = the sum of a_i's 8 lanes, in one order for every lane
// (((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))): eight horizontal sums in 7 vector adds.
RAGATTN_ALWAYS_INLINE v8f reduce8(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
  // pairs: [a0 01, a1 01, a0 23, a1 23, a0 45, a1 45, a0 67, a1 67]
  const v8f s01 = RAGATTN_SHUFFLE8(a0, a1, 0, 8, 2, 10, 4, 12, 6, 14) + RAGATTN_SHUFFLE8(a0, a1, 1, 9, 3, 11, 5, 13, 7, 15);
  const v8f s23 = RAGATTN_SHUFFLE8(a2, a3, 0, 8, 2, 10, 4, 12, 6, 14) + RAGATTN_SHUFFLE8(a2, a3, 1, 9, 3, 11, 5, 13, 7, 15);
  const v8f s45 = RAGATTN_SHUFFLE8(a4, a5, 0, 8, 2, 10, 4, 12, 6, 14) + RAGATTN_SHUFFLE8(a4, a5, 1, 9, 3, 11, 5, 13, 7, 15);
  const v8f s67 = RAGATTN_SHUFFLE8(a6, a7, 0, 8, 2, 10, 4, 12, 6, 14) + RAGATTN_SHUFFLE8(a6, a7, 1, 9, 3, 11, 5, 13, 7, 15);
  // quads: [a0 0-3, a1 0-3, a2 0-3, a3 0-3, a0 4-7, a1 4-7, a2 4-7, a3 4-7] (u1: a4..a7)
  const v8f u0 = RAGATTN_SHUFFLE8(s01, s23, 0, 1, 8, 9, 4, 5, 12, 13) + RAGATTN_SHUFFLE8(s01, s23, 2, 3, 10, 11, 6, 7, 14, 15);
  const v8f u1 = RAGATTN_SHUFFLE8(s45, s67, 0, 1, 8, 9, 4, 5, 12, 13) + RAGATTN_SHUFFLE8(s45, s67, 2, 3, 10, 11, 6, 7, 14, 15);
  return RAGATTN_SHUFFLE8(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) + RAGATTN_SHUFFLE8(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// 8 bfloat16 values (raw bits at p) widened to float: exact (the upper half of a float32).
RAGATTN_ALWAYS_INLINE v8f bf16x8_to_float(const void* p) {
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  v8u16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const v8i bits = __builtin_convertvector(raw, v8i) << 16;
  v8f r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

// 8 IEEE half values (raw bits at p) widened to float, exactly (normal, subnormal, zero, inf,
// NaN), in integer vector ops: compilers scalarise a _Float16 vector conversion.
RAGATTN_ALWAYS_INLINE v8f f16x8_to_float(const void* p) {
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  v8u16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const v8i h = __builtin_convertvector(raw, v8i);
  const v8i em = (h & 0x7fff) << 13;  // exponent and mantissa at their float32 places
  const v8i exp = em & (0x7c00 << 13);
  v8i bits = em + ((127 - 15) << 23);                               // rebias the exponent
  bits = exp == (0x7c00 << 13) ? bits + ((128 - 16) << 23) : bits;  // inf, NaN: all-ones exponent
  v8f normal, low;
  std::memcpy(&normal, &bits, sizeof(normal));
  const v8i low_bits = bits + (1 << 23);  // zero, subnormal: 2^-14 * (1 + m / 1024) - 2^-14
  std::memcpy(&low, &low_bits, sizeof(low));
  low -= 6.103515625e-05f;  // 2^-14, exact
  v8f r = exp == 0 ? low : normal;
  v8i rb;
  std::memcpy(&rb, &r, sizeof(rb));
  rb |= (h & 0x8000) << 16;  // the sign
  std::memcpy(&r, &rb, sizeof(r));
  return r;
}

}  // namespace ragattn
