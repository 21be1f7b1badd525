// Declarations of every C++ op implementation registered in torch_bindings.cpp.
// CPU twins are always built; CUDA launchers only when RAGATTN_WITH_CUDA is defined.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <vector>

namespace ragattn {

// ---- KV cache ops (csrc/kv_cache/) ----
void rerotate_keys_cpu(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                       const at::Tensor& inv_freq, int64_t rotary_dim, bool interleaved);
void copy_kv_cpu(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                 const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                 const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim, bool interleaved);
#ifdef RAGATTN_WITH_CUDA
void rerotate_keys_cuda(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                        const at::Tensor& inv_freq, int64_t rotary_dim, bool interleaved);
void copy_kv_cuda(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                  const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                  const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim, bool interleaved);
#endif

// ---- speculative verification (csrc/speculative/) ----

}  // namespace ragattn
