// What the two CPU paged-attention kernels share (paged_attention_cpu.cpp: the padded block
// table; paged_attention_tagged_cpu.cpp: position-tagged page lists): the index view and layout
// checks, the kernels' argument struct and the online-softmax row state with its chunk step. Each
// kernel lives in a translation unit of its own so that the build compiles them in parallel.
//
// Kernel: one task per (query row, kv head). Only the row's visible slots are read, in place
// through the page table (no gather, no mask), in chunks of kChunk slots aligned to absolute slot
// multiples, with an online softmax. Per chunk: the scores of the GQA group's heads (each K row
// loaded once for two heads, eight dot products per reduction), the exp, then the V rows
// accumulated into register-resident outputs (each V row loaded once for two heads). A row's
// result depends only on its own visible slots (never on the other rows of the call).
// Semantics are the op's (docs/ops.md): row i of sequence b sees slot j iff j < kv_lens[b],
// j <= q_pos[i] and (window_left < 0 or j >= q_pos[i] - window_left); a NaN or +inf visible score
// makes the (row, head) NaN in out and lse, a -inf one has weight 0 (varlen_attention's rule); a
// non-finite visible v[j, d] makes out[i, h, d] NaN;
// a row that sees nothing gets out 0 and lse -inf.
#pragma once

// GCC notes that 32-byte vector arguments change the ABI: the v8f helpers are always inlined
#pragma GCC diagnostic ignored "-Wpsabi"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention/cpu_attention_blocks_c10.h"
#include "attention/softmax_math.h"
#include "common/check_message.h"
#include "common/cpu_isa.h"
#include "common/vec8.h"

namespace ragattn {
namespace paged_cpu {

// ------------------------------------------------------------------------------------ checks
// The public ops validate every argument in Python (ragattn/ops/paged_attention.py: named
// messages, the same on every backend, the fake impl included) before they call these private
// kernels. What stays here is what the kernels need to read memory safely when called on their
// own: the layout in one check each, and every index value they follow (one pass each, with the
// messages the public op documents: these are the CPU's value checks).

// A 1-D or 2-D int32/int64 index tensor read element by element (metadata is tiny: no copies).
struct IndexView {
  const void* data;
  bool is64;
  int64_t s0, s1;
  explicit IndexView(const at::Tensor& t)
      : data(t.data_ptr()), is64(t.scalar_type() == at::kLong), s0(t.dim() ? t.stride(0) : 0),
        s1(t.dim() > 1 ? t.stride(1) : 0) {}
  int64_t operator()(int64_t i, int64_t j = 0) const {
    const int64_t off = i * s0 + j * s1;
    return is64 ? static_cast<const int64_t*>(data)[off] : static_cast<const int32_t*>(data)[off];
  }
};

// An index tensor: int32/int64, CPU, [n] (n < 0: any length).
inline void check_index(const char* op, const char* name, const at::Tensor& x, int64_t n) {
  RAGATTN_CHECK_TYPE(x.scalar_type() == at::kInt || x.scalar_type() == at::kLong, op, ": ", name,
                     " must be int32 or int64");
  RAGATTN_CHECK_VALUE(x.dim() == 1 && (n < 0 || x.size(0) == n) && x.device().is_cpu(), op, ": ", name,
                      " must be a CPU [", n < 0 ? std::string("n") : std::to_string(n), "] tensor");
}

// The layout both kernels read: q [N, H, D], k/v_cache [pages, page_size, H_kv, D] in q's dtype,
// q_pos [N], cu_seqlens_q [B + 1], kv_lens [B]; outputs (when given) like q and float32 [N, H].
inline void check_layout(const char* op, const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& kv_lens,
                  const at::Tensor* out, const at::Tensor* lse_out) {
  RAGATTN_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                          k_cache.size(3) == q.size(2) && k_cache.size(2) >= 1 && q.size(1) % k_cache.size(2) == 0 &&
                          k_cache.size(1) >= 1,
                      op, ": q [N, H, D] and k_cache, v_cache [pages, page_size, H_kv, D] with H_kv dividing H");
  RAGATTN_CHECK_TYPE(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), op,
                     ": q, k_cache and v_cache must share a dtype");
  RAGATTN_CHECK_VALUE(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), op,
                      ": CPU tensors only");
  RAGATTN_CHECK_VALUE(kv_lens.dim() == 1, op, ": kv_lens must be a CPU [B] tensor");
  const int64_t batch = kv_lens.size(0);
  check_index(op, "q_pos", q_pos, q.size(0));
  check_index(op, "cu_seqlens_q", cu_seqlens_q, batch + 1);
  check_index(op, "kv_lens", kv_lens, batch);
  if (out != nullptr)
    RAGATTN_CHECK_VALUE(out->sizes() == q.sizes() && out->scalar_type() == q.scalar_type() && out->device().is_cpu() &&
                            lse_out->dim() == 2 && lse_out->size(0) == q.size(0) && lse_out->size(1) == q.size(1) &&
                            lse_out->scalar_type() == at::kFloat && lse_out->device().is_cpu(),
                        op, ": out must be like q and lse_out float32 [N, H], on the CPU");
}

// cu_seqlens_q [batch + 1]'s values: from 0 to the packed length total_q, non-decreasing.
inline void check_cu_seqlens_values(const char* op, const IndexView& cu, int64_t batch, int64_t total_q) {
  RAGATTN_CHECK_VALUE(cu(0) == 0 && cu(batch) == total_q, op, ": cu_seqlens_q must start at 0 and end at ", total_q,
                      " (the packed length), got ", cu(0), " .. ", cu(batch));
  for (int64_t b = 0; b < batch; ++b)
    RAGATTN_CHECK_VALUE(cu(b + 1) >= cu(b), op, ": cu_seqlens_q must be non-decreasing");
}
// ------------------------------------------------------------------------------------ kernel

constexpr int64_t kChunk = 128;      // slots per online-softmax step (a multiple of 8)
constexpr int64_t kPRow = kChunk + 8;  // a head's score row: whole 8-lane stores past the chunk's end

struct PagedArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  const int64_t* row_seq;  // sequence of each query row
  IndexView q_pos, block_table, kv_lens;
  int64_t num_heads, num_kv_heads, head_dim, page_size;
  int64_t q_s0, q_s1, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, o_s0, o_s1, l_s0, l_s1;
  float scale;
  int64_t window_left;
  float softcap;  // logits_soft_cap (0: off)
};


// One online-softmax step of a head over its scores ph[first, first + n) of this chunk (chunk-
// local slots; lanes of the 8-aligned cover outside the range become -inf), then
// softmax_exp_step. Returns false (and changes nothing else) when a visible score is NaN or +inf.
RAGATTN_ALWAYS_INLINE bool softmax_step(float* ph, int64_t first, int64_t n, float* m, float* l, float* alpha) {
  const float inf = std::numeric_limits<float>::infinity(), big = std::numeric_limits<float>::max();
  const v8f iota = {0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f};
  const v8f minus_inf = v8f{} - inf;
  const int64_t v0 = first / 8 * 8, v1 = (first + n + 7) / 8 * 8;
  v8f vmax = minus_inf;
  v8i nonfinite = {};
  for (int64_t s = v0; s < v1; s += 8) {
    const v8f slot = iota + static_cast<float>(s);  // exact: s < kChunk
    const v8i visible = (slot >= static_cast<float>(first)) & (slot < static_cast<float>(first + n));
    v8f x = load8(ph + s);
    nonfinite |= visible & ~(x <= big);  // NaN compares false; -inf is a valid score (weight 0)
    x = visible ? x : minus_inf;
    vmax = x > vmax ? x : vmax;
    store8(ph + s, x);
  }
  return softmax_exp_step(ph, v0, v1, vmax, nonfinite, m, l, alpha);
}


// The online softmax of G query vectors (one query row's heads of one kv head, or the heads of
// several rows stacked), over buffers a RowStateBuffer owns; part() views some of its vectors.
struct RowState {
  int64_t D, G;
  float* qf;     // [G, D] the query vectors in float
  float* acc;    // [G, D] unnormalised outputs
  float* p;      // [G, kPRow] scores, then probabilities
  float* m;      // [G] running max
  float* l;      // [G] running sum
  float* alpha;  // [G] this chunk's rescale of acc (0 for a poisoned head)
  float* bad;    // [G] 1: a NaN or +inf visible score

  RowState part(int64_t v0, int64_t n) const {
    return RowState{D, n, qf + v0 * D, acc + v0 * D, p + v0 * kPRow, m + v0, l + v0, alpha + v0, bad + v0};
  }

  // Row i's queries of kv head g's group; an empty softmax.
  template <typename T>
  RAGATTN_ALWAYS_INLINE void start(const PagedArgs& a, int64_t i, int64_t g) const {
    const T* qrow = static_cast<const T*>(a.q) + i * a.q_s0 + g * G * a.q_s1;
    for (int64_t h = 0; h < G; ++h) {
      for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(qrow[h * a.q_s1 + d]);
      m[h] = -std::numeric_limits<float>::infinity();
      l[h] = 0.f;
      bad[h] = 0.f;
    }
    std::fill(acc, acc + G * D, 0.f);
  }

  // out and lse of row i's G heads: NaN when poisoned, 0 and -inf when nothing was visible.
  template <typename T>
  RAGATTN_ALWAYS_INLINE void write(const PagedArgs& a, int64_t i, int64_t g) const {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t h = 0; h < G; ++h) {
      const int64_t head = g * G + h;
      T* orow = static_cast<T*>(a.out) + i * a.o_s0 + head * a.o_s1;
      float* lse = a.lse + i * a.l_s0 + head * a.l_s1;
      if (bad[h] != 0.f) {
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(nan);
        *lse = nan;
      } else if (l[h] == 0.f) {  // no visible slot (l >= 1 otherwise: the max slot contributes 1)
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(0.f);
        *lse = -std::numeric_limits<float>::infinity();
      } else {
        const float inv = 1.f / l[h];
        const float* acch = acc + h * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(std::isfinite(acch[d]) ? acch[d] * inv : nan);
        *lse = m[h] + logf(l[h]);
      }
    }
  }
};

struct RowStateBuffer {
  std::vector<float> buf;
  RowState st;
  RowStateBuffer(int64_t D, int64_t G) : buf(G * D * 2 + G * kPRow + G * 4) {
    float* b = buf.data();
    st = RowState{D, G, b, b + G * D, b + 2 * G * D, b + 2 * G * D + G * kPRow, b + 2 * G * D + G * kPRow + G,
                  b + 2 * G * D + G * kPRow + 2 * G, b + 2 * G * D + G * kPRow + 3 * G};
  }
};

// The online-softmax step and the V accumulation of the slots [first, first + n) of a chunk whose
// scores st.p[h][first, first + n) are computed (attend_chunk, or the tagged kernel's per-entry
// query rotations); V rows are vslot[first ...].
template <typename T>
RAGATTN_ALWAYS_INLINE void attend_scored_chunk(const RowState& st, const PagedArgs& a, const T* const* vslot,
                                               int64_t first, int64_t n) {
  const int64_t D = st.D, G = st.G;
  float* p = st.p;
  if (a.softcap > 0.f)  // score -> cap * tanh(score / cap)
    for (int64_t h = 0; h < G; ++h)
      for (int64_t s = first; s < first + n; ++s) p[h * kPRow + s] = a.softcap * std::tanh(p[h * kPRow + s] / a.softcap);
  for (int64_t h = 0; h < G; ++h) {
    st.alpha[h] = 0.f;  // a poisoned head's acc is never read again
    if (st.bad[h] == 0.f && !softmax_step(p + h * kPRow, first, n, st.m + h, st.l + h, st.alpha + h)) st.bad[h] = 1.f;
  }
  // heads in pairs: each V row loaded once for both
  int64_t h = 0;
  for (; h + 2 <= G; h += 2) accumulate<2, kPRow>(st.acc + h * D, p + h * kPRow + first, st.alpha + h, vslot + first, n, D);
  for (; h < G; ++h) accumulate<1, kPRow>(st.acc + h * D, p + h * kPRow + first, st.alpha + h, vslot + first, n, D);
}

// One online-softmax step over the visible slots [first, first + n) of a chunk, whose K and V
// rows are kslot/vslot[first ...] (kslot has 8 spare entries past the chunk for the padding).
template <typename T>
RAGATTN_ALWAYS_INLINE void attend_chunk(const RowState& st, const PagedArgs& a, const T** kslot, const T* const* vslot,
                                        int64_t first, int64_t n) {
  for (int64_t s = first + n; s < first + (n + 7) / 8 * 8; ++s) kslot[s] = kslot[first];
  // the G heads' scores (k padded with a visible slot to a multiple of 8; scores past n unused)
  dot_rows<kPRow>(st.qf, st.G, st.D, kslot + first, n, a.scale, st.p + first);
  attend_scored_chunk<T>(st, a, vslot, first, n);
}

// The sequence of each query row, from cu_seqlens_q.
inline std::vector<int64_t> row_sequences(const at::Tensor& cu_seqlens_q, int64_t total_q, int64_t batch) {
  std::vector<int64_t> row_seq(total_q);
  const IndexView cu(cu_seqlens_q);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = cu(b); r < cu(b + 1); ++r) row_seq[r] = b;
  return row_seq;
}

// The kernels' view of checked tensors (table: the padded block table or the flat page list).
inline PagedArgs paged_args(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& table, const at::Tensor& kv_lens, const std::vector<int64_t>& row_seq,
                     float scale, int64_t window_left, float softcap, const at::Tensor& out, const at::Tensor& lse_out) {
  return PagedArgs{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), lse_out.data_ptr<float>(),
                   row_seq.data(), IndexView(q_pos), IndexView(table), IndexView(kv_lens),
                   q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                   q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
                   lse_out.stride(0), lse_out.stride(1), scale, window_left, softcap};
}

inline at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace paged_cpu
}  // namespace ragattn
