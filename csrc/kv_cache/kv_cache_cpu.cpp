// CPU twins of rerotate_keys_ and copy_kv_: same validation and same per-element math
// (rope_math.h) as the CUDA kernels. Parallel over rows; each row's cos/sin are computed once
// and reused across every layer and head.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstring>
#include <vector>

#include "kv_cache/kv_cache_checks.h"
#include "kv_cache/rope_math.h"
#include "ops.h"

namespace ragattn {
namespace {

// cos/sin of row delta `d` for every frequency.
void row_cos_sin(int32_t d, const float* inv_freq, int64_t half, float* c, float* s) {
  for (int64_t i = 0; i < half; ++i) rope::angle_cos_sin(d, inv_freq[i], &c[i], &s[i]);
}

// Rotate the first `rotary_dim` dims of `heads` consecutive heads in place.
template <typename T>
void rotate_row(T* row, int64_t heads, int64_t head_dim, int64_t rotary_dim, bool interleaved, const float* c,
                const float* s) {
  const int64_t half = rotary_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x = row + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const int a = rope::pair_first(static_cast<int>(i), static_cast<int>(rotary_dim), interleaved);
      const int b = rope::pair_second(static_cast<int>(i), static_cast<int>(rotary_dim), interleaved);
      rope::rotate_stored_pair(&x[a], &x[b], c[i], s[i]);
    }
  }
}

std::vector<void*> data_ptrs(at::TensorList layers) {
  std::vector<void*> out;
  for (const auto& t : layers) out.push_back(t.data_ptr());
  return out;
}

}  // namespace

void rerotate_keys_cpu(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                       const at::Tensor& inv_freq, int64_t rotary_dim, bool interleaved) {
  const kv_cache::LayerGeom g = kv_cache::validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim);
  const int64_t n = rows.size(0);
  if (k_layers.empty() || n == 0) return;
  const at::Tensor rows_c = rows.contiguous(), delta_c = delta.contiguous(), freq_c = inv_freq.contiguous();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  const int32_t* dp = delta_c.data_ptr<int32_t>();
  const float* fp = freq_c.data_ptr<float>();
  const std::vector<void*> bases = data_ptrs(k_layers);
  const int64_t row_elems = g.heads * g.head_dim, half = rotary_dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_layers[0].scalar_type(), "rerotate_keys_cpu", [&] {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> c(half), s(half);
      for (int64_t r = begin; r < end; ++r) {
        if (dp[r] == 0) continue;  // identity
        row_cos_sin(dp[r], fp, half, c.data(), s.data());
        for (void* base : bases) {
          scalar_t* row = static_cast<scalar_t*>(base) + rp[r] * row_elems;
          rotate_row(row, g.heads, g.head_dim, rotary_dim, interleaved, c.data(), s.data());
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
  const int64_t* sp = sr.data_ptr<int64_t>();
  const int64_t* dp = dr.data_ptr<int64_t>();
  at::Tensor delta_c, freq_c;
  const int32_t* delp = nullptr;
  const float* fp = nullptr;
  if (delta.has_value()) {
    delta_c = delta->contiguous();
    freq_c = inv_freq->contiguous();
    delp = delta_c.data_ptr<int32_t>();
    fp = freq_c.data_ptr<float>();
  }
  const std::vector<void*> dk = data_ptrs(dst_k), sk = data_ptrs(src_k);
  const std::vector<void*> dv = g.has_v ? data_ptrs(dst_v) : std::vector<void*>{};
  const std::vector<void*> sv = g.has_v ? data_ptrs(src_v) : std::vector<void*>{};
  const int64_t k_row = g.k.heads * g.k.head_dim, v_row = g.v.heads * g.v.head_dim, half = rotary_dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst_k[0].scalar_type(), "copy_kv_cpu", [&] {
    const size_t kb = k_row * sizeof(scalar_t), vb = v_row * sizeof(scalar_t);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> c(delp ? half : 0), s(delp ? half : 0);
      for (int64_t r = begin; r < end; ++r) {
        const bool rotate = delp != nullptr && delp[r] != 0;
        if (rotate) row_cos_sin(delp[r], fp, half, c.data(), s.data());
        for (size_t l = 0; l < dk.size(); ++l) {
          scalar_t* d = static_cast<scalar_t*>(dk[l]) + dp[r] * k_row;
          std::memcpy(d, static_cast<const scalar_t*>(sk[l]) + sp[r] * k_row, kb);
          if (rotate) rotate_row(d, g.k.heads, g.k.head_dim, rotary_dim, interleaved, c.data(), s.data());
        }
        for (size_t l = 0; l < dv.size(); ++l) {
          std::memcpy(static_cast<scalar_t*>(dv[l]) + dp[r] * v_row, static_cast<const scalar_t*>(sv[l]) + sp[r] * v_row,
                      vb);
        }
      }
    });
  });
}

}  // namespace ragattn
