// ATen launchers of rerotate_keys_ / copy_kv_ on CUDA tensors: validate (shared with the CPU
// twin, before any write), launch on the current stream with the layer pointers in the kernel
// parameters (no host-to-device copy: CUDA-graph capturable). Row ranges/uniqueness are a
// precondition here, checked when RAGATTN_DEBUG=1. Sources that share memory with a destination
// are staged through a temporary first (gather, then scatter), as on the CPU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/check_message.h"
#include "kv_cache/kv_cache_checks.h"
#include "kv_cache/kv_cache_kernels.cuh"
#include "ops.h"

namespace ragattn {
namespace {

kv_cache::CacheDType cache_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return kv_cache::CacheDType::kFloat16;
    case at::kBFloat16:
      return kv_cache::CacheDType::kBFloat16;
    case at::kFloat8_e4m3fn:
      return kv_cache::CacheDType::kFloat8E4M3;
    default:
      return kv_cache::CacheDType::kFloat32;
  }
}

std::vector<void*> data_ptrs(at::TensorList layers) {
  std::vector<void*> out;
  for (const auto& t : layers) out.push_back(t.data_ptr());
  return out;
}

bool all_aligned16(const std::vector<void*>& ptrs) {
  for (void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

void check_grid(const char* op, int64_t n) {
  RAGATTN_CHECK_VALUE(n <= INT32_MAX, "ragattn.", op, ": at most 2^31 - 1 rows per call, got ", n);
}

void check_launch(cudaError_t err, const char* op) {
  RAGATTN_CHECK(err == cudaSuccess, "ragattn.", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

// Device scales of a checked scale tensor (check_scale's stride; < 0: none).
kv_cache::LayerScales layer_scales(const c10::optional<at::Tensor>& scale, int64_t stride) {
  if (stride < 0) return {};
  return kv_cache::LayerScales{scale->const_data_ptr<float>(), stride};
}

// Per-layer base pointers of a staging tensor [L, n, H, D].
std::vector<void*> staging_layers(const at::Tensor& t) {
  std::vector<void*> out;
  for (int64_t l = 0; l < t.size(0); ++l) out.push_back(t[l].data_ptr());
  return out;
}

}  // namespace

void rerotate_keys_cuda(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                        const at::Tensor& inv_freq, int64_t rotary_dim, bool interleaved,
                        c10::optional<int64_t> num_kv_heads, const c10::optional<at::Tensor>& k_scale) {
  const kv_cache::RerotateGeom rg =
      kv_cache::validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim, num_kv_heads, k_scale);
  const kv_cache::LayerGeom& g = rg.g;
  const int64_t n = rows.size(0);
  if (k_layers.empty() || n == 0 || g.num_rows == 0) return;
  check_grid("rerotate_keys_", n);
  const c10::cuda::CUDAGuard guard(k_layers[0].device());
  const std::vector<void*> ptrs = data_ptrs(k_layers);
  const at::Tensor rows_c = rows.contiguous(), delta_c = delta.contiguous(), freq_c = inv_freq.contiguous();
  const int elem = static_cast<int>(k_layers[0].element_size());
  kv_cache::RerotateArgs a{};
  a.layers = ptrs.data();
  a.num_layers = static_cast<int>(ptrs.size());
  a.layout = g.layout;
  a.heads = static_cast<int>(g.heads);
  a.head_dim = static_cast<int>(g.head_dim);
  a.rows = rows_c.const_data_ptr();
  a.rows_int64 = rows_c.scalar_type() == at::kLong;
  a.delta = delta_c.const_data_ptr();
  a.delta_int64 = delta_c.scalar_type() == at::kLong;
  a.scale = layer_scales(k_scale, rg.scale_stride);
  a.n = n;
  a.inv_freq = freq_c.const_data_ptr<float>();
  a.rotary_dim = static_cast<int>(rotary_dim);
  a.interleaved = interleaved;
  a.dtype = cache_dtype(k_layers[0].scalar_type());
  a.vectorized = all_aligned16(ptrs) && kv_cache::vector_layout_ok(elem, g.layout) &&
                 kv_cache::vector_shapes_ok(elem, a.head_dim, a.rotary_dim, interleaved, g.heads * g.head_dim);
  check_launch(kv_cache::launch_rerotate_keys(a, c10::cuda::getCurrentCUDAStream()), "rerotate_keys_");
}

void copy_kv_cuda(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
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
  check_grid("copy_kv_", n);
  const c10::cuda::CUDAGuard guard(dst_k[0].device());
  const int64_t L = static_cast<int64_t>(dst_k.size());
  const std::vector<void*> dk = data_ptrs(dst_k), sk = data_ptrs(src_k);
  const std::vector<void*> dv = g.has_v ? data_ptrs(dst_v) : std::vector<void*>{};
  const std::vector<void*> sv = g.has_v ? data_ptrs(src_v) : std::vector<void*>{};
  const at::Tensor sr = src_rows.contiguous(), dr = dst_rows.contiguous();
  at::Tensor delta_c, freq_c;
  if (delta.has_value()) {
    delta_c = delta->contiguous();
    freq_c = inv_freq->contiguous();
  }
  // 16-byte accesses of the wider element type (the fp8 side then moves 8 or 4 bytes at a time)
  const int elem = static_cast<int>(std::max(dst_k[0].element_size(), src_k[0].element_size()));
  const int vec_unit = 16 / elem;
  const kv_cache::CacheDType dst_dt = cache_dtype(dst_k[0].scalar_type()), src_dt = cache_dtype(src_k[0].scalar_type());
  const kv_cache::LayerScales dks = layer_scales(dst_k_scale, g.dk_scale), dvs = layer_scales(dst_v_scale, g.dv_scale);
  const kv_cache::LayerScales sks = layer_scales(src_k_scale, g.sk_scale), svs = layer_scales(src_v_scale, g.sv_scale);
  const int64_t k_row = g.k.heads * g.k.head_dim, v_row = g.v.heads * g.v.head_dim;

  kv_cache::CopyArgs a{};
  a.num_layers = static_cast<int>(L);
  a.k_heads = static_cast<int>(g.k.heads);
  a.k_head_dim = static_cast<int>(g.k.head_dim);
  a.v_heads = g.has_v ? static_cast<int>(g.v.heads) : 0;
  a.v_head_dim = static_cast<int>(g.v.head_dim);
  a.n = n;
  a.interleaved = interleaved;
  // 16-byte accesses need every pointer, row start and row length in whole 16-byte units.
  bool vec = k_row % vec_unit == 0 && (!g.has_v || v_row % vec_unit == 0);
  if (delta.has_value()) {
    vec = vec && kv_cache::vector_shapes_ok(elem, a.k_head_dim, static_cast<int>(rotary_dim), interleaved,
                                            g.has_v ? v_row : 0);
  }
  auto launch = [&](const std::vector<void*>& d_k, const std::vector<void*>& d_v, const kv_cache::RowLayout& ld_k,
                    const kv_cache::RowLayout& ld_v, const std::vector<void*>& s_k, const std::vector<void*>& s_v,
                    const kv_cache::RowLayout& ls_k, const kv_cache::RowLayout& ls_v, const at::Tensor* s_idx,
                    const at::Tensor* d_idx, bool rotate, kv_cache::CacheDType s_dt, kv_cache::CacheDType d_dt,
                    const kv_cache::LayerScales* s_scales, const kv_cache::LayerScales* d_scales) {
    a.src_dtype = s_dt;
    a.dtype = d_dt;
    a.src_k_scale = s_scales[0];
    a.src_v_scale = s_scales[1];
    a.dst_k_scale = d_scales[0];
    a.dst_v_scale = d_scales[1];
    a.dst_k = d_k.data();
    a.dst_v = g.has_v ? d_v.data() : nullptr;
    a.src_k = s_k.data();
    a.src_v = g.has_v ? s_v.data() : nullptr;
    a.dst_k_layout = ld_k;
    a.dst_v_layout = ld_v;
    a.src_k_layout = ls_k;
    a.src_v_layout = ls_v;
    a.src_rows = s_idx ? s_idx->const_data_ptr() : nullptr;
    a.src_rows_int64 = s_idx && s_idx->scalar_type() == at::kLong;
    a.dst_rows = d_idx ? d_idx->const_data_ptr() : nullptr;
    a.dst_rows_int64 = d_idx && d_idx->scalar_type() == at::kLong;
    a.delta = rotate ? delta_c.const_data_ptr() : nullptr;
    a.delta_int64 = rotate && delta_c.scalar_type() == at::kLong;
    a.inv_freq = rotate ? freq_c.const_data_ptr<float>() : nullptr;
    a.rotary_dim = rotate ? static_cast<int>(rotary_dim) : 0;
    bool v = vec && all_aligned16(d_k) && all_aligned16(s_k) && kv_cache::vector_layout_ok(elem, ld_k) &&
             kv_cache::vector_layout_ok(elem, ls_k);
    if (g.has_v) {
      v = v && all_aligned16(d_v) && all_aligned16(s_v) && kv_cache::vector_layout_ok(elem, ld_v) &&
          kv_cache::vector_layout_ok(elem, ls_v);
    }
    a.vectorized = v;
    check_launch(kv_cache::launch_copy_kv(a, c10::cuda::getCurrentCUDAStream()), "copy_kv_");
  };

  const bool rotate = delta.has_value();
  const kv_cache::LayerScales d_sc[2] = {dks, dvs}, s_sc[2] = {sks, svs}, none[2] = {{}, {}};
  if (g.overlap == kv_cache::ReadWriteOverlap::kNone) {
    launch(dk, dv, g.k.layout, g.v.layout, sk, sv, g.sk.layout, g.sv.layout, &sr, &dr, rotate, src_dt, dst_dt, s_sc,
           d_sc);
    return;
  }
  // A source shares memory with a destination: gather every source row, then scatter. Staged in
  // the destination dtype, float32 when a side is fp8 (exact for dequantised rows: the second
  // pass rounds once, as the one-pass copy does).
  const bool fp8 = dst_k[0].scalar_type() == at::kFloat8_e4m3fn || src_k[0].scalar_type() == at::kFloat8_e4m3fn;
  const auto topt = dst_k[0].options().dtype(fp8 ? at::kFloat : dst_k[0].scalar_type());
  const kv_cache::CacheDType tmp_dt = fp8 ? kv_cache::CacheDType::kFloat32 : dst_dt;
  const at::Tensor tk = at::empty({L, n, g.k.heads, g.k.head_dim}, topt);
  const at::Tensor tv = g.has_v ? at::empty({L, n, g.v.heads, g.v.head_dim}, topt) : at::Tensor();
  const std::vector<void*> tkp = staging_layers(tk), tvp = g.has_v ? staging_layers(tv) : std::vector<void*>{};
  const kv_cache::RowLayout lt_k{n, k_row, n * k_row}, lt_v{n, v_row, n * v_row};
  launch(tkp, tvp, lt_k, lt_v, sk, sv, g.sk.layout, g.sv.layout, &sr, nullptr, false, src_dt, tmp_dt, s_sc, none);
  launch(dk, dv, g.k.layout, g.v.layout, tkp, tvp, lt_k, lt_v, nullptr, &dr, rotate, tmp_dt, dst_dt, none, d_sc);
}

}  // namespace ragattn
