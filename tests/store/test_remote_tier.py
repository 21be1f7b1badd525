"""The chunk store's remote tier against a real redis-server (started here on 127.0.0.1 at a free
port, no persistence, stopped after): fleet sharing, concurrent writers, outages, corruption,
forged values, eviction and chunks larger than one value."""
import json
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

pytest.importorskip("redis", reason="the remote tier needs the redis client (pip install 'ragattn[remote]')")

from ragattn.hf.models import random_llama  # noqa: E402
from ragattn.store import ChunkStore  # noqa: E402
from tests.helpers import run_in_threads  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, rope_theta=1000.0)
SECRET = b"fleet-secret-0123456789"


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, dtype=torch.float32, seed=0).eval()


def _chunks(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in lens]


def _store(model, server, **kw):
    opts = kw.pop("remote_options", {})
    return ChunkStore(model, remote=server.url, remote_secret=kw.pop("secret", SECRET), remote_options=opts, **kw)


def _same(a, b, key):
    for x, y in zip(a.kv(key), b.kv(key)):
        assert torch.equal(x, y)


def test_second_process_computes_nothing_and_serves_identical_kv(model, remote, tmp_path):
    chunks = _chunks(0, [20, 33, 7])
    a = _store(model, remote)
    keys = a.add(chunks)
    assert a.stats["computed"] == 3 and a.stats["remote_published"] == 3
    for i, key in enumerate(keys):
        torch.save(a.kv(key), tmp_path / f"{i}.pt")
    script = textwrap.dedent(f"""
        import torch
        from ragattn.hf.models import random_llama
        from ragattn.store import ChunkStore
        m = random_llama({SHAPE!r}, dtype=torch.float32, seed=0).eval()
        s = ChunkStore(m, remote={remote.url!r}, remote_secret={SECRET!r})
        keys = s.add({chunks!r})
        assert s.stats["computed"] == 0 and s.stats["remote_hits"] == 3, s.stats
        for i, key in enumerate(keys):
            for x, y in zip(s.kv(key), torch.load({str(tmp_path)!r} + f"/{{i}}.pt")):
                assert torch.equal(x, y)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_remote_hit_hashes_the_value_once(model, remote, monkeypatch):
    """A remote hit is checked by its HMAC alone: neither the value's plain sha256 nor the chunk
    file's tensor checksum (both covered by the HMAC) is computed again on the read path."""
    import hashlib
    from types import SimpleNamespace

    from ragattn.store import disk_tier, remote_tier

    chunks = _chunks(5, [19, 40])
    keys = _store(model, remote).add(chunks)
    reader = _store(model, remote)

    def refuse(*a, **k):
        raise AssertionError("the tensors' checksum on the remote read path")

    def small_only(data=b""):        # names and keys are hashed; a whole value is not
        assert len(data) < 4096, "a plain sha256 of the value on the remote read path"
        return hashlib.sha256(data)

    monkeypatch.setattr(disk_tier, "_tensor_digest", refuse)
    monkeypatch.setattr(remote_tier, "hashlib", SimpleNamespace(sha256=small_only))
    assert reader.add(chunks) == keys
    assert reader.stats["remote_hits"] == 2 and reader.stats["computed"] == 0


def test_concurrent_writers_publish_one_copy(model, remote):
    chunk = _chunks(1, [40])
    stores = [_store(model, remote) for _ in range(4)]
    barrier = threading.Barrier(4)

    def run(s):
        barrier.wait()
        s.add(chunk)
    run_in_threads([lambda s=s: run(s) for s in stores])   # a worker's error fails the test
    key = stores[0].key(chunk[0])
    assert sum(s.stats["remote_published"] for s in stores) == 1      # one copy, whoever computed
    assert all(s.stats["computed"] + s.stats["remote_hits"] == 1 for s in stores)
    for s in stores[1:]:
        _same(stores[0], s, key)
    tier = stores[0]._loader.remote
    manifest = json.loads(remote.client().get(tier.manifest_key(key)))
    assert len(remote.client().keys(tier.part_key(key, "*", "*"))) == manifest["parts"]
    reader = _store(model, remote)
    reader.add(chunk)
    assert reader.stats["remote_hits"] == 1 and reader.stats["computed"] == 0


def test_server_killed_and_restarted(model, remote):
    chunks = _chunks(2, [12, 18])
    s = _store(model, remote, remote_options={"timeout": 0.3, "retry_after": 0.2})
    s.add(chunks[:1])
    remote.stop()
    try:
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s.add(chunks[1:])               # answered by local compute within the timeout
            time.sleep(0.25)
            s.add(_chunks(3, [9]))          # still down: no second warning
        assert time.monotonic() - t0 < 5
        assert len([x for x in w if "remote tier" in str(x.message)]) == 1
        assert s.stats["remote_errors"] >= 1 and s.stats["computed"] == 3
    finally:
        remote.start()
    time.sleep(0.25)
    new = _chunks(4, [15])
    s.add(new)                              # reconnected: published again
    assert s.stats["remote_published"] == 2
    other = _store(model, remote)
    other.add(new)
    assert other.stats["remote_hits"] == 1 and other.stats["computed"] == 0


def test_slow_server_answers_within_timeout(model, remote):
    s = _store(model, remote, remote_options={"timeout": 0.3, "retry_after": 5.0})
    remote.client().execute_command("CLIENT", "PAUSE", 8000, "ALL")   # paused far longer than the 0.3 s timeout
    try:
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match="remote tier"):
            s.add(_chunks(5, [10]))
        # answered by local compute long before the server would answer (not a speed bound: a hang)
        assert time.monotonic() - t0 < 6 and s.stats["computed"] == 1
        for i in range(4):                  # skipped while it backs off: no second wait, no second error
            s.add(_chunks(20 + i, [10]))
        assert s.stats["remote_errors"] == 1 and s.stats["computed"] == 5
    finally:
        remote.client().execute_command("CLIENT", "UNPAUSE")


def _parts(store, server, key):
    return server.client().keys(store._loader.remote.part_key(key, "*", "*"))


def _only_part(store, server, key):
    parts = _parts(store, server, key)
    assert len(parts) == 1
    return parts[0]


def test_value_corrupted_in_place_is_recomputed_and_replaced(model, remote):
    chunk = _chunks(6, [25])
    a = _store(model, remote)
    key = a.add(chunk)[0]
    part = _only_part(a, remote, key)
    c = remote.client()
    value = c.get(part)
    c.setrange(part, len(value) - 5, bytes([value[-5] ^ 0xFF]))
    b = _store(model, remote)
    b.add(chunk)
    assert b.stats["remote_bad"] == 1 and b.stats["computed"] == 1 and b.stats["remote_hits"] == 0
    _same(a, b, key)
    assert b.stats["remote_published"] == 1     # replaced
    fresh = _store(model, remote)
    fresh.add(chunk)
    assert fresh.stats["remote_hits"] == 1


def test_value_written_without_the_key_is_never_served(model, remote):
    chunk = _chunks(7, [30])
    forger = _store(model, remote, secret=b"not-the-fleet-key")
    key = forger.add(chunk)[0]
    assert forger.stats["remote_published"] == 1
    honest = _store(model, remote)
    # the forger writes under the fleet's names (another secret's entries live under other names)
    c, theirs, ours = remote.client(), forger._loader.remote, honest._loader.remote
    c.rename(theirs.manifest_key(key), ours.manifest_key(key))
    for part in c.keys(theirs.part_key(key, "*", "*")):
        c.rename(part, part.decode().replace(theirs.namespace, ours.namespace))
    honest.add(chunk)
    assert honest.stats["remote_bad"] == 1 and honest.stats["computed"] == 1 and honest.stats["remote_hits"] == 0
    # a forger with the fleet's key but other KV (values edited, checksums recomputed) is a bad
    # MAC too; here the forged value is refused whole and replaced by the honest one
    again = _store(model, remote)
    again.add(chunk)
    assert again.stats["remote_hits"] == 1
    _same(honest, again, key)


def test_foreign_model_value_is_not_served(model, remote):
    chunk = _chunks(8, [11])
    other = random_llama(SHAPE, dtype=torch.float32, seed=1).eval()
    a = _store(model, remote)
    key = a.add(chunk)[0]
    b = _store(other, remote)
    assert b.key(chunk[0]) != key           # keys carry the fingerprint: another model misses
    b.add(chunk)
    assert b.stats["remote_hits"] == 0 and b.stats["computed"] == 1


def test_eviction_under_small_maxmemory_only_costs_a_recompute(model, remote):
    c = remote.client()
    c.config_set("maxmemory", c.info("memory")["used_memory"] + 300_000)
    c.config_set("maxmemory-policy", "allkeys-lru")
    chunks = _chunks(9, [60] * 30)          # 30 x ~31 KB: more than the server holds
    a = _store(model, remote)
    keys = a.add(chunks)
    b = _store(model, remote)
    assert b.add(chunks) == keys
    assert 0 < b.stats["remote_hits"] < 30 and b.stats["computed"] == 30 - b.stats["remote_hits"]
    assert b.stats["remote_bad"] == 0
    for key in keys:
        _same(a, b, key)


def test_chunk_larger_than_the_value_limit_is_split(model, remote):
    chunk = _chunks(10, [200])              # ~100 KB of K/V
    a = _store(model, remote, remote_options={"max_value_bytes": 4096})
    key = a.add(chunk)[0]
    c = remote.client()
    parts = _parts(a, remote, key)
    assert len(parts) > 20 and max(c.strlen(p) for p in parts) <= 4096
    b = _store(model, remote, remote_options={"max_value_bytes": 4096})
    b.add(chunk)
    assert b.stats["remote_hits"] == 1 and b.stats["computed"] == 0
    _same(a, b, key)
    c.delete(parts[3])                      # one part gone: a miss, recomputed, republished
    d = _store(model, remote, remote_options={"max_value_bytes": 4096})
    d.add(chunk)
    assert d.stats["computed"] == 1 and d.stats["remote_published"] == 1


def test_remote_needs_a_secret(model, remote, monkeypatch):
    from ragattn.store import ChunkStoreError
    monkeypatch.delenv("RAGATTN_REMOTE_SECRET", raising=False)
    with pytest.raises(ChunkStoreError, match="remote_secret"):
        ChunkStore(model, remote=remote.url)


def test_offline_build_fills_and_resumes_from_the_remote_tier(model, remote, tmp_path):
    """What ``build-store --remote`` runs: fused caches published; a second machine (empty
    directory) resumes from the server and computes nothing."""
    from ragattn.methods import fusionrag
    from ragattn.methods.selection import fused_variant

    chunks = _chunks(11, [6, 8, 5])
    head, nbrs = [1, 2, 3], [[1, 2], [0, 2], [0, 1]]
    first = _store(model, remote, directory=tmp_path / "a")
    assert fusionrag.fuse_chunks(model, first, head, chunks, nbrs) == (3, 0)
    assert first.stats["remote_published"] == 1 + 3 + 3       # head, raw chunks, fused variants
    second = _store(model, remote, directory=tmp_path / "b")
    assert fusionrag.fuse_chunks(model, second, head, chunks, nbrs) == (0, 3)
    assert second.stats["computed"] == 0
    for k in second.add(chunks):
        vkey = second.variant_key(k, fused_variant(head))
        _same(first, second, vkey)
        assert (tmp_path / "b" / f"{vkey}.safetensors").is_file()


def test_build_store_remote_needs_the_key(monkeypatch, tmp_path):
    from ragattn.apps import build_store

    monkeypatch.delenv("RAGATTN_REMOTE_SECRET", raising=False)
    args = build_store.parse_args(["--out", str(tmp_path), "--remote", "redis://127.0.0.1:1/0"])
    assert args.remote == "redis://127.0.0.1:1/0"
    with pytest.raises(Exception, match="RAGATTN_REMOTE_SECRET"):
        build_store.run(args, model_and_tokenizer=(None, None))
