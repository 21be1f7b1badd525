// The many-rows route of the CPU paged attention (paged_attention_rows_gemm.cpp): the query rows
// of one sequence attend to its keys through two ATen GEMMs per tile of rows (scores, then P x V)
// instead of the row-at-a-time online softmax, which runs well below a GEMM's rate per FLOP
// when hundreds of rows (a recompute pass, a prefill) share one sequence's keys.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ragattn {

// out, lse of the nr query rows q [nr, Hq, D] (float32, contiguous, rows in ascending position
// order row_pos [nr]) over the n keys k, v [H, n, D] (float32, contiguous, ascending positions
// key_pos [n]; Hq a multiple of H, head h reads kv head h / (Hq / H)); every v must be finite (the
// caller checks: a zero weight times a non-finite v of a slot the row does not see would be NaN).
// Row i sees key j iff key_pos[j] <= row_pos[i] and (window_left < 0 or key_pos[j] >=
// row_pos[i] - window_left). Scores are scale * q . k, then cap * tanh(score / cap) when softcap
// > 0. The op's rules (docs/ops.md): a NaN or +inf visible score makes the (row, head) NaN in out
// and lse, a -inf one has weight 0, a row that sees nothing (or only -inf) gets out 0 and lse
// -inf, a non-finite sum makes out NaN. Returns out float32 [nr, Hq, D] and lse float32 [nr, Hq].
std::tuple<at::Tensor, at::Tensor> paged_attention_rows_gemm(const at::Tensor& q, const int64_t* row_pos,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const int64_t* key_pos, float scale,
                                                             int64_t window_left, float softcap);

}  // namespace ragattn
