// Framework-free launcher of the verify_draft kernel (no torch headers): raw device pointers
// of contiguous tensors, a logits-format tag, a stream. Called by verify_draft_cuda.cu after it
// has validated everything.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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
  int batch;
  int g;
  int vocab;
  int logits_kind;
  float inv_temperature;  // 1 / T (inverse_temperature)
  float eta;          // >= 0
  float alpha;        // in [0, 1]
  bool greedy;
  int cluster_size;  // CTAs per batch row: 1, 2, 4 or 8 (verify_draft_cluster_size; > 1 needs sm_90)
};

// A cluster of cluster_size CTAs of kThreads threads per batch row (grid = batch * cluster_size),
// sequential over the row's drafts (early exit at the first rejection), no host synchronisation, no
// global workspace (CUDA-graph safe). The tokens do not depend on cluster_size. Preconditions (not
// checked here): draft tokens in [0, V) (an out-of-range one is rejected, never read), num_draft in
// [0, g] (clamped), uniforms in [0, 1).
cudaError_t launch_verify_draft(const VerifyDraftArgs& args, cudaStream_t stream);

// CTAs per batch row: the smallest power of two up to 8 (kSlices) that gives at least one CTA per SM
// (B = 64 on an H100's 132 SMs: 4, a grid of 256 CTAs); 1 before sm_90 (no clusters). A function of
// the shapes and the device only, so a CUDA graph replays the same launch. bench/sm90.py mirrors it.
inline int verify_draft_cluster_size(int64_t batch, int num_sms, int cc_major) {
  int c = 1;
  if (cc_major < 9) return c;
  while (c < 8 && batch * c < num_sms) c *= 2;
  return c;
}

}  // namespace speculative
}  // namespace ragattn
