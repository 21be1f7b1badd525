"""The one position-scheme type: where a request places its chunks.

    p = Positions.parse("reordered", "ragattn.ChunkStore.request", count=len(keys))
    firsts = p.first_positions(lens)      # each chunk's first position
    p.next_position(lens)                 # where the final block starts: after the furthest chunk end
    p.token_positions(lens, final_at=end) # each chunk token's position (moved: the final block at end)

Three schemes: ``"reordered"`` (chunk ``i`` from ``o_i``, chunk after chunk), ``"composite"``
(every chunk from 0), or each chunk's first position (a sequence of whole numbers >= 0: any scheme,
Block-Attention's offsets, gaps, overlaps). A request path accepts the schemes it can honour and
refuses the others (``named_only``): the copy path's slots stand for positions (a sliding window
counts slots there), so it takes the two named schemes; zero-copy requests, whose page table names
each page's position, take all three.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ragattn.store.errors import ChunkStoreError

NAMED = ("reordered", "composite")


def _whole_number(p) -> bool:
    """An int, an integral float or an integer tensor element; not a bool, 1.5 or a string."""
    try:
        return not isinstance(p, bool) and float(p).is_integer()
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Positions:
    """A parsed position scheme: ``scheme`` one of :data:`NAMED`, or ``"firsts"`` with ``firsts``
    (each chunk's first position)."""
    scheme: str
    firsts: Optional[tuple[int, ...]] = None

    @classmethod
    def parse(cls, positions, where: str, *, count: Optional[int] = None, named_only: bool = False,
              error: type = ChunkStoreError) -> "Positions":
        """``positions`` (a name, a sequence of first positions, or a :class:`Positions`) checked;
        ``count``: the chunks it must give first positions for; ``named_only``: refuse first
        positions (a path that cannot honour them). Raises ``error`` naming ``where``."""
        if isinstance(positions, Positions):
            positions = positions.scheme if positions.firsts is None else positions.firsts
        if isinstance(positions, str) or named_only:
            if isinstance(positions, str) and positions in NAMED:
                return cls(positions)
            allowed = "'reordered' or 'composite'" if named_only else \
                "'reordered', 'composite' or each chunk's first position"
            raise error(f"{where}: positions must be {allowed}, got {positions!r}")
        # whole numbers only: int() would truncate 1.5 to 1 silently (a bool is no position either)
        if not all(_whole_number(p) for p in positions):
            raise error(f"{where}: positions must be whole numbers, got {list(positions)}")
        firsts = tuple(int(p) for p in positions)
        if (count is not None and len(firsts) != count) or any(p < 0 for p in firsts):
            raise error(f"{where}: positions must give one first position >= 0 per chunk ({count}), "
                        f"got {list(positions)}")
        return cls("firsts", firsts)

    def first_positions(self, lens: Sequence[int]) -> list[int]:
        """Each chunk's first position, for chunks of ``lens`` tokens in request order."""
        if self.scheme == "composite":
            return [0] * len(lens)
        if self.scheme == "reordered":
            out, at = [], 0
            for n in lens:
                out.append(at)
                at += n
            return out
        return list(self.firsts)

    def next_position(self, lens: Sequence[int]) -> int:
        """Where the final block starts: after the furthest chunk end."""
        return max(f + n for f, n in zip(self.first_positions(lens), lens))

    def token_positions(self, lens: Sequence[int], final_at: Optional[int] = None) -> list[int]:
        """Each chunk token's position, chunk after chunk (chunks of ``lens`` tokens in request
        order). ``final_at``: the whole layout moved so that the final block starts there (RoPE
        attention depends on relative distances only: an engine that computes the final block at
        its prompt positions serves the scheme so)."""
        shift = 0 if final_at is None else final_at - self.next_position(lens)
        return [shift + f + j for f, n in zip(self.first_positions(lens), lens) for j in range(n)]
