"""Plain-torch reference of ``merge_attention_states`` (exact, float64-capable)."""
from __future__ import annotations

from typing import Tuple

import torch


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets.

    out_a, out_b [N, H, D] (same dtype); lse_a, lse_b [N, H] (natural log). Returns
    out [N, H, D] in out_a's dtype and lse = logaddexp(lse_a, lse_b) [N, H] (float32, or
    float64 for float64 inputs). The edge rule of ``ragattn.merge_attention_states``: an lse of
    -inf or +inf (FlashAttention's empty-row marker) contributes nothing and its out is never
    read; both empty gives out 0, lse -inf; a NaN lse makes the (row, head) NaN; a side that is
    read passes its non-finite values on as NaN.
    """
    cdt = torch.float64 if torch.float64 in (out_a.dtype, lse_a.dtype) else torch.float32
    neg_inf = torch.tensor(float("-inf"), dtype=cdt, device=out_a.device)
    la = torch.where(lse_a == float("inf"), neg_inf, lse_a.to(cdt))
    lb = torch.where(lse_b == float("inf"), neg_inf, lse_b.to(cdt))
    bad = torch.isnan(la) | torch.isnan(lb)
    lse = torch.logaddexp(la, lb)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    zero = torch.zeros((), dtype=cdt, device=out_a.device)
    read_a, read_b = (la > float("-inf"))[..., None], (lb > float("-inf"))[..., None]
    oa = torch.where(read_a, out_a.to(cdt) * torch.exp(la - safe)[..., None], zero)
    ob = torch.where(read_b, out_b.to(cdt) * torch.exp(lb - safe)[..., None], zero)
    out = oa + ob
    out = torch.where(torch.isfinite(out) & ~bad[..., None], out, torch.full_like(out, float("nan")))
    lse = torch.where(bad, torch.full_like(lse, float("nan")), lse)
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
    return out.to(out_a.dtype).contiguous(), lse.to(lse_dtype).contiguous()
