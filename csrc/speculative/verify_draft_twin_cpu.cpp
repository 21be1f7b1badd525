// verify_draft's bit-faithful CPU twin (RAGATTN_CPU_BACKEND=twin): replays the CUDA kernel's
// arithmetic on kThreads virtual threads, one vocabulary slice at a time as one CTA of the kernel
// reduces it (chunk ownership, warp butterflies, Kogge-Stone scans), and folds the slices with the
// kernel's own fold functions (verify_draft_math.h: fold_target_stats, draft_accepted, draw_pick,
// draw_crossing_slice, draw_token), so that both emit the same tokens for the same uniforms. The kernel
// computes every position's slices at once; the twin walks the positions in order and stops at the
// first rejection (a position's statistics do not depend on any other position). Slow (a scalar
// replay with correctly rounded software FMAs): the tests that compare against the CUDA order use
// it; the default CPU path is verify_draft_fast_cpu.cpp.
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "speculative/verify_draft_cpu.h"
#include "speculative/verify_draft_math.h"

namespace ragattn {
namespace speculative {

namespace {

// One xor butterfly over 32 lanes, the way __shfl_xor_sync pairs them; returns lane 0.
template <class T, class F>
T butterfly(std::array<T, kWarpSize> x, F combine) {
  for (int off = kWarpSize / 2; off > 0; off /= 2) {
    std::array<T, kWarpSize> y;
    for (int i = 0; i < kWarpSize; ++i) y[i] = combine(x[i], x[i ^ off]);
    x = y;
  }
  return x[0];
}

// Block reduction of per-thread partials: a butterfly per warp, then one over the warp results.
template <class T, class F>
T block_reduce(const std::vector<T>& partial, T identity, F combine) {
  std::array<T, kWarpSize> warp_res;
  warp_res.fill(identity);
  for (int w = 0; w < kWarps; ++w) {
    std::array<T, kWarpSize> lanes;
    for (int i = 0; i < kWarpSize; ++i) lanes[i] = partial[w * kWarpSize + i];
    warp_res[w] = butterfly(lanes, combine);
  }
  return butterfly(warp_res, combine);
}

// Kogge-Stone inclusive scan over 32 lanes (shfl_up 1, 2, 4, 8, 16), in place.
void warp_inclusive_scan(std::array<float, kWarpSize>& x) {
  for (int d = 1; d < kWarpSize; d *= 2) {
    std::array<float, kWarpSize> y = x;
    for (int i = d; i < kWarpSize; ++i) y[i] = f_add(x[i - d], x[i]);
    x = y;
  }
}

struct RowView {
  const void* z;   // target logits row (kind below)
  const float* q;  // draft probabilities row, or nullptr (one-hot on `x`, or the bonus position)
  bool has_q;      // a drafted position (q given or one-hot), not the bonus position
  int64_t x;       // the draft token (one-hot q)
  int kind;
  int V;
};

float q_at(const RowView& r, int v) { return draft_prob(r.q, r.x, v); }

float logit_at(const RowView& r, int v) { return load_logit(r.z, r.kind, v); }

// Chunk [v0, v0 + kChunk) of a slice ending at `end`: logits (-inf past the end) and draft
// probabilities (0 past the end), as the kernel loads them.
void chunk_logits(const RowView& r, int v0, int end, float (&z)[kChunk]) {
  for (int e = 0; e < kChunk; ++e) z[e] = v0 + e < end ? logit_at(r, v0 + e) : -INFINITY;
}
void chunk_probs(const RowView& r, int v0, int end, float (&q)[kChunk]) {
  for (int e = 0; e < kChunk; ++e) q[e] = v0 + e < end ? q_at(r, v0 + e) : 0.0f;
}

// One sweep of the kernel over slice s: thread t folds the slice's chunks t, t + kThreads, ... in
// order; f(thread, v0, z, q) does the per-chunk work (q only when with_q).
template <class F>
void slice_sweep(const RowView& r, int s, bool with_q, F&& f) {
  const int b = slice_begin(s, r.V), e = slice_end(s, r.V);
  const int nchunks = (e - b + kChunk - 1) / kChunk;
  float z[kChunk], q[kChunk] = {};
  for (int t = 0; t < kThreads; ++t) {
    for (int c = t; c < nchunks; c += kThreads) {
      const int v0 = b + c * kChunk;
      chunk_logits(r, v0, e, z);
      if (with_q) chunk_probs(r, v0, e, q);
      f(t, v0, z, q);
    }
  }
}

// Phase 1, one slice of one position (a CTA of verify_draft_stats_kernel): p's softmax state and,
// with_q, the slice's max q.
SlicePartial target_partial(const RowView& r, int s, float scale, bool with_q) {
  std::vector<SoftmaxState> st(kThreads, softmax_identity());
  std::vector<float> qmax(kThreads, -INFINITY);
  slice_sweep(r, s, with_q, [&](int t, int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
    softmax_update_chunk(st[t], z, v0, scale);
    if (with_q)
      for (int e = 0; e < kChunk; ++e) qmax[t] = f_max(qmax[t], q[e]);
  });
  auto merge_t = [scale](const SoftmaxState& a, const SoftmaxState& b) { return softmax_merge(a, b, scale); };
  auto max_f = [](float a, float b) { return f_max(a, b); };
  return SlicePartial{block_reduce(st, softmax_identity(), merge_t),
                      with_q ? block_reduce(qmax, -INFINITY, max_f) : -INFINITY};
}

// Phase 1's second pass (eta > 0), one slice (a CTA of verify_draft_modified_stats_kernel): the online
// softmax of the modified logits a = y + eta * mask * (q - p), each virtual thread's state by
// modified_thread_state (its first-sweep state of z shifted unless it holds a masked token).
SlicePartial modified_partial(const RowView& r, int s, const PositionStats& ps, float scale, float eta) {
  std::vector<SoftmaxState> st(kThreads, softmax_identity()), first(kThreads, softmax_identity());
  std::vector<char> masked(kThreads, 0);
  slice_sweep(r, s, true, [&](int t, int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
    softmax_update_chunk(first[t], z, v0, scale);
    masked[t] |= chunk_masked(q, ps.q_thresh);
    modified_update_chunk(st[t], z, q, v0, ps, scale, eta);
  });
  for (int t = 0; t < kThreads; ++t) st[t] = modified_thread_state(masked[t], st[t], first[t], ps.m_z, scale);
  auto merge_1 = [](const SoftmaxState& a, const SoftmaxState& b) { return softmax_merge(a, b, 1.0f); };
  return SlicePartial{block_reduce(st, softmax_identity(), merge_1), -INFINITY};
}

// The statistics at one position: its slices' partials, folded in slice order.
PositionStats position_stats(const RowView& r, float scale, float eta, float alpha) {
  const bool with_q = eta > 0.0f && r.has_q;
  const int n = num_slices(r.V);
  std::vector<SlicePartial> parts(static_cast<size_t>(n));
  for (int s = 0; s < n; ++s) parts[s] = target_partial(r, s, scale, with_q);
  PositionStats ps = fold_target_stats(parts.data(), n, scale, alpha, with_q);
  if (!with_q) return ps;
  for (int s = 0; s < n; ++s) parts[s] = modified_partial(r, s, ps, scale, eta);
  fold_modified_stats(ps, parts.data(), n);
  return ps;
}

// Block-wide scan of one chunk sum per virtual thread (the kernel's block_scan): each thread's chunk
// base from tile_base into `base`; returns the tile total.
float block_scan(const std::vector<float>& sums, float tile_base, std::vector<float>& base) {
  std::array<float, kWarpSize> warp_tot;
  warp_tot.fill(0.0f);
  std::array<std::array<float, kWarpSize>, kWarps> lane_excl;
  for (int wi = 0; wi < kWarps; ++wi) {
    std::array<float, kWarpSize> x;
    for (int lane = 0; lane < kWarpSize; ++lane) x[lane] = sums[wi * kWarpSize + lane];
    warp_inclusive_scan(x);
    lane_excl[wi][0] = 0.0f;
    for (int lane = 1; lane < kWarpSize; ++lane) lane_excl[wi][lane] = x[lane - 1];
    warp_tot[wi] = x[kWarpSize - 1];
  }
  warp_inclusive_scan(warp_tot);
  for (int wi = 0; wi < kWarps; ++wi) {
    const float warp_excl = wi == 0 ? 0.0f : warp_tot[wi - 1];
    for (int lane = 0; lane < kWarpSize; ++lane)
      base[wi * kWarpSize + lane] = chunk_base(tile_base, warp_excl, lane_excl[wi][lane]);
  }
  return warp_tot[kWarpSize - 1];
}

// The inverse-CDF draw at one position, phase by phase as the kernels run it (see the "Summation
// order" of verify_draft_math.h).
class Draw {
 public:
  Draw(const RowView& r, const PositionStats& ps, float scale, float eta)
      : r_(r), ps_(ps), scale_(scale), eta_(eta), w_(kTile), sums_(kThreads), sums_p_(kThreads), base_(kThreads) {}

  int token(int mode, float u) {
    const int n = num_slices(r_.V);
    std::vector<DrawSlice> d(static_cast<size_t>(n));
    // every slice's totals (the one-pass kernel's third sweep, or verify_draft_draw_totals_kernel)
    for (int s = 0; s < n; ++s) d[s] = slice_totals(s, mode);
    float total = 0.0f;
    const int used = draw_pick(d.data(), n, mode, &total);
    int s = -1, found = kNoToken;
    if (used >= 0) {  // verify_draft_draw_find_kernel: the crossing slice alone
      const float target = f_mul(u, total);
      float base = 0.0f;
      s = draw_crossing_slice(d.data(), n, used, target, &base);
      if (s >= 0) found = slice_find(s, used, base, target);
    }
    return draw_token(d.data(), n, used, s, found, ps_.argmax_z);
  }

 private:
  // Weights of `mode` for one tile of slice s (0 past it) into w_, their chunk sums into sums_ and p's
  // into sums_p_; the last token of positive weight of each into *last / *last_p.
  void tile_weights(int s, int tile, int mode, int* last, int* last_p) {
    const int sb = slice_begin(s, r_.V), se = slice_end(s, r_.V);
    for (int t = 0; t < kThreads; ++t) {
      const int v0 = sb + (tile * kThreads + t) * kChunk;
      float sum = 0.0f, sum_p = 0.0f;
      for (int e = 0; e < kChunk; ++e) {
        const int v = v0 + e;
        float wv = 0.0f, wp = 0.0f;
        if (v < se) {
          wv = draw_weights(mode, logit_at(r_, v), mode == kWeightTarget ? 0.0f : q_at(r_, v), ps_, scale_, eta_, &wp);
          if (wv > 0.0f) *last = std::max(*last, v);
          if (wp > 0.0f) *last_p = std::max(*last_p, v);
        }
        w_[t * kChunk + e] = wv;
        sum = f_add(sum, wv);
        sum_p = f_add(sum_p, wp);
      }
      sums_[t] = sum;
      sums_p_[t] = sum_p;
    }
  }

  // Phase 3a, one slice: its totals T_s (tile totals folded from 0).
  DrawSlice slice_totals(int s, int mode) {
    DrawSlice d{0.0f, -1, 0.0f, -1};
    const bool with_p = mode == kWeightResidual;
    for (int tile = 0; tile < slice_tiles(s, r_.V); ++tile) {
      tile_weights(s, tile, mode, &d.last, &d.last_p);
      d.total = f_add(d.total, block_scan(sums_, d.total, base_));
      if (with_p) d.total_p = f_add(d.total_p, block_scan(sums_p_, d.total_p, base_));
    }
    if (!with_p) {
      d.total_p = d.total;
      d.last_p = d.last;
    }
    return d;
  }

  // Phase 3b, one slice: the first token whose prefix (from the slice's base) passes target.
  int slice_find(int s, int mode, float base, float target) {
    int ignored = -1, ignored_p = -1;
    float tile_base = base;
    for (int tile = 0; tile < slice_tiles(s, r_.V); ++tile) {
      tile_weights(s, tile, mode, &ignored, &ignored_p);
      const float tile_total = block_scan(sums_, tile_base, base_);
      const int v_tile = slice_begin(s, r_.V) + tile * kTile;
      for (int t = 0; t < kThreads; ++t) {
        float run = base_[t];
        for (int e = 0; e < kChunk; ++e) {
          const float wv = w_[t * kChunk + e];
          run = f_add(run, wv);
          if (wv > 0.0f && run > target) return v_tile + t * kChunk + e;
        }
      }
      tile_base = f_add(tile_base, tile_total);
    }
    return kNoToken;
  }

  RowView r_;
  PositionStats ps_;
  float scale_, eta_;
  std::vector<float> w_, sums_, sums_p_, base_;
};

class TwinVerifier final : public PositionVerifier {
 public:
  explicit TwinVerifier(const VerifyParams& p) : p_(p) {}

  Decision drafted(const void* z, const float* q, int64_t x, float u, float u_final) override {
    RowView r{z, q, true, x, p_.logits_kind, p_.vocab};
    const Base2Scales& b2 = p_.base2;
    const PositionStats ps = position_stats(r, b2.scale, b2.eta, p_.alpha);
    const bool in_range = x >= 0 && x < p_.vocab;
    const int xi = in_range ? static_cast<int>(x) : 0;
    int best = 0;
    if (draft_accepted(p_.greedy, ps, x, in_range, logit_at(r, xi), q_at(r, xi), u, b2.scale, b2.eta, &best))
      return {true, 0};
    if (p_.greedy) return {false, best};
    return {false, Draw(r, ps, b2.scale, b2.eta).token(kWeightResidual, u_final)};
  }

  int bonus(const void* z, float u_final) override {
    RowView r{z, nullptr, false, -1, p_.logits_kind, p_.vocab};
    const PositionStats ps = position_stats(r, p_.base2.scale, 0.0f, p_.alpha);
    return p_.greedy ? ps.argmax_z : Draw(r, ps, p_.base2.scale, p_.base2.eta).token(kWeightTarget, u_final);
  }

 private:
  VerifyParams p_;
};

}  // namespace

std::unique_ptr<PositionVerifier> make_twin_verifier(const VerifyParams& params) {
  return std::make_unique<TwinVerifier>(params);
}

}  // namespace speculative
}  // namespace ragattn
