// CPU path of merge_attention_states: one pass over both partial outputs, per (row, head) the
// weights of softmax_math.h's merge_weights (the edge rule of docs/ops.md). Registered as
// ragattn::_merge_attention_states_cpu; ragattn/ops/merge_attention_states.py validates and
// calls it (the Triton kernel stays selectable with RAGATTN_CPU_BACKEND=triton). out may be out_a
// itself (the in-place form): each element is read before it is written. Its N-way form
// (_merge_attention_states_n_cpu) follows the Triton kernel's two passes (max lse, weighted sum).
// log2: the lses are base 2 (FlashInfer's), taken to natural log on load and written back in base 2.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/softmax_math.h"
#include "common/check_message.h"
#include "ops.h"

namespace ragattn {
namespace {

constexpr float kLn2 = 0.693147180559945309f, kLog2e = 1.44269504088896341f;

template <typename T>
void merge_rows(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b,
                const at::Tensor& out, const at::Tensor& lse_out, bool log2) {
  const float in_scale = log2 ? kLn2 : 1.f, out_scale = log2 ? kLog2e : 1.f;
  const int64_t n = out_a.size(0), heads = out_a.size(1), dim = out_a.size(2);
  const T* pa = out_a.data_ptr<T>();
  const T* pb = out_b.data_ptr<T>();
  T* po = out.data_ptr<T>();
  const float* la = lse_a.data_ptr<float>();
  const float* lb = lse_b.data_ptr<float>();
  float* lo = lse_out.data_ptr<float>();
  const int64_t as0 = out_a.stride(0), as1 = out_a.stride(1), bs0 = out_b.stride(0), bs1 = out_b.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t las0 = lse_a.stride(0), las1 = lse_a.stride(1), lbs0 = lse_b.stride(0), lbs1 = lse_b.stride(1);
  const int64_t los0 = lse_out.stride(0), los1 = lse_out.stride(1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, dim));
  at::parallel_for(0, n * heads, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads;
      float wa, wb, lse;
      bool read_a, read_b;
      const bool bad = softmax::merge_weights(la[r * las0 + h * las1] * in_scale, lb[r * lbs0 + h * lbs1] * in_scale,
                                              &wa, &wb, &read_a, &read_b, &lse);
      lo[r * los0 + h * los1] = log2 ? lse * out_scale : lse;
      const T* a = pa + r * as0 + h * as1;
      const T* b = pb + r * bs0 + h * bs1;
      T* o = po + r * os0 + h * os1;
      for (int64_t d = 0; d < dim; ++d) {
        // a side that is not read contributes exactly nothing (its values may be NaN)
        const float x = (read_a ? static_cast<float>(a[d]) * wa : 0.f) + (read_b ? static_cast<float>(b[d]) * wb : 0.f);
        o[d] = static_cast<T>(bad || !std::isfinite(x) ? nan : x);
      }
    }
  });
}

// S states [S, N, H, D] / [S, N, H] -> out [N, H, D], lse [N, H]: the Triton kernel's rule
// (max over the non-NaN lses, weights exp(lse_s - max), out = sum w_s o_s / sum w_s).
template <typename T>
void merge_n_rows(const at::Tensor& outs, const at::Tensor& lses, const at::Tensor& out, const at::Tensor& lse_out,
                  bool log2) {
  const int64_t S = outs.size(0), n = outs.size(1), heads = outs.size(2), dim = outs.size(3);
  const float in_scale = log2 ? kLn2 : 1.f;
  const T* po = outs.data_ptr<T>();
  const float* pl = lses.data_ptr<float>();
  T* dst = out.data_ptr<T>();
  float* lo = lse_out.data_ptr<float>();
  const int64_t ps = outs.stride(0), pt = outs.stride(1), ph = outs.stride(2);
  const int64_t ls = lses.stride(0), lt = lses.stride(1), lh = lses.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), los0 = lse_out.stride(0), los1 = lse_out.stride(1);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, dim * S));
  at::parallel_for(0, n * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads;
      auto lse_of = [&](int64_t s) {
        const float x = pl[s * ls + r * lt + h * lh];
        return x == inf ? -inf : x * in_scale;  // +inf: FlashAttention's "saw no key"
      };
      float m = -inf;
      bool bad = false;
      for (int64_t s = 0; s < S; ++s) {
        const float x = lse_of(s);
        if (std::isnan(x)) bad = true;
        else if (x > m) m = x;
      }
      const float m_safe = m == -inf ? 0.f : m;
      std::fill(acc.begin(), acc.end(), 0.f);
      float total = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const float x = lse_of(s);
        if (!(x > -inf)) continue;  // empty (or NaN, flagged above): never read
        const float w = expf(x - m_safe);
        const T* o = po + s * ps + r * pt + h * ph;
        for (int64_t d = 0; d < dim; ++d) acc[d] += static_cast<float>(o[d]) * w;
        total += w;
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      T* y = dst + r * os0 + h * os1;
      for (int64_t d = 0; d < dim; ++d) {
        const float x = acc[d] * inv;
        y[d] = static_cast<T>(bad || !std::isfinite(x) ? nan : x);
      }
      float lse = total > 0.f ? m_safe + logf(total) : -inf;
      if (bad) lse = nan;
      lo[r * los0 + h * los1] = log2 ? lse * kLog2e : lse;
    }
  });
}

}  // namespace

void merge_attention_states_cpu(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                                const at::Tensor& lse_b, bool log2, const at::Tensor& out, const at::Tensor& lse_out) {
  // shapes, dtypes and aliasing are checked by the Python op; this entry only needs unit
  // last-dim strides of the [N, H, D] tensors (the caller passes contiguous copies otherwise)
  RAGATTN_CHECK(out_a.stride(2) == 1 && out_b.stride(2) == 1 && out.stride(2) == 1,
                "ragattn._merge_attention_states_cpu: out_a, out_b and out need a unit last-dim stride");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_a.scalar_type(), "merge_attention_states_cpu",
                                  [&] { merge_rows<scalar_t>(out_a, lse_a, out_b, lse_b, out, lse_out, log2); });
}

void merge_attention_states_n_cpu(const at::Tensor& outs, const at::Tensor& lses, bool log2, const at::Tensor& out,
                                  const at::Tensor& lse_out) {
  RAGATTN_CHECK(outs.stride(3) == 1 && out.stride(2) == 1,
              "ragattn._merge_attention_states_n_cpu: outs and out need a unit last-dim stride");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, outs.scalar_type(), "merge_attention_states_n_cpu",
                                  [&] { merge_n_rows<scalar_t>(outs, lses, out, lse_out, log2); });
}

}  // namespace ragattn
