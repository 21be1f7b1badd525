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
// Sources and destinations may differ in element type when one is float8_e4m3fn (fp8_math.h):
// VEC is then that of the wider type, and every element goes through fp32 with its layer's scale.
#include "kv_cache/fp8_math.h"
#include "kv_cache/kv_cache_kernels.cuh"
#include "kv_cache/rope_math.h"
#include "kv_cache/row_layout.h"

#include <type_traits>

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
  const void* delta;
  const float* inv_freq;
  LayerScales scale;  // of layers[0], stepping by layer
  int num_layers, heads, head_dim, rotary_dim;
  bool rows_int64, delta_int64;
};

struct CopyParams {
  void* ptrs[4 * kMaxCopyLayers];  // dst_k[0..L), dst_v[0..L), src_k[0..L), src_v[0..L)
  RowLayout dst_k, dst_v, src_k, src_v;
  LayerScales dst_k_scale, dst_v_scale, src_k_scale, src_v_scale;  // of layer 0 of this launch
  const void* src_rows;
  const void* dst_rows;
  const void* delta;
  const float* inv_freq;
  int num_layers, k_heads, k_head_dim, v_heads, v_head_dim, rotary_dim;
  bool src_rows_int64, dst_rows_int64, delta_int64;
};

// Layer l's scale of an fp8 element type (1 for the others, nothing read).
template <typename T>
__device__ __forceinline__ float scale_at(const LayerScales& s, int l) {
  if constexpr (IsFp8<T>::value) return s.ptr[l * s.stride];
  return 1.f;
}

// Scales of a chunk of layers starting at layer l0.
inline LayerScales offset_scales(LayerScales s, int l0) {
  if (s.ptr != nullptr) s.ptr += l0 * s.stride;
  return s;
}

// cos/sin of delta[r] * inv_freq[i] for every frequency, in shared memory.
__device__ __forceinline__ void stage_cos_sin(int half, int64_t d, const float* inv_freq, float* cs, float* sn) {
  for (int i = threadIdx.x; i < half; i += blockDim.x) rope::angle_cos_sin(d, inv_freq[i], &cs[i], &sn[i]);
  __syncthreads();
}

// Rotate the rotary slots of one row in every layer: src rows -> dst rows (in place when equal).
template <typename TS, typename TD, int VEC, bool INTERLEAVED>
__device__ __forceinline__ void rotate_slots(void* const* dst, void* const* src, int num_layers, int heads,
                                             int head_dim, int rotary_dim, int64_t dst_off, int64_t src_off,
                                             const float* cs, const float* sn, const LayerScales& s_in,
                                             const LayerScales& s_out) {
  constexpr int SLOT = INTERLEAVED ? (VEC > 2 ? VEC : 2) : VEC;
  const int half = rotary_dim / 2;
  const int slots_per_head = INTERLEAVED ? rotary_dim / SLOT : half / SLOT;
  const int per_layer = heads * slots_per_head;
  const int total = num_layers * per_layer;
  for (int base = threadIdx.x; base < total; base += kBatch * blockDim.x) {
    TS a[kBatch][SLOT], b[kBatch][SLOT];
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
        const TS* s = static_cast<const TS*>(src[l]) + src_off + elem[u];
        load_elems<TS, VEC>(s, a[u]);
        if (!INTERLEAVED) load_elems<TS, VEC>(s + half, b[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * blockDim.x;
      if (i < total) {
        TD* d = static_cast<TD*>(dst[lay[u]]) + dst_off + elem[u];
        const float si = scale_at<TS>(s_in, lay[u]), so = scale_at<TD>(s_out, lay[u]);
        TD ya[SLOT], yb[SLOT];
        float y1, y2;
        if (INTERLEAVED) {
#pragma unroll
          for (int e = 0; e < SLOT; e += 2) {
            const int j = (slot[u] * SLOT + e) / 2;
            rope::rotate_pair(load_elem(a[u][e], si), load_elem(a[u][e + 1], si), cs[j], sn[j], &y1, &y2);
            ya[e] = store_elem<TD>(y1, so);
            ya[e + 1] = store_elem<TD>(y2, so);
          }
          store_elems<TD, VEC>(d, ya);
        } else {
#pragma unroll
          for (int e = 0; e < SLOT; ++e) {
            const int j = slot[u] * SLOT + e;
            rope::rotate_pair(load_elem(a[u][e], si), load_elem(b[u][e], si), cs[j], sn[j], &y1, &y2);
            ya[e] = store_elem<TD>(y1, so);
            yb[e] = store_elem<TD>(y2, so);
          }
          store_elems<TD, VEC>(d, ya);
          store_elems<TD, VEC>(d + half, yb);
        }
      }
    }
  }
}

// Plain copy of `segs` segments of `seg_units` VEC-wide units per row (segment s starts at
// element s * seg_stride + seg_offset), for every layer; converted element by element when a side
// is fp8 (requantising with an equal scale is the identity).
template <typename TS, typename TD, int VEC>
__device__ __forceinline__ void copy_units(void* const* dst, void* const* src, int num_layers, int segs, int seg_units,
                                           int seg_stride, int seg_offset, int64_t dst_off, int64_t src_off,
                                           const LayerScales& s_in, const LayerScales& s_out) {
  constexpr bool kRaw = std::is_same<TS, TD>::value && !IsFp8<TS>::value;
  const int per_layer = segs * seg_units;
  const int total = num_layers * per_layer;
  if (seg_units == 0) return;
  for (int base = threadIdx.x; base < total; base += kBatch * blockDim.x) {
    Pack<TS, VEC> x[kBatch];
    TD* d[kBatch];
    int lay[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * blockDim.x;
      if (i < total) {
        const int l = i / per_layer;
        const int rem = i - l * per_layer;
        const int sg = rem / seg_units;
        const int64_t e = static_cast<int64_t>(sg) * seg_stride + seg_offset + (rem - sg * seg_units) * VEC;
        x[u] = *reinterpret_cast<const Pack<TS, VEC>*>(static_cast<const TS*>(src[l]) + src_off + e);
        d[u] = static_cast<TD*>(dst[l]) + dst_off + e;
        lay[u] = l;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + u * blockDim.x < total) {
        if constexpr (kRaw) {
          *reinterpret_cast<Pack<TS, VEC>*>(d[u]) = x[u];
        } else {
          const float si = scale_at<TS>(s_in, lay[u]), so = scale_at<TD>(s_out, lay[u]);
          Pack<TD, VEC> y;
#pragma unroll
          for (int e = 0; e < VEC; ++e) y.v[e] = store_elem<TD>(load_elem(x[u].v[e], si), so);
          *reinterpret_cast<Pack<TD, VEC>*>(d[u]) = y;
        }
      }
    }
  }
}

template <typename T, int VEC, bool INTERLEAVED>
__global__ void __launch_bounds__(kThreads) rerotate_keys_kernel(const __grid_constant__ RerotateParams p) {
  extern __shared__ __align__(16) float cos_sin[];
  const int64_t r = blockIdx.x;
  const int64_t d = load_index(p.delta, p.delta_int64, r);
  if (d == 0) return;  // identity: leave the row untouched (block-uniform)
  const int half = p.rotary_dim / 2;
  stage_cos_sin(half, d, p.inv_freq, cos_sin, cos_sin + half);
  const int64_t off = row_offset(p.layout, load_index(p.rows, p.rows_int64, r));
  rotate_slots<T, T, VEC, INTERLEAVED>(p.layers, p.layers, p.num_layers, p.heads, p.head_dim, p.rotary_dim, off, off,
                                       cos_sin, cos_sin + half, p.scale, p.scale);
}

template <typename TS, typename TD, int VEC, bool INTERLEAVED, bool ROTATE>
__global__ void __launch_bounds__(kThreads) copy_kv_kernel(const __grid_constant__ CopyParams p) {
  extern __shared__ __align__(16) float cos_sin[];
  const int64_t r = blockIdx.x;
  const int L = p.num_layers;
  const int half = ROTATE ? p.rotary_dim / 2 : 0;
  if (ROTATE) stage_cos_sin(half, load_index(p.delta, p.delta_int64, r), p.inv_freq, cos_sin, cos_sin + half);
  void* const* dst_k = p.ptrs;
  void* const* dst_v = p.ptrs + L;
  void* const* src_k = p.ptrs + 2 * L;
  void* const* src_v = p.ptrs + 3 * L;
  const int64_t sr = load_index(p.src_rows, p.src_rows_int64, r), dr = load_index(p.dst_rows, p.dst_rows_int64, r);
  const int64_t dko = row_offset(p.dst_k, dr), sko = row_offset(p.src_k, sr);
  const int k_row = p.k_heads * p.k_head_dim;
  if (ROTATE) {
    rotate_slots<TS, TD, VEC, INTERLEAVED>(dst_k, src_k, L, p.k_heads, p.k_head_dim, p.rotary_dim, dko, sko, cos_sin,
                                           cos_sin + half, p.src_k_scale, p.dst_k_scale);
    copy_units<TS, TD, VEC>(dst_k, src_k, L, p.k_heads, (p.k_head_dim - p.rotary_dim) / VEC, p.k_head_dim,
                            p.rotary_dim, dko, sko, p.src_k_scale, p.dst_k_scale);
  } else {
    copy_units<TS, TD, VEC>(dst_k, src_k, L, 1, k_row / VEC, 0, 0, dko, sko, p.src_k_scale, p.dst_k_scale);
  }
  if (p.v_heads > 0) {
    const int v_row = p.v_heads * p.v_head_dim;
    copy_units<TS, TD, VEC>(dst_v, src_v, L, 1, v_row / VEC, 0, 0, row_offset(p.dst_v, dr), row_offset(p.src_v, sr),
                            p.src_v_scale, p.dst_v_scale);
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
  p.delta_int64 = a.delta_int64;
  p.inv_freq = a.inv_freq;
  p.heads = a.heads;
  p.head_dim = a.head_dim;
  p.rotary_dim = a.rotary_dim;
  for (int l0 = 0; l0 < a.num_layers; l0 += kMaxRerotateLayers) {
    p.num_layers = a.num_layers - l0 < kMaxRerotateLayers ? a.num_layers - l0 : kMaxRerotateLayers;
    p.scale = offset_scales(a.scale, l0);
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

template <typename TS, typename TD>
cudaError_t copy_typed(const CopyArgs& a, cudaStream_t stream) {
  constexpr int V = 16 / (sizeof(TS) > sizeof(TD) ? sizeof(TS) : sizeof(TD));
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
  p.delta_int64 = a.delta_int64;
  p.inv_freq = a.inv_freq;
  p.k_heads = a.k_heads;
  p.k_head_dim = a.k_head_dim;
  p.v_heads = a.v_heads;
  p.v_head_dim = a.v_head_dim;
  p.rotary_dim = rotate ? a.rotary_dim : 0;
  for (int l0 = 0; l0 < a.num_layers; l0 += kMaxCopyLayers) {
    const int L = a.num_layers - l0 < kMaxCopyLayers ? a.num_layers - l0 : kMaxCopyLayers;
    p.num_layers = L;
    p.dst_k_scale = offset_scales(a.dst_k_scale, l0);
    p.dst_v_scale = offset_scales(a.dst_v_scale, l0);
    p.src_k_scale = offset_scales(a.src_k_scale, l0);
    p.src_v_scale = offset_scales(a.src_v_scale, l0);
    for (int l = 0; l < L; ++l) {
      p.ptrs[l] = a.dst_k[l0 + l];
      p.ptrs[2 * L + l] = a.src_k[l0 + l];
      p.ptrs[L + l] = a.v_heads > 0 ? a.dst_v[l0 + l] : nullptr;
      p.ptrs[3 * L + l] = a.v_heads > 0 ? a.src_v[l0 + l] : nullptr;
    }
#define RAGATTN_COPY(VEC, IL, ROT) copy_kv_kernel<TS, TD, VEC, IL, ROT><<<grid, kThreads, sm, stream>>>(p)
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

// Whether copy_kv_ converts TS to TD: the same type, or fp8 on one side.
template <typename TS, typename TD>
constexpr bool kPairOk = std::is_same<TS, TD>::value || IsFp8<TS>::value || IsFp8<TD>::value;

template <typename TS, typename TD>
cudaError_t copy_pair(const CopyArgs& a, cudaStream_t stream) {
  if constexpr (kPairOk<TS, TD>) {
    return copy_typed<TS, TD>(a, stream);
  } else {
    return cudaErrorInvalidValue;  // refused by the launcher's checks
  }
}

// copy_typed over the source element type, for destinations of type TD.
template <typename TD>
cudaError_t copy_to(const CopyArgs& a, cudaStream_t stream) {
  switch (a.src_dtype) {
    case CacheDType::kFloat16:
      return copy_pair<__half, TD>(a, stream);
    case CacheDType::kBFloat16:
      return copy_pair<__nv_bfloat16, TD>(a, stream);
    case CacheDType::kFloat32:
      return copy_pair<float, TD>(a, stream);
    case CacheDType::kFloat8E4M3:
      return copy_pair<Fp8E4M3, TD>(a, stream);
  }
  return cudaErrorInvalidValue;
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
    case CacheDType::kFloat8E4M3:
      return rerotate_typed<Fp8E4M3>(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy_kv(const CopyArgs& a, cudaStream_t stream) {
  if (a.n == 0 || a.num_layers == 0) return cudaSuccess;
  switch (a.dtype) {
    case CacheDType::kFloat16:
      return copy_to<__half>(a, stream);
    case CacheDType::kBFloat16:
      return copy_to<__nv_bfloat16>(a, stream);
    case CacheDType::kFloat32:
      return copy_to<float>(a, stream);
    case CacheDType::kFloat8E4M3:
      return copy_to<Fp8E4M3>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kv_cache
}  // namespace ragattn
