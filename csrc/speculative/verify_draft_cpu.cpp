// verify_draft: argument checks (shared with the CUDA launcher) and the CPU op: the chain driver
// over the batch rows (in parallel; each row sequential, stopping at the first rejection), running
// the fast default path or, with RAGATTN_CPU_BACKEND=twin, the bit-faithful twin of the CUDA kernel
// (verify_draft_cpu.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <cmath>
#include <vector>

#include "common/check_message.h"
#include "ops.h"
#include "speculative/verify_draft_cpu.h"
#include "speculative/verify_draft_math.h"

namespace ragattn {

namespace {
constexpr const char* kOp = "ragattn.verify_draft";

// "[row]" (ragged) or "[row, col]" of the first bad element (`at_`: a row of nonzero())
std::string element_index(const at::Tensor& at_, bool ragged) {
  std::string s = "[" + std::to_string(at_[0].item<int64_t>());
  if (!ragged) s += ", " + std::to_string(at_[1].item<int64_t>());
  return s + "]";
}
}  // namespace

void check_verify_draft_args(const at::Tensor& draft_tokens, const std::optional<at::Tensor>& draft_probs,
                             const at::Tensor& target_logits, const at::Tensor& uniforms, double temperature,
                             double eta, double alpha, const std::optional<at::Tensor>& num_draft,
                             const std::optional<at::Tensor>& cu_num_draft, bool check_values) {
  const bool ragged = cu_num_draft.has_value();
  RAGATTN_CHECK_TYPE(draft_tokens.scalar_type() == at::kLong, kOp, ": draft_tokens must be int64, got ",
                     draft_tokens.scalar_type());
  int64_t B = 0, g = 0, T = 0;
  if (ragged) {
    const auto& cu = *cu_num_draft;
    RAGATTN_CHECK_TYPE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, kOp,
                       ": cu_num_draft must be int32 or int64, got ", cu.scalar_type());
    RAGATTN_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 1, kOp, ": cu_num_draft must have shape (B + 1,), got ",
                        cu.sizes());
    RAGATTN_CHECK_VALUE(!num_draft.has_value(), kOp,
                        ": num_draft (padded layout) and cu_num_draft (flat layout) cannot both be given");
    RAGATTN_CHECK_VALUE(draft_tokens.dim() == 1, kOp,
                        ": with cu_num_draft, draft_tokens must be flat with shape (T,), got ", draft_tokens.sizes());
    B = cu.size(0) - 1;
    T = draft_tokens.size(0);
  } else {
    RAGATTN_CHECK_VALUE(draft_tokens.dim() == 2, kOp, ": draft_tokens must have shape (B, g), got ",
                        draft_tokens.sizes());
    B = draft_tokens.size(0);
    g = draft_tokens.size(1);
  }
  const auto lt = target_logits.scalar_type();
  RAGATTN_CHECK_TYPE(lt == at::kFloat || lt == at::kHalf || lt == at::kBFloat16, kOp,
                     ": target_logits must be float16 or bfloat16 or float32, got ", lt);
  if (ragged) {
    RAGATTN_CHECK_VALUE(target_logits.dim() == 2 && target_logits.size(0) == T + B && target_logits.size(1) >= 1, kOp,
                        ": with cu_num_draft, target_logits must have shape (T + B, V) = (", T + B,
                        ", V) with V >= 1, got ", target_logits.sizes());
  } else {
    RAGATTN_CHECK_VALUE(target_logits.dim() == 3 && target_logits.size(0) == B && target_logits.size(1) == g + 1 &&
                            target_logits.size(2) >= 1,
                        kOp, ": target_logits must have shape (", B, ", ", g + 1, ", V) with V >= 1, got ",
                        target_logits.sizes());
  }
  const int64_t V = target_logits.size(-1);
  RAGATTN_CHECK_VALUE(V <= (int64_t{1} << 30), kOp, ": target_logits vocabulary must be at most 2^30, got ", V);
  if (draft_probs.has_value()) {
    const auto& q = *draft_probs;
    RAGATTN_CHECK_TYPE(q.scalar_type() == at::kFloat, kOp, ": draft_probs must be float32, got ", q.scalar_type());
    if (ragged) {
      RAGATTN_CHECK_VALUE(q.dim() == 2 && q.size(0) == T && q.size(1) == V, kOp, ": draft_probs must have shape (", T,
                          ", ", V, "), got ", q.sizes());
    } else {
      RAGATTN_CHECK_VALUE(q.dim() == 3 && q.size(0) == B && q.size(1) == g && q.size(2) == V, kOp,
                          ": draft_probs must have shape (", B, ", ", g, ", ", V, "), got ", q.sizes());
    }
  }
  RAGATTN_CHECK_TYPE(uniforms.scalar_type() == at::kFloat, kOp, ": uniforms must be float32, got ",
                     uniforms.scalar_type());
  if (ragged) {
    RAGATTN_CHECK_VALUE(uniforms.dim() == 1 && uniforms.size(0) == T + B, kOp, ": uniforms must have shape (", T + B,
                        ",), got ", uniforms.sizes());
  } else {
    RAGATTN_CHECK_VALUE(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == g + 1, kOp,
                        ": uniforms must have shape (", B, ", ", g + 1, "), got ", uniforms.sizes());
  }
  const auto dev = target_logits.device();
  auto same_device = [&](const at::Tensor& t, const char* name) {
    RAGATTN_CHECK_VALUE(t.device() == dev, kOp, ": all tensors must be on one device; target_logits is on ", dev,
                        ", ", name, " is on ", t.device());
  };
  same_device(draft_tokens, "draft_tokens");
  if (draft_probs.has_value()) same_device(*draft_probs, "draft_probs");
  same_device(uniforms, "uniforms");
  if (ragged) same_device(*cu_num_draft, "cu_num_draft");
  if (num_draft.has_value()) {
    const auto& nd = *num_draft;
    RAGATTN_CHECK_TYPE(nd.scalar_type() == at::kInt || nd.scalar_type() == at::kLong, kOp,
                       ": num_draft must be int32 or int64, got ", nd.scalar_type());
    RAGATTN_CHECK_VALUE(nd.dim() == 1 && nd.size(0) == B, kOp, ": num_draft must have shape (", B, "), got ",
                        nd.sizes());
    same_device(nd, "num_draft");
  }
  RAGATTN_CHECK_VALUE(std::isfinite(temperature) && temperature > 0, kOp,
                      ": temperature must be finite and > 0, got ", temperature);
  RAGATTN_CHECK_VALUE(std::isfinite(eta) && eta >= 0, kOp, ": eta must be finite and >= 0, got ", eta);
  RAGATTN_CHECK_VALUE(std::isfinite(alpha) && alpha >= 0 && alpha <= 1, kOp, ": alpha must be in [0, 1], got ",
                      alpha);
  if (!check_values) return;
  // Index and range checks (host tensors only: on CUDA they are preconditions, see docs/ops.md).
  at::Tensor used;  // which draft tokens are verified (same shape as draft_tokens)
  if (ragged) {
    const at::Tensor cu = cu_num_draft->to(at::kLong);
    const auto c = cu.accessor<int64_t, 1>();
    RAGATTN_CHECK_VALUE(c[0] == 0 && c[B] == T, kOp, ": cu_num_draft must start at 0 and end at T = ", T,
                        " (the number of draft tokens), got ", c[0], " .. ", c[B]);
    for (int64_t b = 0; b < B; ++b) {
      RAGATTN_CHECK_VALUE(c[b + 1] >= c[b], kOp, ": cu_num_draft must be non-decreasing, got ", c[b], " then ",
                          c[b + 1], " at ", b);
    }
    used = at::ones({T}, draft_tokens.options().dtype(at::kBool));
  } else {
    if (B == 0) return;
    at::Tensor nd64 = num_draft.has_value() ? num_draft->to(at::kLong) : at::full({B}, g, draft_tokens.options());
    const auto nd_bad = (nd64 < 0) | (nd64 > g);
    if (nd_bad.any().item<bool>()) {
      const int64_t b = nd_bad.nonzero()[0][0].item<int64_t>();
      RAGATTN_CHECK_VALUE(false, kOp, ": num_draft must be in [0, ", g, "], got ", nd64[b].item<int64_t>(),
                          " in row ", b);
    }
    used = at::arange(g, draft_tokens.options()).unsqueeze(0) < nd64.unsqueeze(1);
  }
  if (draft_tokens.numel() > 0) {
    const auto tok_bad = used & ((draft_tokens < 0) | (draft_tokens >= V));
    if (tok_bad.any().item<bool>()) {
      const auto at_ = tok_bad.nonzero()[0];
      const std::string where = element_index(at_, ragged);
      const at::Tensor bad_val = ragged ? draft_tokens[at_[0]] : draft_tokens[at_[0]][at_[1]];
      RAGATTN_CHECK_VALUE(false, kOp, ": draft_tokens must be in [0, V = ", V, "), got ", bad_val.item<int64_t>(),
                          " at ", where);
    }
  }
  const auto u_bad = ~((uniforms >= 0) & (uniforms < 1));  // NaN is bad too
  if (u_bad.any().item<bool>()) {
    const auto at_ = u_bad.nonzero()[0];
    const std::string where = element_index(at_, ragged);
    const at::Tensor bad_val = ragged ? uniforms[at_[0]] : uniforms[at_[0]][at_[1]];
    RAGATTN_CHECK_VALUE(false, kOp, ": uniforms must be in [0, 1), got ", bad_val.item<float>(), " at ", where);
  }
}


namespace {

using namespace speculative;

// Where row b's data lives: draft tokens / probs from tok_off, logits / uniforms / outputs from
// row_off (padded layout: b * g and b * (g + 1); flat layout: cu[b] and cu[b] + b).
struct RowPlan {
  int64_t tok_off, row_off, nd, out_len;
  int64_t u_last;  // index of the final draw's uniform (padded: column g; flat: the request's last row)
};

void verify_rows(const at::Tensor& draft_tokens, const float* q_base, const at::Tensor& target_logits,
                 const at::Tensor& uniforms, const VerifyParams& params, int64_t B,
                 const std::function<RowPlan(int64_t)>& plan, bool twin, at::Tensor& out_tokens,
                 at::Tensor& num_accepted) {
  const int V = params.vocab;
  const size_t row_bytes = static_cast<size_t>(V) * target_logits.element_size();
  const char* z_base = static_cast<const char*>(target_logits.const_data_ptr());
  const int64_t* tok = draft_tokens.const_data_ptr<int64_t>();
  const float* uni = uniforms.const_data_ptr<float>();
  int64_t* out = out_tokens.data_ptr<int64_t>();
  int32_t* nacc = num_accepted.data_ptr<int32_t>();

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    const std::unique_ptr<PositionVerifier> verifier = twin ? make_twin_verifier(params) : make_fast_verifier(params);
    for (int64_t b = begin; b < end; ++b) {
      const RowPlan rp = plan(b);
      const int64_t nd = rp.nd;
      const float u_last = uni[rp.u_last];
      int64_t n = nd;
      int token = -1;
      for (int64_t j = 0; j < nd; ++j) {
        const int64_t x = tok[rp.tok_off + j];
        const Decision d = verifier->drafted(z_base + static_cast<size_t>(rp.row_off + j) * row_bytes,
                                             q_base ? q_base + (rp.tok_off + j) * V : nullptr, x,
                                             uni[rp.row_off + j], u_last);
        if (!d.accepted) {
          n = j;
          token = d.token;
          break;
        }
        out[rp.row_off + j] = x;
      }
      if (n == nd)  // every draft accepted: bonus token from p at position num_draft
        token = verifier->bonus(z_base + static_cast<size_t>(rp.row_off + nd) * row_bytes, u_last);
      if (token < 0 || token >= V) token = 0;  // only for positions of all -inf / NaN logits
      out[rp.row_off + n] = token;
      for (int64_t j = n + 1; j < rp.out_len; ++j) out[rp.row_off + j] = -1;
      nacc[b] = static_cast<int32_t>(n);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> verify_draft_cpu(const at::Tensor& draft_tokens,
                                                    const std::optional<at::Tensor>& draft_probs,
                                                    const at::Tensor& target_logits, const at::Tensor& uniforms,
                                                    double temperature, double eta, double alpha, bool greedy,
                                                    const std::optional<at::Tensor>& num_draft,
                                                    const std::optional<at::Tensor>& cu_num_draft, bool twin) {
  check_verify_draft_args(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, num_draft,
                          cu_num_draft, /*check_values=*/true);
  RAGATTN_CHECK_VALUE(target_logits.device().is_cpu(), kOp, ": the CPU implementation got tensors on ",
                      target_logits.device());
  const bool ragged = cu_num_draft.has_value();
  const int64_t B = ragged ? cu_num_draft->size(0) - 1 : draft_tokens.size(0);
  const int64_t g = ragged ? 0 : draft_tokens.size(1);
  auto out_tokens = ragged ? at::empty({target_logits.size(0)}, draft_tokens.options())
                           : at::empty({B, g + 1}, draft_tokens.options());
  auto num_accepted = at::empty({B}, draft_tokens.options().dtype(at::kInt));
  if (B == 0) return {out_tokens, num_accepted};
  const auto tok = draft_tokens.contiguous();
  at::Tensor probs;
  if (draft_probs.has_value()) probs = draft_probs->contiguous();
  const auto logits = target_logits.contiguous();
  const auto uni = uniforms.contiguous();
  VerifyParams params{};
  params.vocab = static_cast<int>(logits.size(-1));
  params.logits_kind = logits.scalar_type() == at::kFloat  ? kLogitsF32
                       : logits.scalar_type() == at::kHalf ? kLogitsF16
                                                           : kLogitsBF16;
  params.inv_t = inverse_temperature(temperature);
  params.eta = static_cast<float>(eta);
  params.base2 = base2_scales(temperature, eta);
  params.alpha = static_cast<float>(alpha);
  params.greedy = greedy;
  const float* q_base = probs.defined() ? probs.const_data_ptr<float>() : nullptr;
  if (ragged) {
    const at::Tensor cu = cu_num_draft->to(at::kLong).contiguous();
    const int64_t* c = cu.const_data_ptr<int64_t>();
    verify_rows(tok, q_base, logits, uni, params, B,
                [c](int64_t b) { return RowPlan{c[b], c[b] + b, c[b + 1] - c[b], c[b + 1] - c[b] + 1, c[b + 1] + b}; },
                twin, out_tokens, num_accepted);
  } else {
    at::Tensor nd;
    if (num_draft.has_value()) nd = num_draft->to(at::kLong).contiguous();
    const int64_t* ndp = nd.defined() ? nd.const_data_ptr<int64_t>() : nullptr;
    verify_rows(tok, q_base, logits, uni, params, B,
                [ndp, g](int64_t b) { return RowPlan{b * g, b * (g + 1), ndp ? ndp[b] : g, g + 1, b * (g + 1) + g}; },
                twin, out_tokens, num_accepted);
  }
  return {out_tokens, num_accepted};
}

}  // namespace ragattn
