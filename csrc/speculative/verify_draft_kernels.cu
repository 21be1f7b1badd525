// verify_draft CUDA kernel: chain speculative verification, a cluster of C CTAs per batch row.
//
// The vocabulary is cut into kSlices canonical slices; CTA rank r of a row's cluster owns slices
// r, r + C, ... (C = 1, 2, 4 or 8, picked by the launcher from the batch and the SM count, so that
// B = 64 fills an H100's 132 SMs; C = 1 without thread-block clusters, before sm_90). Per drafted
// position j (in order, stopping at the first rejection) every CTA sweeps its slices once for p
// (online softmax of z / T by chunks, argmax, max q) and, when eta > 0, once more for p_hat; each
// slice is reduced by its CTA, the slice results are exchanged through distributed shared memory and
// every CTA folds all kSlices of them in slice order: every CTA of the cluster holds the same
// statistics, takes the same decision, and the result does not depend on C. At the first rejection,
// or for the bonus token, the final token is drawn by inverse CDF: the slices' totals (one sweep),
// exchanged and folded, then per slice block-wide prefix scans from the slice's base that stop at the
// tile holding the crossing; the first slice with a crossing wins.
//
// All arithmetic lives in verify_draft_math.h and is replayed by the CPU twin in the same order
// (see "Summation order" there), so CUDA and CPU emit the same tokens. No global workspace, no host
// synchronisation, no atomics across CTAs: the cluster's exchanges are the only communication.
#include "speculative/verify_draft_kernels.cuh"
#include "speculative/verify_draft_math.h"

#include <cooperative_groups.h>

namespace ragattn {
namespace speculative {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// One slice's result, published to the cluster: a softmax state, a float (max q / the slice total)
// and an int (the slice's last positive token / its crossing).
struct SliceResult {
  SoftmaxState st;
  float f;
  int i;
};

struct Shared {
  SoftmaxState soft[kWarps];
  float f[kWarps];
  float warp_excl[kWarps];
  int i[kWarps];
  float tile_total;
  int found;
  SliceResult slices[2][kSlices];  // double-buffered: exchange k writes [k % 2] (see Cluster)
};

// The CTAs of one batch row. Exchange protocol: each CTA writes the results of its own slices into
// slices[buf], sync(), then every thread reads all kSlices results (slice s from CTA s % size) and
// the next exchange uses the other buffer; a CTA writes a buffer again only two exchanges later,
// after every CTA has passed the sync that follows its reads of it. Without clusters (sm_80) size is 1.
struct Cluster {
  int size, rank, buf;

  __device__ static Cluster mine() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
    return Cluster{static_cast<int>(cl.num_blocks()), static_cast<int>(cl.block_rank()), 0};
#else
    return Cluster{1, 0, 0};
#endif
  }
  __device__ void sync() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size > 1) {
      cooperative_groups::this_cluster().sync();
      return;
    }
#endif
    __syncthreads();
  }
  // Slice s's result of the current exchange (from the CTA that owns it).
  __device__ SliceResult get(Shared& sh, int s) const {
    SliceResult* p = &sh.slices[buf][s];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size > 1) p = cooperative_groups::this_cluster().map_shared_rank(p, s % size);
#endif
    return *p;
  }
  __device__ void put(Shared& sh, int s, const SliceResult& r) const {
    if (threadIdx.x == 0) sh.slices[buf][s] = r;
  }
  __device__ void next() { buf ^= 1; }
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

// Calls f(v0, z, q) for this thread's chunks of slice [begin, end) in order (t, t + kThreads, ...;
// logits -inf and probs 0 past the end), loading two chunks ahead of the arithmetic to keep more
// bytes in flight.
template <int KIND, bool WITH_Q, bool ONEHOT, class F>
__device__ __forceinline__ void sweep(const void* zrow, const float* qrow, int x, int begin, int end, bool vec, F&& f) {
  const int nchunks = (end - begin + kChunk - 1) / kChunk;
  int c = threadIdx.x;
  float z0[kChunk], q0[kChunk], z1[kChunk], q1[kChunk];
  for (; c + kThreads < nchunks; c += 2 * kThreads) {
    const int v0 = begin + c * kChunk, v1 = begin + (c + kThreads) * kChunk;
    load_logits<KIND>(zrow, v0, kChunk, vec, z0);
    load_logits<KIND>(zrow, v1, min(kChunk, end - v1), vec, z1);
    if (WITH_Q) {
      load_probs<ONEHOT>(qrow, x, v0, kChunk, vec, q0);
      load_probs<ONEHOT>(qrow, x, v1, min(kChunk, end - v1), vec, q1);
    }
    f(v0, z0, q0);
    f(v1, z1, q1);
  }
  if (c < nchunks) {
    const int v0 = begin + c * kChunk, cnt = min(kChunk, end - v0);
    load_logits<KIND>(zrow, v0, cnt, vec, z0);
    if (WITH_Q) load_probs<ONEHOT>(qrow, x, v0, cnt, vec, q0);
    f(v0, z0, q0);
  }
}

// The statistics of p (and p_hat when eta > 0 and q is given) at one position, the same in every
// thread of every CTA of the cluster. has_q: a drafted position (qrow, or one-hot on x when qrow is
// nullptr), not the bonus position.
template <int KIND, bool ONEHOT>
__device__ __forceinline__ PositionStats position_stats(const void* zrow, const float* qrow, bool has_q, int x, int vocab,
                                        float inv_t, float eta, float alpha, Cluster& cl, Shared& sh) {
  const bool with_q = eta > 0.0f && has_q;
  const bool vec = aligned16(zrow) && (!with_q || qrow == nullptr || aligned16(qrow));
  for (int s = cl.rank; s < kSlices; s += cl.size) {
    const int begin = slice_begin(s, vocab), end = slice_end(s, vocab);
    SoftmaxState st = softmax_identity();
    float qm = -INFINITY;
    if (with_q) {
      sweep<KIND, true, ONEHOT>(zrow, qrow, x, begin, end, vec,
                                [&](int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
                                  softmax_update_chunk(st, z, v0, inv_t);
#pragma unroll
                                  for (int e = 0; e < kChunk; ++e) qm = f_max(qm, q[e]);
                                });
    } else {
      sweep<KIND, false, ONEHOT>(zrow, qrow, x, begin, end, vec,
                                 [&](int v0, const float(&z)[kChunk], const float(&)[kChunk]) {
                                   softmax_update_chunk(st, z, v0, inv_t);
                                 });
    }
    const SoftmaxState ss = block_reduce_softmax(st, inv_t, sh);
    cl.put(sh, s, SliceResult{ss, with_q ? block_max(qm, sh) : -INFINITY, 0});
  }
  cl.sync();
  SoftmaxState sz = softmax_identity();
  float qmax = -INFINITY;
  for (int s = 0; s < kSlices; ++s) {
    const SliceResult r = cl.get(sh, s);
    sz = softmax_merge(sz, r.st, inv_t);
    qmax = f_max(qmax, r.f);
  }
  cl.next();
  PositionStats ps = target_stats(sz);
  if (!with_q) return ps;
  ps.q_thresh = f_mul(alpha, qmax);
  for (int s = cl.rank; s < kSlices; s += cl.size) {
    SoftmaxState st = softmax_identity();
    sweep<KIND, true, ONEHOT>(zrow, qrow, x, slice_begin(s, vocab), slice_end(s, vocab), vec,
                              [&](int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
                                float a[kChunk];
#pragma unroll
                                for (int e = 0; e < kChunk; ++e)
                                  a[e] = modified_logit(scaled_logit(z[e], ps.m_z, inv_t), q[e], eta, ps.q_thresh,
                                                        ps.inv_sp);
                                softmax_update_chunk(st, a, v0, 1.0f);
                              });
    cl.put(sh, s, SliceResult{block_reduce_softmax(st, 1.0f, sh), 0.0f, 0});
  }
  cl.sync();
  SoftmaxState sa = softmax_identity();
  for (int s = 0; s < kSlices; ++s) sa = softmax_merge(sa, cl.get(sh, s).st, 1.0f);
  cl.next();
  ps.m_a = sa.m;
  ps.inv_sa = f_div(1.0f, sa.s);
  ps.argmax_a = sa.idx;
  return ps;
}

// Draw weights of this thread's chunk in `tile` of slice [begin, end) (0 past it) and their sum from 0.
template <int KIND, bool ONEHOT>
__device__ __forceinline__ float chunk_weights(const void* zrow, const float* qrow, int x, int begin, int end, bool vec,
                                               int tile, int mode, const PositionStats& ps, float inv_t, float eta,
                                               float (&w)[kChunk], int* last_pos) {
  const int v0 = begin + (tile * kThreads + static_cast<int>(threadIdx.x)) * kChunk;
  const int cnt = max(0, min(kChunk, end - v0));
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

__device__ __forceinline__ int slice_tiles(int s, int vocab) {
  const int nchunks = (slice_end(s, vocab) - slice_begin(s, vocab) + kChunk - 1) / kChunk;
  return (nchunks + kThreads - 1) / kThreads;
}

// Inverse-CDF draw at uniform u from the residual (falling back to p when it is all zero) or p.
template <int KIND, bool ONEHOT>
__device__ __forceinline__ int draw_token(const void* zrow, const float* qrow, int x, int vocab, const PositionStats& ps, int mode,
                          float inv_t, float eta, float u, Cluster& cl, Shared& sh) {
  float w[kChunk];
  for (int attempt = 0; attempt < 2; ++attempt) {
    const bool vec = aligned16(zrow) && (mode != kWeightResidual || qrow == nullptr || aligned16(qrow));
    // 1. the slice totals T_s (each folded from 0 tile by tile) and last positive tokens
    for (int s = cl.rank; s < kSlices; s += cl.size) {
      const int begin = slice_begin(s, vocab), end = slice_end(s, vocab);
      int last_pos = -1;
      float total = 0.0f;
      for (int tile = 0; tile < slice_tiles(s, vocab); ++tile) {
        const float cs = chunk_weights<KIND, ONEHOT>(zrow, qrow, x, begin, end, vec, tile, mode, ps, inv_t, eta, w,
                                                     &last_pos);
        float base;
        total = f_add(total, block_scan(cs, total, &base, sh));
      }
      cl.put(sh, s, SliceResult{softmax_identity(), total, block_max_int(last_pos, sh)});
    }
    cl.sync();
    float total = 0.0f;
    int last_pos = -1;
    for (int s = 0; s < kSlices; ++s) {
      const SliceResult r = cl.get(sh, s);
      total = f_add(total, r.f);
      last_pos = max(last_pos, r.i);
    }
    if (!(total > 0.0f)) {
      cl.next();
      if (mode == kWeightResidual) {
        mode = kWeightTarget;  // all-zero residual: draw from p
        continue;
      }
      return ps.argmax_z;  // degenerate row (all logits -inf)
    }
    // 2. per own slice, prefix scans from the slice's base T_0 + ... + T_{s-1} up to the first crossing
    const float target = f_mul(u, total);
    int cand = kNoToken;
    for (int s = cl.rank; s < kSlices && cand == kNoToken; s += cl.size) {
      const int begin = slice_begin(s, vocab), end = slice_end(s, vocab);
      float tile_base = 0.0f;
      for (int k = 0; k < s; ++k) tile_base = f_add(tile_base, cl.get(sh, k).f);
      int ignored = -1;
      for (int tile = 0; tile < slice_tiles(s, vocab); ++tile) {
        if (threadIdx.x == 0) sh.found = kNoToken;  // published by block_scan's barrier
        const float cs = chunk_weights<KIND, ONEHOT>(zrow, qrow, x, begin, end, vec, tile, mode, ps, inv_t, eta, w,
                                                     &ignored);
        float run;
        const float tile_total = block_scan(cs, tile_base, &run, sh);
        int c = kNoToken;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
          run = f_add(run, w[e]);
          if (c == kNoToken && w[e] > 0.0f && run > target)
            c = begin + (tile * kThreads + static_cast<int>(threadIdx.x)) * kChunk + e;
        }
        if (c != kNoToken) atomicMin(&sh.found, c);
        __syncthreads();
        const int found = sh.found;
        __syncthreads();
        if (found != kNoToken) {
          cand = found;
          break;
        }
        tile_base = f_add(tile_base, tile_total);
      }
    }
    cl.next();  // (the totals' buffer stays untouched until every CTA passed the next sync)
    // 3. the first slice with a crossing: the smallest candidate of the cluster
    for (int s = cl.rank; s < kSlices; s += cl.size) cl.put(sh, s, SliceResult{softmax_identity(), 0.0f, cand});
    cl.sync();
    int found = kNoToken;
    for (int s = 0; s < kSlices; ++s) found = min(found, cl.get(sh, s).i);
    cl.next();
    return found != kNoToken ? found : last_pos;  // none: rounding left u * total at or past the last prefix
  }
  return ps.argmax_z;
}

template <int KIND, bool ONEHOT>
__global__ void __launch_bounds__(kThreads, 2) verify_draft_kernel(const VerifyDraftArgs a) {
  __shared__ Shared sh;
  Cluster cl = Cluster::mine();
  const int64_t b = blockIdx.x / cl.size;
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
  const bool writer = cl.rank == 0;  // one CTA of the cluster writes the row's outputs
  int64_t n = nd;
  int token = -1;
  for (int64_t j = 0; j < nd; ++j) {
    const void* zrow = zbase + static_cast<size_t>((row_off + j) * vocab) * esize;
    const float* qrow = a.draft_probs != nullptr ? a.draft_probs + (tok_off + j) * vocab : nullptr;
    const int64_t x = a.draft_tokens[tok_off + j];
    const bool in_range = x >= 0 && x < vocab;
    const int xi = in_range ? static_cast<int>(x) : -1;  // (one-hot q of an out-of-range draft: all zero)
    const PositionStats ps = position_stats<KIND, ONEHOT>(zrow, qrow, true, xi, vocab, a.inv_temperature, a.eta,
                                                          a.alpha, cl, sh);
    bool ok;
    if (a.greedy) {
      const int best = a.eta > 0.0f ? ps.argmax_a : ps.argmax_z;
      ok = x == best;
      if (!ok) token = best;
    } else {
      ok = false;
      if (in_range) {  // every thread of every CTA reads the same two values and decides alike
        float p, p_hat;
        const float q_x = ONEHOT ? 1.0f : qrow[x];
        token_probs(load_logit(zrow, KIND, x), q_x, ps, a.inv_temperature, a.eta, &p, &p_hat);
        ok = accept_draft(a.uniforms[row_off + j], q_x, p_hat);
      }
      if (!ok) {
        token = draw_token<KIND, ONEHOT>(zrow, qrow, xi, vocab, ps, kWeightResidual, a.inv_temperature, a.eta, u_last,
                                         cl, sh);
      }
    }
    if (!ok) {
      n = j;
      break;
    }
    if (writer && threadIdx.x == 0) a.out_tokens[row_off + j] = x;
  }
  if (n == nd) {  // every draft accepted: bonus token from p at position num_draft
    const void* zrow = zbase + static_cast<size_t>((row_off + nd) * vocab) * esize;
    const PositionStats ps =
        position_stats<KIND, ONEHOT>(zrow, nullptr, false, -1, vocab, a.inv_temperature, 0.0f, a.alpha, cl, sh);
    token = a.greedy ? ps.argmax_z
                     : draw_token<KIND, ONEHOT>(zrow, nullptr, -1, vocab, ps, kWeightTarget, a.inv_temperature, a.eta,
                                                u_last, cl, sh);
  }
  if (token < 0 || token >= vocab) token = 0;  // only for positions of all -inf / NaN logits
  if (writer) {
    for (int64_t j = n + static_cast<int>(threadIdx.x); j < out_len; j += kThreads)
      a.out_tokens[row_off + j] = j == n ? token : -1;
    if (threadIdx.x == 0) a.num_accepted[b] = static_cast<int32_t>(n);
  }
  cl.sync();  // no CTA leaves while another may still read its shared memory
}

template <int KIND, bool ONEHOT>
cudaError_t launch(const VerifyDraftArgs& args, cudaStream_t stream) {
  // Clusters need the sm_90 code of the kernel: a build without it (e.g. sm_80 code JIT-compiled on an
  // H100) runs one CTA per row. (A host query of the loaded binary, no stream synchronisation.)
  cudaFuncAttributes fa;
  const cudaError_t err = cudaFuncGetAttributes(&fa, verify_draft_kernel<KIND, ONEHOT>);
  if (err != cudaSuccess) return err;
  VerifyDraftArgs a = args;
  if (fa.ptxVersion < 90) a.cluster_size = 1;  // (the virtual architecture the code was compiled for)
  const int C = a.cluster_size;
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(args.batch) * C)), block(kThreads);
  if (C == 1) {
    verify_draft_kernel<KIND, ONEHOT><<<grid, block, 0, stream>>>(a);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(C);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, verify_draft_kernel<KIND, ONEHOT>, a);
}

}  // namespace

cudaError_t launch_verify_draft(const VerifyDraftArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  const int C = args.cluster_size;
  if (C != 1 && C != 2 && C != 4 && C != 8) return cudaErrorInvalidValue;
  const bool onehot = args.draft_probs == nullptr;
  switch (args.logits_kind) {
    case kLogitsF32:
      return onehot ? launch<kLogitsF32, true>(args, stream) : launch<kLogitsF32, false>(args, stream);
    case kLogitsF16:
      return onehot ? launch<kLogitsF16, true>(args, stream) : launch<kLogitsF16, false>(args, stream);
    default:
      return onehot ? launch<kLogitsBF16, true>(args, stream) : launch<kLogitsBF16, false>(args, stream);
  }
}

}  // namespace speculative
}  // namespace ragattn
