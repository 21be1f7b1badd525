// CPU twins of rerotate_keys_ and copy_kv_: same validation and same per-element math
// (rope_math.h, row_layout.h) as the CUDA kernels. Parallel over rows (at::parallel_for on torch's
// OpenMP threads, setup.py): every row is written by one thread in one fixed order, so results are
// bit-identical at any thread count; each row's cos/sin are computed once and reused across every
// layer and head.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kv_cache/kv_cache_checks.h"
#include "kv_cache/rope_math.h"
#include "kv_cache/row_layout.h"
#include "ops.h"

namespace ragattn {
namespace {

using kv_cache::RowLayout;

// cos/sin of row delta `d` for every frequency.
void row_cos_sin(int32_t d, const float* inv_freq, int64_t half, float* c, float* s) {
  for (int64_t i = 0; i < half; ++i) rope::angle_cos_sin(d, inv_freq[i], &c[i], &s[i]);
}

// out[0:rotary_dim] = in[0:rotary_dim] of one head rotated by the angles c, s (NeoX halves or GPT-J
// pairs, a compile-time choice so that the loop vectorises): rope_math.h's pair rotation in fp32.
template <bool kInterleaved, typename T>
void rotate_dims(T* __restrict__ out, const T* __restrict__ in, int64_t rotary_dim, const float* c, const float* s) {
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    const int a = rope::pair_first(static_cast<int>(i), static_cast<int>(rotary_dim), kInterleaved);
    const int b = rope::pair_second(static_cast<int>(i), static_cast<int>(rotary_dim), kInterleaved);
    float y1, y2;
    rope::rotate_pair(rope::to_f32(in[a]), rope::to_f32(in[b]), c[i], s[i], &y1, &y2);
    out[a] = rope::from_f32<T>(y1);
    out[b] = rope::from_f32<T>(y2);
  }
}

template <typename T>
void rotate_dims(T* out, const T* in, int64_t rotary_dim, bool interleaved, const float* c, const float* s) {
  if (interleaved) {
    rotate_dims<true>(out, in, rotary_dim, c, s);
  } else {
    rotate_dims<false>(out, in, rotary_dim, c, s);
  }
}

// Rotate the first `rotary_dim` dims of `heads` consecutive heads in place (through a copy of
// each head's rotated dims, so that rotate_dims reads and writes disjoint memory).
template <typename T>
void rotate_row(T* row, int64_t heads, int64_t head_dim, int64_t rotary_dim, bool interleaved, const float* c,
                const float* s, T* scratch) {
  for (int64_t h = 0; h < heads; ++h) {
    std::memcpy(scratch, row + h * head_dim, rotary_dim * sizeof(T));
    rotate_dims(row + h * head_dim, scratch, rotary_dim, interleaved, c, s);
  }
}

// dst row <- src row with the first `rotary_dim` dims of every head rotated: one pass, each
// element written once.
template <typename T>
void copy_rotated_row(T* dst, const T* src, int64_t heads, int64_t head_dim, int64_t rotary_dim, bool interleaved,
                      const float* c, const float* s) {
  for (int64_t h = 0; h < heads; ++h) {
    rotate_dims(dst + h * head_dim, src + h * head_dim, rotary_dim, interleaved, c, s);
    if (rotary_dim < head_dim)
      std::memcpy(dst + h * head_dim + rotary_dim, src + h * head_dim + rotary_dim, (head_dim - rotary_dim) * sizeof(T));
  }
}

// The rotations of rows [begin, end) of a call: cos/sin computed once per run of equal deltas
// (the rows of a chunk share one), and nothing for rows of delta 0 (identity) or without delta.
class RowAngles {
 public:
  RowAngles(const int32_t* delta, const float* inv_freq, int64_t half, int64_t begin, int64_t end)
      : half_(half), entry_(end - begin, -1) {
    if (delta == nullptr) return;
    int64_t runs = 0;
    for (int64_t r = begin; r < end; ++r) {
      if (delta[r] == 0) continue;
      if (runs == 0 || delta[r] != last_) {
        table_.resize((runs + 1) * 2 * half);
        row_cos_sin(delta[r], inv_freq, half, &table_[runs * 2 * half], &table_[runs * 2 * half + half]);
        last_ = delta[r];
        ++runs;
      }
      entry_[r - begin] = runs - 1;
    }
  }
  // cos of row begin + i (its sin follows at + half), nullptr: the row is not rotated
  const float* cos(int64_t i) const { return entry_[i] < 0 ? nullptr : &table_[entry_[i] * 2 * half_]; }

 private:
  int64_t half_;
  int32_t last_ = 0;
  std::vector<int64_t> entry_;
  std::vector<float> table_;
};

// Rows per parallel task: about at::internal::GRAIN_SIZE elements each, so that a call of a few
// rows (a decode step's append) runs inline, without an OpenMP region.
int64_t rows_per_task(int64_t elements_per_row) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, elements_per_row));
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
};

struct Rotation {
  const int32_t* delta = nullptr;  // nullptr: no rotation
  const float* inv_freq = nullptr;
  int64_t rotary_dim = 0;
  bool interleaved = false;
};

// dst row dst_idx[n] <- src row src_idx[n] in every layer (an index of nullptr is the identity),
// K rotated by delta[n] when given. Rows of one call never overlap (validate_copy / staging).
// A task takes a range of rows and copies them layer by layer: each layer's rows then stream
// through memory in order (one row across all 2L layers at a time is 4L streams, more than the
// hardware prefetchers follow: about half the speed on SmolLM2's 30 layers).
template <typename T>
void copy_pass(const Side& dst, const Side& src, const void* src_idx, bool src64, const void* dst_idx, bool dst64,
               int64_t n, int64_t k_heads, int64_t k_head_dim, int64_t v_row, const Rotation& rot) {
  const int64_t k_row = k_heads * k_head_dim, half = rot.rotary_dim / 2;
  const size_t kb = k_row * sizeof(T), vb = v_row * sizeof(T);
  const int64_t row_elements = static_cast<int64_t>(dst.k.size()) * k_row + static_cast<int64_t>(dst.v.size()) * v_row;
  at::parallel_for(0, n, rows_per_task(row_elements), [&](int64_t begin, int64_t end) {
    const RowAngles angles(rot.delta, rot.inv_freq, half, begin, end);
    std::vector<int64_t> so(end - begin), dof(end - begin);  // the rows' element offsets in a layer
    auto row_offsets = [&](const RowLayout& src_layout, const RowLayout& dst_layout) {
      for (int64_t r = begin; r < end; ++r) {
        so[r - begin] = kv_cache::row_offset(src_layout, kv_cache::load_index(src_idx, src64, r));
        dof[r - begin] = kv_cache::row_offset(dst_layout, kv_cache::load_index(dst_idx, dst64, r));
      }
    };
    row_offsets(src.lk, dst.lk);
    for (size_t l = 0; l < dst.k.size(); ++l) {
      const T* sl = static_cast<const T*>(src.k[l]);
      T* dl = static_cast<T*>(dst.k[l]);
      for (int64_t i = 0; i < end - begin; ++i) {
        const float* c = angles.cos(i);
        if (c == nullptr) {
          std::memcpy(dl + dof[i], sl + so[i], kb);
        } else {
          copy_rotated_row(dl + dof[i], sl + so[i], k_heads, k_head_dim, rot.rotary_dim, rot.interleaved, c, c + half);
        }
      }
    }
    if (dst.v.empty()) return;
    row_offsets(src.lv, dst.lv);
    for (size_t l = 0; l < dst.v.size(); ++l) {
      const T* sl = static_cast<const T*>(src.v[l]);
      T* dl = static_cast<T*>(dst.v[l]);
      for (int64_t i = 0; i < end - begin; ++i) std::memcpy(dl + dof[i], sl + so[i], vb);
    }
  });
}

// Per-layer views of a staging tensor [L, n, H, D] and their (one-level) row layout.
std::vector<void*> staging_layers(const at::Tensor& t) {
  std::vector<void*> out;
  for (int64_t l = 0; l < t.size(0); ++l) out.push_back(t[l].data_ptr());
  return out;
}

}  // namespace

void rerotate_keys_cpu(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                       const at::Tensor& inv_freq, int64_t rotary_dim, bool interleaved) {
  const kv_cache::LayerGeom g = kv_cache::validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim);
  const int64_t n = rows.size(0);
  if (k_layers.empty() || n == 0) return;
  const at::Tensor rows_c = rows.contiguous(), delta_c = delta.contiguous(), freq_c = inv_freq.contiguous();
  const void* rp = rows_c.const_data_ptr();
  const bool r64 = rows_c.scalar_type() == at::kLong;
  const int32_t* dp = delta_c.data_ptr<int32_t>();
  const float* fp = freq_c.data_ptr<float>();
  const std::vector<void*> bases = data_ptrs(k_layers);
  const int64_t half = rotary_dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_layers[0].scalar_type(), "rerotate_keys_cpu", [&] {
    const int64_t row_elements = static_cast<int64_t>(bases.size()) * g.heads * g.head_dim;
    at::parallel_for(0, n, rows_per_task(row_elements), [&](int64_t begin, int64_t end) {
      // rows x layers, layer by layer (as copy_pass)
      const RowAngles angles(dp, fp, half, begin, end);
      std::vector<int64_t> off(end - begin);
      for (int64_t r = begin; r < end; ++r)
        off[r - begin] = kv_cache::row_offset(g.layout, kv_cache::load_index(rp, r64, r));
      std::vector<scalar_t> scratch(rotary_dim);
      for (void* base : bases) {
        for (int64_t i = 0; i < end - begin; ++i) {
          const float* c = angles.cos(i);
          if (c == nullptr) continue;  // identity
          rotate_row(static_cast<scalar_t*>(base) + off[i], g.heads, g.head_dim, rotary_dim, interleaved, c, c + half,
                     scratch.data());
        }
      }
    });
  });
}

void copy_kv_cpu(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                 const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                 const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim, bool interleaved) {
  const kv_cache::CopyGeom g =
      kv_cache::validate_copy(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim);
  const int64_t n = src_rows.size(0);
  if (dst_k.empty() || n == 0) return;
  const at::Tensor sr = src_rows.contiguous(), dr = dst_rows.contiguous();
  const bool s64 = sr.scalar_type() == at::kLong, d64 = dr.scalar_type() == at::kLong;
  at::Tensor delta_c, freq_c;
  Rotation rot;
  if (delta.has_value()) {
    delta_c = delta->contiguous();
    freq_c = inv_freq->contiguous();
    rot = Rotation{delta_c.data_ptr<int32_t>(), freq_c.data_ptr<float>(), rotary_dim, interleaved};
  }
  const Side dst{data_ptrs(dst_k), g.has_v ? data_ptrs(dst_v) : std::vector<void*>{}, g.k.layout, g.v.layout};
  const Side src{data_ptrs(src_k), g.has_v ? data_ptrs(src_v) : std::vector<void*>{}, g.sk.layout, g.sv.layout};
  const int64_t v_row = g.v.heads * g.v.head_dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst_k[0].scalar_type(), "copy_kv_cpu", [&] {
    if (!g.staged) {
      copy_pass<scalar_t>(dst, src, sr.const_data_ptr(), s64, dr.const_data_ptr(), d64, n, g.k.heads, g.k.head_dim,
                          v_row, rot);
      return;
    }
    // A source shares memory with a destination: gather every source row first, then scatter
    // (the reference's semantics; validate_copy already refused overlapping destinations).
    const int64_t L = static_cast<int64_t>(dst_k.size());
    const at::Tensor tk = at::empty({L, n, g.k.heads, g.k.head_dim}, dst_k[0].options());
    const at::Tensor tv = g.has_v ? at::empty({L, n, g.v.heads, g.v.head_dim}, dst_k[0].options()) : at::Tensor();
    const Side tmp{staging_layers(tk), g.has_v ? staging_layers(tv) : std::vector<void*>{},
                   RowLayout{n, g.k.heads * g.k.head_dim, n * g.k.heads * g.k.head_dim}, RowLayout{n, v_row, n * v_row}};
    copy_pass<scalar_t>(tmp, src, sr.const_data_ptr(), s64, nullptr, false, n, g.k.heads, g.k.head_dim, v_row,
                        Rotation{});
    copy_pass<scalar_t>(dst, tmp, nullptr, false, dr.const_data_ptr(), d64, n, g.k.heads, g.k.head_dim, v_row, rot);
  });
}

}  // namespace ragattn
