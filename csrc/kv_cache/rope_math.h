// Per-element RoPE math shared by the CUDA kernels (kv_cache_kernels.cu) and the CPU twin
// (kv_cache_cpu.cpp). Framework-free: no torch headers.
//
// Angle: delta * inv_freq is formed and reduced mod 2*pi in double (exact product for
// |delta| < 2^29 since inv_freq has a 24-bit mantissa), so deltas up to 2^20 keep full fp32
// accuracy; a plain fp32 product would be off by up to ~0.06 rad there. Deltas are int64 (int32
// deltas widen exactly): beyond 2^29 the product rounds to double, still far below fp32's step. sin/cos and the pair
// rotation then run in fp32 (design.md: all trigonometry in fp32).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace ragattn {
namespace rope {

// delta * inv_freq reduced to [-pi, pi], as float.
RAGATTN_HD float reduced_angle(int64_t delta, float inv_freq) {
  const double kTwoPi = 6.283185307179586476925286766559;
  const double kInvTwoPi = 0.15915494309189533576888376337251;
  const double theta = static_cast<double>(delta) * static_cast<double>(inv_freq);
  const double turns = rint(theta * kInvTwoPi);
  return static_cast<float>(fma(-turns, kTwoPi, theta));
}

// cos/sin of the rotation by `delta` positions at frequency `inv_freq`.
RAGATTN_HD void angle_cos_sin(int64_t delta, float inv_freq, float* c, float* s) {
  const float a = reduced_angle(delta, inv_freq);
#if defined(__CUDA_ARCH__)
  sincosf(a, s, c);
#else
  *c = std::cos(a);
  *s = std::sin(a);
#endif
}

// (y1, y2) = R(angle) (x1, x2): the rotation of one RoPE pair, in fp32.
RAGATTN_HD void rotate_pair(float x1, float x2, float c, float s, float* y1, float* y2) {
  *y1 = x1 * c - x2 * s;
  *y2 = x2 * c + x1 * s;
}

// Element index pairs of frequency `i`: NeoX halves (i, i + r/2) or GPT-J neighbours (2i, 2i+1).
RAGATTN_HD int pair_first(int i, int rotary_dim, bool interleaved) { return interleaved ? 2 * i : i; }
RAGATTN_HD int pair_second(int i, int rotary_dim, bool interleaved) {
  return interleaved ? 2 * i + 1 : i + rotary_dim / 2;
}

// Storage <-> fp32. The generic versions serve float and c10::Half / c10::BFloat16 on the host;
// the CUDA types get explicit conversions (torch builds with __CUDA_NO_HALF_CONVERSIONS__).
template <typename T>
RAGATTN_HD float to_f32(T v) {
  return static_cast<float>(v);
}
template <typename T>
RAGATTN_HD T from_f32(float v) {
  return static_cast<T>(v);
}
#if defined(__CUDACC__)
template <>
RAGATTN_HD float to_f32<__half>(__half v) {
  return __half2float(v);
}
template <>
RAGATTN_HD __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}
template <>
RAGATTN_HD float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
RAGATTN_HD __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
#endif

// Rotate one stored pair in place.
template <typename T>
RAGATTN_HD void rotate_stored_pair(T* a, T* b, float c, float s) {
  float y1, y2;
  rotate_pair(to_f32(*a), to_f32(*b), c, s, &y1, &y2);
  *a = from_f32<T>(y1);
  *b = from_f32<T>(y2);
}

}  // namespace rope
}  // namespace ragattn
