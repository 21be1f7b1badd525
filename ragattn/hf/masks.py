"""Mask parsing for the "ragattn" attention: a transformers mask read once per forward into a plan.

The plan holds what every layer of one forward shares: the varlen index tensors of a prefill
(each query row's slot, each key's validity), or the decode's page view of the transformers cache
and its attention step over a ``ragattn.PageTable``; or the verdict that the mask is not
"causal by slot + padding (+ window)" and the call falls back to SDPA with it. Made at layer 0
(one host sync for a mask), reused by the later layers while the shapes and the mask object stay.
"""
from __future__ import annotations

import threading

import torch

from ragattn.ops import PagedAttentionStep, PageTable

_FAR = 1 << 30  # a key position no query reaches (padding keys) is _FAR; padded queries sit at -1


def _window_left(module, kwargs) -> int:
    """transformers' sliding window W (key visible iff ``q_pos - W < kv_pos <= q_pos``) as
    FlashAttention's ``window_left = W - 1``; -1 when the layer has none."""
    # the module's own attribute via its __dict__: nn.Module.__getattr__ on a missing name (every
    # layer of a model without windows, every decode step) raises and catches an AttributeError
    w = kwargs.get("sliding_window") or vars(module).get("sliding_window")
    return int(w) - 1 if w else -1


class _Plan:
    """Index tensors shared by every layer of one forward (see the module docstring)."""
    __slots__ = ("key", "mask", "fallback", "kv_end", "cu_q", "cu_k", "q_pos", "kv_pos",
                 "table", "kv_lens", "dec_pos", "cu_dec", "page_view", "window_left", "step")


_local = threading.local()


def _cached_plan(layer_idx, key, mask):
    """The plan of this forward if layer ``layer_idx`` may reuse it (any layer but the first, same
    shapes, the very same mask object)."""
    plan = getattr(_local, "plan", None)
    if plan is None or layer_idx == 0 or plan.key != key or plan.mask is not mask:
        return None
    return plan


def _store_plan(plan):
    if not torch.compiler.is_compiling():
        _local.plan = plan
    return plan


def _visible_from_mask(mask, b, q, kv):
    """bool ``[B, q, kv]`` from a boolean or additive ``[B, 1|H, q, kv]`` mask, or None when the
    mask is not one pattern for all heads of 0 / -inf entries (the caller falls back to SDPA)."""
    if mask.dim() != 4 or mask.shape[-2:] != (q, kv) or mask.shape[0] not in (1, b):
        return None
    if mask.dtype == torch.bool:
        vis = mask
    else:
        vis = mask == 0
        blocked = mask[~vis]
        if blocked.numel() and not bool((blocked <= torch.finfo(mask.dtype).min / 2).all()):
            return None   # a bias, not a mask
    if vis.shape[1] > 1 and not bool((vis == vis[:, :1]).all()):
        return None       # per-head masks
    return vis[:, 0].expand(b, q, kv)


def _plan(module, query, key, attention_mask, kwargs):
    b, hq, q, d = query.shape
    kv = key.shape[2]
    dev = query.device
    window_left = _window_left(module, kwargs)
    shape_key = (b, q, kv, dev, window_left)
    plan = _cached_plan(getattr(module, "layer_idx", 0), shape_key, attention_mask)
    if plan is not None:
        return plan
    plan = _Plan()
    plan.key, plan.mask, plan.fallback, plan.page_view = shape_key, attention_mask, False, None
    plan.window_left, plan.step = window_left, None
    if attention_mask is None:
        if q > 1:   # SDPA's is_causal: top-left aligned, keys past the last query never seen
            plan.kv_end = min(q, kv)
            plan.cu_q, plan.cu_k, plan.q_pos, plan.kv_pos = _versioned(
                torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=dev),
                torch.arange(0, (b + 1) * plan.kv_end, plan.kv_end, dtype=torch.int32, device=dev),
                torch.arange(q, dtype=torch.int32, device=dev).repeat(b),
                torch.arange(plan.kv_end, dtype=torch.int32, device=dev).repeat(b))
        else:       # decode: every key, one page per row, read in place
            plan.page_view = "row"
            plan.table = torch.arange(b, dtype=torch.int32, device=dev)[:, None]
            plan.kv_lens = torch.full((b,), kv, dtype=torch.int32, device=dev)
            plan.dec_pos = torch.full((b,), kv - 1, dtype=torch.int32, device=dev)
            plan.cu_dec = torch.arange(b + 1, dtype=torch.int32, device=dev)
            plan.step = PagedAttentionStep(plan.cu_dec, PageTable.from_block_table(plan.table, plan.kv_lens))
        return _store_plan(plan)
    vis = _visible_from_mask(attention_mask, b, q, kv)
    if vis is None:
        plan.fallback = True
        return _store_plan(plan)
    slot = torch.arange(kv, device=dev)
    if q == 1:      # decode: the visible slots (any set) as pages of one slot, in slot order
        v = vis[:, 0]                                                   # [B, kv]
        plan.page_view = "slot"
        order = torch.sort((~v).to(torch.int8), dim=1, stable=True).indices   # visible first
        hkv = key.shape[1]
        plan.table = (torch.arange(b, device=dev)[:, None] * (hkv * kv) + order).to(torch.int32)
        plan.kv_lens = v.sum(1, dtype=torch.int32)
        plan.dec_pos = (plan.kv_lens - 1).clamp_min(0)
        plan.cu_dec = torch.arange(b + 1, dtype=torch.int32, device=dev)
        plan.step = PagedAttentionStep(plan.cu_dec, PageTable.from_block_table(plan.table, plan.kv_lens))
        return _store_plan(plan)
    # prefill: row slot = last visible key; key valid = seen by some row; must be causal + padding
    last = torch.where(vis, slot, -1).amax(-1)                          # [B, q]
    kv_ok = vis.any(1)                                                  # [B, kv]
    allowed = kv_ok[:, None, :] & (slot <= last[..., None])
    if window_left >= 0:    # transformers' sliding window, by slot: last - W < slot
        allowed &= slot >= last[..., None] - window_left
    structured = (vis == allowed).all()
    if torch.compiler.is_compiling():
        # no host sync in a graph: a mask that is not causal + padding is refused, not approximated
        torch._assert_async(structured, "ragattn attention: under torch.compile the attention mask "
                            "must be causal + padding (transformers' own); use sdpa for custom masks")
        kv_end = kv
    else:
        if not bool(structured):                                        # host sync, once per forward
            plan.fallback = True
            return _store_plan(plan)
        kv_end = max(int(last.max()) + 1, 1)                            # never read the empty tail
    plan.kv_end = kv_end
    plan.cu_q, plan.cu_k, plan.q_pos, plan.kv_pos = _versioned(
        torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=dev),
        torch.arange(0, (b + 1) * kv_end, kv_end, dtype=torch.int32, device=dev),
        last.to(torch.int32).reshape(-1),
        torch.where(kv_ok[:, :kv_end], slot[:kv_end], _FAR).to(torch.int32).reshape(-1))
    return _store_plan(plan)


def _versioned(*index):
    """The forward's varlen index tensors as tensors with a version counter. Every layer passes
    the same objects, and the op's tile-plan cache (``ragattn.triton_kernels.plan_cache``) hits on the same
    objects at unchanged versions without reading them; but tensors made under
    ``torch.inference_mode()`` (serving) have no version counter, so the cache would compare their
    contents in every layer (a host sync per tensor and layer on CUDA). Made once per forward, so
    only its first layer compares."""
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return index
    with torch.inference_mode(False):
        return tuple(t.clone() for t in index)


def _rows_view(t):
    """``[B, H, S, D]`` -> ``[B * S, H, D]`` contiguous (one copy: varlen's packed layout)."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d)


def _page_view(t, kind):
    """The cache ``[B, H, S, D]`` (last dim contiguous) as pages, without a copy: ``"row"`` one
    page per row ``[B, S, H, D]``; ``"slot"`` pages of one slot ``[n, 1, H, D]``, page ``p`` at
    ``p * stride(S)`` (page ``b * H * S + j`` is row ``b``'s slot ``j`` when the rows are packed)."""
    if kind == "row":
        return t.transpose(1, 2)
    b, h, s, d = t.shape
    sb, sh, ss, _ = t.stride()
    if sb != h * s * ss:
        raise ValueError("ragattn attention: the K/V cache rows are not packed (unexpected strides "
                         f"{t.stride()} for shape {tuple(t.shape)})")
    n = (b - 1) * h * s + s
    return t.as_strided((n, 1, h, d), (ss, ss, sh, 1))
