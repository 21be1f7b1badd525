"""Batched requests over shared chunk pages: position-tagged entries, rows a request holds in its
own pages (copy on write by rows), and the passes of one attention step merged by LSE.

A request reads its chunks from pages other requests share (keys page-local: slot ``o`` rotated
by ``o``) and its own tokens from its own pages (keys rotated at their positions). Rows it
recomputed below its first own page cannot overwrite the shared pages: they are *held*, packed in
the request's first own pages (held row ``i`` at slot ``i``), and the chunk pages are read as runs
around them (``PageTable`` entries with ``entry_start``)::

    chunk page 7 (shared):  | a  b  c  d  e  f  g  h |      request A recomputed c and f:
    A's entries:  (7, from a, slots 0-1) (7, slots 3-4) (7, slots 6-7)   shared, keys page-local
                  (12, slot 0 at c's position) (12, slot 1 at f's)       own page 12: c', f'

One step over a batch whose rows may read chunk pages::

    e = SharedEntries.build(spans, chunk_blocks, page_size, positions=None, held=(), held_blocks=())
    private, shared = entry_tables([e, None, ...], block_table, seq_lens, page_size)
    step = PassStep((private, shared), cu_q, max_q_len, rope)           # once per step
    out, lse = step.run(q, q_pos, k_cache, v_cache, scale, window_left, logits_soft_cap, out=, lse_out=)

:func:`run_passes` is the merge of passes (any number: segments of :class:`ragattn.kv.TaggedPagedKV`,
the private and shared passes here), exact by LSE (``merge_attention_states``). ``rope``: an object
with the model's ``inv_freq`` (float32 ``[rotary_dim // 2]``), ``rotary_dim`` and ``interleaved``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import torch

from ragattn.ops import PagedAttentionStep, PageTable, merge_attention_states
from ragattn.ops.page_table import num_pages, page_index, page_offset, page_row, slot_rows


@dataclass(frozen=True)
class SharedEntries:
    """One request's chunk pages as position-tagged entries: ``private_from``
    (slots below it are read from the entries, the rest from the request's own blocks), and
    int32 ``[E]`` ``pages`` / ``first_pos`` / ``start`` / ``valid`` (the slots ``[start, valid)``
    of each page, slot ``o`` at position ``first_pos + o``). ``held``: the entries of the rows
    below ``private_from`` the request holds in its own blocks (recomputed), the same four
    tensors (keys rotated at their positions, as the model writes them), or None."""
    private_from: int
    pages: torch.Tensor
    first_pos: torch.Tensor
    valid: torch.Tensor
    start: torch.Tensor | None = None
    held: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, spans: Sequence[tuple[int, int]], chunk_blocks: Sequence[Sequence[int]], block_size: int,
              positions: torch.Tensor | None = None, held: Sequence[int] = (),
              held_blocks: Sequence[int] = ()) -> "SharedEntries":
        """``spans``: the chunks' prompt ranges (tiling ``[0, end)``), ``chunk_blocks`` their pages,
        ``positions`` int64 ``[end]`` each token's RoPE position (None: its index). ``held``: sorted
        prompt indices below ``private_from`` read from the request's own ``held_blocks`` instead
        (index ``held[i]`` at slot ``i % block_size`` of ``held_blocks[i // block_size]``)."""
        end = spans[-1][1]
        private_from = end - page_offset(end, block_size)
        held = [int(t) for t in held]
        if any(b <= a for a, b in zip(held, held[1:])) or (held and not 0 <= held[0] <= held[-1] < private_from):
            raise ValueError(f"ragattn.kv.SharedEntries: held rows must be sorted, distinct and below {private_from}")
        if len(held_blocks) * block_size < len(held):
            raise ValueError(f"ragattn.kv.SharedEntries: {len(held)} held rows need "
                             f"{num_pages(len(held), block_size)} blocks, got {len(held_blocks)}")
        is_held = set(held)
        pos = (lambda t: t) if positions is None else (lambda t: int(positions[t]))   # noqa: E731
        pages, first, start, valid = [], [], [], []
        for (s, e), blocks in zip(spans, chunk_blocks):
            for i, blk in enumerate(blocks):
                a = s + i * block_size
                n = min(block_size, e - a, private_from - a)
                if n <= 0:
                    break
                run = 0
                for o in range(n + 1):   # the runs of slots [run, o) between held rows
                    if o == n or a + o in is_held:
                        if o > run:
                            pages.append(blk), first.append(pos(a)), start.append(run), valid.append(o)
                        run = o + 1
        as_t = lambda x: torch.tensor(x, dtype=torch.int32)   # noqa: E731
        own = None
        if held:   # held row i at slot i % block_size of held_blocks[i // block_size]: slot 0 at pos - i
            i = torch.arange(len(held))
            off = page_offset(i, block_size).to(torch.int32)
            own = (torch.as_tensor(held_blocks, dtype=torch.int32)[page_index(i, block_size)],
                   as_t([pos(t) for t in held]) - off,
                   off, off + 1)
        return cls(private_from, as_t(pages), as_t(first), as_t(valid), as_t(start) if held else None, own)

    def slots(self, pos: torch.Tensor, block_ids: Sequence[int], block_size: int) -> torch.Tensor:
        """int64 ``[n]``: the cache slot the request writes each of the prompt positions ``pos``
        (int64 ``[n]``, sorted) to: by position in its ``block_ids`` or, for a held row, its held slot."""
        slots = slot_rows(list(block_ids), pos, block_size)
        if self.held is not None:
            page, first, start, _ = (t.to(pos.device, torch.int64) for t in self.held)
            below = pos < self.private_from
            i = torch.searchsorted(first + start, pos[below])   # (held entries: one row each, sorted)
            slots[below] = page_row(page[i], start[i], block_size)
        return slots


def entry_tables(found: Sequence[SharedEntries | None], block_table: torch.Tensor, seq_lens: torch.Tensor,
                 block_size: int) -> tuple[PageTable, PageTable]:
    """``(private, shared)`` tables of batch rows reading chunk pages through ``found`` (None: a
    row that does not). Private: each row's own blocks from its ``private_from`` on (by position)
    and its held rows (keys rotated, no RoPE in the kernel); shared: its chunk entries (keys
    page-local)."""
    dev = block_table.device
    b = len(found)
    first_block = torch.tensor([0 if e is None else page_index(e.private_from, block_size) for e in found],
                               dtype=torch.int64)
    lens = seq_lens[:b].to(torch.int64).cpu()
    n_pages = (num_pages(lens, block_size) - first_block).clamp(min=0)
    rows = torch.repeat_interleave(torch.arange(b), n_pages)
    offset = torch.cumsum(n_pages, 0) - n_pages
    idx = torch.arange(int(n_pages.sum())) - offset[rows] + first_block[rows]
    pos = idx * block_size
    own = (block_table[:b].cpu()[rows, idx].to(torch.int32), pos.to(torch.int32),
           torch.zeros_like(pos, dtype=torch.int32), torch.clamp(lens[rows] - pos, max=block_size).to(torch.int32))
    held = [e.held if e is not None and e.held is not None else None for e in found]
    has_held = any(h is not None for h in held)
    if has_held:   # each row's held entries after its own blocks
        n_held = torch.tensor([0 if h is None else h[0].numel() for h in held], dtype=torch.int64)
        rows = torch.cat([rows, torch.repeat_interleave(torch.arange(b), n_held)])
        order = torch.sort(rows, stable=True).indices
        own = tuple(torch.cat([x] + [h[i] for h in held if h is not None])[order] for i, x in enumerate(own))
        n_pages = n_pages + n_held
    private = PageTable.from_entries(_indptr(n_pages).to(dev), own[0].to(dev), own[1].to(dev), own[3].to(dev),
                                     block_size, own[2].to(dev) if has_held else None)
    empty = torch.zeros(0, dtype=torch.int32)
    runs = any(e is not None and e.start is not None for e in found)
    parts = [(e.pages, e.first_pos, e.valid, e.start if e.start is not None else torch.zeros_like(e.pages))
             if e is not None else (empty,) * 4 for e in found]
    counts = torch.tensor([p[0].numel() for p in parts], dtype=torch.int64)
    cat = [torch.cat([p[i] for p in parts]).to(dev) for i in range(4)]
    shared = PageTable.from_entries(_indptr(counts).to(dev), *cat[:3], block_size, cat[3] if runs else None)
    return private, shared


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])


class Pass(NamedTuple):
    """One pass of an attention step: ``step`` over the pages ``k``/``v`` (``[pages, page_size,
    Hkv, D]``); ``rope``: None (keys stored rotated at their positions) or the model's RoPE (keys
    page-local, rotated in the kernel to their entry's position)."""
    step: PagedAttentionStep
    k: torch.Tensor
    v: torch.Tensor
    rope: object = None


def run_passes(passes: Iterable[Pass], q: torch.Tensor, q_pos: torch.Tensor, scale: float, *,
               window_left: int = -1, logits_soft_cap: float = 0.0, out: torch.Tensor | None = None,
               lse_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``q`` ``[n, Hq, D]`` at ``q_pos`` against every pass, merged exactly by LSE: ``(out [n, Hq, D],
    lse float32 [n, Hq])``, written into ``out``/``lse_out`` where given; ``(None, None)`` without a
    pass. One pass runs straight into ``out``/``lse_out``."""
    passes = list(passes)
    res = lse = None
    for i, p in enumerate(passes):
        last = i == len(passes) - 1
        rope = {} if p.rope is None else dict(inv_freq=p.rope.inv_freq.to(q.device), rotary_dim=p.rope.rotary_dim,
                                              interleaved=p.rope.interleaved)
        direct = dict(out=out, lse_out=lse_out) if last and i == 0 else {}
        o, l = p.step.run(q, q_pos, p.k, p.v, scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                          **rope, **direct)
        if res is None:
            res, lse = o, l
        else:
            res, lse = merge_attention_states(res, lse, o, l, **(dict(out=out, lse_out=lse_out) if last else {}))
    return res, lse


class PassStep:
    """A step's two passes over one cache: the rows' own pages by position (keys rotated) and their
    chunk pages as entries (keys page-local, rotated in the kernel with ``rope``), from the
    ``(private, shared)`` tables of :func:`entry_tables`."""

    def __init__(self, tables: tuple[PageTable, PageTable], cu_q: torch.Tensor, max_q_len: int, rope):
        self.steps = tuple(PagedAttentionStep(cu_q, t, max_q_len=max_q_len) for t in tables)
        self.rope = rope

    def run(self, q, q_pos, k, v, scale, *, window_left=-1, logits_soft_cap=0.0, out=None, lse_out=None):
        """:func:`run_passes` of the two passes on the layer's ``k``/``v`` pages."""
        private, shared = self.steps
        return run_passes((Pass(private, k, v), Pass(shared, k, v, self.rope)), q, q_pos, scale,
                          window_left=window_left, logits_soft_cap=logits_soft_cap, out=out, lse_out=lse_out)


__all__ = ["SharedEntries", "entry_tables", "Pass", "PassStep", "run_passes"]
