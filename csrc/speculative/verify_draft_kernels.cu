// verify_draft CUDA kernels: chain speculative verification over every drafted position at once.
//
// The vocabulary is cut into num_slices(V) slices of kSliceLen tokens (verify_draft_math.h). Phases:
//   1. verify_draft_stats_kernel: one CTA per (logits row, slice), every position of every row at
//      once: the slice's online softmax of z / T by chunks, its argmax and (eta > 0) its max q into a
//      global workspace. With eta > 0, verify_draft_fold_kernel folds each position's slices into p's
//      statistics and verify_draft_modified_stats_kernel does the same per (row, slice) for the
//      modified logits (p_hat); on sm_90, verify_draft_rapid_stats_kernel does all three in one read
//      of HBM (a cluster per position keeping its slices in shared memory between the two sweeps).
//   2. verify_draft_walk_kernel: one warp per batch row; lane j folds position j's slices in slice
//      order, decides its draft on scalars (two loads: z[x], q[x]), a ballot finds the first rejection;
//      it writes the accepted drafts, the -1 tail, num_accepted and the row's DrawPlan (greedy: the
//      token too, and it is the last launch).
//   3. The final token at the one position that needs it, by inverse CDF: verify_draft_draw_totals_kernel
//      (per (batch row, slice) the slice totals in scan order; the sm_90 one-pass kernel has computed them
//      already, at every position from its shared memory), verify_draft_draw_find_kernel (per batch row
//      the crossing slice, the first whose base + total passes u * total, and its prefix scans from that
//      base to the first crossing: the only slice read). The phase-1 grid is rows x slices CTAs (B 64,
//      g 10, V 128256: 704 x 32 = 22528, 43 waves of 4 CTAs per SM on 132 SMs): every SM streams logits,
//      where a per-row chain walk left the sweep of each position latency-bound. It reads the logits of
//      positions after a rejection too.
//
// All arithmetic lives in verify_draft_math.h and is replayed by the CPU twin in the same order
// (see "Summation order" there): fixed slicing, every fold in slice order on one thread, no atomics
// across CTAs, so CUDA and CPU emit the same tokens given the uniforms, on any GPU.
#include "speculative/verify_draft_kernels.cuh"
#include "speculative/verify_draft_math.h"

#include <cooperative_groups.h>
#include <cuda_pipeline.h>

namespace ragattn {
namespace speculative {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWalkWarps = kWarps;  // batch rows per CTA of the walk kernel (kThreads threads, like the others)

struct Shared {
  SoftmaxState soft[kWarps];
  float f[kWarps];
  float warp_excl[kWarps];
  float tile_total;
  int found;
  float tot[kSliceTiles][2][kWarps];  // slice_draw_totals: per tile the warps' inclusive scans (weights, p)
  int last[2][kWarps];                // and their last tokens of positive weight
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

__device__ SoftmaxState block_reduce_softmax(SoftmaxState s, float scale, Shared& sh) {
  return block_allreduce(
      s, softmax_identity(),
      [scale](const SoftmaxState& a, const SoftmaxState& b) { return softmax_merge(a, b, scale); }, sh.soft);
}

__device__ float block_max(float x, Shared& sh) {
  return block_allreduce(x, -INFINITY, [](float a, float b) { return f_max(a, b); }, sh.f);
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

// The raw bits of one full chunk of logits: one 16-byte load (two for fp32), kept undecoded so that
// a load can be issued well before its values are needed.
template <int KIND>
struct RawChunk {
  uint4 w[KIND == kLogitsF32 ? 2 : 1];
};

template <int KIND>
__device__ __forceinline__ void issue_chunk(const void* row, int v0, RawChunk<KIND>& raw) {
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const char*>(row) + static_cast<size_t>(v0) *
                                                  (KIND == kLogitsF32 ? 4 : 2));
#pragma unroll
  for (int i = 0; i < (KIND == kLogitsF32 ? 2 : 1); ++i) raw.w[i] = p[i];
}

template <int KIND>
__device__ __forceinline__ void widen_chunk(const RawChunk<KIND>& raw, float (&z)[kChunk]) {
  if (KIND == kLogitsF32) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 r = raw.w[i];
      z[4 * i] = __uint_as_float(r.x), z[4 * i + 1] = __uint_as_float(r.y);
      z[4 * i + 2] = __uint_as_float(r.z), z[4 * i + 3] = __uint_as_float(r.w);
    }
  } else {
    const uint4 r = raw.w[0];
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = static_cast<uint16_t>(w[i] & 0xffffu), hi = static_cast<uint16_t>(w[i] >> 16);
      z[2 * i] = KIND == kLogitsBF16 ? bf16_to_float(lo) : fp16_to_float(lo);
      z[2 * i + 1] = KIND == kLogitsBF16 ? bf16_to_float(hi) : fp16_to_float(hi);
    }
  }
}

// Tokens [v0, v0 + cnt) of a logits row as fp32 (16-byte loads when `vec` and the chunk is full).
template <int KIND>
__device__ __forceinline__ void load_logits(const void* row, int v0, int cnt, bool vec, float (&z)[kChunk]) {
  if (vec && cnt == kChunk) {
    RawChunk<KIND> raw;
    issue_chunk<KIND>(row, v0, raw);
    widen_chunk<KIND>(raw, z);
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


// Where batch row b's data lives: drafts / draft probs from tok_off, logits / uniforms / outputs from
// row_off (padded layout: b * g and b * (g + 1); flat layout: cu[b] and cu[b] + b).
struct RowRef {
  int64_t tok_off, row_off, nd, out_len, u_last;
};

__device__ __forceinline__ int64_t cu_at(const VerifyDraftArgs& a, int64_t i) {
  return a.cu_is_int64 ? static_cast<const int64_t*>(a.cu_num_draft)[i] : static_cast<const int32_t*>(a.cu_num_draft)[i];
}

__device__ RowRef row_ref(const VerifyDraftArgs& a, int64_t b) {
  RowRef r;
  if (a.cu_num_draft != nullptr) {
    const int64_t c0 = cu_at(a, b), c1 = cu_at(a, b + 1);
    r.tok_off = c0;
    r.row_off = c0 + b;
    r.nd = c1 > c0 ? c1 - c0 : 0;
    r.out_len = r.nd + 1;
    r.u_last = r.row_off + r.nd;  // the request's last row
  } else {
    const int g = a.g;
    r.tok_off = b * g;
    r.row_off = b * (g + 1);
    r.nd = g;
    if (a.num_draft != nullptr) {
      const int64_t v = a.num_draft_is_int64 ? static_cast<const int64_t*>(a.num_draft)[b]
                                             : static_cast<const int32_t*>(a.num_draft)[b];
      r.nd = v < 0 ? 0 : (v > g ? g : v);
    }
    r.out_len = g + 1;
    r.u_last = r.row_off + g;  // column g
  }
  return r;
}

// The batch row owning logits row r (flat layout: the last b with cu[b] + b <= r, by bisection).
__device__ int64_t batch_of_row(const VerifyDraftArgs& a, int64_t r) {
  if (a.cu_num_draft == nullptr) return r / (a.g + 1);
  int64_t lo = 0, hi = a.batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu_at(a, mid) + mid <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One position of one batch row, as a phase-1 CTA sees it.
struct Position {
  int64_t row;  // its target-logits row
  int64_t j;    // its index in the chain (j == nd: the bonus position; j > nd: padding, never read)
  int64_t nd;
  int64_t tok;  // its drafts / draft-probs row (j < nd)
};

__device__ Position position_of_row(const VerifyDraftArgs& a, int64_t r) {
  const RowRef rr = row_ref(a, batch_of_row(a, r));
  return Position{r, r - rr.row_off, rr.nd, rr.tok_off + (r - rr.row_off)};
}

__device__ __forceinline__ const void* logits_row(const VerifyDraftArgs& a, int64_t r) {
  const size_t esize = a.logits_kind == kLogitsF32 ? 4 : 2;
  return static_cast<const char*>(a.target_logits) + static_cast<size_t>(r) * static_cast<size_t>(a.vocab) * esize;
}

// The draft token of a drafted position, or -1 when out of range (its one-hot q is then all zero).
__device__ __forceinline__ int draft_index(const VerifyDraftArgs& a, int64_t tok) {
  const int64_t x = a.draft_tokens[tok];
  return x >= 0 && x < a.vocab ? static_cast<int>(x) : -1;
}

// Draw weights of this thread's chunk in `tile` of slice [begin, end) (0 past it), their sum from 0 and
// p's (with_p), and the last tokens of positive weight of each. zrow / qrow start at token `at` (0: a row
// in global memory; a slice's first token: its copy in shared memory).
template <int KIND, bool ONEHOT>
__device__ __forceinline__ float chunk_weights(const void* zrow, const float* qrow, int x, int at, int begin, int end,
                                               bool vec, int tile, int mode, const PositionStats& ps, float scale,
                                               float eta, float (&w)[kChunk], float* sum_p, int* last, int* last_p) {
  const int v0 = begin + (tile * kThreads + static_cast<int>(threadIdx.x)) * kChunk;
  const int cnt = max(0, min(kChunk, end - v0));
  float z[kChunk], q[kChunk];
  if (cnt > 0) {
    load_logits<KIND>(zrow, v0 - at, cnt, vec, z);
    if (mode == kWeightResidual) {
      load_probs<ONEHOT>(qrow, x - at, v0 - at, cnt, vec, q);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) q[e] = 0.0f;
    }
  }
  float s = 0.0f, sp = 0.0f;
#pragma unroll
  for (int e = 0; e < kChunk; ++e) {
    float wp = 0.0f;
    w[e] = e < cnt ? draw_weights(mode, z[e], q[e], ps, scale, eta, &wp) : 0.0f;
    if (w[e] > 0.0f) *last = v0 + e;
    if (wp > 0.0f) *last_p = v0 + e;
    s = f_add(s, w[e]);
    sp = f_add(sp, wp);
  }
  *sum_p = sp;
  return s;
}

// One slice's draw totals (phase 3a), thread 0's: the tile totals of the weights of `mode` (and, after a
// rejection, of p) in block_scan's order (each warp's Kogge-Stone scan of its chunk sums, then warp 0's of the
// warp totals) folded from 0, and the slice's last tokens of positive weight (a max butterfly in each warp,
// then one over the warp results in warp 0). Only the totals are needed, not the prefixes, so every tile's
// scans and both maxima run under one barrier (and one more before `sh` is reused), where a block_scan per
// tile and weight kind and a block-wide max per kind took three each: the same operations, the same bits.
// The rows start at token `at` (chunk_weights).
template <int KIND, bool ONEHOT>
__device__ DrawSlice slice_draw_totals(const void* zrow, const float* qrow, int x, int at, int s, int vocab, bool vec,
                                       int mode, const PositionStats& ps, float scale, float eta, Shared& sh) {
  const int begin = slice_begin(s, vocab), end = slice_end(s, vocab), tiles = slice_tiles(s, vocab);
  const bool with_p = mode == kWeightResidual;
  float w[kChunk];
  int last = -1, last_p = -1;
  for (int tile = 0; tile < tiles; ++tile) {
    float cs_p;
    const float cs = chunk_weights<KIND, ONEHOT>(zrow, qrow, x, at, begin, end, vec, tile, mode, ps, scale, eta, w,
                                                 &cs_p, &last, &last_p);
    const float incl = warp_inclusive_scan(cs), incl_p = with_p ? warp_inclusive_scan(cs_p) : 0.0f;
    if (lane_id() == kWarpSize - 1) {
      sh.tot[tile][0][warp_id()] = incl;
      sh.tot[tile][1][warp_id()] = incl_p;
    }
  }
  for (int off = kWarpSize / 2; off > 0; off /= 2) {
    last = max(last, shfl_xor(last, off));
    if (with_p) last_p = max(last_p, shfl_xor(last_p, off));
  }
  if (lane_id() == 0) {
    sh.last[0][warp_id()] = last;
    sh.last[1][warp_id()] = last_p;
  }
  __syncthreads();
  DrawSlice d{0.0f, -1, 0.0f, -1};
  if (warp_id() == 0) {
    const bool lane_in = lane_id() < kWarps;
    for (int tile = 0; tile < tiles; ++tile) {
      const float t = warp_inclusive_scan(lane_in ? sh.tot[tile][0][lane_id()] : 0.0f);
      d.total = f_add(d.total, __shfl_sync(kFullMask, t, kWarpSize - 1));
      if (with_p) {
        const float tp = warp_inclusive_scan(lane_in ? sh.tot[tile][1][lane_id()] : 0.0f);
        d.total_p = f_add(d.total_p, __shfl_sync(kFullMask, tp, kWarpSize - 1));
      }
    }
    d.last = lane_in ? sh.last[0][lane_id()] : -1;
    d.last_p = lane_in ? sh.last[1][lane_id()] : -1;
    for (int off = kWarpSize / 2; off > 0; off /= 2) {
      d.last = max(d.last, shfl_xor(d.last, off));
      if (with_p) d.last_p = max(d.last_p, shfl_xor(d.last_p, off));
    }
    if (!with_p) {
      d.total_p = d.total;
      d.last_p = d.last;
    }
  }
  __syncthreads();  // (the next call writes sh.tot and sh.last again)
  return d;
}

// Phase 1: p's partial over one slice of one position (and max q when eta > 0 at a drafted position).
template <int KIND, bool ONEHOT>
__global__ void __launch_bounds__(kThreads, 4) verify_draft_stats_kernel(const VerifyDraftArgs a, VerifyDraftWorkspace ws) {
  __shared__ Shared sh;
  const int ns = num_slices(a.vocab);
  const int64_t r = blockIdx.x / ns;
  const int s = static_cast<int>(blockIdx.x - r * ns);
  const Position pos = position_of_row(a, r);
  if (pos.j > pos.nd) return;  // padding past the bonus position (num_draft < g): never read
  const bool with_q = a.eta > 0.0f && pos.j < pos.nd;
  const void* zrow = logits_row(a, r);
  const float* qrow = with_q && a.draft_probs != nullptr ? a.draft_probs + pos.tok * a.vocab : nullptr;
  const int x = with_q ? draft_index(a, pos.tok) : -1;
  const bool vec = aligned16(zrow) && (qrow == nullptr || aligned16(qrow));
  const int begin = slice_begin(s, a.vocab), end = slice_end(s, a.vocab);
  const float scale = a.scale;
  SoftmaxState st = softmax_identity();
  float qm = -INFINITY;
  if (with_q) {
    sweep<KIND, true, ONEHOT>(zrow, qrow, x, begin, end, vec, [&](int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
      softmax_update_chunk(st, z, v0, scale);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) qm = f_max(qm, q[e]);
    });
  } else {
    sweep<KIND, false, ONEHOT>(zrow, qrow, x, begin, end, vec, [&](int v0, const float(&z)[kChunk], const float(&)[kChunk]) {
      softmax_update_chunk(st, z, v0, scale);
    });
  }
  const SoftmaxState ss = block_reduce_softmax(st, scale, sh);
  const float qs = with_q ? block_max(qm, sh) : -INFINITY;
  if (threadIdx.x == 0) ws.parts_p[r * ns + s] = SlicePartial{ss, qs};
}

// Phase 1 at eta 0 with 16-bit logits, a GPU's alternative to verify_draft_stats_kernel (launch_verify_draft's
// stats_group G > 1):
// one CTA per (position, group of G consecutive slices). A thread issues its chunks of slice k + 1 (raw
// 16-byte loads into registers) before the arithmetic and the reduction of slice k, so a slice's loads
// overlap the previous slice's exps and barriers; the reduction is block_reduce_softmax's butterflies
// (per warp, then over the warp results in warp 0) with one barrier instead of three: warp 0 finishes
// each slice and writes its partial while the other warps go on to the next (the warp results
// alternate between two shared buffers). The same slices, chunks, order and butterflies as
// verify_draft_stats_kernel: the same bits.
template <int KIND>
__global__ void __launch_bounds__(kThreads, 4) verify_draft_stats_group_kernel(const VerifyDraftArgs a,
                                                                               VerifyDraftWorkspace ws, int G) {
  __shared__ SoftmaxState slots[2][kWarps];
  const int ns = num_slices(a.vocab), groups = (ns + G - 1) / G;
  const int64_t r = blockIdx.x / groups;
  const int s0 = static_cast<int>(blockIdx.x - r * groups) * G, s1 = min(ns, s0 + G);
  const Position pos = position_of_row(a, r);
  if (pos.j > pos.nd) return;  // padding past the bonus position (num_draft < g): never read
  const void* zrow = logits_row(a, r);
  const bool vec = aligned16(zrow);
  const float scale = a.scale;
  // chunk i (< kSliceTiles) of this thread in slice s: tokens from slice_begin + (thread + i kThreads) kChunk
  auto chunk_v0 = [&](int s, int i) {
    return slice_begin(s, a.vocab) + (static_cast<int>(threadIdx.x) + i * kThreads) * kChunk;
  };
  auto full = [&](int s, int v0) { return vec && v0 + kChunk <= slice_end(s, a.vocab); };
  auto issue = [&](int s, RawChunk<KIND> (&raw)[kSliceTiles]) {
#pragma unroll
    for (int i = 0; i < kSliceTiles; ++i)
      if (full(s, chunk_v0(s, i))) issue_chunk<KIND>(zrow, chunk_v0(s, i), raw[i]);
  };
  // slice s from `cur` (its loads issued one slice earlier), slice s + 1's loads into `nxt` first
  auto step = [&](int s, const RawChunk<KIND> (&cur)[kSliceTiles], RawChunk<KIND> (&nxt)[kSliceTiles]) {
    if (s + 1 < s1) issue(s + 1, nxt);
    const int end = slice_end(s, a.vocab);
    SoftmaxState st = softmax_identity();
#pragma unroll
    for (int i = 0; i < kSliceTiles; ++i) {
      const int v0 = chunk_v0(s, i);
      if (v0 >= end) break;  // (a short last slice: this thread's chunks end here, as in sweep)
      float z[kChunk];
      if (full(s, v0)) {
        widen_chunk<KIND>(cur[i], z);
      } else {
        load_logits<KIND>(zrow, v0, min(kChunk, end - v0), false, z);
      }
      softmax_update_chunk(st, z, v0, scale);
    }
    for (int off = kWarpSize / 2; off > 0; off /= 2) st = softmax_merge(st, shfl_xor(st, off), scale);
    const int buf = (s - s0) & 1;
    if (lane_id() == 0) slots[buf][warp_id()] = st;
    __syncthreads();
    if (warp_id() == 0) {
      SoftmaxState x = lane_id() < kWarps ? slots[buf][lane_id()] : softmax_identity();
      for (int off = kWarpSize / 2; off > 0; off /= 2) x = softmax_merge(x, shfl_xor(x, off), scale);
      if (lane_id() == 0) ws.parts_p[r * ns + s] = SlicePartial{x, -INFINITY};
    }
  };
  RawChunk<KIND> ping[kSliceTiles], pong[kSliceTiles];
  issue(s0, ping);
  for (int s = s0; s < s1; s += 2) {  // (two slices a trip: the register buffers swap roles, no copies)
    step(s, ping, pong);
    if (s + 1 < s1) step(s + 1, pong, ping);
  }
}

// eta > 0: p's statistics per position (one thread per logits row), for the modified logits' pass.
__global__ void __launch_bounds__(kThreads) verify_draft_fold_kernel(const VerifyDraftArgs a, VerifyDraftWorkspace ws) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (r >= a.rows) return;
  const Position pos = position_of_row(a, r);
  if (pos.j > pos.nd) return;
  const int ns = num_slices(a.vocab);
  ws.stats[r] = fold_target_stats(ws.parts_p + r * ns, ns, a.scale, a.alpha, pos.j < pos.nd);
}

// Phase 1, eta > 0: the modified logits' partial over one slice of one drafted position.
template <int KIND, bool ONEHOT>
__global__ void __launch_bounds__(kThreads, 4) verify_draft_modified_stats_kernel(const VerifyDraftArgs a,
                                                                                  VerifyDraftWorkspace ws) {
  __shared__ Shared sh;
  const int ns = num_slices(a.vocab);
  // positions in the reverse order of the first pass: the last ones it read may still be in L2
  const int64_t r = a.rows - 1 - blockIdx.x / ns;
  const int s = static_cast<int>(blockIdx.x % ns);
  const Position pos = position_of_row(a, r);
  if (pos.j >= pos.nd) return;  // the bonus position uses p alone
  const PositionStats ps = ws.stats[r];
  const void* zrow = logits_row(a, r);
  const float* qrow = a.draft_probs != nullptr ? a.draft_probs + pos.tok * a.vocab : nullptr;
  const int x = draft_index(a, pos.tok);
  const bool vec = aligned16(zrow) && (qrow == nullptr || aligned16(qrow));
  const float scale = a.scale, eta = a.eta;
  // (this kernel has no first-sweep state at hand: it recomputes it, so its bits are the one-pass kernel's)
  SoftmaxState st = softmax_identity(), first = softmax_identity();
  bool masked = false;
  sweep<KIND, true, ONEHOT>(zrow, qrow, x, slice_begin(s, a.vocab), slice_end(s, a.vocab), vec,
                            [&](int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
                              softmax_update_chunk(first, z, v0, scale);
                              masked |= chunk_masked(q, ps.q_thresh);
                              modified_update_chunk(st, z, q, v0, ps, scale, eta);
                            });
  st = modified_thread_state(masked, st, first, ps.m_z, scale);
  const SoftmaxState ss = block_reduce_softmax(st, 1.0f, sh);
  if (threadIdx.x == 0) ws.parts_a[r * ns + s] = SlicePartial{ss, -INFINITY};
}

// Phase 1 with eta > 0 in one pass over memory: a thread-block cluster of C CTAs per position (C =
// min(8, slices)), CTA rank k owning slices k, k + C, ...; it copies its slices' logits and draft
// probabilities into shared memory (cp.async), reduces p's partials from there, the cluster exchanges
// them through distributed shared memory, every CTA folds all slices in order (fold_target_stats,
// the fold kernel's arithmetic) and reduces the modified logits' partials from shared memory again.
// The same slices, sweeps and folds as stats + fold + modified_stats, hence the same bits; only
// the second read of each slice comes from shared memory instead of HBM. A CTA's block reductions
// take N of its slices at once in each sweep (reduce_slices: the same butterflies, one barrier).
// sm_90 (clusters) only.
template <int KIND>
constexpr int logits_bytes() {
  return KIND == kLogitsF32 ? 4 : 2;
}

template <int KIND, bool ONEHOT>
__host__ __device__ constexpr size_t rapid_slice_bytes() {
  return static_cast<size_t>(kSliceLen) * (logits_bytes<KIND>() + (ONEHOT ? 0 : 4));
}

// Dynamic shared memory of the one-pass kernel: `per` slices' logits (and draft probs), then their
// partials, then all slices' partials gathered for the fold, then every thread's first-sweep state of each
// of its slices (the second sweep shifts them: modified_thread_state).
template <int KIND, bool ONEHOT>
__host__ __device__ size_t rapid_smem_bytes(int per, int ns) {
  return rapid_slice_bytes<KIND, ONEHOT>() * per + sizeof(SlicePartial) * (per + ns) +
         sizeof(SoftmaxState) * kThreads * per;
}

// Shared buffers of reduce_slices: per slice of a call the warp results (two sets: consecutive calls
// alternate, so that one call's writes never meet the previous call's reads without a barrier between).
template <int N>
struct SliceSlots {
  SoftmaxState st[2][N][kWarps];
  float q[2][N][kWarps];
};

// The block reductions of n <= N slices at once (the one-pass kernel's): per slice i < n, the softmax
// state st[i] (and with_q the max qm[i]) of every thread reduced by block_reduce_softmax's butterflies,
// one warp butterfly per slice (offsets 16..1, the N slices' steps interleaved: independent shuffles
// instead of one latency-bound chain), then one barrier and warp 0's butterfly over the warp results
// (padded with the identity). The same bits as block_reduce_softmax / block_max slice by slice, with one
// barrier for all n instead of three (six with q) per slice. The results are thread 0's st[i] and qm[i];
// `buf` alternates between calls.
template <int N>
__device__ __forceinline__ void reduce_slices(SoftmaxState (&st)[N], float (&qm)[N], int n, bool with_q, float scale,
                                              SliceSlots<N>& sl, int buf) {
  auto butterflies = [&] {  // (the slices' steps interleaved)
    for (int off = kWarpSize / 2; off > 0; off /= 2) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (i >= n) continue;
        st[i] = softmax_merge(st[i], shfl_xor(st[i], off), scale);
        if (with_q) qm[i] = f_max(qm[i], shfl_xor(qm[i], off));
      }
    }
  };
  butterflies();
  if (lane_id() == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      sl.st[buf][i][warp_id()] = st[i];
      sl.q[buf][i][warp_id()] = qm[i];
    }
  }
  __syncthreads();
  if (warp_id() != 0) return;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    st[i] = lane_id() < kWarps ? sl.st[buf][i][lane_id()] : softmax_identity();
    qm[i] = lane_id() < kWarps ? sl.q[buf][i][lane_id()] : -INFINITY;
  }
  butterflies();
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// Copies tokens [begin, end) of a row (elements of `esize` bytes) into shared memory: 16-byte cp.async
// copies when both sides are aligned, element copies for the rest (the tail, or misaligned rows).
__device__ __forceinline__ void copy_to_shared(void* dst, const void* src, int begin, int end, int esize, bool vec) {
  const int n = end - begin;
  const char* from = static_cast<const char*>(src) + static_cast<size_t>(begin) * esize;
  char* to = static_cast<char*>(dst);
  const int per16 = 16 / esize;
  const int nvec = vec ? n / per16 : 0;
  for (int i = threadIdx.x; i < nvec; i += kThreads) __pipeline_memcpy_async(to + 16 * i, from + 16 * i, 16);
  for (int i = nvec * per16 + threadIdx.x; i < n; i += kThreads) {
    if (esize == 4) {
      reinterpret_cast<float*>(to)[i] = reinterpret_cast<const float*>(from)[i];
    } else {
      reinterpret_cast<uint16_t*>(to)[i] = reinterpret_cast<const uint16_t*>(from)[i];
    }
  }
}
#endif

// (N = 1 is held to the 64 registers of 4 CTAs per SM, a cluster of 16's occupancy, which its allocation
// passes otherwise; N = 2 keeps 64 by itself, and spills when held to it; 0: no minimum)
template <int KIND, bool ONEHOT, int N>
__global__ void __launch_bounds__(kThreads, N == 1 ? 4 : 0) verify_draft_rapid_stats_kernel(const VerifyDraftArgs a,
                                                                                          VerifyDraftWorkspace ws) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char dyn[];
  __shared__ SliceSlots<N> slots;
  __shared__ Shared sh;
  __shared__ PositionStats ps_shared;
  namespace cg = cooperative_groups;
  const cg::cluster_group cl = cg::this_cluster();
  const int C = static_cast<int>(cl.num_blocks()), rank = static_cast<int>(cl.block_rank());
  const int ns = num_slices(a.vocab), per = (ns + C - 1) / C;
  const int64_t r = blockIdx.x / C;  // (clusters are consecutive blocks)
  const Position pos = position_of_row(a, r);
  if (pos.j > pos.nd) return;  // the whole cluster: padding past the bonus position
  const bool drafted = pos.j < pos.nd;
  const void* zrow = logits_row(a, r);
  const float* qrow = drafted && a.draft_probs != nullptr ? a.draft_probs + pos.tok * a.vocab : nullptr;
  const int x = drafted ? draft_index(a, pos.tok) : -1;
  const bool vec = aligned16(zrow) && (qrow == nullptr || aligned16(qrow));
  constexpr int esize = logits_bytes<KIND>();
  unsigned char* zbuf = dyn;
  float* qbuf = reinterpret_cast<float*>(dyn + static_cast<size_t>(kSliceLen) * esize * per);
  SlicePartial* mine = reinterpret_cast<SlicePartial*>(dyn + rapid_slice_bytes<KIND, ONEHOT>() * per);
  SlicePartial* all = mine + per;
  SoftmaxState* firsts = reinterpret_cast<SoftmaxState*>(all + ns);  // [per][kThreads]
  // 1. this CTA's slices into shared memory (the only read of HBM), one copy group per slice
  int mine_n = 0;
  for (int s = rank; s < ns; s += C, ++mine_n) {
    const int begin = slice_begin(s, a.vocab), end = slice_end(s, a.vocab);
    copy_to_shared(zbuf + static_cast<size_t>(mine_n) * kSliceLen * esize, zrow, begin, end, esize, vec);
    if (!ONEHOT && qrow != nullptr) {
      copy_to_shared(qbuf + static_cast<size_t>(mine_n) * kSliceLen, qrow, begin, end, 4, vec);
    }
    __pipeline_commit();
  }
  // The CTA's slices in rounds of up to N: body(l, s, st, qm) fills this thread's state (and max q) of its
  // l-th slice (slice s), then one reduce_slices for the round and emit(l, s, partial) on thread 0.
  int round = 0;  // (reduce_slices' shared buffers alternate between rounds)
  auto rounds = [&](bool with_q, float sc, auto&& body, auto&& emit) {
    for (int l0 = 0; l0 < mine_n; l0 += N, ++round) {
      SoftmaxState st[N];
      float qm[N];
#pragma unroll
      for (int i = 0; i < N; ++i) {
        st[i] = softmax_identity();
        qm[i] = -INFINITY;
        if (l0 + i < mine_n) body(l0 + i, rank + (l0 + i) * C, st[i], qm[i]);
      }
      const int n = min(N, mine_n - l0);
      reduce_slices<N>(st, qm, n, with_q, sc, slots, round & 1);
      if (threadIdx.x == 0)
        for (int i = 0; i < n; ++i) emit(l0 + i, rank + (l0 + i) * C, SlicePartial{st[i], with_q ? qm[i] : -INFINITY});
    }
  };
  // 2. p's partials (and max q) per slice, as verify_draft_stats_kernel; slice l is swept as soon as
  // its own copies have landed (groups complete in order), while the later slices' are in flight
  const float scale = a.scale, eta = a.eta;
  rounds(
      drafted, scale,
      [&](int l, int s, SoftmaxState& st, float& qm) {
        __pipeline_wait_prior(static_cast<size_t>(mine_n - 1 - l));
        __syncthreads();
        const int begin = slice_begin(s, a.vocab), len = slice_end(s, a.vocab) - begin;
        const void* zs = zbuf + static_cast<size_t>(l) * kSliceLen * esize;
        const float* qs = qrow != nullptr ? qbuf + static_cast<size_t>(l) * kSliceLen : nullptr;
        const int xs = x - begin;  // (one-hot q: the draft's index within the slice)
        if (drafted) {
          sweep<KIND, true, ONEHOT>(zs, qs, xs, 0, len, true,
                                    [&](int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
                                      softmax_update_chunk(st, z, begin + v0, scale);
#pragma unroll
                                      for (int e = 0; e < kChunk; ++e) qm = f_max(qm, q[e]);
                                    });
        } else {
          sweep<KIND, false, ONEHOT>(zs, qs, xs, 0, len, true,
                                     [&](int v0, const float(&z)[kChunk], const float(&)[kChunk]) {
                                       softmax_update_chunk(st, z, begin + v0, scale);
                                     });
        }
        firsts[l * kThreads + threadIdx.x] = st;
      },
      [&](int l, int, const SlicePartial& part) { mine[l] = part; });
  // 3. every slice's partial from its CTA, folded in slice order (gather: the cluster's partials in `all`)
  auto gather = [&] {
    cl.sync();
    for (int s = threadIdx.x; s < ns; s += kThreads) all[s] = *cl.map_shared_rank(&mine[s / C], s % C);
    cl.sync();  // (no CTA leaves or writes `mine` again while another may read it)
  };
  gather();
  if (threadIdx.x == 0) {
    ps_shared = fold_target_stats(all, ns, scale, a.alpha, drafted);
    if (rank == 0) ws.stats[r] = ps_shared;
  }
  __syncthreads();
  if (drafted) {  // (the bonus position uses p alone)
    const PositionStats ps = ps_shared;
    // 4. the modified logits' partials per slice, from shared memory, as verify_draft_modified_stats_kernel:
    // a thread without a masked token (almost every one) shifts its first-sweep state, no exps
    rounds(
        false, 1.0f,
        [&](int l, int s, SoftmaxState& st, float&) {
          const int begin = slice_begin(s, a.vocab), len = slice_end(s, a.vocab) - begin;
          const void* zs = zbuf + static_cast<size_t>(l) * kSliceLen * esize;
          const float* qs = qrow != nullptr ? qbuf + static_cast<size_t>(l) * kSliceLen : nullptr;
          bool masked = false;
          for (int c = threadIdx.x; c * kChunk < len; c += kThreads) {
            float q[kChunk];
            load_probs<ONEHOT>(qs, x - begin, c * kChunk, min(kChunk, len - c * kChunk), true, q);
            masked |= chunk_masked(q, ps.q_thresh);
          }
          if (masked) {
            sweep<KIND, true, ONEHOT>(zs, qs, x - begin, 0, len, true,
                                      [&](int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
                                        modified_update_chunk(st, z, q, begin + v0, ps, scale, eta);
                                      });
          }
          st = modified_thread_state(masked, st, firsts[l * kThreads + threadIdx.x], ps.m_z, scale);
        },
        [&](int l, int s, const SlicePartial& part) {
          ws.parts_a[r * ns + s] = part;
          mine[l] = part;
        });
    if (!a.phase1_totals) return;  // (the statistics are all the walk needs)
    // 5. p_hat's statistics, the walk's fold of the same partials (the same bits)
    gather();
    if (threadIdx.x == 0) fold_modified_stats(ps_shared, all, ns);
    __syncthreads();
  }
  if (!a.phase1_totals) return;
  // 6. the draw's totals at this position for each of its slices (verify_draft_draw_totals_kernel's, the
  // weights of the draw this position would make: the residual after a rejection, p at the bonus position)
  // from shared memory, so that the draw reads the crossing slice alone
  const PositionStats ps = ps_shared;
  const int mode = drafted ? kWeightResidual : kWeightTarget;
  for (int l = 0, s = rank; s < ns; ++l, s += C) {
    const int begin = slice_begin(s, a.vocab);
    const void* zs = zbuf + static_cast<size_t>(l) * kSliceLen * esize;
    const float* qs = qrow != nullptr ? qbuf + static_cast<size_t>(l) * kSliceLen : nullptr;
    const DrawSlice t = slice_draw_totals<KIND, ONEHOT>(zs, qs, x, begin, s, a.vocab, true, mode, ps, scale, eta, sh);
    if (threadIdx.x == 0) ws.draws[r * ns + s] = t;
  }
#endif
}

// Phase 2: one warp per batch row. Lane l folds positions l, l + 32, ... (in chunks of 32 positions,
// stopping at the chunk holding the first rejection or the bonus position) and decides its draft; the
// lane of the emitting position writes the row's DrawPlan (greedy: its token).
template <int KIND, bool ONEHOT>
__global__ void __launch_bounds__(kWalkWarps * kWarpSize) verify_draft_walk_kernel(const VerifyDraftArgs a,
                                                                                   VerifyDraftWorkspace ws) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kWalkWarps + threadIdx.x / kWarpSize;
  if (b >= a.batch) return;  // (the whole warp)
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  const RowRef rr = row_ref(a, b);
  const int ns = num_slices(a.vocab);
  const float scale = a.scale, eta = a.eta;
  int64_t n = rr.nd;
  for (int64_t j0 = 0; j0 <= rr.nd; j0 += kWarpSize) {
    const int64_t j = j0 + lane;
    const int64_t r = rr.row_off + j;
    bool reject = false;
    int best = 0, xi = -1;
    PositionStats ps{};
    if (j <= rr.nd) {
      const bool drafted = j < rr.nd;
      if (eta > 0.0f) {
        ps = ws.stats[r];
        if (drafted) fold_modified_stats(ps, ws.parts_a + r * ns, ns);
      } else {
        ps = fold_target_stats(ws.parts_p + r * ns, ns, scale, a.alpha, false);
      }
      if (drafted) {
        const int64_t x = a.draft_tokens[rr.tok_off + j];
        xi = draft_index(a, rr.tok_off + j);
        const bool in_range = xi >= 0;
        const int xr = in_range ? xi : 0;
        const float z_x = load_logit(logits_row(a, r), KIND, xr);
        const float q_x = ONEHOT ? draft_prob(nullptr, x, xr) : a.draft_probs[(rr.tok_off + j) * a.vocab + xr];
        reject = !draft_accepted(a.greedy, ps, x, in_range, z_x, q_x, a.uniforms[r], scale, eta, &best);
      }
    }
    const unsigned rejected = __ballot_sync(kFullMask, reject);
    const bool last_chunk = rr.nd < j0 + kWarpSize;
    if (rejected == 0 && !last_chunk) continue;
    n = rejected != 0 ? j0 + __ffs(rejected) - 1 : rr.nd;
    if (j == n) {  // the emitting position's lane
      if (a.greedy) {
        int token = j < rr.nd ? best : ps.argmax_z;
        if (token < 0 || token >= a.vocab) token = 0;  // only for positions of all -inf / NaN logits
        a.out_tokens[r] = token;
      } else {
        const bool rej = j < rr.nd;
        ws.plans[b] = DrawPlan{r, rej && a.draft_probs != nullptr ? rr.tok_off + j : -1, rej ? xi : -1,
                               rej ? kWeightResidual : kWeightTarget, a.uniforms[rr.u_last], ps};
      }
    }
    break;
  }
  for (int64_t j = lane; j < rr.out_len; j += kWarpSize) {
    if (j < n) a.out_tokens[rr.row_off + j] = a.draft_tokens[rr.tok_off + j];
    if (j > n) a.out_tokens[rr.row_off + j] = -1;
  }
  if (lane == 0) a.num_accepted[b] = static_cast<int32_t>(n);
}

struct DrawRow {
  DrawPlan plan;
  const void* zrow;
  const float* qrow;
  bool vec;
};

__device__ __forceinline__ DrawRow draw_row(const VerifyDraftArgs& a, const VerifyDraftWorkspace& ws, int64_t b) {
  DrawRow d;
  d.plan = ws.plans[b];
  d.zrow = logits_row(a, d.plan.row);
  d.qrow = d.plan.qrow >= 0 ? a.draft_probs + d.plan.qrow * a.vocab : nullptr;
  d.vec = aligned16(d.zrow) && (d.qrow == nullptr || aligned16(d.qrow));
  return d;
}

// Phase 3a (where phase 1 did not compute them): one slice's totals at the row's drawn position.
template <int KIND, bool ONEHOT>
__global__ void __launch_bounds__(kThreads, 4) verify_draft_draw_totals_kernel(const VerifyDraftArgs a,
                                                                               VerifyDraftWorkspace ws) {
  __shared__ Shared sh;
  const int ns = num_slices(a.vocab);
  const int64_t b = blockIdx.x / ns;
  const int s = static_cast<int>(blockIdx.x - b * ns);
  const DrawRow d = draw_row(a, ws, b);
  const DrawSlice t = slice_draw_totals<KIND, ONEHOT>(d.zrow, d.qrow, d.plan.x, 0, s, a.vocab, d.vec, d.plan.mode,
                                                      d.plan.ps, a.scale, a.eta, sh);
  if (threadIdx.x == 0) ws.draws[d.plan.row * ns + s] = t;
}

// Phase 3b, one CTA per batch row: the weights to draw from and their total (draw_pick), the crossing slice
// (draw_crossing_slice) searched tile by tile from its base to its first prefix past u * total, and the
// row's token (draw_token).
template <int KIND, bool ONEHOT>
__global__ void __launch_bounds__(kThreads, 4) verify_draft_draw_find_kernel(const VerifyDraftArgs a,
                                                                             VerifyDraftWorkspace ws) {
  __shared__ Shared sh;
  const int ns = num_slices(a.vocab);
  const int64_t b = blockIdx.x;
  const DrawRow d = draw_row(a, ws, b);
  const DrawSlice* ds = ws.draws + d.plan.row * ns;
  float total = 0.0f;
  const int mode = draw_pick(ds, ns, d.plan.mode, &total);  // (the same on every thread: a broadcast read)
  int s = -1, found = kNoToken;
  if (mode >= 0) {
    const float target = f_mul(d.plan.u, total);
    float tile_base = 0.0f;
    s = draw_crossing_slice(ds, ns, mode, target, &tile_base);
    if (s >= 0) {
      const int begin = slice_begin(s, a.vocab), end = slice_end(s, a.vocab);
      float w[kChunk];
      for (int tile = 0; tile < slice_tiles(s, a.vocab); ++tile) {
        if (threadIdx.x == 0) sh.found = kNoToken;  // published by block_scan's barrier
        float cs_p;
        int ignored = -1, ignored_p = -1;
        const float cs = chunk_weights<KIND, ONEHOT>(d.zrow, d.qrow, d.plan.x, 0, begin, end, d.vec, tile, mode,
                                                     d.plan.ps, a.scale, a.eta, w, &cs_p, &ignored, &ignored_p);
        float run;
        const float tile_total = block_scan(cs, tile_base, &run, sh);
        int c = kNoToken;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
          run = f_add(run, w[e]);
          if (c == kNoToken && w[e] > 0.0f && run > target)
            c = begin + (tile * kThreads + static_cast<int>(threadIdx.x)) * kChunk + e;
        }
        if (c != kNoToken) atomicMin(&sh.found, c);  // (the block's smallest: order-independent)
        __syncthreads();
        found = sh.found;
        __syncthreads();
        if (found != kNoToken) break;
        tile_base = f_add(tile_base, tile_total);
      }
    }
  }
  if (threadIdx.x == 0) {
    int token = draw_token(ds, ns, mode, s, found, d.plan.ps.argmax_z);
    if (token < 0 || token >= a.vocab) token = 0;  // only for positions of all -inf / NaN logits
    a.out_tokens[d.plan.row] = token;
  }
}

unsigned blocks_for(int64_t n, int per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

// The largest dynamic shared memory the one-pass eta > 0 kernel asks for (of an H100's 227 KB per CTA;
// up to ~113 KB two CTAs fit an SM: V 128256 with bf16 logits and fp32 draft probs takes 108 KB).
constexpr size_t kRapidSmemLimit = 200 * 1024;

// eta > 0: phase 1 in one pass over memory (verify_draft_rapid_stats_kernel) where the device runs
// clusters (the sm_90 code was loaded) and a CTA's slices fit kRapidSmemLimit; *done tells the caller.
// The tokens are the same either way.
template <int KIND, bool ONEHOT>
cudaError_t launch_rapid_stats(const VerifyDraftArgs& args, const VerifyDraftWorkspace& ws, int cluster,
                               int reduce_together, bool totals, cudaStream_t stream, bool* done) {
  VerifyDraftArgs a = args;
  a.phase1_totals = totals && !a.greedy;
  *done = false;
  const int ns = num_slices(a.vocab);
  const int C = ns < cluster ? ns : cluster;
  const int per = (ns + C - 1) / C;
  // slices reduced at once: the launch choice, at most the CTA's slices (a cluster of 16 at V 128256: 2, whose
  // kernel keeps the 64 registers of 4 CTAs per SM)
  const int n = reduce_together < per ? reduce_together : per;
  auto* kernel = n >= 4 ? verify_draft_rapid_stats_kernel<KIND, ONEHOT, 4>
                 : n >= 2 ? verify_draft_rapid_stats_kernel<KIND, ONEHOT, 2>
                          : verify_draft_rapid_stats_kernel<KIND, ONEHOT, 1>;
  cudaFuncAttributes fa;
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess || fa.ptxVersion < 90) {
    (void)cudaGetLastError();
    return cudaSuccess;
  }
  const size_t smem = rapid_smem_bytes<KIND, ONEHOT>(per, ns);
  const int64_t grid = a.rows * C;
  if (smem > kRapidSmemLimit || grid > 0x7fffffff) return cudaSuccess;
  const int smem_i = static_cast<int>(smem);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_i) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, C > 8 ? 1 : 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaSuccess;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(C);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;  // a cluster of C such CTAs must fit the device at all (a host query, no sync)
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess || clusters < 1) {
    (void)cudaGetLastError();
    return cudaSuccess;
  }
  *done = true;
  return cudaLaunchKernelEx(&cfg, kernel, a, ws);
}

template <int KIND, bool ONEHOT>
cudaError_t launch(const VerifyDraftArgs& a, cudaStream_t stream, const VerifyDraftLaunch& how) {
  const int stats_group = how.stats_group;
  VerifyDraftWorkspace ws{};
  verify_draft_workspace_layout(a.batch, a.rows, a.vocab, a.eta > 0.0f, a.workspace, &ws);
  const int64_t ns = num_slices(a.vocab);
  const int64_t position_ctas = a.rows * ns, draw_ctas = static_cast<int64_t>(a.batch) * ns;
  if (position_ctas > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 block(kThreads);
  bool stats_done = false;  // phase 1 launched (the one-pass eta > 0 kernel or the grouped eta 0 one)
  if (a.eta > 0.0f) {
    const cudaError_t err =
        launch_rapid_stats<KIND, ONEHOT>(a, ws, how.cluster, how.reduce_together, how.phase1_totals, stream,
                                         &stats_done);
    if (err != cudaSuccess) return err;
  }
  const bool totals_done = stats_done && how.phase1_totals;  // (computed by the one-pass kernel)
  // (16-bit logits only: fp32 chunks would double the prefetched registers, past the 64 of 4 CTAs/SM)
  if constexpr (KIND != kLogitsF32) {
    if (!stats_done && a.eta <= 0.0f && stats_group > 1) {
      const unsigned grid = static_cast<unsigned>(a.rows * ((ns + stats_group - 1) / stats_group));
      verify_draft_stats_group_kernel<KIND><<<grid, block, 0, stream>>>(a, ws, stats_group);
      stats_done = true;
    }
  }
  if (!stats_done) {
    verify_draft_stats_kernel<KIND, ONEHOT><<<static_cast<unsigned>(position_ctas), block, 0, stream>>>(a, ws);
    if (a.eta > 0.0f) {
      verify_draft_fold_kernel<<<blocks_for(a.rows, kThreads), block, 0, stream>>>(a, ws);
      verify_draft_modified_stats_kernel<KIND, ONEHOT><<<static_cast<unsigned>(position_ctas), block, 0, stream>>>(a, ws);
    }
  }
  verify_draft_walk_kernel<KIND, ONEHOT><<<blocks_for(a.batch, kWalkWarps), kWalkWarps * kWarpSize, 0, stream>>>(a, ws);
  if (!a.greedy) {
    if (!totals_done) {
      verify_draft_draw_totals_kernel<KIND, ONEHOT><<<static_cast<unsigned>(draw_ctas), block, 0, stream>>>(a, ws);
    }
    verify_draft_draw_find_kernel<KIND, ONEHOT><<<static_cast<unsigned>(a.batch), block, 0, stream>>>(a, ws);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_verify_draft(const VerifyDraftArgs& args, cudaStream_t stream, VerifyDraftLaunch how) {
  if (args.batch == 0) return cudaSuccess;
  const bool onehot = args.draft_probs == nullptr;
  const VerifyDraftLaunch& g = how;
  switch (args.logits_kind) {
    case kLogitsF32:
      return onehot ? launch<kLogitsF32, true>(args, stream, g) : launch<kLogitsF32, false>(args, stream, g);
    case kLogitsF16:
      return onehot ? launch<kLogitsF16, true>(args, stream, g) : launch<kLogitsF16, false>(args, stream, g);
    default:
      return onehot ? launch<kLogitsBF16, true>(args, stream, g) : launch<kLogitsBF16, false>(args, stream, g);
  }
}

}  // namespace speculative
}  // namespace ragattn
