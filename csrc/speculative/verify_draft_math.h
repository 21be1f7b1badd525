// Per-element math of verify_draft, shared by the CUDA kernel and its CPU twin.
//
// The CUDA kernel and the CPU twin must emit the same tokens for the same uniforms. An inverse
// CDF over a 128K vocabulary changes its answer whenever a prefix sum moves by one ulp, so both
// sides compute every intermediate value bit for bit alike:
//   * every fp32 operation is an explicitly rounded add/sub/mul/div or an explicit fmaf (so that
//     neither nvcc nor a host compiler fuses a multiply into an add behind our back);
//   * exp is our own (vexp2 below, base 2, branch-free), not the CUDA or libm one, which differ in the
//     last bit; every exponent is in base-2 units (base2_scales: the 1/T and log2(e) scales are one
//     multiply);
//   * sums are taken in one canonical order (see "Summation order"), which the CPU twin
//     replays on virtual threads. Maxima and argmaxima are order-independent.
//
// Summation order. The vocabulary is cut into num_slices(V) slices of kSliceLen tokens (the last one
// ends at V); on the GPU one CTA reduces one slice of one position, and the slice results are folded
// in slice order from the identity, at every position alike (fold_target_stats,
// fold_modified_stats, draw_pick, draw_crossing_slice). Slicing and fold order depend on V only, never
// on the device or the batch.
// Within a slice:
//   * the slice is cut into chunks of kChunk consecutive tokens; thread t owns the slice's chunks
//     t, t + kThreads, t + 2 kThreads, ... and folds them in increasing order, one chunk at a time
//     (softmax_update_chunk: the chunk's max first, then one rescale and the chunk's exps in order);
//   * per-thread partials are combined by an xor butterfly inside each warp (offsets 16..1),
//     then the warp results by the same butterfly in warp 0 (padded with the identity);
//   * inverse-CDF prefix sums go tile by tile (a tile = kThreads chunks of the slice): a chunk's base
//     is tile_base + (warp_exclusive + lane_exclusive), both exclusive prefixes taken from
//     Kogge-Stone inclusive scans (shfl_up 1, 2, 4, 8, 16) of the chunk sums, each chunk sum
//     folded from 0 in token order; inside a chunk the prefix is base + w0 + w1 + ... in order.
//     The slice total T_s folds its tile totals from 0; slice s starts its prefixes at
//     T_0 + T_1 + ... + T_{s-1} (folded from 0 in slice order), the grand total is that fold over
//     all slices; the drawn token is the first crossing in the crossing slice, the first slice whose
//     base + T_s passes u * total (draw_crossing_slice, draw_token): the other slices are not searched.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/host_device.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace ragattn {
namespace speculative {

constexpr int kThreads = 256;   // threads per CTA (CUDA block size; the twin's virtual threads)
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kChunk = 8;                    // consecutive tokens per thread step (one 16-byte bf16 load)
constexpr int kTile = kThreads * kChunk;     // tokens per block-wide step
constexpr int kSliceTiles = 2;               // tiles per vocabulary slice (one CTA's share of a position)
constexpr int kSliceLen = kSliceTiles * kTile;  // 4096 tokens: 8 KB of bf16 logits per CTA
constexpr int kNoToken = 0x7fffffff;         // "no index yet" in argmin/argmax reductions

// Storage format of target_logits.
enum LogitsKind : int { kLogitsF32 = 0, kLogitsF16 = 1, kLogitsBF16 = 2 };

// Which weights the final draw uses.
enum WeightMode : int { kWeightTarget = 0, kWeightResidual = 1 };

// Vocabulary slices (see "Summation order"): kSliceLen tokens each, the last one ends at V.
RAGATTN_HD int num_slices(int vocab) { return (vocab + kSliceLen - 1) / kSliceLen; }
// First token of slice s and one past its last.
RAGATTN_HD int slice_begin(int s, int vocab) {
  const int b = s * kSliceLen;
  return b < vocab ? b : vocab;
}
RAGATTN_HD int slice_end(int s, int vocab) { return slice_begin(s + 1, vocab); }
// Tiles of slice s (the last slice may hold fewer than kSliceTiles).
RAGATTN_HD int slice_tiles(int s, int vocab) {
  const int nchunks = (slice_end(s, vocab) - slice_begin(s, vocab) + kChunk - 1) / kChunk;
  return (nchunks + kThreads - 1) / kThreads;
}

// ---- explicitly rounded fp32 arithmetic ------------------------------------------------------
// Host compilers only fuse a*b+c into an FMA when the target has one (__FP_FAST_FMAF); there the
// product is forced through memory so it stays rounded, like __fmul_rn on the device.
RAGATTN_HD float f_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#elif defined(__FP_FAST_FMAF)
  volatile float r = a * b;
  return r;
#else
  return a * b;
#endif
}
RAGATTN_HD float f_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
RAGATTN_HD float f_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
RAGATTN_HD float f_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
RAGATTN_HD float f_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);  // correctly rounded on every host (hardware or libm)
#endif
}
RAGATTN_HD float f_max(float a, float b) { return a > b ? a : (b > a ? b : (a == a ? a : b)); }
// IEEE maxNum: the larger of a and b, the other one where one is NaN (a zero's sign is left open).
RAGATTN_HD float f_maxnum(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return (b > a || a != a) ? b : a;
#endif
}
RAGATTN_HD float f_min(float a, float b) { return a < b ? a : (b < a ? b : (a == a ? a : b)); }
// IEEE minNum: the smaller of a and b, the other one where one is NaN (a zero's sign is left open).
RAGATTN_HD float f_minnum(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return (b < a || a != a) ? b : a;
#endif
}

RAGATTN_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

RAGATTN_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// Exact widening of the 16-bit logit formats (the raw bits, so that no framework type is needed).
RAGATTN_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }
RAGATTN_HD float fp16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));  // exact, like the integer path below
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t expo = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (expo == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float mag = f_mul(static_cast<float>(mant), 5.9604644775390625e-8f);
    return sign ? -mag : mag;
  }
  if (expo == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  return bits_to_float(sign | ((expo + 112u) << 23) | (mant << 13));
#endif
}

// Token v of a logits row, widened to fp32.
RAGATTN_HD float load_logit(const void* row, int kind, int64_t v) {
  if (kind == kLogitsF32) return static_cast<const float*>(row)[v];
  const uint16_t h = static_cast<const uint16_t*>(row)[v];
  return kind == kLogitsBF16 ? bf16_to_float(h) : fp16_to_float(h);
}

// 2^t, the one exponential of the op's arithmetic. Every exponent is a base-2 scaled difference
// t = (x - m) * scale with scale = log2(e) / T (base2_scales below) or one of its sums, so that
// 2^t = exp((x - m) / T) costs one multiply and this function: the 1/T and log2(e) scales are one
// multiply, and the reduction needs no ln2 split (k = rint(t), r = t - k is exact). Arguments are
// <= 0 up to rounding (a value minus the running max of its kind); NaN and t < -126.5 (-inf too)
// give 0 (no subnormal results). Branch-free: t is clamped at -127 (maxNum: NaN -> -127, whose 2^k
// is the zero bit pattern), k is rounded to an integer by adding and subtracting 1.5 * 2^23 (exact,
// ties to even, like rint), the sum's low bits are k, and 2^k is (k + 127) << 23. 2^r on
// [-1/2, 1/2]: degree-6 Chebyshev-node interpolant of 2^r (0.3 ulp from its fp32 coefficients),
// about 1 ulp in all.
RAGATTN_HD float vexp2(float t) {
  const float tc = f_maxnum(t, -127.0f);  // one instruction on the GPU; NaN -> -127
  const float kk = f_add(tc, 12582912.0f);  // 1.5 * 2^23 + k: its low mantissa bits are k
  const float r = f_sub(tc, f_sub(kk, 12582912.0f));
  float p = 1.5461444854736328e-4f;
  p = f_fma(p, r, 1.3400427997112274e-3f);
  p = f_fma(p, r, 9.618056938052177e-3f);
  p = f_fma(p, r, 5.550327152013779e-2f);
  p = f_fma(p, r, 2.4022650718688965e-1f);
  p = f_fma(p, r, 6.931471824645996e-1f);
  p = f_fma(p, r, 1.0f);
  // bits(kk) = bits(1.5 * 2^23) + k, and bits(1.5 * 2^23) << 23 wraps to 0 (its low 9 bits are 0)
  return f_mul(p, bits_to_float((float_to_bits(kk) << 23) + (127u << 23)));
}

// The op's scales in base 2: t = (z - max z) * scale is the scaled logit (z - max z) / T in units of
// log2(e), so 2^t = exp((z - max z) / T); RAPID's modified logits a = y + eta * mask * (q - p) take
// eta * log2(e) in the same units. Each is one rounding of its float64 value (saturated at FLT_MAX:
// for T below log2(e) / FLT_MAX every token but the argmax ties of z gets t = -inf, probability 0,
// which is also the limit T -> 0). The fast CPU path keeps natural units (1/T, eta).
struct Base2Scales {
  float scale;  // log2(e) / T
  float eta;    // eta * log2(e) (0 when eta rounds to 0 in fp32, so that eta > 0 decides alike)
};

inline Base2Scales base2_scales(double temperature, double eta) {
  constexpr double kLog2e = 1.4426950408889634;
  const double s = kLog2e / temperature;
  Base2Scales b;
  b.scale = s < 3.4028234663852886e38 ? static_cast<float>(s) : 3.4028234663852886e38f;
  b.eta = static_cast<float>(eta) > 0.0f ? static_cast<float>(eta * kLog2e) : 0.0f;
  return b;
}

// 1/T in fp32, saturated at FLT_MAX (the fast CPU path's natural-unit scale).
inline float inverse_temperature(double temperature) {
  const double inv = 1.0 / temperature;
  return inv < 3.4028234663852886e38 ? static_cast<float>(inv) : 3.4028234663852886e38f;
}

// ---- non-finite logits: one rule on every backend -------------------------------------------------
// NaN and -inf logits have probability 0. +inf logits share all the mass equally (the limit of a
// logit growing without bound): every +inf token has probability 1 / (number of +inf tokens) and
// every other token 0. A position whose logits are all -inf/NaN has no mass at all: its draft is
// rejected and it emits token 0 (argmax and inverse CDF find nothing).
// x - m, except that +inf - +inf is 0 (a +inf token at the running +inf maximum), not NaN.
RAGATTN_HD float logit_diff(float x, float m) { return (x == INFINITY && m == INFINITY) ? 0.0f : f_sub(x, m); }

// ---- online softmax with argmax ---------------------------------------------------------------
// Running (max m, sum s of 2^((x - m) * scale), first argmax idx) over the tokens seen (scale: log2(e) / T
// for logits, 1 for the modified logits, already in base-2 units). -inf and NaN inputs contribute
// nothing (probability 0).
struct SoftmaxState {
  float m;
  float s;
  int idx;
};

RAGATTN_HD SoftmaxState softmax_identity() { return SoftmaxState{-INFINITY, 0.0f, kNoToken}; }

// Folds one chunk of kChunk logits (tokens v0, v0 + 1, ...; -inf past the end of the slice) into
// st: the chunk's max (maxNum: NaN and -inf never win; +0 for a zero max, whatever the sign of its
// zeros, so that every backend holds the same bits) and, where it raises the running max, its first
// argmax and one rescale of st.s to the new max (skipped where st.s is 0: the chunk's first state,
// whose rescale would multiply 0), then the chunk's exps in token order. A chunk that does not raise
// the max skips the rescale, whose factor would be exactly 2^0 = 1: the same bits either way. One
// vexp2 per token plus at most one per chunk, where a per-token online update pays a data-dependent
// rescale.
RAGATTN_HD void softmax_update_chunk(SoftmaxState& st, const float (&x)[kChunk], int v0, float scale) {
  float cm = -INFINITY;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int e = 0; e < kChunk; ++e) cm = f_maxnum(cm, x[e]);
  cm = f_add(cm, 0.0f);  // -0 -> +0 (maxNum leaves the sign of a zero max open)
  if (cm > st.m) {  // a new running max (every chunk of a fresh state but an all -inf / NaN one)
    int ci = kChunk - 1;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int e = kChunk - 1; e >= 0; --e) ci = x[e] == cm ? e : ci;  // the first index of the max
    st.idx = v0 + ci;
    if (st.s > 0.0f) st.s = f_mul(st.s, vexp2(f_mul(logit_diff(st.m, cm), scale)));
    st.m = cm;
  }
  const float m = st.m;
  if (m == INFINITY) {  // (rare) a +inf logit: +inf - +inf must give 0, not NaN
    for (int e = 0; e < kChunk; ++e) st.s = f_add(st.s, vexp2(f_mul(logit_diff(x[e], m), scale)));
  } else {  // logit_diff(x, m) == x - m: a uniform branch saves its checks on every token
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int e = 0; e < kChunk; ++e) st.s = f_add(st.s, vexp2(f_mul(f_sub(x[e], m), scale)));
  }
}

// Symmetric in (a, b) bit for bit, so both lanes of a butterfly hold the same result.
// Merging with a state that saw nothing returns the other state exactly (vexp2(0) == 1), so that
// case is short-cut (most virtual threads of the CPU twin are empty for small vocabularies).
RAGATTN_HD SoftmaxState softmax_merge(const SoftmaxState& a, const SoftmaxState& b, float scale) {
  if (b.s == 0.0f && b.idx == kNoToken) return a;
  if (a.s == 0.0f && a.idx == kNoToken) return b;
  SoftmaxState r;
  r.m = f_max(a.m, b.m);
  const float sa = a.s > 0.0f ? f_mul(a.s, vexp2(f_mul(logit_diff(a.m, r.m), scale))) : 0.0f;
  const float sb = b.s > 0.0f ? f_mul(b.s, vexp2(f_mul(logit_diff(b.m, r.m), scale))) : 0.0f;
  r.s = f_add(sa, sb);
  r.idx = a.m > b.m ? a.idx : (b.m > a.m ? b.idx : (a.idx < b.idx ? a.idx : b.idx));
  return r;
}

// ---- the distributions at one position ---------------------------------------------------------
// After the per-position reductions every thread holds the same PositionStats.
struct PositionStats {
  float m_z;       // max of the raw target logits z
  float inv_sp;    // 1 / sum 2^((z - m_z) * scale)
  int argmax_z;    // first argmax of z (= argmax p)
  float q_thresh;  // alpha * max(q): the RAPID mask is q >= q_thresh
  float m_a;       // max of the modified logits a (eta > 0; base-2 units)
  float inv_sa;    // 1 / sum 2^(a - m_a)
  int argmax_a;    // first argmax of a (= argmax p_hat)
  float hat_scale;  // p_hat / p of an unmasked token (eta > 0; hat_scale_of), 0: none (its own exp)
};

// The stats of p alone (eta = 0, or before the p_hat sweep): p_hat = p until that sweep fills them.
RAGATTN_HD PositionStats target_stats(const SoftmaxState& sz) {
  PositionStats ps;
  ps.m_z = sz.m;
  ps.inv_sp = f_div(1.0f, sz.s);
  ps.argmax_z = sz.idx;
  ps.q_thresh = 0.0f;
  ps.m_a = 0.0f;
  ps.inv_sa = 1.0f;
  ps.argmax_a = sz.idx;
  ps.hat_scale = 0.0f;
  return ps;
}

// y = (z - max z) * log2(e) / T <= 0 (base 2: p = 2^y / sum): never overflows, however small T is (0 for
// a +inf token at a +inf max).
RAGATTN_HD float scaled_logit(float z, float m_z, float scale) { return f_mul(logit_diff(z, m_z), scale); }

// Draft probability of token v: the row of draft_probs, or one-hot on the draft token x when the
// drafter gave no distribution (draft_probs=None: n-gram / prompt-lookup drafters).
RAGATTN_HD float draft_prob(const float* q_row, int64_t x, int64_t v) {
  return q_row != nullptr ? q_row[v] : (v == x ? 1.0f : 0.0f);
}

// p(v) from its scaled logit.
RAGATTN_HD float target_prob(float y, float inv_sp) { return f_mul(vexp2(y), inv_sp); }

// RAPID's modified logit a = y + eta * mask * (q - p) in base-2 units (eta: base2_scales' eta * log2(e);
// p_hat = 2^a / sum, shift-invariant).
// p is only needed where the mask is on (usually a handful of tokens), so it is computed there.
RAGATTN_HD float modified_logit(float y, float q, float eta, float q_thresh, float inv_sp) {
  return q >= q_thresh ? f_add(y, f_mul(eta, f_sub(q, target_prob(y, inv_sp)))) : y;
}

RAGATTN_HD float modified_prob(float a, float m_a, float inv_sa) { return f_mul(vexp2(f_sub(a, m_a)), inv_sa); }

// The per-position constant c with p_hat = p * c at every unmasked token (a = y there, so p_hat / p =
// 2^-m_a * sum 2^y / sum 2^(a - m_a)): c = (inv_sa / inv_sp) * 2^-m_a, one vexp2 a position, so that the
// draw's weights take one exp a token. Used where m_a is in [-24, 64] (|m_a| <= eta * log2(e): RAPID's eta
// up to ~16 always) and c comes out a positive finite float: below -24 the unmasked tokens' p would
// underflow (vexp2 has no subnormals) where p_hat need not, above 64 c could; elsewhere (and for the
// all -inf / NaN rows) 0: an unmasked token's p_hat then takes its own exp, modified_prob.
RAGATTN_HD float hat_scale_of(float inv_sp, float m_a, float inv_sa) {
  if (!(m_a >= -24.0f && m_a <= 64.0f)) return 0.0f;
  const float c = f_mul(f_div(inv_sa, inv_sp), vexp2(f_sub(0.0f, m_a)));
  return c > 0.0f && c < INFINITY ? c : 0.0f;
}

// ---- the modified logits' sweep (eta > 0): a thread's state over its chunks of a slice ----------------
// Where none of a thread's tokens in the slice is masked (q < q_thresh everywhere, so a = y there, padding
// included), its state is its first sweep's state of z (the same chunks, softmax_update_chunk with scale)
// shifted into a's units: max y(m), the same sum and first argmax (2^(y - y(m)) = 2^((z - m) scale) up to
// rounding), with no exp per token. Otherwise (a thread holding one of a position's few masked tokens) it
// is the online softmax of its modified logits, chunk by chunk (modified_update_chunk). Which of the two a
// thread takes is part of the summation order: every backend tests the same tokens.
RAGATTN_HD bool chunk_masked(const float (&q)[kChunk], float q_thresh) {
  bool any = false;
  for (int e = 0; e < kChunk; ++e) any |= q[e] >= q_thresh;
  return any;
}

// One chunk of modified logits a = modified_logit(y, q) folded into st (base-2 units, scale 1).
RAGATTN_HD void modified_update_chunk(SoftmaxState& st, const float (&z)[kChunk], const float (&q)[kChunk], int v0,
                                      const PositionStats& ps, float scale, float eta) {
  float a[kChunk];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int e = 0; e < kChunk; ++e) {
    a[e] = modified_logit(scaled_logit(z[e], ps.m_z, scale), q[e], eta, ps.q_thresh, ps.inv_sp);
  }
  softmax_update_chunk(st, a, v0, 1.0f);
}

// A first-sweep state of z in the modified logits' units (a state that saw nothing stays so, and so does one
// whose tokens all have y = -inf: finite logits under a +inf max).
RAGATTN_HD SoftmaxState shifted_state(const SoftmaxState& st, float m_z, float scale) {
  if (st.s == 0.0f && st.idx == kNoToken) return st;
  const float m = scaled_logit(st.m, m_z, scale);
  return m == -INFINITY ? softmax_identity() : SoftmaxState{m, st.s, st.idx};
}

// The thread's state in the modified logits: `direct` (its modified_update_chunk folds) if it holds a
// masked token, else its first-sweep state `first` shifted.
RAGATTN_HD SoftmaxState modified_thread_state(bool masked, const SoftmaxState& direct, const SoftmaxState& first,
                                              float m_z, float scale) {
  return masked ? direct : shifted_state(first, m_z, scale);
}

// p(v) and p_hat(v) of one token (p_hat = p when eta == 0): p by one vexp2; p_hat of an unmasked token
// (q < q_thresh) p * hat_scale where the position has one, else (a masked token, or no hat_scale) from
// its modified logit by its own vexp2.
RAGATTN_HD void token_probs(float z, float q, const PositionStats& st, float scale, float eta, float* p,
                            float* p_hat) {
  const float y = scaled_logit(z, st.m_z, scale);
  *p = target_prob(y, st.inv_sp);
  if (!(eta > 0.0f)) {
    *p_hat = *p;
  } else if (q < st.q_thresh && st.hat_scale > 0.0f) {
    *p_hat = f_mul(*p, st.hat_scale);
  } else {
    *p_hat = modified_prob(modified_logit(y, q, eta, st.q_thresh, st.inv_sp), st.m_a, st.inv_sa);
  }
}

// Accept draft x iff q(x) > 0 and u q(x) < p_hat(x): the division-free, strict form of
// u <= min(1, p_hat / q), which never accepts a token of target probability 0.
RAGATTN_HD bool accept_draft(float u, float q_x, float p_hat_x) { return q_x > 0.0f && f_mul(u, q_x) < p_hat_x; }

// The residual weight max(p - min(q, p_hat), 0) of a token after a rejection: one minNum and one maxNum
// instruction on the GPU. The same bits as the NaN-ordered f_min / f_max on every input the op makes: p is
// +0, positive or NaN (never -0), so p - min(q, p_hat) is never -0 and the sign left open of a zero min
// cannot show; a NaN operand gives the other one (min) and 0 (max) either way.
RAGATTN_HD float residual_weight(float p, float q, float p_hat) {
  return f_maxnum(f_sub(p, f_minnum(q, p_hat)), 0.0f);
}

// Weight of token v in the final draw, the residual after a rejection (mode kWeightResidual) or p for the
// bonus token, and p(v) (*w_p), in one pass: the draw totals of a rejected position need both (the residual,
// and p for its all-zero fallback).
RAGATTN_HD float draw_weights(int mode, float z, float q, const PositionStats& st, float scale, float eta, float* w_p) {
  float p, p_hat;
  if (mode == kWeightTarget) {
    p = target_prob(scaled_logit(z, st.m_z, scale), st.inv_sp);
    *w_p = p;
    return p;
  }
  token_probs(z, q, st, scale, eta, &p, &p_hat);
  *w_p = p;
  return residual_weight(p, q, p_hat);
}

// Prefix of a chunk's first token within a tile (see "Summation order").
RAGATTN_HD float chunk_base(float tile_base, float warp_exclusive, float lane_exclusive) {
  return f_add(tile_base, f_add(warp_exclusive, lane_exclusive));
}

// ---- the phases' scalar steps (see verify_draft_kernels.cu: the kernel runs each slice of each
// position in its own CTA and these folds on single threads; the twin calls the same functions) --

// One slice's statistics at one position (phase 1): the softmax state of z / T (or, in the second
// pass, of the modified logits) and the slice's max draft probability (-inf where it is not needed).
struct SlicePartial {
  SoftmaxState st;
  float qmax;
};

// p's statistics at a position from its slices' partials, folded in slice order; with_q (eta > 0 at
// a drafted position): also RAPID's mask threshold alpha * max q.
RAGATTN_HD PositionStats fold_target_stats(const SlicePartial* parts, int n, float scale, float alpha, bool with_q) {
  SoftmaxState sz = softmax_identity();
  float qm = -INFINITY;
  for (int s = 0; s < n; ++s) {
    sz = softmax_merge(sz, parts[s].st, scale);
    qm = f_max(qm, parts[s].qmax);
  }
  PositionStats ps = target_stats(sz);
  if (with_q) ps.q_thresh = f_mul(alpha, qm);
  return ps;
}

// p_hat's statistics (eta > 0) from the second pass's partials, folded in slice order.
RAGATTN_HD void fold_modified_stats(PositionStats& ps, const SlicePartial* parts, int n) {
  SoftmaxState sa = softmax_identity();
  for (int s = 0; s < n; ++s) sa = softmax_merge(sa, parts[s].st, 1.0f);
  ps.m_a = sa.m;
  ps.inv_sa = f_div(1.0f, sa.s);
  ps.argmax_a = sa.idx;
  ps.hat_scale = hat_scale_of(ps.inv_sp, ps.m_a, ps.inv_sa);
}

// The decision at a drafted position: draft x (in_range: x in [0, V)), its logit z_x and draft
// probability q_x (read only when in_range), acceptance uniform u. Greedy: accepted iff x is the argmax
// of p_hat (*best, the token emitted on rejection); sampling: accept_draft.
RAGATTN_HD bool draft_accepted(bool greedy, const PositionStats& ps, int64_t x, bool in_range, float z_x, float q_x,
                               float u, float scale, float eta, int* best) {
  *best = eta > 0.0f ? ps.argmax_a : ps.argmax_z;
  if (greedy) return x == *best;
  if (!in_range) return false;
  float p, p_hat;
  token_probs(z_x, q_x, ps, scale, eta, &p, &p_hat);
  return accept_draft(u, q_x, p_hat);
}

// One slice's totals at the drawn position (phase 3a): T_s of the draw's weights and, after a rejection,
// of p too (the fallback when the whole residual is zero), each with the slice's last token of positive
// weight (-1: none). For a bonus draw both pairs hold p's.
struct DrawSlice {
  float total;
  int last;
  float total_p;
  int last_p;
};

RAGATTN_HD float draw_slice_total(const DrawSlice& d, int mode) { return mode == kWeightResidual ? d.total : d.total_p; }

// The weights the draw uses (mode: the residual, or p if the residual is all zero; -1: no weight at all,
// a position of all -inf / NaN logits) and their grand total, the slices folded in order from 0.
RAGATTN_HD int draw_pick(const DrawSlice* d, int n, int mode, float* total) {
  float t = 0.0f;
  if (mode == kWeightResidual) {
    for (int s = 0; s < n; ++s) t = f_add(t, d[s].total);
    if (t > 0.0f) {
      *total = t;
      return kWeightResidual;
    }
    t = 0.0f;
  }
  for (int s = 0; s < n; ++s) t = f_add(t, d[s].total_p);
  *total = t;
  return t > 0.0f ? kWeightTarget : -1;
}

// The slice holding the draw's crossing of target = u * total: the first slice with T_s > 0 whose base_s + T_s
// passes target, base_s = T_0 + ... + T_{s-1} folded from 0 in slice order (*base); -1 where none does
// (rounding put target at the grand total). Only that slice is searched (draw_token).
RAGATTN_HD int draw_crossing_slice(const DrawSlice* d, int n, int mode, float target, float* base) {
  float b = 0.0f;
  for (int s = 0; s < n; ++s) {
    const float t = draw_slice_total(d[s], mode);
    const float next = f_add(b, t);
    if (t > 0.0f && next > target) {
      *base = b;
      return s;
    }
    b = next;
  }
  *base = b;
  return -1;
}

// The drawn token (mode: draw_pick's): in the crossing slice s its first token whose prefix from base_s passes
// target (`found`; kNoToken where the slice's prefixes, rounded apart from base_s + T_s, stay at or below
// it) or else its last token of positive weight; with no crossing slice (s < 0) the row's last token of
// positive weight; with no weight at all (mode < 0) argmax_z.
RAGATTN_HD int draw_token(const DrawSlice* d, int n, int mode, int s, int found, int argmax_z) {
  if (mode < 0) return argmax_z;
  auto last_of = [mode](const DrawSlice& x) { return mode == kWeightResidual ? x.last : x.last_p; };
  if (s >= 0) return found != kNoToken ? found : last_of(d[s]);
  int last = -1;
  for (int k = 0; k < n; ++k) last = last_of(d[k]) > last ? last_of(d[k]) : last;
  return last;
}

}  // namespace speculative
}  // namespace ragattn
