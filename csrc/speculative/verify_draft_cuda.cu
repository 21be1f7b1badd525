// ATen launcher of verify_draft on CUDA tensors: validate (shared with the CPU twin; the index
// and range checks that need host data are preconditions here, checked by the Python wrapper
// when RAGATTN_DEBUG=1), allocate the outputs and the kernels' workspace, launch on the current
// stream. No host sync.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/check_message.h"
#include "ops.h"
#include "speculative/verify_draft_kernels.cuh"
#include "speculative/verify_draft_math.h"

#include <cstdlib>

namespace ragattn {
namespace {

// An integer launch knob from the environment, read at every call so that one process can A/B the
// kernels (scripts/ab_kernels.py): `fallback` where unset, a ValueError naming it outside [lo, hi].
int launch_knob(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  RAGATTN_CHECK_VALUE(*end == '\0' && x >= lo && x <= hi, "ragattn.verify_draft: ", name, " must be an integer in [",
                      lo, ", ", hi, "], got '", v, "'");
  return static_cast<int>(x);
}

// The launch choices (speculative::VerifyDraftLaunch; the same tokens for every value), defaults the
// kernels measured on an H100 (68e7ebf) until a GPU run shows another faster (docs/perf/h100.md,
// verify_draft): RAGATTN_VERIFY_DRAFT_GROUP (phase 1's slices per CTA at eta 0, 1-32, default 1),
// RAGATTN_VERIFY_DRAFT_CLUSTER (CTAs per cluster of the eta > 0 one-pass kernel, 1-16, default 8),
// RAGATTN_VERIFY_DRAFT_REDUCE (that kernel's slices reduced at once per CTA: 1, 2 or 4, default 4),
// RAGATTN_VERIFY_DRAFT_PHASE1_TOTALS (1: that kernel computes the draw's totals too; 0, the default: the
// totals kernel does).
speculative::VerifyDraftLaunch launch_choices() {
  speculative::VerifyDraftLaunch how;
  how.stats_group = launch_knob("RAGATTN_VERIFY_DRAFT_GROUP", 1, 1, 32);
  how.cluster = launch_knob("RAGATTN_VERIFY_DRAFT_CLUSTER", 8, 1, 16);
  how.reduce_together = launch_knob("RAGATTN_VERIFY_DRAFT_REDUCE", 4, 1, 4);
  RAGATTN_CHECK_VALUE(how.reduce_together != 3, "ragattn.verify_draft: RAGATTN_VERIFY_DRAFT_REDUCE must be 1, 2 or 4, "
                      "got 3");
  how.phase1_totals = launch_knob("RAGATTN_VERIFY_DRAFT_PHASE1_TOTALS", 0, 0, 1) == 1;
  return how;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> verify_draft_cuda(const at::Tensor& draft_tokens,
                                                     const std::optional<at::Tensor>& draft_probs,
                                                     const at::Tensor& target_logits, const at::Tensor& uniforms,
                                                     double temperature, double eta, double alpha, bool greedy,
                                                     const std::optional<at::Tensor>& num_draft,
                                                     const std::optional<at::Tensor>& cu_num_draft) {
  check_verify_draft_args(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, num_draft,
                          cu_num_draft, /*check_values=*/false);
  RAGATTN_CHECK_VALUE(target_logits.is_cuda(), "ragattn.verify_draft: the CUDA implementation got tensors on ",
                      target_logits.device());
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const bool ragged = cu_num_draft.has_value();
  const int64_t B = ragged ? cu_num_draft->size(0) - 1 : draft_tokens.size(0);
  const int64_t g = ragged ? 0 : draft_tokens.size(1);
  auto out_tokens = ragged ? at::empty({target_logits.size(0)}, draft_tokens.options())
                           : at::empty({B, g + 1}, draft_tokens.options());
  auto num_accepted = at::empty({B}, draft_tokens.options().dtype(at::kInt));
  if (B == 0) return {out_tokens, num_accepted};
  RAGATTN_CHECK_VALUE(B <= 0x7fffffff, "ragattn.verify_draft: batch must be below 2^31, got ", B);

  const at::Tensor tok = draft_tokens.contiguous();
  at::Tensor probs, cu;
  if (draft_probs.has_value()) probs = draft_probs->contiguous();
  if (ragged) cu = cu_num_draft->contiguous();
  const at::Tensor logits = target_logits.contiguous(), uni = uniforms.contiguous();
  at::Tensor nd;
  if (num_draft.has_value()) nd = num_draft->contiguous();

  speculative::VerifyDraftArgs args{};
  args.draft_tokens = tok.const_data_ptr<int64_t>();
  args.draft_probs = probs.defined() ? probs.const_data_ptr<float>() : nullptr;
  args.target_logits = logits.const_data_ptr();
  args.uniforms = uni.const_data_ptr<float>();
  args.num_draft = nd.defined() ? nd.const_data_ptr() : nullptr;
  args.num_draft_is_int64 = nd.defined() && nd.scalar_type() == at::kLong;
  args.cu_num_draft = cu.defined() ? cu.const_data_ptr() : nullptr;
  args.cu_is_int64 = cu.defined() && cu.scalar_type() == at::kLong;
  args.out_tokens = out_tokens.data_ptr<int64_t>();
  args.num_accepted = num_accepted.data_ptr<int32_t>();
  args.batch = static_cast<int>(B);
  args.g = static_cast<int>(g);
  args.vocab = static_cast<int>(logits.size(-1));
  args.logits_kind = logits.scalar_type() == at::kFloat  ? speculative::kLogitsF32
                     : logits.scalar_type() == at::kHalf ? speculative::kLogitsF16
                                                         : speculative::kLogitsBF16;
  const speculative::Base2Scales base2 = speculative::base2_scales(temperature, eta);
  args.scale = base2.scale;
  args.eta = base2.eta;
  args.alpha = static_cast<float>(alpha);
  args.greedy = greedy;
  args.rows = logits.numel() / logits.size(-1);
  RAGATTN_CHECK_VALUE(args.rows * speculative::num_slices(args.vocab) <= 0x7fffffff,
                      "ragattn.verify_draft: the CUDA kernels take fewer than 2^31 (position, vocabulary slice) "
                      "pairs, got ", args.rows, " positions x ", speculative::num_slices(args.vocab), " slices");
  // the kernels' global workspace (partials per position and slice, draw plans): from torch's caching
  // allocator on the current stream, so no cudaMalloc and no host sync
  const bool modified = args.eta > 0.0f;  // (base2_scales' eta: what the kernels test)
  const auto ws_bytes =
      static_cast<int64_t>(speculative::verify_draft_workspace_bytes(B, args.rows, args.vocab, modified));
  const at::Tensor workspace = at::empty({ws_bytes}, logits.options().dtype(at::kByte));
  args.workspace = workspace.data_ptr();
  const cudaError_t err = speculative::launch_verify_draft(args, c10::cuda::getCurrentCUDAStream(), launch_choices());
  RAGATTN_CHECK(err == cudaSuccess, "ragattn.verify_draft: CUDA kernel launch failed: ", cudaGetErrorString(err));
  return {out_tokens, num_accepted};
}

}  // namespace ragattn
