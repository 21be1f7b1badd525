// paged_attention's CPU kernel over a padded block table, the private op
// ragattn::_paged_attention_cpu called by ragattn/ops/paged_attention.py (the op's one dispatch
// point, which validates every argument first; schema in torch_bindings.cpp). Its own checks are
// the layout and the index values it follows (memory safety on a direct call); nothing here calls
// into Python. The kernel and its rules: paged_attention_cpu_common.h (shared with the tagged
// kernel, paged_attention_tagged_cpu.cpp).
// GCC notes that 32-byte vector arguments change the ABI: the v8f helpers are always inlined
#pragma GCC diagnostic ignored "-Wpsabi"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention/paged_attention_cpu_common.h"
#include "common/check_message.h"
#include "common/parallel_largest_first.h"
#include "common/dispatch.h"
#include "ops.h"

namespace ragattn {
namespace {
using namespace paged_cpu;

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
  RAGATTN_DISPATCH_ATTENTION_TYPES(q.scalar_type(), "paged_attention_cpu", [&] {
    void (*run)(const PagedArgs&, int64_t, int64_t) = &paged_items_run<scalar_t>;
    // a causal row's cost grows with its position: blocks of items, largest first
    const auto visible = [&](int64_t item) {
      const int64_t i = item / a.num_kv_heads, pos = a.q_pos(i), kv_len = a.kv_lens(a.row_seq[i]);
      const int64_t lo = a.window_left >= 0 ? std::max<int64_t>(0, pos - a.window_left) : 0;
      return std::max<int64_t>(0, std::min(pos, kv_len - 1) - lo + 1);
    };
    parallel_blocks_largest_first(items, grain, visible, [&](int64_t begin, int64_t end) { run(a, begin, end); });
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

}  // namespace ragattn
