// verify_draft's default CPU path: a few flat, vectorisable passes over each verified row.
//
// Unlike the twin (verify_draft_twin_cpu.cpp) this path does not replay the CUDA kernel's
// reduction order: sums run in 8 float lanes (combined in a fixed order, so the result does not
// depend on the thread count), exp is the branch-free 8-lane polynomial of common/vec8.h, and the
// inverse-CDF prefix sums are float64. It follows the same rule, including the edge rule for
// non-finite logits; its tokens agree with the float64 reference wherever the reference's decision
// is not within float32 rounding of a threshold (tests/ops/test_verify_draft.py).
//
// Hot loops are compiled twice (baseline x86-64 and x86-64-v3, AVX2 + FMA) and picked at load time
// (RAGATTN_CPU_CLONES of common/cpu_isa.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/cpu_isa.h"
#include "common/vec8.h"
#include "speculative/verify_draft_cpu.h"
#include "speculative/verify_draft_math.h"

// (the 8-lane helpers are always inlined: no 32-byte vector crosses a call boundary)
#pragma GCC diagnostic ignored "-Wpsabi"

namespace ragattn {
namespace speculative {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// 8 float lanes (v8f of common/vec8.h; one AVX register in the x86-64-v3 clone).
constexpr int kLanes = 8;

RAGATTN_ALWAYS_INLINE v8f splat(float x) { return v8f{} + x; }

// x[v, v + 8) with lanes past n set to `pad`.
RAGATTN_ALWAYS_INLINE v8f load8(const float* x, int v, int n, float pad) {
  v8f r;
  if (v + kLanes <= n) {
    std::memcpy(&r, x + v, sizeof(r));
  } else {
    for (int l = 0; l < kLanes; ++l) r[l] = v + l < n ? x[v + l] : pad;
  }
  return r;
}

RAGATTN_ALWAYS_INLINE void store8(float* x, int v, int n, const v8f& r) {
  if (v + kLanes <= n) {
    std::memcpy(x + v, &r, sizeof(r));
  } else {
    for (int l = 0; l < kLanes && v + l < n; ++l) x[v + l] = r[l];
  }
}

// Lanes folded in a fixed order: the result does not depend on the machine or the thread count.
RAGATTN_ALWAYS_INLINE float lane_sum(const v8f& a) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += a[l];
  return s;
}

// Row of logits widened to float32, NaN -> -inf (probability 0).
RAGATTN_CPU_CLONES void load_row(const void* z, int kind, int n, float* out) {
  if (kind == kLogitsF32) {
    const float* s = static_cast<const float*>(z);
    for (int v = 0; v < n; ++v) out[v] = s[v] == s[v] ? s[v] : kNegInf;
  } else if (kind == kLogitsBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(z);
    for (int v = 0; v < n; ++v) {
      const uint32_t bits = static_cast<uint32_t>(s[v]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      out[v] = f == f ? f : kNegInf;
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(z);
    for (int v = 0; v < n; ++v) {
      const float f = fp16_to_float(s[v]);
      out[v] = f == f ? f : kNegInf;
    }
  }
}

// max over x[0, n) (no NaN in x), -inf if n == 0.
RAGATTN_CPU_CLONES float row_max(const float* x, int n) {
  v8f acc = splat(kNegInf);
  for (int v = 0; v < n; v += kLanes) {
    const v8f xv = load8(x, v, n, kNegInf);
    acc = xv > acc ? xv : acc;
  }
  float m = kNegInf;
  for (int l = 0; l < kLanes; ++l) m = acc[l] > m ? acc[l] : m;
  return m;
}

// e[v] = exp(y[v]) and their sum.
RAGATTN_CPU_CLONES float exp_and_sum(const float* y, int n, float* e) {
  v8f acc = {};
  for (int v = 0; v < n; v += kLanes) {
    const v8f ev = exp8_nonpositive(load8(y, v, n, kNegInf));
    store8(e, v, n, ev);
    acc += ev;
  }
  return lane_sum(acc);
}

// y = (z - m) * inv_t in place (m finite), or the +inf rule (m = +inf: 0 at +inf tokens, -inf elsewhere).
RAGATTN_CPU_CLONES void scale_logits(float* y, int n, float m, float inv_t) {
  if (m == kPosInf) {
    for (int v = 0; v < n; ++v) y[v] = y[v] == kPosInf ? 0.0f : kNegInf;
  } else {
    for (int v = 0; v < n; ++v) y[v] = (y[v] - m) * inv_t;
  }
}

// RAPID's modified logits a = y + eta * [q >= thresh] * (q - p), p = e * inv_s, minus their max
// (returned; a row with mass has a finite one).
RAGATTN_CPU_CLONES float modified_logits(const float* y, const float* e, const float* q, int n, float inv_s, float eta,
                                     float thresh, float* a) {
  v8f acc = splat(kNegInf);
  for (int v = 0; v < n; v += kLanes) {
    const v8f yv = load8(y, v, n, kNegInf), qv = load8(q, v, n, 0.0f);
    const v8f av = qv >= thresh ? yv + eta * (qv - load8(e, v, n, 0.0f) * inv_s) : yv;
    store8(a, v, n, av);
    acc = av > acc ? av : acc;
  }
  float m = kNegInf;
  for (int l = 0; l < kLanes; ++l) m = acc[l] > m ? acc[l] : m;
  return m;
}

// Residual weights max(p - min(q, p_hat), 0) with p = e * inv_s, p_hat = eh * inv_sh. The sign is
// decided on the rounded p: a compiler may fuse p - m into one FMA (exact e * inv_s - m), which
// would leave a rounding-size residual where p_hat == p <= q (eta = 0) instead of exactly 0.
RAGATTN_CPU_CLONES void residual(const float* e, float inv_s, const float* eh, float inv_sh, const float* q, int n,
                             float* w) {
  for (int v = 0; v < n; v += kLanes) {
    const v8f p = load8(e, v, n, 0.0f) * inv_s, ph = load8(eh, v, n, 0.0f) * inv_sh, qv = load8(q, v, n, 0.0f);
    const v8f m = qv < ph ? qv : ph;
    store8(w, v, n, p > m ? p - m : v8f{});
  }
}

int first_index_of(const float* x, int n, float m) {
  for (int v = 0; v < n; ++v)
    if (x[v] == m) return v;
  return -1;
}

// Inverse CDF at u over w (>= 0): the first v with w > 0 and prefix(v) > u * total, float64 prefix
// sums; -1 if there is no weight.
int inverse_cdf(const float* w, int n, float u) {
  double total = 0.0;
  for (int v = 0; v < n; ++v) total += w[v];
  if (!(total > 0.0)) return -1;
  const double target = static_cast<double>(u) * total;
  double run = 0.0;
  int last = -1;
  for (int v = 0; v < n; ++v) {
    if (!(w[v] > 0.0f)) continue;
    run += w[v];
    last = v;
    if (run > target) return v;
  }
  return last;  // unreachable for u < 1 (run reaches total), kept for safety
}

class FastVerifier final : public PositionVerifier {
 public:
  explicit FastVerifier(const VerifyParams& p)
      : p_(p), y_(p.vocab), e_(p.vocab), a_(p.vocab), eh_(p.vocab), q_(p.vocab), w_(p.vocab) {}

  Decision drafted(const void* z, const float* q, int64_t x, float u, float u_final) override {
    const int V = p_.vocab;
    if (!target(z)) return {false, 0};  // no mass: rejected, emits token 0
    const float* qr = q;
    if (qr == nullptr) {  // one-hot draft (materialised: the residual and the mask read it)
      std::fill(q_.begin(), q_.end(), 0.0f);
      q_[x] = 1.0f;
      qr = q_.data();
    }
    const float* eh = e_.data();
    float inv_sh = inv_s_;
    int argmax_h = argmax_;
    if (p_.eta > 0.0f) {
      const float thresh = p_.alpha * row_max(qr, V);
      const float ma = modified_logits(y_.data(), e_.data(), qr, V, inv_s_, p_.eta, thresh, a_.data());
      argmax_h = first_index_of(a_.data(), V, ma);
      for (int v = 0; v < V; ++v) a_[v] -= ma;  // (ma is finite: the row has mass)
      inv_sh = 1.0f / exp_and_sum(a_.data(), V, eh_.data());
      eh = eh_.data();
    }
    if (p_.greedy) {
      if (x == argmax_h) return {true, 0};
      return {false, argmax_h};
    }
    const float q_x = qr[x];
    if (accept_draft(u, q_x, eh[x] * inv_sh)) return {true, 0};
    residual(e_.data(), inv_s_, eh, inv_sh, qr, V, w_.data());
    int tok = inverse_cdf(w_.data(), V, u_final);
    if (tok < 0) tok = inverse_cdf(e_.data(), V, u_final);  // all-zero residual: draw from p
    return {false, tok < 0 ? 0 : tok};
  }

  int bonus(const void* z, float u_final) override {
    if (!target(z)) return 0;
    if (p_.greedy) return argmax_;
    const int tok = inverse_cdf(e_.data(), p_.vocab, u_final);
    return tok < 0 ? 0 : tok;
  }

 private:
  // p of a row: y_ = scaled logits, e_ = exp(y_) (p = e_ * inv_s_), argmax_; false if no mass.
  bool target(const void* z) {
    const int V = p_.vocab;
    load_row(z, p_.logits_kind, V, y_.data());
    const float m = row_max(y_.data(), V);
    if (m == kNegInf) return false;
    argmax_ = first_index_of(y_.data(), V, m);
    scale_logits(y_.data(), V, m, p_.inv_t);
    inv_s_ = 1.0f / exp_and_sum(y_.data(), V, e_.data());
    return true;
  }

  VerifyParams p_;
  std::vector<float> y_, e_, a_, eh_, q_, w_;
  float inv_s_ = 1.0f;
  int argmax_ = 0;
};

}  // namespace

std::unique_ptr<PositionVerifier> make_fast_verifier(const VerifyParams& params) {
  return std::make_unique<FastVerifier>(params);
}

}  // namespace speculative
}  // namespace ragattn
