"""The sliding-window rule of both request caches (:class:`~ragattn.kv.PagedKV`, the copy path, and
:class:`~ragattn.kv.TaggedPagedKV`, zero-copy).

A sliding window is by *position*: a query at position ``p`` sees a key at position ``k`` iff
``p - window_left <= k <= p`` (what RoPE measures, and what the kernels compute: slot ``j`` of a
plain cache holds position ``j``, a tagged page table names each slot's position). When every
position is held by at most one slot (reordered positions, gapped first positions) both caches
compute it. When positions overlap (composite: every chunk from position 0; overlapping first
positions) a window of ``W`` positions holds several tokens per position, which no model was
trained on, and the copy path, whose slots stand for positions, would window by slot instead: the
two disagree. So a windowed layer over overlapping positions is refused on both paths, unless the
window covers every slot a query may see (every query slot ``<= window_left``: then both rules see
every earlier slot and agree).
"""
from __future__ import annotations


def check_window(window_left: int, overlapping: bool, last_query_slot: int) -> None:
    """ValueError when a window of ``window_left`` hides a slot of a request whose positions
    overlap (``overlapping``) from a query at logical slot up to ``last_query_slot``."""
    if window_left >= 0 and overlapping and last_query_slot > window_left:
        raise ValueError(
            f"ragattn attention: a sliding window (window_left={window_left}) over a request whose chunks "
            f"share positions (composite positions: every chunk from 0) is not defined: a query at slot "
            f"{last_query_slot} would see the chunks by position, not by slot. Use distinct positions "
            f"(positions='reordered') for a model with sliding-window layers")
