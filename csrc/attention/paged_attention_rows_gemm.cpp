// paged_attention_rows_gemm.h's route: rows sorted by position in tiles of at most kTileVectors
// query vectors per kv head; a tile reads the keys [min lo, max hi) of its rows (sorted keys make
// each row's visible set one range), S = Q K^T by an ATen GEMM per (tile, kv head), the masked softmax of
// S in place (one pass for the max and the NaN/+inf rule, one for exp and the sum: only a row's
// visible range is read, the rest of its P row is set to 0), then P V and the 1 / l.
// GCC notes that 32-byte vector arguments change the ABI: the v8f helpers are always inlined
#pragma GCC diagnostic ignored "-Wpsabi"

#include "attention/paged_attention_rows_gemm.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "common/cpu_isa.h"
#include "common/parallel_largest_first.h"
#include "common/vec8.h"

namespace ragattn {
namespace {

constexpr int64_t kTileVectors = 96;  // at most this many query vectors (rows x the GQA group) per tile and kv head
constexpr int64_t kMinItems = 4;     // at least this many (tile, kv head) work items where the rows allow

// Lanes [0, n) of p (n < 8) widened with -inf (neutral for the max and the NaN/+inf test).
RAGATTN_ALWAYS_INLINE v8f load_tail(const float* p, int64_t n) {
  v8f x = v8f{} - std::numeric_limits<float>::infinity();
  for (int64_t u = 0; u < n; ++u) x[u] = p[u];
  return x;
}

// Each score row p[x * ld ...] (x = r * G + h, the tile's query vectors) becomes its softmax
// weights exp(s - m) over the visible columns [lo[r], hi[r]) and 0 elsewhere; m[x], l[x] its max
// and sum, bad[x] 1 when a visible score is NaN or +inf (its row is then all 0).
RAGATTN_CPU_CLONES void softmax_rows(float* s, int64_t nvec, int64_t G, int64_t ld, const int64_t* lo,
                                     const int64_t* hi, float scale, float softcap, float* m, float* l,
                                     unsigned char* bad) {
  const float inf = std::numeric_limits<float>::infinity(), big = std::numeric_limits<float>::max();
  for (int64_t x = 0; x < nvec; ++x) {
    float* p = s + x * ld;
    const int64_t c0 = lo[x / G], c1 = std::max(c0, hi[x / G]);
    std::fill(p, p + c0, 0.f);
    std::fill(p + c1, p + ld, 0.f);
    float sc = scale;
    if (softcap > 0.f) {  // score -> cap * tanh(score / cap)
      for (int64_t j = c0; j < c1; ++j) p[j] = softcap * std::tanh(p[j] * scale / softcap);
      sc = 1.f;
    }
    v8f vmax = v8f{} - inf;
    v8i nonfinite = {};
    int64_t j = c0;
    for (; j + 8 <= c1; j += 8) {  // the scale, the max and the NaN/+inf test in one pass
      v8f y;
      std::memcpy(&y, p + j, sizeof(y));
      y *= sc;
      std::memcpy(p + j, &y, sizeof(y));
      nonfinite |= ~(y <= big);  // NaN compares false; -inf is a valid score (weight 0)
      vmax = y > vmax ? y : vmax;
    }
    for (int64_t u = j; u < c1; ++u) p[u] *= sc;
    if (j < c1) {
      const v8f y = load_tail(p + j, c1 - j);
      nonfinite |= ~(y <= big);
      vmax = y > vmax ? y : vmax;
    }
    float mx = -inf;
    bool poisoned = false;
    for (int u = 0; u < 8; ++u) {
      poisoned |= nonfinite[u] != 0;
      mx = vmax[u] > mx ? vmax[u] : mx;
    }
    bad[x] = poisoned;
    m[x] = mx;
    if (poisoned || mx == -inf) {  // NaN, or nothing with weight: l = 0
      std::fill(p + c0, p + c1, 0.f);
      l[x] = 0.f;
      continue;
    }
    v8f sum = {};
    for (j = c0; j + 8 <= c1; j += 8) {
      v8f y;
      std::memcpy(&y, p + j, sizeof(y));
      const v8f e = exp8_nonpositive(y - mx);
      std::memcpy(p + j, &e, sizeof(e));
      sum += e;
    }
    if (j < c1) {
      const v8f e = exp8_nonpositive(load_tail(p + j, c1 - j) - mx);  // -inf lanes: 0
      for (int64_t u = 0; u < c1 - j; ++u) p[j + u] = e[u];
      sum += e;
    }
    l[x] = hsum8(sum);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> paged_attention_rows_gemm(const at::Tensor& q, const int64_t* row_pos,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const int64_t* key_pos, float scale,
                                                             int64_t window_left, float softcap) {
  const int64_t nr = q.size(0), Hq = q.size(1), D = q.size(2), H = k.size(0), n = k.size(1), G = Hq / H;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  at::Tensor out = at::empty({nr, Hq, D}, q.options());
  at::Tensor lse = at::empty({nr, Hq}, q.options());
  float* o = out.data_ptr<float>();
  float* ls = lse.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  // each row's visible keys [lo, hi) (key_pos ascending)
  std::vector<int64_t> lo(nr), hi(nr);
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t p = row_pos[r];
    hi[r] = std::upper_bound(key_pos, key_pos + n, p) - key_pos;
    lo[r] = window_left >= 0 && p > window_left ? std::lower_bound(key_pos, key_pos + n, p - window_left) - key_pos : 0;
  }
  // Tiles of rows: at most kTileVectors query vectors per kv head, and at least kMinItems work
  // items (tile, kv head) where the rows allow, so that two threads get work at 1 to 3 kv heads.
  // The tiling depends on the shape alone, never on the thread count: the answer is the same on any
  // number of threads.
  const int64_t min_tiles = std::max<int64_t>(1, std::min(nr, (kMinItems + H - 1) / H));
  const int64_t tile = std::max<int64_t>(1, std::min(kTileVectors / G, (nr + min_tiles - 1) / min_tiles));
  const int64_t tiles = (nr + tile - 1) / tile;
  // each tile's key range [c0, c0 + nk): the union of its rows' visible ranges
  std::vector<int64_t> tc0(tiles), tnk(tiles);
  for (int64_t ti = 0; ti < tiles; ++ti) {
    int64_t c0 = n, c1 = 0;
    for (int64_t r = ti * tile; r < std::min(nr, (ti + 1) * tile); ++r) {
      if (lo[r] < hi[r]) c0 = std::min(c0, lo[r]), c1 = std::max(c1, hi[r]);
    }
    if (c0 >= c1) c0 = c1 = 0;
    tc0[ti] = c0;
    tnk[ti] = c1 - c0;
  }
  // One work item is (tile, kv head): S = Q K^T, its masked softmax, P V and the 1 / l, all on one
  // thread (at::mm_out runs single-threaded inside a parallel region). The softmax and the output
  // loops then run on every thread too, and S stays in that thread's cache between the two GEMMs.
  // Items cost about rows x keys, which grows along a causal sequence: largest first.
  std::vector<int64_t> cost(tiles * H);
  for (int64_t item = 0; item < tiles * H; ++item)
    cost[item] = std::min(tile, nr - item / H * tile) * std::max<int64_t>(tnk[item / H], 1);
  parallel_largest_first(largest_first(cost), [&](auto next_item) {
    // one query, score and output buffer per thread, for its largest item
    // (uninitialised: every element an item reads, it has written)
    const at::Tensor qtile = at::empty({tile * G * D}, q.options()), stile = at::empty({tile * G * n}, q.options()),
                     atile = at::empty({tile * G * D}, q.options());
    float* qbuf = qtile.data_ptr<float>();
    std::vector<int64_t> tlo(tile), thi(tile);
    std::vector<float> m(tile * G), l(tile * G);
    std::vector<unsigned char> bad(tile * G);
    for (int64_t item = next_item(); item >= 0; item = next_item()) {
      const int64_t ti = item / H, g = item % H, r0 = ti * tile, t = std::min(tile, nr - r0), M = t * G;
      const int64_t c0 = tc0[ti], nk = tnk[ti];
      for (int64_t r = 0; r < t; ++r) {
        tlo[r] = std::min(std::max<int64_t>(lo[r0 + r] - c0, 0), nk);
        thi[r] = std::min(std::max<int64_t>(hi[r0 + r] - c0, tlo[r]), nk);
      }
      const float* ap = atile.data_ptr<float>();
      if (nk > 0) {
        // kv head g's query vectors [M, D], row-major (r, h)
        for (int64_t r = 0; r < t; ++r)
          std::memcpy(qbuf + r * G * D, qp + ((r0 + r) * Hq + g * G) * D, G * D * sizeof(float));
        const at::Tensor qt = qtile.narrow(0, 0, M * D).view({M, D});
        at::Tensor scores = stile.narrow(0, 0, M * nk).view({M, nk});
        at::mm_out(scores, qt, k.select(0, g).narrow(0, c0, nk).t());
        softmax_rows(scores.data_ptr<float>(), M, G, nk, tlo.data(), thi.data(), scale, softcap, m.data(), l.data(),
                     bad.data());
        at::Tensor acc = atile.narrow(0, 0, M * D).view({M, D});
        at::mm_out(acc, scores, v.select(0, g).narrow(0, c0, nk));
      }
      for (int64_t r = 0; r < t; ++r) {
        for (int64_t h = 0; h < G; ++h) {
          const int64_t x = r * G + h;  // (row, head) in the item
          float* orow = o + ((r0 + r) * Hq + g * G + h) * D;
          float* lrow = ls + (r0 + r) * Hq + g * G + h;
          if (nk > 0 && bad[x]) {
            std::fill(orow, orow + D, nan);
            *lrow = nan;
          } else if (nk == 0 || l[x] == 0.f) {  // no visible slot with weight (l >= 1 otherwise)
            std::fill(orow, orow + D, 0.f);
            *lrow = -inf;
          } else {
            const float inv = 1.f / l[x];
            const float* a = ap + x * D;
            for (int64_t d = 0; d < D; ++d) orow[d] = std::isfinite(a[d]) ? a[d] * inv : nan;
            *lrow = m[x] + logf(l[x]);
          }
        }
      }
    }
  });
  return {out, lse};
}

}  // namespace ragattn
