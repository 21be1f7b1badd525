// Framework-free launcher of the verify_draft kernels (no torch headers): raw device pointers
// of contiguous tensors, a logits-format tag, a workspace from the caller, a stream. Called by
// verify_draft_cuda.cu after it has validated everything.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "speculative/verify_draft_math.h"

namespace ragattn {
namespace speculative {

struct VerifyDraftArgs {
  // Padded layout (cu_num_draft == nullptr) / flat layout (vLLM's: cu_num_draft [B + 1], T drafts):
  const int64_t* draft_tokens;  // [B, g] / [T]
  const float* draft_probs;     // [B, g, V] / [T, V], or nullptr: one-hot on the draft token
  const void* target_logits;    // [B, g + 1, V] / [T + B, V] in logits_kind (a LogitsKind of verify_draft_math.h)
  const float* uniforms;        // [B, g + 1] / [T + B]
  const void* num_draft;        // [B] int32 or int64 (num_draft_is_int64), or nullptr (= g)
  bool num_draft_is_int64;
  const void* cu_num_draft;  // [B + 1] int32 or int64 (cu_is_int64), or nullptr (padded layout)
  bool cu_is_int64;
  int64_t* out_tokens;    // [B, g + 1] / [T + B]
  int32_t* num_accepted;  // [B]
  void* workspace;        // verify_draft_workspace_bytes(batch, rows, vocab, eta > 0) bytes, 16-byte aligned
  int batch;
  int g;
  int64_t rows;  // target-logits rows: B * (g + 1) / T + B
  int vocab;
  int logits_kind;
  float scale;        // log2(e) / T (base2_scales of verify_draft_math.h)
  float eta;          // eta * log2(e) (base2_scales), >= 0
  float alpha;        // in [0, 1]
  bool greedy;
  bool phase1_totals;  // (the launcher's, from VerifyDraftLaunch) the one-pass kernel writes the draw's totals
};

// What the walk decided for one batch row, read by the draw kernels: the position to draw at and how.
struct DrawPlan {
  int64_t row;   // target-logits row of the drawn position (= its slot in out_tokens)
  int64_t qrow;  // draft-probs row after a rejection (-1: a bonus draw, or one-hot drafts)
  int x;         // the rejected draft token (one-hot q; -1: none)
  int mode;      // kWeightResidual after a rejection, kWeightTarget for the bonus token
  float u;       // the draw's uniform
  PositionStats ps;
};

// The global workspace: per (logits row, slice) partials, per logits row folded stats (eta > 0),
// per batch row the draw plan, per (logits row, slice) the draw totals.
struct VerifyDraftWorkspace {
  SlicePartial* parts_p;  // [rows, slices]: phase 1, p
  SlicePartial* parts_a;  // [rows, slices]: phase 1's second pass, p_hat (eta > 0)
  PositionStats* stats;   // [rows]: p's folded statistics (eta > 0)
  DrawPlan* plans;        // [B]
  DrawSlice* draws;       // [rows, slices]: the draw's totals at a position (the drawn ones, or all of them)
};

// Bytes of the workspace (and, with base != nullptr, its pointers carved from base).
inline size_t verify_draft_workspace_layout(int64_t batch, int64_t rows, int vocab, bool modified, void* base,
                                            VerifyDraftWorkspace* ws) {
  const size_t ns = static_cast<size_t>(num_slices(vocab));
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 15) / 16 * 16;
    return base != nullptr ? static_cast<char*>(base) + at : nullptr;
  };
  const size_t r = static_cast<size_t>(rows), b = static_cast<size_t>(batch);
  VerifyDraftWorkspace w{};
  w.parts_p = reinterpret_cast<SlicePartial*>(take(r * ns * sizeof(SlicePartial)));
  w.parts_a = reinterpret_cast<SlicePartial*>(take(modified ? r * ns * sizeof(SlicePartial) : 0));
  w.stats = reinterpret_cast<PositionStats*>(take(modified ? r * sizeof(PositionStats) : 0));
  w.plans = reinterpret_cast<DrawPlan*>(take(b * sizeof(DrawPlan)));
  w.draws = reinterpret_cast<DrawSlice*>(take(r * ns * sizeof(DrawSlice)));
  if (ws != nullptr) *ws = w;
  return off;
}

inline size_t verify_draft_workspace_bytes(int64_t batch, int64_t rows, int vocab, bool modified) {
  return verify_draft_workspace_layout(batch, rows, vocab, modified, nullptr, nullptr);
}

// The launches (see verify_draft_kernels.cu): phase 1 over rows x num_slices(V) CTAs of kThreads
// threads (twice with eta > 0, a fold between; on sm_90 one launch of a cluster per position
// instead, same bits, which also computes the draw's totals at every position), the walk (a warp per batch
// row), then, unless greedy, the draw's totals over B x num_slices(V) CTAs (unless phase 1 computed them) and
// its find, a CTA per batch row over the crossing slice alone. No host synchronisation, a fixed launch
// sequence for given shapes (CUDA-graph safe), no atomics across CTAs. Preconditions (not checked
// here): draft tokens in [0, V) (an out-of-range one is rejected, never read), num_draft in [0, g]
// (clamped), uniforms in [0, 1), rows * num_slices(V) < 2^31 (cudaErrorInvalidValue otherwise).
// The launch choices a GPU makes (the same tokens for every value):
struct VerifyDraftLaunch {
  // phase 1's slices per CTA at eta 0 with 16-bit logits: 1 = verify_draft_stats_kernel (a CTA per slice),
  // G in [2, 32] = verify_draft_stats_group_kernel (a CTA per G consecutive slices of a position, the next
  // slice's loads issued before the current one's reduction)
  int stats_group = 1;
  // CTAs per cluster of the one-pass eta > 0 kernel (sm_90), at most the vocabulary's slices: 8 (the
  // portable maximum) or up to 16 (non-portable on the H100: half the slices and shared memory per CTA,
  // twice the CTAs per SM)
  int cluster = 8;
  // slices of a CTA of that kernel reduced at once (1, 2 or 4, at most the CTA's slices: independent
  // butterflies under one barrier, the same bits; at sm_90a 4 takes 77-80 registers, 2 and 1 64: a
  // cluster of 16 at V 128256, 2 slices a CTA, keeps the 4 CTAs/SM its shared memory allows)
  int reduce_together = 4;
  // the draw's totals: computed by that kernel at every position from its shared memory (true: a third
  // sweep, one more cluster exchange and fold, and no totals kernel), or by verify_draft_draw_totals_kernel
  // over the drawn positions' rows (false, the other paths' way); the same totals
  bool phase1_totals = false;
};

cudaError_t launch_verify_draft(const VerifyDraftArgs& args, cudaStream_t stream, VerifyDraftLaunch how = {});

}  // namespace speculative
}  // namespace ragattn
