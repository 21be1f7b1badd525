"""The selection maths of selective recompute (FusionRAG, CacheBlend), shared by every engine
(``ragattn.methods.fusionrag`` on HF models, ``ragattn.vllm.recompute`` in vLLM); imports no
model library.

    k = budget(ratio, n_chunk_tokens)                         # tokens recomputed
    scores = query_guided_scores(q_last, k_last, chunk_lens)  # FusionRAG: float32 [N]
    rows = top_rows(scores, k, group=None)                    # sorted int64 indices
    checks = cacheblend_schedule(ratio, n_chunk_tokens)       # CacheBlend: {layer: kept after it}
    dev = kv_deviation(new_k, new_v, old_k, old_v)            # CacheBlend: float32 [n]
    ran = walk_layers(walk, checks=checks, num_candidates=n, group=None)   # the recompute loop

:func:`walk_layers` is the one layer loop of a recompute: a model-family *walk* (HF's in
``ragattn.hf.layer_walk``, vLLM's in ``ragattn.vllm.recompute``) runs one decoder layer at a time
over its current rows and the loop applies CacheBlend's gradual filtering between layers.
"""
from __future__ import annotations

import hashlib
import math
from typing import Protocol, Sequence

import torch

from ragattn import ops as _ops

SCORE_NORMS = ("per_chunk", "global")
CACHEBLEND_CHECK_LAYERS = (1, 2, 3)


def check_ratio(ratio, where: str) -> float:
    """``ratio`` as a float in [0, 1], or a ValueError naming ``where``."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ValueError(f"ragattn.methods.fusionrag.{where}: ratio must be a number in [0, 1], "
                         f"got {ratio!r}")
    r = float(ratio)
    if not (0.0 <= r <= 1.0):  # also rejects NaN
        raise ValueError(f"ragattn.methods.fusionrag.{where}: ratio must lie in [0, 1] (the fraction "
                         f"of chunk tokens recomputed), got {ratio!r}")
    return r


def budget(ratio: float, num_tokens: int) -> int:
    """Number of tokens recomputed: ``floor(ratio * num_tokens)`` (robust to 0.29 * 100 = 28.99..)."""
    return min(num_tokens, math.floor(ratio * num_tokens + 1e-9))


def top_rows(scores: torch.Tensor, k: int, group=None) -> torch.Tensor:
    """Sorted int64 indices of the ``k`` largest ``scores`` (float ``[n]``), ties to the lower index.

    With ``group`` (tensor parallelism: each rank scored its own heads) the scores are first summed
    over the ranks (``all_reduce``), so every rank selects the same rows. Deterministic."""
    if group is not None:
        import torch.distributed as dist

        scores = scores.clone()
        dist.all_reduce(scores, op=dist.ReduceOp.SUM, group=group)
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:k].sort().values


def query_guided_scores(q_last: torch.Tensor, k_last: torch.Tensor, chunk_lens: Sequence[int],
                        score_norm: str = "per_chunk", scale: float | None = None) -> torch.Tensor:
    """FusionRAG's critical score of every chunk token (paper §3.2).

    ``q_last``: ``[T, Hq, D]`` last-layer queries of the question rows (after RoPE);
    ``k_last``: ``[N, Hkv, D]`` the chunks' cached last-layer keys, chunk after chunk
    (``N = sum(chunk_lens)``). Returns float32 ``[N]``: the attention probability each key receives,
    summed over the question rows and the (local) heads, with the softmax over each chunk's keys
    (``"per_chunk"``, the paper) or over all chunk tokens (``"global"``)."""
    if score_norm not in SCORE_NORMS:
        raise ValueError(f"ragattn.methods.fusionrag: score_norm must be one of {SCORE_NORMS}, "
                         f"got {score_norm!r}")
    dev, t = q_last.device, q_last.shape[0]
    lens = list(chunk_lens) if score_norm == "per_chunk" else [sum(chunk_lens)]
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device=dev)
    cu_k[1:] = torch.tensor(lens, device=dev).cumsum(0)
    cu_q = torch.arange(0, (len(lens) + 1) * t, t, dtype=torch.int32, device=dev)
    q = q_last.repeat(len(lens), 1, 1) if len(lens) > 1 else q_last
    return _ops.key_attention_scores(q.contiguous(), k_last.contiguous(), cu_q, cu_k, scale)


def kv_deviation(new_k, new_v, old_k, old_v) -> torch.Tensor:
    """CacheBlend's token-wise KV deviation: float32 ``[n]``, the sum over heads and dims of the
    squared differences of K and of V (all ``[n, Hkv, D]``)."""
    dk = (new_k.float() - old_k.float()).square().sum((1, 2))
    dv = (new_v.float() - old_v.float()).square().sum((1, 2))
    return dk + dv


def cacheblend_schedule(ratio: float, num_tokens: int, check_layers=CACHEBLEND_CHECK_LAYERS) -> dict:
    """``{layer: tokens kept after it}``: gradual filtering from ``2 * ratio`` down to ``ratio``
    (CacheBlend §4.3: a slightly larger set at the first check layer, narrowed at each next one)."""
    n = len(check_layers)
    fracs = [ratio * (2 - i / (n - 1)) if n > 1 else ratio for i in range(n)]
    return {l: budget(min(1.0, f), num_tokens) for l, f in zip(check_layers, fracs)}


def fused_variant(head: Sequence[int]) -> str:
    """The chunk-store variant name of the fused caches built after the prompt head ``head``."""
    return "fused-" + hashlib.sha256(torch.tensor(list(head), dtype=torch.int64).numpy().tobytes()
                                     ).hexdigest()[:16]


class LayerWalk(Protocol):
    """One recompute's rows through a model's decoder layers (each row at its own position,
    writing its K/V at its own slot of the request's cache)."""
    num_layers: int

    @property
    def rows(self) -> int:
        """Rows still running."""

    def cached_kv(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's K/V ``[n, Hkv, D]`` at the first ``n`` rows' slots before ``layer`` writes them (copies)."""

    def run_layer(self, layer: int, capture_kv: bool) -> bool:
        """Runs ``layer`` over the rows (``capture_kv``: keep their fresh K/V for :meth:`fresh_kv`);
        False: the walk stopped (it has what it needed, e.g. the last layer's query)."""

    def fresh_kv(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` rows' K/V ``[n, Hkv, D]`` that ``layer`` just computed."""

    def keep(self, rows: torch.Tensor) -> None:
        """Only ``rows`` (int64 indices, sorted) go on."""


def walk_layers(walk: LayerWalk, *, checks: dict | None = None, num_candidates: int | None = None,
                group=None) -> bool:
    """Runs ``walk`` through every layer. ``checks`` ``{layer: keep}`` (CacheBlend's gradual
    filtering): after such a layer, of the first ``num_candidates`` rows still running (default:
    all; the rows after them are always kept), the ``keep`` whose K/V deviate most from the cache's
    previous K/V at their slots go on, the others stop (their K/V written so far stay). Returns
    False if the walk stopped early (:meth:`LayerWalk.run_layer`), True otherwise."""
    checks = checks or {}
    n = walk.rows if num_candidates is None else num_candidates
    for layer in range(walk.num_layers):
        old = walk.cached_kv(layer, n) if layer in checks else None
        if not walk.run_layer(layer, layer in checks):
            return False
        if layer in checks:
            keep = top_rows(kv_deviation(*walk.fresh_kv(layer, n), *old), min(checks[layer], n), group)
            keep = torch.cat([keep, torch.arange(n, walk.rows, device=keep.device)])
            n = min(checks[layer], n)
            walk.keep(keep)
            if walk.rows == 0:
                break
    return True


__all__ = ["SCORE_NORMS", "CACHEBLEND_CHECK_LAYERS", "check_ratio", "budget", "top_rows", "query_guided_scores",
           "kv_deviation", "cacheblend_schedule", "fused_variant", "LayerWalk", "walk_layers"]
