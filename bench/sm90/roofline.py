"""Roofline lower bounds of the benchmarks' GPU cases (modelled from their bytes and FLOPs)."""
from __future__ import annotations

from typing import List

from .h100 import H100, KV_CACHE_SHAPES, PAGED_BATCH, PAGED_CTX, PAGED_WINDOW, SPARSE_ROWS, SPARSE_TAIL, WINDOW_L, WINDOW_W


def roofline_cases() -> List[dict]:
    """Bytes and FLOPs of each GPU-size benchmark case, from its shapes (no tensor is allocated).

    FLOPs match the benchmarks' ``Case.flops`` (visible pairs only); bytes are the compulsory
    traffic: every input read once, every output written once.
    """
    cases = []
    bf = 2
    H, Hkv, D = 32, 8, 128
    for n, c in [(64, 500), (8, 4096)]:  # bench_varlen_attention
        tail = 50
        L = n * c + tail
        pairs = n * c * (c + 1) / 2 + sum(n * c + i + 1 for i in range(tail))
        io = 2 * L * H * D * bf + 2 * L * Hkv * D * bf + L * H * 4
        cases.append(dict(case=f"varlen_attention/fwd_chunks{n}x{c}+{tail}", bytes=io, flops=4.0 * D * H * pairs))
        if c == 500:  # backward reads q,k,v,o,do,lse, writes dq,dk,dv
            bio = 4 * L * H * D * bf + 4 * L * Hkv * D * bf + 2 * L * H * 4
            cases.append(dict(case=f"varlen_attention/bwd_chunks{n}x{c}+{tail}", bytes=bio, flops=2.5 * 4.0 * D * H * pairs))
    L, W = WINDOW_L, WINDOW_W  # bench_varlen_attention window case: each query sees its last W keys
    pairs = sum(min(i + 1, W) for i in range(L))
    cases.append(dict(case=f"varlen_attention/fwd_window{W}_L{L}",
                      bytes=2 * L * H * D * bf + 2 * L * Hkv * D * bf + L * H * 4, flops=4.0 * D * H * pairs))
    # bench_paged_attention sparse prefill: one 32K sequence, 15% of its rows at random and its 64-row tail
    # (4969 rows); the visible pairs are the expectation over the random rows (uniform: mean position
    # (ctx - tail - 1) / 2), the same as the evenly spread rows of the specs' model
    ctx, tail, rows = PAGED_CTX, SPARSE_TAIL, SPARSE_ROWS
    pairs = (rows - tail) * ((ctx - tail - 1) / 2 + 1) + sum(ctx - tail + i + 1 for i in range(tail))
    cases.append(dict(case="paged_attention/sparse_prefill",
                      bytes=2 * ctx * Hkv * D * bf + 2 * rows * H * D * bf + rows * H * 4, flops=4.0 * D * H * pairs))
    batch = PAGED_BATCH
    cases.append(dict(case="paged_attention/decode", bytes=2 * batch * ctx * Hkv * D * bf + 2 * batch * H * D * bf,
                      flops=4.0 * D * H * batch * ctx))
    window = PAGED_WINDOW
    cases.append(dict(case="paged_attention/decode_window",
                      bytes=2 * batch * (window + 1) * Hkv * D * bf + 2 * batch * H * D * bf,
                      flops=4.0 * D * H * batch * window))
    rows = 32 * 128
    cases.append(dict(case="merge_attention_states/merge", bytes=3.0 * rows * H * (D * bf + 4), flops=None))
    t_q, t_k = 64, 32768  # bench_key_attention_scores: two passes over q and K (row LSE, column sums)
    cases.append(dict(case="key_attention_scores/scores", bytes=2 * t_k * Hkv * D * bf + 2 * t_q * H * D * bf + t_k * 4,
                      flops=2 * 2.0 * H * t_q * t_k * D))
    for tag, layers, N in KV_CACHE_SHAPES:  # bench_kv_cache: H=8, D=128 bf16
        kv = N * layers * Hkv * D * bf
        cases.append(dict(case=f"kv_cache/rerotate_keys_ {tag}", bytes=2 * kv, flops=None))
        cases.append(dict(case=f"kv_cache/copy_kv_ {tag}", bytes=2 * 2 * kv, flops=None))
        cases.append(dict(case=f"kv_cache/copy_kv_+rotate {tag}", bytes=2 * 2 * kv, flops=None))
    for b, g, vocab in [(1, 4, 32000), (64, 10, 128256)]:  # bench_verify_draft: bf16 logits, fp32 draft probs
        # every position's logits row, whatever the acceptance (phase 1 covers all g + 1 positions); eta 0 reads
        # draft probs at the draft tokens and one rejected row (not counted), eta > 0 every drafted row (max q,
        # p_hat). Compulsory bytes: the eta > 0 pass over the modified logits re-reads logits and probs (up to 2x)
        per_row = g * 8 + (g + 1) * 4 + (g + 1) * 8 + 4 + g * 4
        logits = b * (g + 1) * vocab * bf
        cases.append(dict(case=f"verify_draft/B{b}_g{g}_V{vocab}_eta0",
                          bytes=float(logits + b * per_row), flops=None))
        cases.append(dict(case=f"verify_draft/B{b}_g{g}_V{vocab}_eta10",
                          bytes=float(logits + b * g * vocab * 4 + b * per_row), flops=None))
    for c in cases:
        t_mem = c["bytes"] / H100["hbm_bytes_per_s"]
        t_math = (c["flops"] or 0.0) / H100["bf16_flops_per_s"]
        c.update(lower_bound_us=round(1e6 * max(t_mem, t_math), 2), bound="memory" if t_mem >= t_math else "compute",
                 memory_us=round(1e6 * t_mem, 2), compute_us=round(1e6 * t_math, 2),
                 arithmetic_intensity=round(c["flops"] / c["bytes"], 1) if c["flops"] else None)
    return cases

