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
};

// One block of kThreads threads per batch row, sequential over the row's drafts (early exit at
// the first rejection), no host synchronisation. Preconditions (not checked here): draft tokens
// in [0, V) (an out-of-range one is rejected, never read), num_draft in [0, g] (clamped),
// uniforms in [0, 1).
cudaError_t launch_verify_draft(const VerifyDraftArgs& args, cudaStream_t stream);

}  // namespace speculative
}  // namespace ragattn
