"""Benchmarks of ``paged_attention`` and ``merge_attention_states``.

gpu (bf16, 32 query heads, 8 kv heads, head dim 128, page size 16, shuffled page table):
* ``sparse_prefill``: a 32K-token cached context, 15% of its rows chosen uniformly at random plus
  a 64-token tail recomputed (FusionRAG's selective recompute + final block). Baselines: SDPA
  full causal over all 32K rows (flash backend; target: ragattn >= 5x faster) and SDPA over the
  selected rows with a dense boolean mask (mask creation time reported as setup).
  ``flops`` counts the useful visible (query, key) pairs only: 4 * head_dim * heads per pair.
* ``decode``: batch 32, one row each, 32K-token contexts; GB/s on the K/V bytes read (target:
  >= 80% of the measured copy peak). Baseline: SDPA over contiguous K/V with ``enable_gqa``.
* ``decode_window``: the decode case under a 4096-token sliding window (``window_left=4095``);
  GB/s on the window's K/V bytes. Baseline: SDPA over the window's slots stored contiguously.
* ``decode_tagged_rope``: the decode case on a zero-copy request's position-tagged table, keys
  stored page-local and moved to their positions in the kernel. Baseline: the same decode over rotated keys.
* ``merge``: cascade merge of two partial states for 32 x 128 rows; GB/s on bytes read + written.
cpu: tiny shapes of the same cases.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch

from .harness import Case, Rand, lazy, small_dtype, synchronize

FAMILIES = ("paged_attention", "merge_attention_states")  # the Case.family values of this module (lets --only skip building it)

I32 = torch.int32


def _flash_only(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _paged_cache(batch, ctx, page_size, kv_heads, head_dim, dtype, device, rnd):
    """Random K/V for `batch` sequences of `ctx` slots, pages shuffled over the pool."""
    pages = math.ceil(ctx / page_size)
    perm = torch.randperm(batch * pages, generator=rnd.cpu).to(I32)
    block_table = perm.view(batch, pages).to(device)
    k = rnd.randn(batch * pages, page_size, kv_heads, head_dim, dtype=dtype)
    v = rnd.randn(batch * pages, page_size, kv_heads, head_dim, dtype=dtype)
    return k, v, block_table


def _decode_shape(device, size):
    """(batch, ctx, heads, kv_heads, head_dim, dtype, page_size) of the decode cases."""
    if size == "gpu":
        return 32, 32768, 32, 8, 128, torch.bfloat16, 16
    return 3, 200, 4, 2, 64, small_dtype(device), 16


def _decode_batch(batch, ctx, heads, kv_heads, head_dim, dtype, page_size, device, rnd):
    """A decode step's inputs: the paged K/V (`_paged_cache`), one query row per sequence at its
    last position, cu_seqlens_q and kv_lens."""
    k, v, bt = _paged_cache(batch, ctx, page_size, kv_heads, head_dim, dtype, device, rnd)
    q = rnd.randn(batch, heads, head_dim, dtype=dtype)
    q_pos = torch.full((batch,), ctx - 1, dtype=I32, device=device)
    cu = torch.arange(batch + 1, dtype=I32, device=device)
    kv_lens = torch.full((batch,), ctx, dtype=I32, device=device)
    return k, v, bt, q, q_pos, cu, kv_lens


def _contiguous(cache, block_table_row, ctx):
    """[1, kv_heads, ctx, D] view of one sequence's slots (for the SDPA baselines)."""
    from ragattn.reference.paged_attention import gather_paged

    return gather_paged(cache, block_table_row, ctx).transpose(0, 1).unsqueeze(0).contiguous()


def _plan_config(plan) -> dict:
    """The launch a plan chose (the results table's config column)."""
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_D", "group", "group_pad", "splits", "split_len", "num_stages", "num_warps",
             "pipeline_v")
    return dict(zip(names, plan.launch))


def _sparse_prefill(device, size, rnd):
    import ragattn

    if size == "gpu":
        ctx, heads, kv_heads, head_dim, dtype, page_size, tail = 32768, 32, 8, 128, torch.bfloat16, 16, 64
    else:
        ctx, heads, kv_heads, head_dim, dtype, page_size, tail = 300, 4, 2, 64, small_dtype(device), 16, 8
    group = heads // kv_heads
    k, v, bt = _paged_cache(1, ctx, page_size, kv_heads, head_dim, dtype, device, rnd)
    body = torch.randperm(ctx - tail, generator=rnd.cpu)[: int(0.15 * (ctx - tail))].sort().values
    q_pos = torch.cat([body, torch.arange(ctx - tail, ctx)]).to(I32)
    n_rows = q_pos.numel()
    q = rnd.randn(n_rows, heads, head_dim, dtype=dtype)
    q_pos_d = q_pos.to(device)
    cu = torch.tensor([0, n_rows], dtype=I32, device=device)
    kv_lens = torch.tensor([ctx], dtype=I32, device=device)
    visible_pairs = float((q_pos.long() + 1).sum())

    # baselines: contiguous K/V with all query heads (what the flash backend accepts)
    kc = _contiguous(k, bt[0], ctx).repeat_interleave(group, dim=1)
    vc = _contiguous(v, bt[0], ctx).repeat_interleave(group, dim=1)
    q_full = rnd.randn(1, heads, ctx, head_dim, dtype=dtype)
    q_sel = q.transpose(0, 1).unsqueeze(0).contiguous()

    def full_causal():
        with _flash_only(device):
            return torch.nn.functional.scaled_dot_product_attention(q_full, kc, vc, is_causal=True)

    def make_mask():
        return torch.arange(ctx, device=device)[None, :] <= q_pos_d[:, None].long()

    t0 = time.perf_counter()
    mask = make_mask()
    synchronize(device)
    mask_ms = (time.perf_counter() - t0) * 1e3

    return Case(
        family="paged_attention",
        name=f"sparse_prefill_ctx{ctx}_rows{n_rows}_h{heads}_kv{kv_heads}_d{head_dim}_p{page_size}",
        run=lambda: ragattn.paged_attention(q, q_pos_d, cu, k, v, bt, kv_lens),
        baselines={
            "sdpa_full_causal_all_rows": full_causal,
            "sdpa_dense_mask_selected_rows": lambda: torch.nn.functional.scaled_dot_product_attention(
                q_sel, kc, vc, attn_mask=mask
            ),
        },
        flops=4.0 * head_dim * heads * visible_pairs,
        peak="matmul",
        peak_dtype=dtype,
        setup_ms={"sdpa_dense_mask_selected_rows": mask_ms},
        backends={"sdpa_full_causal_all_rows": "SDPA, flash backend only (K/V repeated to every head)",
                  "sdpa_dense_mask_selected_rows": "SDPA, torch's choice of backend for a boolean mask"},
        params={"dtype": str(dtype).replace("torch.", ""), "target": "speedup >= 5x over sdpa_full_causal_all_rows"},
    )


def _decode(device, size, rnd):
    import ragattn

    batch, ctx, heads, kv_heads, head_dim, dtype, page_size = _decode_shape(device, size)
    k, v, bt, q, q_pos, cu, kv_lens = _decode_batch(batch, ctx, heads, kv_heads, head_dim, dtype, page_size, device,
                                                    rnd)
    kv_bytes = 2.0 * batch * ctx * kv_heads * head_dim * k.element_size()

    # baseline: SDPA over the same K/V stored contiguously [B, kv_heads, ctx, D], GQA by the op
    kc = k[bt.long()].reshape(batch, -1, kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()
    vc = v[bt.long()].reshape(batch, -1, kv_heads, head_dim)[:, :ctx].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)  # [B, H, 1, D]

    def sdpa_decode():
        return torch.nn.functional.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True)

    # the engine path: one plan per step (here: once), the run per layer; the one-call op plans
    # (and reads the lengths back to the host) on every call
    plan = ragattn.plan_paged_attention(cu, ragattn.PageTable.from_block_table(bt, kv_lens), num_heads=heads,
                                        num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    return Case(
        family="paged_attention",
        name=f"decode_b{batch}_ctx{ctx}_h{heads}_kv{kv_heads}_d{head_dim}_p{page_size}",
        run=lambda: ragattn.run_paged_attention(plan, q, q_pos, k, v),
        config=lambda: _plan_config(plan),
        baselines={"sdpa_contiguous_gqa": sdpa_decode,
                   "ragattn_one_call": lambda: ragattn.paged_attention(q, q_pos, cu, k, v, bt, kv_lens)},
        backends={"sdpa_contiguous_gqa": "SDPA, torch's choice of backend, enable_gqa=True",
                  "ragattn_one_call": "plan + run in one call (host read of the lengths)"},
        bytes=kv_bytes,
        flops=4.0 * head_dim * heads * batch * ctx,
        peak="copy",
        params={"dtype": str(dtype).replace("torch.", ""), "target": ">= 80% of copy peak on KV bytes"},
    )


def _decode_tagged(device, size, rnd):
    """Decode on a zero-copy request's table: every page an entry with its first
    position (``PageTable.from_entries``), keys stored page-local and moved to their positions in
    the kernel.
    Baseline: the same decode over keys rotated beforehand (the copy path's cache)."""
    import ragattn

    batch, ctx, heads, kv_heads, head_dim, dtype, page_size = _decode_shape(device, size)
    k, v, bt, q, q_pos, cu, kv_lens = _decode_batch(batch, ctx, heads, kv_heads, head_dim, dtype, page_size, device,
                                                    rnd)
    pages_per_seq = bt.shape[1]
    indptr = torch.arange(0, (batch + 1) * pages_per_seq, pages_per_seq, dtype=I32, device=device)
    first = (torch.arange(pages_per_seq, dtype=I32, device=device) * page_size).repeat(batch)
    valid = torch.full_like(first, page_size)
    valid.view(batch, pages_per_seq)[:, -1] = ctx - (pages_per_seq - 1) * page_size
    table = ragattn.PageTable.from_entries(indptr, bt.reshape(-1), first, valid, page_size)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))).to(device)
    plan = ragattn.plan_paged_attention(cu, table, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                        dtype=dtype)
    plain = ragattn.plan_paged_attention(cu, ragattn.PageTable.from_block_table(bt, kv_lens), num_heads=heads,
                                         num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    return Case(
        family="paged_attention",
        name=f"decode_tagged_rope_b{batch}_ctx{ctx}_h{heads}_kv{kv_heads}_d{head_dim}_p{page_size}",
        run=lambda: ragattn.run_paged_attention(plan, q, q_pos, k, v, inv_freq=inv_freq),
        config=lambda: _plan_config(plan),
        baselines={"ragattn_keys_rotated_beforehand": lambda: ragattn.run_paged_attention(plain, q, q_pos, k, v)},
        bytes=2.0 * batch * ctx * kv_heads * head_dim * k.element_size(),
        flops=4.0 * head_dim * heads * batch * ctx,
        peak="copy",
        params={"dtype": str(dtype).replace("torch.", ""), "target": "within a few % of the keys-rotated decode"},
    )


def _decode_window(device, size, rnd):
    import ragattn

    if size == "gpu":
        batch, ctx, window, heads, kv_heads, head_dim, dtype, page_size = 32, 32768, 4096, 32, 8, 128, torch.bfloat16, 16
    else:
        batch, ctx, window, heads, kv_heads, head_dim, dtype, page_size = 3, 200, 32, 4, 2, 64, small_dtype(device), 16
    k, v, bt, q, q_pos, cu, kv_lens = _decode_batch(batch, ctx, heads, kv_heads, head_dim, dtype, page_size, device,
                                                    rnd)
    kv_bytes = 2.0 * batch * window * kv_heads * head_dim * k.element_size()  # only the window is read

    # baseline: SDPA over the window's slots stored contiguously [B, kv_heads, window, D]
    kc = k[bt.long()].reshape(batch, -1, kv_heads, head_dim)[:, ctx - window: ctx].transpose(1, 2).contiguous()
    vc = v[bt.long()].reshape(batch, -1, kv_heads, head_dim)[:, ctx - window: ctx].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)

    plan = ragattn.plan_paged_attention(cu, ragattn.PageTable.from_block_table(bt, kv_lens), num_heads=heads,
                                        num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, window_left=window - 1)
    return Case(
        family="paged_attention",
        name=f"decode_window{window}_b{batch}_ctx{ctx}_h{heads}_kv{kv_heads}_d{head_dim}_p{page_size}",
        run=lambda: ragattn.run_paged_attention(plan, q, q_pos, k, v),
        config=lambda: _plan_config(plan),
        baselines={"sdpa_contiguous_window_gqa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q4, kc, vc, enable_gqa=True),
                   "ragattn_one_call": lambda: ragattn.paged_attention(q, q_pos, cu, k, v, bt, kv_lens, None, window - 1)},
        backends={"sdpa_contiguous_window_gqa": "SDPA, torch's choice of backend, enable_gqa=True, window's slots only"},
        bytes=kv_bytes,
        flops=4.0 * head_dim * heads * batch * window,
        peak="copy",
        params={"dtype": str(dtype).replace("torch.", ""), "window_left": window - 1,
                "target": "time proportional to the window, not the context"},
    )


def _merge(device, size, rnd):
    import ragattn
    from ragattn.reference.merge_attention_states import merge_attention_states as ref_merge

    if size == "gpu":
        rows, heads, head_dim, dtype = 32 * 128, 32, 128, torch.bfloat16
    else:
        rows, heads, head_dim, dtype = 64, 4, 64, small_dtype(device)
    out_a = rnd.randn(rows, heads, head_dim, dtype=dtype)
    out_b = rnd.randn(rows, heads, head_dim, dtype=dtype)
    lse_a = rnd.randn(rows, heads)
    lse_b = rnd.randn(rows, heads)
    nbytes = 3.0 * rows * heads * (head_dim * out_a.element_size() + 4)
    return Case(
        family="merge_attention_states",
        name=f"n{rows}_h{heads}_d{head_dim}",
        run=lambda: ragattn.merge_attention_states(out_a, lse_a, out_b, lse_b),
        baselines={"torch_eager": lambda: ref_merge(out_a, lse_a, out_b, lse_b)},
        bytes=nbytes,
        peak="copy",
        params={"dtype": str(dtype).replace("torch.", "")},
    )


def _merge_n(device, size, rnd):
    """merge_attention_states_n over S = 4 cascade levels vs a chain of pairwise merges."""
    import ragattn
    from ragattn.reference.merge_attention_states import merge_attention_states_n as ref_merge_n

    if size == "gpu":
        rows, heads, head_dim, dtype = 32 * 128, 32, 128, torch.bfloat16
    else:
        rows, heads, head_dim, dtype = 64, 4, 64, small_dtype(device)
    S = 4
    outs = rnd.randn(S, rows, heads, head_dim, dtype=dtype)
    lses = rnd.randn(S, rows, heads)

    def pairwise():
        o, l = outs[0], lses[0]
        for i in range(1, S):
            o, l = ragattn.merge_attention_states(o, l, outs[i], lses[i])
        return o, l

    return Case(
        family="merge_attention_states",
        name=f"n-way S{S} n{rows}_h{heads}_d{head_dim}",
        run=lambda: ragattn.merge_attention_states_n(outs, lses),
        baselines={"pairwise_merges": pairwise, "torch_eager": lambda: ref_merge_n(outs, lses)},
        bytes=(S + 1.0) * rows * heads * (head_dim * outs.element_size() + 4),
        peak="copy",
        params={"dtype": str(dtype).replace("torch.", ""), "states": S},
    )


def cases(device: torch.device, size: str):
    """The cases, not built yet: each builds its inputs (on the device, from its own seed) only
    when the runner measures it."""
    builders = [("paged_attention", "sparse_prefill", _sparse_prefill), ("paged_attention", "decode_b", _decode),
                ("paged_attention", "decode_window", _decode_window),
                ("paged_attention", "decode_tagged_rope", _decode_tagged),
                ("merge_attention_states", "n", _merge), ("merge_attention_states", "n-way", _merge_n)]
    return [lazy(family, key, build, device, size, Rand(device, seed))
            for seed, (family, key, build) in enumerate(builders)]
