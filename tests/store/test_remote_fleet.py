"""The remote tier as a fleet shares it (a real redis-server, tests/store/conftest.py): a replaced
variant is replaced for every process, a writer deletes only its own parts, a reader deletes only
entries proven bad by their own bytes (never because of its own secret, weights or model), every
value read from the server is parsed as untrusted, a server that is not Redis is an outage naming
the URL, and the secret and options are checked when the tier is built."""
import copy
import json
import socket
import threading

import pytest
import torch

pytest.importorskip("redis", reason="the remote tier needs the redis client (pip install 'ragattn[remote]')")

from ragattn.hf.models import random_llama  # noqa: E402
from ragattn.store import ChunkStore, ChunkStoreError  # noqa: E402
from tests.store.test_remote_tier import SECRET, SHAPE, _chunks, _store  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, dtype=torch.float32, seed=0).eval()


def _tier(store):
    return store._loader.remote


def _fresh_hits(model, remote, chunk) -> int:
    """Remote hits of a fresh process-like store adding ``chunk`` (1: the fleet's entry is there)."""
    s = _store(model, remote)
    s.add([chunk])
    return s.stats["remote_hits"]


def test_replaced_variant_is_replaced_for_every_process(model, remote):
    a = _store(model, remote)
    chunk = _chunks(40, [23])[0]
    key = a.add([chunk])[0]
    k, v = a.get_kv(key)
    g = torch.Generator().manual_seed(40)
    first = ([torch.randn(x.shape, generator=g) for x in k], [torch.randn(x.shape, generator=g) for x in v])
    second = ([torch.randn(x.shape, generator=g) for x in k], [torch.randn(x.shape, generator=g) for x in v])
    vkey = a.put(key, "fused-x", *first)
    assert a.put(key, "fused-x", *second) == vkey
    b = _store(model, remote)                   # another process (or this one after eviction)
    for got, want in zip(b.kv(vkey), a.kv(vkey)):
        assert torch.equal(got, want)           # the second put's K/V, not the first's


@pytest.mark.parametrize("manifest", [
    b'{"size": Infinity, "parts": 1, "sha256": "00", "mac": "00"}',
    b'{"size": 10, "parts": Infinity, "sha256": "00", "mac": "00"}',
    b'{"size": 10, "parts": 1e400, "sha256": "00", "mac": "00"}',
    b'{"size": 10, "parts": NaN, "sha256": "00", "mac": "00"}',
    b'{"size": 100000000000000000000000000000000, "parts": 1, "sha256": "00", "mac": "00"}',
    b'{"size": "10", "parts": true, "sha256": 7, "mac": null}',
    b'[1, 2, 3]',
    b'\xff\xfe not json',
])
def test_malformed_manifest_is_a_bad_entry_recomputed_and_replaced(model, remote, manifest):
    chunk = _chunks(41, [19])[0]
    a = _store(model, remote)
    key = a.add([chunk])[0]
    remote.client().set(_tier(a).manifest_key(key), manifest)
    b = _store(model, remote)
    b.add([chunk])                              # no OverflowError: a bad entry, computed here
    assert b.stats["remote_bad"] == 1 and b.stats["computed"] == 1 and b.stats["remote_published"] == 1
    for x, y in zip(a.kv(key), b.kv(key)):
        assert torch.equal(x, y)
    assert _fresh_hits(model, remote, chunk) == 1


class _NotRedis:
    """A TCP server on 127.0.0.1 answering every request with an HTTP 400 (a proxy, a web server)."""

    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn):
        with conn:
            try:
                while conn.recv(65536):
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass

    def __exit__(self, *exc):
        self.sock.close()


def test_a_server_that_is_not_redis_is_an_outage_naming_the_url(model):
    with _NotRedis() as srv:
        s = ChunkStore(model, remote=srv.url, remote_secret=SECRET, remote_options={"retry_after": 60})
        with pytest.warns(RuntimeWarning, match=f"remote tier {srv.url}"):
            s.add(_chunks(42, [9, 14]))
        assert s.stats["computed"] == 2 and s.stats["remote_errors"] >= 1


def test_url_password_is_not_in_the_warning(model):
    with _NotRedis() as srv:
        url = srv.url.replace("redis://", "redis://:hunter2-password@")
        s = ChunkStore(model, remote=url, remote_secret=SECRET)
        with pytest.warns(RuntimeWarning) as w:
            s.add(_chunks(43, [9]))
        assert all("hunter2" not in str(x.message) for x in w)
        assert any(srv.url.replace("redis://", "redis://:***@") in str(x.message) for x in w)


def test_writer_that_loses_the_race_keeps_the_winners_parts(model, remote, monkeypatch):
    from ragattn.store import remote_tier

    chunk = _chunks(44, [31])[0]
    encode, values = remote_tier.encode_chunk, {}
    # both writers' values byte-identical (safetensors' header order varies between writes, so
    # this happens by chance; here always)
    monkeypatch.setattr(remote_tier, "encode_chunk", lambda key, *a: values.setdefault(key, encode(key, *a)))
    a, b = _store(model, remote), _store(model, remote)
    tier, publish = _tier(b), _tier(b).publish

    def late(*args, **kw):
        # b found no copy, computed the same (byte-identical) value, and a's manifest lands now,
        # after b's check: b writes its parts and loses the manifest
        a.add([chunk])
        tier.client.exists = lambda *names: 0
        return publish(*args, **kw)
    tier.publish = late
    b.add([chunk])
    assert b.stats["computed"] == 1 and b.stats["remote_published"] == 0
    assert a.stats["computed"] == 1 and a.stats["remote_published"] == 1
    assert _fresh_hits(model, remote, chunk) == 1


def _entry(server, tier, key):
    """The manifest and the parts of ``key`` on the server, as bytes."""
    c = server.client()
    return c.get(tier.manifest_key(key)), sorted(c.get(p) for p in c.keys(f"{tier.prefix}:part:{key}:*"))


def test_reader_with_another_secret_leaves_the_fleets_entry(model, remote):
    chunk = _chunks(45, [27])[0]
    a = _store(model, remote)
    key = a.add([chunk])[0]
    before = _entry(remote, _tier(a), key)
    other = _store(model, remote, secret=b"another-deployment-secret")
    other.add([chunk])
    assert other.stats["computed"] == 1 and other.stats["remote_hits"] == 0
    assert _entry(remote, _tier(a), key) == before
    assert _fresh_hits(model, remote, chunk) == 1


def test_reader_with_changed_weights_leaves_the_entry(model, remote):
    chunk = _chunks(46, [21])[0]
    mine = copy.deepcopy(model)
    s = _store(mine, remote)
    key = s.add([chunk])[0]
    before = _entry(remote, _tier(s), key)
    with torch.no_grad():
        next(mine.parameters()).add_(0.25)      # the store follows: key is now of earlier weights
    with pytest.raises(ChunkStoreError, match="earlier weights"):
        s.get_kv(key)
    assert not s.verify(key)
    assert _entry(remote, _tier(s), key) == before
    assert _fresh_hits(model, remote, chunk) == 1


def test_store_of_another_model_leaves_the_entry(model, remote):
    chunk = _chunks(47, [17])[0]
    a = _store(model, remote)
    key = a.add([chunk])[0]
    before = _entry(remote, _tier(a), key)
    other = _store(random_llama(SHAPE, dtype=torch.float32, seed=1).eval(), remote)
    assert not other.verify(key)                # another model's key: not served, not deleted
    with pytest.raises(ChunkStoreError, match="no chunk"):
        other.get_kv(key)
    assert other.stats["remote_bad"] == 0
    assert _entry(remote, _tier(a), key) == before
    assert _fresh_hits(model, remote, chunk) == 1


def test_forged_value_in_the_fleets_namespace_is_removed(model, remote):
    """A client without the secret writes under the fleet's manifest name: refused by its MAC (its
    own bytes), removed, computed and replaced."""
    chunk = _chunks(48, [29])[0]
    a = _store(model, remote)
    key = a.add([chunk])[0]
    c = remote.client()
    name = _tier(a).manifest_key(key)
    m = json.loads(c.get(name))
    m["mac"] = "0" * 64
    c.set(name, json.dumps(m))
    b = _store(model, remote)
    b.add([chunk])
    assert b.stats["remote_bad"] == 1 and b.stats["computed"] == 1 and b.stats["remote_published"] == 1
    assert _fresh_hits(model, remote, chunk) == 1


def test_evicted_chunk_of_a_store_without_directory_comes_from_the_remote_tier(model, remote):
    """One miss order for get, pin (request, assemble) and add: memory, disk, remote, recompute."""
    chunks = _chunks(49, [40, 40, 40, 40])
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    row = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * head_dim * 4
    s = _store(model, remote, memory_budget=4 * 16 * row, page_size=16)     # one chunk (3 pages) at a time
    keys = [s.add([c])[0] for c in chunks]                                  # each evicts the one before
    assert len(s) == 1 and s.stats["computed"] == 4
    ref = _store(model, remote)
    hits = s.stats["remote_hits"]
    for got, want in zip(s.kv(keys[0]), ref.kv(keys[0])):                  # get
        assert torch.equal(got, want)
    with s.request([keys[1]]):                                              # pin
        pass
    req = s.assemble([keys[2]])
    assert req.num_slots == 40
    s.add([chunks[3]])                                                      # add
    s.add([chunks[0]])
    assert s.stats["recomputed"] == 0 and s.stats["computed"] == 4 and s.stats["remote_hits"] == hits + 5


@pytest.mark.parametrize("secret", [12345, 10 ** 6, True, 1.5, b"", "", "short", b"15-bytes-secret", ["x" * 20]])
def test_secret_must_be_bytes_or_str_of_sixteen_bytes(model, secret):
    with pytest.raises(ChunkStoreError, match="remote_secret"):
        ChunkStore(model, remote="redis://127.0.0.1:1/0", remote_secret=secret)


@pytest.mark.parametrize("options, name", [
    ({"timeout": -1}, "timeout"), ({"timeout": float("nan")}, "timeout"), ({"timeout": 0}, "timeout"),
    ({"timeout": float("inf")}, "timeout"), ({"timeout": "0.5"}, "timeout"), ({"timeout": True}, "timeout"),
    ({"retry_after": -1}, "retry_after"), ({"retry_after": float("nan")}, "retry_after"),
    ({"prefix": ""}, "prefix"), ({"prefix": 3}, "prefix"),
    ({"client_options": "ssl"}, "client_options"),
    ({"client_options": {"decode_responses": True}}, "client_options"), ({"max_value_bytes": 10 ** 30}, "max_value_bytes"),
    ({"speed": 3}, "speed"),
])
def test_options_are_checked_when_the_tier_is_built(model, options, name):
    with pytest.raises(ChunkStoreError, match=f"remote.*{name}"):
        ChunkStore(model, remote="redis://127.0.0.1:1/0", remote_secret=SECRET, remote_options=options)


def test_remote_url_must_be_a_string(model):
    with pytest.raises(ChunkStoreError, match="remote"):
        ChunkStore(model, remote=b"redis://127.0.0.1:1/0", remote_secret=SECRET)
