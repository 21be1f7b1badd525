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
    float64 for float64 inputs). A side with lse -inf contributes nothing (its out is ignored,
    even if NaN); both -inf gives out 0, lse -inf.
    """
    cdt = torch.float64 if torch.float64 in (out_a.dtype, lse_a.dtype) else torch.float32
    la, lb = lse_a.to(cdt), lse_b.to(cdt)
    lse = torch.logaddexp(la, lb)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(la - safe)[..., None]
    wb = torch.exp(lb - safe)[..., None]
    oa = torch.where(wa > 0, out_a.to(cdt) * wa, torch.zeros((), dtype=cdt, device=out_a.device))
    ob = torch.where(wb > 0, out_b.to(cdt) * wb, torch.zeros((), dtype=cdt, device=out_a.device))
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
    return (oa + ob).to(out_a.dtype).contiguous(), lse.to(lse_dtype).contiguous()
