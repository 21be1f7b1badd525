// Input validation shared by the CPU twin and the CUDA launcher of the KV-cache ops.
// Everything is checked before any cache is written, so a rejected call leaves caches untouched.
// Errors: TypeError (wrong dtype) / ValueError (shape, device, layout, range, aliasing), naming
// `ragattn.<op>` and the argument. ragattn/ops/kv_cache.py holds the Python twin of every rule
// (the reference path and the fake impl validate exactly like this).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

#include "kv_cache/row_layout.h"

namespace ragattn {
namespace kv_cache {

// Geometry of one list of cache layers, each addressed as [num_rows, heads, head_dim] through
// `layout` (row_layout.h).
struct LayerGeom {
  int64_t num_rows = 0;
  int64_t outer_rows = 1;  // num_rows = outer_rows * layout.inner_rows (when num_rows > 0)
  int64_t heads = 0;
  int64_t head_dim = 0;
  RowLayout layout;
};

// Layers: fp16/bf16/fp32/float8_e4m3fn, >= 3 dims, one shape/strides/dtype/device, [H, D] contiguous, leading
// dims addressable with at most two row strides (row_layout.h), distinct rows never overlapping.
LayerGeom check_layers(const char* op, const char* name, at::TensorList layers);

// Row index vector: int32 or int64, 1-D, `n` entries (n < 0: any), on `device`.
void check_rows_index(const char* op, const char* name, const at::Tensor& t, int64_t n, c10::Device device);

// Index vector of one dtype: 1-D, `n` entries (n < 0: any), on `device`.
void check_index(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t n,
                 c10::Device device);

// rotary_dim even, in [2, head_dim]; inv_freq float32 [rotary_dim / 2] on `device`.
void check_rope(const char* op, const at::Tensor& inv_freq, int64_t rotary_dim, int64_t head_dim,
                c10::Device device);

// Per-tensor scale of a list of L cache layers of dtype `cache_dtype`: required (float32, shape
// [], [1] or [L], on `device`) for float8_e4m3fn caches, refused for the others. Returns the
// stride between layers' scales (0: one scale for every layer); -1 when there is no scale.
int64_t check_scale(const char* op, const char* name, const c10::optional<at::Tensor>& scale, const char* cache_name,
                    at::ScalarType cache_dtype, int64_t num_layers, c10::Device device);

// num_kv_heads (when given) must be the heads H of every list's [..., H, D] rows: a head-major
// (HND) page [pages, H, page_size, D] passed as if it were NHD would be read with page_size as H.
void check_num_kv_heads(const char* op, const c10::optional<int64_t>& num_kv_heads, const char* name,
                        const LayerGeom& g, at::TensorList layers);

// Host-side range (and, if `distinct`, uniqueness) check of an int32/int64 row vector.
void check_rows_host(const char* op, const char* name, const at::Tensor& rows, int64_t num_rows, bool distinct);

// One list of layers with its geometry, for the aliasing rules.
struct NamedLayers {
  const char* name;
  at::TensorList layers;
  const LayerGeom* geom;
};

// Whether two layers share memory (exact for two layers of one layout; otherwise conservative:
// their byte spans in one storage intersect).
bool layers_overlap(const at::Tensor& a, const LayerGeom& ga, const at::Tensor& b, const LayerGeom& gb);

// Every written layer must be disjoint in memory from every other written layer (a row written
// twice, or rotated twice, would depend on the order): ValueError naming both.
void check_writes_disjoint(const char* op, std::initializer_list<NamedLayers> written);

// How the read layers share memory with the written layers: not at all; only as the very same rows
// (same storage, offset and layout: row i of a source is row i of its destination, so a row is
// clobbered before it is read only where it is both read and written: rows_meet); or otherwise.
// copy_kv_ stages the source rows through a temporary (every row read before any is written)
// when they share memory (on the CPU, same rows only when the row sets meet).
enum class ReadWriteOverlap { kNone, kSameRows, kOther };
ReadWriteOverlap read_write_overlap(std::initializer_list<NamedLayers> read, std::initializer_list<NamedLayers> written);

// Whether an int32/int64 row vector `a` and another `b` (host tensors) share a row.
bool rows_meet(const at::Tensor& a, const at::Tensor& b);

// Whole-op validation (shared by the CPU twin and the CUDA launcher). Row-range and
// uniqueness checks run on CPU tensors always, on CUDA tensors only when debug_mode().
// delta: int32 or int64. k_scale: see check_scale.
struct RerotateGeom {
  LayerGeom g;
  int64_t scale_stride = -1;  // check_scale's result for k_scale
};
RerotateGeom validate_rerotate(at::TensorList k_layers, const at::Tensor& rows, const at::Tensor& delta,
                               const at::Tensor& inv_freq, int64_t rotary_dim,
                               const c10::optional<int64_t>& num_kv_heads, const c10::optional<at::Tensor>& k_scale);

struct CopyGeom {
  LayerGeom k, v;    // destination geometry of K and V
  LayerGeom sk, sv;  // source geometry of K and V
  bool has_v = false;
  ReadWriteOverlap overlap = ReadWriteOverlap::kNone;  // sources vs destinations (read_write_overlap)
  // check_scale's results for dst_k_scale, dst_v_scale, src_k_scale, src_v_scale
  int64_t dk_scale = -1, dv_scale = -1, sk_scale = -1, sv_scale = -1;
};
// Sources and destinations share one dtype, except that either side may be float8_e4m3fn
// (dequantised on read, quantised on write with the side's scales).
CopyGeom validate_copy(at::TensorList dst_k, at::TensorList dst_v, at::TensorList src_k, at::TensorList src_v,
                       const at::Tensor& src_rows, const at::Tensor& dst_rows, const c10::optional<at::Tensor>& delta,
                       const c10::optional<at::Tensor>& inv_freq, int64_t rotary_dim,
                       const c10::optional<int64_t>& num_kv_heads, const c10::optional<at::Tensor>& src_k_scale,
                       const c10::optional<at::Tensor>& src_v_scale, const c10::optional<at::Tensor>& dst_k_scale,
                       const c10::optional<at::Tensor>& dst_v_scale);

// RAGATTN_DEBUG=1: run the host-side row checks on CUDA tensors too (syncs).
bool debug_mode();

}  // namespace kv_cache
}  // namespace ragattn
