// How a cache layer's rows are addressed, shared by the CUDA kernels and the CPU twin
// (framework-free: no torch headers).
//
// A layer is any tensor [..., H, D] whose inner [H, D] block is contiguous and whose leading dims
// collapse to at most two levels: row r lives at element offset
//     (r / inner_rows) * outer_stride + (r % inner_rows) * inner_stride
// from the layer's first element. This covers a contiguous [rows, H, D] or [pages, page_size, H, D]
// cache (one level), vLLM's FlashAttention cache [2, blocks, block_size, H, D] seen through
// kv_cache[0] / kv_cache[1] (one level, offset base), and FlashInfer's [pages, 2, page_size, H, D]
// seen through cache[:, 0] / cache[:, 1] (two levels: outer stride 2 * page_size * H * D).
// kv_cache_checks.cpp builds it and refuses every other layout with a named error.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace ragattn {
namespace kv_cache {

struct RowLayout {
  int64_t inner_rows = 1;    // rows per outer index (>= 1)
  int64_t inner_stride = 0;  // elements between consecutive rows of one outer index (>= H * D)
  int64_t outer_stride = 0;  // elements between outer indices (>= inner_rows * inner_stride)
};

// Element offset of row r from the layer's first element.
RAGATTN_HD int64_t row_offset(const RowLayout& g, int64_t r) {
  const int64_t o = r / g.inner_rows;
  return o * g.outer_stride + (r - o * g.inner_rows) * g.inner_stride;
}

// Entry n of an int32 or int64 index vector; a null vector is the identity (n).
RAGATTN_HD int64_t load_index(const void* idx, bool is_int64, int64_t n) {
  if (idx == nullptr) return n;
  return is_int64 ? static_cast<const int64_t*>(idx)[n] : static_cast<int64_t>(static_cast<const int32_t*>(idx)[n]);
}

}  // namespace kv_cache
}  // namespace ragattn
