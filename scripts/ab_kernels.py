"""A/B of kernel variants on a GPU, in one process (scripts/gpu_check.sh's stage `ab`; not part of
the benchmark suite):
1. decode on a zero-copy request's position-tagged table, keys rotated in the kernel, against the
   same table over rotated keys and the padded table (batch 32 x 32K, bf16, 32/8 heads, d128, page 16);
2. decode under a 4096 window at 2, 4, 8 and 16 splits, then its loops and stages: the table's window
   entry (edge tiles in one loop, 5 stages), 68e7ebf's three loops at 3 stages (452 us there), the edge
   loop at 3 stages, three loops at 5 stages and 32-key tiles (3 CTAs/SM), each also called through the
   Triton launcher directly and timed back to back between two syncs (the wall), which separates a
   host-bound call from a slow kernel;
3. varlen_attention's forward (8 x 4096 + 50 Block-Attention, and a 4096 window over 16K) at the
   table's tile (128 x 32, 8 warps, 3 stages) and wider ones, and with TMA loads;
4. key_attention_scores q64 x k32K: pass 2 split over the keys (column_pass "split", the table's)
   against one program per key tile ("tile", the H100 run's 198 us), with the wall beside do_bench;
5. verify_draft B64 g10 V128256 (bf16 logits, fp32 draft probs, bench_verify_draft's inputs): at eta 0
   phase 1 one slice per CTA (the default; 347 us on the H100 at 68e7ebf) against G slices of a position
   per CTA (RAGATTN_VERIFY_DRAFT_GROUP 2, 4, 8, 16), each row checked token for token against the
   default; eta 10 (the one-pass kernel: 1111 us at 68e7ebf) in clusters of 8 CTAs (the default) and 16
   (RAGATTN_VERIFY_DRAFT_CLUSTER: 2 slices and ~55 KB per CTA, 4 CTAs/SM), a CTA's slices reduced 4 (the
   default), 2 or 1 at once (RAGATTN_VERIFY_DRAFT_REDUCE, capped at the CTA's slices), the draw's totals
   by the totals kernel (the default) or by the one-pass kernel (RAGATTN_VERIFY_DRAFT_PHASE1_TOTALS=1),
   tokens checked alike.

    python scripts/ab_kernels.py OUT.jsonl

``AB_DRY=1`` runs the same steps at tiny sizes on the CPU (a check of the script, no timing).
``AB_PARTS=paged``, ``varlen``, ``keys`` or ``verify`` runs those parts (comma-separated; default all).
Every result is appended to OUT.jsonl as it is measured (a run cut short keeps them) and printed.
Times: triton.testing.do_bench medians (L2 flushed between calls). Run from the repository root
with the extension built (scripts/gpu_check.sh --build-only).
"""
import contextlib
import json
import os
import sys
import time

if os.environ.get("AB_DRY") == "1":  # before triton is imported: it reads this when it decorates a kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import ragattn  # noqa: E402
import ragattn.triton_kernels.varlen_attention as va  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "ab.jsonl"
DRY = os.environ.get("AB_DRY") == "1"
dev = torch.device("cpu" if DRY else "cuda")
bf16, i32 = torch.bfloat16, torch.int32
gen = torch.Generator(device=dev).manual_seed(0)


def record(**row):
    row["gpu"] = "dry run (cpu)" if DRY else torch.cuda.get_device_name(dev)
    print(json.dumps(row), flush=True)
    with open(OUT, "a") as f:
        f.write(json.dumps(row) + "\n")


def us(fn):
    if DRY:
        fn()
        return 0.0
    return float(do_bench(fn, warmup=25, rep=100)) * 1e3


def wall_us(fn, n=20):
    """Back-to-back calls between two device syncs, per call: the host's launch cost included."""
    if DRY:
        fn()
        return 0.0
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def randn(*shape):
    return torch.randn(*shape, generator=gen, device=dev).to(bf16)


B, CTX, H, HKV, D, PAGE = (2, 512, 4, 2, 64, 16) if DRY else (32, 32768, 32, 8, 128, 16)
W = 64 if DRY else 4096


def paged():
    """Parts 1 and 2: paged decode, batch 32 x 32K."""
    pages = CTX // PAGE
    perm = torch.randperm(B * pages).to(i32)
    bt = perm.view(B, pages).to(dev)
    k, v = randn(B * pages, PAGE, HKV, D), randn(B * pages, PAGE, HKV, D)
    q = randn(B, H, D)
    q_pos = torch.full((B,), CTX - 1, dtype=i32, device=dev)
    cu = torch.arange(B + 1, dtype=i32, device=dev)
    kv_lens = torch.full((B,), CTX, dtype=i32, device=dev)
    indptr = torch.arange(0, (B + 1) * pages, pages, dtype=i32, device=dev)
    first = (torch.arange(pages, dtype=i32, device=dev) * PAGE).repeat(B)
    valid = torch.full_like(first, PAGE)
    tagged = ragattn.PageTable.from_entries(indptr, bt.reshape(-1), first, valid, PAGE)
    padded = ragattn.PageTable.from_block_table(bt, kv_lens)
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(dev)
    kw = dict(num_heads=H, num_kv_heads=HKV, head_dim=D, dtype=bf16)
    p_tag = ragattn.plan_paged_attention(cu, tagged, **kw)
    p_pad = ragattn.plan_paged_attention(cu, padded, **kw)
    for name, fn in [("tagged_rope_in_kernel", lambda: ragattn.run_paged_attention(p_tag, q, q_pos, k, v, inv_freq=inv_freq)),
                     ("tagged_keys_rotated", lambda: ragattn.run_paged_attention(p_tag, q, q_pos, k, v)),
                     ("padded_keys_rotated", lambda: ragattn.run_paged_attention(p_pad, q, q_pos, k, v))]:
        record(case="decode_b32_ctx32768", variant=name, us=us(fn), launch=list(p_tag.launch) if "tagged" in name else
               list(p_pad.launch))
    ref = ragattn.run_paged_attention(p_pad, q, q_pos, k, v)[0].float()
    got = ragattn.run_paged_attention(p_tag, q, q_pos, k, v)[0].float()
    record(case="decode_b32_ctx32768", variant="tagged vs padded max abs diff (same keys)", us=None,
           diff=float((got - ref).abs().max()))

    kc = k[bt.long()].reshape(B, -1, HKV, D)[:, CTX - W: CTX].transpose(1, 2).contiguous()
    vc = v[bt.long()].reshape(B, -1, HKV, D)[:, CTX - W: CTX].transpose(1, 2).contiguous()
    record(case="decode_window4096", variant="sdpa_contiguous_window_gqa",
           us=us(lambda: torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, enable_gqa=True)))
    for splits in (None, 2, 4, 8, 16):
        plan = ragattn.plan_paged_attention(cu, padded, window_left=W - 1, num_splits=splits, **kw)
        record(case="decode_window4096", variant=f"splits={splits or 'auto'}", launch=list(plan.launch),
               us=us(lambda: ragattn.run_paged_attention(plan, q, q_pos, k, v)))
    window_loops(q, q_pos, cu, k, v, bt, kv_lens, padded, kw)
    del k, v, kc, vc
    if not DRY:
        torch.cuda.empty_cache()


def window_loops(q, q_pos, cu, k, v, bt, kv_lens, padded, kw):
    """Part 2b: the window decode's loop structure and stages (the 218 -> 452 us regression)."""
    import ragattn.triton_kernels.paged_attention as pa
    from ragattn.triton_kernels import gpu_configs

    key = "decode/16bit/d128/window"
    base = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, waves=4.0)
    variants = [("table", None), ("68e7ebf: three loops, 3 stages", dict(base, num_stages=3, edge_loop=False)),
                ("edge loop, 3 stages", dict(base, num_stages=3, edge_loop=True)),
                ("edge loop, 5 stages", dict(base, num_stages=5, edge_loop=True)),
                ("three loops, 5 stages", dict(base, num_stages=5, edge_loop=False)),
                ("edge loop, 32-key tiles, 3 stages", dict(base, BLOCK_N=32, num_stages=3, edge_loop=True))]
    for name, cfg in variants:
        with gpu_configs.override("paged_attention", key, cfg) if cfg else contextlib.nullcontext():
            plan = ragattn.plan_paged_attention(cu, padded, window_left=W - 1, **kw)
            tplan = pa.plan_paged_attention(cu, kv_lens, window_left=W - 1, **kw)
        op = lambda: ragattn.run_paged_attention(plan, q, q_pos, k, v)  # noqa: E731
        direct = lambda: pa.run_paged_attention(tplan, q, q_pos, cu, k, v, bt, kv_lens, None, W - 1)  # noqa: E731
        record(case="decode_window4096", variant=f"loops: {name}", launch=list(plan.launch), us=us(op),
               wall_us=wall_us(op), direct_us=us(direct), direct_wall_us=wall_us(direct))


# ---- 4: key_attention_scores pass 2
def keys():
    """Part 4: key_attention_scores q64 x k32K (bf16, 32 / 8 heads, d128), both pass-2 designs."""
    import ragattn.triton_kernels.key_attention_scores as kas

    tq, tk = (8, 300) if DRY else (64, 32768)
    q, k = randn(tq, H, D), randn(tk, HKV, D)
    cu_q = torch.tensor([0, tq], dtype=i32, device=dev)
    cu_k = torch.tensor([0, tk], dtype=i32, device=dev)
    ref = ragattn.key_attention_scores(q, k, cu_q, cu_k)
    for column_pass in kas.COLUMN_PASSES:
        fn = lambda: kas.key_attention_scores(q, k, cu_q, cu_k, column_pass=column_pass)  # noqa: E731
        p = kas.launch_params(tq, tk, 1, H, HKV, D, q.dtype, q.device, None, column_pass)
        record(case="key_attention_scores_q64_k32768", variant=f"column_pass={column_pass}", us=us(fn),
               wall_us=wall_us(fn), config={n: p[n] for n in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages",
                                                              "num_splits", "grid1", "grid2")},
               max_abs_diff_vs_op=float((fn() - ref).abs().max()))
    op = lambda: ragattn.key_attention_scores(q, k, cu_q, cu_k)  # noqa: E731
    record(case="key_attention_scores_q64_k32768", variant="op (table's design)", us=us(op), wall_us=wall_us(op))


# ---- 3: varlen forward tiles
def varlen_problem(n, c, tail, window):
    L = n * c + tail
    blk = torch.cat([torch.arange(n).repeat_interleave(c), torch.full((tail,), -1)]).to(i32).to(dev)
    qq, kk, vv = randn(L, H, D), randn(L, HKV, D), randn(L, HKV, D)
    cuq = torch.tensor([0, L], dtype=i32, device=dev)
    if window:
        return lambda: ragattn.varlen_attention(qq, kk, vv, cuq, cuq, window_left=W - 1)
    return lambda: ragattn.varlen_attention(qq, kk, vv, cuq, cuq, q_block=blk, kv_block=blk)


def varlen():
    """Part 3: varlen_attention's forward at several tiles."""
    orig_config = va._config
    for case, fn in [("varlen_chunks8x4096+50", varlen_problem(*((2, 40, 6) if DRY else (8, 4096, 50)), False)),
                     ("varlen_window4096_L16384", varlen_problem(1, 160 if DRY else 16384, 0, True))]:
        for cfg in [None, (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), "tma"]:
            os.environ["RAGATTN_VARLEN_TMA"] = "1" if cfg == "tma" else "0"
            va._config = orig_config if cfg in (None, "tma") else (lambda *a, _c=cfg, **k: _c)
            try:
                record(case=case, variant=f"tile={cfg or 'table'}", us=us(fn))
            except Exception as exc:  # a config that does not compile here
                record(case=case, variant=f"tile={cfg}", us=None, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    va._config = orig_config


# ---- 5: verify_draft phase 1
def verify():
    """Part 5: verify_draft B64 g10 V128256 at eta 0 per phase-1 group (tokens must not change), and eta 10."""
    from ragattn.bench.bench_verify_draft import _inputs

    b, g, vocab = (2, 3, 9000) if DRY else (64, 10, 128256)
    x, q, z, u = _inputs(b, g, vocab, dev, torch.Generator(device=dev).manual_seed(0))
    # (read by the launcher at every call)
    knobs = ("RAGATTN_VERIFY_DRAFT_GROUP", "RAGATTN_VERIFY_DRAFT_CLUSTER", "RAGATTN_VERIFY_DRAFT_REDUCE",
             "RAGATTN_VERIFY_DRAFT_PHASE1_TOTALS")
    old = {k: os.environ.get(k) for k in knobs}
    rows = ([(0.0, group, "8", "4", "0") for group in ("1", "2", "4", "8", "16")]
            + [(10.0, "1", "8", r, t) for r, t in (("4", "0"), ("4", "1"), ("2", "0"), ("1", "0"))]
            + [(10.0, "1", "16", r, t) for r, t in (("2", "0"), ("2", "1"), ("1", "1"))])
    want = {}
    try:
        for eta, group, cluster, reduce, totals in rows:
            os.environ.update(dict(zip(knobs, (group, cluster, reduce, totals))))
            fn = lambda: ragattn.verify_draft(x, q, z, u, eta=eta)  # noqa: E731
            got = fn()
            want.setdefault(eta, got)
            variant = f"group {group}, cluster {cluster}"
            variant += f", reduce {reduce}, phase-1 totals {totals}" if eta > 0 else ""
            record(case=f"verify_draft_B64_g10_V128256_eta{eta:g}", variant=variant,
                   us=us(fn), wall_us=wall_us(fn), same_tokens_as_default=all(map(torch.equal, got, want[eta])))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


PARTS = os.environ.get("AB_PARTS", "paged,varlen,keys,verify").split(",")
t0 = time.time()
if "keys" in PARTS:  # first: the shortest part
    keys()
if "verify" in PARTS:
    verify()
if "paged" in PARTS:
    paged()
if "varlen" in PARTS:
    varlen()
print(f"done in {time.time() - t0:.0f} s")
