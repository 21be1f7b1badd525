"""Engine-neutral request KV caches over ``ragattn.PageTable`` and the paged attention ops.

Two caches, one interface for a forward of ``q`` new tokens (every layer)::

    f = cache.plan(first_layer, q, positions, slots=None, valid=None)   # once per forward
    cache.write(f, layer, k_rows, v_rows)     # the new tokens' K/V, [tokens, Hkv, D] token-major
    out = cache.attend(f, layer, q_rows, scale, window_left=-1, logits_soft_cap=0.0)  # [tokens, Hq, D]

* :class:`PagedKV` (the copy path): a request's own pages, keys stored rotated, slot ``j`` at
  position ``j`` (a padded block table); batch ``B``.
* :class:`TaggedPagedKV` (zero copy): a request's entries over the chunk store's shared pages and
  its private ones, keys stored page-local (slot ``o`` of a page rotated by ``o``) and moved to
  their ``positions`` in the kernel (a position-tagged table); batch 1.

* :class:`SharedEntries` (:mod:`ragattn.kv.shared_entries`): batched requests (an engine's block
  tables) over shared chunk pages, rows a request recomputed held in its own pages (copy on
  write by rows); :func:`entry_tables` and :class:`PassStep` attend to them in two passes, and
  :func:`run_passes` is the one merge of passes (by LSE) of both zero-copy forms.

A sliding window is by position on both, refused where positions overlap unless it hides nothing
(:mod:`ragattn.kv.window`). The per-forward state (where the new tokens go, the tables, the attention plans) is the
``plan``'s, made at the first layer and reused by the others. ``positions`` is the one name of a
token's RoPE position from the store to the kernel. Engines (transformers' attention in
``ragattn.hf``, vLLM's) route onto this layer; it imports only ``ragattn.ops``.
"""
from ragattn.ops.backend import cpu_sdpa_enabled
from ragattn.kv.paged_kv import CopyForward, PagedKV
from ragattn.kv.shared_entries import Pass, PassStep, SharedEntries, entry_tables, run_passes
from ragattn.kv.zero_copy import TaggedPagedKV, ZeroCopyForward

__all__ = ["PagedKV", "TaggedPagedKV", "CopyForward", "ZeroCopyForward", "cpu_sdpa_enabled", "SharedEntries",
           "entry_tables", "Pass", "PassStep", "run_passes"]
