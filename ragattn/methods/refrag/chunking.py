"""REFRAG chunking: a context cut into k-token chunks in the DECODER's token space.

    from ragattn.methods.refrag.chunking import chunk_context
    lay = chunk_context([passage_a_ids, passage_b_ids], k=16)   # or one passage: chunk_context(ids, 16)
    lay.num_chunks, lay.chunk_token_ids()                      # L, [ids of chunk 0, ...]

Rules (the paper leaves them open; notes §2.2, §9.1-3):

* chunk ``i`` of a passage is its tokens ``[i k, (i + 1) k)`` (0-based; the paper's index formula
  is off by one);
* chunks never cross passage boundaries: each passage is chunked on its own, so a passage of
  ``n`` tokens gives ``ceil(n / k)`` chunks and its **final chunk is shorter** (``n mod k``
  tokens) when ``k`` does not divide ``n``; it is kept as is, never padded or merged (the encoder
  sees its real tokens; an expanded short chunk gives back exactly its tokens);
* empty passages give no chunk; a context with no token at all is an error.

``k`` is in decoder tokens because an expanded chunk is put back as its k decoder-token
embeddings. :func:`chunk_context` accepts ``k`` in ``{8, 16, 32}`` (the paper's compression
rates) unless ``allowed_k=None``; the low-level :func:`chunk_spans` accepts any ``k >= 1``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

DEFAULT_KS = (8, 16, 32)

Ids = Union[Sequence[int], torch.Tensor]


def _check_k(k, allowed_k: Optional[Sequence[int]], where: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"ragattn.refrag.{where}: k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"ragattn.refrag.{where}: k (tokens per chunk) must be >= 1, got {k}")
    if allowed_k is not None and k not in allowed_k:
        raise ValueError(f"ragattn.refrag.{where}: k must be one of {tuple(allowed_k)} (the paper's "
                         f"compression rates), got {k}; pass allowed_k=None to use another k")
    return k


def chunk_spans(lengths: Sequence[int], k: int):
    """Chunk spans of passages of the given token counts, any ``k >= 1``.

    Returns int64 tensors ``(starts [L], lens [L], passage [L])``: chunk ``j`` is tokens
    ``starts[j] .. starts[j] + lens[j]`` of the concatenated passages and belongs to passage
    ``passage[j]``; ``1 <= lens[j] <= k`` (a passage's final chunk may be shorter)."""
    _check_k(k, None, "chunk_spans")
    lens_t = torch.as_tensor(list(lengths), dtype=torch.int64)
    if lens_t.numel() and int(lens_t.min()) < 0:
        raise ValueError(f"ragattn.refrag.chunk_spans: passage lengths must be >= 0, got {lens_t.tolist()}")
    offsets = torch.cumsum(lens_t, 0) - lens_t
    n_chunks = (lens_t + k - 1) // k
    passage = torch.repeat_interleave(torch.arange(lens_t.numel()), n_chunks)
    first = torch.cumsum(n_chunks, 0) - n_chunks
    within = torch.arange(int(n_chunks.sum())) - first[passage]      # chunk index inside its passage
    starts = offsets[passage] + within * k
    lens = torch.clamp(lens_t[passage] - within * k, max=k)
    return starts, lens, passage


@dataclass(frozen=True)
class ChunkLayout:
    """One context cut into chunks.

    ``token_ids`` int64 ``[T_ctx]``: the context's decoder tokens (passages concatenated);
    ``cu_passages`` int64 ``[P + 1]``: passage offsets in ``token_ids``; ``starts``, ``lens``,
    ``passage`` int64 ``[L]``: each chunk's first token, length (``1..k``) and passage; ``k``."""
    token_ids: torch.Tensor
    cu_passages: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor
    passage: torch.Tensor
    k: int

    @property
    def num_chunks(self) -> int:
        return int(self.starts.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    def chunk_token_ids(self) -> list:
        """``L`` int64 tensors: the decoder token ids of each chunk (views of ``token_ids``)."""
        return [self.token_ids[s:s + n] for s, n in zip(self.starts.tolist(), self.lens.tolist())]


def _as_passages(context) -> list:
    if isinstance(context, torch.Tensor):
        if context.dim() != 1:
            raise ValueError(f"ragattn.refrag.chunk_context: a tensor context must be 1-D token ids, got "
                             f"shape {tuple(context.shape)}")
        return [context]
    items = list(context)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return [items] if items else []
    return items


def chunk_context(context, k: int, *, allowed_k: Optional[Sequence[int]] = DEFAULT_KS) -> ChunkLayout:
    """Cut a context into chunks of ``k`` decoder tokens, per passage (see the module docstring).

    Args:
        context: one passage (list of ints or 1-D int tensor) or a sequence of passages.
        k: tokens per chunk (= compression rate), one of ``allowed_k`` (default ``(8, 16, 32)``;
            ``None`` accepts any ``k >= 1``).

    Raises ValueError for a bad ``k``, a non-1-D passage or negative ids, or an empty context."""
    _check_k(k, allowed_k, "chunk_context")
    passages = []
    for i, p in enumerate(_as_passages(context)):
        t = p if isinstance(p, torch.Tensor) else torch.as_tensor(list(p), dtype=torch.int64)
        if t.dim() != 1:
            raise ValueError(f"ragattn.refrag.chunk_context: passage {i} must be 1-D token ids, got shape "
                             f"{tuple(t.shape)}")
        if t.is_floating_point() or t.dtype == torch.bool:
            raise TypeError(f"ragattn.refrag.chunk_context: passage {i} must hold integer token ids, got {t.dtype}")
        passages.append(t.to(torch.int64).cpu())
    lengths = [p.numel() for p in passages]
    if sum(lengths) == 0:
        raise ValueError("ragattn.refrag.chunk_context: the context is empty (no passage has a token); "
                         "REFRAG needs at least one context token to compress")
    ids = torch.cat(passages)
    if int(ids.min()) < 0:
        raise ValueError(f"ragattn.refrag.chunk_context: token ids must be >= 0, got {int(ids.min())}")
    starts, lens, passage = chunk_spans(lengths, k)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return ChunkLayout(ids, cu, starts, lens, passage, k)


def effective_compression(k: int, p: float) -> float:
    """The paper's effective compression rate ``k / (1 - p + k p)`` with a fraction ``p`` expanded."""
    return k / (1.0 - p + k * p)


def num_expanded(num_chunks: int, fraction: float) -> int:
    """``round(fraction * num_chunks)`` chunks to expand (half away from zero), in ``[0, num_chunks]``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"ragattn.refrag: expand_fraction must lie in [0, 1], got {fraction}")
    return min(num_chunks, int(fraction * num_chunks + 0.5))
