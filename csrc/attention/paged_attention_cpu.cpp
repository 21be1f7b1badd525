// CPU path of paged_attention: each (query row, kv head) reads its visible slots in place from
// the page table (no gather, no mask), the GQA group's query heads together so every K/V row is
// loaded once per group, with an online softmax over chunks of slots (softmax_math.h).
// Registered as ragattn::_paged_attention_cpu; ragattn/ops/paged_attention.py validates and calls
// it. Semantics are the op's (docs/ops.md): row i of sequence b sees slot j iff j < kv_lens[b],
// j <= q_pos[i] and (window_left < 0 or j >= q_pos[i] - window_left); only those slots are ever
// read; a non-finite visible score makes the (row, head) NaN in out and lse; a non-finite visible
// v[j, d] makes out[i, h, d] NaN; a row that sees nothing gets out 0 and lse -inf.
// GCC notes that 32-byte vector arguments change the ABI: the v8f helpers are always inlined
#pragma GCC diagnostic ignored "-Wpsabi"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "attention/softmax_math.h"
#include "common/cpu_isa.h"
#include "common/vec8.h"
#include "ops.h"

namespace ragattn {
namespace {

constexpr int64_t kChunk = 32;  // slots per online-softmax step

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

template <typename T>
RAGATTN_ALWAYS_INLINE v8f load8(const T* p) {
  float tmp[8];
  for (int u = 0; u < 8; ++u) tmp[u] = static_cast<float>(p[u]);
  v8f r;
  std::memcpy(&r, tmp, sizeof(r));
  return r;
}

template <>
RAGATTN_ALWAYS_INLINE v8f load8<float>(const float* p) {
  v8f r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

RAGATTN_ALWAYS_INLINE float hsum8(v8f a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// Four dot products of q with the rows k0..k3 (four independent accumulator chains).
template <typename T>
RAGATTN_ALWAYS_INLINE void dot4_f32(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t n,
                                    float* out) {
  v8f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const v8f x = load8(q + d);
    a0 += x * load8(k0 + d);
    a1 += x * load8(k1 + d);
    a2 += x * load8(k2 + d);
    a3 += x * load8(k3 + d);
  }
  float t0 = hsum8(a0), t1 = hsum8(a1), t2 = hsum8(a2), t3 = hsum8(a3);
  for (; d < n; ++d) {  // head dims that are not a multiple of 8
    t0 += q[d] * static_cast<float>(k0[d]);
    t1 += q[d] * static_cast<float>(k1[d]);
    t2 += q[d] * static_cast<float>(k2[d]);
    t3 += q[d] * static_cast<float>(k3[d]);
  }
  out[0] = t0;
  out[1] = t1;
  out[2] = t2;
  out[3] = t3;
}

// Dot products of two query rows qa, qb with the rows k0..k3: out[0:4] for qa, out[4:8] for qb
// (eight accumulator chains; six loads per eight multiply-adds).
template <typename T>
RAGATTN_ALWAYS_INLINE void dot2x4_f32(const float* qa, const float* qb, const T* k0, const T* k1, const T* k2,
                                      const T* k3, int64_t n, float* out) {
  v8f a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const v8f x = load8(qa + d), y = load8(qb + d);
    const v8f c0 = load8(k0 + d), c1 = load8(k1 + d), c2 = load8(k2 + d), c3 = load8(k3 + d);
    a0 += x * c0;
    a1 += x * c1;
    a2 += x * c2;
    a3 += x * c3;
    b0 += y * c0;
    b1 += y * c1;
    b2 += y * c2;
    b3 += y * c3;
  }
  float t[8] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3), hsum8(b0), hsum8(b1), hsum8(b2), hsum8(b3)};
  const T* k[4] = {k0, k1, k2, k3};
  for (; d < n; ++d) {  // head dims that are not a multiple of 8
    for (int r = 0; r < 4; ++r) {
      t[r] += qa[d] * static_cast<float>(k[r][d]);
      t[4 + r] += qb[d] * static_cast<float>(k[r][d]);
    }
  }
  for (int r = 0; r < 8; ++r) out[r] = t[r];
}

// acc[0:n] += p * v[0:n]
template <typename T>
RAGATTN_ALWAYS_INLINE void axpy_f32(float* acc, float p, const T* v, int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    v8f a = load8(acc + d);
    a += p * load8(v + d);
    std::memcpy(acc + d, &a, sizeof(a));
  }
  for (; d < n; ++d) acc[d] += p * static_cast<float>(v[d]);
}

// acc_a[0:n] += pa * v[0:n] and acc_b[0:n] += pb * v[0:n]
template <typename T>
RAGATTN_ALWAYS_INLINE void axpy2_f32(float* acc_a, float* acc_b, float pa, float pb, const T* v, int64_t n) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const v8f x = load8(v + d);
    v8f a = load8(acc_a + d), b = load8(acc_b + d);
    a += pa * x;
    b += pb * x;
    std::memcpy(acc_a + d, &a, sizeof(a));
    std::memcpy(acc_b + d, &b, sizeof(b));
  }
  for (; d < n; ++d) {
    const float x = static_cast<float>(v[d]);
    acc_a[d] += pa * x;
    acc_b[d] += pb * x;
  }
}

// Query rows x kv heads [begin, end): item = row * num_kv_heads + kv_head.
template <typename T>
RAGATTN_ALWAYS_INLINE void paged_items(const PagedArgs& a, int64_t begin, int64_t end) {
  const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, S = a.page_size;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> buf(G * D * 2 + G * kChunk + G * 3);
  float* qf = buf.data();        // [G, D] the group's query rows in float
  float* acc = qf + G * D;       // [G, D] unnormalised outputs
  float* p = acc + G * D;        // [G, kChunk] scores, then probabilities
  float* m = p + G * kChunk;     // [G] running max
  float* l = m + G;              // [G] running sum
  float* bad = l + G;            // [G] 1: a non-finite visible score
  const T* kslot[kChunk];
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
    int64_t page_idx = lo / S, off = lo % S;  // slot lo's page-table entry and offset, stepped below
    for (int64_t c = lo; c < hi; c += kChunk) {
      const int64_t n = std::min(kChunk, hi - c);
      for (int64_t s = 0; s < n; ++s) {
        const int64_t page = a.block_table(b, page_idx);
        kslot[s] = static_cast<const T*>(a.k) + page * a.k_s0 + off * a.k_s1 + g * a.k_s2;
        vslot[s] = static_cast<const T*>(a.v) + page * a.v_s0 + off * a.v_s1 + g * a.v_s2;
        if (++off == S) {
          off = 0;
          ++page_idx;
        }
      }
      for (int64_t s = n; s < (n + 3) / 4 * 4; ++s) kslot[s] = kslot[0];  // pad the last quad (ignored)
      float dots[8];
      for (int64_t s = 0; s < n; s += 4) {
        int64_t h = 0;
        for (; h + 2 <= G; h += 2) {  // two heads at once: each K row loaded once for both
          dot2x4_f32(qf + h * D, qf + (h + 1) * D, kslot[s], kslot[s + 1], kslot[s + 2], kslot[s + 3], D, dots);
          for (int64_t r = 0; r < 4 && s + r < n; ++r) {
            p[h * kChunk + s + r] = dots[r] * a.scale;
            p[(h + 1) * kChunk + s + r] = dots[4 + r] * a.scale;
          }
        }
        for (; h < G; ++h) {
          dot4_f32(qf + h * D, kslot[s], kslot[s + 1], kslot[s + 2], kslot[s + 3], D, dots);
          for (int64_t r = 0; r < 4 && s + r < n; ++r) p[h * kChunk + s + r] = dots[r] * a.scale;
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        if (bad[h] != 0.f) continue;
        float* ph = p + h * kChunk;
        float cmax = neg_inf;
        bool finite = true;
        for (int64_t s = 0; s < n; ++s) {
          finite &= std::isfinite(ph[s]);
          cmax = ph[s] > cmax ? ph[s] : cmax;
        }
        if (!finite) {
          bad[h] = 1.f;
          continue;
        }
        const float m_new = std::max(m[h], cmax);
        const float alpha = softmax::rescale(m[h], m_new);
        float* acch = acc + h * D;
        if (alpha != 1.f) {
          for (int64_t d = 0; d < D; ++d) acch[d] *= alpha;
        }
        float sum = 0.f;
        for (int64_t s = n; s < (n + 7) / 8 * 8; ++s) ph[s] = neg_inf;  // whole vectors: exp(-inf) = 0
        for (int64_t s = 0; s < n; s += 8) {
          const v8f e = exp8_nonpositive(load8(ph + s) - m_new);
          std::memcpy(ph + s, &e, sizeof(e));
          sum += hsum8(e);
        }
        l[h] = l[h] * alpha + sum;
        m[h] = m_new;
      }
      for (int64_t s = 0; s < n; ++s) {
        int64_t h = 0;
        for (; h + 2 <= G; h += 2) {  // two heads at once: each V row loaded once for both
          if (bad[h] == 0.f && bad[h + 1] == 0.f) {
            axpy2_f32(acc + h * D, acc + (h + 1) * D, p[h * kChunk + s], p[(h + 1) * kChunk + s], vslot[s], D);
          } else {
            if (bad[h] == 0.f) axpy_f32(acc + h * D, p[h * kChunk + s], vslot[s], D);
            if (bad[h + 1] == 0.f) axpy_f32(acc + (h + 1) * D, p[(h + 1) * kChunk + s], vslot[s], D);
          }
        }
        for (; h < G; ++h)
          if (bad[h] == 0.f) axpy_f32(acc + h * D, p[h * kChunk + s], vslot[s], D);
      }
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

template <typename T>
void paged_items_generic(const PagedArgs& a, int64_t begin, int64_t end) {
  paged_items<T>(a, begin, end);
}

#if RAGATTN_HAVE_AVX2_VARIANT
template <typename T>
RAGATTN_TARGET_AVX2 void paged_items_avx2(const PagedArgs& a, int64_t begin, int64_t end) {
  paged_items<T>(a, begin, end);
}
#endif

// The value checks of ragattn/ops/paged_attention.py's _validate (same messages; reading host
// data is free here, and one pass in C++ costs less than the Python reductions). Fills row_seq.
void check_paged_values(const at::Tensor& cu_seqlens_q, const at::Tensor& q_pos, const at::Tensor& block_table,
                        const at::Tensor& kv_lens, int64_t total_q, int64_t num_pages, int64_t page_size,
                        std::vector<int64_t>& row_seq) {
  const IndexView cu(cu_seqlens_q), pos(q_pos), bt(block_table), lens(kv_lens);
  const int64_t batch = kv_lens.size(0), max_pages = block_table.size(1);
  TORCH_CHECK_VALUE(cu(0) == 0 && cu(batch) == total_q, "ragattn.paged_attention: cu_seqlens_q must start at 0 and end at ",
                    total_q, " (the packed length), got ", cu(0), " .. ", cu(batch));
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(cu(b + 1) >= cu(b) && cu(b + 1) <= total_q,
                      "ragattn.paged_attention: cu_seqlens_q must be non-decreasing");
    const int64_t len = lens(b);
    TORCH_CHECK_VALUE(len >= 0 && len <= max_pages * page_size,
                      "ragattn.paged_attention: kv_lens must lie in [0, max_pages * page_size = ", max_pages * page_size,
                      "], got ", len, " for sequence ", b);
    // pages used by kv_lens: the first ceil(kv_lens / page_size) of each row; others may be anything
    for (int64_t j = 0; j * page_size < len; ++j) {
      const int64_t page = bt(b, j);
      TORCH_CHECK_VALUE(page >= 0 && page < num_pages,
                        "ragattn.paged_attention: block_table entries used by kv_lens must lie in [0, num_pages = ",
                        num_pages, "), got ", page, " at [", b, ", ", j, "]");
    }
    for (int64_t r = cu(b); r < cu(b + 1); ++r) row_seq[r] = b;
  }
  for (int64_t r = 0; r < total_q; ++r) {
    const int64_t p = pos(r);
    TORCH_CHECK_VALUE(p >= 0, "ragattn.paged_attention: q_pos must be >= 0, got ", p, " at row ", r);
  }
}

}  // namespace

void paged_attention_cpu(const at::Tensor& q, const at::Tensor& q_pos, const at::Tensor& cu_seqlens_q,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                         const at::Tensor& kv_lens, double scale, int64_t window_left, const at::Tensor& out,
                         const at::Tensor& lse_out) {
  // every shape/dtype/value check is the Python op's (ragattn/ops/paged_attention.py); this entry
  // needs unit last-dim strides of q, the caches and out (the caller copies otherwise)
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && out.stride(2) == 1,
              "ragattn._paged_attention_cpu: q, k_cache, v_cache and out need a unit last-dim stride");
  const int64_t total_q = q.size(0), batch = kv_lens.size(0);
  const int64_t num_pages = k_cache.size(0), page_size = k_cache.size(1);
  // sequence of each query row, from cu_seqlens_q
  std::vector<int64_t> row_seq(total_q);
  check_paged_values(cu_seqlens_q, q_pos, block_table, kv_lens, total_q, num_pages, page_size, row_seq);
  PagedArgs a{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), lse_out.data_ptr<float>(),
              row_seq.data(), IndexView(q_pos), IndexView(block_table), IndexView(kv_lens),
              q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
              q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
              lse_out.stride(0), lse_out.stride(1), static_cast<float>(scale), window_left};
  const int64_t items = total_q * a.num_kv_heads;
  if (items == 0) return;
  // grain: about GRAIN_SIZE multiply-adds per task, from the average cached length
  int64_t kv_total = 0;
  for (int64_t b = 0; b < batch; ++b) kv_total += a.kv_lens(b);
  const int64_t per_item = std::max<int64_t>(1, (kv_total / std::max<int64_t>(1, batch)) * a.head_dim *
                                                    (a.num_heads / a.num_kv_heads));
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / per_item);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_attention_cpu", [&] {
    void (*run)(const PagedArgs&, int64_t, int64_t) = &paged_items_generic<scalar_t>;
#if RAGATTN_HAVE_AVX2_VARIANT
    if (cpu_has_avx2()) run = &paged_items_avx2<scalar_t>;
#endif
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) { run(a, begin, end); });
  });
}

}  // namespace ragattn
