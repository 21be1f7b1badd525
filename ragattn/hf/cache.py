"""The paged request cache as a transformers ``Cache``: ``model.generate()`` over a :class:`PagedKV`.

    from ragattn.hf.cache import PagedCache
    cache = PagedCache(paged_kv, seen=num_cached)        # e.g. chunks assembled by the ChunkStore
    out = model.generate(input_ids=prompt_ids, position_ids=positions, past_key_values=cache,
                         max_new_tokens=32, do_sample=True, ...)   # attn_implementation "ragattn"

``seen`` is how many leading tokens of ``input_ids`` the cache already holds (every row holds
``paged_kv.lengths[b]`` slots; generate() only ever looks at ``seen``), so generate() feeds the
rest (``input_ids[:, seen:]``) as the first step, then one token per step. Rows may hold different
numbers of slots (their cached prefix padded on the left in ``input_ids``); the new tokens' padding
(from ``attention_mask``) is never written to the pages, so each row's slots stay contiguous and
causal by slot. RoPE positions are whatever ``position_ids`` says (generate() extends them by one
per step): TurboRAG's composite positions or re-rotated chunks need no special decoding.

Each layer's ``update`` hands the new K/V to the "ragattn" attention function, which writes them
into the pages and runs ``ragattn.paged_attention``; the last layer advances the rows' lengths.
Beam search, cropping and cache reordering are refused (a paged request cache has no copy of a
row to reorder); sampling, logits processors, stopping criteria and stop strings all work.
"""
from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ragattn.kv import PagedKV


def _query_length(arg) -> int:
    # transformers >= 5.2x passes the query length, earlier 5.x the cache_position tensor
    return int(arg.shape[0]) if isinstance(arg, torch.Tensor) else int(arg)


class PagedLayer(CacheLayerMixin):
    """One layer's view of a :class:`PagedCache` (the pages live in the shared :class:`PagedKV`)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: "PagedCache", layer_idx: int):
        super().__init__()
        # a weak reference: no cycle cache <-> layers, so a finished request's pages are freed
        # (or recycled by the ChunkStore) as soon as the cache is dropped, not at the next gc
        self._owner, self.layer_idx = weakref.ref(owner), layer_idx
        self.is_initialized = True

    @property
    def owner(self) -> "PagedCache":
        return self._owner()

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner._hand_over(key_states, value_states)

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # the mask covers only the new tokens (the keys at slots seen.. in generate()'s view):
        # their padding and causality; the cached slots are always visible
        return _query_length(query_length), self.owner.seen

    def get_seq_length(self) -> int:
        return self.owner.seen

    def get_max_length(self) -> int:
        return self.owner.paged.capacity

    def reset(self) -> None:
        self.owner.reset()

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("ragattn PagedCache: beam search (cache reordering) is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ragattn PagedCache: cropping is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("ragattn PagedCache: num_return_sequences / expansion is not supported")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("ragattn PagedCache: batch selection is not supported")


class PagedCache(Cache):
    """A transformers ``Cache`` over a :class:`PagedKV` (see the module docstring).

    ``paged``: the request pages, a :class:`PagedKV` or a zero-copy
    :class:`~ragattn.kv.TaggedPagedKV` (``lengths[b]`` slots already filled in row ``b``); ``seen``: the
    number of leading ``input_ids`` tokens the cache stands for (default ``max(lengths)``).
    After each forward, ``paged.lengths[b]`` has grown by row ``b``'s non-padding new tokens and
    ``seen`` by the number of new tokens.
    """

    def __init__(self, paged: PagedKV, seen: int | None = None):
        self.paged = paged
        self.seen = int(paged.lengths.max()) if seen is None else int(seen)
        super().__init__(layers=[PagedLayer(self, i) for i in range(paged.num_layers)])

    @property
    def num_layers(self) -> int:
        return self.paged.num_layers

    def _hand_over(self, key_states, value_states):
        # the attention function finds the pages on the key it is given (update's return value)
        key_states._ragattn_paged = self.paged
        key_states._ragattn_cache = self
        return key_states, value_states

    def _advance(self, new_tokens: int, valid_per_row: torch.Tensor | None) -> None:
        """Called by the attention function after the last layer of a forward."""
        if valid_per_row is None:
            self.paged.lengths += new_tokens
        else:
            self.paged.lengths += valid_per_row.to(torch.int32)
        self.seen += new_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.paged.capacity

    def reset(self) -> None:
        self.paged.lengths.zero_()
        self.seen = 0

    @property
    def is_compileable(self) -> bool:
        return False
