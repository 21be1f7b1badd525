"""The zero-copy request cache: a request attends to shared chunk pages in place, positions in its page table.

A :class:`TaggedPagedKV` is a batch-1 request cache whose keys are all stored *page-local* (slot
``o`` of a page holds its key rotated by ``o``, whatever the page's position) and whose slots live
on pages it does not own: the pages of the chunk store's pool (shared with every
other request that retrieved the same chunks) and private pages (the question, the answer, and
copies of shared pages that selective recompute writes to: copy on write). Its page table is a
list of entries (page, first position, valid slots) (``ragattn.PageTable.from_entries``), so the
position of a slot comes from its entry, never from its index; the attention kernel moves each
page to its entry's first position ``p0`` in fp32 (``run_paged_attention(..., inv_freq=...)``: on
the CPU it rotates the query by ``-p0`` once per entry, since ``R(m) q . R(p0 + o) k = R(m - p0) q .
R(o) k``). One rule holds for every slot: shared or private, chunk or question, its key is
rotated by its page offset.

Logical slots (what the methods index, as with :class:`~ragattn.kv.PagedKV`): the
request's tokens in prompt order, dense, ``0 .. lengths[0] - 1``; slot ``t`` lies in entry
``slot_entry[t]`` at offset ``slot_off[t]``. A chunk of ``n`` tokens occupies ``ceil(n / page_size)``
entries (its last one partial), the private area ``capacity - chunk tokens`` slots on whole pages::

    logical slots   0 ........ 25 | 26 ...... 51 | 52 ... (question, answer)
    entries         (p3, 0, 16)     (p1, 0, 16)     (q0, 26, 16)  <- private, valid grows
                    (p5, 16, 10)    (p6, 16, 10)    (q1, .., 0)
                    chunk A (shared) chunk B (shared, composite: from 0 again)

Visibility is by position: a query row at position ``p`` sees every valid slot at a position
``<= p`` (and within a sliding window). For appended rows (the final block, the answer) on every
scheme, and for recomputed chunk rows on reordered positions, this is exactly the slot-causal rule
of :class:`PagedKV`. Recomputed rows (``slots``) whose positions do not follow slot order
(composite, first positions out of order or overlapping) attend by slot instead, as the copy path
does, in a dense pass over the request's K/V (:meth:`TaggedPagedKV._attend_by_slot`). A sliding window is by
position too, and refused where positions overlap unless it hides nothing (:mod:`ragattn.kv.window`,
the rule of both caches).

The pages may live in several tensors (the pool's slabs and a request's private pages come from
one allocator, but a pool may have several slabs): one ``run_paged_attention`` per tensor
("segment") holding some of the request's entries, merged exactly by their LSEs
(``merge_attention_states``); usually one.

The owner (the chunk store's ``ChunkStore.request``) builds it with :meth:`add_entries` and
:meth:`add_private`, gives ``alloc_page`` (one private page for copy on write) and releases the
pages when the request ends (:meth:`close` turns every later use into an error).

One forward, every layer (the interface :class:`ragattn.kv.PagedKV` shares)::

    f = cache.plan(first_layer, q, positions, slots=None, valid=None)   # positions: int [q]
    cache.write(f, layer, k_rows, v_rows)          # [q, Hkv, D], keys rotated at their positions
    out = cache.attend(f, layer, q_rows, scale, window_left, logits_soft_cap)   # [q, Hq, D]

``positions`` is the one name of a token's RoPE position from the store to the kernel: an
entry's ``positions`` (of its slot 0), a slot's, a query row's.
"""
from __future__ import annotations

import bisect
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from ragattn import ops as _ops
from ragattn.kv.shared_entries import Pass, run_passes
from ragattn.kv.window import check_window
from ragattn.ops import PagedAttentionStep
from ragattn.ops.page_table import page_offset, page_row, page_rows


class ZeroCopyForward:
    """What every layer of one forward shares: where the new tokens go (``writes``: per segment
    the new tokens, their rows and the rotation deltas ``offset - position`` that put their keys in
    the page-local form), the query rows'
    ``positions`` and one attention step per segment holding entries (``steps``); for the
    window rule (:mod:`ragattn.kv.window`) the filled slots' positions, the last query slot and
    whether positions overlap (computed at the first windowed layer); ``by_slot``: ``(written
    slots, filled)`` for a recompute whose rows would see other slots by position than by slot
    (:meth:`TaggedPagedKV._slot_order_differs`), else None."""
    __slots__ = ("key", "q", "src", "writes", "positions", "cu_q", "steps", "filled_positions", "last_slot",
                 "overlapping", "by_slot")


class TaggedPagedKV:
    """A batch-1 zero-copy request cache (see the module docstring).

    ``lengths`` int32 ``[1]``: slots filled (chunk slots count as filled); ``capacity``: slots in
    all. ``inv_freq`` float32 ``[rotary_dim // 2]``, ``rotary_dim``, ``interleaved``: the model's
    RoPE (``ragattn.hf.rope.rope_params``). ``alloc_page()`` -> ``(k_layers, v_layers, page)``: a
    fresh private page of a segment (per layer ``[num_pages, page_size, Hkv, D]`` tensors)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 device, inv_freq: torch.Tensor, rotary_dim: int, interleaved: bool,
                 alloc_page: Optional[Callable[[], tuple]] = None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self.inv_freq = inv_freq.to(self.device, torch.float32).contiguous()
        self.rotary_dim, self.interleaved = int(rotary_dim), bool(interleaved)
        self.alloc_page = alloc_page
        self.lengths = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.segments: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._rows: dict = {}   # (segment, layer) -> its K, V as [rows, Hkv, D] (the views write copies into)
        self._seg_of: dict[int, int] = {}
        # entries (host lists): segment, page, position of slot 0, valid slots, fixed (a chunk's:
        # its valid count never changes) or private-growing, shared (not this request's page)
        self.e_seg: list[int] = []
        self.e_page: list[int] = []
        self.e_positions: list[int] = []
        self.e_len: list[int] = []
        self.e_fixed: list[bool] = []
        self.e_shared: list[bool] = []
        self.e_slot0: list[int] = []          # logical slot of the entry's offset 0
        self.e_span: list[int] = []           # logical slots the entry spans (its valid count, or a whole page)
        # per logical slot: entry, offset in it, position (-1: private, not written); built from the
        # entries by _slots() (the entries appended since: one vectorised extension, not tensors per entry)
        self.slot_entry = self.slot_off = self.slot_positions = None
        self._slots_built = 0                 # entries the slot tensors cover
        self.capacity = 0
        self.cow_pages = 0                    # shared pages copied on write so far
        self._entries = None                  # _entry_tensors' cache
        self.closed = False
        self._fwd: Optional[ZeroCopyForward] = None
        # what the last accepted forward left for the next decode step (_decode_forward): the
        # entries it planned over, every entry's valid count and first position, per segment its
        # entries in use and their table tensors and step; None until a forward is planned
        self._live: Optional[dict] = None

    # ----- building -------------------------------------------------------------------------
    def segment(self, k_layers, v_layers) -> int:
        """Index of the segment whose per-layer page tensors are ``k_layers``/``v_layers``."""
        key = id(k_layers[0])
        s = self._seg_of.get(key)
        if s is None:
            for t in (*k_layers, *v_layers):
                if t.dim() != 4 or tuple(t.shape[1:]) != (self.page_size, self.num_kv_heads, self.head_dim):
                    raise ValueError(f"ragattn TaggedPagedKV: segment pages must be [pages, {self.page_size}, "
                                     f"{self.num_kv_heads}, {self.head_dim}], got {tuple(t.shape)}")
            if len(k_layers) != self.num_layers or len(v_layers) != self.num_layers:
                raise ValueError(f"ragattn TaggedPagedKV: a segment needs {self.num_layers} K and V layers")
            s = self._seg_of[key] = len(self.segments)
            self.segments.append((list(k_layers), list(v_layers)))
        return s

    def add_entries(self, k_layers, v_layers, pages, positions, valid, shared: bool = True) -> None:
        """Append chunk entries (``pages``, ``positions`` of their slot 0, ``valid`` slots:
        equal-length int lists) of one segment; their ``sum(valid)`` slots become the next logical
        slots, filled."""
        s = self.segment(k_layers, v_layers)
        for p, f, n in zip(pages, positions, valid):
            if not 0 < n <= self.page_size or f < 0:
                raise ValueError(f"ragattn TaggedPagedKV: an entry needs 1..{self.page_size} valid slots and a "
                                 f"first position >= 0, got {n} and {f}")
            self._append(s, int(p), int(f), int(n), fixed=True, shared=shared)
        self.lengths += int(sum(valid))

    def add_private(self, k_layers, v_layers, pages) -> None:
        """Append private pages (whole, empty): room for the tokens written later."""
        s = self.segment(k_layers, v_layers)
        for p in pages:
            self._append(s, int(p), 0, self.page_size, fixed=False, shared=False)

    def _append(self, s, page, pos, n, fixed, shared):
        e = len(self.e_seg)
        self.e_seg.append(s)
        self.e_page.append(page)
        self.e_positions.append(pos)
        self.e_len.append(n if fixed else 0)
        self.e_fixed.append(fixed)
        self.e_shared.append(shared)
        self.e_slot0.append(self.capacity)
        self.e_span.append(n)
        self.capacity += n
        self._entries = None

    def _entry_tensors(self) -> dict:
        """The entries as int64 CPU tensors (rebuilt after entries are added or copied on write):
        segment, page, first position and valid slots as built (a private entry's are set per
        forward), first logical slot; the private entries and their logical slots."""
        if self._entries is None:
            t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
            fixed = torch.tensor(self.e_fixed, dtype=torch.bool)
            entry = self._slots()[0]
            priv = (~fixed).nonzero()[:, 0]
            self._entries = dict(seg=t(self.e_seg), page=t(self.e_page), pos=t(self.e_positions), len=t(self.e_len),
                                 slot0=t(self.e_slot0), fixed=fixed, private=priv,
                                 private_slots=(~fixed[entry]).nonzero()[:, 0] if entry.numel() else entry)
        return self._entries

    def _slots(self):
        """``(slot_entry, slot_off, slot_positions)`` int64 ``[capacity]``, extended by the entries
        appended since the last call (the positions written into private slots so far are kept)."""
        e0, e1 = self._slots_built, len(self.e_seg)
        if self.slot_entry is None or e0 < e1:
            t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
            span, slot0 = t(self.e_span[e0:e1]), t(self.e_slot0[e0:e1])
            entry = torch.repeat_interleave(torch.arange(e1 - e0), span)      # new entries, 0-based
            first = slot0[0] if e1 > e0 else 0
            off = torch.arange(int(span.sum())) - (slot0 - first)[entry]
            fixed = torch.tensor(self.e_fixed[e0:e1], dtype=torch.bool)[entry]
            pos = torch.where(fixed, t(self.e_positions[e0:e1])[entry] + off, -1)
            if self.slot_entry is None:
                self.slot_entry, self.slot_off, self.slot_positions = entry + e0, off, pos
            else:
                self.slot_entry = torch.cat([self.slot_entry, entry + e0])
                self.slot_off = torch.cat([self.slot_off, off])
                self.slot_positions = torch.cat([self.slot_positions, pos])
            self._slots_built = e1
        return self.slot_entry, self.slot_off, self.slot_positions

    def close(self) -> None:
        """The request ended: its owner takes the pages back; any later use is an error."""
        self.closed = True
        self.segments = []
        self._rows = {}
        self._fwd = None
        self._live = None

    def _check_open(self):
        if self.closed:
            raise ValueError("ragattn TaggedPagedKV: the request was released (its pages went back to the "
                             "chunk store); make a new one")

    # ----- reading ----------------------------------------------------------------------------
    @property
    def slot_pos(self):
        """(Former name of ``slot_positions``: int64 ``[capacity]``, each slot's position, -1 unwritten.)"""
        return self.slot_positions

    @property
    def private_pages(self) -> int:
        """Pages this request owns (question/answer pages and copies made on write)."""
        return sum(1 for s in self.e_shared if not s)

    def positions(self) -> torch.Tensor:
        """int64 ``[lengths[0]]``: the RoPE position of each filled slot (-1: private, not written)."""
        return self._slots()[2][: int(self.lengths[0])].clone()

    def slot_location(self, slots: torch.Tensor):
        """``(segment [n], flat row [n], position [n])`` int64 (CPU) of logical ``slots``."""
        entry, off, pos = self._slots()
        s = slots.detach().to("cpu", torch.int64)
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= self.capacity):
            raise ValueError(f"ragattn TaggedPagedKV: slots must lie in [0, {self.capacity}), "
                             f"got {int(s.min())} .. {int(s.max())}")
        e = entry[s]
        E = self._entry_tensors()
        seg = E["seg"][e]
        row = page_row(E["page"][e], off[s], self.page_size)
        return seg, row, pos[s]

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer ``layer``'s K, V at logical ``slots``: ``[n, Hkv, D]`` each, keys rotated
        from their page offsets to their slots' positions (fp32 rotation), as a plain cache holds them."""
        self._check_open()
        seg, row, pos = self.slot_location(slots)
        n = seg.numel()
        k = torch.empty(n, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        for s in seg.unique().tolist():
            sel = (seg == s).nonzero()[:, 0]
            ks, vs = self.segments[s]
            r = row[sel].to(self.device)
            k[sel.to(self.device)] = ks[layer].view(-1, self.num_kv_heads, self.head_dim).index_select(0, r)
            v[sel.to(self.device)] = vs[layer].view(-1, self.num_kv_heads, self.head_dim).index_select(0, r)
        if n:
            delta = (pos - page_offset(row, self.page_size)).to(self.device)
            _ops.rerotate_keys_([k], torch.arange(n, device=self.device), delta, self.inv_freq,
                                self.rotary_dim, self.interleaved)
        return k, v

    # ----- one forward ----------------------------------------------------------------------
    def _cow(self, entries) -> None:
        """Copy the shared pages of ``entries`` into fresh private pages (every layer, K and V) and
        point the entries at them: the pages a recompute is about to write."""
        if not entries:
            return
        if self.alloc_page is None:
            raise ValueError("ragattn TaggedPagedKV: writing to shared chunk pages needs copy on write "
                             "(alloc_page), this cache has none")
        # every page first: if the pool runs out, no entry points at a page not yet filled
        fresh = [self.alloc_page() for _ in entries]
        moves: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for e, (k_layers, v_layers, page) in zip(entries, fresh):
            s = self.segment(k_layers, v_layers)
            moves.setdefault((self.e_seg[e], s), []).append((self.e_page[e], int(page)))
            self.e_seg[e], self.e_page[e], self.e_shared[e] = s, int(page), False
            self.cow_pages += 1
        self._entries = None
        for (a, b), pairs in moves.items():
            src = page_rows([p for p, _ in pairs], self.page_size)
            dst = page_rows([q for _, q in pairs], self.page_size)
            (sk, sv), (dk, dv) = self.segments[a], self.segments[b]
            _ops.copy_kv_(dk, dv, sk, sv, src.to(self.device), dst.to(self.device))

    def begin_forward(self, q: int, positions: torch.Tensor, slots: Optional[torch.Tensor] = None,
                      valid: Optional[torch.Tensor] = None) -> ZeroCopyForward:
        """Plan one forward of ``q`` new tokens at RoPE ``positions`` (int ``[q]``): appended after
        ``lengths[0]`` (``valid`` bool ``[1, q]``: only those written), or written at logical
        ``slots`` (int ``[q]``, distinct, ``< lengths[0]``: selective recompute; a shared page
        among them is copied on write first). Made at the forward's first layer (a few host reads)
        and reused by the others while ``slots`` is the same object."""
        self._check_open()
        if q == 1 and slots is None and (valid is None or bool(valid.all())):
            f = self._decode_forward(positions)
            if f is not None:
                return f
        entry, off, slot_positions = self._slots()
        pos = positions.detach().reshape(-1).to("cpu", torch.int64)
        if pos.numel() != q:
            raise ValueError(f"ragattn TaggedPagedKV: {q} new tokens need {q} positions, got {pos.numel()}")
        if q and int(pos.min()) < 0:
            raise ValueError(f"ragattn TaggedPagedKV: positions must be >= 0, got {int(pos.min())}")
        length = int(self.lengths[0])
        src = None
        if slots is None:
            if valid is not None and not bool(valid.all()):
                src = valid.reshape(-1).nonzero()[:, 0].cpu()
            n = q if src is None else src.numel()
            if length + n > self.capacity:
                raise ValueError(f"ragattn attention: paged request cache full ({self.capacity} slots), "
                                 f"cannot append {n} tokens")
            w = torch.arange(length, length + n, dtype=torch.int64)
            filled = length + n
        else:
            w = slots.detach().reshape(-1).to("cpu", torch.int64)
            if w.numel() != q:
                raise ValueError(f"ragattn attention: ragattn_slots must be [q] = [{q}], got {tuple(slots.shape)}")
            if q and (int(w.min()) < 0 or int(w.max()) >= length):
                raise ValueError(f"ragattn attention: ragattn_slots must lie in [0, lengths[0] = {length}), "
                                 f"got {int(w.min())} .. {int(w.max())}")
            if torch.unique(w).numel() != w.numel():
                raise ValueError("ragattn attention: ragattn_slots may not repeat a slot")
            filled = length
        written = pos if src is None else pos[src]
        we = entry[w]
        fixed = self._entry_tensors()["fixed"][we]
        if bool(fixed.any()):
            # a chunk slot keeps its position (its entry says where it is): a recompute at another
            # position would be rotated wrongly, silently
            bad = fixed & (slot_positions[w] != written)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"ragattn TaggedPagedKV: slot {int(w[i])} is a chunk slot at position "
                                 f"{int(slot_positions[w[i]])}, written at position {int(written[i])}")
            self._cow(sorted({int(e) for e in we[fixed].tolist() if self.e_shared[e]}))
        committed, slot_positions = slot_positions, slot_positions.clone()   # kept only when accepted
        slot_positions[w] = written
        # private entries: valid = their filled slots, positions consecutive from the first
        # (vectorised: a decode step at a long context has thousands of entries)
        E = self._entry_tensors()
        seg_of, page_of, e_positions, lens = E["seg"], E["page"], E["pos"].clone(), E["len"].clone()
        priv, pslots = E["private"], E["private_slots"]
        if priv.numel():
            s0 = E["slot0"][priv]
            nv = (filled - s0).clamp(0, self.page_size)
            lens[priv] = nv
            e_positions[priv] = torch.where(nv > 0, slot_positions[s0], 0)
            r = pslots[pslots < filled]
            bad = (slot_positions[r] < 0) | (slot_positions[r] != e_positions[entry[r]] + off[r])
            if bool(bad.any()):
                i = int(r[bad][0])
                e = int(entry[i])
                s_a, n_e = self.e_slot0[e], int(lens[e])
                raise ValueError(
                    f"ragattn TaggedPagedKV: the positions of a private page's slots must be consecutive "
                    f"(slots {s_a}..{s_a + n_e - 1} hold {slot_positions[s_a: s_a + n_e].tolist()}): a zero-copy page "
                    "has one first position")
        committed.copy_(slot_positions)
        f = ZeroCopyForward()
        f.by_slot = None
        if slots is not None and q and self._slot_order_differs(slot_positions[:filled], w, written):
            f.by_slot = (w.to(self.device), filled)
        f.q, f.src = q, None if src is None else src.to(self.device)
        f.filled_positions, f.overlapping = slot_positions[:filled], None
        f.last_slot = int(w.max()) if w.numel() else -1
        rows = page_row(page_of[we], off[w], self.page_size)
        segs = seg_of[we]
        f.writes = []
        for s in segs.unique().tolist():
            sel = (segs == s).nonzero()[:, 0]
            # a key is stored page-local: rotated from its position to its page offset as it is copied in
            to_local = off[w][sel] - written[sel]
            f.writes.append((s, sel.to(self.device), rows[sel].to(self.device), to_local.to(self.device)))
        f.positions = pos.to(self.device)
        f.cu_q = torch.tensor([0, q], dtype=torch.int32, device=self.device)
        live = dict(entries=self._entries, filled=filled, pos=e_positions.tolist(), len=lens.tolist(), segs={})
        f.steps = []
        for s in range(len(self.segments)):
            use = ((seg_of == s) & (lens > 0)).nonzero()[:, 0]
            if use.numel() == 0:
                continue
            seg = live["segs"][s] = dict(use=use.tolist(), page=page_of[use], pos=e_positions[use], len=lens[use])
            f.steps.append((s, self._segment_step(seg, f.cu_q, q)))
        f.key = (id(slots), q)
        self._fwd, self._live = f, live
        return f

    def _segment_step(self, seg: dict, cu_q: torch.Tensor, q: int) -> PagedAttentionStep:
        """The attention step of the forward's ``q`` query rows (``cu_q`` int32 ``[0, q]``) over one
        segment's entries in use (``seg``: their pages, first positions and valid counts, int64 CPU
        tensors)."""
        ptr = torch.tensor([0, len(seg["use"])], dtype=torch.int32)
        table = _ops.PageTable.from_entries(ptr.to(self.device), seg["page"].to(self.device),
                                            seg["pos"].to(self.device), seg["len"].to(self.device), self.page_size)
        # the sizes are known here: a plan reads nothing from the device (no sync)
        return PagedAttentionStep(cu_q, table, max_q_len=q, max_kv_len=len(seg["use"]) * self.page_size)

    def _decode_forward(self, positions: torch.Tensor) -> Optional[ZeroCopyForward]:
        """:meth:`begin_forward` of one token appended (a decode step) in a few host operations: only
        the entry that receives the token changes since the last forward (its valid count, and its
        first position when the token opens it), so the other segments keep their steps and the
        checks cover the new slot alone (every earlier slot passed them when it was written). None
        where this does not apply (no earlier forward over the same entries and slots filled, as
        after a rollback of ``lengths``; the next slot not on a private page): the general path
        plans it."""
        live = self._live
        if live is None or live["entries"] is not self._entries:
            return None
        pos = positions.detach().reshape(-1)
        if pos.numel() != 1:
            raise ValueError(f"ragattn TaggedPagedKV: 1 new token needs 1 position, got {pos.numel()}")
        p = int(pos[0])
        if p < 0:
            raise ValueError(f"ragattn TaggedPagedKV: positions must be >= 0, got {p}")
        w = int(self.lengths[0])
        if w != live["filled"]:   # (lengths moved back, a rollback: the general path recounts every entry)
            return None
        if w + 1 > self.capacity:
            raise ValueError(f"ragattn attention: paged request cache full ({self.capacity} slots), "
                             f"cannot append 1 tokens")
        e = bisect.bisect_right(self.e_slot0, w) - 1
        if self.e_fixed[e]:
            return None
        o = w - self.e_slot0[e]   # the new slot's offset in its (private) page
        first = live["pos"][e]
        if o > 0 and p != first + o:
            s_a = self.e_slot0[e]
            held = self.slot_positions[s_a: w].tolist()
            raise ValueError(
                f"ragattn TaggedPagedKV: the positions of a private page's slots must be consecutive "
                f"(slots {s_a}..{w} hold {held + [p]}): a zero-copy page has one first position")
        live = dict(live, filled=w + 1, pos=list(live["pos"]), len=list(live["len"]), segs=dict(live["segs"]))
        live["pos"][e], live["len"][e] = (p if o == 0 else first), o + 1
        s = self.e_seg[e]
        seg = live["segs"].get(s)
        if o > 0:   # the entry is in use: its valid count grows by one
            n = seg["len"].clone()
            n[seg["use"].index(e)] = o + 1
            seg = dict(seg, len=n)
        else:       # the token opens the entry: it joins its segment's entries in use
            use = sorted((seg["use"] if seg else []) + [e])
            of_use = lambda xs: torch.tensor([xs[i] for i in use], dtype=torch.int64)  # noqa: E731
            seg = dict(use=use, page=of_use(self.e_page), pos=of_use(live["pos"]), len=of_use(live["len"]))
        live["segs"][s] = seg
        # the other segments' steps are the last forward's, when it too had one query row (its
        # steps and self._live were made together); segments in the general path's order
        prev = dict(self._fwd.steps) if self._fwd is not None and self._fwd.q == 1 else {}
        f = ZeroCopyForward()
        f.q, f.src, f.key, f.by_slot = 1, None, (id(None), 1), None
        f.cu_q = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
        f.steps = [(t, prev[t] if t != s and t in prev else self._segment_step(sg, f.cu_q, 1))
                   for t, sg in sorted(live["segs"].items())]
        self.slot_positions[w] = p
        f.filled_positions, f.overlapping, f.last_slot = self.slot_positions[: w + 1], None, w
        row = page_row(self.e_page[e], o, self.page_size)
        idx = torch.tensor([0, row, o - p], dtype=torch.int64, device=self.device)
        # a key is stored page-local: rotated from its position to its page offset as it is copied in
        f.writes = [(s, idx[0:1], idx[1:2], idx[2:3])]
        f.positions = pos.to(self.device, torch.int64)
        self._fwd, self._live = f, live
        return f

    @staticmethod
    def _slot_order_differs(filled_positions: torch.Tensor, w: torch.Tensor, written: torch.Tensor) -> bool:
        """Whether a row written at slot ``w[i]`` (position ``written[i]``) would see, by position,
        another set of slots than ``0 .. w[i]`` (its slot-causal set, the copy path's and the
        ``ragattn_slots`` contract's): an earlier slot at a later position (composite, first
        positions out of order) or a later slot at a position not after its own (overlaps).
        ``filled_positions`` int64 ``[filled]``, ``w``, ``written`` int64 ``[q]`` (CPU)."""
        earlier_later = torch.cummax(filled_positions, 0).values[w] > written
        seen = torch.searchsorted(torch.sort(filled_positions).values, written, right=True)
        return bool((earlier_later | (seen != w + 1)).any())

    def _attend_by_slot(self, f: ZeroCopyForward, layer: int, q_rows: torch.Tensor, scale: float,
                        window_left: int, logits_soft_cap: float) -> torch.Tensor:
        """Attention of a recompute's rows ``q_rows`` ``[q, Hq, D]`` (rotated at their positions)
        slot-causally: row ``i`` sees the filled slots ``0 .. w[i]``, as on the copy path, where
        position order and slot order disagree. Every filled slot's K/V read at its position
        (:meth:`read_kv`), one dense pass in fp32 (fp64 for fp64 queries). A window that would
        hide a slot is refused (:func:`check_window`: positions that overlap or run backwards)."""
        w, filled = f.by_slot
        check_window(window_left, True, f.last_slot)
        k, v = self.read_kv(layer, torch.arange(filled))
        dt = torch.float64 if q_rows.dtype == torch.float64 else torch.float32
        group = q_rows.shape[1] // self.num_kv_heads
        k, v = k.to(dt).repeat_interleave(group, 1), v.to(dt).repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q_rows.to(dt), k) * scale
        if logits_soft_cap:
            s = torch.tanh(s / logits_soft_cap) * logits_soft_cap
        s = s.masked_fill(torch.arange(filled, device=s.device)[None, :] > w[:, None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).to(q_rows.dtype)

    def plan(self, first_layer: bool, q: int, positions, slots=None, valid=None) -> ZeroCopyForward:
        """:meth:`begin_forward` at a forward's first layer, its plan reused by the others (while
        ``slots`` is the same object)."""
        f = self._fwd
        if first_layer or f is None or f.key != (id(slots), q):
            f = self.begin_forward(q, positions, slots, valid)
        return f

    forward_plan = plan   # (its former name)

    def write(self, f: ZeroCopyForward, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the forward's new K (rotated at its positions, as the model made it: stored
        rotated by its page offset) and V ``[q, Hkv, D]`` of ``layer`` into their pages."""
        if f.src is not None:
            k_new, v_new = k_new.index_select(0, f.src), v_new.index_select(0, f.src)
        if not f.writes:
            return
        k_new, v_new = k_new.to(self.dtype).contiguous(), v_new.to(self.dtype).contiguous()
        for s, sel, rows, to_local in f.writes:
            dst = self._rows.get((s, layer))
            if dst is None:
                ks, vs = self.segments[s]
                shape = (-1, self.num_kv_heads, self.head_dim)
                dst = self._rows[(s, layer)] = ([ks[layer].view(shape)], [vs[layer].view(shape)])
            # one pass: K rotated to its page offset (in fp32, rounded once) and V, into their rows
            _ops.copy_kv_(dst[0], dst[1], [k_new], [v_new], sel, rows, to_local, self.inv_freq, self.rotary_dim,
                          self.interleaved)

    def attend(self, f: ZeroCopyForward, layer: int, q_rows: torch.Tensor, scale: float, window_left: int = -1,
               logits_soft_cap: float = 0.0) -> torch.Tensor:
        """``q_rows`` ``[q, Hq, D]`` (rotated) against every valid slot at a position ``<=`` its row's:
        one paged attention step per segment (pages moved to their positions in the kernel),
        merged by LSE. Returns ``[q, Hq, D]``. A window over overlapping positions follows
        :mod:`ragattn.kv.window` (refused unless it hides nothing). Rows written at chunk slots
        whose positions do not follow slot order attend by slot instead (:meth:`_attend_by_slot`)."""
        if f.by_slot is not None:
            return self._attend_by_slot(f, layer, q_rows, scale, window_left, logits_soft_cap)
        if window_left >= 0:
            if f.overlapping is None:   # once per forward: does a position hold two filled slots?
                p = f.filled_positions[f.filled_positions >= 0]
                f.overlapping = torch.unique(p).numel() != p.numel()
            check_window(window_left, f.overlapping, f.last_slot)
        q_rows = q_rows.contiguous()
        rope = SimpleNamespace(inv_freq=self.inv_freq, rotary_dim=self.rotary_dim, interleaved=self.interleaved)
        out, _ = run_passes((Pass(step, self.segments[s][0][layer], self.segments[s][1][layer], rope)
                             for s, step in f.steps), q_rows, f.positions, scale, window_left=window_left,
                            logits_soft_cap=logits_soft_cap)
        if out is None:
            return q_rows.new_zeros(q_rows.shape)
        return out
