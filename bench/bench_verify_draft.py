"""Benchmark of ``verify_draft``: chain speculative verification, standard (eta 0) and
RAPID's modified target (eta 10).

gpu: B in {1, 8, 64} x gamma in {4, 10} x V in {32000 (LLaMA-2), 128256 (LLaMA-3.1),
152064 (Qwen2.5)}, bf16 target logits, fp32 draft probs, T = 1. The drafts are sampled from a
draft distribution close to the target's, so that a realistic share of each chain is accepted
(``mean_accepted`` is reported in the params). ``bytes`` = the bytes the kernel must read and write,
counted from the call's own ``num_accepted``: every position's target-logits row (the CUDA kernel's
first phase covers all g + 1 positions of a row at once, rejected or not), the draft-probs rows it reads
(eta > 0: every drafted position's row, for max q and p_hat; eta = 0: only the rejected position's row,
for the residual, plus single entries at the draft tokens), each row counted once (with eta > 0 the
second pass re-reads logits and draft probs, up to 2x these bytes, and the draw re-reads the drawn
position's rows; the kernel's workspace, ~16 B per position and vocabulary slice, is not counted), plus
the small per-row tensors. Peak "copy".
Target on an H100: >= 80% of the copy bandwidth at B = 64, gamma = 10, V = 128256, and >= 10x
over the torch implementation.

Baselines, same inputs and rule:
* ``torch_batched``: ragattn.reference.speculative.verify_draft in fp32, the rule of RAPID's
  code vectorised over the batch (softmaxes over all positions, gathers, cumsum inverse CDF).
* ``torch_rapid_loop``: RAPID's ``_speculative_sampling`` as the authors run it, one row at a
  time with a host-side branch on the accepted count and ``torch.multinomial`` (batch-1 code).
"""
from __future__ import annotations

import torch

from .harness import Case, cpu_config, lazy

FAMILIES = ("verify_draft",)  # the Case.family values of this module (lets --only skip building it)


def _rapid_loop(x, q, z, temperature, eta, alpha):
    """RAPID's code path, row by row (host sync per row, as in the batch-1 original)."""
    g = x.shape[1]
    out = []
    for b in range(x.shape[0]):
        s_t = z[b].float() / temperature
        p = torch.softmax(s_t, dim=-1)
        qb = q[b]
        mask = qb >= alpha * qb.amax(dim=-1, keepdim=True)
        p_hat = torch.softmax(s_t[:g] - eta * torch.where(mask, p[:g] - qb, torch.zeros_like(qb)), dim=-1)
        ratio = p_hat.gather(-1, x[b, :, None])[:, 0] / qb.gather(-1, x[b, :, None])[:, 0]
        accepted = torch.rand(g, device=z.device) <= ratio
        n = int(((~accepted).cumsum(-1) < 1).sum())
        if n < g:
            w = torch.clamp(p[n] - torch.minimum(qb[n], p_hat[n]), min=0)
            w = w / w.sum()
        else:
            w = p[g]
        out.append(torch.multinomial(w, 1))
    return out


def _bytes_touched(num_accepted, g, vocab, logits_elem, eta):
    """Bytes one call reads and writes at least once (see the module docstring)."""
    n = num_accepted.long().cpu()
    logits_rows = n.numel() * (g + 1)
    rejected = n < g
    probs_rows = n.numel() * g if eta > 0 else int(rejected.sum())
    per_row = g * 8 + (g + 1) * 4 + (g + 1) * 8 + 4  # drafts, uniforms, out_tokens, num_accepted
    return float(logits_rows * vocab * logits_elem + probs_rows * vocab * 4 + n.numel() * per_row)


def _config(device, batch, g, vocab):
    """The CUDA launcher's grid (csrc/speculative: CTAs of 256 threads over every (position, vocabulary
    slice), mirrored by bench.sm90), or the CPU backend."""
    if device.type != "cuda":
        return cpu_config()
    from .sm90 import verify_draft_grid, verify_draft_slices

    grid = verify_draft_grid(batch, g, vocab)
    return {"kernel": "cuda", "threads": 256, "slices": verify_draft_slices(vocab), "grid": grid["stats"],
            "draw_grid": grid["draw"]}


def _inputs(bsz, g, vocab, device, gen):
    z = 3.0 * torch.randn(bsz, g + 1, vocab, generator=gen, device=device)
    # per-token acceptance sum(min(p, q)) ~ 0.8, RAPID's reported 75-85%
    q = torch.softmax(z[:, :g] + 0.5 * torch.randn(bsz, g, vocab, generator=gen, device=device), dim=-1)
    x = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(bsz, g)
    u = torch.rand(bsz, g + 1, generator=gen, device=device)
    return x, q.contiguous(), z.to(torch.bfloat16), u


def cases(device: torch.device, size: str):
    """One case per (batch, draft length, vocabulary, eta), not built yet; the target shape
    (B64 g10 V128256) first."""
    if size == "gpu":
        grid = [(64, 10, 128256)] + [(b, g, v) for v in (32000, 128256, 152064) for g in (4, 10) for b in (1, 8, 64)
                                     if (b, g, v) != (64, 10, 128256)]
    else:
        grid = [(1, 4, 2000), (4, 4, 2000)]
    return [lazy("verify_draft", f"B{b}_g{g}_V{v}_eta{eta:g}", _case, device, b, g, v, eta, seed)
            for seed, (b, g, v) in enumerate(grid) for eta in (0.0, 10.0)]


def _case(device, bsz, g, vocab, eta, seed):
    import ragattn
    from ragattn.reference.speculative import verify_draft as reference

    gen = torch.Generator(device=device).manual_seed(seed)
    x, q, z, u = _inputs(bsz, g, vocab, device, gen)
    _, n = ragattn.verify_draft(x, q, z, u, eta=eta)
    nbytes = _bytes_touched(n, g, vocab, z.element_size(), eta)
    return Case(
        family="verify_draft",
        name=f"B{bsz}_g{g}_V{vocab}_eta{eta:g}",
        run=lambda: ragattn.verify_draft(x, q, z, u, eta=eta),
        baselines={
            "torch_batched": lambda: reference(x, q, z, u, 1.0, eta, 0.1, False, None, torch.float32),
            "torch_rapid_loop": lambda: _rapid_loop(x, q, z, 1.0, eta, 0.1),
        },
        backends={"torch_batched": "ragattn.reference.verify_draft (batched torch ops, fp32)",
                  "torch_rapid_loop": "RAPID's reference loop in torch"},
        bytes=float(nbytes),
        peak="copy",
        config=lambda: _config(device, bsz, g, vocab),
        params={
            "logits": "bfloat16",
            "eta": eta,
            "mean_accepted": round(float(n.float().mean()), 2),
            "target": "B64 g10 V128256: <= 100 us at eta 0, <= 200 us at eta 10, >= 10x torch",
        },
    )
