// Test harness of verify_draft's shared math (tests/ops/test_verify_draft_precision.py): p and p_hat of
// each row from the CPU twin's own statistics (verify_draft_twin_cpu.cpp, included: the CUDA kernel's
// order, butterflies and folds) and token_probs of verify_draft_math.h.
//   probs: stdin int32 rows, vocab, kind (LogitsKind); float32 scale, eta, alpha (base2_scales' units);
//          logits [rows, vocab] in `kind`, float32 draft probs [rows, vocab].
//          stdout float32 p and p_hat [rows, vocab].
//   exp2:  stdin int32 n, float32 t [n]; stdout float32 vexp2(t) [n].
#include <cstdio>
#include <cstring>
#include <vector>

#include "speculative/verify_draft_twin_cpu.cpp"

using namespace ragattn::speculative;

static bool read_all(void* dst, size_t bytes) { return std::fread(dst, 1, bytes, stdin) == bytes; }

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "exp2") == 0) {
    int n = 0;
    if (!read_all(&n, sizeof(n))) return 1;
    std::vector<float> t(n);
    if (!read_all(t.data(), sizeof(float) * n)) return 1;
    for (float& v : t) v = vexp2(v);
    std::fwrite(t.data(), sizeof(float), n, stdout);
    return 0;
  }
  int hdr[3];
  float par[3];
  if (!read_all(hdr, sizeof(hdr)) || !read_all(par, sizeof(par))) return 1;
  const int rows = hdr[0], vocab = hdr[1], kind = hdr[2];
  const float scale = par[0], eta = par[1], alpha = par[2];
  const size_t n = static_cast<size_t>(rows) * vocab, esize = kind == kLogitsF32 ? 4 : 2;
  std::vector<unsigned char> z(n * esize);
  std::vector<float> q(n), p(n, NAN), p_hat(n, NAN);  // (outputs poisoned)
  if (!read_all(z.data(), z.size()) || !read_all(q.data(), sizeof(float) * n)) return 1;
  for (int r = 0; r < rows; ++r) {
    const size_t off = static_cast<size_t>(r) * vocab;
    const RowView row{z.data() + off * esize, q.data() + off, true, -1, kind, vocab};
    const PositionStats ps = position_stats(row, scale, eta, alpha);
    for (int v = 0; v < vocab; ++v) {
      token_probs(logit_at(row, v), q_at(row, v), ps, scale, eta, &p[off + v], &p_hat[off + v]);
    }
  }
  std::fwrite(p.data(), sizeof(float), n, stdout);
  std::fwrite(p_hat.data(), sizeof(float), n, stdout);
  return 0;
}
