"""Block-Attention (Sun et al. 2024): cached blocks with position re-encoding, a global final block.

    from ragattn.methods import block_attention
    res = block_attention.answer(model, tokenizer, chunks, question, max_new_tokens=32, store=store)

Every block but the last (the prompt head and each chunk) is computed alone at positions
``0..n-1`` and cached in the :class:`~ragattn.store.ChunkStore` (keys page-local);
at request time the blocks are re-encoded to their real offsets by the request's page table (each
page's first position; RoPE applied in the attention kernel, no copy; ``zero_copy=False``: copied
into the request's paged cache, keys rotated on the way by one ``copy_kv_``); the final block (question + assistant header) is prefilled through
``paged_attention`` and attends to everything, then `model.generate()` decodes (greedy by default). At inference this
is the same computation as TurboRAG with reordered positions. :func:`block_ids` gives the
single-pass mask (``model(..., ragattn_block_ids=...)`` with the "ragattn" attention), used for
fine-tuning and as the exactness oracle.
"""
from __future__ import annotations

import torch

from ragattn.methods.cached_answer import cached_answer

from ragattn.methods.generate import Answer


def answer(model, tokenizer, chunks, question: str, *, max_new_tokens: int = 32, store=None,
           zero_copy: bool = True, **generate_kwargs) -> Answer:
    """``generate_kwargs`` go to ``model.generate()`` (default greedy): sampling, logits
    processors, ``stop_strings``... ``zero_copy`` (default): attend to the store's chunk pages
    in place; False: copy them into a request cache first (see ``common.cached_answer``)."""
    return cached_answer(model, tokenizer, chunks, question, positions="reordered",
                         method="block_attention", max_new_tokens=max_new_tokens, store=store,
                         zero_copy=zero_copy, **generate_kwargs)


def block_ids(block_lens, final_len: int) -> torch.Tensor:
    """int32 ``[sum(block_lens) + final_len]``: block ``i`` for the tokens of local block ``i``,
    ``-1`` (global) for the final block."""
    ids = [torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(block_lens)]
    return torch.cat(ids + [torch.full((final_len,), -1, dtype=torch.int32)])
