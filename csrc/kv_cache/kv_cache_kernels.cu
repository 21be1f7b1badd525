// CUDA kernels of rerotate_keys_ and copy_kv_ (framework-free; launched from kv_cache_cuda.cu).
//
// One thread block per row n, covering that row in every layer and head: the block first
// computes cos/sin of delta[n] * inv_freq[i] once (rope_math.h, angle reduced in double) into
// shared memory, then streams the row's slots of all layers with 16-byte loads/stores, several
// slots in flight per thread (loads of a batch issued before its stores).
//
// Slot layout (elements of one head, T = storage type, VEC = 16 / sizeof(T)):
//   NeoX (interleaved=false): slot p = elements [p*VEC, p*VEC+VEC) of the first half together with
//                             their partners [half + p*VEC, ...) of the second half.
//   GPT-J (interleaved=true): slot p = elements [p*SLOT, p*SLOT+SLOT) = SLOT/2 neighbouring pairs.
// The scalar fallback (misaligned pointers or shapes) is the same code with VEC = 1.
#include "kv_cache/kv_cache_kernels.cuh"
#include "kv_cache/rope_math.h"

namespace ragattn {
namespace kv_cache {
namespace {

constexpr int kThreads = 256;
constexpr int kBatch = 4;  // slots each thread keeps in flight

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC, int N>
__device__ __forceinline__ void load_elems(const T* p, T (&out)[N]) {
#pragma unroll
  for (int k = 0; k < N / VEC; ++k) {
    const Pack<T, VEC> x = reinterpret_cast<const Pack<T, VEC>*>(p)[k];
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[k * VEC + e] = x.v[e];
  }
}

template <typename T, int VEC, int N>
__device__ __forceinline__ void store_elems(T* p, const T (&in)[N]) {
#pragma unroll
  for (int k = 0; k < N / VEC; ++k) {
    Pack<T, VEC> x;
#pragma unroll
    for (int e = 0; e < VEC; ++e) x.v[e] = in[k * VEC + e];
    reinterpret_cast<Pack<T, VEC>*>(p)[k] = x;
  }
}

// Shared-memory staging: layer pointers first (8-byte aligned), then cos[half], sin[half].
struct Smem {
  void** ptrs;
  float* cos;
  float* sin;
};

__device__ __forceinline__ Smem stage(void* const* ptrs, int num_ptrs, int half, const int32_t* delta, int64_t r,
                                      const float* inv_freq) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem s;
  s.ptrs = reinterpret_cast<void**>(smem_raw);
  s.cos = reinterpret_cast<float*>(s.ptrs + num_ptrs);
  s.sin = s.cos + half;
  for (int i = threadIdx.x; i < num_ptrs; i += blockDim.x) s.ptrs[i] = ptrs[i];
  if (delta != nullptr) {
    const int32_t d = delta[r];
    for (int i = threadIdx.x; i < half; i += blockDim.x) rope::angle_cos_sin(d, inv_freq[i], &s.cos[i], &s.sin[i]);
  }
  __syncthreads();
  return s;
}

// Rotate the rotary slots of one row in every layer: src rows -> dst rows (in place when equal).
template <typename T, int VEC, bool INTERLEAVED>
__device__ __forceinline__ void rotate_slots(void* const* dst, void* const* src, int num_layers, int heads,
                                             int head_dim, int rotary_dim, int64_t dst_off, int64_t src_off,
                                             const float* cs, const float* sn) {
  constexpr int SLOT = INTERLEAVED ? (VEC > 2 ? VEC : 2) : VEC;
  const int half = rotary_dim / 2;
  const int slots_per_head = INTERLEAVED ? rotary_dim / SLOT : half / SLOT;
  const int per_layer = heads * slots_per_head;
  const int total = num_layers * per_layer;
  for (int base = threadIdx.x; base < total; base += kBatch * blockDim.x) {
    T a[kBatch][SLOT], b[kBatch][SLOT];
    int64_t elem[kBatch];  // element offset of the slot inside its layer's row
    int lay[kBatch], slot[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * blockDim.x;
      if (i < total) {
        const int l = i / per_layer;
        const int rem = i - l * per_layer;
        const int h = rem / slots_per_head;
        const int p = rem - h * slots_per_head;
        lay[u] = l;
        slot[u] = p;
        elem[u] = static_cast<int64_t>(h) * head_dim + p * SLOT;
        const T* s = static_cast<const T*>(src[l]) + src_off + elem[u];
        load_elems<T, VEC>(s, a[u]);
        if (!INTERLEAVED) load_elems<T, VEC>(s + half, b[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * blockDim.x;
      if (i < total) {
        T* d = static_cast<T*>(dst[lay[u]]) + dst_off + elem[u];
        if (INTERLEAVED) {
#pragma unroll
          for (int e = 0; e < SLOT; e += 2) {
            const int j = (slot[u] * SLOT + e) / 2;
            rope::rotate_stored_pair(&a[u][e], &a[u][e + 1], cs[j], sn[j]);
          }
          store_elems<T, VEC>(d, a[u]);
        } else {
#pragma unroll
          for (int e = 0; e < SLOT; ++e) {
            const int j = slot[u] * SLOT + e;
            rope::rotate_stored_pair(&a[u][e], &b[u][e], cs[j], sn[j]);
          }
          store_elems<T, VEC>(d, a[u]);
          store_elems<T, VEC>(d + half, b[u]);
        }
      }
    }
  }
}

// Plain copy of `segs` segments of `seg_units` VEC-wide units per row (segment s starts at
// element s * seg_stride + seg_offset), for every layer.
template <typename T, int VEC>
__device__ __forceinline__ void copy_units(void* const* dst, void* const* src, int num_layers, int segs, int seg_units,
                                           int seg_stride, int seg_offset, int64_t dst_off, int64_t src_off) {
  const int per_layer = segs * seg_units;
  const int total = num_layers * per_layer;
  if (seg_units == 0) return;
  for (int base = threadIdx.x; base < total; base += kBatch * blockDim.x) {
    Pack<T, VEC> x[kBatch];
    T* d[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * blockDim.x;
      if (i < total) {
        const int l = i / per_layer;
        const int rem = i - l * per_layer;
        const int sg = rem / seg_units;
        const int64_t e = static_cast<int64_t>(sg) * seg_stride + seg_offset + (rem - sg * seg_units) * VEC;
        x[u] = *reinterpret_cast<const Pack<T, VEC>*>(static_cast<const T*>(src[l]) + src_off + e);
        d[u] = static_cast<T*>(dst[l]) + dst_off + e;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + u * blockDim.x < total) *reinterpret_cast<Pack<T, VEC>*>(d[u]) = x[u];
    }
  }
}

template <typename T, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(kThreads)
    rerotate_keys_kernel(void* const* layers, int num_layers, int heads, int head_dim, const int64_t* rows,
                         const int32_t* delta, const float* inv_freq, int rotary_dim) {
  const int64_t r = blockIdx.x;
  if (delta[r] == 0) return;  // identity: leave the row untouched (block-uniform)
  const Smem s = stage(layers, num_layers, rotary_dim / 2, delta, r, inv_freq);
  const int64_t off = rows[r] * heads * head_dim;
  rotate_slots<T, VEC, INTERLEAVED>(s.ptrs, s.ptrs, num_layers, heads, head_dim, rotary_dim, off, off, s.cos, s.sin);
}

template <typename T, int VEC, bool INTERLEAVED, bool ROTATE>
__global__ void __launch_bounds__(kThreads)
    copy_kv_kernel(void* const* ptrs, int num_layers, int k_heads, int k_head_dim, int v_heads, int v_head_dim,
                   const int64_t* src_rows, const int64_t* dst_rows, const int32_t* delta, const float* inv_freq,
                   int rotary_dim) {
  const int64_t r = blockIdx.x;
  const int L = num_layers;
  const Smem s = stage(ptrs, 4 * L, ROTATE ? rotary_dim / 2 : 0, ROTATE ? delta : nullptr, r, inv_freq);
  void* const* dst_k = s.ptrs;
  void* const* dst_v = s.ptrs + L;
  void* const* src_k = s.ptrs + 2 * L;
  void* const* src_v = s.ptrs + 3 * L;
  const int64_t sr = src_rows[r], dr = dst_rows[r];
  const int64_t k_row = static_cast<int64_t>(k_heads) * k_head_dim;
  if (ROTATE) {
    rotate_slots<T, VEC, INTERLEAVED>(dst_k, src_k, L, k_heads, k_head_dim, rotary_dim, dr * k_row, sr * k_row, s.cos,
                                      s.sin);
    copy_units<T, VEC>(dst_k, src_k, L, k_heads, (k_head_dim - rotary_dim) / VEC, k_head_dim, rotary_dim, dr * k_row,
                       sr * k_row);
  } else {
    copy_units<T, VEC>(dst_k, src_k, L, 1, static_cast<int>(k_row / VEC), 0, 0, dr * k_row, sr * k_row);
  }
  if (v_heads > 0) {
    const int64_t v_row = static_cast<int64_t>(v_heads) * v_head_dim;
    copy_units<T, VEC>(dst_v, src_v, L, 1, static_cast<int>(v_row / VEC), 0, 0, dr * v_row, sr * v_row);
  }
}

size_t smem_bytes(int num_ptrs, int half) { return num_ptrs * sizeof(void*) + 2 * half * sizeof(float); }

template <typename T>
cudaError_t rerotate_typed(void* const* layers, int L, int heads, int head_dim, const int64_t* rows,
                           const int32_t* delta, int64_t n, const float* inv_freq, int rotary_dim, bool interleaved,
                           bool vectorized, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const dim3 grid(static_cast<unsigned>(n));
  const size_t sm = smem_bytes(L, rotary_dim / 2);
#define RAGATTN_ROT(VEC, IL) \
  rerotate_keys_kernel<T, VEC, IL><<<grid, kThreads, sm, stream>>>(layers, L, heads, head_dim, rows, delta, inv_freq, rotary_dim)
  if (vectorized) {
    if (interleaved) RAGATTN_ROT(V, true); else RAGATTN_ROT(V, false);
  } else {
    if (interleaved) RAGATTN_ROT(1, true); else RAGATTN_ROT(1, false);
  }
#undef RAGATTN_ROT
  return cudaGetLastError();
}

template <typename T>
cudaError_t copy_typed(void* const* ptrs, int L, int k_heads, int k_head_dim, int v_heads, int v_head_dim,
                       const int64_t* src_rows, const int64_t* dst_rows, int64_t n, const int32_t* delta,
                       const float* inv_freq, int rotary_dim, bool interleaved, bool vectorized, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const dim3 grid(static_cast<unsigned>(n));
  const bool rotate = delta != nullptr;
  const size_t sm = smem_bytes(4 * L, rotate ? rotary_dim / 2 : 0);
#define RAGATTN_COPY(VEC, IL, ROT)                                                                             \
  copy_kv_kernel<T, VEC, IL, ROT><<<grid, kThreads, sm, stream>>>(ptrs, L, k_heads, k_head_dim, v_heads, v_head_dim, \
                                                                  src_rows, dst_rows, delta, inv_freq, rotary_dim)
  if (vectorized) {
    if (!rotate) RAGATTN_COPY(V, false, false);
    else if (interleaved) RAGATTN_COPY(V, true, true);
    else RAGATTN_COPY(V, false, true);
  } else {
    if (!rotate) RAGATTN_COPY(1, false, false);
    else if (interleaved) RAGATTN_COPY(1, true, true);
    else RAGATTN_COPY(1, false, true);
  }
#undef RAGATTN_COPY
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rerotate_keys(void* const* layers, int num_layers, int heads, int head_dim, const int64_t* rows,
                                 const int32_t* delta, int64_t n, const float* inv_freq, int rotary_dim,
                                 bool interleaved, CacheDType dtype, bool vectorized, cudaStream_t stream) {
  if (n == 0 || num_layers == 0) return cudaSuccess;
  switch (dtype) {
    case CacheDType::kFloat16:
      return rerotate_typed<__half>(layers, num_layers, heads, head_dim, rows, delta, n, inv_freq, rotary_dim,
                                    interleaved, vectorized, stream);
    case CacheDType::kBFloat16:
      return rerotate_typed<__nv_bfloat16>(layers, num_layers, heads, head_dim, rows, delta, n, inv_freq, rotary_dim,
                                           interleaved, vectorized, stream);
    case CacheDType::kFloat32:
      return rerotate_typed<float>(layers, num_layers, heads, head_dim, rows, delta, n, inv_freq, rotary_dim,
                                   interleaved, vectorized, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy_kv(void* const* ptrs, int num_layers, int k_heads, int k_head_dim, int v_heads, int v_head_dim,
                           const int64_t* src_rows, const int64_t* dst_rows, int64_t n, const int32_t* delta,
                           const float* inv_freq, int rotary_dim, bool interleaved, CacheDType dtype, bool vectorized,
                           cudaStream_t stream) {
  if (n == 0 || num_layers == 0) return cudaSuccess;
  switch (dtype) {
    case CacheDType::kFloat16:
      return copy_typed<__half>(ptrs, num_layers, k_heads, k_head_dim, v_heads, v_head_dim, src_rows, dst_rows, n,
                                delta, inv_freq, rotary_dim, interleaved, vectorized, stream);
    case CacheDType::kBFloat16:
      return copy_typed<__nv_bfloat16>(ptrs, num_layers, k_heads, k_head_dim, v_heads, v_head_dim, src_rows, dst_rows,
                                       n, delta, inv_freq, rotary_dim, interleaved, vectorized, stream);
    case CacheDType::kFloat32:
      return copy_typed<float>(ptrs, num_layers, k_heads, k_head_dim, v_heads, v_head_dim, src_rows, dst_rows, n,
                               delta, inv_freq, rotary_dim, interleaved, vectorized, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kv_cache
}  // namespace ragattn
