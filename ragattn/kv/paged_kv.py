"""The copy path's request cache: a request's K/V on pages it owns, keys stored rotated.

:class:`PagedKV` holds one model's layers as ``[num_pages, page_size, Hkv, D]`` pages and a padded
``block_table`` (each sequence's pages consecutive), fills them by copying (a chunk store's rows,
a prefill's new tokens) and attends through ``paged_attention`` over a ``ragattn.PageTable``.
Slot ``j`` of a sequence holds position ``j``: a query row at position ``p`` sees the slots
``<= p`` below ``lengths + new tokens``.

One forward, every layer (the interface :class:`ragattn.kv.TaggedPagedKV` shares)::

    f = cache.plan(first_layer, q, slots=None, valid=None, device=...)  # where the new tokens go
    cache.write(f, layer, k_rows, v_rows)           # [B * q, Hkv, D] token-major, keys rotated
    out = cache.attend(f, layer, q_rows, scale, window_left, logits_soft_cap)   # [B * q, Hq, D]
"""
from __future__ import annotations

from typing import Optional

import torch

from ragattn.kv.cpu_sdpa import head_rows, row_masks, rows_sdpa
from ragattn.kv.window import check_window
from ragattn.ops import PagedAttentionStep, PageTable
from ragattn.ops.backend import cpu_sdpa_enabled
from ragattn.ops.page_table import num_pages, slot_rows


class CopyForward:
    """What every layer of one forward of a :class:`PagedKV` shares (made by ``PagedKV.plan``):
    ``rows`` int64 ``[n]`` (flat page rows the new tokens go to) and ``src`` (None, or which of
    the ``B * q`` new tokens are real), ``positions`` int32 ``[B * q]`` (each query row's position:
    its slot), ``kv_lens`` int32 ``[B]``, ``counts`` (real new tokens per sequence, or None),
    ``spans`` (per sequence ``(first flat row, kv length)`` when its pages are consecutive CPU
    rows, else None), the attention ``step`` over the table, the SDPA route's masks, the last
    query slot (read once, for the window rule of :mod:`ragattn.kv.window`)."""
    __slots__ = ("key", "q", "batch", "rows", "src", "positions", "kv_lens", "counts", "spans", "in_place",
                 "cpu_sdpa", "step", "masks", "last_slot")


class PagedKV:
    """A paged request KV cache (design.md layout) for one model.

    ``k[l]``, ``v[l]``: ``[num_pages, page_size, Hkv, D]`` per layer; ``block_table`` int32
    ``[B, max_pages]``; ``lengths`` int32 ``[B]`` (slots filled per row); ``capacity`` slots per
    row. :class:`ragattn.hf.cache.PagedCache` wraps one as a transformers ``Cache``.

    ``buffer``: optional flat tensor (``dtype``, ``device``) of at least :meth:`buffer_numel`
    elements whose leading part holds every layer's K then V (views, no copy; e.g. a recycled
    request cache of the chunk store); by default one tensor per layer is allocated.

    ``overlapping_positions``: False unless whoever filled the slots rotated their keys at
    positions that several slots share (``ChunkStore.assemble(positions="composite")`` sets it):
    then a sliding window narrower than the request is refused (:mod:`ragattn.kv.window`).
    """

    def __init__(self, num_layers, batch, capacity, num_kv_heads, head_dim, page_size=16,
                 dtype=torch.float32, device="cpu", buffer: torch.Tensor | None = None):
        pages_per_row = max(1, num_pages(capacity, page_size))
        n_pages = batch * pages_per_row
        self.page_size, self.capacity = page_size, pages_per_row * page_size
        shape = (n_pages, page_size, num_kv_heads, head_dim)
        if buffer is None:
            self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.empty_like(t) for t in self.k]
        else:
            per = n_pages * page_size * num_kv_heads * head_dim
            if (buffer.dim() != 1 or buffer.numel() < 2 * num_layers * per or buffer.dtype != dtype
                    or buffer.device != torch.device(device)):
                raise ValueError(f"ragattn PagedKV: buffer must be a flat {dtype} tensor on {device} of at "
                                 f"least {2 * num_layers * per} elements, got {tuple(buffer.shape)} "
                                 f"{buffer.dtype} on {buffer.device}")
            layers = buffer[: 2 * num_layers * per].view(2 * num_layers, *shape).unbind(0)
            self.k, self.v = list(layers[:num_layers]), list(layers[num_layers:])
        self.block_table = torch.arange(n_pages, dtype=torch.int32, device=device).view(batch, pages_per_row)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self._plan_key = self._scatter_key = None
        self._head_views = {}
        self._fwd: Optional[CopyForward] = None   # the current forward (plan)
        self.overlapping_positions = False

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer ``layer``'s K, V at row 0's ``slots``: ``[n, Hkv, D]`` each (keys as
        stored: rotated). :class:`ragattn.kv.TaggedPagedKV` has the same method."""
        rows = self.slot_rows(0, slots)
        return (self.k[layer].view(-1, *self.k[layer].shape[2:])[rows],
                self.v[layer].view(-1, *self.v[layer].shape[2:])[rows])

    @staticmethod
    def buffer_numel(num_layers, batch, capacity, num_kv_heads, head_dim, page_size=16) -> int:
        """Elements of the ``buffer`` a cache of these sizes needs (K and V of every layer)."""
        pages = batch * max(1, num_pages(capacity, page_size))
        return 2 * num_layers * pages * page_size * num_kv_heads * head_dim

    def slot_rows(self, b: int, slots: torch.Tensor) -> torch.Tensor:
        """Flat row indices (into a layer viewed as ``[num_pages * page_size, Hkv, D]``) of ``slots``."""
        return slot_rows(self.block_table[b], slots, self.page_size)

    def all_slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Like :meth:`slot_rows` for every row at once: ``slots`` int ``[B, n]`` -> int64 ``[B, n]``."""
        return slot_rows(self.block_table, slots, self.page_size)

    def scatter_plan(self, slots: torch.Tensor, first_layer: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [q] int64, positions [q] int32)`` for writing ``q`` tokens of row 0 at ``slots``
        (selective recompute); checked once per forward (at its first layer): slots distinct and
        ``< lengths[0]``."""
        key = (id(slots), tuple(slots.shape))
        if first_layer or self._scatter_key != key:
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

    def append_plan(self, q: int, device, first_layer: bool = True):
        """``(rows [B * q] int64, positions [B * q] int32, cu_seqlens_q [B + 1] int32, kv_lens [B]
        int32)``: where ``q`` new tokens per row go, and ``paged_attention``'s metadata for them.

        The same for every layer of one forward: computed at the forward's first layer (one host
        sync for the capacity check) and reused by the others (the caller advances ``lengths``
        after the forward). Keyed by the layer, not by ``lengths``' version counter, so that it
        works on inference tensors (``torch.inference_mode()``), which have none."""
        b = self.lengths.shape[0]
        key = (q, b)
        if first_layer or self._plan_key != key:
            if int(self.lengths.max()) + q > self.capacity:
                raise ValueError(f"ragattn attention: paged request cache full ({self.capacity} slots), "
                                 f"cannot append {q} tokens")
            slots = self.lengths[:, None] + torch.arange(q, device=device, dtype=torch.int32)   # [B, q]
            cu = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=device)
            self._plan_key = key
            self._plan = (self.all_slot_rows(slots).reshape(-1), slots.reshape(-1), cu, self.lengths + q)
        return self._plan

    def masked_append_plan(self, valid: torch.Tensor, first_layer: bool = True):
        """Appending ``q`` new tokens per row of which only ``valid`` (bool ``[B, q]``) are real
        (the rest padding, never written): ``(rows [n] int64, src [n] int64, positions [B * q]
        int32, kv_lens [B] int32, counts [B] int32)`` with ``src`` the flat indices of the real
        tokens, written at their row's next slots in order. Padding query rows get a position that
        sees only written slots (their output is never used). Computed at the first layer."""
        b, q = valid.shape
        key = ("masked", b, q)
        if first_layer or self._plan_key != key:
            counts = valid.sum(1, dtype=torch.int32)
            if int((self.lengths + counts).max()) > self.capacity:
                raise ValueError(f"ragattn attention: paged request cache full ({self.capacity} slots), "
                                 f"cannot append {q} tokens")
            rank = valid.to(torch.int32).cumsum(1) - 1                          # [B, q]
            slots = self.lengths[:, None] + rank
            src = valid.reshape(-1).nonzero().squeeze(1)
            rows = self.all_slot_rows(slots.clamp_min(0)).reshape(-1)[src]
            self._plan_key = key
            self._plan = (rows, src, slots.clamp_min(0).reshape(-1).to(torch.int32),
                          self.lengths + counts, counts)
        return self._plan

    def head_views(self, layer: int):
        """``(k, v)`` of ``layer`` as ``[1, Hkv, num_pages * page_size, D]`` views (flat slot rows,
        no copy), or ``(None, None)`` when the pages do not merge into rows. Cached per layer (a
        decode step builds none) and rebuilt when ``k[layer]`` or ``v[layer]`` is replaced."""
        k, v = self.k[layer], self.v[layer]
        hv = self._head_views.get(layer)
        if hv is None or hv[0] is not k or hv[1] is not v:
            hv = (k, v, head_rows(k), head_rows(v))
            if hv[2] is None or hv[3] is None:
                hv = (k, v, None, None)
            self._head_views[layer] = hv
        return hv[2], hv[3]

    def _spans(self, kv_lens):
        """Per sequence ``(first flat row, kv length)`` when every sequence's pages are consecutive
        CPU pages (rows of :meth:`head_views`), else None."""
        bt = self.block_table
        if bt.device.type != "cpu" or not bool((bt[:, 1:] - bt[:, :-1] == 1).all()):
            return None
        return [(page0 * self.page_size, length) for page0, length in zip(bt[:, 0].tolist(), kv_lens.tolist())]

    # ----- one forward ----------------------------------------------------------------------
    def plan(self, first_layer: bool, q: int, positions=None, slots: Optional[torch.Tensor] = None,
             valid: Optional[torch.Tensor] = None, *, device=None) -> CopyForward:
        """Plan one forward of ``q`` new tokens per sequence (made at its first layer, reused by
        the others): appended after ``lengths`` (``valid`` bool ``[B, q]``: only those written), or
        written at row 0's ``slots`` (int ``[q]``, distinct, ``< lengths[0]``: selective recompute;
        batch 1). ``positions`` (the model's RoPE positions) are not needed: a slot's position
        is its index and keys arrive rotated."""
        b = self.lengths.shape[0]
        device = self.lengths.device if device is None else torch.device(device)
        key = (q, b, None if slots is None else id(slots), valid is None)
        f = self._fwd
        if not first_layer and f is not None and f.key == key:
            return f
        f = CopyForward()
        f.key, f.q, f.batch, f.src, f.counts, f.masks, f.last_slot = key, q, b, None, None, {}, None
        if valid is not None:
            f.rows, f.src, f.positions, f.kv_lens, f.counts = self.masked_append_plan(valid, True)
        elif slots is None:
            f.rows, f.positions, _, f.kv_lens = self.append_plan(q, device, first_layer=True)
        else:
            if b != 1 or slots.shape != (q,):
                raise ValueError(f"ragattn attention: ragattn_slots must be [q] = [{q}] with batch 1, "
                                 f"got {tuple(slots.shape)} with batch {b}")
            f.rows, f.positions = self.scatter_plan(slots, first_layer=True)
            f.kv_lens = self.lengths
        cpu = device.type == "cpu"
        # the CPU decode (and unpadded prefill) step writes the new K/V into consecutive slot rows
        # of [1, Hkv, rows, D] views (no index tensors), and SDPA may read a row's slots in place
        f.cpu_sdpa = slots is None and cpu and cpu_sdpa_enabled(q)
        f.spans = self._spans(f.kv_lens) if cpu and (f.cpu_sdpa or (slots is None and valid is None)) else None
        f.in_place = f.spans is not None and slots is None and valid is None
        cu = torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=device)
        f.step = PagedAttentionStep(cu, PageTable.from_block_table(self.block_table, f.kv_lens))
        self._fwd = f
        return f

    def write(self, f: CopyForward, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the forward's new K (rotated) and V ``[B * q, Hkv, D]`` of ``layer`` into their slots."""
        if f.in_place:
            k4, v4 = self.head_views(layer)
            if k4 is not None:
                q = f.q
                for i, (start, length) in enumerate(f.spans):
                    # narrow, not [:, :, a:b]: one op where Python indexing applies three (each costs
                    # microseconds in a forward whose matmuls have just flushed the CPU's caches)
                    k4.narrow(2, start + length - q, q).copy_(k_new[i * q:(i + 1) * q].transpose(0, 1)[None])
                    v4.narrow(2, start + length - q, q).copy_(v_new[i * q:(i + 1) * q].transpose(0, 1)[None])
                return
        kf = self.k[layer].view(-1, *self.k[layer].shape[2:])
        vf = self.v[layer].view(-1, *self.v[layer].shape[2:])
        k_new, v_new = k_new.to(kf.dtype), v_new.to(vf.dtype)
        if f.src is not None:
            k_new, v_new = k_new.index_select(0, f.src), v_new.index_select(0, f.src)
        kf.index_copy_(0, f.rows, k_new)
        vf.index_copy_(0, f.rows, v_new)

    def attend(self, f: CopyForward, layer: int, q_rows: torch.Tensor, scale: float, window_left: int = -1,
               logits_soft_cap: float = 0.0) -> torch.Tensor:
        """``q_rows`` ``[B * q, Hq, D]`` (rotated) against each sequence's slots ``<=`` its row's
        position: ``out [B * q, Hq, D]`` (SDPA over the rows in place on the CPU route that takes
        it, which cannot soft-cap; else ``paged_attention`` through the forward's step). A window
        over overlapping positions follows :mod:`ragattn.kv.window` (refused unless it hides nothing)."""
        if window_left >= 0 and self.overlapping_positions:
            if f.last_slot is None:   # one host read per forward, only for such a request
                f.last_slot = int(f.positions.max()) if f.positions.numel() else -1
            check_window(window_left, True, f.last_slot)
        if f.cpu_sdpa and f.spans is not None and not logits_soft_cap:
            k4, v4 = self.head_views(layer)
            if k4 is not None:
                key = (window_left, q_rows.dtype)
                masks = f.masks.get(key)
                if masks is None:
                    masks = f.masks[key] = row_masks(f.spans, f.positions, f.q, window_left, q_rows.dtype)
                hq, d = q_rows.shape[1:]
                query = q_rows.view(f.batch, f.q, hq, d).transpose(1, 2)
                return rows_sdpa(query, k4, v4, masks, scale).reshape(f.batch * f.q, hq, d)
        return f.step.run(q_rows, f.positions, self.k[layer], self.v[layer], scale, window_left=window_left,
                          logits_soft_cap=logits_soft_cap)[0]
