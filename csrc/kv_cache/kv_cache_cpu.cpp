// CPU twins of rerotate_keys_ and copy_kv_: same validation and same per-element math
// (rope_math.h, row_layout.h) as the CUDA kernels. Parallel over layers (at::parallel_for on torch's
// OpenMP threads, setup.py): every row of a layer is written by one thread with the same math, so
// results are bit-identical at any thread count; each delta's cos/sin are computed once per block
// of rows and reused across every layer and head. float8_e4m3fn caches (fp8_math.h) are read as
// stored * scale and written as saturate(value / scale), per layer, in the same pass.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/check_message.h"
#include "kv_cache/fp8_math.h"
#include "kv_cache/kv_cache_checks.h"
#include "kv_cache/rope_math.h"
#include "kv_cache/row_layout.h"
#include "ops.h"

namespace ragattn {
namespace {

using kv_cache::Fp8E4M3;
using kv_cache::IsFp8;
using kv_cache::load_elem;
using kv_cache::RowLayout;
using kv_cache::store_elem;

// cos/sin of row delta `d` for every frequency.
void row_cos_sin(int64_t d, const float* inv_freq, int64_t half, float* c, float* s) {
  for (int64_t i = 0; i < half; ++i) rope::angle_cos_sin(d, inv_freq[i], &c[i], &s[i]);
}

// Rotate one stored pair in place, fp8 elements through their scale.
template <typename T>
inline void rotate_elem_pair(T* a, T* b, float c, float s, float scale) {
  if constexpr (IsFp8<T>::value) {
    float y1, y2;
    rope::rotate_pair(load_elem(*a, scale), load_elem(*b, scale), c, s, &y1, &y2);
    *a = store_elem<T>(y1, scale);
    *b = store_elem<T>(y2, scale);
  } else {
    rope::rotate_stored_pair(a, b, c, s);
  }
}

// Rotate the first `rotary_dim` dims of `heads` consecutive heads in place (scale: fp8 only).
template <typename T>
void rotate_row(T* row, int64_t heads, int64_t head_dim, int64_t rotary_dim, bool interleaved, const float* c,
                const float* s, float scale) {
  const int64_t half = rotary_dim / 2;
  if (!interleaved) {  // NeoX halves: two contiguous runs, a loop the compiler vectorises
    for (int64_t h = 0; h < heads; ++h) {
      T* __restrict__ x = row + h * head_dim;
      T* __restrict__ y = x + half;
      for (int64_t i = 0; i < half; ++i) rotate_elem_pair(&x[i], &y[i], c[i], s[i], scale);
    }
    return;
  }
  for (int64_t h = 0; h < heads; ++h) {
    T* x = row + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const int a = rope::pair_first(static_cast<int>(i), static_cast<int>(rotary_dim), interleaved);
      const int b = rope::pair_second(static_cast<int>(i), static_cast<int>(rotary_dim), interleaved);
      rotate_elem_pair(&x[a], &x[b], c[i], s[i], scale);
    }
  }
}

// out[0:rotary_dim] = in[0:rotary_dim] of one head rotated by the angles c, s (NeoX halves or GPT-J
// pairs, a compile-time choice so that the loop vectorises): rotate_row's math out of place, from
// TS to TD (fp8 sides through their scales).
template <bool kInterleaved, typename TS, typename TD>
void rotate_dims(TD* __restrict__ out, const TS* __restrict__ in, int rotary_dim, const float* __restrict__ c,
                 const float* __restrict__ s, float s_in, float s_out) {
  for (int i = 0; i < rotary_dim / 2; ++i) {
    const int a = rope::pair_first(i, rotary_dim, kInterleaved), b = rope::pair_second(i, rotary_dim, kInterleaved);
    float y1, y2;
    rope::rotate_pair(load_elem(in[a], s_in), load_elem(in[b], s_in), c[i], s[i], &y1, &y2);
    out[a] = store_elem<TD>(y1, s_out);
    out[b] = store_elem<TD>(y2, s_out);
  }
}

// n elements TS -> TD (a memcpy when the types match and neither is fp8 or the fp8 scales agree:
// requantising with the same scale is the identity).
template <typename TS, typename TD>
void convert_elems(TD* __restrict__ out, const TS* __restrict__ in, int64_t n, float s_in, float s_out) {
  if constexpr (std::is_same<TS, TD>::value) {
    if (!IsFp8<TS>::value || s_in == s_out) {
      std::memcpy(out, in, n * sizeof(TD));
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) out[i] = store_elem<TD>(load_elem(in[i], s_in), s_out);
}

// dst row <- src row with the first `rotary_dim` dims of every head rotated, in one pass (a
// memcpy then rotate_row in place over the same row cost ~1.3x more on SmolLM2's assembly).
template <typename TS, typename TD>
void copy_rotated_row(TD* dst, const TS* src, int64_t heads, int64_t head_dim, int64_t rotary_dim, bool interleaved,
                      const float* c, const float* s, float s_in, float s_out) {
  for (int64_t h = 0; h < heads; ++h) {
    TD* y = dst + h * head_dim;
    const TS* x = src + h * head_dim;
    if (interleaved) {
      rotate_dims<true>(y, x, static_cast<int>(rotary_dim), c, s, s_in, s_out);
    } else {
      rotate_dims<false>(y, x, static_cast<int>(rotary_dim), c, s, s_in, s_out);
    }
    if (rotary_dim < head_dim) convert_elems(y + rotary_dim, x + rotary_dim, head_dim - rotary_dim, s_in, s_out);
  }
}

// Work items per parallel task: about at::internal::GRAIN_SIZE elements each, so that a small
// call (a decode step's append of one row) runs inline, without an OpenMP region.
int64_t items_per_task(int64_t elements_per_item) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, elements_per_item));
}

std::vector<void*> data_ptrs(at::TensorList layers) {
  std::vector<void*> out;
  for (const auto& t : layers) out.push_back(t.data_ptr());
  return out;
}

// Layers of one list (K or V of the sources or the destinations) with their row layout.
struct Side {
  std::vector<void*> k, v;
  RowLayout lk, lv;
  std::vector<float> sk, sv;  // per-layer scales (fp8 layers; empty: 1)
};

// Per-layer scales of L layers from a checked scale tensor (check_scale's stride; -1: none).
std::vector<float> layer_scales(const c10::optional<at::Tensor>& scale, int64_t stride, int64_t L) {
  if (stride < 0) return {};
  const at::Tensor s = scale->to(at::kCPU).reshape({-1});
  std::vector<float> out(L);
  for (int64_t l = 0; l < L; ++l) out[l] = s[stride == 0 ? 0 : l].item<float>();
  return out;
}

inline float scale_of(const std::vector<float>& s, int64_t l) { return s.empty() ? 1.f : s[l]; }

struct Rotation {
  const void* delta = nullptr;  // int32 or int64 [n]; nullptr: no rotation
  bool delta64 = false;
  const float* inv_freq = nullptr;
  int64_t rotary_dim = 0;
  bool interleaved = false;
};

// Rows per block of a call: the block's cos/sin tables are computed first (at most kBlockRows x
// rotary_dim floats), then each layer of the block is one task.
constexpr int64_t kBlockRows = 4096;

// cos/sin of the rotations of rows [r0, r1): run[r - r0] indexes the row's entry of c and s (rows
// of a chunk share their delta, hence one entry), -1 where the delta is 0 (identity).
struct BlockAngles {
  std::vector<int32_t> run;
  std::vector<float> c, s;
};

BlockAngles block_angles(const void* delta, bool delta64, const float* inv_freq, int64_t half, int64_t r0,
                         int64_t r1) {
  BlockAngles a;
  a.run.assign(r1 - r0, -1);
  std::vector<int64_t> runs;  // the delta of each entry
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t d = kv_cache::load_index(delta, delta64, r);
    if (d == 0) continue;
    if (runs.empty() || runs.back() != d) runs.push_back(d);
    a.run[r - r0] = static_cast<int32_t>(runs.size() - 1);
  }
  a.c.resize(runs.size() * half);
  a.s.resize(runs.size() * half);
  at::parallel_for(0, static_cast<int64_t>(runs.size()), items_per_task(half * 16), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) row_cos_sin(runs[i], inv_freq, half, &a.c[i * half], &a.s[i * half]);
  });
  return a;
}

// dst row dst_idx[n] <- src row src_idx[n] in every layer (an index of nullptr is the identity),
// K rotated by delta[n] when given. Rows of one call never overlap (validate_copy / staging).
// Layer-major: a task streams one layer's rows (K or V) of a block, so the memory seen at once is
// a few runs of rows, not 2 x layers of them (row-major over the layers ran at ~half the copy
// bandwidth on a 30-layer cache).
template <typename TS, typename TD>
void copy_pass(const Side& dst, const Side& src, const void* src_idx, bool src64, const void* dst_idx, bool dst64,
               int64_t n, int64_t k_heads, int64_t k_head_dim, int64_t v_row, const Rotation& rot) {
  const int64_t k_row = k_heads * k_head_dim, half = rot.rotary_dim / 2;
  const int64_t nk = static_cast<int64_t>(dst.k.size()), nv = static_cast<int64_t>(dst.v.size());
  for (int64_t r0 = 0; r0 < n; r0 += kBlockRows) {
    const int64_t r1 = std::min(n, r0 + kBlockRows);
    const BlockAngles a = rot.delta ? block_angles(rot.delta, rot.delta64, rot.inv_freq, half, r0, r1) : BlockAngles{};
    at::parallel_for(0, nk + nv, items_per_task((r1 - r0) * std::max(k_row, v_row)), [&](int64_t b, int64_t e) {
      for (int64_t item = b; item < e; ++item) {
        const bool is_k = item < nk;
        const int64_t l = is_k ? item : item - nk;
        const float s_in = scale_of(is_k ? src.sk : src.sv, l), s_out = scale_of(is_k ? dst.sk : dst.sv, l);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t sr = kv_cache::load_index(src_idx, src64, r), dr = kv_cache::load_index(dst_idx, dst64, r);
          if (!is_k) {
            convert_elems(static_cast<TD*>(dst.v[l]) + kv_cache::row_offset(dst.lv, dr),
                          static_cast<const TS*>(src.v[l]) + kv_cache::row_offset(src.lv, sr), v_row, s_in, s_out);
            continue;
          }
          TD* d = static_cast<TD*>(dst.k[l]) + kv_cache::row_offset(dst.lk, dr);
          const TS* x = static_cast<const TS*>(src.k[l]) + kv_cache::row_offset(src.lk, sr);
          const int32_t run = rot.delta ? a.run[r - r0] : -1;
          if (run >= 0) {
            copy_rotated_row(d, x, k_heads, k_head_dim, rot.rotary_dim, rot.interleaved, &a.c[run * half],
                             &a.s[run * half], s_in, s_out);
          } else {
            convert_elems(d, x, k_row, s_in, s_out);
          }
        }
      }
    });
  }
}

// The element type of a cache dtype, for the dispatch below (fp8 as its storage struct).
template <typename F>
void dispatch_elem(at::ScalarType t, const F& f) {
  switch (t) {
    case at::kHalf:
      return f(c10::Half{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kFloat:
      return f(float{});
    case at::kFloat8_e4m3fn:
      return f(Fp8E4M3{});
    default:
      RAGATTN_CHECK(false, "ragattn kv_cache: unsupported cache dtype ", t);
  }
}

// Per-layer views of a staging tensor [L, n, H, D] and their (one-level) row layout.
std::vector<void*> staging_layers(const at::Tensor& t) {
  std::vector<void*> out;
  for (int64_t l = 0; l < t.size(0); ++l) out.push_back(t[l].data_ptr());
  return out;
}

}  // namespace

void rerotate_keys_cpu(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                       const at::Tensor& inv_freq, int64_t rotary_dim, bool interleaved,
                       c10::optional<int64_t> num_kv_heads, const c10::optional<at::Tensor>& k_scale) {
  const kv_cache::RerotateGeom rg =
      kv_cache::validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim, num_kv_heads, k_scale);
  const kv_cache::LayerGeom& g = rg.g;
  const int64_t n = rows.size(0);
  if (k_layers.empty() || n == 0) return;
  const at::Tensor rows_c = rows.contiguous(), delta_c = delta.contiguous(), freq_c = inv_freq.contiguous();
  const void* rp = rows_c.const_data_ptr();
  const bool r64 = rows_c.scalar_type() == at::kLong;
  const void* dp = delta_c.const_data_ptr();
  const bool d64 = delta_c.scalar_type() == at::kLong;
  const float* fp = freq_c.data_ptr<float>();
  const std::vector<void*> bases = data_ptrs(k_layers);
  const int64_t half = rotary_dim / 2;
  const int64_t nl = static_cast<int64_t>(bases.size());
  const std::vector<float> scales = layer_scales(k_scale, rg.scale_stride, nl);
  dispatch_elem(k_layers[0].scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r0 = 0; r0 < n; r0 += kBlockRows) {  // layer-major, as copy_pass
      const int64_t r1 = std::min(n, r0 + kBlockRows);
      const BlockAngles a = block_angles(dp, d64, fp, half, r0, r1);
      at::parallel_for(0, nl, items_per_task((r1 - r0) * g.heads * g.head_dim), [&](int64_t b, int64_t e) {
        for (int64_t l = b; l < e; ++l) {
          const float scale = scale_of(scales, l);
          for (int64_t r = r0; r < r1; ++r) {
            const int32_t run = a.run[r - r0];
            if (run < 0) continue;  // identity
            const int64_t off = kv_cache::row_offset(g.layout, kv_cache::load_index(rp, r64, r));
            rotate_row(static_cast<T*>(bases[l]) + off, g.heads, g.head_dim, rotary_dim, interleaved,
                       &a.c[run * half], &a.s[run * half], scale);
          }
        }
      });
    }
  });
}

void copy_kv_cpu(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                 const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                 const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim, bool interleaved,
                 c10::optional<int64_t> num_kv_heads, const c10::optional<at::Tensor>& src_k_scale,
                 const c10::optional<at::Tensor>& src_v_scale, const c10::optional<at::Tensor>& dst_k_scale,
                 const c10::optional<at::Tensor>& dst_v_scale) {
  const kv_cache::CopyGeom g =
      kv_cache::validate_copy(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim,
                              num_kv_heads, src_k_scale, src_v_scale, dst_k_scale, dst_v_scale);
  const int64_t n = src_rows.size(0);
  if (dst_k.empty() || n == 0) return;
  const int64_t L = static_cast<int64_t>(dst_k.size());
  const at::Tensor sr = src_rows.contiguous(), dr = dst_rows.contiguous();
  const bool s64 = sr.scalar_type() == at::kLong, d64 = dr.scalar_type() == at::kLong;
  at::Tensor delta_c, freq_c;
  Rotation rot;
  if (delta.has_value()) {
    delta_c = delta->contiguous();
    freq_c = inv_freq->contiguous();
    rot = Rotation{delta_c.const_data_ptr(), delta_c.scalar_type() == at::kLong, freq_c.data_ptr<float>(), rotary_dim,
                   interleaved};
  }
  const Side dst{data_ptrs(dst_k), g.has_v ? data_ptrs(dst_v) : std::vector<void*>{}, g.k.layout, g.v.layout,
                 layer_scales(dst_k_scale, g.dk_scale, L), layer_scales(dst_v_scale, g.dv_scale, L)};
  const Side src{data_ptrs(src_k), g.has_v ? data_ptrs(src_v) : std::vector<void*>{}, g.sk.layout, g.sv.layout,
                 layer_scales(src_k_scale, g.sk_scale, L), layer_scales(src_v_scale, g.sv_scale, L)};
  const int64_t v_row = g.v.heads * g.v.head_dim;
  const at::ScalarType sdt = src_k[0].scalar_type(), ddt = dst_k[0].scalar_type();
  // A source shares memory with a destination: gather every source row first, then scatter (the
  // reference's semantics; validate_copy already refused overlapping destinations). The staging
  // copy is in the destination dtype, float32 when a side is fp8 (exact for the dequantised rows,
  // so that the second pass rounds once, as the one-pass copy does).
  const bool fp8 = sdt == at::kFloat8_e4m3fn || ddt == at::kFloat8_e4m3fn;
  const at::ScalarType tdt = fp8 ? at::kFloat : ddt;
  // A move between pages of one pool (a copy on write: sources and destinations are the same
  // layers) clobbers a source only where a row is both read and written; otherwise the one-pass
  // copy reads every source row intact (and skips a temporary as large as the copy, fresh memory
  // that page-faults on every call).
  const bool staged = g.overlap == kv_cache::ReadWriteOverlap::kOther ||
                      (g.overlap == kv_cache::ReadWriteOverlap::kSameRows && kv_cache::rows_meet(sr, dr));
  at::Tensor tk, tv;
  Side tmp;
  if (staged) {
    tk = at::empty({L, n, g.k.heads, g.k.head_dim}, dst_k[0].options().dtype(tdt));
    tv = g.has_v ? at::empty({L, n, g.v.heads, g.v.head_dim}, dst_k[0].options().dtype(tdt)) : at::Tensor();
    tmp = Side{staging_layers(tk), g.has_v ? staging_layers(tv) : std::vector<void*>{},
               RowLayout{n, g.k.heads * g.k.head_dim, n * g.k.heads * g.k.head_dim}, RowLayout{n, v_row, n * v_row},
               {}, {}};
  }
  dispatch_elem(sdt, [&](auto stag) {
    using TS = decltype(stag);
    dispatch_elem(ddt, [&](auto dtag) {
      using TD = decltype(dtag);
      if constexpr (std::is_same<TS, TD>::value || IsFp8<TS>::value || IsFp8<TD>::value) {
        if (!staged) {
          copy_pass<TS, TD>(dst, src, sr.const_data_ptr(), s64, dr.const_data_ptr(), d64, n, g.k.heads, g.k.head_dim,
                            v_row, rot);
          return;
        }
        using TT = typename std::conditional<IsFp8<TS>::value || IsFp8<TD>::value, float, TD>::type;
        copy_pass<TS, TT>(tmp, src, sr.const_data_ptr(), s64, nullptr, false, n, g.k.heads, g.k.head_dim, v_row,
                          Rotation{});
        copy_pass<TT, TD>(dst, tmp, nullptr, false, dr.const_data_ptr(), d64, n, g.k.heads, g.k.head_dim, v_row, rot);
      } else {
        RAGATTN_CHECK(false, "ragattn.copy_kv_: unsupported dtype pair ", sdt, " -> ", ddt);
      }
    });
  });
}

}  // namespace ragattn
