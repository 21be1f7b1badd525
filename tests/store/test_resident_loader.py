"""The chunk store's parts on their own: the resident set over the page pool (page-local keys, LRU,
pins, what holds the pool) and the loader's miss policy (memory, disk, remote, recompute), over a
hand-made model description (no HF model)."""
from __future__ import annotations

import pytest
import torch

from ragattn.reference.kv_cache import rope_rotate
from ragattn.store import ChunkModel, ChunkStoreError, Rope, chunk_key
from ragattn.store.disk_tier import DiskTier
from ragattn.store.loader import Loader
from ragattn.store.page_pool import PagePool
from ragattn.store.resident import ResidentSet

L, HKV, D, PS = 2, 2, 8, 4
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
LAYOUT = (L, HKV, D, torch.float32)


def _kv(tokens):
    """K/V a fixed function of each token id, keys rotated at 0..n-1 (per layer [n, Hkv, D])."""
    table = torch.randn(64, L, 2, HKV, D, generator=torch.Generator().manual_seed(0))
    t = torch.as_tensor(tokens, dtype=torch.int64)
    kv = table[t]
    pos = torch.arange(t.numel())
    return ([rope_rotate(kv[:, l, 0], pos, INV_FREQ, D, False) for l in range(L)],
            [kv[:, l, 1].clone() for l in range(L)])


def _spec(calls, fingerprint="toy-1"):
    def prefill(ids, positions, cu):
        calls.append(cu.tolist())
        ks, vs = [], []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            k, v = _kv(ids[a:b])
            ks.append(k)
            vs.append(v)
        return [torch.cat(x) for x in zip(*ks)], [torch.cat(x) for x in zip(*vs)]
    return ChunkModel(fingerprint=fingerprint, num_layers=L, num_kv_heads=HKV, head_dim=D, dtype=torch.float32,
                      device="cpu", rope=Rope(INV_FREQ, D, False), max_positions=256, vocab_size=64, prefill=prefill)


def _pool(pages):
    row_bytes = 2 * L * HKV * D * 4
    return PagePool(L, HKV, D, torch.float32, torch.device("cpu"), PS, pages * PS * row_bytes, 256)


def _resident(pages, evicted=None):
    stats = {"evicted": 0}
    hook = None if evicted is None else (lambda key, e: evicted.append(key))
    return ResidentSet(_pool(pages), Rope(INV_FREQ, D, False), stats, hook), stats


def _same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


# ----- the resident set ----------------------------------------------------------------------------
def test_resident_keys_are_page_local_and_read_back_at_local_positions():
    rs, _ = _resident(8)
    toks = list(range(1, 11))                           # 10 tokens: 3 pages, the last partial
    k, v = _kv(toks)
    e = rs.insert("a", torch.tensor(toks), k, v, on_disk=False)
    raw_k, raw_v = rs.pool.read(e.parts, e.rows)
    off = rs.pool_offsets(e.rows)
    assert off.tolist() == [j % PS for j in range(10)]  # whole pages: token j at offset j % page_size
    # the pool holds each key rotated by its page offset, not by its position
    _same(raw_k, [rope_rotate(rope_rotate(x, -torch.arange(10), INV_FREQ, D, False), off, INV_FREQ, D, False)
                  for x in k])
    _same(raw_v, v)
    got_k, got_v = rs.read_local(e)
    _same(got_k + got_v, k + v)


def test_resident_lru_evicts_the_oldest_unpinned_and_reports_it():
    evicted = []
    rs, stats = _resident(3, evicted)
    for i, key in enumerate("abc"):
        rs.insert(key, torch.tensor([i + 1] * PS), *_kv([i + 1] * PS), on_disk=False)
    rs.entries["a"].pins += 1
    rs.entries.move_to_end("b")                          # used: c is now the oldest unpinned
    layout = rs.layout
    rs.insert("d", torch.tensor([9] * PS), *_kv([9] * PS), on_disk=False)
    assert evicted == ["c"] and stats["evicted"] == 1 and list(rs.entries) == ["a", "b", "d"]
    assert rs.layout == layout + 2                       # an eviction and an insertion
    assert rs.pinned_by(rs.entries["a"]) == "in use by a running gather"
    rs.unpin([rs.entries["a"]])
    assert not rs.any_pinned()
    assert sorted(rs.clear()) == ["a", "b", "d"] and not rs.entries and evicted == ["c"]   # no LRU eviction
    assert sum(len(s.free) for s in rs.pool.slabs) == sum(s.pages for s in rs.pool.slabs)


def test_resident_refusal_names_the_live_requests_that_hold_the_pool():
    rs, _ = _resident(2)
    e = rs.insert("a", torch.tensor([1] * PS), *_kv([1] * PS), on_disk=False)
    e.pins += 1
    private = rs.alloc(PS)                               # the request's private page
    rs.live_requests[1] = ([e], private)
    assert rs.pinned_by(e) == "held by 1 live zero-copy request(s)"
    with pytest.raises(ChunkStoreError, match="2 of its 2 pages .* 1 more are needed"):
        rs.alloc(1)
    del rs.live_requests[1]
    with pytest.raises(ChunkStoreError, match="too small: the chunks one request uses"):
        rs.alloc(1)


# ----- the loader --------------------------------------------------------------------------------
class FakeRemote:
    """A remote tier in a dict (what ``RemoteTier`` answers, without a server)."""

    def __init__(self):
        self.values, self.stats = {}, {"remote_hits": 0, "remote_published": 0}

    def publish(self, key, tokens, k, v, fingerprint, variant=None, *, replace=False):
        if key in self.values and not replace:
            return False
        self.values[key] = (tokens.clone(), k.clone(), v.clone(), fingerprint, variant)
        self.stats["remote_published"] += 1
        return True

    def fetch(self, key, fingerprint, layout):
        got = self.values.get(key)
        if got is None or got[3] != fingerprint:
            return None
        self.stats["remote_hits"] += 1
        return key, got[0], got[1], got[2], got[4]


def _loader(pages, calls, directory=None, remote=None, read_only=False, fingerprint="toy-1"):
    stats = {"computed": 0, "recomputed": 0, "loaded": 0, "evicted": 0, "bad_files": 0}
    spec = _spec(calls, fingerprint)
    rs = ResidentSet(_pool(pages), spec.rope, stats)
    disk = None if directory is None else DiskTier(directory, read_only, LAYOUT)
    return Loader(spec, rs, disk, remote, stats, max_batch_tokens=64), stats


def test_loader_misses_go_memory_then_disk_then_recompute(tmp_path):
    calls = []
    ld, stats = _loader(2, calls, tmp_path)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ka, kb = ld.add([a, b])
    assert calls == [[0, 4, 8]] and stats["computed"] == 2              # one packed prefill
    assert ld.on_disk(ka) and ld.has(kb)
    assert ld.add([a]) == [ka] and len(calls) == 1                      # memory
    kc, = ld.add([[9, 10, 11, 12]])                                     # evicts b (a was used since)
    assert kb not in ld.resident.entries and kb in ld.recomputable
    ld.get(kb)                                                          # disk
    assert stats["loaded"] == 1 and len(calls) == 2 and kb not in ld.recomputable
    ld.disk.path(ka).unlink()                                           # a evicted by b's load, file gone
    assert ka not in ld.resident.entries
    ld.get(ka)                                                          # recomputed from its tokens
    assert stats["recomputed"] == 1 and calls[-1] == [0, 4] and ld.on_disk(ka)   # and written again
    _same(ld.resident.read_local(ld.resident.entries[ka])[0], _kv(a)[0])


def test_loader_replaces_a_corrupt_file_and_refuses_what_it_cannot_recompute(tmp_path):
    calls = []
    ld, stats = _loader(1, calls, tmp_path)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ka, = ld.add([a])
    kb, = ld.add([b])                                                   # a evicted
    data = bytearray(ld.disk.path(ka).read_bytes())
    data[-1] ^= 0xFF                                                    # corrupt: checksum fails
    ld.disk.path(ka).write_bytes(bytes(data))
    ld.get(ka)
    assert stats["bad_files"] == 1 and stats["recomputed"] == 1 and ld.on_disk(ka)   # recomputed, replaced
    vkey = ld.put(ka, "fused", *_kv(a))                                 # a derived entry, on disk too
    ld.get(kb)                                                          # the variant evicted
    ld.disk.path(vkey).write_bytes(b"\0" * 64)                         # truncated: not loadable
    with pytest.raises(ChunkStoreError, match="truncated or not a chunk file"):
        ld.get(vkey)


def test_loader_after_a_weight_change_names_the_earlier_weights():
    calls = []
    ld, _ = _loader(4, calls)
    ka, = ld.add([[1, 2, 3]])
    ld.weights_changed(_spec(calls, "toy-2"))
    assert not ld.resident.entries and ld.fingerprint == "toy-2"
    with pytest.raises(ChunkStoreError, match="earlier weights"):
        ld.get(ka)
    with pytest.raises(ChunkStoreError, match="no chunk with key"):
        ld.get(chunk_key("toy-2", [4, 5]))


def test_loader_pin_recomputes_the_misses_in_one_prefill_and_evicts_none_of_the_request():
    calls = []
    ld, stats = _loader(3, calls)
    keys = ld.add([[1] * PS, [2] * PS, [3] * PS])
    more = ld.add([[4] * PS, [5] * PS])                                 # evicts the first two
    assert all(k in ld.recomputable for k in keys[:2])
    want = [keys[0], more[1], keys[1], keys[0]]
    entries, pinned = ld.pin(want)
    assert calls[-1] == [0, PS, 2 * PS] and stats["recomputed"] == 2    # one packed prefill of both misses
    assert [e.pins for e in entries] == [1, 1, 1, 1] and len(pinned) == 3
    assert entries[0] is entries[3] and all(ld.resident.entries[k] is e for k, e in zip(want, entries))
    ResidentSet.unpin(pinned)
    assert not ld.resident.any_pinned()


def test_loader_reads_a_fleet_remote_before_computing():
    calls = []
    remote = FakeRemote()
    first, _ = _loader(4, calls, remote=remote)
    keys = first.add([[1, 2, 3], [4, 5]])
    second, stats = _loader(4, calls, remote=remote)
    assert second.add([[1, 2, 3], [4, 5]]) == keys
    assert stats["computed"] == 0 and remote.stats["remote_hits"] == 2 and len(calls) == 1
    for k in keys:
        _same(second.resident.read_local(second.resident.entries[k])[0],
              first.resident.read_local(first.resident.entries[k])[0])
    assert remote.stats["remote_published"] == 2
    third, stats = _loader(4, calls, remote=remote, fingerprint="toy-2")     # other weights: not served
    third.add([[1, 2, 3]])
    assert stats["computed"] == 1 and remote.stats["remote_hits"] == 2


def test_one_chunk_file_naming_rule(tmp_path):
    from ragattn.store import chunk_file, chunk_files
    calls = []
    ld, _ = _loader(4, calls, tmp_path)
    keys = ld.add([[1, 2, 3], [4, 5]])
    assert [ld.disk.path(k) for k in keys] == [chunk_file(tmp_path, k) for k in keys]
    assert chunk_files(tmp_path) == sorted(chunk_file(tmp_path, k) for k in keys)
    assert all(chunk_file(tmp_path, k).is_file() for k in keys)
    assert ld.load(chunk_file(tmp_path, keys[0])) == keys[0]
