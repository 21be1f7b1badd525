"""Pinning and eviction with zero-copy requests, a property test: random sequences of
adding chunks (churn through a small budget), opening requests (any scheme), recomputing into them
(copy on write), decoding into their private pages and releasing them. After every step: no page
of a live request (its chunks' shared pages, its private pages) was evicted, freed or written by
anyone else; no page is used twice; the pool stays within its budget, shared pages counted once."""
import pytest
import torch

from ragattn.hf.registration import use_ragattn
from ragattn.hf.models import random_llama
from ragattn.store import ChunkStore, ChunkStoreError

hyp = pytest.importorskip("hypothesis")
st = hyp.strategies

SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=50, max_position_embeddings=128, rope_theta=1000.0)
PAGE, BUDGET_PAGES = 2, 10
_BASE = {}


def _model():
    if "m" not in _BASE:
        _BASE["m"] = random_llama(SHAPE, dtype=torch.float32, seed=12).eval()
    return _BASE["m"]


def _tokens(i):
    g = torch.Generator().manual_seed(2000 + i)
    return torch.randint(1, SHAPE["vocab_size"], (1 + i % 5,), generator=g).tolist()


OPS = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 14), min_size=1, max_size=3)),
    st.tuples(st.just("request"), st.lists(st.integers(0, 14), min_size=1, max_size=3),
              st.sampled_from(["reordered", "composite", "gapped"])),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("recompute"), st.integers(0, 7), st.integers(0, 1 << 16)),
    st.tuples(st.just("decode"), st.integers(0, 7)),
)


def _pages(parts):
    return [(id(slab), p) for slab, pages, _ in parts for p in pages]


def _snapshot(store, req):
    """Every (segment, page) entry of the request's table and its raw K/V content now."""
    c = req.cache
    snap = {}
    for e, (s, p) in enumerate(zip(c.e_seg, c.e_page)):
        ks, vs = c.segments[s]
        snap[e] = (id(ks[0]), p, [t[p].clone() for t in ks + vs])
    return snap


def _check(store, live):
    pool = store._pool
    free = {(id(s), p) for s in pool.slabs for p in s.free}
    used = []
    for e in store._resident.entries.values():
        used += _pages(e.parts)
    for req, snap, shared_keys in live:
        c = req.cache
        for key in shared_keys:           # pinned chunks are never evicted
            assert key in store._resident.entries and store._resident.entries[key].pins > 0
        slab_of = {id(s.k_pages[0]): s for s in pool.slabs}
        for e, (seg_id, page, content) in snap.items():
            s = c.e_seg[e]
            ks, vs = c.segments[s]
            if id(ks[0]) != seg_id or c.e_page[e] != page:
                continue                  # copied on write since: checked below as a private page
            assert seg_id in slab_of, "a live request's slab was released"
            assert (id(slab_of[seg_id]), page) not in free, "a live request's page went back to the free list"
            if c.e_fixed[e]:              # chunk pages: nobody writes them (private pages grow)
                # (bytes, not values: the slots past a chunk's last valid one hold whatever the
                # memory held, NaN included, and NaN != NaN)
                assert all(torch.equal(a.view(torch.uint8), t[page].view(torch.uint8)) for a, t in zip(content, ks + vs))
        private = [(id(slab_of[id(c.segments[s][0][0])]), p)
                   for s, p, shared in zip(c.e_seg, c.e_page, c.e_shared) if not shared]
        assert not set(private) & free
        used += private
    assert len(used) == len(set(used)), "a page is used twice"
    assert not set(used) & free
    assert store.pool_bytes <= store.memory_budget


@hyp.settings(max_examples=40, deadline=None, suppress_health_check=list(hyp.HealthCheck))
@hyp.given(st.lists(OPS, min_size=1, max_size=14))
def test_pinned_pages_are_never_evicted(ops):
    model = _model()
    store = ChunkStore(model, page_size=PAGE, memory_budget=BUDGET_PAGES * PAGE * ChunkStore(model).row_bytes)
    live = []
    for op in ops:
        if op[0] == "add":
            try:
                store.add([_tokens(i) for i in op[1]])
            except ChunkStoreError as exc:    # every page pinned by live requests
                assert "too small" in str(exc)
        elif op[0] == "request":
            keys = [store.key(_tokens(i)) for i in op[1]]
            try:
                store.add([_tokens(i) for i in op[1]])
                lens = [len(_tokens(i)) for i in op[1]]
                scheme = [3 * i + 7 * (i % 2) for i in range(len(lens))] if op[2] == "gapped" else op[2]
                req = store.request(keys, scheme, extra_slots=4)
            except ChunkStoreError as exc:
                assert "too small" in str(exc) or "budget" in str(exc)
                continue
            live.append((req, _snapshot(store, req), set(keys)))
        elif op[0] == "release" and live:
            req = live.pop(op[1] % len(live))[0]
            req.release()
            assert req.released
        elif op[0] == "recompute" and live:
            from ragattn.methods.fusionrag import recompute

            req = live[op[1] % len(live)][0]
            g = torch.Generator().manual_seed(op[2])
            n = min(req.num_slots, 3)
            slots = torch.randperm(req.num_slots, generator=g)[:n].sort().values
            try:
                with use_ragattn(model):
                    recompute(model, req.cache, torch.randint(1, 50, (n,), generator=g), slots,
                              positions=req.positions[slots].long())
            except ChunkStoreError as exc:    # no page left for the copy: nothing written
                assert "too small" in str(exc)
        elif op[0] == "decode" and live:
            from ragattn.methods.generate import paged_forward

            req = live[op[1] % len(live)][0]
            c = req.cache
            if int(c.lengths[0]) < c.capacity:
                at = int(c.lengths[0]) - req.num_slots
                paged_forward(model, torch.tensor([[7]]), torch.tensor([req.next_position + at]), c)
        _check(store, live)
    for req, _, _ in live:
        req.release()
    assert all(e.pins == 0 for e in store._resident.entries.values())
    assert sum(len(s.free) for s in store._pool.slabs) + sum(len(_pages(e.parts)) for e in store._resident.entries.values()) \
        == sum(s.pages for s in store._pool.slabs)
