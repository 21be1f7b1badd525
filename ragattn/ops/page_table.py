"""``ragattn.PageTable``: the one page-table input of ``paged_attention``'s plan/run pair.

Engines hand over a sequence's pages in one of two forms; both normalise, without a copy or a
host sync, to what the kernels read: a page list ``pages`` and, per sequence, where its list starts
and how many slots it holds::

    padded block_table [B, max_pages]            FlashInfer CSR: indptr [B + 1], indices [E],
    (vLLM, ragattn's HF cache)                   last_page_len [B]
      seq 0: | 7 | 2 | 9 | - |                     indptr  = [0,        3,    5]
      seq 1: | 4 | 0 | - | - |                     indices = [7, 2, 9,  4, 0]
                                                   last_page_len = [5, 16]   (page_size 16)
      pages = block_table (row b at b * stride)    pages = indices, row_start = indptr[:-1]
      kv_lens given                                kv_lens = (count - 1) * page_size + last_page_len

    slot j of sequence b  ->  page pages[row_start[b] + j // page_size], offset j % page_size
    (padded: pages[b, j // page_size]); slot j holds position j.

Only the first ``ceil(kv_lens[b] / page_size)`` entries of a sequence are ever read; sequences
may share entries or pages (a shared prefix), and pages may come in any order.

Position-tagged entries (zero-copy chunk pages, ``from_entries``): each entry of a flat list also
carries the position of its slot 0 and its count of valid slots, so a slot's position comes from
its entry, not its index, and any position scheme is just a table (chunks that all start at 0,
consecutive ones, gaps), with partial pages anywhere::

    entries (page, first position, valid):  (3, 0, 16) (5, 16, 10) | (1, 0, 16) (6, 16, 10) | (2, 52, 4)
                                             chunk A, 26 tokens       chunk B, 26 tokens       question
    slot j of entry e holds position entry_pos[e] + j % page_size if j % page_size < entry_len[e]

An entry may also start past slot 0 (``entry_start``): it is then a run of its page, the slots
``[entry_start[e], entry_len[e])``. Two requests read one shared page whole, or around the rows
one of them holds privately (recomputed rows: a private page gives their own entries)::

    entries (page, first position, start, valid); shared page 3, slot 0 at position 40:
                                  | a  b  c  d  e  f  g  h |
    request A, all of it:         (3, 40, 0, 8)                                a .. h at 40 .. 47
    request B, d and f its own:   (3, 40, 0, 3) (3, 40, 4, 5) (3, 40, 6, 8)    + (9, 43, 0, 1) (9, 44, 1, 2):
                                                                               d', f' in its page 9
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ragattn.ops._validate import INDEX_DTYPES, check_tensor

_OP = "PageTable"


@dataclass(frozen=True)
class PageTable:
    """A batch's page lists, as ``paged_attention``'s kernels read them.

    Attributes:
        pages: int32/int64, ``[B, max_pages]`` (a padded block table, ``row_start`` None) or
            ``[num_entries]`` (a flat page list, with ``row_start``): physical page ids into the
            caches' first dim.
        kv_lens: int32/int64 ``[B]``, cached slots per sequence.
        row_start: None, or int32/int64 ``[B]``: index in ``pages`` of each sequence's first
            entry (its logical page 0).
        entry_pos, entry_len: None, or int32/int64 ``[num_entries]`` beside a flat ``pages``: the
            position of each entry's slot 0, and its count of valid slots (``from_entries``).
        entry_start: None, or int32/int64 ``[num_entries]``: the first valid slot of each entry
            (its valid slots are then ``[entry_start, entry_len)``; None: from slot 0).

    Build it with ``from_block_table`` or ``from_csr``; neither copies nor syncs.
    """

    pages: torch.Tensor
    kv_lens: torch.Tensor
    row_start: Optional[torch.Tensor] = None
    entry_pos: Optional[torch.Tensor] = None
    entry_len: Optional[torch.Tensor] = None
    entry_start: Optional[torch.Tensor] = None

    @property
    def batch(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def is_padded(self) -> bool:
        return self.row_start is None

    @property
    def is_tagged(self) -> bool:
        """Entries carry their positions, valid counts or first slots (``from_entries``)."""
        return self.entry_pos is not None or self.entry_len is not None or self.entry_start is not None

    @classmethod
    def from_block_table(cls, block_table: torch.Tensor, kv_lens: torch.Tensor) -> "PageTable":
        """vLLM's / ragattn's form: ``block_table`` int32/int64 ``[B, max_pages]`` (slot ``j`` of
        sequence ``b`` at page ``block_table[b, j // page_size]``), ``kv_lens`` int32/int64 ``[B]``."""
        check_tensor(_OP, "block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
        check_tensor(_OP, "kv_lens", kv_lens, dtypes=INDEX_DTYPES, shape=(block_table.shape[0],),
                     device=block_table.device)
        return cls(pages=block_table, kv_lens=kv_lens)

    @classmethod
    def from_csr(cls, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                 page_size: int) -> "PageTable":
        """FlashInfer's form (``paged_kv_indptr`` / ``paged_kv_indices`` / ``paged_kv_last_page_len``).

        Args:
            indptr: int32/int64 ``[B + 1]``, sequence ``b``'s pages are ``indices[indptr[b]:indptr[b + 1]]``.
            indices: int32/int64 ``[num_entries]``, physical page ids.
            last_page_len: int32/int64 ``[B]``, valid slots of each sequence's last page, in
                ``[1, page_size]`` (ignored for a sequence with no page).
            page_size: slots per page (the caches' dim 1).

        ``kv_lens`` is computed on the device (``(count - 1) * page_size + last_page_len``, 0 for
        a sequence with no page): no host sync. Values are checked where the op reads them (on
        CPU, or with ``RAGATTN_DEBUG=1``): ``indptr`` from 0, non-decreasing, within ``indices``.
        """
        check_tensor(_OP, "indptr", indptr, dtypes=INDEX_DTYPES, ndim=1)
        if indptr.shape[0] < 1:
            raise ValueError(f"ragattn.{_OP}: indptr must have at least one entry (batch + 1)")
        dev = indptr.device
        batch = indptr.shape[0] - 1
        check_tensor(_OP, "indices", indices, dtypes=INDEX_DTYPES, ndim=1, device=dev)
        check_tensor(_OP, "last_page_len", last_page_len, dtypes=INDEX_DTYPES, shape=(batch,), device=dev)
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"ragattn.{_OP}: page_size must be a positive int, got {page_size!r}")
        if dev.type == "cpu" and indptr.device.type != "meta":
            _check_csr_values(indptr, indices, last_page_len, page_size)
        count = indptr[1:] - indptr[:-1]
        kv_lens = torch.where(count > 0, (count - 1) * page_size + last_page_len, torch.zeros_like(count))
        return cls(pages=indices, kv_lens=kv_lens.to(torch.int32), row_start=indptr[:-1])

    @classmethod
    def from_entries(cls, indptr: torch.Tensor, pages: torch.Tensor, first_pos: torch.Tensor,
                     valid: torch.Tensor, page_size: int, start: Optional[torch.Tensor] = None) -> "PageTable":
        """Position-tagged page lists: sequence ``b``'s entries are ``indptr[b]:indptr[b + 1]``,
        entry ``e`` is (page ``pages[e]``, its slot 0 at position ``first_pos[e]``, valid slots
        ``[start[e], valid[e])``; slot ``o`` at position ``first_pos[e] + o``). Shared chunk pages
        and a request's private pages mix freely; ``start`` reads a run of a page (around rows a
        request holds elsewhere).

        Args:
            indptr: int32/int64 ``[B + 1]``; pages, first_pos, valid: int32/int64 ``[num_entries]``.
            page_size: slots per page (the caches' dim 1).
            start: None (every entry from slot 0), or int32/int64 ``[num_entries]``.

        ``kv_lens`` (on the device, no sync) counts each sequence's slots as ``entries * page_size``;
        slots outside an entry's ``[start, valid)`` are never read. Values are checked on CPU
        (``first_pos >= 0``, ``valid`` in ``[0, page_size]``, ``start`` in ``[0, valid]``) and by
        the op with ``RAGATTN_DEBUG=1``.
        """
        check_tensor(_OP, "indptr", indptr, dtypes=INDEX_DTYPES, ndim=1)
        if indptr.shape[0] < 1:
            raise ValueError(f"ragattn.{_OP}: indptr must have at least one entry (batch + 1)")
        dev = indptr.device
        check_tensor(_OP, "pages", pages, dtypes=INDEX_DTYPES, ndim=1, device=dev)
        for name, t in (("first_pos", first_pos), ("valid", valid)):
            check_tensor(_OP, name, t, dtypes=INDEX_DTYPES, shape=tuple(pages.shape), device=dev)
        if start is not None:
            check_tensor(_OP, "start", start, dtypes=INDEX_DTYPES, shape=tuple(pages.shape), device=dev)
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"ragattn.{_OP}: page_size must be a positive int, got {page_size!r}")
        if dev.type == "cpu":
            ptr = indptr.tolist()
            if ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[-1] > pages.shape[0]:
                raise ValueError(
                    f"ragattn.{_OP}: indptr must start at 0, never decrease and end within pages "
                    f"({pages.shape[0]} entries), got {ptr[0]} .. {ptr[-1]}")
            _check_entry_values(first_pos, valid, page_size, start)
        kv_lens = ((indptr[1:] - indptr[:-1]) * page_size).to(torch.int32)
        return cls(pages=pages, kv_lens=kv_lens, row_start=indptr[:-1], entry_pos=first_pos, entry_len=valid,
                   entry_start=start)



# ----- the page arithmetic every cache shares (one home; see the slot rule in the module docstring) -----
def page_offset(rows, page_size: int):
    """A slot's (or a flat row's) offset in its page: ``rows % page_size`` (a tensor or an int).
    Page-local keys are rotated by it."""
    return rows % page_size


def page_index(rows, page_size: int):
    """The page a flat row lies in (or a logical slot's index in its page list): ``rows //
    page_size`` (a tensor or an int)."""
    return rows // page_size


def page_row(pages, offsets, page_size: int):
    """The flat row (a cache viewed as ``[num_pages * page_size, ...]``) of slot ``offsets`` of page
    ``pages``: ``pages * page_size + offsets`` (tensors or ints)."""
    return pages * page_size + offsets


def num_pages(slots, page_size: int):
    """Pages that hold ``slots`` slots: ``ceil(slots / page_size)`` (an int, or elementwise for an
    int tensor)."""
    return -(-slots // page_size)


def page_rows(pages, page_size: int) -> torch.Tensor:
    """int64 ``[len(pages) * page_size]`` (CPU for a list): every flat row of ``pages`` (a list
    or an int tensor), page after page."""
    p = torch.as_tensor(pages, dtype=torch.int64)
    return page_row(p[:, None], torch.arange(page_size, device=p.device), page_size).reshape(-1)


def slot_rows(pages, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """int64 flat rows of logical ``slots`` of a page list: slot ``j`` lies in page
    ``pages[j // page_size]`` at offset ``j % page_size``. ``pages``: ``[max_pages]`` (a list or
    an int tensor) with ``slots`` of any shape, or ``[B, max_pages]`` with ``slots`` ``[B, n]``."""
    s = slots.long()
    p = torch.as_tensor(pages, device=s.device).long()
    idx = page_index(s, page_size)
    return page_row(p[idx] if p.dim() == 1 else p.gather(-1, idx), page_offset(s, page_size), page_size)

def _check_entry_values(first_pos, valid, page_size, start=None) -> None:
    """Position-tagged entries: first positions >= 0, valid counts in [0, page_size], first valid
    slots in [0, valid] (``valid`` None: page_size)."""
    if first_pos.numel() and int(first_pos.min()) < 0:
        raise ValueError(f"ragattn.{_OP}: first_pos must be >= 0, got min {int(first_pos.min())}")
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) > page_size):
        raise ValueError(f"ragattn.{_OP}: valid must lie in [0, page_size = {page_size}], "
                         f"got {int(valid.min())} .. {int(valid.max())}")
    if start is not None and start.numel():
        end = valid.long() if valid.numel() else torch.full_like(start, page_size, dtype=torch.int64)
        bad = (start.long() < 0) | (start.long() > end)
        if bool(bad.any()):
            e = int(bad.nonzero()[0, 0])
            raise ValueError(f"ragattn.{_OP}: start must lie in [0, valid] (entry {e}: start {int(start[e])}, "
                             f"valid {int(end[e])})")


def _check_csr_values(indptr, indices, last_page_len, page_size) -> None:
    """FlashInfer's CSR invariants (one host read each; CPU tensors or the debug mode)."""
    ptr = indptr.tolist()
    if ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[-1] > indices.shape[0]:
        raise ValueError(
            f"ragattn.{_OP}: indptr must start at 0, never decrease and end within indices "
            f"({indices.shape[0]} entries), got {ptr[0]} .. {ptr[-1]}")
    last = last_page_len.tolist()
    for b, n in enumerate(l1 - l0 for l0, l1 in zip(ptr, ptr[1:])):
        if n > 0 and not 1 <= last[b] <= page_size:
            raise ValueError(
                f"ragattn.{_OP}: last_page_len must lie in [1, page_size = {page_size}] for a sequence "
                f"with pages, got {last[b]} for sequence {b}")
