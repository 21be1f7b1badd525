// Input validation shared by the CPU twin and the CUDA launcher of the KV-cache ops.
// Everything is checked before any cache is written, so a rejected call leaves caches untouched.
// Errors: TypeError (wrong dtype) / ValueError (shape, device, layout, range), naming
// `ragattn.<op>` and the argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

namespace ragattn {
namespace kv_cache {

// Geometry of one list of cache layers, each viewed as [num_rows, heads, head_dim].
struct LayerGeom {
  int64_t num_rows = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
};

// Layers: fp16/bf16/fp32, >= 3 dims, contiguous, one shape/dtype/device, pairwise distinct.
LayerGeom check_layers(const char* op, const char* name, at::TensorList layers);

// Index vector: dtype, 1-D, `n` entries (n < 0: any), on `device`.
void check_index(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t n,
                 c10::Device device);

// rotary_dim even, in [2, head_dim]; inv_freq float32 [rotary_dim / 2] on `device`.
void check_rope(const char* op, const at::Tensor& inv_freq, int64_t rotary_dim, int64_t head_dim,
                c10::Device device);

// Host-side range (and, if `distinct`, uniqueness) check of an int64 row vector (CPU tensor).
void check_rows_host(const char* op, const char* name, const at::Tensor& rows_cpu, int64_t num_rows, bool distinct);

// Whole-op validation (shared by the CPU twin and the CUDA launcher). Row-range and
// uniqueness checks run on CPU tensors always, on CUDA tensors only when debug_mode().
LayerGeom validate_rerotate(at::TensorList k_layers, const at::Tensor& rows,
                            const at::Tensor& delta, const at::Tensor& inv_freq, int64_t rotary_dim);

struct CopyGeom {
  LayerGeom k, v;  // destination geometry of K and V
  int64_t src_rows_total = 0;  // rows of each source layer
  bool has_v = false;
};
CopyGeom validate_copy(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                       const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                       const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim);

// RAGATTN_DEBUG=1: run the host-side row checks on CUDA tensors too (syncs).
bool debug_mode();

}  // namespace kv_cache
}  // namespace ragattn
