"""Plain-torch reference of ``paged_attention_run`` over a position-tagged page list (zero-copy
chunk pages): each entry of a sequence's page list carries the position of its slot 0 and its
valid slots (``[entry_start, entry_len)``: a run of the page), and RoPE may be left to the
kernel: then slot ``o`` of every page holds its key rotated by ``o`` (page-local), and the key of
a slot at position ``p0 + o`` (``p0``: its entry's first position) is rotated here by ``p0`` more,
to ``p0 + o``.

Float64-capable; the attention itself is ``varlen_attention``'s reference (same mask semantics:
visible iff ``kv_pos <= q_pos`` and, with a window, ``kv_pos >= q_pos - window_left``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ragattn.reference.kv_cache import rope_rotate
from ragattn.reference.varlen_attention import varlen_attention


def table_slots(pages, row_start, kv_lens, page_size, entry_pos=None, entry_len=None, entry_start=None):
    """Per sequence, its valid slots as (page, offset, position) ``int64`` triples.

    Slot ``j < kv_lens[b]`` lies in entry ``e = row_start[b] + j // page_size`` (``row_start``
    None: row ``b`` of a padded ``pages [B, max_pages]``), at offset ``o = j % page_size``; it is
    valid iff ``entry_start[e] <= o < entry_len[e]`` (no ``entry_start``: from 0) and holds
    position ``entry_pos[e] + o`` (``entry_pos`` None: position ``j``). Returns a list of
    ``(pages [n], offsets [n], positions [n])``.
    """
    out = []
    for b, length in enumerate(kv_lens.tolist()):
        j = torch.arange(length, device=pages.device)
        if row_start is None:
            e = None
            page = pages[b].long()[j // page_size]
        else:
            e = int(row_start[b]) + j // page_size
            page = pages.long()[e]
        off = j % page_size
        valid = torch.ones_like(j, dtype=torch.bool)
        pos = j
        if entry_len is not None:
            valid = off < entry_len.long()[e]
        if entry_start is not None:
            valid = valid & (off >= entry_start.long()[e])
        if entry_pos is not None:
            pos = entry_pos.long()[e] + off
        out.append((page[valid], off[valid], pos[valid]))
    return out


def paged_attention_table(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    row_start: Optional[torch.Tensor],
    kv_lens: torch.Tensor,
    entry_pos: Optional[torch.Tensor] = None,
    entry_len: Optional[torch.Tensor] = None,
    inv_freq: Optional[torch.Tensor] = None,
    rotary_dim: int = 0,
    interleaved: bool = False,
    scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    *,
    entry_start: Optional[torch.Tensor] = None,
    upcast: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[total_q, H, D]`` (rows at ``q_pos``, already rotated) over each
    sequence's valid slots (``table_slots``; ``entry_start``: each entry's first valid slot); with
    ``inv_freq`` (float32 ``[rotary_dim // 2]``) each key, stored rotated by its page offset ``o``,
    is rotated by ``position - o`` first (to its position; ``rope_rotate``: angles in float64,
    products in float64; with ``upcast=False`` in float32 and rounded once to the keys' dtype, as
    the kernel does). Returns out like q and lse ``[total_q, H]``."""
    slots = table_slots(pages, row_start, kv_lens, k_cache.shape[1], entry_pos, entry_len, entry_start)
    ks, vs, ps = [], [], []
    for page, off, pos in slots:
        k = k_cache[page, off]
        if inv_freq is not None and rotary_dim > 0 and k.shape[0]:
            # stored rotated by the page offset `off`: rotated by the entry's first position
            # pos - off more. upcast=False is the same computation in the keys' dtype: rotated in
            # fp32, rounded once to that dtype, then attention in it
            k = rope_rotate(k.double() if upcast else k, pos - off, inv_freq, rotary_dim, interleaved,
                            compute_dtype=torch.float64 if upcast else torch.float32)
        ks.append(k)
        vs.append(v_cache[page, off])
        ps.append(pos)
    cu_k = torch.tensor([0] + torch.tensor([p.numel() for p in ps], dtype=torch.int64).cumsum(0).tolist(),
                        dtype=torch.int64, device=q.device)
    k = torch.cat(ks) if ks else k_cache.new_zeros((0,) + tuple(k_cache.shape[2:]))
    v = torch.cat(vs) if vs else v_cache.new_zeros((0,) + tuple(v_cache.shape[2:]))
    kv_pos = torch.cat(ps) if ps else torch.zeros(0, dtype=torch.int64, device=q.device)
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    else:
        k = k.to(q.dtype)
    out, lse = varlen_attention(q, k, v, cu_seqlens_q.long(), cu_k, q_pos.long(), kv_pos, None, None, True, scale,
                                window_left, logits_soft_cap, upcast=upcast)
    return out, lse
