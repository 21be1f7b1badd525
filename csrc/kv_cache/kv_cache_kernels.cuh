// Framework-free launchers of the KV-cache kernels (no torch headers): raw device pointers,
// a dtype tag, a stream. Called by kv_cache_cuda.cu after it has validated everything.
//
// The layer base pointers travel inside the kernel's own parameters (a __grid_constant__
// struct of at most kMaxLayerPtrs pointers): nothing is copied from the host per call, so a
// launch can be captured in a CUDA graph. More layers than fit are launched in chunks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kv_cache/row_layout.h"

namespace ragattn {
namespace kv_cache {

enum class CacheDType { kFloat16, kBFloat16, kFloat32, kFloat8E4M3 };

// Per-layer scales of float8_e4m3fn caches (fp8_math.h): layer l's is ptr[l * stride] (stride 0:
// one for all layers), a device float32 array; ptr == nullptr for the other dtypes (scale 1).
struct LayerScales {
  const float* ptr = nullptr;
  int64_t stride = 0;
};

constexpr int kMaxLayerPtrs = 256;                     // pointers per launch (2 KB of parameters)
constexpr int kMaxRerotateLayers = kMaxLayerPtrs;      // rerotate_keys_: one pointer per layer
constexpr int kMaxCopyLayers = kMaxLayerPtrs / 4;      // copy_kv_: dst_k, dst_v, src_k, src_v per layer

struct RerotateArgs {
  void* const* layers;  // host array of num_layers device base pointers
  int num_layers;
  RowLayout layout;  // of every layer (elements)
  int heads, head_dim;
  const void* rows;  // device, int32 or int64 [n]
  bool rows_int64;
  const void* delta;  // device, int32 or int64 [n]
  bool delta_int64;
  LayerScales scale;  // fp8 layers: stored x means x * scale
  int64_t n;
  const float* inv_freq;  // device [rotary_dim / 2]
  int rotary_dim;
  bool interleaved;
  CacheDType dtype;
  bool vectorized;  // every base pointer 16-byte aligned, shapes/strides in whole 16-byte units
};

// In place: row rows[i] of every layer is rotated by delta[i] positions.
// Preconditions: rows distinct and in range; 2 <= rotary_dim <= head_dim, rotary_dim even; the
// layers pairwise disjoint in memory.
cudaError_t launch_rerotate_keys(const RerotateArgs& a, cudaStream_t stream);

struct CopyArgs {
  // Host arrays of num_layers device base pointers; dst_v/src_v are nullptr when v_heads == 0.
  void* const* dst_k;
  void* const* dst_v;
  void* const* src_k;
  void* const* src_v;
  int num_layers;
  RowLayout dst_k_layout, dst_v_layout, src_k_layout, src_v_layout;
  int k_heads, k_head_dim, v_heads, v_head_dim;
  const void* src_rows;  // device int32/int64 [n], or nullptr: row i
  bool src_rows_int64;
  const void* dst_rows;  // device int32/int64 [n], or nullptr: row i
  bool dst_rows_int64;
  int64_t n;
  const void* delta;  // device int32/int64 [n] or nullptr (no rotation)
  bool delta_int64;
  const float* inv_freq;
  int rotary_dim;
  bool interleaved;
  CacheDType dtype;      // of the destinations
  CacheDType src_dtype;  // of the sources: dtype, or either of the two float8_e4m3fn
  LayerScales dst_k_scale, dst_v_scale, src_k_scale, src_v_scale;  // fp8 sides only
  bool vectorized;  // 16-byte accesses of the wider element type
};

// dst row dst_rows[i] <- src row src_rows[i] in every layer, K rotated by delta[i] when given.
// Preconditions: dst_rows distinct and in range, src_rows in range, no source memory written by
// the call (the ATen launcher stages aliased sources through a temporary first); src_dtype ==
// dtype unless one of them is kFloat8E4M3.
cudaError_t launch_copy_kv(const CopyArgs& a, cudaStream_t stream);

// Whether rotating `head_dim`-wide heads with `rotary_dim` and copying rows of `row_elems`
// elements can use 16-byte accesses for elements of `elem_bytes` bytes (pointer alignment aside).
inline bool vector_shapes_ok(int elem_bytes, int head_dim, int rotary_dim, bool interleaved, int64_t v_row_elems) {
  const int vec = 16 / elem_bytes;
  const int rot_unit = interleaved ? rotary_dim : rotary_dim / 2;
  return head_dim % vec == 0 && rot_unit % vec == 0 && v_row_elems % vec == 0;
}

// Whether every row of `layout` starts on a 16-byte boundary relative to its layer's base.
inline bool vector_layout_ok(int elem_bytes, const RowLayout& layout) {
  const int vec = 16 / elem_bytes;
  return layout.inner_stride % vec == 0 && layout.outer_stride % vec == 0;
}

}  // namespace kv_cache
}  // namespace ragattn
