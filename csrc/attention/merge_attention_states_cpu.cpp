// CPU path of merge_attention_states: one pass over both partial outputs, per (row, head) the
// weights of softmax_math.h's merge_weights (the edge rule of docs/ops.md). Registered as
// ragattn::_merge_attention_states_cpu; ragattn/ops/merge_attention_states.py validates and
// calls it (the Triton kernel stays selectable with RAGATTN_CPU_BACKEND=triton).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <limits>

#include "attention/softmax_math.h"
#include "common/check_message.h"
#include "ops.h"

namespace ragattn {
namespace {

template <typename T>
void merge_rows(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b,
                const at::Tensor& out, const at::Tensor& lse_out) {
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
      const bool bad = softmax::merge_weights(la[r * las0 + h * las1], lb[r * lbs0 + h * lbs1], &wa, &wb, &read_a,
                                              &read_b, &lse);
      lo[r * los0 + h * los1] = lse;
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

}  // namespace

void merge_attention_states_cpu(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                                const at::Tensor& lse_b, const at::Tensor& out, const at::Tensor& lse_out) {
  // shapes, dtypes and aliasing are checked by the Python op; this entry only needs unit
  // last-dim strides of the [N, H, D] tensors (the caller passes contiguous copies otherwise)
  RAGATTN_CHECK(out_a.stride(2) == 1 && out_b.stride(2) == 1 && out.stride(2) == 1,
                "ragattn._merge_attention_states_cpu: out_a, out_b and out need a unit last-dim stride");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_a.scalar_type(), "merge_attention_states_cpu",
                                  [&] { merge_rows<scalar_t>(out_a, lse_a, out_b, lse_b, out, lse_out); });
}

}  // namespace ragattn
