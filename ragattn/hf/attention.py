"""ragattn as a transformers attention implementation ("ragattn").

    import ragattn.hf.attention          # registers "ragattn" (also done by ragattn.hf.enable())
    model.set_attn_implementation("ragattn")            # or from_pretrained(..., attn_implementation="ragattn")
    model.generate(**tok(texts, return_tensors="pt", padding=True), do_sample=False)

Registered in both ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface``
(the mask builder: transformers' boolean SDPA mask, so padded batches get their mask, or ``None``
for an unpadded causal batch). Per layer call, with ``query [B, Hq, q, D]`` and the updated
contiguous cache ``key/value [B, Hkv, kv, D]`` (slot ``j`` holds position ``j`` of the row):

* ``q > 1`` (prefill, chunked prefill): the valid (non-pad) queries and keys are packed and run
  through ``ragattn.varlen_attention`` with ``q_pos``/``kv_pos`` = cache slots (causal by slot).
* ``q == 1`` (decode): ``ragattn.paged_attention``; unpadded: one page per row (the contiguous
  special case), padded: pages of one slot listing only the row's valid slots.

Block-Attention: pass ``ragattn_block_ids`` (int ``[B, kv]``, block id of every cache slot incl.
the current tokens, ``-1`` = global) through ``model(..., ragattn_block_ids=...)``; the prefill then
uses the Block-Attention mask (same block or either side global).

Further keyword arguments used by ``ragattn.methods`` (all optional, passed through ``model(...)``):

* ``ragattn_cu_seqlens`` int32 ``[n + 1]``: the batch-1 input packs ``n`` independent sequences
  (e.g. chunks; their ``position_ids`` restart at 0): one ``varlen_attention`` call, no cross-talk.
  With ``ragattn_block_ids`` ``[1, T]`` as well, each packed sequence gets the Block-Attention mask
  (block fine-tuning: ``ragattn.finetune``); differentiable through ``varlen_attention``'s autograd.
* ``ragattn_capture`` list: each layer appends its ``(key, value)`` ``[B, Hkv, T, D]`` (keys after RoPE).
* ``ragattn_capture_query`` list: each layer appends its ``query`` ``[B, Hq, T, D]`` (after RoPE).
* ``ragattn_paged`` a :class:`PagedKV`: the current tokens' K/V are written into the paged request
  cache at slots ``lengths[b] + i`` and attention runs through ``ragattn.paged_attention`` (causal by
  slot; RoPE positions come from ``position_ids`` and may differ from slots). The caller advances
  ``lengths`` after the forward.
* ``ragattn_slots`` int ``[q]`` with ``ragattn_paged`` (batch 1): selective recompute. The current
  tokens' K/V overwrite these slots (distinct, each ``< lengths[0]``; the caller sets ``lengths`` to
  cover them first and does not advance it after) instead of being appended, and row ``i`` attends
  causally to the slots ``<= ragattn_slots[i]``: never to a later slot, whatever the row order.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ragattn import ops as _ops

NAME = "ragattn"


class PagedKV:
    """A paged request KV cache (design.md layout) for one model.

    ``k[l]``, ``v[l]``: ``[num_pages, page_size, Hkv, D]`` per layer; ``block_table`` int32
    ``[B, max_pages]``; ``lengths`` int32 ``[B]`` (slots filled per row).
    """

    def __init__(self, num_layers, batch, capacity, num_kv_heads, head_dim, page_size=16,
                 dtype=torch.float32, device="cpu"):
        pages_per_row = max(1, -(-capacity // page_size))
        n_pages = batch * pages_per_row
        self.page_size, self.capacity = page_size, pages_per_row * page_size
        self.k = [torch.empty(n_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.block_table = torch.arange(n_pages, dtype=torch.int32, device=device).view(batch, pages_per_row)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)

    def slot_rows(self, b: int, slots: torch.Tensor) -> torch.Tensor:
        """Flat row indices (into a layer viewed as ``[num_pages * page_size, Hkv, D]``) of ``slots``."""
        pages = self.block_table[b].long()[slots.long() // self.page_size]
        return pages * self.page_size + slots.long() % self.page_size

    def scatter_plan(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [q] int64, slots [q] int32)`` for writing ``q`` tokens of row 0 at ``slots``
        (selective recompute); checked once per forward (slots distinct and ``< lengths[0]``)."""
        key = (id(slots), slots._version, id(self.lengths), self.lengths._version)
        if getattr(self, "_scatter_key", None) != key:
            if self.lengths.shape[0] != 1:
                raise ValueError("ragattn attention: ragattn_slots needs a batch-1 paged cache")
            if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= int(self.lengths[0])):
                raise ValueError(f"ragattn attention: ragattn_slots must lie in [0, lengths[0] = "
                                 f"{int(self.lengths[0])}), got {int(slots.min())} .. {int(slots.max())}")
            if torch.unique(slots).numel() != slots.numel():
                raise ValueError("ragattn attention: ragattn_slots may not repeat a slot")
            self._scatter_key = key
            self._scatter = (self.slot_rows(0, slots), slots.to(torch.int32))
        return self._scatter

    def append_plan(self, q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [B * q] int64, slots [B * q] int32)``: where ``q`` new tokens per row go.

        The same for every layer of one forward, so it is computed once (one host sync for the
        capacity check) and reused until ``lengths`` changes (the caller advances it afterwards).
        """
        key = (id(self.lengths), self.lengths._version, q)
        if getattr(self, "_plan_key", None) != key:
            if int(self.lengths.max()) + q > self.capacity:
                raise ValueError(f"ragattn attention: paged request cache full ({self.capacity} slots), "
                                 f"cannot append {q} tokens")
            slots = [self.lengths[i] + torch.arange(q, device=device, dtype=torch.int32)
                     for i in range(self.lengths.shape[0])]
            rows = torch.cat([self.slot_rows(i, sl) for i, sl in enumerate(slots)])
            self._plan_key, self._plan = key, (rows, torch.cat(slots))
        return self._plan


def _paged_forward(module, query, key, value, scaling, cache: PagedKV, slots=None):
    b, hq, q, d = query.shape
    layer = module.layer_idx
    if slots is None:
        rows, q_pos = cache.append_plan(q, query.device)
        kv_lens = cache.lengths + q
    else:
        if b != 1 or slots.shape != (q,):
            raise ValueError(f"ragattn attention: ragattn_slots must be [q] = [{q}] with batch 1, "
                             f"got {tuple(slots.shape)} with batch {b}")
        rows, q_pos = cache.scatter_plan(slots)
        kv_lens = cache.lengths
    kf = cache.k[layer].view(-1, *cache.k[layer].shape[2:])
    vf = cache.v[layer].view(-1, *cache.v[layer].shape[2:])
    kf[rows] = key.transpose(1, 2).reshape(b * q, *kf.shape[1:]).to(kf.dtype)    # [B * q, Hkv, D]
    vf[rows] = value.transpose(1, 2).reshape(b * q, *vf.shape[1:]).to(vf.dtype)
    cu = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=query.device)
    o, _ = _ops.paged_attention(query.transpose(1, 2).reshape(b * q, hq, d).contiguous(),
                                q_pos, cu, cache.k[layer], cache.v[layer],
                                cache.block_table, kv_lens, scaling)
    return o.view(b, q, hq, d), None


def _valid_from_mask(mask, b, q, kv, device):
    """(q_valid [B, q], kv_valid [B, kv]) bool from a boolean/additive mask [B, 1|H, q, kv] or None."""
    if mask is None:
        return (torch.ones(b, q, dtype=torch.bool, device=device),
                torch.ones(b, kv, dtype=torch.bool, device=device))
    m = mask if mask.dtype == torch.bool else mask == 0
    m = m[:, 0].expand(b, q, kv)
    return m.any(-1), m.any(-2)


def ragattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              is_causal=None, **kwargs):
    """HF attention function: returns ``(out [B, q, Hq, D], None)``."""
    if dropout and module.training:
        raise NotImplementedError("ragattn attention: dropout is not supported")
    b, hq, q, d = query.shape
    kv, hkv = key.shape[2], key.shape[1]
    dev = query.device
    capture = kwargs.get("ragattn_capture")
    if capture is not None:
        capture.append((key, value))
    if kwargs.get("ragattn_capture_query") is not None:
        kwargs["ragattn_capture_query"].append(query)
    if kwargs.get("ragattn_paged") is not None:
        return _paged_forward(module, query, key, value, scaling, kwargs["ragattn_paged"],
                              kwargs.get("ragattn_slots"))
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
                                     None, None, blocks, blocks, True, scaling)
        return o[None], None
    window = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
    if window is not None and kv > window:
        raise NotImplementedError(f"ragattn attention: sliding-window attention (window {window}) "
                                  f"over {kv} keys is not supported")
    q_valid, kv_valid = _valid_from_mask(attention_mask, b, q, kv, dev)
    block_ids = kwargs.get("ragattn_block_ids")
    qt, kt, vt = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, T, H, D]
    out = torch.zeros(b, q, hq, d, dtype=query.dtype, device=dev)
    if q == 1 and block_ids is None:
        n = kv_valid.sum(1).to(torch.int32)                       # valid keys per row
        if bool(kv_valid.all()):
            k_cache, v_cache = kt.contiguous(), vt.contiguous()   # [B, kv, Hkv, D]: one page per row
            table = torch.arange(b, dtype=torch.int32, device=dev)[:, None]
        else:
            k_cache = kt.reshape(b * kv, 1, hkv, d).contiguous()
            v_cache = vt.reshape(b * kv, 1, hkv, d).contiguous()
            slots = torch.arange(kv, device=dev).expand(b, kv)
            order = torch.sort((~kv_valid).to(torch.int8), dim=1, stable=True).indices  # valid first
            table = ((torch.arange(b, device=dev)[:, None] * kv) + slots.gather(1, order)).to(torch.int32)
        cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
        o, _ = _ops.paged_attention(qt[:, 0].contiguous(), (n - 1).clamp_min(0), cu, k_cache, v_cache,
                                    table, n, scaling)
        out[:, 0] = o
        return out, None
    slot_k = torch.arange(kv, dtype=torch.int32, device=dev).expand(b, kv)
    slot_q = slot_k[:, kv - q:]
    cu_q = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    cu_k = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    cu_q[1:] = q_valid.sum(1).cumsum(0)
    cu_k[1:] = kv_valid.sum(1).cumsum(0)
    q_block = kv_block = None
    if block_ids is not None:
        block_ids = block_ids.to(device=dev, dtype=torch.int32)
        kv_block = block_ids[kv_valid].contiguous()
        q_block = block_ids[:, kv - q:][q_valid].contiguous()
    o, _ = _ops.varlen_attention(
        qt[q_valid].contiguous(), kt[kv_valid].contiguous(), vt[kv_valid].contiguous(), cu_q, cu_k,
        slot_q[q_valid].contiguous(), slot_k[kv_valid].contiguous(), q_block, kv_block, True, scaling)
    out[q_valid] = o
    return out, None


@contextlib.contextmanager
def use_ragattn(model):
    """Context manager: run ``model`` with the "ragattn" attention implementation, then restore."""
    old = model.config._attn_implementation
    if old == NAME:  # already on: no switch (a switch costs ~0.5 ms on SmolLM2)
        yield model
        return
    model.set_attn_implementation(NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(old)


def register() -> None:
    """Register "ragattn" with transformers (idempotent)."""
    AttentionInterface.register(NAME, ragattn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
