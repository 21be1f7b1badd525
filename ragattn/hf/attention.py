"""ragattn as a transformers attention implementation ("ragattn"): the attention function that
:mod:`ragattn.hf.registration` registers (importing :mod:`ragattn.hf` does).

    import ragattn.hf                                    # registers "ragattn" (ragattn.hf.enable(): again, idempotent)
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="ragattn")
    # or: model.set_attn_implementation("ragattn")
    model.generate(**tok(texts, return_tensors="pt", padding=True), do_sample=False)

Registered in both ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface``
(the mask builder: transformers' boolean SDPA mask, so padded batches get their mask, or ``None``
where SDPA would use ``is_causal``). Every transformers cache works (dynamic, static, offloaded,
and ragattn's paged :class:`ragattn.hf.cache.PagedCache`). Per layer call, with
``query [B, Hq, q, D]`` and the cache's ``key/value [B, Hkv, kv, D]``:

* The mask decides what each query sees, exactly as it does for SDPA. ``None`` means SDPA's
  ``is_causal``: for ``q > 1`` query ``i`` sees keys ``0..i`` (top-left aligned: a fresh cache,
  dynamic or static), for ``q == 1`` every key. A boolean or additive ``[B, 1|H, q, kv]`` mask
  is read once per forward (at layer 0, one host sync) into a *plan*: each query row's slot
  (its last visible key) and each key's validity (padding). When the mask is exactly
  "causal by slot and padding" (what transformers builds for any cache, padded or not), the
  plan runs ragattn's kernels (a sliding layer's mask: "causal + padding + window W");
  **any other mask (block-diagonal, a custom bias) falls back to SDPA with that mask**, so a
  custom mask is always honoured, never approximated.
* ``q > 1`` (prefill, chunked prefill): ``ragattn.varlen_attention`` over the batch with no
  packing: keys of padding get a position no query reaches, padded query rows a position below
  every key; keys past the last query's slot (a static cache's empty tail) are never read.
* ``q == 1`` (decode): ``ragattn.paged_attention`` reading the cache in place (its strides, no
  copy): unpadded, one page per row; with a mask, pages of one slot listing the visible slots.
* Sliding windows (Mistral, Qwen2's sliding layers): decode reads only the window's slots (the
  mask says which); a prefill whose mask is "causal + padding + window W by slot" runs
  ``varlen_attention`` with ``window_left = W - 1`` (the window is checked against the mask, and
  any other mask falls back to SDPA); the paged paths pass ``window_left = W - 1`` to
  ``ragattn.paged_attention``.
* With no mask (an unpadded batch) the path has no host sync and builds its index tensors once
  per shape, so ``torch.compile(fullgraph=True)`` traces it without a graph break.

``output_attentions=True`` runs that call through the model's own eager attention (the weights
are formed there only). Attention-logit soft-capping (Gemma 2) runs in the kernels
(``logits_soft_cap``). Refused with a named error (rather than computed wrong): attention sinks,
dropout in training and non-causal attention modules; model families whose attention this path
has not been checked against (:data:`ragattn.hf.rope.SUPPORTED_FAMILIES`) are refused when the
model is created or switched to "ragattn" (:func:`ragattn.hf.registration.refuse_unsupported_family`).
A transformers version outside :data:`ragattn.hf.registration.TESTED_TRANSFORMERS` gets a warning
(``RAGATTN_ALLOW_UNTESTED_TRANSFORMERS=1`` silences it).

Keyword arguments used by ``ragattn.methods`` (all optional, passed through ``model(...)``):

* ``ragattn_block_ids`` int ``[B, kv]``: block id of every cache slot incl. the current tokens,
  ``-1`` = global; the prefill then uses the Block-Attention mask (same block or either global).
* ``ragattn_cu_seqlens`` int32 ``[n + 1]``: the batch-1 input packs ``n`` independent sequences
  (e.g. chunks; their ``position_ids`` restart at 0): one ``varlen_attention`` call, no cross-talk.
  With ``ragattn_block_ids`` ``[1, T]`` as well, each packed sequence gets the Block-Attention mask
  (block fine-tuning: ``ragattn.apps.finetune``); differentiable through ``varlen_attention``'s autograd.
* ``ragattn_capture`` list: each layer appends its ``(key, value)`` ``[B, Hkv, T, D]`` (keys after RoPE).
* ``ragattn_capture_query`` list: each layer appends its ``query`` ``[B, Hq, T, D]`` (after RoPE).
  With ``ragattn_query_only=True`` as well, the layer then raises :class:`QueryCaptured` instead of
  attending (nothing of the forward past that query is computed, no K/V is written): for a caller
  that needs one layer's query alone (FusionRAG's selection pass, ``fusionrag.recompute``).
* ``ragattn_paged`` a :class:`ragattn.kv.PagedKV`: the current tokens' K/V are written into the paged request
  cache at slots ``lengths[b] + i`` and attention runs through ``ragattn.paged_attention`` (causal by
  slot; RoPE positions come from ``position_ids`` and may differ from slots). The caller advances
  ``lengths`` after the forward (:class:`ragattn.hf.cache.PagedCache` does it for ``generate()``).
  ``ragattn_paged`` may also be a zero-copy request (:class:`ragattn.kv.TaggedPagedKV`,
  ``ChunkStore.request``): keys are stored page-local on shared and private pages, positions come
  from its page table and RoPE is applied in the kernel; it needs ``position_ids`` (batch 1) and
  masks by position (the same rule as by slot for the methods' position schemes).
* ``ragattn_slots`` int ``[q]`` with ``ragattn_paged`` (batch 1): selective recompute. The current
  tokens' K/V overwrite these slots (distinct, each ``< lengths[0]``; the caller sets ``lengths`` to
  cover them first and does not advance it after) instead of being appended, and row ``i`` attends
  causally to the slots ``<= ragattn_slots[i]``: never to a later slot, whatever the row order.
"""
from __future__ import annotations

import torch

from ragattn import ops as _ops
from ragattn.hf.fallbacks import _eager_forward, _refuse_unsupported, _sdpa_fallback, _soft_cap
from ragattn.hf.masks import _FAR, _page_view, _plan, _rows_view, _visible_from_mask, _window_left
from ragattn.kv import TaggedPagedKV


class QueryCaptured(Exception):
    """Raised by the attention after it appended the layer's query to ``ragattn_capture_query``
    when ``ragattn_query_only=True``: the forward stops there (its caller catches it)."""


def _token_rows(t: torch.Tensor, q: int) -> torch.Tensor:
    """``[B, H, q, D]`` -> token-major ``[B * q, H, D]`` (a view for one token)."""
    b, h, _, d = t.shape
    return t[:, :, 0] if q == 1 else t.transpose(1, 2).reshape(b * q, h, d)


def _paged_forward(module, query, key, value, scaling, cache, slots=None, valid=None,
                   window_left: int = -1, logits_soft_cap: float = 0.0, positions=None):
    """One layer on a ``ragattn.kv`` request cache (:class:`PagedKV` or :class:`TaggedPagedKV`):
    the forward planned at its first layer, this layer's new K/V written, then attention through
    the cache. ``valid`` bool ``[B, q]`` marks the real (non-padding) new tokens; ``slots``:
    selective recompute; ``window_left`` >= 0: sliding window. Returns ``((out, None), counts or
    None)``. A zero-copy request needs the forward's ``positions`` (its ``position_ids``)."""
    b, hq, q, d = query.shape
    layer = module.layer_idx
    if isinstance(cache, TaggedPagedKV):
        if b != 1:
            raise ValueError(f"ragattn attention: a zero-copy request cache (TaggedPagedKV) holds one sequence, "
                             f"got a batch of {b}")
        if positions is None:
            raise ValueError("ragattn attention: a zero-copy request cache (TaggedPagedKV) needs the forward's "
                             "position_ids (its keys are rotated in the kernel by position)")
        f = cache.plan(layer == 0, q, positions.reshape(-1), slots, valid)
        counts = None if valid is None else valid.sum(1, dtype=torch.int32)
    else:
        f = cache.plan(layer == 0, q, slots=slots, valid=valid, device=query.device)
        counts = f.counts
    cache.write(f, layer, _token_rows(key, q), _token_rows(value, q))
    o = cache.attend(f, layer, _token_rows(query, q), scaling, window_left, logits_soft_cap)
    return (o.view(b, q, hq, d), None), counts


def _paged_cache_forward(module, query, key, value, attention_mask, scaling, owner, window_left=-1,
                         logits_soft_cap=0.0, positions=None):
    """The :class:`ragattn.hf.cache.PagedCache` path: the mask covers only the new tokens
    (``[B, 1, q, q]``: causal + their padding); its diagonal says which tokens are real."""
    b, q = query.shape[0], query.shape[2]
    valid = None
    if attention_mask is not None:
        vis = _visible_from_mask(attention_mask, b, q, q)
        if vis is None:
            raise NotImplementedError("ragattn attention: a custom attention mask with a PagedCache")
        valid = torch.diagonal(vis, dim1=1, dim2=2)                     # [B, q]
    out, counts = _paged_forward(module, query, key, value, scaling, owner.paged, valid=valid,
                                 window_left=window_left, logits_soft_cap=logits_soft_cap,
                                 positions=positions)
    if module.layer_idx == owner.num_layers - 1:
        owner._advance(q, counts)
    return out


def ragattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              is_causal=None, **kwargs):
    """HF attention function: returns ``(out [B, q, Hq, D], None)`` (with ``output_attentions=True``:
    the model's eager attention, ``(out, weights [B, Hq, q, kv])``)."""
    if kwargs.get("output_attentions"):
        return _eager_forward(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    _refuse_unsupported(module, dropout, dict(kwargs, is_causal=is_causal))
    cap = _soft_cap(module, kwargs)
    b, hq, q, d = query.shape
    dev = query.device
    capture = kwargs.get("ragattn_capture")
    if capture is not None:
        capture.append((key, value))
    if kwargs.get("ragattn_capture_query") is not None:
        kwargs["ragattn_capture_query"].append(query)
        if kwargs.get("ragattn_query_only"):
            raise QueryCaptured()
    owner = getattr(key, "_ragattn_cache", None)       # set by PagedCache.update
    if owner is not None:
        return _paged_cache_forward(module, query, key, value, attention_mask, scaling, owner,
                                    _window_left(module, kwargs), cap, kwargs.get("position_ids"))
    paged = kwargs.get("ragattn_paged")
    if paged is not None:
        return _paged_forward(module, query, key, value, scaling, paged, kwargs.get("ragattn_slots"),
                              window_left=_window_left(module, kwargs), logits_soft_cap=cap,
                              positions=kwargs.get("position_ids"))[0]
    kv = key.shape[2]
    cu_packed = kwargs.get("ragattn_cu_seqlens")
    if cu_packed is not None:
        if b != 1 or kv != q:
            raise ValueError("ragattn attention: ragattn_cu_seqlens needs a batch of 1 with no cache")
        cu_packed = cu_packed.to(device=dev, dtype=torch.int32)
        blocks = kwargs.get("ragattn_block_ids")  # [1, T]: Block-Attention inside each packed sequence
        if blocks is not None:
            blocks = blocks.to(device=dev, dtype=torch.int32).reshape(-1).contiguous()
        o, _ = _ops.varlen_attention(query[0].transpose(0, 1).contiguous(),
                                     key[0].transpose(0, 1).contiguous(),
                                     value[0].transpose(0, 1).contiguous(), cu_packed, cu_packed,
                                     None, None, blocks, blocks, True, scaling, -1, cap)
        return o[None], None
    block_ids = kwargs.get("ragattn_block_ids")
    if block_ids is not None:
        return _block_forward(query, key, value, attention_mask, scaling, block_ids, cap)
    plan = _plan(module, query, key, attention_mask, kwargs)
    if plan.fallback:
        return _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if q == 1:
        o = plan.step.run(query[:, :, 0], plan.dec_pos, _page_view(key, plan.page_view),
                          _page_view(value, plan.page_view), scaling, logits_soft_cap=cap)[0]
        return o[:, None], None
    e = plan.kv_end
    o, _ = _ops.varlen_attention(_rows_view(query), _rows_view(key[:, :, :e]), _rows_view(value[:, :, :e]),
                                 plan.cu_q, plan.cu_k, plan.q_pos, plan.kv_pos, None, None, True, scaling,
                                 plan.window_left, cap)
    return o.view(b, q, hq, d), None


def _block_forward(query, key, value, attention_mask, scaling, block_ids, logits_soft_cap=0.0):
    """Block-Attention prefill (``ragattn_block_ids``): causal by slot, same block or global."""
    b, hq, q, d = query.shape
    kv, dev = key.shape[2], query.device
    kv_ok = torch.ones(b, kv, dtype=torch.bool, device=dev)
    if attention_mask is not None:   # padding: keys no row sees
        vis = _visible_from_mask(attention_mask, b, q, kv)
        if vis is None:
            raise NotImplementedError("ragattn attention: ragattn_block_ids with a custom attention mask")
        kv_ok = vis.any(1)
    slot = torch.arange(kv, dtype=torch.int32, device=dev)
    kv_pos = torch.where(kv_ok, slot, _FAR).to(torch.int32).reshape(-1)
    q_pos = torch.where(kv_ok[:, kv - q:], slot[kv - q:], -1).to(torch.int32).reshape(-1)
    blocks = block_ids.to(device=dev, dtype=torch.int32)
    cu_q = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=dev)
    cu_k = torch.arange(0, (b + 1) * kv, kv, dtype=torch.int32, device=dev)
    o, _ = _ops.varlen_attention(_rows_view(query), _rows_view(key), _rows_view(value), cu_q, cu_k,
                                 q_pos, kv_pos, blocks[:, kv - q:].reshape(-1).contiguous(),
                                 blocks.reshape(-1).contiguous(), True, scaling, -1, logits_soft_cap)
    return o.view(b, q, hq, d), None
