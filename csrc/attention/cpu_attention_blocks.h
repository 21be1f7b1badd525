// The 8-lane building blocks the CPU attention kernels share (paged_attention_cpu_common.h,
// varlen_attention_cpu_kernel.h), framework-free: widening loads, eight dot products per
// horizontal reduction, the exponentiation half of an online-softmax step, and the V accumulation
// into register-resident outputs. The element type T is a template parameter;
// cpu_attention_blocks_c10.h adds the loads of torch's half types.
// Everything is always inlined (cpu_isa.h): it compiles for its caller's ISA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention/softmax_math.h"
#include "common/cpu_isa.h"
#include "common/vec8.h"

namespace ragattn {

// 8 elements of T widened to float.
template <typename T>
RAGATTN_ALWAYS_INLINE v8f load8(const T* p) {
  float tmp[8];
  for (int u = 0; u < 8; ++u) tmp[u] = static_cast<float>(p[u]);
  v8f r;
  std::memcpy(&r, tmp, sizeof(r));
  return r;
}

template <>
RAGATTN_ALWAYS_INLINE v8f load8<float>(const float* p) {
  v8f r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

RAGATTN_ALWAYS_INLINE void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof(x)); }

// Dot products of NQ query vectors (qf, qf + D, ...) with NS key rows k[0..NS) (NQ * NS == 8):
// lane iq * NS + s = qf[iq] . k[s], summed in float in one fixed order whatever NQ, NS (8-lane
// partial sums over D, reduce8's tree, then the head dims past the last multiple of 8).
template <int NQ, int NS, typename T>
RAGATTN_ALWAYS_INLINE v8f dots8(const float* qf, int64_t D, const T* const* k) {
  static_assert(NQ * NS == 8, "eight dot products per call");
  v8f acc[8] = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    v8f kd[NS];
    for (int s = 0; s < NS; ++s) kd[s] = load8(k[s] + d);
    for (int iq = 0; iq < NQ; ++iq) {
      const v8f x = load8(qf + iq * D + d);
      for (int s = 0; s < NS; ++s) acc[iq * NS + s] += x * kd[s];
    }
  }
  v8f r = reduce8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]);
  for (; d < D; ++d)
    for (int iq = 0; iq < NQ; ++iq)
      for (int s = 0; s < NS; ++s) r[iq * NS + s] += qf[iq * D + d] * static_cast<float>(k[s][d]);
  return r;
}

// p[i * PROW + s] = scale * x[i] . rows[s] for the nv vectors x (D apart) and the n rows (rows
// padded to a multiple of 8 with a real row): pairs of vectors x four rows, each row loaded once
// for both; entries past n (up to the multiple of 8) are unspecified.
template <int64_t PROW, typename T>
RAGATTN_ALWAYS_INLINE void dot_rows(const float* x, int64_t nv, int64_t D, const T* const* rows, int64_t n, float scale,
                                    float* p) {
  int64_t i = 0;
  for (; i + 2 <= nv; i += 2) {
    for (int64_t s = 0; s < n; s += 4) {
      float o[8];
      store8(o, dots8<2, 4>(x + i * D, D, rows + s) * scale);
      std::memcpy(p + i * PROW + s, o, 4 * sizeof(float));
      std::memcpy(p + (i + 1) * PROW + s, o + 4, 4 * sizeof(float));
    }
  }
  for (; i < nv; ++i)
    for (int64_t s = 0; s < n; s += 8) store8(p + i * PROW + s, dots8<1, 8>(x + i * D, D, rows + s) * scale);
}

// acc[h][0:D] = alpha[h] * acc[h][0:D] + sum_s p[h][s] * v[s][0:D] for NH heads (acc rows D
// apart, p rows PROW apart), d in blocks of DB vectors kept in registers over all n rows of v.
template <int NH, int DB, int64_t PROW, typename T>
RAGATTN_ALWAYS_INLINE int64_t accumulate_block(float* acc, const float* p, const float* alpha, const T* const* v,
                                               int64_t n, int64_t D, int64_t d) {
  for (; d + 8 * DB <= D; d += 8 * DB) {
    v8f a[NH][DB];
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < DB; ++u) a[h][u] = load8(acc + h * D + d + 8 * u) * alpha[h];
    for (int64_t s = 0; s < n; ++s) {
      v8f x[DB];
      for (int u = 0; u < DB; ++u) x[u] = load8(v[s] + d + 8 * u);
      for (int h = 0; h < NH; ++h) {
        const float w = p[h * PROW + s];
        for (int u = 0; u < DB; ++u) a[h][u] += w * x[u];
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < DB; ++u) store8(acc + h * D + d + 8 * u, a[h][u]);
  }
  return d;
}

template <int NH, int64_t PROW, typename T>
RAGATTN_ALWAYS_INLINE void accumulate(float* acc, const float* p, const float* alpha, const T* const* v, int64_t n,
                                      int64_t D) {
  int64_t d = accumulate_block<NH, 8 / NH, PROW>(acc, p, alpha, v, n, D, 0);
  d = accumulate_block<NH, 1, PROW>(acc, p, alpha, v, n, D, d);
  for (; d < D; ++d) {  // head dims past the last multiple of 8
    for (int h = 0; h < NH; ++h) {
      float a = acc[h * D + d] * alpha[h];
      for (int64_t s = 0; s < n; ++s) a += p[h * PROW + s] * static_cast<float>(v[s][d]);
      acc[h * D + d] = a;
    }
  }
}

// The second half of an online-softmax step over the scores ph[s0, s1) (8-aligned), whose masked
// lanes the caller has set to -inf: vmax is their lane-wise max and bad marks the lanes holding a
// visible score the caller's rule refuses (NaN or +inf in both kernels; -inf has weight 0). Returns
// false (and changes nothing) when a lane is bad; else the running max m and sum l are updated,
// alpha = the rescale of the accumulated output, ph[s] = exp(ph[s] - m) (-inf lanes give 0, and
// so do NaN lanes from -inf - -inf while every score so far is -inf).
RAGATTN_ALWAYS_INLINE bool softmax_exp_step(float* ph, int64_t s0, int64_t s1, v8f vmax, v8i bad, float* m, float* l,
                                            float* alpha) {
  for (int u = 0; u < 8; ++u)
    if (bad[u]) return false;
  float cmax = vmax[0];
  for (int u = 1; u < 8; ++u) cmax = vmax[u] > cmax ? vmax[u] : cmax;
  const float m_new = std::max(*m, cmax);
  *alpha = softmax::rescale(*m, m_new);
  v8f sum = {};
  for (int64_t s = s0; s < s1; s += 8) {
    const v8f e = exp8_nonpositive(load8(ph + s) - m_new);
    store8(ph + s, e);
    sum += e;
  }
  *l = *l * *alpha + hsum8(sum);
  *m = m_new;
  return true;
}

}  // namespace ragattn
