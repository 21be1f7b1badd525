// verify_draft: argument checks (shared with the CUDA launcher) and the CPU twin.
//
// The twin replays the CUDA kernel's arithmetic on kThreads virtual threads (chunk ownership,
// warp butterflies, Kogge-Stone scans: see verify_draft_math.h), so that both emit the same
// tokens for the same uniforms. Batch rows run in parallel; each row is sequential.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <sstream>
#include <array>
#include <functional>
#include <cmath>
#include <vector>

#include "ops.h"
#include "speculative/verify_draft_math.h"

namespace ragattn {

namespace {
constexpr const char* kOp = "ragattn.verify_draft";
}  // namespace

void check_verify_draft_args(const at::Tensor& draft_tokens, const std::optional<at::Tensor>& draft_probs,
                             const at::Tensor& target_logits, const at::Tensor& uniforms, double temperature,
                             double eta, double alpha, const std::optional<at::Tensor>& num_draft,
                             const std::optional<at::Tensor>& cu_num_draft, bool check_values) {
  const bool ragged = cu_num_draft.has_value();
  TORCH_CHECK_TYPE(draft_tokens.scalar_type() == at::kLong, kOp, ": draft_tokens must be int64, got ",
                   draft_tokens.scalar_type());
  int64_t B = 0, g = 0, T = 0;
  if (ragged) {
    const auto& cu = *cu_num_draft;
    TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, kOp,
                     ": cu_num_draft must be int32 or int64, got ", cu.scalar_type());
    TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 1, kOp, ": cu_num_draft must have shape (B + 1,), got ",
                      cu.sizes());
    TORCH_CHECK_VALUE(!num_draft.has_value(), kOp,
                      ": num_draft (padded layout) and cu_num_draft (flat layout) cannot both be given");
    TORCH_CHECK_VALUE(draft_tokens.dim() == 1, kOp,
                      ": with cu_num_draft, draft_tokens must be flat with shape (T,), got ", draft_tokens.sizes());
    B = cu.size(0) - 1;
    T = draft_tokens.size(0);
  } else {
    TORCH_CHECK_VALUE(draft_tokens.dim() == 2, kOp, ": draft_tokens must have shape (B, g), got ",
                      draft_tokens.sizes());
    B = draft_tokens.size(0);
    g = draft_tokens.size(1);
  }
  const auto lt = target_logits.scalar_type();
  TORCH_CHECK_TYPE(lt == at::kFloat || lt == at::kHalf || lt == at::kBFloat16, kOp,
                   ": target_logits must be float16 or bfloat16 or float32, got ", lt);
  if (ragged) {
    TORCH_CHECK_VALUE(target_logits.dim() == 2 && target_logits.size(0) == T + B && target_logits.size(1) >= 1, kOp,
                      ": with cu_num_draft, target_logits must have shape (T + B, V) = (", T + B,
                      ", V) with V >= 1, got ", target_logits.sizes());
  } else {
    TORCH_CHECK_VALUE(target_logits.dim() == 3 && target_logits.size(0) == B && target_logits.size(1) == g + 1 &&
                          target_logits.size(2) >= 1,
                      kOp, ": target_logits must have shape (", B, ", ", g + 1, ", V) with V >= 1, got ",
                      target_logits.sizes());
  }
  const int64_t V = target_logits.size(-1);
  TORCH_CHECK_VALUE(V <= (int64_t{1} << 30), kOp, ": target_logits vocabulary must be at most 2^30, got ", V);
  if (draft_probs.has_value()) {
    const auto& q = *draft_probs;
    TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat, kOp, ": draft_probs must be float32, got ", q.scalar_type());
    if (ragged) {
      TORCH_CHECK_VALUE(q.dim() == 2 && q.size(0) == T && q.size(1) == V, kOp, ": draft_probs must have shape (", T,
                        ", ", V, "), got ", q.sizes());
    } else {
      TORCH_CHECK_VALUE(q.dim() == 3 && q.size(0) == B && q.size(1) == g && q.size(2) == V, kOp,
                        ": draft_probs must have shape (", B, ", ", g, ", ", V, "), got ", q.sizes());
    }
  }
  TORCH_CHECK_TYPE(uniforms.scalar_type() == at::kFloat, kOp, ": uniforms must be float32, got ",
                   uniforms.scalar_type());
  if (ragged) {
    TORCH_CHECK_VALUE(uniforms.dim() == 1 && uniforms.size(0) == T + B, kOp, ": uniforms must have shape (", T + B,
                      ",), got ", uniforms.sizes());
  } else {
    TORCH_CHECK_VALUE(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == g + 1, kOp,
                      ": uniforms must have shape (", B, ", ", g + 1, "), got ", uniforms.sizes());
  }
  const auto dev = target_logits.device();
  auto same_device = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device() == dev, kOp, ": all tensors must be on one device; target_logits is on ", dev,
                      ", ", name, " is on ", t.device());
  };
  same_device(draft_tokens, "draft_tokens");
  if (draft_probs.has_value()) same_device(*draft_probs, "draft_probs");
  same_device(uniforms, "uniforms");
  if (ragged) same_device(*cu_num_draft, "cu_num_draft");
  if (num_draft.has_value()) {
    const auto& nd = *num_draft;
    TORCH_CHECK_TYPE(nd.scalar_type() == at::kInt || nd.scalar_type() == at::kLong, kOp,
                     ": num_draft must be int32 or int64, got ", nd.scalar_type());
    TORCH_CHECK_VALUE(nd.dim() == 1 && nd.size(0) == B, kOp, ": num_draft must have shape (", B, "), got ",
                      nd.sizes());
    same_device(nd, "num_draft");
  }
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0, kOp,
                    ": temperature must be finite and > 0, got ", temperature);
  TORCH_CHECK_VALUE(std::isfinite(eta) && eta >= 0, kOp, ": eta must be finite and >= 0, got ", eta);
  TORCH_CHECK_VALUE(std::isfinite(alpha) && alpha >= 0 && alpha <= 1, kOp, ": alpha must be in [0, 1], got ",
                    alpha);
  if (!check_values) return;
  // Index and range checks (host tensors only: on CUDA they are preconditions, see docs/ops.md).
  at::Tensor used;  // which draft tokens are verified (same shape as draft_tokens)
  if (ragged) {
    const at::Tensor cu = cu_num_draft->to(at::kLong);
    const auto c = cu.accessor<int64_t, 1>();
    TORCH_CHECK_VALUE(c[0] == 0 && c[B] == T, kOp, ": cu_num_draft must start at 0 and end at T = ", T,
                      " (the number of draft tokens), got ", c[0], " .. ", c[B]);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK_VALUE(c[b + 1] >= c[b], kOp, ": cu_num_draft must be non-decreasing, got ", c[b], " then ",
                        c[b + 1], " at ", b);
    }
    used = at::ones({T}, draft_tokens.options().dtype(at::kBool));
  } else {
    if (B == 0) return;
    at::Tensor nd64 = num_draft.has_value() ? num_draft->to(at::kLong) : at::full({B}, g, draft_tokens.options());
    const auto nd_bad = (nd64 < 0) | (nd64 > g);
    if (nd_bad.any().item<bool>()) {
      const int64_t b = nd_bad.nonzero()[0][0].item<int64_t>();
      TORCH_CHECK_VALUE(false, kOp, ": num_draft must be in [0, ", g, "], got ", nd64[b].item<int64_t>(),
                        " in row ", b);
    }
    used = at::arange(g, draft_tokens.options()).unsqueeze(0) < nd64.unsqueeze(1);
  }
  if (draft_tokens.numel() > 0) {
    const auto tok_bad = used & ((draft_tokens < 0) | (draft_tokens >= V));
    if (tok_bad.any().item<bool>()) {
      const auto at_ = tok_bad.nonzero()[0];
      std::ostringstream where;
      where << "[" << at_[0].item<int64_t>();
      if (!ragged) where << ", " << at_[1].item<int64_t>();
      where << "]";
      const at::Tensor bad_val = ragged ? draft_tokens[at_[0]] : draft_tokens[at_[0]][at_[1]];
      TORCH_CHECK_VALUE(false, kOp, ": draft_tokens must be in [0, V = ", V, "), got ", bad_val.item<int64_t>(),
                        " at ", where.str());
    }
  }
  const auto u_bad = ~((uniforms >= 0) & (uniforms < 1));  // NaN is bad too
  if (u_bad.any().item<bool>()) {
    const auto at_ = u_bad.nonzero()[0];
    std::ostringstream where;
    where << "[" << at_[0].item<int64_t>();
    if (!ragged) where << ", " << at_[1].item<int64_t>();
    where << "]";
    const at::Tensor bad_val = ragged ? uniforms[at_[0]] : uniforms[at_[0]][at_[1]];
    TORCH_CHECK_VALUE(false, kOp, ": uniforms must be in [0, 1), got ", bad_val.item<float>(), " at ", where.str());
  }
}

namespace {

using namespace speculative;

// One xor butterfly over 32 lanes, the way __shfl_xor_sync pairs them; returns lane 0.
template <class T, class F>
T butterfly(std::array<T, kWarpSize> x, F combine) {
  for (int off = kWarpSize / 2; off > 0; off /= 2) {
    std::array<T, kWarpSize> y;
    for (int i = 0; i < kWarpSize; ++i) y[i] = combine(x[i], x[i ^ off]);
    x = y;
  }
  return x[0];
}

// Block reduction of per-thread partials: a butterfly per warp, then one over the warp results.
template <class T, class F>
T block_reduce(const std::vector<T>& partial, T identity, F combine) {
  std::array<T, kWarpSize> warp_res;
  warp_res.fill(identity);
  for (int w = 0; w < kWarps; ++w) {
    std::array<T, kWarpSize> lanes;
    for (int i = 0; i < kWarpSize; ++i) lanes[i] = partial[w * kWarpSize + i];
    warp_res[w] = butterfly(lanes, combine);
  }
  return butterfly(warp_res, combine);
}

// Kogge-Stone inclusive scan over 32 lanes (shfl_up 1, 2, 4, 8, 16), in place.
void warp_inclusive_scan(std::array<float, kWarpSize>& x) {
  for (int d = 1; d < kWarpSize; d *= 2) {
    std::array<float, kWarpSize> y = x;
    for (int i = d; i < kWarpSize; ++i) y[i] = f_add(x[i - d], x[i]);
    x = y;
  }
}

struct RowView {
  const void* z;   // target logits row (kind below)
  const float* q;  // draft probabilities row, or nullptr (one-hot on `x`, or the bonus position)
  bool has_q;      // a drafted position (q given or one-hot), not the bonus position
  int64_t x;       // the draft token (one-hot q)
  int kind;
  int V;
};

float q_at(const RowView& r, int v) { return draft_prob(r.q, r.x, v); }

float logit_at(const RowView& r, int v) { return load_logit(r.z, r.kind, v); }

PositionStats position_stats(const RowView& r, float inv_t, float eta, float alpha) {
  const int nchunks = (r.V + kChunk - 1) / kChunk;
  const bool with_q = eta > 0.0f && r.has_q;
  std::vector<SoftmaxState> st(kThreads);
  std::vector<float> qmax(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    SoftmaxState s = softmax_identity();
    float qm = -INFINITY;
    for (int c = t; c < nchunks; c += kThreads) {
      const int v0 = c * kChunk, v1 = std::min(v0 + kChunk, r.V);
      for (int v = v0; v < v1; ++v) {
        softmax_update(s, logit_at(r, v), v, inv_t);
        if (with_q) qm = f_max(qm, q_at(r, v));
      }
    }
    st[t] = s;
    qmax[t] = qm;
  }
  auto merge_t = [inv_t](const SoftmaxState& a, const SoftmaxState& b) { return softmax_merge(a, b, inv_t); };
  const SoftmaxState sz = block_reduce(st, softmax_identity(), merge_t);
  PositionStats ps = target_stats(sz);
  if (!with_q) return ps;
  const float qm = block_reduce(qmax, -INFINITY, [](float a, float b) { return f_max(a, b); });
  ps.q_thresh = f_mul(alpha, qm);
  // Second pass: online softmax of the modified logits a = y + eta * mask * (q - p).
  for (int t = 0; t < kThreads; ++t) {
    SoftmaxState s = softmax_identity();
    for (int c = t; c < nchunks; c += kThreads) {
      const int v0 = c * kChunk, v1 = std::min(v0 + kChunk, r.V);
      for (int v = v0; v < v1; ++v) {
        const float y = scaled_logit(logit_at(r, v), ps.m_z, inv_t);
        softmax_update(s, modified_logit(y, q_at(r, v), eta, ps.q_thresh, ps.inv_sp), v, 1.0f);
      }
    }
    st[t] = s;
  }
  auto merge_1 = [](const SoftmaxState& a, const SoftmaxState& b) { return softmax_merge(a, b, 1.0f); };
  const SoftmaxState sa = block_reduce(st, softmax_identity(), merge_1);
  ps.m_a = sa.m;
  ps.inv_sa = f_div(1.0f, sa.s);
  ps.argmax_a = sa.idx;
  return ps;
}

// Inverse-CDF draw of one token from the weights of `mode` at this position (see the
// "Summation order" of verify_draft_math.h); falls back from the residual to p when the
// residual is all zero.
int draw_token(const RowView& r, const PositionStats& ps, int mode, float inv_t, float eta, float u) {
  const int nchunks = (r.V + kChunk - 1) / kChunk;
  const int ntiles = (nchunks + kThreads - 1) / kThreads;
  std::vector<float> w(static_cast<size_t>(kTile));
  std::vector<float> base(kThreads);

  // Weights of one tile (0 past the vocabulary), chunk sums, and the block scan -> tile total.
  auto tile_scan = [&](int tile, float tile_base, int* last_pos) {
    std::array<float, kWarpSize> warp_tot;
    warp_tot.fill(0.0f);
    std::array<std::array<float, kWarpSize>, kWarps> lane_excl;
    for (int wi = 0; wi < kWarps; ++wi) {
      std::array<float, kWarpSize> x;
      for (int lane = 0; lane < kWarpSize; ++lane) {
        const int t = wi * kWarpSize + lane;
        const int v0 = (tile * kThreads + t) * kChunk;
        float s = 0.0f;
        for (int e = 0; e < kChunk; ++e) {
          const int v = v0 + e;
          float wv = 0.0f;
          if (v < r.V) {
            wv = draw_weight(mode, logit_at(r, v), mode == kWeightTarget ? 0.0f : q_at(r, v), ps, inv_t, eta);
            if (wv > 0.0f && v > *last_pos) *last_pos = v;
          }
          w[t * kChunk + e] = wv;
          s = f_add(s, wv);
        }
        x[lane] = s;
      }
      warp_inclusive_scan(x);
      lane_excl[wi][0] = 0.0f;
      for (int lane = 1; lane < kWarpSize; ++lane) lane_excl[wi][lane] = x[lane - 1];
      warp_tot[wi] = x[kWarpSize - 1];
    }
    warp_inclusive_scan(warp_tot);
    for (int wi = 0; wi < kWarps; ++wi) {
      const float warp_excl = wi == 0 ? 0.0f : warp_tot[wi - 1];
      for (int lane = 0; lane < kWarpSize; ++lane)
        base[wi * kWarpSize + lane] = chunk_base(tile_base, warp_excl, lane_excl[wi][lane]);
    }
    return warp_tot[kWarpSize - 1];
  };

  for (int attempt = 0; attempt < 2; ++attempt) {
    int last_pos = -1;
    float total = 0.0f;
    for (int tile = 0; tile < ntiles; ++tile) total = f_add(total, tile_scan(tile, total, &last_pos));
    if (!(total > 0.0f)) {
      if (mode == kWeightResidual) {
        mode = kWeightTarget;  // all-zero residual: draw from p
        continue;
      }
      return ps.argmax_z;  // degenerate row (all logits -inf): no weight anywhere
    }
    const float target = f_mul(u, total);
    float tile_base = 0.0f;
    int ignored = -1;
    for (int tile = 0; tile < ntiles; ++tile) {
      const float tile_total = tile_scan(tile, tile_base, &ignored);
      for (int t = 0; t < kThreads; ++t) {
        float run = base[t];
        const int v0 = (tile * kThreads + t) * kChunk;
        for (int e = 0; e < kChunk; ++e) {
          const float wv = w[t * kChunk + e];
          run = f_add(run, wv);
          if (wv > 0.0f && run > target) return v0 + e;
        }
      }
      tile_base = f_add(tile_base, tile_total);
    }
    return last_pos;  // rounding left u * total at or past the last prefix
  }
  return ps.argmax_z;
}

// Where row b's data lives: draft tokens / probs from tok_off, logits / uniforms / outputs from
// row_off (padded layout: b * g and b * (g + 1); flat layout: cu[b] and cu[b] + b).
struct RowPlan {
  int64_t tok_off, row_off, nd, out_len;
  int64_t u_last;  // index of the final draw's uniform (padded: column g; flat: the request's last row)
};

void verify_rows(const at::Tensor& draft_tokens, const float* q_base, const at::Tensor& target_logits,
                 const at::Tensor& uniforms, float inv_t, float eta, float alpha, bool greedy, int64_t B,
                 const std::function<RowPlan(int64_t)>& plan, at::Tensor& out_tokens, at::Tensor& num_accepted) {
  const int V = static_cast<int>(target_logits.size(-1));
  const int kind = target_logits.scalar_type() == at::kFloat  ? kLogitsF32
                   : target_logits.scalar_type() == at::kHalf ? kLogitsF16
                                                              : kLogitsBF16;
  const size_t esize = target_logits.element_size();
  const char* z_base = static_cast<const char*>(target_logits.const_data_ptr());
  const int64_t* tok = draft_tokens.const_data_ptr<int64_t>();
  const float* uni = uniforms.const_data_ptr<float>();
  int64_t* out = out_tokens.data_ptr<int64_t>();
  int32_t* nacc = num_accepted.data_ptr<int32_t>();

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const RowPlan rp = plan(b);
      const int64_t nd = rp.nd;
      const float u_last = uni[rp.u_last];
      int64_t n = nd;
      int token = -1;
      for (int64_t j = 0; j < nd; ++j) {
        const int64_t x = tok[rp.tok_off + j];
        RowView r{z_base + static_cast<size_t>((rp.row_off + j) * V) * esize,
                  q_base ? q_base + (rp.tok_off + j) * V : nullptr, true, x, kind, V};
        const PositionStats ps = position_stats(r, inv_t, eta, alpha);
        bool ok;
        if (greedy) {
          const int best = eta > 0.0f ? ps.argmax_a : ps.argmax_z;
          ok = x == best;
          if (!ok) token = best;
        } else {
          float p, p_hat;
          const float q_x = q_at(r, static_cast<int>(x));
          token_probs(load_logit(r.z, kind, x), q_x, ps, inv_t, eta, &p, &p_hat);
          ok = accept_draft(uni[rp.row_off + j], q_x, p_hat);
          if (!ok) token = draw_token(r, ps, kWeightResidual, inv_t, eta, u_last);
        }
        if (!ok) {
          n = j;
          break;
        }
        out[rp.row_off + j] = x;
      }
      if (n == nd) {  // every draft accepted: bonus token from p at position num_draft
        RowView r{z_base + static_cast<size_t>((rp.row_off + nd) * V) * esize, nullptr, false, -1, kind, V};
        const PositionStats ps = position_stats(r, inv_t, 0.0f, alpha);
        token = greedy ? ps.argmax_z : draw_token(r, ps, kWeightTarget, inv_t, eta, u_last);
      }
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
                                                    const std::optional<at::Tensor>& cu_num_draft) {
  check_verify_draft_args(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, num_draft,
                          cu_num_draft, /*check_values=*/true);
  TORCH_CHECK_VALUE(target_logits.device().is_cpu(), kOp, ": the CPU implementation got tensors on ",
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
  const float t = inverse_temperature(temperature), e = static_cast<float>(eta), a = static_cast<float>(alpha);
  const float* q_base = probs.defined() ? probs.const_data_ptr<float>() : nullptr;
  if (ragged) {
    const at::Tensor cu = cu_num_draft->to(at::kLong).contiguous();
    const int64_t* c = cu.const_data_ptr<int64_t>();
    verify_rows(tok, q_base, logits, uni, t, e, a, greedy, B,
                [c](int64_t b) { return RowPlan{c[b], c[b] + b, c[b + 1] - c[b], c[b + 1] - c[b] + 1, c[b + 1] + b}; }, out_tokens,
                num_accepted);
  } else {
    at::Tensor nd;
    if (num_draft.has_value()) nd = num_draft->to(at::kLong).contiguous();
    const int64_t* ndp = nd.defined() ? nd.const_data_ptr<int64_t>() : nullptr;
    verify_rows(tok, q_base, logits, uni, t, e, a, greedy, B,
                [ndp, g](int64_t b) { return RowPlan{b * g, b * (g + 1), ndp ? ndp[b] : g, g + 1, b * (g + 1) + g}; }, out_tokens,
                num_accepted);
  }
  return {out_tokens, num_accepted};
}

}  // namespace ragattn
