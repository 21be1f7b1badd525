// paged_attention_run's CPU kernel for position-tagged page lists, the private op
// ragattn::_paged_attention_tagged_cpu called by ragattn/ops/paged_attention_run.py after its
// checks (schema in torch_bindings.cpp): a flat page list with RoPE applied in the kernel. Its own
// checks are the layout and the index values it follows (memory safety on a direct call); nothing
// here calls into Python. The row-block kernel and its rules: paged_attention_cpu_common.h
// (shared with the padded-table kernel, paged_attention_cpu.cpp); sequences with many query rows
// take the GEMM route of paged_attention_rows_gemm.cpp.
// GCC notes that 32-byte vector arguments change the ABI: the v8f helpers are always inlined
#pragma GCC diagnostic ignored "-Wpsabi"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "attention/paged_attention_cpu_common.h"
#include "attention/paged_attention_rows_gemm.h"
#include "kv_cache/rope_math.h"
#include "common/check_message.h"
#include "common/dispatch.h"
#include "common/cpu_isa.h"
#include "common/parallel_largest_first.h"
#include "common/vec8.h"
#include "ops.h"

namespace ragattn {
namespace {
using namespace paged_cpu;

constexpr const char* kTaggedOp = "ragattn._paged_attention_tagged_cpu";

// --------------------------------------------------------------- position-tagged page lists
// paged_attention_run over a flat page list whose entries carry the position of their slot 0
// and their count of valid slots, with RoPE optionally applied in the kernel (zero-copy chunk
// pages: ragattn/kv/zero_copy.py, ragattn/reference/paged_attention_table.py). Slot j < kv_lens[b]
// lies in entry e = row_start[b] + j / page_size at offset o = j % page_size; it is valid iff
// entry_start[e] <= o < entry_len[e] and holds position p0 + o, p0 = entry_pos[e] (without
// entry_pos: the page's first slot j - o; entry_start: a run of a page, e.g. around rows a request
// holds privately). A row sees the valid slots at positions <= q_pos (and >= q_pos - window_left).
// Positions need not grow with j, so each entry's visible offsets are found from p0, and only
// those slots enter a chunk (compacted: no masks).
//
// With RoPE, slot o of a page holds its key rotated by o (page-local: a page is valid at any
// placement). A key belongs at p0 + o, and R(q_pos) q . R(p0 + o) k = R(q_pos - p0) q . R(o) k: the
// query (given rotated at q_pos) is rotated by -p0 once per entry, in fp32, and the stored keys are
// read in place. (Rotating every key into a scratch copy per call instead would touch every key,
// every layer, every step.)
// A sequence that takes the rows-GEMM route rotates its keys by p0 as it gathers them (one
// query matrix for all its slots; the gather copies the keys anyway).

// The RoPE table of a call (cos_t null: keys already rotated, read as stored).
struct RopeTable {
  const float* cos_t;  // [positions, half]: cos and sin of p * inv_freq[f]
  const float* sin_t;
  int64_t half;  // rotary_dim / 2
  bool interleaved;
};

struct TaggedArgs {
  IndexView pages, row_start, entry_pos, entry_len, entry_start;
  bool has_pos, has_len, has_start;
};

// The offsets [*o_lo, *o_hi) of an entry (slot 0 at position p0, valid offsets [from, cnt)) that
// a row at position pos sees; empty when *o_lo >= *o_hi. No int64 overflow for any pos, p0 >= 0.
RAGATTN_ALWAYS_INLINE void visible_offsets(int64_t pos, int64_t window_left, int64_t p0, int64_t from, int64_t cnt,
                                           int64_t* o_lo, int64_t* o_hi) {
  *o_hi = pos < p0 ? 0 : (pos - p0 < cnt ? pos - p0 + 1 : cnt);
  const int64_t first = window_left >= 0 ? pos - window_left : 0;  // >= -INT64_MAX
  *o_lo = std::max(from, first > p0 ? first - p0 : 0);
}

// Entry pi of a sequence of kv_len slots (page_size S): its valid offsets [*from, *cnt) and the
// position of its slot 0.
RAGATTN_ALWAYS_INLINE void entry_extent(const TaggedArgs& t, int64_t e, int64_t pi, int64_t S, int64_t kv_len,
                                        int64_t* from, int64_t* cnt, int64_t* p0) {
  *cnt = std::min(S, kv_len - pi * S);
  if (t.has_len) *cnt = std::min(*cnt, t.entry_len(e));
  *from = t.has_start ? t.entry_start(e) : 0;
  *p0 = t.has_pos ? t.entry_pos(e) : pi * S;
}

// dst = src rotated by the angles of (c, sign * s) [half], pairs (f, f + half) or (2f, 2f + 1), in
// fp32; dims past 2 * half copied. Two plain loops (one per layout) so that the compiler
// vectorises them.
template <typename S, typename T>
RAGATTN_ALWAYS_INLINE void rotate_row(const S* src, T* dst, const float* c, const float* s, float sign, int64_t half,
                                      int64_t D, bool interleaved) {
  float y1, y2;
  if (interleaved) {
    for (int64_t f = 0; f < half; ++f) {
      rope::rotate_pair(static_cast<float>(src[2 * f]), static_cast<float>(src[2 * f + 1]), c[f], sign * s[f], &y1,
                        &y2);
      dst[2 * f] = static_cast<T>(y1);
      dst[2 * f + 1] = static_cast<T>(y2);
    }
  } else {
    for (int64_t f = 0; f < half; ++f) {
      rope::rotate_pair(static_cast<float>(src[f]), static_cast<float>(src[f + half]), c[f], sign * s[f], &y1, &y2);
      dst[f] = static_cast<T>(y1);
      dst[f + half] = static_cast<T>(y2);
    }
  }
  for (int64_t d = 2 * half; d < D; ++d) dst[d] = static_cast<T>(src[d]);
}

// The chunk's slots [0, n) in segments of one entry rotation each (segment i: from at[i], its
// entry's first position p0[i]): per segment, the query vectors rotated by -p0 (from q0, the
// vectors as given) score its keys; then one softmax step over the whole chunk.
template <typename T>
RAGATTN_ALWAYS_INLINE void attend_rotated_chunk(const RowState& st, const PagedArgs& a, const RopeTable& rope,
                                                const float* q0, const T** kslot, const T* const* vslot, int64_t n,
                                                const int64_t* at, const int64_t* p0, int64_t nseg) {
  const int64_t D = st.D;
  // dot_rows reads up to 7 slots past a segment's end: the next segment's keys, or this padding
  for (int64_t s = n; s < n + 8; ++s) kslot[s] = kslot[0];
  for (int64_t i = 0; i < nseg; ++i) {
    const float* c = rope.cos_t + p0[i] * rope.half;
    const float* sn = rope.sin_t + p0[i] * rope.half;
    for (int64_t v = 0; v < st.G; ++v) rotate_row(q0 + v * D, st.qf + v * D, c, sn, -1.f, rope.half, D, rope.interleaved);
    // segments in order: a segment's scores past its end (padding) are overwritten by the next
    const int64_t end = i + 1 < nseg ? at[i + 1] : n;
    dot_rows<kPRow>(st.qf, st.G, D, kslot + at[i], end - at[i], a.scale, st.p + at[i]);
  }
  attend_scored_chunk<T>(st, a, vslot, 0, n);
}

// The chunk's n slots attended: with RoPE (rope.cos_t), segment by segment; segments reset. (A
// function, not a lambda in tagged_items: a lambda's body is compiled out of line without the
// caller's target clone, which makes it far slower.)
template <typename T>
RAGATTN_ALWAYS_INLINE void flush_chunk(const RowState& st, const PagedArgs& a, const RopeTable& rope, const float* q0,
                                       const T** kslot, const T* const* vslot, int64_t n, const int64_t* seg_at,
                                       const int64_t* seg_p0, int64_t* nseg) {
  if (rope.cos_t) {
    attend_rotated_chunk<T>(st, a, rope, q0, kslot, vslot, n, seg_at, seg_p0, *nseg);
  } else {
    attend_chunk<T>(st, a, kslot, vslot, 0, n);
  }
  *nseg = 0;
}

// --------------------------------------------------------------------------------- split-KV
// A sequence with fewer than kSplitItems items (row blocks x kv heads: a decode row has as many as
// kv heads, 3 for SmolLM2, which 2 threads share 2:1) splits its entries into parts of at least
// kSplitMinSlots slots, each part an item of its own; their states are merged after
// (flash-decoding's split-KV). The split depends on the sequence's own rows and length alone: its
// answer is the same on any number of threads and in any batch. (The padded-table kernel does not
// split: its rows are batch-invariant, a row's bits never depend on the other rows of its call
// either, and a split by rows would add a merge to every long row of a large batch.)
constexpr int64_t kSplitItems = 16;
constexpr int64_t kSplitMinSlots = 128;

// The parts of a sequence of kv_len slots whose rows make `items` items.
inline int64_t split_parts(int64_t items, int64_t kv_len) {
  if (items >= kSplitItems) return 1;
  return std::max<int64_t>(1, std::min((kSplitItems + items - 1) / items, kv_len / kSplitMinSlots));
}

// An item: kv head g of row block `block`, part `part` of `parts` of its sequence's entries.
struct TaggedItem {
  int64_t block, g, part, parts;
};

// The online-softmax state of a RowState's G vectors saved for a merge (split_state_floats(G, D)
// floats: acc [G, D], m [G], l [G], bad [G]): the state of one part of a row's slots.
inline int64_t split_state_floats(int64_t G, int64_t D) { return G * (D + 3); }

RAGATTN_ALWAYS_INLINE void save_split_state(const RowState& st, float* dst) {
  const int64_t G = st.G, D = st.D;
  std::copy(st.acc, st.acc + G * D, dst);
  std::copy(st.m, st.m + G, dst + G * D);
  std::copy(st.l, st.l + G, dst + G * D + G);
  std::copy(st.bad, st.bad + G, dst + G * D + 2 * G);
}

// st (its G vectors) := the merge of nsplit saved states of the same vectors over disjoint slot
// sets (saved + s * stride, in split order), as one online softmax over their union would end:
// m the max, l and acc rescaled to it and summed; bad in any split makes the vector bad. A split
// with no weight (m = -inf) contributes 0 * acc: a non-finite V it read still makes acc NaN, as
// in one pass.
RAGATTN_ALWAYS_INLINE void merge_split_states(const RowState& st, const float* saved, int64_t stride, int64_t nsplit) {
  const int64_t G = st.G, D = st.D;
  for (int64_t x = 0; x < G; ++x) {
    float m = -std::numeric_limits<float>::infinity(), l = 0.f, bad = 0.f;
    for (int64_t s = 0; s < nsplit; ++s) {
      const float* sp = saved + s * stride;
      m = std::max(m, sp[G * D + x]);
      bad = std::max(bad, sp[G * D + 2 * G + x]);
    }
    float* acc = st.acc + x * D;
    std::fill(acc, acc + D, 0.f);
    for (int64_t s = 0; s < nsplit; ++s) {
      const float* sp = saved + s * stride;
      const float ms = sp[G * D + x];
      const float w = ms == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(ms - m);
      l += w * sp[G * D + G + x];
      const float* as = sp + x * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += w * as[d];
    }
    st.m[x] = m, st.l[x] = l, st.bad[x] = bad;
  }
}

// Items [begin, end) of `items`: block k the rows [blocks[2k], blocks[2k] + blocks[2k + 1]) of
// one sequence, part s of n its entries [P * s / n, P * (s + 1) / n) of P; an item of a split
// sequence saves its state to partial + item * stride, the others write their rows. The slots
// every row of the block sees are attended by all their query vectors at once (each K/V row loaded
// once for the block); the rest (the causal diagonal, window edges) row by row, so no row ever
// reads a slot it does not see (no masks: 0 * NaN cannot happen).
template <typename T>
RAGATTN_ALWAYS_INLINE void tagged_items(const PagedArgs& a, const TaggedArgs& t, const RopeTable& rope,
                                        const int64_t* blocks, int64_t max_rows, const TaggedItem* items,
                                        float* partial, int64_t stride, int64_t begin, int64_t end) {
  const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, S = a.page_size;
  const bool rotate = rope.cos_t != nullptr;
  RowStateBuffer buf(D, max_rows * G);
  std::vector<float> q0(rotate ? max_rows * G * D : 0);  // the query vectors as given (rotated at q_pos)
  const T* kslot[kChunk + 8];
  const T* vslot[kChunk];
  int64_t seg_at[kChunk], seg_p0[kChunk], nseg = 0;
  std::vector<int64_t> lo(max_rows), hi(max_rows), pos(max_rows);
  for (int64_t item = begin; item < end; ++item) {
    const TaggedItem& it = items[item];
    const int64_t k = it.block, g = it.g, i0 = blocks[2 * k], nr = blocks[2 * k + 1];
    const int64_t b = a.row_seq[i0];
    const int64_t kv_len = a.kv_lens(b), r0 = t.row_start(b), P = (kv_len + S - 1) / S;
    const int64_t p_begin = P * it.part / it.parts, p_end = P * (it.part + 1) / it.parts;
    for (int64_t r = 0; r < nr; ++r) {
      pos[r] = a.q_pos(i0 + r);
      buf.st.part(r * G, G).start<T>(a, i0 + r, g);
    }
    if (rotate) std::copy(buf.st.qf, buf.st.qf + nr * G * D, q0.begin());
    const T* k_base = static_cast<const T*>(a.k) + g * a.k_s2;
    const T* v_base = static_cast<const T*>(a.v) + g * a.v_s2;
    // pass -1: the slots all nr rows see, attended by all of them; pass r: row r's others
    for (int64_t pass = -1; pass < (nr > 1 ? nr : 0); ++pass) {
      const RowState st = pass < 0 ? buf.st.part(0, nr * G) : buf.st.part(pass * G, G);
      const float* q0p = rotate ? q0.data() + (pass < 0 ? 0 : pass * G * D) : nullptr;
      int64_t n = 0;
      for (int64_t pi = p_begin; pi < p_end; ++pi) {
        int64_t from, cnt, p0, all_lo = 0, all_hi = std::numeric_limits<int64_t>::max();
        entry_extent(t, r0 + pi, pi, S, kv_len, &from, &cnt, &p0);
        for (int64_t r = 0; r < nr; ++r) {
          visible_offsets(pos[r], a.window_left, p0, from, cnt, &lo[r], &hi[r]);
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
        const T* kp = k_base + page * a.k_s0;
        const T* vp = v_base + page * a.v_s0;
        for (const auto& rg : ranges) {
          for (int64_t o = rg[0]; o < rg[1]; ++o) {
            if (rotate && (nseg == 0 || seg_p0[nseg - 1] != p0)) seg_at[nseg] = n, seg_p0[nseg++] = p0;
            kslot[n] = kp + o * a.k_s1;
            vslot[n] = vp + o * a.v_s1;
            if (++n == kChunk) {
              flush_chunk<T>(st, a, rope, q0p, kslot, vslot, n, seg_at, seg_p0, &nseg);
              n = 0;
            }
          }
        }
      }
      if (n) flush_chunk<T>(st, a, rope, q0p, kslot, vslot, n, seg_at, seg_p0, &nseg);
    }
    if (it.parts > 1) {
      save_split_state(buf.st.part(0, nr * G), partial + item * stride);
    } else {
      for (int64_t r = 0; r < nr; ++r) buf.st.part(r * G, G).write<T>(a, i0 + r, g);
    }
  }
}

template <typename T>
RAGATTN_CPU_CLONES void tagged_items_run(const PagedArgs& a, const TaggedArgs& t, const RopeTable& rope,
                                         const int64_t* blocks, int64_t max_rows, const TaggedItem* items,
                                         float* partial, int64_t stride, int64_t begin, int64_t end) {
  tagged_items<T>(a, t, rope, blocks, max_rows, items, partial, stride, begin, end);
}

// The rows of the split items' blocks (each block's parts consecutive items): merged, written.
template <typename T>
void merge_parts(const PagedArgs& a, const int64_t* blocks, int64_t max_rows, const std::vector<TaggedItem>& items,
                 const float* partial, int64_t stride) {
  const int64_t G = a.num_heads / a.num_kv_heads;
  RowStateBuffer buf(a.head_dim, max_rows * G);
  for (size_t item = 0; item < items.size(); item += items[item].parts) {
    const TaggedItem& it = items[item];
    if (it.parts == 1) continue;
    const int64_t i0 = blocks[2 * it.block], nr = blocks[2 * it.block + 1];
    merge_split_states(buf.st.part(0, nr * G), partial + item * stride, stride, it.parts);
    for (int64_t r = 0; r < nr; ++r) buf.st.part(r * G, G).write<T>(a, i0 + r, it.g);
  }
}

// A slot the rows-GEMM route gathers: its position, its entry's first position, its K and V rows.
template <typename T>
struct GemmSlot {
  int64_t pos, p0;
  const T* k;
  const T* v;
};

// Slots [j0, j1) of n widened to float into k, v [H, n, D], keys rotated by their entry's p0 with
// `rope` (in fp32, rounded once to T, as a stored rotated key). Out of line per ISA (the rotation
// and the widening vectorise). Returns false when one of the V values is not finite.
template <typename T>
RAGATTN_CPU_CLONES bool gather_gemm_slots(const GemmSlot<T>* slots, int64_t j0, int64_t j1, int64_t n, int64_t H,
                                          int64_t D, int64_t k_s2, int64_t v_s2, const RopeTable& rope, float* kp,
                                          float* vp) {
  std::vector<T> krow(D);  // a key rotated (and rounded to T) before widening
  uint32_t nonfinite = 0;
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t g = 0; g < H; ++g) {
      const T* ks = slots[j].k + g * k_s2;
      if (rope.cos_t) {
        rotate_row(ks, krow.data(), rope.cos_t + slots[j].p0 * rope.half, rope.sin_t + slots[j].p0 * rope.half, 1.f,
                   rope.half, D, rope.interleaved);
        ks = krow.data();
      }
      const T* vs = slots[j].v + g * v_s2;
      float* kd = kp + (g * n + j) * D;
      float* vd = vp + (g * n + j) * D;
      for (int64_t d = 0; d < D; ++d) {
        kd[d] = static_cast<float>(ks[d]);
        const float x = static_cast<float>(vs[d]);
        vd[d] = x;
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        nonfinite |= (~bits & 0x7f800000u) == 0;  // exponent all ones: inf or NaN (an integer OR: vectorises)
      }
    }
  }
  return nonfinite == 0;
}

// Sequences with at least this many query rows take paged_attention_rows_gemm's route (hundreds
// of rows over one sequence's slots run faster as GEMMs than as the row blocks below); decode rows
// never do.
constexpr int64_t kGemmMinRows = 16;

// Sequence b's rows [r_begin, r_end) by paged_attention_rows_gemm: its slots at positions
// [pos_lo, pos_hi] (the ones some row sees) gathered in position order, widened to float, keys
// rotated by their entry's p0 as they are gathered (with `rope`; in fp32, rounded once to T, as a
// stored rotated key). Returns false (writing nothing) when one of those v
// rows holds a non-finite value: the GEMM would spread it to the rows that do not see it, so the
// row blocks handle that sequence.
template <typename T>
bool tagged_rows_gemm(const PagedArgs& a, const TaggedArgs& t, const RopeTable& rope, int64_t b, int64_t r_begin,
                      int64_t r_end, int64_t pos_lo, int64_t pos_hi) {
  const int64_t D = a.head_dim, S = a.page_size, H = a.num_kv_heads, Hq = a.num_heads, kv_len = a.kv_lens(b);
  const int64_t r0 = t.row_start(b), nr = r_end - r_begin;
  std::vector<GemmSlot<T>> slots;
  for (int64_t pi = 0; pi * S < kv_len; ++pi) {
    int64_t from, cnt, p0, o_lo, o_hi;
    entry_extent(t, r0 + pi, pi, S, kv_len, &from, &cnt, &p0);
    visible_offsets(pos_hi, pos_hi - pos_lo, p0, from, cnt, &o_lo, &o_hi);
    const int64_t page = t.pages(r0 + pi);
    for (int64_t o = o_lo; o < o_hi; ++o)
      slots.push_back({p0 + o, p0, static_cast<const T*>(a.k) + page * a.k_s0 + o * a.k_s1,
                       static_cast<const T*>(a.v) + page * a.v_s0 + o * a.v_s1});
  }
  std::stable_sort(slots.begin(), slots.end(), [](const GemmSlot<T>& x, const GemmSlot<T>& y) { return x.pos < y.pos; });
  const int64_t n = static_cast<int64_t>(slots.size());
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor k = at::empty({H, n, D}, f32), v = at::empty({H, n, D}, f32);
  std::vector<int64_t> key_pos(n);
  for (int64_t j = 0; j < n; ++j) key_pos[j] = slots[j].pos;
  std::atomic<bool> finite{true};
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, H * D));
  at::parallel_for(0, n, grain, [&](int64_t j0, int64_t j1) {
    if (!gather_gemm_slots<T>(slots.data(), j0, j1, n, H, D, a.k_s2, a.v_s2, rope, k.data_ptr<float>(),
                              v.data_ptr<float>()))
      finite = false;
  });
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
constexpr int64_t kBlockVectors = 16;

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
      RAGATTN_CHECK_VALUE(!t.has_start || (t.entry_start(e) >= 0 && t.entry_start(e) <= (t.has_len ? t.entry_len(e) : S)),
                          op, ": entry_start[", e, "] must lie in [0, entry_len[", e, "]]");
    }
  }
  for (int64_t r = 0; r < q_pos.size(0); ++r) {
    RAGATTN_CHECK_VALUE(pos(r) >= 0, op, ": q_pos must be >= 0, got ", pos(r), " at row ", r);
    RAGATTN_CHECK_VALUE(table_rows < 0 || pos(r) < table_rows, op, ": the RoPE table has ", table_rows,
                        " positions, row ", r, " is at ", pos(r));
  }
}

// The tagged kernel on checked arguments (unit last-dim strides).
void run_tagged(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& pages, const at::Tensor& kv_lens, const TaggedArgs& t,
                const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin,
                int64_t rotary_dim, bool interleaved, float scale, int64_t window_left, float softcap,
                const at::Tensor& out, const at::Tensor& lse_out) {
  const int64_t total_q = q.size(0), batch = kv_lens.size(0);
  if (total_q == 0) return;
  const std::vector<int64_t> row_seq = row_sequences(cu_seqlens_q, total_q, batch);
  const IndexView cu(cu_seqlens_q), qp(q_pos);
  const PagedArgs a = paged_args(q, q_pos, k_cache, v_cache, pages, kv_lens, row_seq, scale, window_left, softcap,
                                 out, lse_out);
  const int64_t H = a.num_kv_heads, D = a.head_dim;
  const bool rope = rope_cos.has_value();
  // per sequence, the positions its rows see: [pos_lo, pos_hi] (pos_hi -1: no rows)
  std::vector<int64_t> pos_lo(batch, 0), pos_hi(batch, -1);
  for (int64_t r = 0; r < total_q; ++r) {
    const int64_t b = row_seq[r], p = qp(r);
    const int64_t lo = window_left >= 0 && p > window_left ? p - window_left : 0;
    pos_lo[b] = pos_hi[b] < 0 ? lo : std::min(pos_lo[b], lo);
    pos_hi[b] = std::max(pos_hi[b], p);
  }
  // rows per block: about kBlockVectors query vectors (rows x the GQA group) share each K/V load
  const int64_t max_rows = std::max<int64_t>(1, kBlockVectors / (a.num_heads / H));
  const RopeTable table{rope ? rope_cos->data_ptr<float>() : nullptr, rope ? rope_sin->data_ptr<float>() : nullptr,
                        rotary_dim / 2, interleaved};
  RAGATTN_DISPATCH_ATTENTION_TYPES(q.scalar_type(), "paged_attention_tagged_cpu", [&] {
    // sequences with many rows: the GEMM route first; done[b] marks those it answered
    std::vector<char> done(batch, 0);
    for (int64_t b = 0; b < batch; ++b)
      done[b] = cu(b + 1) - cu(b) >= kGemmMinRows &&
                tagged_rows_gemm<scalar_t>(a, t, table, b, cu(b), cu(b + 1), pos_lo[b], pos_hi[b]);
    // items: blocks of up to max_rows rows of one sequence x kv heads (the sequences the GEMM
    // route did not answer)
    std::vector<int64_t> blocks;
    for (int64_t b = 0; b < batch; ++b) {
      if (done[b]) continue;
      for (int64_t r = cu(b); r < cu(b + 1); r += max_rows) blocks.insert(blocks.end(), {r, std::min(max_rows, cu(b + 1) - r)});
    }
    // the items: per block, per kv head, its sequence's parts
    std::vector<TaggedItem> items;
    bool split = false;
    int64_t kv_total = 0;
    for (int64_t b = 0; b < batch; ++b) kv_total += a.kv_lens(b);
    for (int64_t k = 0; k < static_cast<int64_t>(blocks.size()) / 2; ++k) {
      const int64_t b = a.row_seq[blocks[2 * k]];
      const int64_t parts = split_parts((cu(b + 1) - cu(b) + max_rows - 1) / max_rows * H, a.kv_lens(b));
      split |= parts > 1;
      for (int64_t g = 0; g < H; ++g)
        for (int64_t s = 0; s < parts; ++s) items.push_back({k, g, s, parts});
    }
    const int64_t n_items = static_cast<int64_t>(items.size());
    const int64_t stride = split_state_floats(max_rows * (a.num_heads / H), D);
    std::vector<float> partial(split ? n_items * stride : 0);
    // about GRAIN_SIZE multiply-adds per task: an item reads its sequence's slots / its parts
    const int64_t unsplit = static_cast<int64_t>(blocks.size()) / 2 * H;
    const int64_t per_item = std::max<int64_t>(
        1, kv_total / std::max<int64_t>(1, batch) * D * (a.num_heads / H) * unsplit / std::max<int64_t>(1, n_items));
    const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / per_item);
    auto run = [&](int64_t begin, int64_t end) {
      tagged_items_run<scalar_t>(a, t, table, blocks.data(), max_rows, items.data(), partial.data(), stride, begin,
                                 end);
    };
    // sequences of unequal lengths: blocks of items, largest first
    const auto slots = [&](int64_t i) { return a.kv_lens(a.row_seq[blocks[2 * items[i].block]]) / items[i].parts; };
    parallel_blocks_largest_first(n_items, grain, slots, run);
    if (split) merge_parts<scalar_t>(a, blocks.data(), max_rows, items, partial.data(), stride);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> paged_attention_tagged_cpu(
    const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& pages, const at::Tensor& row_start, const at::Tensor& kv_lens,
    const std::optional<at::Tensor>& entry_pos, const std::optional<at::Tensor>& entry_len,
    const std::optional<at::Tensor>& entry_start, const std::optional<at::Tensor>& rope_cos,
    const std::optional<at::Tensor>& rope_sin, int64_t rotary_dim,
    bool interleaved, double scale, int64_t window_left, double logits_soft_cap) {
  constexpr const char* op = kTaggedOp;
  check_layout(op, q, q_pos, cu_seqlens_q, k_cache, v_cache, kv_lens, nullptr, nullptr);
  check_index(op, "row_start", row_start, kv_lens.size(0));
  RAGATTN_CHECK_VALUE(pages.dim() == 1, op, ": pages must be a flat page list");
  check_index(op, "pages", pages, -1);
  if (entry_pos) check_index(op, "entry_pos", *entry_pos, pages.size(0));
  if (entry_len) check_index(op, "entry_len", *entry_len, pages.size(0));
  if (entry_start) check_index(op, "entry_start", *entry_start, pages.size(0));
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
  const TaggedArgs t{IndexView(pages),
                     IndexView(row_start),
                     IndexView(entry_pos ? *entry_pos : pages),
                     IndexView(entry_len ? *entry_len : pages),
                     IndexView(entry_start ? *entry_start : pages),
                     entry_pos.has_value(),
                     entry_len.has_value(),
                     entry_start.has_value()};
  check_tagged_values(q_pos, cu_seqlens_q, k_cache.size(0), k_cache.size(1), t, pages, kv_lens, table_rows);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  run_tagged(unit_last_stride(q), q_pos, cu_seqlens_q, unit_last_stride(k_cache), unit_last_stride(v_cache), pages,
             kv_lens, t, rope_cos, rope_sin, rotary_dim, interleaved, static_cast<float>(scale), window_left,
             static_cast<float>(logits_soft_cap), out, lse);
  return {out, lse};
}

}  // namespace ragattn
