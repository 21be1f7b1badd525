"""Plain-torch reference of ``merge_attention_states`` and its N-way form (exact, float64-capable)."""
from __future__ import annotations

import math
from typing import Tuple

import torch

LN2 = math.log(2.0)


def merge_attention_states_n(outs: torch.Tensor, lses: torch.Tensor, log2: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial attentions of the same queries over disjoint key sets.

    outs ``[S, N, H, D]`` (one dtype); lses ``[S, N, H]``, natural log (base 2 with ``log2``).
    Returns out ``[N, H, D]`` in outs' dtype and lse ``[N, H]`` = logsumexp over S in the same base
    (float32, or float64 for float64 inputs). The edge rule of ``ragattn.merge_attention_states``:
    an lse of -inf or +inf (FlashAttention's empty-row marker) contributes nothing and its out is
    never read; every side empty gives out 0, lse -inf; a NaN lse makes the (row, head) NaN; a
    side that is read passes its non-finite values on as NaN.
    """
    cdt = torch.float64 if torch.float64 in (outs.dtype, lses.dtype) else torch.float32
    neg_inf = torch.tensor(float("-inf"), dtype=cdt, device=outs.device)
    ls = torch.where(lses == float("inf"), neg_inf, lses.to(cdt))
    if log2:
        ls = ls * LN2
    bad = torch.isnan(ls).any(dim=0)
    lse = torch.logsumexp(torch.where(torch.isnan(ls), neg_inf, ls), dim=0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    zero = torch.zeros((), dtype=cdt, device=outs.device)
    read = (ls > float("-inf"))[..., None]
    out = torch.where(read, outs.to(cdt) * torch.exp(ls - safe)[..., None], zero).sum(dim=0)
    out = torch.where(torch.isfinite(out) & ~bad[..., None], out, torch.full_like(out, float("nan")))
    lse = torch.where(bad, torch.full_like(lse, float("nan")), lse)
    if log2:
        lse = lse / LN2
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
    return out.to(outs.dtype).contiguous(), lse.to(lse_dtype).contiguous()


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, log2: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets.

    out_a, out_b [N, H, D] (same dtype); lse_a, lse_b [N, H] (natural log; base 2 with ``log2``,
    FlashInfer's convention, the returned lse then base 2 too). Returns out [N, H, D] in out_a's
    dtype and lse = logaddexp(lse_a, lse_b) [N, H] (float32, or float64 for float64 inputs), with
    the edge rule of :func:`merge_attention_states_n`.
    """
    return merge_attention_states_n(torch.stack((out_a, out_b)), torch.stack((lse_a, lse_b)), log2)


__all__ = ["merge_attention_states", "merge_attention_states_n"]
