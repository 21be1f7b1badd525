// verify_draft CUDA kernel: chain speculative verification, one block per batch row.
//
// Per drafted position j (in order, stopping at the first rejection) the block sweeps the
// vocabulary once for p (online softmax of z / T, argmax, max q) and, when eta > 0, once more
// for p_hat (online softmax of the modified logits). Thread 0's view of the draft token then
// decides acceptance (every thread computes the same decision from the same block-wide
// statistics, so the block never diverges). At the first rejection, or for the bonus token, the
// final token is drawn by inverse CDF: one sweep for the total in scan order, one sweep of
// block-wide prefix scans that stops at the tile holding the crossing.
//
// All arithmetic lives in verify_draft_math.h and is replayed by the CPU twin in the same
// order (see "Summation order" there), so CUDA and CPU emit the same tokens.
#include "speculative/verify_draft_kernels.cuh"
#include "speculative/verify_draft_math.h"

namespace ragattn {
namespace speculative {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

struct Shared {
  SoftmaxState soft[kWarps];
  float f[kWarps];
  float warp_excl[kWarps];
  int i[kWarps];
  float tile_total;
  int found;
};

__device__ __forceinline__ int lane_id() { return threadIdx.x & (kWarpSize - 1); }
__device__ __forceinline__ int warp_id() { return threadIdx.x / kWarpSize; }

__device__ __forceinline__ float shfl_xor(float x, int off) { return __shfl_xor_sync(kFullMask, x, off); }
__device__ __forceinline__ int shfl_xor(int x, int off) { return __shfl_xor_sync(kFullMask, x, off); }
__device__ __forceinline__ SoftmaxState shfl_xor(const SoftmaxState& s, int off) {
  return SoftmaxState{shfl_xor(s.m, off), shfl_xor(s.s, off), shfl_xor(s.idx, off)};
}

// Butterfly in every warp, then in warp 0 over the warp results (`slots`: kWarps entries of
// shared memory); every thread gets lane 0's result of the last butterfly (the value the CPU
// twin's emulation returns).
template <typename T, typename Op>
__device__ T block_allreduce(T x, T identity, Op op, T* slots) {
  for (int off = kWarpSize / 2; off > 0; off /= 2) x = op(x, shfl_xor(x, off));
  if (lane_id() == 0) slots[warp_id()] = x;
  __syncthreads();
  if (warp_id() == 0) {
    x = lane_id() < kWarps ? slots[lane_id()] : identity;
    for (int off = kWarpSize / 2; off > 0; off /= 2) x = op(x, shfl_xor(x, off));
    if (lane_id() == 0) slots[0] = x;
  }
  __syncthreads();
  const T r = slots[0];
  __syncthreads();
  return r;
}

__device__ SoftmaxState block_reduce_softmax(SoftmaxState s, float inv_t, Shared& sh) {
  return block_allreduce(
      s, softmax_identity(), [inv_t](const SoftmaxState& a, const SoftmaxState& b) { return softmax_merge(a, b, inv_t); },
      sh.soft);
}

__device__ float block_max(float x, Shared& sh) {
  return block_allreduce(x, -INFINITY, [](float a, float b) { return f_max(a, b); }, sh.f);
}

__device__ int block_max_int(int x, Shared& sh) {
  return block_allreduce(x, -1, [](int a, int b) { return max(a, b); }, sh.i);
}

__device__ __forceinline__ float warp_inclusive_scan(float x) {
  for (int d = 1; d < kWarpSize; d *= 2) {
    const float y = __shfl_up_sync(kFullMask, x, d);
    if (lane_id() >= d) x = f_add(y, x);
  }
  return x;
}

// Block-wide scan of one chunk sum per thread: this thread's chunk base (given the tile base)
// and the tile total, in the order the CPU twin replays.
__device__ float block_scan(float chunk_sum, float tile_base, float* base, Shared& sh) {
  const float incl = warp_inclusive_scan(chunk_sum);
  float lane_excl = __shfl_up_sync(kFullMask, incl, 1);
  if (lane_id() == 0) lane_excl = 0.0f;
  if (lane_id() == kWarpSize - 1) sh.f[warp_id()] = incl;
  __syncthreads();
  if (warp_id() == 0) {
    const float t = warp_inclusive_scan(lane_id() < kWarps ? sh.f[lane_id()] : 0.0f);
    float excl = __shfl_up_sync(kFullMask, t, 1);
    if (lane_id() == 0) excl = 0.0f;
    if (lane_id() < kWarps) sh.warp_excl[lane_id()] = excl;
    if (lane_id() == kWarpSize - 1) sh.tile_total = t;
  }
  __syncthreads();
  *base = chunk_base(tile_base, sh.warp_excl[warp_id()], lane_excl);
  const float total = sh.tile_total;
  __syncthreads();
  return total;
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Tokens [v0, v0 + cnt) of a logits row as fp32 (16-byte loads when `vec` and the chunk is full).
template <int KIND>
__device__ __forceinline__ void load_logits(const void* row, int v0, int cnt, bool vec, float (&z)[kChunk]) {
  if (vec && cnt == kChunk) {
    if (KIND == kLogitsF32) {
      const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(row) + v0);
      const float4 a = p[0], b = p[1];
      z[0] = a.x, z[1] = a.y, z[2] = a.z, z[3] = a.w, z[4] = b.x, z[5] = b.y, z[6] = b.z, z[7] = b.w;
    } else {
      const uint4 r = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(row) + v0);
      const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint16_t lo = static_cast<uint16_t>(w[i] & 0xffffu), hi = static_cast<uint16_t>(w[i] >> 16);
        z[2 * i] = KIND == kLogitsBF16 ? bf16_to_float(lo) : fp16_to_float(lo);
        z[2 * i + 1] = KIND == kLogitsBF16 ? bf16_to_float(hi) : fp16_to_float(hi);
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) z[e] = e < cnt ? load_logit(row, KIND, v0 + e) : -INFINITY;
  }
}

// Draft probabilities of tokens [v0, v0 + cnt) (ONEHOT: one-hot on the draft token x, row unused).
// A compile-time switch, so that the kernels with draft_probs keep their own register allocation.
template <bool ONEHOT>
__device__ __forceinline__ void load_probs(const float* row, int x, int v0, int cnt, bool vec, float (&q)[kChunk]) {
  if (ONEHOT) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) q[e] = draft_prob(nullptr, x, v0 + e);
  } else if (vec && cnt == kChunk) {
    const float4* p = reinterpret_cast<const float4*>(row + v0);
    const float4 a = p[0], b = p[1];
    q[0] = a.x, q[1] = a.y, q[2] = a.z, q[3] = a.w, q[4] = b.x, q[5] = b.y, q[6] = b.z, q[7] = b.w;
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) q[e] = e < cnt ? row[v0 + e] : 0.0f;
  }
}

// Calls f(v0, cnt, z, q) for this thread's chunks in order (t, t + kThreads, ...), loading two
// chunks ahead of the arithmetic to keep more bytes in flight.
template <int KIND, bool WITH_Q, bool ONEHOT, class F>
__device__ __forceinline__ void sweep(const void* zrow, const float* qrow, int x, int vocab, bool vec, F&& f) {
  const int nchunks = (vocab + kChunk - 1) / kChunk;
  int c = threadIdx.x;
  float z0[kChunk], q0[kChunk], z1[kChunk], q1[kChunk];
  for (; c + kThreads < nchunks; c += 2 * kThreads) {
    const int v0 = c * kChunk, v1 = (c + kThreads) * kChunk;
    load_logits<KIND>(zrow, v0, kChunk, vec, z0);
    load_logits<KIND>(zrow, v1, min(kChunk, vocab - v1), vec, z1);
    if (WITH_Q) {
      load_probs<ONEHOT>(qrow, x, v0, kChunk, vec, q0);
      load_probs<ONEHOT>(qrow, x, v1, min(kChunk, vocab - v1), vec, q1);
    }
    f(v0, kChunk, z0, q0);
    f(v1, min(kChunk, vocab - v1), z1, q1);
  }
  if (c < nchunks) {
    const int v0 = c * kChunk, cnt = min(kChunk, vocab - v0);
    load_logits<KIND>(zrow, v0, cnt, vec, z0);
    if (WITH_Q) load_probs<ONEHOT>(qrow, x, v0, cnt, vec, q0);
    f(v0, cnt, z0, q0);
  }
}

// The block-wide statistics of p (and p_hat when eta > 0 and q is given) at one position.
// has_q: a drafted position (qrow, or one-hot on x when qrow is nullptr), not the bonus position.
template <int KIND, bool ONEHOT>
__device__ PositionStats position_stats(const void* zrow, const float* qrow, bool has_q, int x, int vocab,
                                        float inv_t, float eta, float alpha, Shared& sh) {
  const bool with_q = eta > 0.0f && has_q;
  const bool vec = aligned16(zrow) && (!with_q || qrow == nullptr || aligned16(qrow));
  SoftmaxState s = softmax_identity();
  float qm = -INFINITY;
  if (with_q) {
    sweep<KIND, true, ONEHOT>(zrow, qrow, x, vocab, vec, [&](int v0, int cnt, const float(&z)[kChunk], const float(&q)[kChunk]) {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        if (e < cnt) {
          softmax_update(s, z[e], v0 + e, inv_t);
          qm = f_max(qm, q[e]);
        }
      }
    });
  } else {
    sweep<KIND, false, ONEHOT>(zrow, qrow, x, vocab, vec, [&](int v0, int cnt, const float(&z)[kChunk], const float(&)[kChunk]) {
#pragma unroll
      for (int e = 0; e < kChunk; ++e)
        if (e < cnt) softmax_update(s, z[e], v0 + e, inv_t);
    });
  }
  const SoftmaxState sz = block_reduce_softmax(s, inv_t, sh);
  PositionStats ps = target_stats(sz);
  if (!with_q) return ps;
  ps.q_thresh = f_mul(alpha, block_max(qm, sh));
  SoftmaxState sa = softmax_identity();
  sweep<KIND, true, ONEHOT>(zrow, qrow, x, vocab, vec, [&](int v0, int cnt, const float(&z)[kChunk], const float(&q)[kChunk]) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      if (e < cnt) {
        const float y = scaled_logit(z[e], ps.m_z, inv_t);
        softmax_update(sa, modified_logit(y, q[e], eta, ps.q_thresh, ps.inv_sp), v0 + e, 1.0f);
      }
    }
  });
  const SoftmaxState ra = block_reduce_softmax(sa, 1.0f, sh);
  ps.m_a = ra.m;
  ps.inv_sa = f_div(1.0f, ra.s);
  ps.argmax_a = ra.idx;
  return ps;
}

// Draw weights of this thread's chunk in `tile` (0 past the vocabulary) and their sum from 0.
template <int KIND, bool ONEHOT>
__device__ __forceinline__ float chunk_weights(const void* zrow, const float* qrow, int x, int vocab, bool vec, int tile,
                                               int mode, const PositionStats& ps, float inv_t, float eta,
                                               float (&w)[kChunk], int* last_pos) {
  const int v0 = (tile * kThreads + static_cast<int>(threadIdx.x)) * kChunk;
  const int cnt = max(0, min(kChunk, vocab - v0));
  float z[kChunk], q[kChunk];
  if (cnt > 0) {
    load_logits<KIND>(zrow, v0, cnt, vec, z);
    if (mode == kWeightResidual) {
      load_probs<ONEHOT>(qrow, x, v0, cnt, vec, q);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) q[e] = 0.0f;
    }
  }
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < kChunk; ++e) {
    w[e] = e < cnt ? draw_weight(mode, z[e], q[e], ps, inv_t, eta) : 0.0f;
    if (w[e] > 0.0f) *last_pos = v0 + e;
    s = f_add(s, w[e]);
  }
  return s;
}

// Inverse-CDF draw at uniform u from the residual (falling back to p when it is all zero) or p.
template <int KIND, bool ONEHOT>
__device__ int draw_token(const void* zrow, const float* qrow, int x, int vocab, const PositionStats& ps, int mode,
                          float inv_t, float eta, float u, Shared& sh) {
  const int nchunks = (vocab + kChunk - 1) / kChunk;
  const int ntiles = (nchunks + kThreads - 1) / kThreads;
  float w[kChunk];
  for (int attempt = 0; attempt < 2; ++attempt) {
    const bool vec = aligned16(zrow) && (mode != kWeightResidual || qrow == nullptr || aligned16(qrow));
    int last_pos = -1;
    float total = 0.0f;
    for (int tile = 0; tile < ntiles; ++tile) {
      const float s = chunk_weights<KIND, ONEHOT>(zrow, qrow, x, vocab, vec, tile, mode, ps, inv_t, eta, w, &last_pos);
      float base;
      total = f_add(total, block_scan(s, total, &base, sh));
    }
    last_pos = block_max_int(last_pos, sh);
    if (!(total > 0.0f)) {
      if (mode == kWeightResidual) {
        mode = kWeightTarget;  // all-zero residual: draw from p
        continue;
      }
      return ps.argmax_z;  // degenerate row (all logits -inf)
    }
    const float target = f_mul(u, total);
    float tile_base = 0.0f;
    int ignored = -1;
    for (int tile = 0; tile < ntiles; ++tile) {
      if (threadIdx.x == 0) sh.found = kNoToken;  // published by block_scan's barrier
      const float s = chunk_weights<KIND, ONEHOT>(zrow, qrow, x, vocab, vec, tile, mode, ps, inv_t, eta, w, &ignored);
      float run;
      const float tile_total = block_scan(s, tile_base, &run, sh);
      int cand = kNoToken;
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        run = f_add(run, w[e]);
        if (cand == kNoToken && w[e] > 0.0f && run > target) cand = (tile * kThreads + threadIdx.x) * kChunk + e;
      }
      if (cand != kNoToken) atomicMin(&sh.found, cand);
      __syncthreads();
      const int found = sh.found;
      __syncthreads();
      if (found != kNoToken) return found;
      tile_base = f_add(tile_base, tile_total);
    }
    return last_pos;  // rounding left u * total at or past the last prefix
  }
  return ps.argmax_z;
}

template <int KIND, bool ONEHOT>
__global__ void __launch_bounds__(kThreads) verify_draft_kernel(const VerifyDraftArgs a) {
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  const size_t esize = KIND == kLogitsF32 ? 4 : 2;
  const int vocab = a.vocab;
  // Row b's drafts from tok_off, its logits / uniforms / outputs from row_off (padded or flat layout).
  int64_t tok_off, row_off, nd, out_len;
  if (a.cu_num_draft != nullptr) {
    const int64_t c0 = a.cu_is_int64 ? static_cast<const int64_t*>(a.cu_num_draft)[b]
                                     : static_cast<const int32_t*>(a.cu_num_draft)[b];
    const int64_t c1 = a.cu_is_int64 ? static_cast<const int64_t*>(a.cu_num_draft)[b + 1]
                                     : static_cast<const int32_t*>(a.cu_num_draft)[b + 1];
    tok_off = c0;
    row_off = c0 + b;
    nd = c1 > c0 ? c1 - c0 : 0;
    out_len = nd + 1;
  } else {
    const int g = a.g;
    tok_off = b * g;
    row_off = b * (g + 1);
    nd = g;
    if (a.num_draft != nullptr) {
      const int64_t v = a.num_draft_is_int64 ? static_cast<const int64_t*>(a.num_draft)[b]
                                             : static_cast<const int32_t*>(a.num_draft)[b];
      nd = v < 0 ? 0 : (v > g ? g : v);
    }
    out_len = g + 1;
  }
  // the final draw's uniform: column g (padded) or the request's last row (flat)
  const float u_last = a.uniforms[row_off + (a.cu_num_draft != nullptr ? nd : out_len - 1)];
  const char* zbase = static_cast<const char*>(a.target_logits);
  int64_t n = nd;
  int token = -1;
  for (int64_t j = 0; j < nd; ++j) {
    const void* zrow = zbase + static_cast<size_t>((row_off + j) * vocab) * esize;
    const float* qrow = a.draft_probs != nullptr ? a.draft_probs + (tok_off + j) * vocab : nullptr;
    const int64_t x = a.draft_tokens[tok_off + j];
    const bool in_range = x >= 0 && x < vocab;
    const int xi = in_range ? static_cast<int>(x) : -1;  // (one-hot q of an out-of-range draft: all zero)
    const PositionStats ps = position_stats<KIND, ONEHOT>(zrow, qrow, true, xi, vocab, a.inv_temperature, a.eta,
                                                          a.alpha, sh);
    bool ok;
    if (a.greedy) {
      const int best = a.eta > 0.0f ? ps.argmax_a : ps.argmax_z;
      ok = x == best;
      if (!ok) token = best;
    } else {
      ok = false;
      if (in_range) {  // every thread reads the same two values (a broadcast) and decides alike
        float p, p_hat;
        const float q_x = ONEHOT ? 1.0f : qrow[x];
        token_probs(load_logit(zrow, KIND, x), q_x, ps, a.inv_temperature, a.eta, &p, &p_hat);
        ok = accept_draft(a.uniforms[row_off + j], q_x, p_hat);
      }
      if (!ok) {
        token = draw_token<KIND, ONEHOT>(zrow, qrow, xi, vocab, ps, kWeightResidual, a.inv_temperature, a.eta, u_last,
                                         sh);
      }
    }
    if (!ok) {
      n = j;
      break;
    }
    if (threadIdx.x == 0) a.out_tokens[row_off + j] = x;
  }
  if (n == nd) {  // every draft accepted: bonus token from p at position num_draft
    const void* zrow = zbase + static_cast<size_t>((row_off + nd) * vocab) * esize;
    const PositionStats ps =
        position_stats<KIND, ONEHOT>(zrow, nullptr, false, -1, vocab, a.inv_temperature, 0.0f, a.alpha, sh);
    token = a.greedy ? ps.argmax_z
                     : draw_token<KIND, ONEHOT>(zrow, nullptr, -1, vocab, ps, kWeightTarget, a.inv_temperature, a.eta,
                                                u_last, sh);
  }
  if (token < 0 || token >= vocab) token = 0;  // only for positions of all -inf / NaN logits
  for (int64_t j = n + static_cast<int>(threadIdx.x); j < out_len; j += kThreads)
    a.out_tokens[row_off + j] = j == n ? token : -1;
  if (threadIdx.x == 0) a.num_accepted[b] = static_cast<int32_t>(n);
}

}  // namespace

cudaError_t launch_verify_draft(const VerifyDraftArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(args.batch)), block(kThreads);
  const bool onehot = args.draft_probs == nullptr;
#define RAGATTN_VD(KIND) \
  (onehot ? verify_draft_kernel<KIND, true><<<grid, block, 0, stream>>>(args) \
          : verify_draft_kernel<KIND, false><<<grid, block, 0, stream>>>(args))
  switch (args.logits_kind) {
    case kLogitsF32:
      RAGATTN_VD(kLogitsF32);
      break;
    case kLogitsF16:
      RAGATTN_VD(kLogitsF16);
      break;
    default:
      RAGATTN_VD(kLogitsBF16);
      break;
  }
#undef RAGATTN_VD
  return cudaGetLastError();
}

}  // namespace speculative
}  // namespace ragattn
