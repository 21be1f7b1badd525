// ATen launchers of rerotate_keys_ / copy_kv_ on CUDA tensors: validate (shared with the CPU
// twin, before any write), ship the layer base pointers to the device, launch on the current
// stream. Row ranges/uniqueness are a precondition here, checked when RAGATTN_DEBUG=1.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <vector>

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
    default:
      return kv_cache::CacheDType::kFloat32;
  }
}

// Base pointers as a device int64 tensor: a pinned host buffer copied asynchronously on the
// current stream (the caching host allocator keeps it alive until the copy has run).
at::Tensor device_pointer_array(const std::vector<void*>& ptrs, const at::Device& device, bool* aligned16) {
  at::Tensor host = at::empty({static_cast<int64_t>(ptrs.size())}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  *aligned16 = true;
  for (size_t i = 0; i < ptrs.size(); ++i) {
    h[i] = reinterpret_cast<int64_t>(ptrs[i]);
    *aligned16 = *aligned16 && (reinterpret_cast<uintptr_t>(ptrs[i]) % 16 == 0);
  }
  return host.to(device, /*non_blocking=*/true);
}

// One block per row (grid.x) and the layer pointers staged in shared memory.
void check_grid(const char* op, int64_t n, size_t num_ptrs) {
  TORCH_CHECK_VALUE(n <= INT32_MAX, "ragattn.", op, ": at most 2^31 - 1 rows per call, got ", n);
  TORCH_CHECK_VALUE(num_ptrs <= 4096, "ragattn.", op, ": too many layers (", num_ptrs, " cache pointers; at most 4096, i.e. 1024 layers for copy_kv_)");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "ragattn.", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

void rerotate_keys_cuda(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                        const at::Tensor& inv_freq, int64_t rotary_dim, bool interleaved) {
  const kv_cache::LayerGeom g = kv_cache::validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim);
  const int64_t n = rows.size(0);
  if (k_layers.empty() || n == 0) return;
  check_grid("rerotate_keys_", n, k_layers.size());
  const c10::cuda::CUDAGuard guard(k_layers[0].device());
  std::vector<void*> ptrs;
  for (const auto& t : k_layers) ptrs.push_back(t.data_ptr());
  bool aligned = false;
  const at::Tensor dev_ptrs = device_pointer_array(ptrs, k_layers[0].device(), &aligned);
  const at::Tensor rows_c = rows.contiguous(), delta_c = delta.contiguous(), freq_c = inv_freq.contiguous();
  const int elem = static_cast<int>(k_layers[0].element_size());
  const bool vec = aligned && kv_cache::vector_shapes_ok(elem, static_cast<int>(g.head_dim), static_cast<int>(rotary_dim),
                                                         interleaved, g.heads * g.head_dim);
  check_launch(kv_cache::launch_rerotate_keys(reinterpret_cast<void* const*>(dev_ptrs.data_ptr<int64_t>()),
                                              static_cast<int>(k_layers.size()), static_cast<int>(g.heads),
                                              static_cast<int>(g.head_dim), rows_c.data_ptr<int64_t>(),
                                              delta_c.data_ptr<int32_t>(), n, freq_c.data_ptr<float>(),
                                              static_cast<int>(rotary_dim), interleaved,
                                              cache_dtype(k_layers[0].scalar_type()), vec,
                                              c10::cuda::getCurrentCUDAStream()),
               "rerotate_keys_");
}

void copy_kv_cuda(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                  const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                  const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim, bool interleaved) {
  const kv_cache::CopyGeom g =
      kv_cache::validate_copy(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim);
  const int64_t n = src_rows.size(0);
  if (dst_k.empty() || n == 0) return;
  check_grid("copy_kv_", n, 4 * dst_k.size());
  const c10::cuda::CUDAGuard guard(dst_k[0].device());
  const size_t L = dst_k.size();
  std::vector<void*> ptrs(4 * L, nullptr);
  for (size_t l = 0; l < L; ++l) {
    ptrs[l] = dst_k[l].data_ptr();
    ptrs[2 * L + l] = src_k[l].data_ptr();
    if (g.has_v) {
      ptrs[L + l] = dst_v[l].data_ptr();
      ptrs[3 * L + l] = src_v[l].data_ptr();
    }
  }
  if (!g.has_v) {  // keep the alignment test meaningful: reuse K pointers for the unused V slots
    for (size_t l = 0; l < L; ++l) ptrs[L + l] = ptrs[3 * L + l] = ptrs[l];
  }
  bool aligned = false;
  const at::Tensor dev_ptrs = device_pointer_array(ptrs, dst_k[0].device(), &aligned);
  const at::Tensor sr = src_rows.contiguous(), dr = dst_rows.contiguous();
  at::Tensor delta_c, freq_c;
  const int rd = delta.has_value() ? static_cast<int>(rotary_dim) : 0;
  if (delta.has_value()) {
    delta_c = delta->contiguous();
    freq_c = inv_freq->contiguous();
  }
  const int elem = static_cast<int>(dst_k[0].element_size());
  const int vec_unit = 16 / elem;
  bool vec = aligned && (g.k.heads * g.k.head_dim) % vec_unit == 0 && (g.v.heads * g.v.head_dim) % vec_unit == 0;
  if (delta.has_value()) {
    vec = vec && kv_cache::vector_shapes_ok(elem, static_cast<int>(g.k.head_dim), rd, interleaved, g.v.heads * g.v.head_dim);
  }
  check_launch(kv_cache::launch_copy_kv(reinterpret_cast<void* const*>(dev_ptrs.data_ptr<int64_t>()), static_cast<int>(L),
                                        static_cast<int>(g.k.heads), static_cast<int>(g.k.head_dim),
                                        g.has_v ? static_cast<int>(g.v.heads) : 0, static_cast<int>(g.v.head_dim),
                                        sr.data_ptr<int64_t>(), dr.data_ptr<int64_t>(), n,
                                        delta.has_value() ? delta_c.data_ptr<int32_t>() : nullptr,
                                        delta.has_value() ? freq_c.data_ptr<float>() : nullptr, rd, interleaved,
                                        cache_dtype(dst_k[0].scalar_type()), vec, c10::cuda::getCurrentCUDAStream()),
               "copy_kv_");
}

}  // namespace ragattn
