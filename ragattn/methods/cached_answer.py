"""Answering from cached chunks (TurboRAG, Block-Attention): the chunks' K/V from the store,
either attended in place (zero-copy) or copied into a request cache, then the final block and
decoding (:func:`ragattn.methods.generate.generate_paged`)."""
from __future__ import annotations

import time

from ragattn.hf.registration import use_ragattn
from ragattn.methods.generate import Answer, generate_paged
from ragattn.methods.prompt import prompt_parts

def cached_answer(model, tokenizer, chunks, question, *, positions: str, method: str,
                  max_new_tokens: int = 32, store=None, rerotate: bool = True, zero_copy: bool = True,
                  **generate_kwargs) -> Answer:
    """Answer from cached chunks (TurboRAG / Block-Attention). See the module docstring;
    ``generate_kwargs`` go to ``model.generate()`` (default: greedy). ``zero_copy`` (default):
    the request attends to the store's own chunk pages in place (``ChunkStore.request``: positions
    in its page table, RoPE in the kernel); False: the chunks are copied into a request cache with
    their keys rotated on the way (``ChunkStore.assemble``; ``rerotate=False`` is a copy-path
    option for tests)."""
    from ragattn.store import ChunkStore, ChunkStoreError

    if len(chunks) == 0:
        raise ChunkStoreError(f"ragattn.methods.{method}: no chunks given (empty retrieval)")
    head, chunk_ids, tail = prompt_parts(tokenizer, chunks, question)
    if store is None:
        store = ChunkStore(model)
    else:   # the store's model (it follows its weights) or one with the same fingerprint
        store.check_model(model, f"ragattn.methods.{method}")
    with use_ragattn(model):  # switched outside the timed region
        t0 = time.perf_counter()
        keys = store.add([head] + chunk_ids)
        if zero_copy and rerotate:
            req = store.request(keys, positions=positions, extra_slots=len(tail) + max_new_tokens)
        else:
            req = store.assemble(keys, positions=positions, extra_slots=len(tail) + max_new_tokens,
                                 rerotate=rerotate)
        prompt_len = req.num_slots + len(tail)
        try:
            ans = generate_paged(model, tokenizer, req.cache, tail, req.next_position, max_new_tokens,
                                 t0, method, prompt_len, cached_ids=[t for c in [head] + chunk_ids for t in c],
                                 cached_positions=req.positions, **generate_kwargs)
        finally:
            if zero_copy and rerotate:
                req.release()
        if zero_copy and rerotate:
            ans.extra["private_bytes"] = req.private_bytes
        return ans
