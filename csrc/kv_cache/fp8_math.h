// float8_e4m3fn KV-cache elements (vLLM's kv_cache_dtype="fp8"), shared by the CUDA kernels and
// the CPU twin. A stored element x of a cache with per-tensor scale s means the value x * s; a
// value v is stored as round_to_nearest_even(clamp(v / s, -448, 448)) (saturating, as vLLM
// quantises). A scale must be finite and > 0 (checked on the host where that is free: CPU, or
// RAGATTN_DEBUG=1); a kernel that meets another reads and writes NaN, never a finite value. The conversions are CUDA's cuda_fp8.h intrinsics under nvcc and c10's (the same
// bits as torch's .to(torch.float8_e4m3fn)) on the host. Framework-free apart from that host
// include.
#pragma once

#include <cstdint>
#include <limits>

#include "common/host_device.h"
#include "kv_cache/rope_math.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#else
#include <c10/util/Float8_e4m3fn.h>
#endif

namespace ragattn {
namespace kv_cache {

// Storage of one float8_e4m3fn element (torch's bits).
struct alignas(1) Fp8E4M3 {
  uint8_t bits;
};

constexpr float kFp8E4M3Max = 448.f;

RAGATTN_HD float fp8_e4m3_to_f32(uint8_t b) {
#if defined(__CUDACC__)
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
#else
  return c10::detail::fp8e4m3fn_to_fp32_value(b);
#endif
}

// Saturating: |v| > 448 stores +-448; NaN stays NaN.
RAGATTN_HD uint8_t f32_to_fp8_e4m3(float v) {
  v = v > kFp8E4M3Max ? kFp8E4M3Max : (v < -kFp8E4M3Max ? -kFp8E4M3Max : v);
#if defined(__CUDACC__)
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
#else
  return c10::detail::fp8e4m3fn_from_fp32_value(v);
#endif
}

// Whether a per-tensor scale is usable: finite and > 0 (false for NaN).
RAGATTN_HD bool fp8_scale_ok(float scale) { return scale > 0.f && scale <= 3.402823466e38f; }

RAGATTN_HD float fp8_nan() {
#if defined(__CUDA_ARCH__)
  return __int_as_float(0x7fc00000);
#else
  return std::numeric_limits<float>::quiet_NaN();
#endif
}

template <typename T>
struct IsFp8 {
  static constexpr bool value = false;
};
template <>
struct IsFp8<Fp8E4M3> {
  static constexpr bool value = true;
};

// A stored element as fp32: x * scale for fp8, x otherwise (the scale is 1 there).
template <typename T>
RAGATTN_HD float load_elem(T x, float scale) {
  return rope::to_f32(x);
}
template <>
RAGATTN_HD float load_elem<Fp8E4M3>(Fp8E4M3 x, float scale) {
  return fp8_scale_ok(scale) ? fp8_e4m3_to_f32(x.bits) * scale : fp8_nan();
}

// An fp32 value stored as T: v / scale, saturated, for fp8; rounded to T otherwise.
template <typename T>
RAGATTN_HD T store_elem(float v, float scale) {
  return rope::from_f32<T>(v);
}
template <>
RAGATTN_HD Fp8E4M3 store_elem<Fp8E4M3>(float v, float scale) {
  return Fp8E4M3{f32_to_fp8_e4m3(fp8_scale_ok(scale) ? v / scale : fp8_nan())};
}

}  // namespace kv_cache
}  // namespace ragattn
