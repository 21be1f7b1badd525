// CPU impl of ragattn::paged_attention and paged_attention.out (registered in torch_bindings.cpp,
// no Python in the call): the checks of ragattn/ops/paged_attention.py's _validate in the same
// order with the same messages (the fake impl keeps the Python ones; tests compare the two), then
// the kernel below, or the Python backends when RAGATTN_CPU_BACKEND=reference|triton.
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
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "attention/cpu_attention_blocks_c10.h"
#include "attention/softmax_math.h"
#include "common/cpu_isa.h"
#include "common/vec8.h"
#include "ops.h"

namespace ragattn {
namespace {

constexpr const char* kOp = "ragattn.paged_attention";

// ------------------------------------------------------------------------------------ checks

// Python's spelling of a dtype and of a shape tuple, so the messages equal _validate's.
std::string dtype_name(at::ScalarType t) { return std::string(c10::getDtypeNames(t).first); }

// want[d] < 0 prints as '*' (any size), like the repr of _validate's pretty tuple
std::string shape_str(at::IntArrayRef shape, bool any_marks = false) {
  std::ostringstream o;
  o << "(";
  for (size_t d = 0; d < shape.size(); ++d) {
    if (d) o << ", ";
    if (any_marks && shape[d] < 0) {
      o << "'*'";
    } else {
      o << shape[d];
    }
  }
  o << (shape.size() == 1 ? ",)" : ")");
  return o.str();
}

void check_dtype(const char* name, const at::Tensor& t, std::initializer_list<at::ScalarType> dtypes) {
  if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end()) return;
  std::string want;
  for (auto d : dtypes) want += (want.empty() ? "" : " or ") + dtype_name(d);
  TORCH_CHECK_TYPE(false, kOp, ": ", name, " must be ", want, ", got ", dtype_name(t.scalar_type()));
}

void check_ndim(const char* name, const at::Tensor& t, int64_t ndim) {
  TORCH_CHECK_VALUE(t.dim() == ndim, kOp, ": ", name, " must have ", ndim, " dims, got shape ", shape_str(t.sizes()));
}

void check_shape(const char* name, const at::Tensor& t, std::vector<int64_t> want) {
  bool ok = t.dim() == static_cast<int64_t>(want.size());
  for (size_t d = 0; ok && d < want.size(); ++d) ok = want[d] < 0 || want[d] == t.size(d);
  TORCH_CHECK_VALUE(ok, kOp, ": ", name, " must have shape ", shape_str(want, true), ", got ", shape_str(t.sizes()));
}

void check_device(const char* name, const at::Tensor& t, const at::Device& dev) {
  TORCH_CHECK_VALUE(t.device() == dev, kOp, ": ", name, " must be on ", dev.str(), ", got ", t.device().str());
}

constexpr std::initializer_list<at::ScalarType> kIndexTypes = {at::kInt, at::kLong};

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

// [first, last] byte of t in its storage (_validate's _byte_span); false for an empty tensor
bool byte_span(const at::Tensor& t, int64_t* first, int64_t* last) {
  if (t.numel() == 0) return false;
  int64_t extent = 0;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  *first = t.storage_offset() * t.element_size();
  *last = *first + (extent + 1) * t.element_size() - 1;
  return true;
}

// _validate's check_no_overlap: an output sharing bytes with an input or the other output
void check_no_overlap(const at::Tensor& out, const at::Tensor& lse_out,
                      std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  std::vector<std::pair<const char*, const at::Tensor*>> outs = {{"out", &out}, {"lse_out", &lse_out}};
  std::vector<std::pair<const char*, const at::Tensor*>> others = outs;
  others.insert(others.end(), inputs.begin(), inputs.end());
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& o = *outs[i].second;
    int64_t of, ol;
    if (!byte_span(o, &of, &ol)) continue;
    for (size_t j = i + 1; j < others.size(); ++j) {
      const at::Tensor& t = *others[j].second;
      if (t.device() != o.device() || !t.has_storage() || !o.has_storage() ||
          t.storage().unsafeGetStorageImpl() != o.storage().unsafeGetStorageImpl())
        continue;
      int64_t tf, tl;
      TORCH_CHECK_VALUE(!(byte_span(t, &tf, &tl) && of <= tl && tf <= ol), kOp, ": ", outs[i].first,
                        " must not share memory with ", others[j].first);
    }
  }
}

// Every check of _validate (read_values=True: this path owns host data), in its order.
void check_paged_args(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                      const at::Tensor& kv_lens, std::optional<double> scale, const at::Tensor* out,
                      const at::Tensor* lse_out) {
  check_dtype("q", q, {at::kHalf, at::kBFloat16, at::kFloat});
  check_ndim("q", q, 3);
  const at::Device dev = q.device();
  const int64_t total_q = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK_VALUE(head_dim >= 1, kOp, ": q's head_dim (dim 2) must be >= 1, got ", head_dim);
  check_dtype("k_cache", k_cache, {q.scalar_type()});
  check_ndim("k_cache", k_cache, 4);
  check_device("k_cache", k_cache, dev);
  check_shape("k_cache", k_cache, {-1, -1, -1, head_dim});
  const int64_t num_pages = k_cache.size(0), page_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  check_dtype("v_cache", v_cache, {q.scalar_type()});
  check_shape("v_cache", v_cache, k_cache.sizes().vec());
  check_device("v_cache", v_cache, dev);
  TORCH_CHECK_VALUE(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, kOp, ": q's num_heads (", num_heads,
                    ") must be a multiple of k_cache's num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK_VALUE(page_size >= 1, kOp, ": k_cache's page_size (dim 1) must be >= 1, got ", page_size);
  check_dtype("q_pos", q_pos, kIndexTypes);
  check_shape("q_pos", q_pos, {total_q});
  check_device("q_pos", q_pos, dev);
  // check_cu_seqlens
  check_dtype("cu_seqlens_q", cu_seqlens_q, kIndexTypes);
  check_ndim("cu_seqlens_q", cu_seqlens_q, 1);
  check_device("cu_seqlens_q", cu_seqlens_q, dev);
  TORCH_CHECK_VALUE(cu_seqlens_q.numel() >= 1, kOp, ": cu_seqlens_q must have at least one entry (batch + 1)");
  const int64_t batch = cu_seqlens_q.numel() - 1;
  const IndexView cu(cu_seqlens_q);
  TORCH_CHECK_VALUE(cu(0) == 0 && cu(batch) == total_q, kOp, ": cu_seqlens_q must start at 0 and end at ", total_q,
                    " (the packed length), got ", cu(0), " .. ", cu(batch));
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK_VALUE(cu(b + 1) >= cu(b), kOp, ": cu_seqlens_q must be non-decreasing");
  check_dtype("block_table", block_table, kIndexTypes);
  check_ndim("block_table", block_table, 2);
  check_device("block_table", block_table, dev);
  check_shape("block_table", block_table, {batch, -1});
  check_dtype("kv_lens", kv_lens, kIndexTypes);
  check_shape("kv_lens", kv_lens, {batch});
  check_device("kv_lens", kv_lens, dev);
  TORCH_CHECK_VALUE(!scale || std::isfinite(*scale), kOp, ": scale must be finite, got ", scale ? *scale : 0.0);
  if (out) {
    check_dtype("out", *out, {q.scalar_type()});
    check_shape("out", *out, q.sizes().vec());
    check_device("out", *out, dev);
    check_dtype("lse_out", *lse_out, {at::kFloat});
    check_shape("lse_out", *lse_out, {total_q, num_heads});
    check_device("lse_out", *lse_out, dev);
    check_no_overlap(*out, *lse_out,
                     {{"q", &q}, {"q_pos", &q_pos}, {"cu_seqlens_q", &cu_seqlens_q}, {"k_cache", &k_cache},
                      {"v_cache", &v_cache}, {"block_table", &block_table}, {"kv_lens", &kv_lens}});
  }
  // the value checks (one pass each; the Python side reads the same values with reductions)
  const IndexView pos(q_pos), bt(block_table), lens(kv_lens);
  const int64_t max_pages = block_table.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens(b);
    TORCH_CHECK_VALUE(len >= 0 && len <= max_pages * page_size, kOp,
                      ": kv_lens must lie in [0, max_pages * page_size = ", max_pages * page_size, "], got ", len,
                      " for sequence ", b);
  }
  for (int64_t r = 0; r < total_q; ++r)
    TORCH_CHECK_VALUE(pos(r) >= 0, kOp, ": q_pos must be >= 0, got ", pos(r), " at row ", r);
  for (int64_t b = 0; b < batch; ++b) {
    // pages used by kv_lens: the first ceil(kv_lens / page_size) of each row; others may be anything
    for (int64_t j = 0; j * page_size < lens(b); ++j) {
      const int64_t page = bt(b, j);
      TORCH_CHECK_VALUE(page >= 0 && page < num_pages, kOp,
                        ": block_table entries used by kv_lens must lie in [0, num_pages = ", num_pages, "), got ",
                        page, " at [", b, ", ", j, "]");
    }
  }
}

// RAGATTN_CPU_BACKEND (read on every call, like ragattn._extension.cpu_backend): the kernel for
// unset/"default"/"twin"; anything else goes to the Python backends, which also reject bad values.
bool use_python_backend() {
  const char* env = std::getenv("RAGATTN_CPU_BACKEND");
  if (env == nullptr) return false;
  std::string v;
  for (const char* c = env; *c; ++c) v += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  const size_t a = v.find_first_not_of(" \t\n\r\f\v"), e = v.find_last_not_of(" \t\n\r\f\v");
  v = a == std::string::npos ? "" : v.substr(a, e - a + 1);
  return !(v.empty() || v == "default" || v == "twin");
}

std::tuple<at::Tensor, at::Tensor> python_backend(const at::Tensor& q, const at::Tensor& q_pos,
                                                  const at::Tensor& cu_seqlens_q, const at::Tensor& k_cache,
                                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                                  const at::Tensor& kv_lens, std::optional<double> scale,
                                                  int64_t window_left) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ragattn::_paged_attention_cpu_backend", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, std::optional<double>, int64_t)>();
  return op.call(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left);
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


// Query rows x kv heads [begin, end): item = row * num_kv_heads + kv_head.
template <typename T>
RAGATTN_ALWAYS_INLINE void paged_items(const PagedArgs& a, int64_t begin, int64_t end) {
  const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, S = a.page_size;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> buf(G * D * 2 + G * kPRow + G * 4);
  float* qf = buf.data();       // [G, D] the group's query rows in float
  float* acc = qf + G * D;      // [G, D] unnormalised outputs
  float* p = acc + G * D;       // [G, kPRow] scores, then probabilities
  float* m = p + G * kPRow;     // [G] running max
  float* l = m + G;             // [G] running sum
  float* alpha = l + G;         // [G] this chunk's rescale of acc (0 for a poisoned head)
  float* bad = alpha + G;       // [G] 1: a NaN or +inf visible score
  // chunk-local slot pointers (+ 8: the last block of dots8 is padded with a visible slot)
  const T* kslot[kChunk + 8];
  const T* vslot[kChunk];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item / a.num_kv_heads, g = item % a.num_kv_heads;
    const int64_t b = a.row_seq[i];
    const int64_t pos = a.q_pos(i), kv_len = a.kv_lens(b);
    const int64_t hi = pos >= kv_len ? kv_len : pos + 1;  // never pos + 1 past int64 max
    const int64_t lo = a.window_left >= 0 ? std::max<int64_t>(0, pos - a.window_left) : 0;
    const T* qrow = static_cast<const T*>(a.q) + i * a.q_s0 + g * G * a.q_s1;
    for (int64_t h = 0; h < G; ++h) {
      for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(qrow[h * a.q_s1 + d]);
      m[h] = neg_inf;
      l[h] = 0.f;
      bad[h] = 0.f;
    }
    std::fill(acc, acc + G * D, 0.f);
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
      for (int64_t s = first + n; s < first + (n + 7) / 8 * 8; ++s) kslot[s] = kslot[first];
      // the G heads' scores (k padded with a visible slot to a multiple of 8; scores past n unused)
      dot_rows<kPRow>(qf, G, D, kslot + first, n, a.scale, p + first);
      for (int64_t h = 0; h < G; ++h) {
        alpha[h] = 0.f;  // a poisoned head's acc is never read again
        if (bad[h] == 0.f && !softmax_step(p + h * kPRow, first, n, m + h, l + h, alpha + h)) bad[h] = 1.f;
      }
      // heads in pairs: each V row loaded once for both
      int64_t h = 0;
      for (; h + 2 <= G; h += 2) accumulate<2, kPRow>(acc + h * D, p + h * kPRow + first, alpha + h, vslot + first, n, D);
      for (; h < G; ++h) accumulate<1, kPRow>(acc + h * D, p + h * kPRow + first, alpha + h, vslot + first, n, D);
    }
    for (int64_t h = 0; h < G; ++h) {
      const int64_t head = g * G + h;
      T* orow = static_cast<T*>(a.out) + i * a.o_s0 + head * a.o_s1;
      float* lse = a.lse + i * a.l_s0 + head * a.l_s1;
      if (bad[h] != 0.f) {
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(nan);
        *lse = nan;
      } else if (l[h] == 0.f) {  // no visible slot (l >= 1 otherwise: the max slot contributes 1)
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(0.f);
        *lse = neg_inf;
      } else {
        const float inv = 1.f / l[h];
        const float* acch = acc + h * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(std::isfinite(acch[d]) ? acch[d] * inv : nan);
        *lse = m[h] + logf(l[h]);
      }
    }
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
                const at::Tensor& kv_lens, float scale, int64_t window_left, const at::Tensor& out,
                const at::Tensor& lse_out) {
  const int64_t total_q = q.size(0), batch = kv_lens.size(0);
  if (total_q == 0) return;
  // sequence of each query row, from cu_seqlens_q
  std::vector<int64_t> row_seq(total_q);
  const IndexView cu(cu_seqlens_q);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = cu(b); r < cu(b + 1); ++r) row_seq[r] = b;
  PagedArgs a{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), lse_out.data_ptr<float>(),
              row_seq.data(), IndexView(q_pos), IndexView(block_table), IndexView(kv_lens),
              q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
              q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
              lse_out.stride(0), lse_out.stride(1), scale, window_left};
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

}  // namespace

std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(const at::Tensor& q, const at::Tensor& q_pos,
                                                       const at::Tensor& cu_seqlens_q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& block_table,
                                                       const at::Tensor& kv_lens, std::optional<double> scale,
                                                       int64_t window_left) {
  check_paged_args(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, nullptr, nullptr);
  if (use_python_backend())
    return python_backend(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, window_left);
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, like the fake impl
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  run_kernel(unit_last_stride(q), q_pos, cu_seqlens_q, unit_last_stride(k_cache), unit_last_stride(v_cache),
             block_table, kv_lens, static_cast<float>(s), window_left, out, lse);
  return {out, lse};
}

void paged_attention_out_cpu(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                             const at::Tensor& kv_lens, std::optional<double> scale, int64_t window_left,
                             const at::Tensor& out, const at::Tensor& lse_out) {
  check_paged_args(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale, &out, &lse_out);
  if (use_python_backend()) {
    auto [o, lse] = python_backend(q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, kv_lens, scale,
                                   window_left);
    out.copy_(o);
    lse_out.copy_(lse);
    return;
  }
  const at::Tensor o = out.stride(-1) == 1 ? out : at::empty(q.sizes(), q.options());  // copied in below
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  run_kernel(unit_last_stride(q), q_pos, cu_seqlens_q, unit_last_stride(k_cache), unit_last_stride(v_cache),
             block_table, kv_lens, static_cast<float>(s), window_left, o, lse_out);
  if (!o.is_same(out)) out.copy_(o);
}

}  // namespace ragattn
