"""Block-Attention (Sun et al. 2024): cached blocks with position re-encoding, a global final block.

    from ragattn.methods import block_attention
    res = block_attention.answer(model, tokenizer, chunks, question, max_new_tokens=32, store=store)

Every block but the last (the prompt head and each chunk) is computed alone at positions
``0..n-1`` and cached in the :class:`~ragattn.methods.chunk_store.ChunkStore`; at request time the
blocks' keys are re-encoded to their real offsets while being copied into the request's paged
cache (one ``copy_kv_``); the final block (question + assistant header) is prefilled through
``paged_attention`` and attends to everything, then `model.generate()` decodes (greedy by default). At inference this
is the same computation as TurboRAG with reordered positions. :func:`block_ids` gives the
single-pass mask (``model(..., ragattn_block_ids=...)`` with the "ragattn" attention), used for
fine-tuning and as the exactness oracle.
"""
from __future__ import annotations

import torch

from ragattn.methods.common import Answer, cached_answer


def answer(model, tokenizer, chunks, question: str, *, max_new_tokens: int = 32, store=None,
           **generate_kwargs) -> Answer:
    """``generate_kwargs`` go to ``model.generate()`` (default greedy): sampling, logits
    processors, ``stop_strings``..."""
    return cached_answer(model, tokenizer, chunks, question, positions="reordered",
                         method="block_attention", max_new_tokens=max_new_tokens, store=store,
                         **generate_kwargs)


def block_ids(block_lens, final_len: int) -> torch.Tensor:
    """int32 ``[sum(block_lens) + final_len]``: block ``i`` for the tokens of local block ``i``,
    ``-1`` (global) for the final block."""
    ids = [torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(block_lens)]
    return torch.cat(ids + [torch.full((final_len,), -1, dtype=torch.int32)])
