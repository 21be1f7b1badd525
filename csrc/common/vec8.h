// 8 float lanes for the CPU kernels: GCC/clang vector extensions (explicit SIMD that does not
// depend on the auto-vectoriser; one ymm register in an AVX2 variant, two xmm registers on
// baseline x86-64) and the one branch-free exp the CPU paths share. Helpers are always inlined
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

}  // namespace ragattn
