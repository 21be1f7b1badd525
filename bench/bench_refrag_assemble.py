"""Benchmark of ``refrag_assemble``: REFRAG's decoder input, token embeddings and
projected chunk embeddings interleaved in one pass.

gpu: LLaMA-2-7B shape (V 32000, d 4096, bf16), 16 rows of a 64-token question + 2048 context
tokens at k = 16 with 10 % of the chunks expanded (notes §2.11): ~6K output slots.
cpu: SmolLM2 shape (V 49152, d 576, fp32), 2 rows of 32 + 512 tokens, k = 16, 10 % expanded.
Baseline ``python_cat``: the per-segment Python loop + ``torch.cat`` of community
reimplementations. ``bytes``: every output row written once and read once from its source.
"""
from __future__ import annotations

import torch

from .harness import Case, lazy, small_dtype

FAMILIES = ("refrag_assemble",)


def cases(device: torch.device, size: str):
    """The cases, not built yet (they share one set of inputs, made when measured)."""
    return [lazy("refrag_assemble", "", _build, device, size)]


def _build(device: torch.device, size: str):
    import ragattn
    from ragattn.methods.refrag import RefragExample, build_layout, chunk_context

    if size == "gpu":
        vocab, d, dtype, rows, q_len, ctx_len = 32000, 4096, torch.bfloat16, 16, 64, 2048
    else:
        vocab, d, dtype, rows, q_len, ctx_len = 49152, 576, small_dtype(device), 2, 32, 512
    k = 16
    gen = torch.Generator().manual_seed(0)
    examples, masks = [], []
    for _ in range(rows):
        ctx = chunk_context([torch.randint(0, vocab, (ctx_len,), generator=gen)], k)
        examples.append(RefragExample(ctx, prompt=torch.randint(0, vocab, (q_len,), generator=gen)))
        masks.append(torch.rand(ctx.num_chunks, generator=gen) < 0.1)
    lay = build_layout(examples, masks)
    w = torch.randn(vocab, d, generator=gen).to(device=device, dtype=dtype)
    chunks = torch.randn(len(lay.compressed), d, generator=gen).to(device=device, dtype=dtype)
    ids, src = lay.token_ids.to(device), lay.slot_src.to(device)
    src_list = lay.slot_src.tolist()

    def python_cat():
        # one torch.cat over runs of token slots and single chunk rows, as a Python loop would build it
        parts, run = [], []
        for s in src_list:
            if s >= 0:
                run.append(s)
                continue
            if run:
                parts.append(w[ids[run[0]:run[-1] + 1]])
                run = []
            parts.append(chunks[-s - 1:-s])
        if run:
            parts.append(w[ids[run[0]:run[-1] + 1]])
        return torch.cat(parts)

    n = src.numel()
    return [Case(
        family="refrag_assemble",
        name=f"rows{rows}_q{q_len}_ctx{ctx_len}_k{k}_p0.1_V{vocab}_d{d}",
        run=lambda: ragattn.refrag_assemble(w, ids, chunks, src),
        baselines={"python_cat": python_cat},
        bytes=2.0 * n * d * w.element_size(),
        peak="copy",
        params={"dtype": str(dtype).replace("torch.", ""), "slots": n, "chunks": len(lay.compressed)},
    )]
