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
    "scaled_logits",
    "softmax_or_zero",
    "target_probs",
    "modified_target_probs",
    "residual_weights",
    "first_token_distribution",
    "final_token_weights",
]


def scaled_logits(target_logits: torch.Tensor, temperature: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``y = (z - max z) / T`` over the last dim in ``dtype``, with the op's rule for non-finite logits:
    NaN counts as ``-inf`` (probability 0); where a row has ``+inf`` logits they share the mass
    (``y = 0`` there, ``-inf`` elsewhere); a row of only ``-inf``/NaN stays all ``-inf``."""
    z = target_logits.to(dtype)
    z = torch.where(torch.isnan(z), torch.full_like(z, float("-inf")), z)
    posinf = z == float("inf")
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    y = (z - m) / temperature
    inf_rows = posinf.any(dim=-1, keepdim=True)
    return torch.where(inf_rows, torch.where(posinf, torch.zeros_like(z), torch.full_like(z, float("-inf"))), y)


def softmax_or_zero(y: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim; a row of only ``-inf`` gives all zeros (no mass) instead of NaN."""
    m = y.amax(dim=-1, keepdim=True)
    e = torch.exp(y - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    s = e.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, e / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(e))


def target_probs(target_logits: torch.Tensor, temperature: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``p = softmax(z / T)`` over the last dim, in ``dtype`` (``[..., V]`` -> ``[..., V]``), with the
    non-finite rule of :func:`scaled_logits`."""
    return softmax_or_zero(scaled_logits(target_logits, temperature, dtype))


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
    q = draft_probs.to(dtype)
    y = scaled_logits(target_logits, temperature, dtype)
    p = softmax_or_zero(y)
    if eta == 0:
        return p
    mask = q >= alpha * q.amax(dim=-1, keepdim=True)
    shift = torch.where(mask, eta * (q - p), torch.zeros_like(q))
    return softmax_or_zero(y + shift)


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
    draft_probs: Optional[torch.Tensor],
    target_logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float = 1.0,
    eta: float = 0.0,
    alpha: float = 0.1,
    greedy: bool = False,
    num_draft: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float64,
    cu_num_draft: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``ragattn.verify_draft`` (same arguments; see its docstring), computed in ``dtype``.

    Padded layout: ``draft_tokens [B, g]`` int64, ``draft_probs [B, g, V]`` or None (one-hot on the
    drafts), ``target_logits [B, g + 1, V]``, ``uniforms [B, g + 1]``, ``num_draft [B]`` or None;
    returns ``out_tokens`` int64 ``[B, g + 1]`` (-1 after the emitted ones) and ``num_accepted``
    int32 ``[B]``. Flat layout (``cu_num_draft [B + 1]``): ``draft_tokens [T]``, ``draft_probs [T, V]``,
    ``target_logits [T + B, V]``, ``uniforms [T + B]``, ``out_tokens [T + B]`` (request ``b`` owns
    rows ``cu[b] + b .. cu[b + 1] + b``); computed by padding to the longest chain.
    """
    if cu_num_draft is not None:
        return _verify_flat(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, greedy,
                            cu_num_draft, dtype)
    bsz, g = draft_tokens.shape
    dev = target_logits.device
    nd = torch.full((bsz,), g, dtype=torch.int64, device=dev) if num_draft is None else num_draft.to(torch.int64)
    pos = torch.arange(g, device=dev)
    valid = pos[None, :] < nd[:, None]  # [B, g]
    rows = torch.arange(bsz, device=dev)
    x = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens))
    if draft_probs is None:  # one-hot drafts (n-gram drafters): q(x) = 1
        draft_probs = torch.nn.functional.one_hot(x, target_logits.shape[-1]).to(dtype)

    p = target_probs(target_logits, temperature, dtype)  # [B, g+1, V]
    q = draft_probs.to(dtype)
    p_hat = modified_target_probs(target_logits[:, :g], q, temperature, eta, alpha, dtype)  # [B, g, V]

    if greedy:
        if g > 0:
            best = p_hat.argmax(dim=-1)
            ok = (draft_tokens == best) & (p_hat.gather(-1, best.unsqueeze(-1)).squeeze(-1) > 0) & valid
        else:
            ok = valid
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


def _verify_flat(draft_tokens, draft_probs, target_logits, uniforms, temperature, eta, alpha, greedy, cu_num_draft,
                 dtype):
    """The flat layout through the padded one: gather each request's rows into [B, g_max (+1)]."""
    cu = cu_num_draft.to(torch.int64)
    bsz = cu.numel() - 1
    dev = target_logits.device
    nd = cu[1:] - cu[:-1]
    g = int(nd.max()) if bsz > 0 else 0
    j = torch.arange(g + 1, device=dev)[None, :]
    row = (cu[:-1] + torch.arange(bsz, device=dev))[:, None] + j  # [B, g + 1] rows of logits / uniforms / out
    live = j <= nd[:, None]  # the request's g_b + 1 rows
    row_c = torch.where(live, row, torch.zeros_like(row))
    tok = (cu[:-1, None] + j[:, :g]).clamp(max=max(draft_tokens.numel() - 1, 0))
    x = draft_tokens[tok] if draft_tokens.numel() else torch.zeros(bsz, g, dtype=torch.int64, device=dev)
    x = torch.where(j[:, :g] < nd[:, None], x, torch.zeros_like(x))
    q = draft_probs[tok] if draft_probs is not None and draft_tokens.numel() else None
    if draft_probs is not None and q is None:
        q = torch.zeros(bsz, g, target_logits.shape[-1], dtype=draft_probs.dtype, device=dev)
    z = target_logits[row_c] if target_logits.shape[0] else target_logits.new_zeros(bsz, g + 1, target_logits.shape[-1])
    u = torch.where(live, uniforms[row_c], torch.zeros_like(row_c, dtype=uniforms.dtype)) if uniforms.numel() else \
        torch.zeros(bsz, g + 1, dtype=uniforms.dtype, device=dev)
    # the padded op takes the final draw from column g: move each request's last uniform there
    u[:, g] = u.gather(1, nd[:, None])[:, 0]
    out_p, n = verify_draft(x, q, z, u, temperature, eta, alpha, greedy, nd, dtype)
    out = torch.full((target_logits.shape[0],), -1, dtype=torch.int64, device=dev)
    out[row[live]] = out_p[live]
    return out, n
