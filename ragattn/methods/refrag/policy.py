"""Selective-expansion policies (notes §2.9): which chunks of a context go back to tokens.

A policy is any object with ``select(c, chunk_token_ids, n_expand) -> expand_mask``:

* ``c``: float32 ``[L, d_enc]``, the encoder embeddings of the row's ``L`` chunks (the paper's
  policy input; no question);
* ``chunk_token_ids``: ``L`` int64 tensors, each chunk's decoder tokens (for heuristics such as
  perplexity);
* ``n_expand``: how many chunks to expand, ``0 <= n_expand <= L``;
* returns bool ``[L]`` with exactly ``n_expand`` True (True = expanded to its tokens).

Here: :class:`NoExpansion` and :class:`RandomPolicy` (the paper's random baseline); the learned
(GRPO) and perplexity policies live with the training recipe.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch


class ExpansionPolicy(Protocol):
    def select(self, c: torch.Tensor, chunk_token_ids: Sequence[torch.Tensor], n_expand: int) -> torch.Tensor:
        ...


def check_selection(mask, num_chunks: int, n_expand: int, policy) -> torch.Tensor:
    """The policy's mask as bool ``[L]`` on the CPU, or a ValueError naming the policy."""
    name = type(policy).__name__
    mask = torch.as_tensor(mask)
    if mask.dtype != torch.bool or mask.shape != (num_chunks,):
        raise ValueError(f"ragattn.refrag: policy {name}.select must return bool [{num_chunks}], got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    if int(mask.sum()) != n_expand:
        raise ValueError(f"ragattn.refrag: policy {name}.select expanded {int(mask.sum())} chunks, "
                         f"asked for {n_expand}")
    return mask.cpu()


class NoExpansion:
    """Compress every chunk (``n_expand`` must be 0)."""

    def select(self, c, chunk_token_ids, n_expand: int) -> torch.Tensor:
        if n_expand:
            raise ValueError(f"ragattn.refrag.NoExpansion: cannot expand {n_expand} chunks")
        return torch.zeros(c.shape[0], dtype=torch.bool)


class RandomPolicy:
    """Expand ``n_expand`` chunks uniformly at random (own generator: ``seed`` makes it repeatable)."""

    def __init__(self, seed: Optional[int] = 0):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def select(self, c, chunk_token_ids, n_expand: int) -> torch.Tensor:
        L = c.shape[0]
        mask = torch.zeros(L, dtype=torch.bool)
        mask[torch.randperm(L, generator=self.generator)[:n_expand]] = True
        return mask
