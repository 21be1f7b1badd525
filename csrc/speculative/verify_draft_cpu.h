// The CPU implementations of verify_draft behind one chain driver (verify_draft_cpu.cpp):
//   * the fast default (verify_draft_fast_cpu.cpp): vectorisable passes over a row, its own
//     accumulation order (8-lane float sums, float64 inverse-CDF prefix sums);
//   * the bit-faithful twin (verify_draft_twin_cpu.cpp): replays the CUDA kernel's reduction order
//     on virtual threads (see verify_draft_math.h), selected by RAGATTN_CPU_BACKEND=twin.
// Both follow the op's rule (docs/ops.md) and its edge rule for non-finite logits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "speculative/verify_draft_math.h"

namespace ragattn {
namespace speculative {

// Everything one position's verification needs besides its row pointers.
struct VerifyParams {
  int vocab;
  int logits_kind;  // LogitsKind of verify_draft_math.h
  float inv_t;      // inverse_temperature(T) (the fast path's natural units)
  float eta;
  Base2Scales base2;  // base2_scales(T, eta): the twin's (and the CUDA kernel's) base-2 units
  float alpha;
  bool greedy;
};

// The outcome at a drafted position: accepted, or rejected with the emitted token.
struct Decision {
  bool accepted;
  int token;
};

// Verifies the positions of one chain in order (one instance per CPU thread: it owns scratch buffers).
class PositionVerifier {
 public:
  virtual ~PositionVerifier() = default;
  // Drafted position: target logits row z, draft-probs row q (nullptr: one-hot on x), draft token
  // x in [0, V), its acceptance uniform u and the final draw's uniform u_final.
  virtual Decision drafted(const void* z, const float* q, int64_t x, float u, float u_final) = 0;
  // Bonus position (every draft accepted): the token drawn from p (argmax p if greedy).
  virtual int bonus(const void* z, float u_final) = 0;
};

std::unique_ptr<PositionVerifier> make_fast_verifier(const VerifyParams& params);
std::unique_ptr<PositionVerifier> make_twin_verifier(const VerifyParams& params);

}  // namespace speculative
}  // namespace ragattn
