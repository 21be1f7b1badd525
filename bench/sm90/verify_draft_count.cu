// Instruction-count harness of verify_draft's per-token math (csrc/speculative/verify_draft_math.h), for
// bench/sm90/ptx_blocks.py: one thread's work in phase 1 as the kernels run it, without their loads'
// addressing and reductions. Count the hot path of each entry (docs/perf/h100.md, verify_draft):
//   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr -Icsrc -ptx \
//     -o /tmp/vd.ptx bench/sm90/verify_draft_count.cu && python bench/sm90/ptx_blocks.py /tmp/vd.ptx slice_pair
// (entries: one_exp, slice_pair, slice_pair_modified, slice_pair_reuse, chunk_residual)
#include "speculative/verify_draft_math.h"
using namespace ragattn::speculative;

__device__ __forceinline__ void widen_bf16(const uint4& r, float (&x)[kChunk]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = bf16_to_float(static_cast<uint16_t>(w[i] & 0xffffu));
    x[2 * i + 1] = bf16_to_float(static_cast<uint16_t>(w[i] >> 16));
  }
}

// the exp alone
extern "C" __global__ void one_exp(const float* x, float* y) { y[threadIdx.x] = vexp2(x[threadIdx.x]); }

// one thread's share of a slice in phase 1 (kSliceTiles = 2 chunks from the identity), as the stats kernels
extern "C" __global__ void slice_pair(const uint4* z, float scale, SoftmaxState* out) {
  SoftmaxState st = softmax_identity();
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    float x[kChunk];
    widen_bf16(z[threadIdx.x + 256 * c], x);
    softmax_update_chunk(st, x, (threadIdx.x + 256 * c) * 8, scale);
  }
  out[threadIdx.x] = st;
}

// the same share in the eta > 0 second sweep computed directly (a thread holding a masked token)
extern "C" __global__ void slice_pair_modified(const uint4* z, const float4* q, PositionStats ps, float scale,
                                               float eta, SoftmaxState* out) {
  SoftmaxState st = softmax_identity();
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int ch = threadIdx.x + 256 * c;
    const float4 qa = q[2 * ch], qb = q[2 * ch + 1];
    const float qq[kChunk] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
    float x[kChunk];
    widen_bf16(z[ch], x);
    modified_update_chunk(st, x, qq, ch * 8, ps, scale, eta);
  }
  out[threadIdx.x] = st;
}

// the second sweep of one thread's two chunks when none is masked: the mask test over q and the shift
extern "C" __global__ void slice_pair_reuse(const float4* q, const SoftmaxState* first, PositionStats ps, float scale,
                                            SoftmaxState* out) {
  bool masked = false;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int ch = threadIdx.x + 256 * c;
    const float4 qa = q[2 * ch], qb = q[2 * ch + 1];
    const float qq[kChunk] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
    masked |= chunk_masked(qq, ps.q_thresh);
  }
  SoftmaxState st = softmax_identity();
  if (masked) st.s = 1.0f;  // (stands for the rare direct sweep)
  out[threadIdx.x] = modified_thread_state(masked, st, first[threadIdx.x], ps.m_z, scale);
}

// one chunk of the draw's totals at a drafted position (the eta > 0 one-pass kernel's third sweep, or the totals
// kernel): the residual weights and p's, their sums from 0 and last tokens of positive weight, as chunk_weights
// computes them; the hot path is an unmasked chunk's (p_hat = p hat_scale)
extern "C" __global__ void chunk_residual(const uint4* z, const float4* q, PositionStats ps, float scale, float eta,
                                          float2* sums, int2* lasts) {
  const int ch = threadIdx.x;
  const float4 qa = q[2 * ch], qb = q[2 * ch + 1];
  const float qq[kChunk] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
  float x[kChunk];
  widen_bf16(z[ch], x);
  float s = 0.0f, sp = 0.0f;
  int last = -1, last_p = -1;
#pragma unroll
  for (int e = 0; e < kChunk; ++e) {
    float wp = 0.0f;
    const float w = draw_weights(kWeightResidual, x[e], qq[e], ps, scale, eta, &wp);
    if (w > 0.0f) last = ch * kChunk + e;
    if (wp > 0.0f) last_p = ch * kChunk + e;
    s = f_add(s, w);
    sp = f_add(sp, wp);
  }
  sums[ch] = make_float2(s, sp);
  lasts[ch] = make_int2(last, last_p);
}
