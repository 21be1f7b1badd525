"""Tier or recompute: the cost model (ragattn.store.cost.TierCosts) and the loader's choice by it.
The choice follows the model (per tier, per chunk length, in add, get and pin), the default reads
the tiers always, and the chunk's K/V is the same whichever path brought it."""
import math
import os

import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.store import TIERS_FIRST, ChunkStore, ChunkStoreError, TierCosts

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=512, rope_theta=1000.0)
SECRET = b"fleet-secret-0123456789"
RECOMPUTE = TierCosts(disk=(1.0, 0.0), remote=(1.0, 0.0), recompute=(0.0, 0.0))   # recomputing is free


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, dtype=torch.float32, seed=3).eval()


def _chunks(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in lens]


def _evict_all(store, seed=99):
    """Fill the pool with other chunks until none of the earlier ones is resident."""
    before = store.stats["evicted"]
    store.add(_chunks(seed, [store.memory_budget // store.row_bytes]))
    assert store.stats["evicted"] > before


def _close(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_costs_validate_model_and_fit():
    with pytest.raises(ValueError, match="recompute costs must be >= 0"):
        TierCosts(recompute=(-1.0, 0.0))
    with pytest.raises(ValueError, match="disk costs must be >= 0"):
        TierCosts(disk=(float("nan"), 0.0))
    with pytest.raises(ValueError, match="seconds per chunk, seconds per unit"):
        TierCosts(remote=(1.0,))
    with pytest.raises(ValueError, match="tier must be one of"):
        TierCosts().tier_s("tape", 10)
    c = TierCosts(disk=(2e-3, 1e-9), remote=(5e-3, 3e-9), recompute=(1e-3, 1e-5))
    row = 4096
    assert c.tier_s("disk", 1000) == pytest.approx(2e-3 + 1e-6)
    assert c.recompute_s(100) == pytest.approx(2e-3)
    # below the crossover recomputing is cheaper, above it the tier
    x = c.crossover_tokens("disk", row)
    assert x == pytest.approx((2e-3 - 1e-3) / (1e-5 - 1e-9 * row))
    assert c.prefer_recompute("disk", int(x) - 1, row) and not c.prefer_recompute("disk", int(x) + 1, row)
    assert not TIERS_FIRST.prefer_recompute("disk", 1, row) and TIERS_FIRST.crossover_tokens("remote", row) == 0
    # a fit recovers noisy lines; negative terms are clipped
    g = torch.Generator().manual_seed(5)
    xs = [37.0, 113.0, 301.0, 777.0]
    pts = [(x, 3e-3 + 2e-6 * x + 1e-9 * float(torch.rand(1, generator=g))) for x in xs]
    f = TierCosts.fit({"recompute": pts, "disk": [(1e6, 1e-3), (3e6, 3e-3)]})
    assert f.recompute == pytest.approx((3e-3, 2e-6), rel=1e-3)
    assert f.disk[0] == pytest.approx(0.0, abs=1e-9) and f.disk[1] == pytest.approx(1e-9)
    assert f.remote == (0.0, 0.0)
    flat = TierCosts.fit({"disk": [(10.0, 5e-3), (20.0, 4e-3)]})
    assert flat.disk == (pytest.approx(4.5e-3), 0.0)
    with pytest.raises(ValueError, match="unknown source"):
        TierCosts.fit({"tape": [(1, 1)]})


def test_store_refuses_costs_of_another_type(model):
    with pytest.raises(ChunkStoreError, match="costs must be a ragattn.store.TierCosts"):
        ChunkStore(model, costs={"disk": (0, 0)})


@pytest.mark.parametrize("how", ["get", "request", "add"])
def test_choice_follows_the_model_and_kv_is_unchanged(model, tmp_path, how):
    """A chunk on disk, evicted: TIERS_FIRST reads it (bit-exact); a model where recomputing is
    cheaper recomputes it (no file read, none written) to the same K/V within rounding."""
    chunks = _chunks(1, [45, 19])
    ref = ChunkStore(model)
    keys = ref.add(chunks)
    page = ref.row_bytes * 16
    for costs, recomputed in ((None, False), (RECOMPUTE, True)):
        d = tmp_path / ("r" if recomputed else "t")
        store = ChunkStore(model, d, memory_budget=8 * page, costs=costs)
        assert store.add(chunks) == keys
        files = {k: os.stat(store.directory / f"{k}.safetensors") for k in keys}
        _evict_all(store)
        assert not any(k in store._resident.entries for k in keys)
        loaded, computed = store.stats["loaded"], store.stats["computed"] + store.stats["recomputed"]
        if how == "get":
            kv = [store.kv(k) for k in keys]
        elif how == "request":
            store.assemble(keys, "reordered").cache   # pins both: one pass of the miss order
            kv = [store.kv(k) for k in keys]
        else:
            assert store.add(chunks) == keys
            kv = [store.kv(k) for k in keys]
        if recomputed:
            assert store.stats["recompute_chosen"] == 2 and store.stats["loaded"] == loaded
            assert store.stats["computed"] + store.stats["recomputed"] == computed + 2
            assert store.stats["recompute_s"] > 0
            for k in keys:                     # the file the disk holds is neither read nor rewritten
                st = os.stat(store.directory / f"{k}.safetensors")
                assert (st.st_mtime_ns, st.st_ino) == (files[k].st_mtime_ns, files[k].st_ino)
                assert store._resident.entries[k].on_disk
            for key, got in zip(keys, kv):
                _close(got, ref.kv(key))
        else:
            assert store.stats["recompute_chosen"] == 0 and store.stats["loaded"] == loaded + 2
            assert store.stats["disk_s"] > 0
            for key, got in zip(keys, kv):
                for x, y in zip(got, ref.kv(key)):
                    assert torch.equal(x, y)


def test_choice_by_chunk_length_in_one_request(model, tmp_path):
    """Crossover at 64 tokens: of one request's two evicted chunks, the short one is recomputed and
    the long one read from disk; the assembled request equals a fresh store's."""
    row = ChunkStore(model).row_bytes
    costs = TierCosts(disk=(64e-3, 0.0), recompute=(0.0, 1e-3 + 0.0 * row))
    assert costs.crossover_tokens("disk", row) == pytest.approx(64)
    chunks = _chunks(2, [23, 141])
    store = ChunkStore(model, tmp_path, memory_budget=16 * 16 * row, costs=costs)
    keys = store.add(chunks)
    _evict_all(store)
    got = store.assemble(keys, "reordered")
    assert store.stats["recompute_chosen"] == 1 and store.stats["loaded"] == 1
    ref_store = ChunkStore(model)
    ref = ref_store.assemble(ref_store.add(chunks), "reordered")
    assert torch.equal(got.positions, ref.positions) and got.chunk_lens == ref.chunk_lens
    for key in keys:
        _close(store.kv(key), ref_store.kv(key))


def test_choice_over_the_remote_tier(model, remote):
    """Without a directory: an evicted chunk is fetched from the remote tier by default, recomputed
    (and not published again) when the model says recomputing is cheaper."""
    pytest.importorskip("redis")
    chunks = _chunks(4, [30, 52])
    page = ChunkStore(model).row_bytes * 16
    kvs = {}
    for costs in (None, RECOMPUTE):
        s = ChunkStore(model, remote=remote.url, remote_secret=SECRET, memory_budget=8 * page, costs=costs)
        keys = s.add(chunks)
        _evict_all(s, seed=50 + (costs is None))
        hits, published, chosen = (s.stats[k] for k in ("remote_hits", "remote_published", "recompute_chosen"))
        kvs[costs is None] = [s.kv(k) for k in keys]
        if costs is None:
            assert s.stats["remote_hits"] == hits + 2 and s.stats["remote_s"] > 0
        else:
            assert s.stats["remote_hits"] == hits and s.stats["recompute_chosen"] == chosen + 2
            assert s.stats["remote_published"] == published
    for a, b in zip(kvs[True], kvs[False]):
        _close(a, b)


def test_measure_calibrates_on_the_model(model):
    c = TierCosts.measure(model, tokens=(8, 40), chunks=2)
    assert all(math.isfinite(v) and v >= 0 for v in (*c.disk, *c.recompute))
    assert c.recompute_s(40) > 0 and c.tier_s("disk", 40 * ChunkStore(model).row_bytes) > 0
    with pytest.raises(ValueError, match="lengths >= 1"):
        TierCosts.measure(model, tokens=(0,), chunks=1)
