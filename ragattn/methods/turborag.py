"""TurboRAG (Lu et al. 2024): answer from precomputed, independently prefilled chunk KV caches.

    from ragattn.methods import turborag
    res = turborag.answer(model, tokenizer, chunks, question, positions="reordered",
                          max_new_tokens=32, store=store)      # -> ragattn.methods.generate.Answer

``positions``:
* "reordered" (default, the paper's better scheme): chunks at consecutive positions, the question
  follows the last chunk.
* "composite": every chunk keeps its own 0-based positions; the question starts after the longest
  chunk (``max len``).

Either scheme is just the request's page table over the store's shared, page-local chunk pages
(``ChunkStore.request``; keys rotated in the attention kernel); ``zero_copy=False`` copies the
chunks into a request cache instead, keys rotated on the way (``copy_kv_``).
Chunks attend only to themselves (Independent Attention); the final block (question + assistant
header) and the answer attend to everything, through ``ragattn.paged_attention``.
"""
from __future__ import annotations

from ragattn.methods.cached_answer import cached_answer
from ragattn.methods.generate import Answer
from ragattn.store.positions import Positions


def answer(model, tokenizer, chunks, question: str, *, positions: str = "reordered",
           max_new_tokens: int = 32, store=None, zero_copy: bool = True, **generate_kwargs) -> Answer:
    """``generate_kwargs`` go to ``model.generate()`` (default greedy): sampling, logits
    processors, ``stop_strings``... ``zero_copy`` (default): attend to the store's chunk pages
    in place; False: copy them into a request cache first (see ``ragattn.methods.cached_answer``)."""
    # the method's two schemes (its names: turborag-reordered, turborag-composite), no first positions
    Positions.parse(positions, "ragattn.methods.turborag.answer", named_only=True, error=ValueError)
    return cached_answer(model, tokenizer, chunks, question, positions=positions,
                         method=f"turborag-{positions}", max_new_tokens=max_new_tokens, store=store,
                         zero_copy=zero_copy, **generate_kwargs)
