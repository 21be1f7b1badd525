// Framework-free launchers of the KV-cache kernels (no torch headers): raw device pointers,
// a dtype tag, a stream. Called by kv_cache_cuda.cu after it has validated everything.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ragattn {
namespace kv_cache {

enum class CacheDType { kFloat16, kBFloat16, kFloat32 };

// In place: row rows[n] of each of the `num_layers` caches (device array `layers` of base
// pointers, each viewed as [*, heads, head_dim] contiguous) is rotated by delta[n] positions.
// `vectorized`: every base pointer is 16-byte aligned (the launcher knows the pointers).
// Preconditions: rows distinct and in range; 2 <= rotary_dim <= head_dim, rotary_dim even.
cudaError_t launch_rerotate_keys(void* const* layers, int num_layers, int heads, int head_dim, const int64_t* rows,
                                 const int32_t* delta, int64_t n, const float* inv_freq, int rotary_dim,
                                 bool interleaved, CacheDType dtype, bool vectorized, cudaStream_t stream);

// ptrs: device array of 4 * num_layers base pointers: dst_k[0..L), dst_v[0..L), src_k[0..L),
// src_v[0..L) (the V halves unused when v_heads == 0). For n: dst row dst_rows[n] <- src row
// src_rows[n] in every layer, K rotated by delta[n] when delta != nullptr.
// Preconditions: dst_rows distinct and in range, src_rows in range, no row both read and written.
cudaError_t launch_copy_kv(void* const* ptrs, int num_layers, int k_heads, int k_head_dim, int v_heads, int v_head_dim,
                           const int64_t* src_rows, const int64_t* dst_rows, int64_t n, const int32_t* delta,
                           const float* inv_freq, int rotary_dim, bool interleaved, CacheDType dtype, bool vectorized,
                           cudaStream_t stream);

// Whether rotating `head_dim`-wide heads with `rotary_dim` and copying rows of `row_elems`
// elements can use 16-byte accesses for elements of `elem_bytes` bytes (pointer alignment aside).
inline bool vector_shapes_ok(int elem_bytes, int head_dim, int rotary_dim, bool interleaved, int64_t v_row_elems) {
  const int vec = 16 / elem_bytes;
  const int rot_unit = interleaved ? rotary_dim : rotary_dim / 2;
  return head_dim % vec == 0 && rot_unit % vec == 0 && v_row_elems % vec == 0;
}

}  // namespace kv_cache
}  // namespace ragattn
