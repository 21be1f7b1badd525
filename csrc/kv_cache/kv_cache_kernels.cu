// CUDA kernels of rerotate_keys_ and copy_kv_ (framework-free; launched from kv_cache_cuda.cu).
//
// One thread block per row n, covering that row in every layer and head (layer base pointers in
// the __grid_constant__ kernel parameters, row addresses from row_layout.h): the block first
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
#include "kv_cache/row_layout.h"

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

// Kernel parameters (__grid_constant__: read in place from the parameter bank, never copied to
// local memory, so the pointer arrays may be indexed at run time).
struct RerotateParams {
  void* layers[kMaxRerotateLayers];
  RowLayout layout;
  const void* rows;
  const int32_t* delta;
  const float* inv_freq;
  int num_layers, heads, head_dim, rotary_dim;
  bool rows_int64;
};

struct CopyParams {
  void* ptrs[4 * kMaxCopyLayers];  // dst_k[0..L), dst_v[0..L), src_k[0..L), src_v[0..L)
  RowLayout dst_k, dst_v, src_k, src_v;
  const void* src_rows;
  const void* dst_rows;
  const int32_t* delta;
  const float* inv_freq;
  int num_layers, k_heads, k_head_dim, v_heads, v_head_dim, rotary_dim;
  bool src_rows_int64, dst_rows_int64;
};

// cos/sin of delta[r] * inv_freq[i] for every frequency, in shared memory.
__device__ __forceinline__ void stage_cos_sin(int half, int32_t d, const float* inv_freq, float* cs, float* sn) {
  for (int i = threadIdx.x; i < half; i += blockDim.x) rope::angle_cos_sin(d, inv_freq[i], &cs[i], &sn[i]);
  __syncthreads();
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
__global__ void __launch_bounds__(kThreads) rerotate_keys_kernel(const __grid_constant__ RerotateParams p) {
  extern __shared__ __align__(16) float cos_sin[];
  const int64_t r = blockIdx.x;
  const int32_t d = p.delta[r];
  if (d == 0) return;  // identity: leave the row untouched (block-uniform)
  const int half = p.rotary_dim / 2;
  stage_cos_sin(half, d, p.inv_freq, cos_sin, cos_sin + half);
  const int64_t off = row_offset(p.layout, load_index(p.rows, p.rows_int64, r));
  rotate_slots<T, VEC, INTERLEAVED>(p.layers, p.layers, p.num_layers, p.heads, p.head_dim, p.rotary_dim, off, off,
                                    cos_sin, cos_sin + half);
}

template <typename T, int VEC, bool INTERLEAVED, bool ROTATE>
__global__ void __launch_bounds__(kThreads) copy_kv_kernel(const __grid_constant__ CopyParams p) {
  extern __shared__ __align__(16) float cos_sin[];
  const int64_t r = blockIdx.x;
  const int L = p.num_layers;
  const int half = ROTATE ? p.rotary_dim / 2 : 0;
  if (ROTATE) stage_cos_sin(half, p.delta[r], p.inv_freq, cos_sin, cos_sin + half);
  void* const* dst_k = p.ptrs;
  void* const* dst_v = p.ptrs + L;
  void* const* src_k = p.ptrs + 2 * L;
  void* const* src_v = p.ptrs + 3 * L;
  const int64_t sr = load_index(p.src_rows, p.src_rows_int64, r), dr = load_index(p.dst_rows, p.dst_rows_int64, r);
  const int64_t dko = row_offset(p.dst_k, dr), sko = row_offset(p.src_k, sr);
  const int k_row = p.k_heads * p.k_head_dim;
  if (ROTATE) {
    rotate_slots<T, VEC, INTERLEAVED>(dst_k, src_k, L, p.k_heads, p.k_head_dim, p.rotary_dim, dko, sko, cos_sin,
                                      cos_sin + half);
    copy_units<T, VEC>(dst_k, src_k, L, p.k_heads, (p.k_head_dim - p.rotary_dim) / VEC, p.k_head_dim, p.rotary_dim, dko,
                       sko);
  } else {
    copy_units<T, VEC>(dst_k, src_k, L, 1, k_row / VEC, 0, 0, dko, sko);
  }
  if (p.v_heads > 0) {
    const int v_row = p.v_heads * p.v_head_dim;
    copy_units<T, VEC>(dst_v, src_v, L, 1, v_row / VEC, 0, 0, row_offset(p.dst_v, dr), row_offset(p.src_v, sr));
  }
}

template <typename T>
cudaError_t rerotate_typed(const RerotateArgs& a, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const dim3 grid(static_cast<unsigned>(a.n));
  const size_t sm = static_cast<size_t>(a.rotary_dim) * sizeof(float);  // cos and sin, rotary_dim / 2 each
  RerotateParams p{};
  p.layout = a.layout;
  p.rows = a.rows;
  p.rows_int64 = a.rows_int64;
  p.delta = a.delta;
  p.inv_freq = a.inv_freq;
  p.heads = a.heads;
  p.head_dim = a.head_dim;
  p.rotary_dim = a.rotary_dim;
  for (int l0 = 0; l0 < a.num_layers; l0 += kMaxRerotateLayers) {
    p.num_layers = a.num_layers - l0 < kMaxRerotateLayers ? a.num_layers - l0 : kMaxRerotateLayers;
    for (int l = 0; l < p.num_layers; ++l) p.layers[l] = a.layers[l0 + l];
#define RAGATTN_ROT(VEC, IL) rerotate_keys_kernel<T, VEC, IL><<<grid, kThreads, sm, stream>>>(p)
    if (a.vectorized) {
      if (a.interleaved) RAGATTN_ROT(V, true); else RAGATTN_ROT(V, false);
    } else {
      if (a.interleaved) RAGATTN_ROT(1, true); else RAGATTN_ROT(1, false);
    }
#undef RAGATTN_ROT
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t copy_typed(const CopyArgs& a, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const dim3 grid(static_cast<unsigned>(a.n));
  const bool rotate = a.delta != nullptr;
  const size_t sm = rotate ? static_cast<size_t>(a.rotary_dim) * sizeof(float) : 0;
  CopyParams p{};
  p.dst_k = a.dst_k_layout;
  p.dst_v = a.dst_v_layout;
  p.src_k = a.src_k_layout;
  p.src_v = a.src_v_layout;
  p.src_rows = a.src_rows;
  p.src_rows_int64 = a.src_rows_int64;
  p.dst_rows = a.dst_rows;
  p.dst_rows_int64 = a.dst_rows_int64;
  p.delta = a.delta;
  p.inv_freq = a.inv_freq;
  p.k_heads = a.k_heads;
  p.k_head_dim = a.k_head_dim;
  p.v_heads = a.v_heads;
  p.v_head_dim = a.v_head_dim;
  p.rotary_dim = rotate ? a.rotary_dim : 0;
  for (int l0 = 0; l0 < a.num_layers; l0 += kMaxCopyLayers) {
    const int L = a.num_layers - l0 < kMaxCopyLayers ? a.num_layers - l0 : kMaxCopyLayers;
    p.num_layers = L;
    for (int l = 0; l < L; ++l) {
      p.ptrs[l] = a.dst_k[l0 + l];
      p.ptrs[2 * L + l] = a.src_k[l0 + l];
      p.ptrs[L + l] = a.v_heads > 0 ? a.dst_v[l0 + l] : nullptr;
      p.ptrs[3 * L + l] = a.v_heads > 0 ? a.src_v[l0 + l] : nullptr;
    }
#define RAGATTN_COPY(VEC, IL, ROT) copy_kv_kernel<T, VEC, IL, ROT><<<grid, kThreads, sm, stream>>>(p)
    if (a.vectorized) {
      if (!rotate) RAGATTN_COPY(V, false, false);
      else if (a.interleaved) RAGATTN_COPY(V, true, true);
      else RAGATTN_COPY(V, false, true);
    } else {
      if (!rotate) RAGATTN_COPY(1, false, false);
      else if (a.interleaved) RAGATTN_COPY(1, true, true);
      else RAGATTN_COPY(1, false, true);
    }
#undef RAGATTN_COPY
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_rerotate_keys(const RerotateArgs& a, cudaStream_t stream) {
  if (a.n == 0 || a.num_layers == 0) return cudaSuccess;
  switch (a.dtype) {
    case CacheDType::kFloat16:
      return rerotate_typed<__half>(a, stream);
    case CacheDType::kBFloat16:
      return rerotate_typed<__nv_bfloat16>(a, stream);
    case CacheDType::kFloat32:
      return rerotate_typed<float>(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy_kv(const CopyArgs& a, cudaStream_t stream) {
  if (a.n == 0 || a.num_layers == 0) return cudaSuccess;
  switch (a.dtype) {
    case CacheDType::kFloat16:
      return copy_typed<__half>(a, stream);
    case CacheDType::kBFloat16:
      return copy_typed<__nv_bfloat16>(a, stream);
    case CacheDType::kFloat32:
      return copy_typed<float>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kv_cache
}  // namespace ragattn
