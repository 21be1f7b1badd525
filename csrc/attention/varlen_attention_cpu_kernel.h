// The CPU kernel of ragattn::varlen_attention's forward, framework-free (no torch headers: the
// element type T is a template parameter; varlen_attention_cpu.cpp instantiates it for float,
// c10::Half and c10::BFloat16 with cpu_attention_blocks_c10.h's widening loads).
//
// Work item: a tile of up to kTileRows consecutive query rows of one sequence. Per tile, the keys
// visible to at least one of its rows are listed once (with a per-key bit mask of the rows that
// see it): when the sequence's kv_pos are non-decreasing, each row's [q_pos - window_left, q_pos]
// range is found by binary search and only blocks need a per-key test; otherwise every key of the
// sequence is tested. A key no row of the tile sees is never read. Then per kv head, the tile's
// rows x the GQA group's heads (up to kTileRows * G query vectors) run an online softmax over the
// list in steps of kChunk keys: each K row is loaded once for a pair of query vectors (eight dot
// products per horizontal reduction), a masked (row, key) pair's score is replaced by -inf (a
// select, never arithmetic), and each visible V row is accumulated into register-resident outputs
// for two heads of a row at a time (a row's masked keys are dropped from its list first, so
// 0 * NaN never happens). Results depend only on the row's own visible keys and the tiling of its
// sequence, never on the thread count.
//
// Semantics (the op's docstring, ragattn/ops/varlen_attention.py): a visible score that is NaN or
// +inf makes the (row, head) NaN in out and lse; -inf scores get weight 0 (as in the reference);
// a non-finite visible V element follows IEEE arithmetic; a row whose visible scores are all -inf,
// or that sees no key, gets out 0 (NaN where 0 * a non-finite V) and lse -inf.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/cpu_attention_blocks.h"
#include "attention/softmax_math.h"
#include "common/cpu_isa.h"
#include "common/vec8.h"

namespace ragattn {
namespace varlen_cpu {

constexpr int64_t kTileRows = 4;      // query rows per work item (<= 8: one bit each in a key's mask)
constexpr int64_t kChunk = 64;        // keys per online-softmax step (a multiple of 8)
constexpr int64_t kPRow = kChunk + 8;  // a query vector's score row: whole 8-lane blocks past n

struct Tile {
  int64_t r0, r1;  // query rows [r0, r1), one sequence
  int64_t k0, k1;  // the sequence's keys [k0, k1)
  bool kv_sorted;  // kv_pos non-decreasing over [k0, k1)
};

struct Args {
  const void* q;
  const void* k;
  const void* v;
  void* out;    // [total_q, H, D], row stride o_s0, head stride o_s1, unit last stride
  float* lse;   // [total_q, H] contiguous
  const int64_t* q_pos;  // [total_q] (defaults materialised)
  const int64_t* kv_pos;  // [total_k]
  const int64_t* q_block;  // [total_q], nullptr: no block test (every id -1)
  const int64_t* kv_block;  // [total_k]
  const int64_t* kv_run_end;  // [total_k] with blocks: the end of the run of equal kv_block ids at j
  const Tile* tiles;
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, o_s0, o_s1;
  float scale;
  bool causal;
  int64_t window_left;
  float softcap;  // logits_soft_cap: score -> softcap * tanh(score / softcap) after scaling; 0 = off
};

// tanh of 8 lanes, a few ulp: |y| < 0.25 by its odd Taylor series to y^9 (the next term is under
// 1e-8 relative), else (1 - e) / (1 + e) with e = exp(-2|y|) (no cancellation: e <= 0.61); +-inf
// give +-1, NaN stays NaN. (std::tanh per score cost ~8 ns, 1.4x a d256 row's whole attention.)
RAGATTN_ALWAYS_INLINE v8f tanh8(v8f y) {
  const v8f a = y < 0.f ? -y : y;
  const v8f e = exp8_nonpositive(-2.f * a);
  const v8f big = (1.f - e) / (1.f + e);
  const v8f y2 = y * y;
  v8f p = v8f{} + 62.f / 2835.f;
  p = p * y2 - 17.f / 315.f;
  p = p * y2 + 2.f / 15.f;
  p = p * y2 - 1.f / 3.f;
  const v8f small = y + y * y2 * p;
  v8f t = a < 0.25f ? small : (y < 0.f ? -big : big);
  return y != y ? y : t;
}

// Logit soft-capping of n scores in place (Gemma 2's attn_logit_softcapping): s -> cap * tanh(s / cap).
// Whole 8-lane steps: the score rows are padded to a multiple of 8 (lanes past n are never read).
RAGATTN_ALWAYS_INLINE void soft_cap_scores(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; i += 8) store8(s + i, cap * tanh8(load8(s + i) * inv));
}

// One online-softmax step of a query vector over its scores ph[0, n8) (n8 a multiple of 8) with
// the visibility lanes vis[0, n8) (-1: visible): masked lanes become -inf, then softmax_exp_step.
// Returns false (and changes nothing else) when a visible score is NaN or +inf.
RAGATTN_ALWAYS_INLINE bool softmax_step(float* ph, const int32_t* vis, int64_t n8, float* m, float* l, float* alpha) {
  const float inf = std::numeric_limits<float>::infinity(), big = std::numeric_limits<float>::max();
  const v8f minus_inf = v8f{} - inf;
  v8f vmax = minus_inf;
  v8i bad = {};
  for (int64_t s = 0; s < n8; s += 8) {
    v8i visible;
    std::memcpy(&visible, vis + s, sizeof(visible));
    v8f x = load8(ph + s);
    bad |= visible & ~(x <= big);  // NaN compares false; -inf is a valid score (weight 0)
    x = visible ? x : minus_inf;
    vmax = x > vmax ? x : vmax;
    store8(ph + s, x);
  }
  return softmax_exp_step(ph, 0, n8, vmax, bad, m, l, alpha);
}

// rows[0, n) of D elements as float rows: the rows themselves for float, else widened into buf.
template <typename T>
RAGATTN_ALWAYS_INLINE void widen_rows(const T* const* rows, int64_t n, int64_t D, float* buf, const float** out) {
  if constexpr (std::is_same<T, float>::value) {
    for (int64_t s = 0; s < n; ++s) out[s] = rows[s];
  } else {
    for (int64_t s = 0; s < n; ++s) {
      float* o = buf + s * D;
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) store8(o + d, load8(rows[s] + d));
      for (; d < D; ++d) o[d] = static_cast<float>(rows[s][d]);
      out[s] = o;
    }
  }
}

// Keys [0, n) of a step (offsets keys[s] from the bases, row bit masks masks[s]): their K and V
// rows as float (half types widened once per step, not per use; kptr padded to a multiple of 8
// with a listed key), the visibility lanes vis[r][s] (-1: row r sees key s; 0 past n) and
// seen[r], the number of keys row r sees.
template <typename T>
RAGATTN_ALWAYS_INLINE void step_keys(const T* k_base, int64_t k_s0, const T* v_base, int64_t v_s0,
                                     const int32_t* keys, const uint8_t* masks, int64_t n, int64_t R, int64_t D,
                                     float* kf, float* vf, const float** kptr, const float** vptr,
                                     int32_t (*vis)[kPRow], int64_t* seen) {
  const T* kin[kChunk];
  const T* vin[kChunk];
  const int64_t n8 = (n + 7) / 8 * 8;
  for (int64_t r = 0; r < R; ++r) seen[r] = 0;
  for (int64_t s = 0; s < n; ++s) {
    kin[s] = k_base + keys[s] * k_s0;
    vin[s] = v_base + keys[s] * v_s0;
    for (int64_t r = 0; r < R; ++r) {
      const bool on = (masks[s] >> r) & 1u;
      vis[r][s] = on ? -1 : 0;
      seen[r] += on;
    }
  }
  widen_rows(kin, n, D, kf, kptr);
  widen_rows(vin, n, D, vf, vptr);
  for (int64_t s = n; s < n8; ++s) {
    kptr[s] = kptr[0];
    vptr[s] = vptr[0];
    for (int64_t r = 0; r < R; ++r) vis[r][s] = 0;
  }
}

// acc[h] (h < G, rows D apart) = alpha[h] acc[h] + sum of w[h * kPRow + s] * rows[s] over the
// keys s < n a row sees (vis[s] != 0, seen of them): its masked keys dropped first (compacted into
// pc / crow), so 0 * a non-finite row never happens; heads in pairs (each row loaded once for both).
RAGATTN_ALWAYS_INLINE void accumulate_visible(float* acc, const float* w, const float* alpha, const float* const* rows,
                                              const int32_t* vis, int64_t seen, int64_t n, int64_t G, int64_t D,
                                              float* pc, const float** crow) {
  if (seen != n) {
    int64_t c = 0;
    for (int64_t s = 0; s < n; ++s) {
      if (!vis[s]) continue;
      crow[c] = rows[s];
      for (int64_t h = 0; h < G; ++h) pc[h * kPRow + c] = w[h * kPRow + s];
      ++c;
    }
    w = pc;
    rows = crow;
  }
  int64_t h = 0;
  for (; h + 2 <= G; h += 2) accumulate<2, kPRow>(acc + h * D, w + h * kPRow, alpha + h, rows, seen, D);
  for (; h < G; ++h) accumulate<1, kPRow>(acc + h * D, w + h * kPRow, alpha + h, rows, seen, D);
}

// Whether query row r sees key j by the op's rule (positions int64: no wrap at the int32 limits).
RAGATTN_ALWAYS_INLINE bool visible(const Args& a, int64_t r, int64_t j) {
  const int64_t qp = a.q_pos[r], kp = a.kv_pos[j];
  if (a.causal && kp > qp) return false;
  if (a.window_left >= 0 && kp < qp - a.window_left) return false;
  if (a.q_block == nullptr) return true;
  const int64_t qb = a.q_block[r], kb = a.kv_block[j];
  return qb == -1 || kb == -1 || qb == kb;
}

// Per-tile scratch, reused across the tiles of one task.
struct Scratch {
  std::vector<float> buf;
  std::vector<int32_t> keys;    // the tile's listed keys
  std::vector<uint8_t> masks;   // per listed key: bit r = row r of the tile sees it
  Scratch(int64_t G, int64_t D) {
    const int64_t nv = kTileRows * G;
    buf.resize(nv * D * 2 + nv * kPRow + nv * 4 + G * kPRow + 2 * kChunk * D);
  }
};

// The keys of tile t that some row of it sees (offsets from t.k0, in order) and per key the bit
// mask of those rows, into sc.keys / sc.masks.
template <typename Scr>
RAGATTN_ALWAYS_INLINE void list_tile_keys(const Args& a, const Tile& t, Scr& sc) {
  const int64_t R = t.r1 - t.r0;
  int64_t lo[kTileRows], hi[kTileRows];
  bool test[kTileRows];
  int64_t u0 = t.k1, u1 = t.k0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t qp = a.q_pos[t.r0 + r];
    lo[r] = t.k0;
    hi[r] = t.k1;
    test[r] = true;
    if (t.kv_sorted) {
      const int64_t* kp = a.kv_pos;
      if (a.window_left >= 0) lo[r] = std::lower_bound(kp + t.k0, kp + t.k1, qp - a.window_left) - kp;
      if (a.causal) hi[r] = std::upper_bound(kp + t.k0, kp + t.k1, qp) - kp;
      test[r] = a.q_block != nullptr && a.q_block[t.r0 + r] != -1;  // positions alone decide otherwise
    }
    if (lo[r] < hi[r]) {
      u0 = std::min(u0, lo[r]);
      u1 = std::max(u1, hi[r]);
    }
  }
  sc.keys.clear();
  sc.masks.clear();
  for (int64_t j = u0; j < u1; ++j) {
    uint32_t mask = 0;
    for (int64_t r = 0; r < R; ++r)
      if (j >= lo[r] && j < hi[r] && (!test[r] || visible(a, t.r0 + r, j))) mask |= 1u << r;
    if (mask) {
      sc.keys.push_back(static_cast<int32_t>(j - t.k0));
      sc.masks.push_back(static_cast<uint8_t>(mask));
    } else if (a.kv_block != nullptr && a.kv_block[j] != -1) {
      // a chunk block none of the tile's rows may see: skip its run of keys (Block-Attention)
      const int64_t kb = a.kv_block[j];
      bool skip = true;
      for (int64_t r = 0; r < R && skip; ++r) {
        const int64_t qb = a.q_block[t.r0 + r];
        skip = qb != -1 && qb != kb;
      }
      if (skip) j = std::min(u1, a.kv_run_end[j]) - 1;
    }
  }
}

template <typename T>
RAGATTN_ALWAYS_INLINE void run_tile(const Args& a, const Tile& t, Scratch& sc) {
  const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, R = t.r1 - t.r0, nv = R * G;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float* qf = sc.buf.data();               // [nv, D] query vectors (row r, head h: r * G + h), float
  float* acc = qf + kTileRows * G * D;     // [nv, D] unnormalised outputs
  float* p = acc + kTileRows * G * D;      // [nv, kPRow] scores, then probabilities
  float* m = p + kTileRows * G * kPRow;    // [nv] running max
  float* l = m + kTileRows * G;            // [nv] running sum
  float* alpha = l + kTileRows * G;        // [nv] this step's rescale of acc
  float* bad = alpha + kTileRows * G;      // [nv] 1: a NaN or +inf visible score
  float* pc = bad + kTileRows * G;         // [G, kPRow] a row's probabilities over its own keys
  float* kf = pc + G * kPRow;              // [kChunk, D] half types: the step's K rows in float
  float* vf = kf + kChunk * D;             // [kChunk, D] and V rows
  alignas(32) int32_t vis[kTileRows][kPRow];
  const float* kptr[kChunk + 8];  // the step's K and V rows as float (in place for float inputs)
  const float* vptr[kChunk + 8];
  const float* vrow[kChunk];

  list_tile_keys(a, t, sc);  // 1. the keys some row of the tile sees, with their row masks
  const int64_t n_keys = static_cast<int64_t>(sc.keys.size());

  // 2. per kv head: the tile's query vectors over the listed keys
  for (int64_t g = 0; g < a.num_kv_heads; ++g) {
    for (int64_t r = 0; r < R; ++r) {
      const T* qrow = static_cast<const T*>(a.q) + (t.r0 + r) * a.q_s0 + g * G * a.q_s1;
      for (int64_t h = 0; h < G; ++h)
        for (int64_t d = 0; d < D; ++d) qf[(r * G + h) * D + d] = static_cast<float>(qrow[h * a.q_s1 + d]);
    }
    for (int64_t i = 0; i < nv; ++i) {
      m[i] = neg_inf;
      l[i] = 0.f;
      bad[i] = 0.f;
    }
    std::fill(acc, acc + nv * D, 0.f);
    const T* k_base = static_cast<const T*>(a.k) + t.k0 * a.k_s0 + g * a.k_s1;
    const T* v_base = static_cast<const T*>(a.v) + t.k0 * a.v_s0 + g * a.v_s1;
    for (int64_t c0 = 0; c0 < n_keys; c0 += kChunk) {
      const int64_t n = std::min(kChunk, n_keys - c0), n8 = (n + 7) / 8 * 8;
      int64_t seen[kTileRows];
      step_keys(k_base, a.k_s0, v_base, a.v_s0, sc.keys.data() + c0, sc.masks.data() + c0, n, R, D, kf, vf, kptr, vptr,
                vis, seen);
      dot_rows<kPRow>(qf, nv, D, kptr, n, a.scale, p);  // scores
      if (a.softcap > 0.f)
        for (int64_t iv = 0; iv < nv; ++iv) soft_cap_scores(p + iv * kPRow, n, a.softcap);
      for (int64_t r = 0; r < R; ++r) {
        if (seen[r] == 0) continue;
        for (int64_t h = 0; h < G; ++h) {
          const int64_t iv = r * G + h;
          alpha[iv] = 0.f;  // a poisoned vector's acc is never read again
          if (bad[iv] == 0.f && !softmax_step(p + iv * kPRow, vis[r], n8, m + iv, l + iv, alpha + iv)) bad[iv] = 1.f;
        }
        // the row's own keys: all listed keys, or its masked ones dropped (never 0 * V)
        accumulate_visible(acc + r * G * D, p + r * G * kPRow, alpha + r * G, vptr, vis[r], seen[r], n, G, D, pc, vrow);
      }
    }
    // 3. normalise and store
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t h = 0; h < G; ++h) {
        const int64_t iv = r * G + h, head = g * G + h, row = t.r0 + r;
        T* orow = static_cast<T*>(a.out) + row * a.o_s0 + head * a.o_s1;
        float* lse = a.lse + row * a.num_heads + head;
        const float* ai = acc + iv * D;
        if (bad[iv] != 0.f) {
          for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(nan);
          *lse = nan;
        } else if (l[iv] == 0.f) {  // no visible key, or every visible score -inf: acc is 0 or NaN
          for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(ai[d] == 0.f ? 0.f : nan);
          *lse = neg_inf;
        } else {
          const float inv = 1.f / l[iv];
          for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(ai[d] * inv);
          *lse = m[iv] + logf(l[iv]);
        }
      }
    }
  }
}

// Tiles [begin, end) of a.tiles.
template <typename T>
RAGATTN_ALWAYS_INLINE void run_tiles(const Args& a, int64_t begin, int64_t end) {
  Scratch sc(a.num_heads / a.num_kv_heads, a.head_dim);
  for (int64_t i = begin; i < end; ++i) run_tile<T>(a, a.tiles[i], sc);
}

// ------------------------------------------------------------------------------------ backward
// dq, dk, dv from the forward's out and lse (FlashAttention's backward): per visible (row, key)
// pair P = exp(score - lse), dP = dout . v, dS = P (dP - rowsum(dout * out)); dq = scale sum dS k,
// dk = scale sum dS q, dv = sum P dout. Work item: one (sequence, kv head), computed by one thread
// in a fixed order (its keys' dk/dv belong to it alone: no races, no dependence on the thread
// count); inside, the forward's tiles, listing and steps. A row's masked keys are dropped from
// its sums and a key's unseeing rows from its sums (never 0 * NaN).
struct BwdArgs {
  Args f;                 // q, k, v, index, tiles (f.out / f.lse unused)
  const void* dout;       // [total_q, H, D] contiguous
  const void* o;          // [total_q, H, D] contiguous, the forward's out
  const float* lse;       // [total_q, H] contiguous
  void* dq;               // [total_q, H, D] contiguous
  void* dk;               // [total_k, Hkv, D] contiguous
  void* dv;
  const int64_t* seq_tiles;  // [B + 1] tile range of each sequence
  const int64_t* cu_k;       // [B + 1]
};

struct BwdScratch {
  std::vector<float> buf;
  std::vector<int32_t> keys;
  std::vector<uint8_t> masks;
  std::vector<float> dkv;  // [2, keys of the sequence, D] dk, dv accumulators
  std::vector<const float*> rows;  // per key: the vectors that see it
  BwdScratch(int64_t G, int64_t D) {
    const int64_t nv = kTileRows * G;
    buf.resize(nv * D * 3 + nv * kPRow * 2 + nv * 3 + nv * 2 + 2 * kChunk * D + G * kPRow + D);
    rows.resize(2 * nv);
  }
};

template <typename T>
RAGATTN_ALWAYS_INLINE void run_bwd_item(const BwdArgs& a, int64_t b, int64_t g, BwdScratch& sc) {
  const Args& f = a.f;
  const int64_t D = f.head_dim, H = f.num_heads, G = H / f.num_kv_heads, Hkv = f.num_kv_heads;
  const int64_t k0 = a.cu_k[b], nk = a.cu_k[b + 1] - k0;
  const float one[1] = {1.f};
  const std::vector<float> ones_g(G, 1.f);
  const float* ones = ones_g.data();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t nvmax = kTileRows * G;
  float* qf = sc.buf.data();          // [nv, D] q rows (vector r * G + h)
  float* df = qf + nvmax * D;         // [nv, D] dout rows
  float* dqa = df + nvmax * D;        // [nv, D] dq accumulators (unscaled)
  float* p = dqa + nvmax * D;         // [nv, kPRow] scores, then P
  float* dp = p + nvmax * kPRow;      // [nv, kPRow] dout . v, then dS
  float* lse = dp + nvmax * kPRow;    // [nv] the forward's lse
  float* di = lse + nvmax;            // [nv] rowsum(dout * out)
  float* lse_nan = di + nvmax;        // [nv] 1: lse is NaN (a poisoned row: its gradients are NaN)
  float* w = lse_nan + nvmax;         // [2 nv] one key's dS and P weights over the vectors seeing it
  float* kf = w + 2 * nvmax;          // [kChunk, D]
  float* vf = kf + kChunk * D;        // [kChunk, D]
  float* pc = vf + kChunk * D;        // [G, kPRow] a row's dS over its own keys
  float* of = pc + G * kPRow;         // [D] one out row in float
  alignas(32) int32_t vis[kTileRows][kPRow];
  const float* kptr[kChunk + 8];
  const float* vptr[kChunk + 8];
  const float* krow[kChunk];
  sc.dkv.assign(2 * nk * D, 0.f);
  float* dka = sc.dkv.data();
  float* dva = dka + nk * D;
  const T* k_base = static_cast<const T*>(f.k) + k0 * f.k_s0 + g * f.k_s1;
  const T* v_base = static_cast<const T*>(f.v) + k0 * f.v_s0 + g * f.v_s1;
  for (int64_t ti = a.seq_tiles[b]; ti < a.seq_tiles[b + 1]; ++ti) {
    const Tile& t = f.tiles[ti];
    const int64_t R = t.r1 - t.r0, nv = R * G;
    list_tile_keys(f, t, sc);
    const int64_t n_keys = static_cast<int64_t>(sc.keys.size());
    if (n_keys == 0) {  // rows that see nothing: no gradient
      for (int64_t r = 0; r < R; ++r)
        for (int64_t h = 0; h < G; ++h) {
          T* out = static_cast<T*>(a.dq) + ((t.r0 + r) * H + g * G + h) * D;
          for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(0.f);
        }
      continue;
    }
    for (int64_t r = 0; r < R; ++r) {
      const T* qrow = static_cast<const T*>(f.q) + (t.r0 + r) * f.q_s0 + g * G * f.q_s1;
      for (int64_t h = 0; h < G; ++h) {
        const int64_t iv = r * G + h, off = ((t.r0 + r) * H + g * G + h) * D;
        const T* drow = static_cast<const T*>(a.dout) + off;
        const T* orow = static_cast<const T*>(a.o) + off;
        for (int64_t d = 0; d < D; ++d) {
          qf[iv * D + d] = static_cast<float>(qrow[h * f.q_s1 + d]);
          df[iv * D + d] = static_cast<float>(drow[d]);
          of[d] = static_cast<float>(orow[d]);
        }
        // rowsum(dout * out) in the dot products' summation order: a row that sees one key
        // (out = v) gets dS = P (dP - di) = 0 exactly, as the reference's softmax backward does
        const float* o8[8] = {of, of, of, of, of, of, of, of};
        di[iv] = dots8<1, 8>(df + iv * D, D, o8)[0];
        lse[iv] = a.lse[(t.r0 + r) * H + g * G + h];
        lse_nan[iv] = std::isnan(lse[iv]) ? 1.f : 0.f;
      }
    }
    std::fill(dqa, dqa + nv * D, 0.f);
    for (int64_t c0 = 0; c0 < n_keys; c0 += kChunk) {
      const int64_t n = std::min(kChunk, n_keys - c0), n8 = (n + 7) / 8 * 8;
      const int32_t* keys = sc.keys.data() + c0;
      int64_t seen[kTileRows];
      step_keys(k_base, f.k_s0, v_base, f.v_s0, keys, sc.masks.data() + c0, n, R, D, kf, vf, kptr, vptr, vis, seen);
      dot_rows<kPRow>(qf, nv, D, kptr, n, f.scale, p);
      if (f.softcap > 0.f)
        for (int64_t iv = 0; iv < nv; ++iv) soft_cap_scores(p + iv * kPRow, n, f.softcap);
      dot_rows<kPRow>(df, nv, D, vptr, n, 1.f, dp);
      // soft cap: d(cap tanh(s / cap)) / ds = 1 - (capped / cap)^2, applied to dS below
      const v8f inv_cap8 = v8f{} + (f.softcap > 0.f ? 1.f / f.softcap : 0.f);
      for (int64_t iv = 0; iv < nv; ++iv) {  // P and dS, 8 lanes (masked lanes: P 0, never summed)
        const int32_t* vr = vis[iv / G];
        const v8f l8 = v8f{} + lse[iv], d8 = v8f{} + di[iv];
        for (int64_t s = 0; s < n8; s += 8) {
          v8i on;
          std::memcpy(&on, vr + s, sizeof(on));
          const v8f x = load8(p + iv * kPRow + s);
          v8f pe = exp8_nonpositive(x - l8);  // -inf - -inf (NaN): 0
          pe = lse_nan[iv] != 0.f ? v8f{} + nan : pe;
          pe = on ? pe : v8f{};
          store8(p + iv * kPRow + s, pe);
          const v8f t = x * inv_cap8;  // 0 without a soft cap: factor 1
          const v8f ds = pe * (load8(dp + iv * kPRow + s) - d8) * (1.f - t * t);
          store8(dp + iv * kPRow + s, on ? ds : v8f{});
        }
      }
      // dq: each row over its own keys
      for (int64_t r = 0; r < R; ++r) {
        if (seen[r] == 0) continue;
        accumulate_visible(dqa + r * G * D, dp + r * G * kPRow, ones, kptr, vis[r], seen[r], n, G, D, pc, krow);
      }
      // dk, dv: each key over the vectors that see it
      const float** qrows = sc.rows.data();
      const float** drows = qrows + nvmax;
      for (int64_t s = 0; s < n; ++s) {
        int64_t c = 0;
        for (int64_t r = 0; r < R; ++r) {
          if (!vis[r][s]) continue;
          for (int64_t h = 0; h < G; ++h, ++c) {
            const int64_t iv = r * G + h;
            w[c] = dp[iv * kPRow + s];
            w[nvmax + c] = p[iv * kPRow + s];
            qrows[c] = qf + iv * D;
            drows[c] = df + iv * D;
          }
        }
        accumulate<1, kPRow>(dka + keys[s] * D, w, one, qrows, c, D);
        accumulate<1, kPRow>(dva + keys[s] * D, w + nvmax, one, drows, c, D);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < G; ++h) {
        T* out = static_cast<T*>(a.dq) + ((t.r0 + r) * H + g * G + h) * D;
        const float* src = dqa + (r * G + h) * D;
        for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(src[d] * f.scale);
      }
  }
  for (int64_t j = 0; j < nk; ++j) {
    T* dko = static_cast<T*>(a.dk) + ((k0 + j) * Hkv + g) * D;
    T* dvo = static_cast<T*>(a.dv) + ((k0 + j) * Hkv + g) * D;
    for (int64_t d = 0; d < D; ++d) {
      dko[d] = static_cast<T>(dka[j * D + d] * f.scale);
      dvo[d] = static_cast<T>(dva[j * D + d]);
    }
  }
}

// Items [begin, end): item = sequence * num_kv_heads + kv head.
template <typename T>
RAGATTN_ALWAYS_INLINE void run_bwd_items(const BwdArgs& a, int64_t begin, int64_t end) {
  BwdScratch sc(a.f.num_heads / a.f.num_kv_heads, a.f.head_dim);
  for (int64_t i = begin; i < end; ++i) run_bwd_item<T>(a, i / a.f.num_kv_heads, i % a.f.num_kv_heads, sc);
}

}  // namespace varlen_cpu
}  // namespace ragattn
