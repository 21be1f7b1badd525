// paged_attention's CPU kernels, private ops called by ragattn/ops/paged_attention.py (the op's
// one dispatch point, which validates every argument first): ragattn::_paged_attention_cpu reads a
// padded block table, ragattn::_paged_attention_tagged_cpu a flat, position-tagged page list with
// RoPE applied in the kernel (schemas in torch_bindings.cpp). Their own checks are the layout and
// the index values they follow (memory safety on a direct call); nothing here calls into Python.
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
// GCC notes that 32-byte vector arguments change the ABI: the v8f helpers are always inlined
#pragma GCC diagnostic ignored "-Wpsabi"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention/cpu_attention_blocks_c10.h"
#include "attention/paged_attention_rows_gemm.h"
#include "attention/softmax_math.h"
#include "kv_cache/rope_math.h"
#include "common/check_message.h"
#include "common/cpu_isa.h"
#include "common/vec8.h"
#include "ops.h"

namespace ragattn {
namespace {

// ------------------------------------------------------------------------------------ checks
// The public ops validate every argument in Python (ragattn/ops/paged_attention.py: named
// messages, the same on every backend, the fake impl included) before they call these private
// kernels. What stays here is what the kernels need to read memory safely when called on their
// own: the layout in one check each, and every index value they follow (one pass each, with the
// messages the public op documents: these are the CPU's value checks).

constexpr const char* kTaggedOp = "ragattn._paged_attention_tagged_cpu";

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
void check_index(const char* op, const char* name, const at::Tensor& x, int64_t n) {
  RAGATTN_CHECK_TYPE(x.scalar_type() == at::kInt || x.scalar_type() == at::kLong, op, ": ", name,
                     " must be int32 or int64");
  RAGATTN_CHECK_VALUE(x.dim() == 1 && (n < 0 || x.size(0) == n) && x.device().is_cpu(), op, ": ", name,
                      " must be a CPU [", n < 0 ? std::string("n") : std::to_string(n), "] tensor");
}

// The layout both kernels read: q [N, H, D], k/v_cache [pages, page_size, H_kv, D] in q's dtype,
// q_pos [N], cu_seqlens_q [B + 1], kv_lens [B]; outputs (when given) like q and float32 [N, H].
void check_layout(const char* op, const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q,
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
void check_cu_seqlens_values(const char* op, const IndexView& cu, int64_t batch, int64_t total_q) {
  RAGATTN_CHECK_VALUE(cu(0) == 0 && cu(batch) == total_q, op, ": cu_seqlens_q must start at 0 and end at ", total_q,
                      " (the packed length), got ", cu(0), " .. ", cu(batch));
  for (int64_t b = 0; b < batch; ++b)
    RAGATTN_CHECK_VALUE(cu(b + 1) >= cu(b), op, ": cu_seqlens_q must be non-decreasing");
}

// The padded-table kernel's index values: cu_seqlens_q, kv_lens, q_pos and the block_table
// entries kv_lens uses (the public op's CPU value checks, ragattn.paged_attention's messages).
void check_padded_values(const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q, const at::Tensor& block_table,
                         const at::Tensor& kv_lens, int64_t num_pages, int64_t page_size) {
  constexpr const char* op = "ragattn.paged_attention";
  const int64_t batch = kv_lens.size(0), total_q = q_pos.size(0), max_pages = block_table.size(1);
  check_cu_seqlens_values(op, IndexView(cu_seqlens_q), batch, total_q);
  const IndexView pos(q_pos), bt(block_table), lens(kv_lens);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens(b);
    RAGATTN_CHECK_VALUE(len >= 0 && len <= max_pages * page_size, op,
                        ": kv_lens must lie in [0, max_pages * page_size = ", max_pages * page_size, "], got ", len,
                        " for sequence ", b);
  }
  for (int64_t r = 0; r < total_q; ++r)
    RAGATTN_CHECK_VALUE(pos(r) >= 0, op, ": q_pos must be >= 0, got ", pos(r), " at row ", r);
  for (int64_t b = 0; b < batch; ++b) {
    // pages used by kv_lens: the first ceil(kv_lens / page_size) of each row; others may be anything
    for (int64_t j = 0; j * page_size < lens(b); ++j) {
      const int64_t page = bt(b, j);
      RAGATTN_CHECK_VALUE(page >= 0 && page < num_pages, op,
                          ": block_table entries used by kv_lens must lie in [0, num_pages = ", num_pages, "), got ",
                          page, " at [", b, ", ", j, "]");
    }
  }
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

// One online-softmax step over the visible slots [first, first + n) of a chunk, whose K and V
// rows are kslot/vslot[first ...] (kslot has 8 spare entries past the chunk for the padding).
template <typename T>
RAGATTN_ALWAYS_INLINE void attend_chunk(const RowState& st, const PagedArgs& a, const T** kslot, const T* const* vslot,
                                        int64_t first, int64_t n) {
  const int64_t D = st.D, G = st.G;
  float* p = st.p;
  for (int64_t s = first + n; s < first + (n + 7) / 8 * 8; ++s) kslot[s] = kslot[first];
  // the G heads' scores (k padded with a visible slot to a multiple of 8; scores past n unused)
  dot_rows<kPRow>(st.qf, G, D, kslot + first, n, a.scale, p + first);
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

// Query rows x kv heads [begin, end): item = row * num_kv_heads + kv_head.
template <typename T>
RAGATTN_ALWAYS_INLINE void paged_items(const PagedArgs& a, int64_t begin, int64_t end) {
  const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, S = a.page_size;
  RowStateBuffer sb(D, G);
  RowState& st = sb.st;
  // chunk-local slot pointers (+ 8: the last block of dots8 is padded with a visible slot)
  const T* kslot[kChunk + 8];
  const T* vslot[kChunk];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item / a.num_kv_heads, g = item % a.num_kv_heads;
    const int64_t b = a.row_seq[i];
    const int64_t pos = a.q_pos(i), kv_len = a.kv_lens(b);
    const int64_t hi = pos >= kv_len ? kv_len : pos + 1;  // never pos + 1 past int64 max
    const int64_t lo = a.window_left >= 0 ? std::max<int64_t>(0, pos - a.window_left) : 0;
    st.start<T>(a, i, g);
    const T* k_base = static_cast<const T*>(a.k) + g * a.k_s2;
    const T* v_base = static_cast<const T*>(a.v) + g * a.v_s2;
    int64_t page_idx = lo / S, off = lo % S;  // slot lo's page-table entry and offset, stepped below
    // chunks of absolute slots [c0, c0 + kChunk); this row reads [first, first + n) of each
    for (int64_t c0 = lo / kChunk * kChunk; lo < hi && c0 < hi; c0 += kChunk) {
      const int64_t first = std::max(lo, c0) - c0, n = std::min(hi, c0 + kChunk) - c0 - first;
      for (int64_t s = first; s < first + n;) {  // the visible slots' rows, page by page
        const int64_t page = a.block_table(b, page_idx);
        const T* kp = k_base + page * a.k_s0 + off * a.k_s1;
        const T* vp = v_base + page * a.v_s0 + off * a.v_s1;
        const int64_t run = std::min(S - off, first + n - s);
        for (int64_t u = 0; u < run; ++u, ++s) {
          kslot[s] = kp + u * a.k_s1;
          vslot[s] = vp + u * a.v_s1;
        }
        off += run;
        if (off == S) {
          off = 0;
          ++page_idx;
        }
      }
      attend_chunk<T>(st, a, kslot, vslot, first, n);
    }
    st.write<T>(a, i, g);
  }
}

// The one out-of-line copy of the kernel, per ISA (cpu_isa.h).
template <typename T>
RAGATTN_CPU_CLONES void paged_items_run(const PagedArgs& a, int64_t begin, int64_t end) {
  paged_items<T>(a, begin, end);
}

// --------------------------------------------------------------- position-tagged page lists
// paged_attention_run over a flat page list whose entries carry the position of their slot 0
// and their count of valid slots, with keys optionally stored without RoPE (zero-copy chunk pages:
// ragattn/hf/tagged.py, ragattn/reference/paged_attention_table.py). Slot j < kv_lens[b] lies in
// entry e = row_start[b] + j / page_size at offset o = j % page_size; it is valid iff
// o < entry_len[e] and holds position entry_pos[e] + o (without entry_pos: j). A row sees the valid
// slots at positions <= q_pos (and >= q_pos - window_left). Positions need not grow with j, so
// each entry's visible offsets are found from its first position, and only those slots enter a
// chunk (compacted: no masks). Keys are rotated once per call, in fp32 and rounded once to the
// cache's dtype (the Triton kernel's computation), into a scratch copy of the slots some row can
// see, with cos/sin from a per-position table (rope_cos/sin [P, rotary_dim / 2]) read once per
// slot for every kv head. (Rotating in each (row, kv head) task instead cost a decode step 1.12x
// the copy path's here, against 1.05x: the table reads and rotations were repeated per head.)

struct TaggedArgs {
  IndexView pages, row_start, entry_pos, entry_len;
  bool has_pos, has_len;
  const void* krot;          // [slots, num_kv_heads, head_dim] rotated keys, or nullptr: keys read in place
  const int64_t* slot_base;  // each sequence's first scratch slot
};

// The offsets [*o_lo, *o_hi) of an entry (first position p0, cnt valid slots) that a row at
// position pos sees; empty when *o_lo >= *o_hi. No int64 overflow for any pos, p0 >= 0.
RAGATTN_ALWAYS_INLINE void visible_offsets(int64_t pos, int64_t window_left, int64_t p0, int64_t cnt, int64_t* o_lo,
                                           int64_t* o_hi) {
  *o_hi = pos < p0 ? 0 : (pos - p0 < cnt ? pos - p0 + 1 : cnt);
  const int64_t first = window_left >= 0 ? pos - window_left : 0;  // >= -INT64_MAX
  *o_lo = first > p0 ? first - p0 : 0;
}

// Slot count of entry pi of a sequence of kv_len slots (page_size S), and its first position.
RAGATTN_ALWAYS_INLINE void entry_extent(const TaggedArgs& t, int64_t e, int64_t pi, int64_t S, int64_t kv_len,
                                        int64_t* cnt, int64_t* p0) {
  *cnt = std::min(S, kv_len - pi * S);
  if (t.has_len) *cnt = std::min(*cnt, t.entry_len(e));
  *p0 = t.has_pos ? t.entry_pos(e) : pi * S;
}

// dst = src rotated by the angles of (c, s) [half], pairs (f, f + half) or (2f, 2f + 1), in fp32,
// rounded once to T; dims past 2 * half copied. Two plain loops (one per layout) so that the
// compiler vectorises them.
template <typename T>
RAGATTN_ALWAYS_INLINE void rotate_row(const T* src, T* dst, const float* c, const float* s, int64_t half, int64_t D,
                                      bool interleaved) {
  float y1, y2;
  if (interleaved) {
    for (int64_t f = 0; f < half; ++f) {
      rope::rotate_pair(static_cast<float>(src[2 * f]), static_cast<float>(src[2 * f + 1]), c[f], s[f], &y1, &y2);
      dst[2 * f] = static_cast<T>(y1);
      dst[2 * f + 1] = static_cast<T>(y2);
    }
  } else {
    for (int64_t f = 0; f < half; ++f) {
      rope::rotate_pair(static_cast<float>(src[f]), static_cast<float>(src[f + half]), c[f], s[f], &y1, &y2);
      dst[f] = static_cast<T>(y1);
      dst[f + half] = static_cast<T>(y2);
    }
  }
  for (int64_t d = 2 * half; d < D; ++d) dst[d] = src[d];
}

// Items [begin, end) = row blocks x kv heads: item = block * num_kv_heads + kv_head, block k the
// rows [blocks[2k], blocks[2k] + blocks[2k + 1]) of one sequence. The slots every row of the block
// sees are attended by all their query vectors at once (each K/V row loaded once for the block);
// the rest (the causal diagonal, window edges) row by row, so no row ever reads a slot it does
// not see (no masks: 0 * NaN cannot happen).
template <typename T>
RAGATTN_ALWAYS_INLINE void tagged_items(const PagedArgs& a, const TaggedArgs& t, const int64_t* blocks,
                                        int64_t max_rows, int64_t begin, int64_t end) {
  const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, S = a.page_size, H = a.num_kv_heads;
  RowStateBuffer buf(D, max_rows * G);
  const T* kslot[kChunk + 8];
  const T* vslot[kChunk];
  std::vector<int64_t> lo(max_rows), hi(max_rows), pos(max_rows);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t k = item / H, g = item % H, i0 = blocks[2 * k], nr = blocks[2 * k + 1];
    const int64_t b = a.row_seq[i0];
    const int64_t kv_len = a.kv_lens(b), r0 = t.row_start(b);
    for (int64_t r = 0; r < nr; ++r) {
      pos[r] = a.q_pos(i0 + r);
      buf.st.part(r * G, G).start<T>(a, i0 + r, g);
    }
    const T* k_base = static_cast<const T*>(a.k) + g * a.k_s2;
    const T* v_base = static_cast<const T*>(a.v) + g * a.v_s2;
    const T* krot = t.krot ? static_cast<const T*>(t.krot) + (t.slot_base[b] * H + g) * D : nullptr;
    // pass -1: the slots all nr rows see, attended by all of them; pass r: row r's others
    for (int64_t pass = -1; pass < (nr > 1 ? nr : 0); ++pass) {
      const RowState st = pass < 0 ? buf.st.part(0, nr * G) : buf.st.part(pass * G, G);
      int64_t n = 0;
      for (int64_t pi = 0; pi * S < kv_len; ++pi) {
        int64_t cnt, p0, all_lo = 0, all_hi = std::numeric_limits<int64_t>::max();
        entry_extent(t, r0 + pi, pi, S, kv_len, &cnt, &p0);
        for (int64_t r = 0; r < nr; ++r) {
          visible_offsets(pos[r], a.window_left, p0, cnt, &lo[r], &hi[r]);
          all_lo = std::max(all_lo, lo[r]);
          all_hi = std::min(all_hi, hi[r]);
        }
        if (all_lo >= all_hi) all_lo = all_hi = 0;  // no slot of the entry seen by every row
        // the offsets of this pass: [all_lo, all_hi), or row `pass`'s range without it (which it
        // contains when not empty): two pieces
        int64_t ranges[2][2] = {{all_lo, all_hi}, {0, 0}};
        if (pass >= 0 && all_lo < all_hi) {
          ranges[0][0] = lo[pass], ranges[0][1] = all_lo;
          ranges[1][0] = all_hi, ranges[1][1] = hi[pass];
        } else if (pass >= 0) {
          ranges[0][0] = lo[pass], ranges[0][1] = hi[pass];
        }
        const int64_t page = t.pages(r0 + pi);
        const T* kp = krot ? krot + pi * S * H * D : k_base + page * a.k_s0;
        const int64_t k_step = krot ? H * D : a.k_s1;
        const T* vp = v_base + page * a.v_s0;
        for (const auto& rg : ranges) {
          for (int64_t o = rg[0]; o < rg[1]; ++o) {
            kslot[n] = kp + o * k_step;
            vslot[n] = vp + o * a.v_s1;
            if (++n == kChunk) {
              attend_chunk<T>(st, a, kslot, vslot, 0, n);
              n = 0;
            }
          }
        }
      }
      if (n) attend_chunk<T>(st, a, kslot, vslot, 0, n);
    }
    for (int64_t r = 0; r < nr; ++r) buf.st.part(r * G, G).write<T>(a, i0 + r, g);
  }
}

template <typename T>
RAGATTN_CPU_CLONES void tagged_items_run(const PagedArgs& a, const TaggedArgs& t, const int64_t* blocks,
                                         int64_t max_rows, int64_t begin, int64_t end) {
  tagged_items<T>(a, t, blocks, max_rows, begin, end);
}

// The rotated keys of sequences [b0, b1)'s entries [e0, e1) (flattened over the sequences: entry
// list `ents` of (sequence, page index)) whose slots lie in [pos_lo[b], pos_hi[b]], the positions
// some row of the sequence can see, into krot[slot_base[b] + slot].
template <typename T>
RAGATTN_CPU_CLONES void rotate_tagged_keys(const PagedArgs& a, const TaggedArgs& t, const int64_t* ents, int64_t e0,
                                           int64_t e1, const int64_t* pos_lo, const int64_t* pos_hi,
                                           const float* cos_t, const float* sin_t, int64_t rotary_dim,
                                           bool interleaved, T* krot) {
  const int64_t D = a.head_dim, S = a.page_size, H = a.num_kv_heads, half = rotary_dim / 2;
  for (int64_t x = e0; x < e1; ++x) {
    const int64_t b = ents[2 * x], pi = ents[2 * x + 1], e = t.row_start(b) + pi;
    int64_t cnt, p0, o_lo, o_hi;
    entry_extent(t, e, pi, S, a.kv_lens(b), &cnt, &p0);
    // [pos_lo, pos_hi] as visible_offsets' window: pos_hi is the last position, window pos_hi - pos_lo
    visible_offsets(pos_hi[b], pos_hi[b] - pos_lo[b], p0, cnt, &o_lo, &o_hi);
    const int64_t page = t.pages(e);
    for (int64_t o = o_lo; o < o_hi; ++o) {
      const float* c = cos_t + (p0 + o) * half;  // position p0 + o's row, read once for every kv head
      const float* s = sin_t + (p0 + o) * half;
      for (int64_t h = 0; h < H; ++h) {
        const T* src = static_cast<const T*>(a.k) + page * a.k_s0 + o * a.k_s1 + h * a.k_s2;
        T* dst = krot + ((t.slot_base[b] + pi * S + o) * H + h) * D;
        rotate_row(src, dst, c, s, half, D, interleaved);
      }
    }
  }
}

// Sequences with at least this many query rows take paged_attention_rows_gemm's route (at 290
// rows x 1.6K slots it ran about 2x faster than the row blocks below); decode rows never do.
constexpr int64_t kGemmMinRows = 16;

// Sequence b's rows [r_begin, r_end) by paged_attention_rows_gemm: its slots at positions
// [pos_lo, pos_hi] (the ones some row sees) gathered in position order, widened to float, keys
// rotated when t.krot holds them. Returns false (writing nothing) when one of those v rows holds
// a non-finite value: the GEMM would spread it to the rows that do not see it, so the row
// blocks handle that sequence.
template <typename T>
bool tagged_rows_gemm(const PagedArgs& a, const TaggedArgs& t, int64_t b, int64_t r_begin, int64_t r_end,
                      int64_t pos_lo, int64_t pos_hi) {
  const int64_t D = a.head_dim, S = a.page_size, H = a.num_kv_heads, Hq = a.num_heads, kv_len = a.kv_lens(b);
  const int64_t r0 = t.row_start(b), nr = r_end - r_begin;
  struct Slot {
    int64_t pos;
    const T* k;
    const T* v;
  };
  std::vector<Slot> slots;
  const T* krot = t.krot ? static_cast<const T*>(t.krot) + t.slot_base[b] * H * D : nullptr;
  const int64_t k_head = krot ? D : a.k_s2;
  for (int64_t pi = 0; pi * S < kv_len; ++pi) {
    int64_t cnt, p0, o_lo, o_hi;
    entry_extent(t, r0 + pi, pi, S, kv_len, &cnt, &p0);
    visible_offsets(pos_hi, pos_hi - pos_lo, p0, cnt, &o_lo, &o_hi);
    const int64_t page = t.pages(r0 + pi);
    for (int64_t o = o_lo; o < o_hi; ++o)
      slots.push_back({p0 + o, krot ? krot + (pi * S + o) * H * D : static_cast<const T*>(a.k) + page * a.k_s0 + o * a.k_s1,
                       static_cast<const T*>(a.v) + page * a.v_s0 + o * a.v_s1});
  }
  std::stable_sort(slots.begin(), slots.end(), [](const Slot& x, const Slot& y) { return x.pos < y.pos; });
  const int64_t n = static_cast<int64_t>(slots.size());
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor k = at::empty({H, n, D}, f32), v = at::empty({H, n, D}, f32);
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  std::vector<int64_t> key_pos(n);
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) {
    key_pos[j] = slots[j].pos;
    for (int64_t g = 0; g < H; ++g)
      for (int64_t d = 0; d < D; ++d) {
        kp[(g * n + j) * D + d] = static_cast<float>(slots[j].k[g * k_head + d]);
        const float x = static_cast<float>(slots[j].v[g * a.v_s2 + d]);
        finite &= std::isfinite(x);
        vp[(g * n + j) * D + d] = x;
      }
  }
  if (!finite) return false;
  std::vector<int64_t> rows(nr), row_pos(nr);
  for (int64_t r = 0; r < nr; ++r) rows[r] = r_begin + r;
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t x, int64_t y) { return a.q_pos(x) < a.q_pos(y); });
  at::Tensor q = at::empty({nr, Hq, D}, f32);
  float* qp = q.data_ptr<float>();
  for (int64_t r = 0; r < nr; ++r) {
    row_pos[r] = a.q_pos(rows[r]);
    const T* src = static_cast<const T*>(a.q) + rows[r] * a.q_s0;
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t d = 0; d < D; ++d) qp[(r * Hq + h) * D + d] = static_cast<float>(src[h * a.q_s1 + d]);
  }
  const auto res = paged_attention_rows_gemm(q, row_pos.data(), k, v, key_pos.data(), a.scale, a.window_left, a.softcap);
  const float* op = std::get<0>(res).data_ptr<float>();
  const float* lp = std::get<1>(res).data_ptr<float>();
  for (int64_t r = 0; r < nr; ++r) {
    T* dst = static_cast<T*>(a.out) + rows[r] * a.o_s0;
    for (int64_t h = 0; h < Hq; ++h) {
      for (int64_t d = 0; d < D; ++d) dst[h * a.o_s1 + d] = static_cast<T>(op[(r * Hq + h) * D + d]);
      a.lse[rows[r] * a.l_s0 + h * a.l_s1] = lp[r * Hq + h];
    }
  }
  return true;
}

// The sequence of each query row, from cu_seqlens_q.
std::vector<int64_t> row_sequences(const at::Tensor& cu_seqlens_q, int64_t total_q, int64_t batch) {
  std::vector<int64_t> row_seq(total_q);
  const IndexView cu(cu_seqlens_q);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = cu(b); r < cu(b + 1); ++r) row_seq[r] = b;
  return row_seq;
}

// The kernels' view of checked tensors (table: the padded block table or the flat page list).
PagedArgs paged_args(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& table, const at::Tensor& kv_lens, const std::vector<int64_t>& row_seq,
                     float scale, int64_t window_left, float softcap, const at::Tensor& out, const at::Tensor& lse_out) {
  return PagedArgs{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), lse_out.data_ptr<float>(),
                   row_seq.data(), IndexView(q_pos), IndexView(table), IndexView(kv_lens),
                   q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                   q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
                   lse_out.stride(0), lse_out.stride(1), scale, window_left, softcap};
}

// The kernel on checked arguments; q, k_cache, v_cache and out have a unit last-dim stride.
void run_kernel(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q,
                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                const at::Tensor& kv_lens, float scale, int64_t window_left, float softcap, const at::Tensor& out,
                const at::Tensor& lse_out) {
  const int64_t total_q = q.size(0), batch = kv_lens.size(0);
  if (total_q == 0) return;
  const std::vector<int64_t> row_seq = row_sequences(cu_seqlens_q, total_q, batch);
  const PagedArgs a = paged_args(q, q_pos, k_cache, v_cache, block_table, kv_lens, row_seq, scale, window_left,
                                 softcap, out, lse_out);
  const int64_t items = total_q * a.num_kv_heads;
  // grain: about GRAIN_SIZE multiply-adds per task, from the average cached length
  int64_t kv_total = 0;
  for (int64_t b = 0; b < batch; ++b) kv_total += a.kv_lens(b);
  const int64_t per_item = std::max<int64_t>(1, (kv_total / std::max<int64_t>(1, batch)) * a.head_dim *
                                                    (a.num_heads / a.num_kv_heads));
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / per_item);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_attention_cpu", [&] {
    void (*run)(const PagedArgs&, int64_t, int64_t) = &paged_items_run<scalar_t>;
    if (items <= grain) {
      run(a, 0, items);  // one task: no parallel region
    } else {
      at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) { run(a, begin, end); });
    }
  });
}

at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

constexpr int64_t kBlockVectors = 16;

// Rotated keys held at once (sequences in groups): 256 MiB, or RAGATTN_TEST_TAGGED_SCRATCH_BYTES
// (the tests' way to make every sequence a group of its own).
int64_t scratch_budget() {
  const char* env = std::getenv("RAGATTN_TEST_TAGGED_SCRATCH_BYTES");
  return env ? std::max<int64_t>(1, std::atoll(env)) : int64_t(256) << 20;
}

// Every index value the tagged kernel reads, checked (the public op's Python checks ran before;
// this keeps the private op memory-safe on its own): entries of the used slots, their pages,
// valid counts and positions, q_pos, and a RoPE table that covers every position a row sees.
void check_tagged_values(const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q, int64_t num_pages, int64_t S,
                         const TaggedArgs& t, const at::Tensor& pages, const at::Tensor& kv_lens, int64_t table_rows) {
  constexpr const char* op = kTaggedOp;
  const IndexView pos(q_pos), lens(kv_lens);
  const int64_t batch = kv_lens.size(0), num_entries = pages.size(0);
  check_cu_seqlens_values(op, IndexView(cu_seqlens_q), batch, q_pos.size(0));  // (its shape: checked by the caller)
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens(b), r0 = t.row_start(b);
    const int64_t used = (len + S - 1) / S;
    RAGATTN_CHECK_VALUE(len >= 0 && r0 >= 0 && r0 + used <= num_entries, op, ": sequence ", b, "'s ", len,
                        " slots need entries [", r0, ", ", r0 + used, ") of ", num_entries);
    for (int64_t e = r0; e < r0 + used; ++e) {
      RAGATTN_CHECK_VALUE(t.pages(e) >= 0 && t.pages(e) < num_pages, op, ": pages[", e, "] = ", t.pages(e),
                          " must lie in [0, ", num_pages, ")");
      RAGATTN_CHECK_VALUE(!t.has_len || (t.entry_len(e) >= 0 && t.entry_len(e) <= S), op, ": entry_len[", e,
                          "] must lie in [0, ", S, "]");
      RAGATTN_CHECK_VALUE(!t.has_pos || t.entry_pos(e) >= 0, op, ": entry_pos[", e, "] must be >= 0");
    }
  }
  for (int64_t r = 0; r < q_pos.size(0); ++r) {
    RAGATTN_CHECK_VALUE(pos(r) >= 0, op, ": q_pos must be >= 0, got ", pos(r), " at row ", r);
    RAGATTN_CHECK_VALUE(table_rows < 0 || pos(r) < table_rows, op, ": the RoPE table has ", table_rows,
                        " positions, row ", r, " is at ", pos(r));
  }
}

// The tagged kernel on checked arguments (unit last-dim strides), sequences in groups whose
// rotated keys fit scratch_budget().
void run_tagged(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& pages, const at::Tensor& kv_lens, const TaggedArgs& t0,
                const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin,
                int64_t rotary_dim, bool interleaved, float scale, int64_t window_left, float softcap,
                const at::Tensor& out, const at::Tensor& lse_out) {
  const int64_t total_q = q.size(0), batch = kv_lens.size(0);
  if (total_q == 0) return;
  const std::vector<int64_t> row_seq = row_sequences(cu_seqlens_q, total_q, batch);
  const IndexView cu(cu_seqlens_q), qp(q_pos);
  const PagedArgs a = paged_args(q, q_pos, k_cache, v_cache, pages, kv_lens, row_seq, scale, window_left, softcap,
                                 out, lse_out);
  const int64_t H = a.num_kv_heads, D = a.head_dim, S = a.page_size;
  const bool rope = rope_cos.has_value();
  // per sequence, the positions its rows see: [pos_lo, pos_hi] (pos_hi -1: no rows)
  std::vector<int64_t> pos_lo(batch, 0), pos_hi(batch, -1);
  for (int64_t r = 0; r < total_q; ++r) {
    const int64_t b = row_seq[r], p = qp(r);
    const int64_t lo = window_left >= 0 && p > window_left ? p - window_left : 0;
    pos_lo[b] = pos_hi[b] < 0 ? lo : std::min(pos_lo[b], lo);
    pos_hi[b] = std::max(pos_hi[b], p);
  }
  std::vector<int64_t> slot_base(batch, 0), ents, blocks;
  const int64_t budget = scratch_budget();
  // rows per block: about kBlockVectors query vectors (rows x the GQA group) share each K/V load
  const int64_t max_rows = std::max<int64_t>(1, kBlockVectors / (a.num_heads / H));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_attention_tagged_cpu", [&] {
    for (int64_t b0 = 0, b1; b0 < batch; b0 = b1) {
      int64_t slots = 0;
      for (b1 = b0; b1 < batch; ++b1) {
        const int64_t more = rope && pos_hi[b1] >= 0 ? a.kv_lens(b1) : 0;
        if (b1 > b0 && (slots + more) * H * D * int64_t(sizeof(scalar_t)) > budget) break;
        slot_base[b1] = slots;
        slots += more;
      }
      TaggedArgs t = t0;
      at::Tensor scratch;
      if (rope && slots > 0) {
        scratch = at::empty({slots, H, D}, k_cache.options());
        ents.clear();
        for (int64_t b = b0; b < b1; ++b)
          for (int64_t pi = 0; pos_hi[b] >= 0 && pi * S < a.kv_lens(b); ++pi) ents.insert(ents.end(), {b, pi});
        t.krot = scratch.data_ptr();
        t.slot_base = slot_base.data();
        const int64_t n_ents = static_cast<int64_t>(ents.size()) / 2;
        const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, S * H * D));
        const float* c = rope_cos->data_ptr<float>();
        const float* s = rope_sin->data_ptr<float>();
        scalar_t* k = scratch.data_ptr<scalar_t>();
        at::parallel_for(0, n_ents, grain, [&](int64_t e0, int64_t e1) {
          rotate_tagged_keys<scalar_t>(a, t, ents.data(), e0, e1, pos_lo.data(), pos_hi.data(), c, s, rotary_dim,
                                       interleaved, k);
        });
      }
      // items: blocks of up to max_rows rows of one sequence x kv heads (sequences with many rows:
      // the GEMM route first)
      blocks.clear();
      for (int64_t b = b0; b < b1; ++b) {
        if (cu(b + 1) - cu(b) >= kGemmMinRows &&
            tagged_rows_gemm<scalar_t>(a, t, b, cu(b), cu(b + 1), pos_lo[b], pos_hi[b]))
          continue;
        for (int64_t r = cu(b); r < cu(b + 1); r += max_rows) blocks.insert(blocks.end(), {r, std::min(max_rows, cu(b + 1) - r)});
      }
      const int64_t items = static_cast<int64_t>(blocks.size()) / 2 * H;
      int64_t kv_total = 0;
      for (int64_t b = b0; b < b1; ++b) kv_total += a.kv_lens(b);
      const int64_t per_item = std::max<int64_t>(1, kv_total / std::max<int64_t>(1, b1 - b0) * D * (a.num_heads / H));
      const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / per_item);
      auto run = [&](int64_t begin, int64_t end) {
        tagged_items_run<scalar_t>(a, t, blocks.data(), max_rows, begin, end);
      };
      if (items <= grain) {
        run(0, items);
      } else {
        at::parallel_for(0, items, grain, run);
      }
    }
  });
}

}  // namespace

void paged_attention_cpu(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                         const at::Tensor& kv_lens, double scale, int64_t window_left, double logits_soft_cap,
                         const at::Tensor& out, const at::Tensor& lse_out) {
  constexpr const char* op = "ragattn._paged_attention_cpu";
  check_layout(op, q, q_pos, cu_seqlens_q, k_cache, v_cache, kv_lens, &out, &lse_out);
  RAGATTN_CHECK_TYPE(block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong, op,
                     ": block_table must be int32 or int64");
  RAGATTN_CHECK_VALUE(block_table.dim() == 2 && block_table.size(0) == kv_lens.size(0) && block_table.device().is_cpu(),
                      op, ": block_table must be a CPU [B, max_pages] tensor");
  check_padded_values(q_pos, cu_seqlens_q, block_table, kv_lens, k_cache.size(0), k_cache.size(1));
  const at::Tensor o = out.stride(-1) == 1 ? out : at::empty(q.sizes(), q.options());  // copied in below
  run_kernel(unit_last_stride(q), q_pos, cu_seqlens_q, unit_last_stride(k_cache), unit_last_stride(v_cache),
             block_table, kv_lens, static_cast<float>(scale), window_left, static_cast<float>(logits_soft_cap), o,
             lse_out);
  if (!o.is_same(out)) out.copy_(o);
}

std::tuple<at::Tensor, at::Tensor> paged_attention_tagged_cpu(
    const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& pages, const at::Tensor& row_start, const at::Tensor& kv_lens,
    const std::optional<at::Tensor>& entry_pos, const std::optional<at::Tensor>& entry_len,
    const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin, int64_t rotary_dim,
    bool interleaved, double scale, int64_t window_left, double logits_soft_cap) {
  constexpr const char* op = kTaggedOp;
  check_layout(op, q, q_pos, cu_seqlens_q, k_cache, v_cache, kv_lens, nullptr, nullptr);
  check_index(op, "row_start", row_start, kv_lens.size(0));
  RAGATTN_CHECK_VALUE(pages.dim() == 1, op, ": pages must be a flat page list");
  check_index(op, "pages", pages, -1);
  if (entry_pos) check_index(op, "entry_pos", *entry_pos, pages.size(0));
  if (entry_len) check_index(op, "entry_len", *entry_len, pages.size(0));
  RAGATTN_CHECK_VALUE(rope_cos.has_value() == rope_sin.has_value(), op, ": rope_cos and rope_sin go together");
  int64_t table_rows = -1;
  if (rope_cos) {
    RAGATTN_CHECK_VALUE(rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= q.size(2), op,
                        ": rotary_dim must be even and in [2, head_dim]");
    for (const at::Tensor* x : {&*rope_cos, &*rope_sin})
      RAGATTN_CHECK_VALUE(x->scalar_type() == at::kFloat && x->dim() == 2 && x->size(1) == rotary_dim / 2 &&
                              x->is_contiguous() && x->device().is_cpu() && x->sizes() == rope_cos->sizes(),
                          op, ": rope_cos and rope_sin must be contiguous float32 [positions, rotary_dim / 2]");
    table_rows = rope_cos->size(0);
  }
  RAGATTN_CHECK_VALUE(std::isfinite(scale) && std::isfinite(logits_soft_cap) && logits_soft_cap >= 0, op,
                      ": scale finite, logits_soft_cap finite and >= 0");
  const TaggedArgs t{IndexView(pages), IndexView(row_start), IndexView(entry_pos ? *entry_pos : pages),
                     IndexView(entry_len ? *entry_len : pages), entry_pos.has_value(), entry_len.has_value(),
                     nullptr, nullptr};
  check_tagged_values(q_pos, cu_seqlens_q, k_cache.size(0), k_cache.size(1), t, pages, kv_lens, table_rows);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  run_tagged(unit_last_stride(q), q_pos, cu_seqlens_q, unit_last_stride(k_cache), unit_last_stride(v_cache), pages,
             kv_lens, t, rope_cos, rope_sin, rotary_dim, interleaved, static_cast<float>(scale), window_left,
             static_cast<float>(logits_soft_cap), out, lse);
  return {out, lse};
}

}  // namespace ragattn
