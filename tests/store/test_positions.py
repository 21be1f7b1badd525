"""The one position-scheme type (ragattn.store.Positions) and the rule each request path keeps with
it: a request is answered by the scheme it asked for, never silently by another; the copy path
(assemble, whose slots stand for positions) refuses first positions, zero-copy requests take them."""
from __future__ import annotations

import pytest
import torch

from ragattn.store import ChunkStoreError, Positions


def test_parse_and_layout():
    lens = [3, 5, 2]
    r, c = Positions.parse("reordered", "w"), Positions.parse("composite", "w")
    assert r.first_positions(lens) == [0, 3, 8] and r.next_position(lens) == 10
    assert c.first_positions(lens) == [0, 0, 0] and c.next_position(lens) == 5
    f = Positions.parse(torch.tensor([4, 0, 20]), "w", count=3)
    assert f == Positions("firsts", (4, 0, 20)) and f.first_positions(lens) == [4, 0, 20]
    assert f.next_position(lens) == 22 and Positions.parse(f, "w", count=3) == f
    assert Positions.parse([2.0, 7], "w", count=2).firsts == (2, 7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_positions_follow_the_firsts(seed):
    """Each chunk token at its chunk's first position + its index; ``final_at`` moves the layout so
    that the final block starts there and keeps every distance to it."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    firsts = torch.randint(0, 30, (len(lens),), generator=g).tolist()
    for p in (Positions("reordered"), Positions("composite"), Positions("firsts", tuple(firsts))):
        want = [f + j for f, n in zip(p.first_positions(lens), lens) for j in range(n)]
        assert p.token_positions(lens) == want
        end = sum(lens) + 3
        moved = p.token_positions(lens, final_at=end)
        assert [end - x for x in moved] == [p.next_position(lens) - x for x in want]


@pytest.mark.parametrize("bad, match", [
    ("shuffled", "'reordered', 'composite' or each chunk's first position, got 'shuffled'"),
    ([1.5, 2], "whole numbers"), ([True, 2], "whole numbers"), (["a", 2], "whole numbers"),
    ([1], r"one first position >= 0 per chunk \(2\)"), ([0, -1], r"one first position >= 0 per chunk \(2\)"),
])
def test_parse_refuses(bad, match):
    with pytest.raises(ChunkStoreError, match=f"^where: positions must .*{match}"):
        Positions.parse(bad, "where", count=2)


@pytest.mark.parametrize("bad", ["shuffled", [0, 3], Positions("firsts", (0, 3))])
def test_named_only_refuses_first_positions(bad):
    with pytest.raises(ValueError, match="positions must be 'reordered' or 'composite', got") as info:
        Positions.parse(bad, "ragattn.methods.turborag.answer", named_only=True, error=ValueError)
    assert type(info.value) is ValueError


def test_each_store_path_answers_by_the_scheme_asked_for():
    from ragattn.store import ChunkStore
    from tests.store.test_resident_loader import _spec

    store = ChunkStore(_spec([]), page_size=4, memory_budget=1 << 20)
    keys = store.add([[1, 2, 3], [4, 5, 6, 7, 8]])
    with pytest.raises(ChunkStoreError, match="assemble: positions must be 'reordered' or 'composite', got"):
        store.assemble(keys, positions=[0, 3])                       # the copy path cannot honour them
    with store.request(keys, positions=[6, 0], extra_slots=2) as req:
        assert req.positions.tolist() == [6, 7, 8, 0, 1, 2, 3, 4] and req.next_position == 9
    for scheme in ("reordered", "composite"):
        a = store.assemble(keys, positions=scheme, extra_slots=2)
        with store.request(keys, positions=scheme, extra_slots=2) as z:
            assert torch.equal(a.positions, z.positions) and a.next_position == z.next_position
