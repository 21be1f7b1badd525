"""TurboRAG (Lu et al. 2024): answer from precomputed, independently prefilled chunk KV caches.

    from ragattn.methods import turborag
    res = turborag.answer(model, tokenizer, chunks, question, positions="reordered",
                          max_new_tokens=32, store=store)      # -> ragattn.methods.common.Answer

``positions``:
* "reordered" (default, the paper's better scheme): chunk keys are re-rotated to consecutive
  positions (``copy_kv_`` with a per-chunk delta), the question follows the last chunk.
* "composite": every chunk keeps its own 0-based positions, no re-rotation; the question starts
  after the longest chunk (``max len``).
Chunks attend only to themselves (Independent Attention); the final block (question + assistant
header) and the answer attend to everything, through ``ragattn.paged_attention``.
"""
from __future__ import annotations

from ragattn.methods.common import Answer, cached_answer

POSITIONS = ("reordered", "composite")


def answer(model, tokenizer, chunks, question: str, *, positions: str = "reordered",
           max_new_tokens: int = 32, store=None, **generate_kwargs) -> Answer:
    """``generate_kwargs`` go to ``model.generate()`` (default greedy): sampling, logits
    processors, ``stop_strings``..."""
    if positions not in POSITIONS:
        raise ValueError(f"ragattn.methods.turborag.answer: positions must be one of {POSITIONS}, "
                         f"got {positions!r}")
    return cached_answer(model, tokenizer, chunks, question, positions=positions,
                         method=f"turborag-{positions}", max_new_tokens=max_new_tokens, store=store,
                         **generate_kwargs)
