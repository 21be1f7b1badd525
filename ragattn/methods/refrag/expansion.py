"""REFRAG selective expansion beyond the base policies: heuristics, the learned policy, its RL math.

The policy hook, ``NoExpansion`` and ``RandomPolicy`` live in ``ragattn.methods.refrag.policy``
(``select(c, chunk_token_ids, n_expand) -> BoolTensor[L]``, exactly ``n_expand`` True). This module adds

- ``PerplexityPolicy(model, tokenizer, order)``: the paper's heuristic baselines (Fig. 3).
  Every context chunk's perplexity is measured by the decoder over the whole context (teacher
  forced, one forward); ``order="desc"`` expands the highest-perplexity chunks (the paper's
  "Perplexity-desc: compress low-perplexity chunks"), ``order="asc"`` the lowest.
- ``PolicyNetwork``: the paper's learned policy (notes §2.9), a two-layer transformer over the chunk
  embeddings ``c`` (pre-projection encoder outputs) giving one logit per chunk. Logits are scored
  once and not recomputed after each pick (as the paper does), so the paper's masked sequential
  sampling is exactly Plackett-Luce sampling without replacement, i.e. Gumbel-top-T'
  (``gumbel_top_k``); greedy decoding is plain top-T'.
- ``LearnedPolicy(net, mode)``: the network wrapped in the ``select`` hook (greedy at inference);
  ``save_policy`` / ``load_policy`` store it (hyper-parameters + weights, ~1 MB).
- ``selection_step_log_probs`` / ``selection_log_prob``: log-probability of an ordered selection,
  ``log pi(l_t | l_<t) = s_{l_t} - logsumexp_{j not in l_<t} s_j``, the per-step terms the PPO
  ratio of the GRPO objective needs.
- ``group_advantages`` / ``grpo_clip_loss``: the paper's Eq. 1 (GRPO group-normalised advantages,
  PPO-clip ratio per selection step, no KL term); ``ragattn.methods.refrag.train`` runs the loop.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def _check_n_expand(n_expand: int, n_chunks: int, who: str) -> int:
    if isinstance(n_expand, bool) or not isinstance(n_expand, int):
        raise TypeError(f"{who}: n_expand must be an int, got {type(n_expand).__name__}")
    if not 0 <= n_expand <= n_chunks:
        raise ValueError(f"{who}: n_expand={n_expand} must be in [0, {n_chunks}] (the number of chunks)")
    return n_expand


def _check_logits(logits: torch.Tensor, valid: Optional[torch.Tensor], who: str) -> torch.Tensor:
    """Returns the logits with invalid (padding) chunks at -inf; validates shapes and values."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"{who}: logits must be a float tensor [..., L]")
    if not torch.isfinite(logits).all():
        raise ValueError(f"{who}: logits must be finite (mark padding chunks with `valid`, not -inf)")
    if valid is None:
        return logits
    if valid.shape != logits.shape or valid.dtype != torch.bool:
        raise ValueError(f"{who}: valid must be a bool tensor of the logits' shape {tuple(logits.shape)}, "
                         f"got {valid.dtype} {tuple(valid.shape)}")
    return logits.masked_fill(~valid, float("-inf"))


def gumbel_top_k(logits: torch.Tensor, n: int, valid: Optional[torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Samples ``n`` distinct chunks per row, in pick order, from the pointer policy.

    logits: float [..., L] (fixed scores s); valid: optional bool [..., L] (False = padding chunk,
    never picked; every row needs at least ``n`` valid chunks). Returns int64 [..., n]: the ordered
    selection. Adding i.i.d. Gumbel(0, 1) noise to s and taking the top-n in descending order draws
    exactly from the sequential masked softmax ``pi(l_t = i) = softmax(s - inf * [i in l_<t])``.
    """
    x = _check_logits(logits, valid, "gumbel_top_k")
    n = _check_n_expand(n, x.shape[-1], "gumbel_top_k")
    if valid is not None and bool((valid.sum(-1) < n).any()):
        raise ValueError(f"gumbel_top_k: a row has fewer than n={n} valid chunks")
    u = torch.rand(x.shape, generator=generator, dtype=torch.float64, device=x.device)
    # -log(-log u) with u in (0, 1): clamp away from 0 so no row gets an infinite key
    g = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float64).tiny)))
    return torch.topk(x.double() + g, n, dim=-1).indices


def greedy_top_k(logits: torch.Tensor, n: int, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``n`` highest-scoring valid chunks per row, in descending order: int64 [..., n]."""
    x = _check_logits(logits, valid, "greedy_top_k")
    n = _check_n_expand(n, x.shape[-1], "greedy_top_k")
    if valid is not None and bool((valid.sum(-1) < n).any()):
        raise ValueError(f"greedy_top_k: a row has fewer than n={n} valid chunks")
    return torch.topk(x, n, dim=-1).indices


def selection_step_log_probs(logits: torch.Tensor, order: torch.Tensor,
                             valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-step log-probabilities of an ordered selection under the masked pointer policy.

    logits: float [..., L]; order: int64 [..., T'] (distinct indices per row); valid: optional bool
    [..., L]. Returns float [..., T'] with entry t = ``s[l_t] - logsumexp_{j valid, j not in l_<t} s_j``
    (differentiable in ``logits``).
    """
    x = _check_logits(logits, valid, "selection_step_log_probs")
    if order.dtype != torch.int64 or order.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"selection_step_log_probs: order must be int64 [..., T'] with batch shape "
                         f"{tuple(x.shape[:-1])}, got {order.dtype} {tuple(order.shape)}")
    L, T = x.shape[-1], order.shape[-1]
    if T == 0:
        return x.new_zeros(order.shape)
    if bool(((order < 0) | (order >= L)).any()):
        raise ValueError(f"selection_step_log_probs: order has an index outside [0, {L})")
    picked = F.one_hot(order, L).bool()                     # [..., T', L]
    if bool((picked.sum(-2) > 1).any()):
        raise ValueError("selection_step_log_probs: order repeats a chunk")
    chosen = x.gather(-1, order)                            # [..., T']
    if valid is not None and bool(torch.isinf(chosen).any()):
        raise ValueError("selection_step_log_probs: order picks a padding chunk (valid=False)")
    before = picked.cumsum(-2) - picked.long()              # chunks picked at steps < t
    masked = x.unsqueeze(-2).expand(picked.shape).masked_fill(before.bool(), float("-inf"))
    return chosen - torch.logsumexp(masked, dim=-1)


def selection_log_prob(logits: torch.Tensor, order: torch.Tensor,
                       valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Log-probability of the whole ordered selection: float [...] (sum of the step terms)."""
    return selection_step_log_probs(logits, order, valid).sum(-1)


class PolicyNetwork(nn.Module):
    """The paper's expansion policy g_theta: a 2-layer transformer over chunk embeddings.

    c: float [L, d_enc] or [B, L, d_enc] (the encoder's chunk vectors, before the projector);
    valid: optional bool [B, L] key-padding mask (False = padding). Returns float32 logits [L] or
    [B, L], one per chunk. Chunk order enters through a learned position embedding (the paper does
    not say whether its policy sees positions; the chunk nearest the continuation matters, so it
    does here). The query is not an input, as in the paper.
    """

    def __init__(self, d_enc: int, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
                 max_chunks: int = 1024):
        super().__init__()
        if d_enc <= 0 or d_model <= 0 or d_model % n_heads:
            raise ValueError(f"PolicyNetwork: need d_enc > 0 and d_model ({d_model}) divisible by "
                             f"n_heads ({n_heads})")
        self.d_enc, self.max_chunks = d_enc, max_chunks
        self.hparams = dict(d_enc=d_enc, d_model=d_model, n_layers=n_layers, n_heads=n_heads, max_chunks=max_chunks)
        self.inp = nn.Linear(d_enc, d_model)
        self.pos = nn.Embedding(max_chunks, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 1)

    def forward(self, c: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        squeeze = c.dim() == 2
        if squeeze:
            c = c.unsqueeze(0)
            valid = None if valid is None else valid.unsqueeze(0)
        if c.dim() != 3 or c.shape[-1] != self.d_enc:
            raise ValueError(f"PolicyNetwork: c must be [L, {self.d_enc}] or [B, L, {self.d_enc}], "
                             f"got {tuple(c.shape)}")
        B, L, _ = c.shape
        if L == 0:
            raise ValueError("PolicyNetwork: c has no chunks (empty context)")
        if L > self.max_chunks:
            raise ValueError(f"PolicyNetwork: {L} chunks exceed max_chunks={self.max_chunks}")
        if valid is not None and (valid.shape != (B, L) or valid.dtype != torch.bool):
            raise ValueError(f"PolicyNetwork: valid must be bool [{B}, {L}], got {valid.dtype} "
                             f"{tuple(valid.shape)}")
        p = next(self.parameters())
        h = self.inp(c.to(p.dtype)) + self.pos.weight[:L]
        h = self.body(h, src_key_padding_mask=None if valid is None else ~valid)
        s = self.head(h).squeeze(-1).float()
        return s[0] if squeeze else s


POLICY_FORMAT = "ragattn-refrag-policy-v1"


def save_policy(net: PolicyNetwork, path, extra: Optional[dict] = None):
    """Save a ``PolicyNetwork`` (hyper-parameters + state dict + ``extra`` metadata) to ``path``."""
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": POLICY_FORMAT, "hparams": net.hparams,
             "state": {k: v.detach().cpu() for k, v in net.state_dict().items()}, "extra": extra or {}}
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def load_policy(path, device="cpu") -> PolicyNetwork:
    """The ``PolicyNetwork`` saved by :func:`save_policy` (eval mode); ``net.extra`` holds the metadata."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != POLICY_FORMAT:
        raise ValueError(f"ragattn.refrag.load_policy: {path} is not a {POLICY_FORMAT} file")
    net = PolicyNetwork(**state["hparams"])
    net.load_state_dict(state["state"])
    net.extra = state.get("extra", {})
    return net.to(device).eval()


class LearnedPolicy:
    """``select`` hook around a ``PolicyNetwork``: greedy top-T' (inference) or Gumbel sampling."""

    def __init__(self, net: PolicyNetwork, mode: str = "greedy",
                 generator: Optional[torch.Generator] = None):
        if mode not in ("greedy", "sample"):
            raise ValueError(f"LearnedPolicy: mode must be 'greedy' or 'sample', got {mode!r}")
        self.net, self.mode, self.generator = net, mode, generator

    @torch.no_grad()
    def select(self, c: torch.Tensor, chunk_token_ids: Sequence[torch.Tensor], n_expand: int) -> torch.Tensor:
        """c: float [L, d_enc]; chunk_token_ids: L int tensors (unused); returns bool [L] with
        exactly ``n_expand`` True."""
        if c.dim() != 2:
            raise ValueError(f"LearnedPolicy.select: c must be [L, d_enc], got {tuple(c.shape)}")
        L = c.shape[0]
        n_expand = _check_n_expand(n_expand, L, "LearnedPolicy.select")
        mask = torch.zeros(L, dtype=torch.bool, device=c.device)
        if n_expand == 0:
            return mask
        s = self.net(c)
        order = (greedy_top_k(s, n_expand) if self.mode == "greedy"
                 else gumbel_top_k(s, n_expand, generator=self.generator))
        mask[order] = True
        return mask


@torch.no_grad()
def chunk_perplexities(model, chunk_token_ids: Sequence[torch.Tensor],
                       bos_token_id: Optional[int] = None) -> torch.Tensor:
    """Per-chunk mean negative log-likelihood (log-perplexity) of the context under the decoder.

    model: HF causal LM; chunk_token_ids: L int tensors [k_i] (decoder token ids, in order).
    The chunks are concatenated into one sequence (after ``bos_token_id`` when given) and scored in
    one teacher-forced forward; chunk i's value is the mean NLL of its tokens given everything
    before. Without a BOS the very first token has no prediction and chunk 0 averages the rest
    (a 1-token first chunk then gets +inf, so it is never called "easy"). Returns float32 [L].
    """
    if len(chunk_token_ids) == 0:
        raise ValueError("chunk_perplexities: no chunks (empty context)")
    lens = [int(t.numel()) for t in chunk_token_ids]
    if min(lens) == 0:
        raise ValueError("chunk_perplexities: a chunk has no tokens")
    dev = next(model.parameters()).device
    ids = torch.cat([t.reshape(-1).long() for t in chunk_token_ids]).to(dev)
    lead = 0
    if bos_token_id is not None:
        ids = torch.cat([ids.new_tensor([bos_token_id]), ids])
        lead = 1
    logits = model(input_ids=ids[None]).logits[0, :-1].float()
    nll = F.cross_entropy(logits, ids[1:], reduction="none")          # nll[j] is for token j+1
    nll = torch.cat([nll.new_full((1 - lead,), float("nan")), nll])   # align: entry j <-> ids[lead+j]
    out = []
    start = 0
    for n in lens:
        part = nll[start:start + n]
        part = part[~torch.isnan(part)]
        out.append(part.mean() if part.numel() else nll.new_tensor(float("inf")))
        start += n
    return torch.stack(out).cpu()


class PerplexityPolicy:
    """Heuristic expansion by decoder perplexity (paper Fig. 3 baselines).

    ``order="desc"``: expand the highest-perplexity chunks (compress the easy ones);
    ``order="asc"``: expand the lowest-perplexity chunks. Ties break toward the earlier chunk.
    """

    def __init__(self, model, tokenizer=None, order: str = "desc"):
        if order not in ("asc", "desc"):
            raise ValueError(f"PerplexityPolicy: order must be 'asc' or 'desc', got {order!r}")
        self.model, self.order = model, order
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None

    def select(self, c: torch.Tensor, chunk_token_ids: Sequence[torch.Tensor], n_expand: int) -> torch.Tensor:
        """c: [L, d_enc] (unused beyond its length); chunk_token_ids: L int tensors; bool [L] out."""
        L = len(chunk_token_ids)
        if c is not None and c.shape[0] != L:
            raise ValueError(f"PerplexityPolicy.select: c has {c.shape[0]} rows but there are {L} chunks")
        n_expand = _check_n_expand(n_expand, L, "PerplexityPolicy.select")
        mask = torch.zeros(L, dtype=torch.bool)
        if n_expand:
            ppl = chunk_perplexities(self.model, chunk_token_ids, self.bos_token_id).double()
            key = -ppl if self.order == "desc" else ppl
            # stable sort: equal perplexities keep chunk order
            mask[torch.sort(key, stable=True).indices[:n_expand]] = True
        return mask.to(c.device if c is not None else "cpu")


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: ``A_i = (r_i - mean_G r) / (std_G r + eps)`` within each group.

    rewards: float [B, G] (G >= 2 sampled selections per example). std is the sample standard
    deviation (Bessel-corrected, as TRL's GRPO); a group whose rewards are all equal gets A = 0.
    Returns float [B, G] (same dtype), zero-mean per row.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2 or not rewards.is_floating_point():
        raise ValueError(f"group_advantages: rewards must be float [B, G] with G >= 2, got "
                         f"{rewards.dtype} {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("group_advantages: rewards must be finite")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def grpo_clip_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                   clip_eps: float = 0.2) -> torch.Tensor:
    """Negative of the paper's Eq. 1 objective (to minimise).

    logp_new: float [B, G, T'] per-step log-probs of the sampled selections under the current
    policy (differentiable); logp_old: same shape, under the sampling policy (no grad);
    advantages: float [B, G] (one per selection, shared by its T' steps). Returns the scalar
    ``-mean_{B,G,T'} min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)`` with ``rho = exp(new - old)``.
    """
    if logp_new.shape != logp_old.shape or logp_new.dim() != 3:
        raise ValueError(f"grpo_clip_loss: logp_new and logp_old must both be [B, G, T'], got "
                         f"{tuple(logp_new.shape)} and {tuple(logp_old.shape)}")
    if advantages.shape != logp_new.shape[:2]:
        raise ValueError(f"grpo_clip_loss: advantages must be [B, G] = {tuple(logp_new.shape[:2])}, "
                         f"got {tuple(advantages.shape)}")
    if not 0 < clip_eps < 1:
        raise ValueError(f"grpo_clip_loss: clip_eps must be in (0, 1), got {clip_eps}")
    if logp_new.shape[2] == 0:
        raise ValueError("grpo_clip_loss: T' = 0 (nothing selected, no policy gradient)")
    ratio = torch.exp(logp_new - logp_old.detach())
    adv = advantages.detach().unsqueeze(-1).to(ratio.dtype)
    objective = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    return -objective.mean()
