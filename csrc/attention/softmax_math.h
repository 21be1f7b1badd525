// Per-element softmax-state math shared by the attention CPU twins (host and device).
// An attention state over a key set is (m, l, acc): the largest score m, l = sum exp(s - m) and
// acc = sum exp(s - m) v; lse = m + log(l). Merging states, or adding a block of keys, rescales
// by exp(m_old - m_new). These are the formulas the Triton kernels use (tl.exp / tl.log).
#pragma once

#include <cmath>
#include <limits>

#include "common/host_device.h"

namespace ragattn {
namespace softmax {

// logaddexp(a, b) exactly as torch.logaddexp computes it (both -inf -> -inf; NaN propagates).
RAGATTN_HD float log_add_exp(float a, float b) {
  if (a == b && std::isinf(a)) return a;
  const float m = a > b ? a : b;
  return m + log1pf(expf(-fabsf(a - b)));
}

// The weights of two partial attentions with log-sum-exps la and lb in their merge (cascade
// attention), and the merged lse. +inf (FlashAttention's empty-row marker) and -inf both mean
// "saw no key": weight 0 and that side is never read (read_* = false). A NaN lse poisons the
// pair (returns true: out and lse are NaN). Both empty: lse -inf, both weights 0.
RAGATTN_HD bool merge_weights(float la, float lb, float* wa, float* wb, bool* read_a, bool* read_b, float* lse) {
  const float inf = std::numeric_limits<float>::infinity();
  if (la == inf) la = -inf;
  if (lb == inf) lb = -inf;
  if (std::isnan(la) || std::isnan(lb)) {
    *lse = std::numeric_limits<float>::quiet_NaN();
    *wa = *wb = 0.f;
    *read_a = *read_b = false;
    return true;
  }
  *lse = log_add_exp(la, lb);
  const float safe = std::isfinite(*lse) ? *lse : 0.f;
  *read_a = la > -inf;
  *read_b = lb > -inf;
  *wa = *read_a ? expf(la - safe) : 0.f;
  *wb = *read_b ? expf(lb - safe) : 0.f;
  return false;
}

// Rescale factor of an online-softmax state when its running max moves from m_old to m_new
// (m_old = -inf: an empty state, factor 0).
RAGATTN_HD float rescale(float m_old, float m_new) {
  return m_old == -std::numeric_limits<float>::infinity() ? 0.f : expf(m_old - m_new);
}

}  // namespace softmax
}  // namespace ragattn
