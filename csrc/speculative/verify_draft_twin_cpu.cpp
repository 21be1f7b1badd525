// verify_draft's bit-faithful CPU twin (RAGATTN_CPU_BACKEND=twin): replays the CUDA kernel's
// arithmetic on kThreads virtual threads, slice by slice (chunk ownership, warp butterflies,
// Kogge-Stone scans, the fold over the kSlices slices: see verify_draft_math.h), so that both emit
// the same tokens for the same uniforms, whatever cluster size the kernel runs with. Slow (a scalar
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

PositionStats position_stats(const RowView& r, float inv_t, float eta, float alpha) {
  const bool with_q = eta > 0.0f && r.has_q;
  std::vector<SoftmaxState> st(kThreads);
  std::vector<float> qmax(kThreads);
  auto merge_t = [inv_t](const SoftmaxState& a, const SoftmaxState& b) { return softmax_merge(a, b, inv_t); };
  auto max_f = [](float a, float b) { return f_max(a, b); };
  // Per slice: block reduction of the per-thread states; then the slices folded in order.
  SoftmaxState sz = softmax_identity();
  float qm = -INFINITY;
  for (int s = 0; s < kSlices; ++s) {
    std::fill(st.begin(), st.end(), softmax_identity());
    std::fill(qmax.begin(), qmax.end(), -INFINITY);
    slice_sweep(r, s, with_q, [&](int t, int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
      softmax_update_chunk(st[t], z, v0, inv_t);
      if (with_q)
        for (int e = 0; e < kChunk; ++e) qmax[t] = f_max(qmax[t], q[e]);
    });
    sz = softmax_merge(sz, block_reduce(st, softmax_identity(), merge_t), inv_t);
    if (with_q) qm = f_max(qm, block_reduce(qmax, -INFINITY, max_f));
  }
  PositionStats ps = target_stats(sz);
  if (!with_q) return ps;
  ps.q_thresh = f_mul(alpha, qm);
  // Second sweep: online softmax of the modified logits a = y + eta * mask * (q - p).
  auto merge_1 = [](const SoftmaxState& a, const SoftmaxState& b) { return softmax_merge(a, b, 1.0f); };
  SoftmaxState sa = softmax_identity();
  for (int s = 0; s < kSlices; ++s) {
    std::fill(st.begin(), st.end(), softmax_identity());
    slice_sweep(r, s, true, [&](int t, int v0, const float(&z)[kChunk], const float(&q)[kChunk]) {
      float a[kChunk];
      for (int e = 0; e < kChunk; ++e)
        a[e] = modified_logit(scaled_logit(z[e], ps.m_z, inv_t), q[e], eta, ps.q_thresh, ps.inv_sp);
      softmax_update_chunk(st[t], a, v0, 1.0f);
    });
    sa = softmax_merge(sa, block_reduce(st, softmax_identity(), merge_1), 1.0f);
  }
  ps.m_a = sa.m;
  ps.inv_sa = f_div(1.0f, sa.s);
  ps.argmax_a = sa.idx;
  return ps;
}

// Inverse-CDF draw of one token from the weights of `mode` at this position (see the
// "Summation order" of verify_draft_math.h); falls back from the residual to p when the
// residual is all zero.
int draw_token(const RowView& r, const PositionStats& ps, int mode, float inv_t, float eta, float u) {
  std::vector<float> w(static_cast<size_t>(kTile));
  std::vector<float> base(kThreads);

  // Weights of one tile of slice s (0 past the slice), chunk sums, and the block scan -> tile total.
  auto tile_scan = [&](int s, int tile, float tile_base, int* last_pos) {
    const int sb = slice_begin(s, r.V), se = slice_end(s, r.V);
    std::array<float, kWarpSize> warp_tot;
    warp_tot.fill(0.0f);
    std::array<std::array<float, kWarpSize>, kWarps> lane_excl;
    for (int wi = 0; wi < kWarps; ++wi) {
      std::array<float, kWarpSize> x;
      for (int lane = 0; lane < kWarpSize; ++lane) {
        const int t = wi * kWarpSize + lane;
        const int v0 = sb + (tile * kThreads + t) * kChunk;
        float sum = 0.0f;
        for (int e = 0; e < kChunk; ++e) {
          const int v = v0 + e;
          float wv = 0.0f;
          if (v < se) {
            wv = draw_weight(mode, logit_at(r, v), mode == kWeightTarget ? 0.0f : q_at(r, v), ps, inv_t, eta);
            if (wv > 0.0f && v > *last_pos) *last_pos = v;
          }
          w[t * kChunk + e] = wv;
          sum = f_add(sum, wv);
        }
        x[lane] = sum;
      }
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
  };
  auto ntiles = [&](int s) {
    const int nchunks = (slice_end(s, r.V) - slice_begin(s, r.V) + kChunk - 1) / kChunk;
    return (nchunks + kThreads - 1) / kThreads;
  };

  for (int attempt = 0; attempt < 2; ++attempt) {
    int last_pos = -1;
    std::array<float, kSlices> slice_total;
    for (int s = 0; s < kSlices; ++s) {
      slice_total[s] = 0.0f;
      for (int tile = 0; tile < ntiles(s); ++tile)
        slice_total[s] = f_add(slice_total[s], tile_scan(s, tile, slice_total[s], &last_pos));
    }
    float total = 0.0f;
    for (int s = 0; s < kSlices; ++s) total = f_add(total, slice_total[s]);
    if (!(total > 0.0f)) {
      if (mode == kWeightResidual) {
        mode = kWeightTarget;  // all-zero residual: draw from p
        continue;
      }
      return ps.argmax_z;  // degenerate row (all logits -inf): no weight anywhere
    }
    const float target = f_mul(u, total);
    float slice_base = 0.0f;  // T_0 + ... + T_{s-1}
    int ignored = -1;
    for (int s = 0; s < kSlices; ++s) {
      float tile_base = slice_base;
      for (int tile = 0; tile < ntiles(s); ++tile) {
        const float tile_total = tile_scan(s, tile, tile_base, &ignored);
        const int v_tile = slice_begin(s, r.V) + tile * kTile;
        for (int t = 0; t < kThreads; ++t) {
          float run = base[t];
          for (int e = 0; e < kChunk; ++e) {
            const float wv = w[t * kChunk + e];
            run = f_add(run, wv);
            if (wv > 0.0f && run > target) return v_tile + t * kChunk + e;
          }
        }
        tile_base = f_add(tile_base, tile_total);
      }
      slice_base = f_add(slice_base, slice_total[s]);
    }
    return last_pos;  // rounding left u * total at or past the last prefix
  }
  return ps.argmax_z;
}

class TwinVerifier final : public PositionVerifier {
 public:
  explicit TwinVerifier(const VerifyParams& p) : p_(p) {}

  Decision drafted(const void* z, const float* q, int64_t x, float u, float u_final) override {
    RowView r{z, q, true, x, p_.logits_kind, p_.vocab};
    const PositionStats ps = position_stats(r, p_.inv_t, p_.eta, p_.alpha);
    if (p_.greedy) {
      const int best = p_.eta > 0.0f ? ps.argmax_a : ps.argmax_z;
      return {x == best, best};
    }
    float pv, p_hat;
    const float q_x = q_at(r, static_cast<int>(x));
    token_probs(load_logit(z, p_.logits_kind, x), q_x, ps, p_.inv_t, p_.eta, &pv, &p_hat);
    if (accept_draft(u, q_x, p_hat)) return {true, 0};
    return {false, draw_token(r, ps, kWeightResidual, p_.inv_t, p_.eta, u_final)};
  }

  int bonus(const void* z, float u_final) override {
    RowView r{z, nullptr, false, -1, p_.logits_kind, p_.vocab};
    const PositionStats ps = position_stats(r, p_.inv_t, 0.0f, p_.alpha);
    return p_.greedy ? ps.argmax_z : draw_token(r, ps, kWeightTarget, p_.inv_t, p_.eta, u_final);
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
