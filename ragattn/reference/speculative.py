"""Plain-torch reference of ``verify_draft`` (chain speculative verification) and the closed-form
output distributions the tests check it against.

The rule is the one of RAPID's code (``src/utils.py::_speculative_sampling``, notes-rapid.md
§2.5-§2.7), vectorised over the batch and with the guards the code lacks:

* ``p = softmax(z / T)`` per position, computed as ``softmax((z - max z) / T)`` so that a tiny
  temperature never overflows (the limit is the uniform distribution over the argmax ties);
* ``p_hat = softmax(z / T + eta * mask * (q - p))`` with ``mask = q >= alpha * max(q)``
  (``p_hat = p`` when ``eta == 0``);
* draft ``j`` is accepted iff ``q(x_j) > 0`` and ``u_j * q(x_j) < p_hat(x_j)`` (the division-free,
  strict form of ``u_j <= min(1, p_hat / q)``: a token the draft gave probability 0 is rejected, a
  token the target gives probability 0 is never accepted, the probability of acceptance is the
  same ``min(1, p_hat / q)`` for ``u ~ U[0, 1)``);
* ``n`` = the leading run of accepts (at most ``num_draft``); at the first rejection the final
  token is drawn from ``norm(max(p - min(q, p_hat), 0))`` (``p`` when that is all zero); when every
  draft is accepted the bonus token is drawn from ``p`` at position ``num_draft``;
* the final draw is the inverse CDF at ``uniforms[:, g]``: the first token ``v`` with weight > 0
  and ``cumsum(w)[v] > u * sum(w)``;
* greedy: accept while ``x_j == argmax p_hat_j`` (first index on ties), emit that argmax at the
  first mismatch, ``argmax p`` as the bonus.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = [
    "verify_draft",
    "target_probs",
    "modified_target_probs",
    "residual_weights",
    "first_token_distribution",
    "final_token_weights",
]


def target_probs(target_logits: torch.Tensor, temperature: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``p = softmax(z / T)`` over the last dim, in ``dtype`` (``[..., V]`` -> ``[..., V]``)."""
    z = target_logits.to(dtype)
    m = z.amax(dim=-1, keepdim=True)
    return torch.softmax((z - m) / temperature, dim=-1)


def modified_target_probs(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    temperature: float,
    eta: float,
    alpha: float,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """RAPID's retrieval-augmented target ``p_hat`` (code variant, notes-rapid.md §2.5).

    ``target_logits`` and ``draft_probs`` are ``[..., V]`` (same leading dims);
    ``p_hat = softmax(z / T + eta * mask * (q - p))``, ``mask = q >= alpha * max(q)``.
    """
    z = target_logits.to(dtype)
    q = draft_probs.to(dtype)
    y = (z - z.amax(dim=-1, keepdim=True)) / temperature
    p = torch.softmax(y, dim=-1)
    if eta == 0:
        return p
    mask = q >= alpha * q.amax(dim=-1, keepdim=True)
    shift = torch.where(mask, eta * (q - p), torch.zeros_like(q))
    return torch.softmax(y + shift, dim=-1)


def residual_weights(p: torch.Tensor, q: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual ``max(p - min(q, p_hat), 0)`` (``[..., V]``)."""
    return torch.clamp(p - torch.minimum(q, p_hat), min=0)


def _normalise_or_p(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    total = w.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, w / torch.where(total > 0, total, torch.ones_like(total)), p)


def first_token_distribution(p: torch.Tensor, q: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
    """Distribution of the token emitted at a drafted position when the draft ``x ~ q``.

    ``P_out = min(q, p_hat) + (1 - beta) * norm(max(p - min(q, p_hat), 0))`` with
    ``beta = sum(min(q, p_hat))`` (notes-rapid.md §2.6); the residual falls back to ``p`` when it
    is all zero. ``eta == 0`` (``p_hat == p``) gives exactly ``p``. All ``[..., V]``.
    """
    accepted = torch.minimum(q, p_hat)
    beta = accepted.sum(dim=-1, keepdim=True)
    return accepted + (1 - beta) * _normalise_or_p(residual_weights(p, q, p_hat), p)


def final_token_weights(p: torch.Tensor, q: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
    """Normalised distribution the final token is drawn from after a rejection (``[..., V]``)."""
    return _normalise_or_p(residual_weights(p, q, p_hat), p)


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``w [N, V]`` (non-negative, some > 0): first ``v`` with ``w[v] > 0`` and
    ``cumsum(w)[v] > u * sum(w)``; the last positive ``v`` if rounding leaves none."""
    cdf = torch.cumsum(w, dim=-1)
    target = (u.to(w.dtype) * cdf[:, -1]).unsqueeze(-1)
    hit = (cdf > target) & (w > 0)
    v = w.shape[-1]
    idx = torch.arange(v, device=w.device)
    first = torch.where(hit, idx, v).amin(dim=-1)
    last_pos = torch.where(w > 0, idx, -1).amax(dim=-1)
    return torch.where(first < v, first, last_pos.clamp(min=0))


def verify_draft(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float = 1.0,
    eta: float = 0.0,
    alpha: float = 0.1,
    greedy: bool = False,
    num_draft: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``ragattn.verify_draft`` (same arguments; see its docstring), computed in ``dtype``.

    Shapes: ``draft_tokens [B, g]`` int64, ``draft_probs [B, g, V]``, ``target_logits [B, g + 1, V]``,
    ``uniforms [B, g + 1]``, ``num_draft [B]`` or None. Returns ``out_tokens`` int64 ``[B, g + 1]``
    (-1 after the emitted ones) and ``num_accepted`` int32 ``[B]``.
    """
    bsz, g = draft_tokens.shape
    dev = target_logits.device
    nd = torch.full((bsz,), g, dtype=torch.int64, device=dev) if num_draft is None else num_draft.to(torch.int64)
    pos = torch.arange(g, device=dev)
    valid = pos[None, :] < nd[:, None]  # [B, g]
    rows = torch.arange(bsz, device=dev)

    p = target_probs(target_logits, temperature, dtype)  # [B, g+1, V]
    q = draft_probs.to(dtype)
    p_hat = modified_target_probs(target_logits[:, :g], q, temperature, eta, alpha, dtype)  # [B, g, V]
    x = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens))

    if greedy:
        ok = (draft_tokens == p_hat.argmax(dim=-1)) & valid if g > 0 else valid
    else:
        q_x = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        ph_x = p_hat.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        ok = (q_x > 0) & (uniforms[:, :g].to(dtype) * q_x < ph_x) & valid
    n = (torch.cumsum((~ok).to(torch.int64), dim=-1) == 0).sum(dim=-1) if g > 0 else nd.clone()
    rejected = n < nd

    # Distribution of the final token: residual at n after a rejection, p at n = num_draft otherwise.
    p_n = p[rows, n]  # [B, V]
    if greedy:
        ph_n = p_hat[rows, n.clamp(max=max(g - 1, 0))] if g > 0 else p_n
        final = torch.where(rejected, ph_n.argmax(dim=-1), p_n.argmax(dim=-1))
    else:
        if g > 0:
            nq = n.clamp(max=g - 1)
            w_rej = residual_weights(p_n, q[rows, nq], p_hat[rows, nq])
            w_rej = torch.where(w_rej.sum(dim=-1, keepdim=True) > 0, w_rej, p_n)
            w = torch.where(rejected[:, None], w_rej, p_n)
        else:
            w = p_n
        final = _inverse_cdf(w, uniforms[:, g])

    out = torch.where(pos[None, :] < n[:, None], draft_tokens, torch.full_like(draft_tokens, -1))
    out = torch.cat([out, torch.full((bsz, 1), -1, dtype=torch.int64, device=dev)], dim=1)
    out[rows, n] = final.to(torch.int64)
    return out, n.to(torch.int32)
