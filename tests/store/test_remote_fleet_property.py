"""A property test of the remote tier shared by a fleet, on one real redis-server: writers and
readers of two models and two secrets (four stores, each with its own copy of its model and a
memory budget of a few chunks, so that chunks are evicted and come back), random sequences of
add, get, put (a derived entry, replaced), weight changes, fresh processes reading what the
fleet holds, malformed manifests and parts the server evicted. After every step every K/V a store
serves equals a recomputation with that store's current weights (a derived entry: the last put in
its namespace, for a reader that did not hold it), and no entry a writer published is gone from the
server unless the test damaged or evicted it; at the end every remaining entry verifies and holds
the K/V it should."""
import copy

import pytest
import torch

pytest.importorskip("redis", reason="the remote tier needs the redis client (pip install 'ragattn[remote]')")
hyp = pytest.importorskip("hypothesis")
st = hyp.strategies

from ragattn.hf.models import random_llama  # noqa: E402
from ragattn.store import ChunkStore, ChunkStoreError  # noqa: E402

SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=50, max_position_embeddings=64, rope_theta=1000.0)
SECRETS = (b"fleet-one-secret-0123", b"fleet-two-secret-4567")
ACTORS = ((0, 0), (0, 0), (0, 1), (1, 0))      # (model seed, secret) of each store
ROW_BYTES = 2 * 2 * 2 * 8 * 4                   # K and V, 2 layers, 2 kv heads, head dim 8, fp32
CHUNKS = [torch.randint(1, 50, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 13, 3)]
_MODELS = {}


def _model(seed):
    if seed not in _MODELS:
        _MODELS[seed] = random_llama(SHAPE, dtype=torch.float32, seed=seed).eval()
    return _MODELS[seed]


actor = st.integers(0, len(ACTORS) - 1)
chunk = st.integers(0, len(CHUNKS) - 1)
chunk_of_put = st.integers(0, 1)      # two chunks only: the same variant is put again, replaced
OPS = st.one_of(
    st.tuples(st.just("add"), actor, st.lists(chunk, min_size=1, max_size=3)),
    st.tuples(st.just("get"), actor, chunk),
    st.tuples(st.just("put"), actor, chunk_of_put, st.integers(0, 3)),
    st.tuples(st.just("weights"), actor, st.integers(0, 1)),
    st.tuples(st.just("fresh"), actor, chunk),
    st.tuples(st.just("damage"), actor, chunk),
    st.tuples(st.just("evict_part"), actor, chunk),
)


class Fleet:
    """The stores, the references and what the server must hold."""

    def __init__(self, server):
        self.server, self.client = server, server.client()
        self.client.flushall()
        self.models = [copy.deepcopy(_model(m)) for m, _ in ACTORS]
        self.stores = [self._store(i) for i in range(len(ACTORS))]
        self.frozen = {}       # fingerprint -> a copy of the weights it names (for recomputations)
        self.refs = {}         # (fingerprint, chunk) -> K, V recomputed alone
        self.variants = {}     # (namespace, variant key) -> the last K/V put ([L, n, Hkv, D] each)
        self.entries = {}      # (namespace, key) -> (tier, fingerprint, chunk or None, variant key or None)
        self.gone = set()      # (namespace, key) the test damaged or evicted (allowed to be missing)
        self.known = [set() for _ in ACTORS]   # keys each store added (it can serve them: tokens known)
        for i in range(len(ACTORS)):
            self._freeze(i)

    def _store(self, i, model=None):
        return ChunkStore(self.models[i] if model is None else model, page_size=4, memory_budget=10 * 4 * ROW_BYTES,
                          remote=self.server.url, remote_secret=SECRETS[ACTORS[i][1]])

    def _freeze(self, i):
        fp = self.stores[i].fingerprint
        if fp not in self.frozen:
            self.frozen[fp] = copy.deepcopy(self.models[i])

    def tier(self, i):
        return self.stores[i]._loader.remote

    def ref(self, fp, c):
        if (fp, c) not in self.refs:
            s = ChunkStore(self.frozen[fp], page_size=4)
            self.refs[(fp, c)] = s.kv(s.add([CHUNKS[c]])[0])
        return self.refs[(fp, c)]

    def served(self, store, key, want):
        for got, w in zip(store.kv(key), want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)

    def track(self, i, c, vkey=None):
        s, t = self.stores[i], self.tier(i)
        key = s.key(CHUNKS[c])
        name = (t.namespace, vkey or key)
        self.entries[name] = (t, s.fingerprint, c, vkey)
        self.gone.discard(name)
        self.known[i].add(key)

    # ----- the operations ------------------------------------------------------------------------
    def add(self, i, cs):
        s = self.stores[i]
        keys = s.add([CHUNKS[c] for c in cs])
        for c, key in zip(cs, keys):
            self.served(s, key, self.ref(s.fingerprint, c))
            self.track(i, c)

    def get(self, i, c):
        s = self.stores[i]
        key = s.key(CHUNKS[c])
        if key not in self.known[i]:
            return
        self.served(s, key, self.ref(s.fingerprint, c))    # from memory, the server or recomputed

    def put(self, i, c, seed):
        s = self.stores[i]
        key = s.add([CHUNKS[c]])[0]
        self.track(i, c)
        g = torch.Generator().manual_seed(seed)
        k, v = (torch.randn(SHAPE["num_hidden_layers"], len(CHUNKS[c]), 2, 8, generator=g) for _ in range(2))
        vkey = s.put(key, f"v{c}", list(k), list(v))
        self.variants[(self.tier(i).namespace, vkey)] = (k, v)
        self.track(i, c, vkey)

    def weights(self, i, delta):
        with torch.no_grad():
            next(self.models[i].parameters()).add_(0.125 if delta else -0.125)
        self.stores[i].key(CHUNKS[0])      # the store follows its model's weights
        self._freeze(i)

    def fresh(self, i, c):
        """A new process with store i's weights and secret: the fleet's K/V, nothing stale."""
        s = self._store(i, copy.deepcopy(self.models[i]))
        key = s.key(CHUNKS[c])
        vkey = s.variant_key(key, f"v{c}")
        latest = self.variants.get((self.tier(i).namespace, vkey))
        if latest is not None and (self.tier(i).namespace, vkey) not in self.gone:
            self.served(s, vkey, latest)
        s.add([CHUNKS[c]])
        self.served(s, key, self.ref(s.fingerprint, c))
        self.track(i, c)

    def damage(self, i, c):
        name = self.tier(i).manifest_key(self.stores[i].key(CHUNKS[c]))
        if self.client.exists(name):
            self.client.set(name, b'{"size": Infinity, "parts": 1}')
            self.gone.add((self.tier(i).namespace, self.stores[i].key(CHUNKS[c])))

    def evict_part(self, i, c):
        t, key = self.tier(i), self.stores[i].key(CHUNKS[c])
        parts = self.client.keys(t.part_key(key, "*", "*"))
        if parts:
            self.client.delete(parts[0])
            self.gone.add((t.namespace, key))

    # ----- the invariants -----------------------------------------------------------------------
    def nothing_lost(self):
        for (ns, key), (t, _, _, _) in self.entries.items():
            if (ns, key) not in self.gone:
                assert self.client.exists(t.manifest_key(key)), f"entry {key} of namespace {ns} disappeared"

    def all_verify(self):
        layout = (SHAPE["num_hidden_layers"], 2, 8, torch.float32)
        for (ns, key), (t, fp, c, vkey) in self.entries.items():
            if (ns, key) in self.gone:
                continue
            got = t.fetch(key, fp, layout)
            assert got is not None, f"entry {key} does not verify"
            want = self.variants[(ns, vkey)] if vkey else self.ref(fp, c)
            torch.testing.assert_close(got[2], want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[3], want[1], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fleet_server(server):
    server.client().config_set("maxmemory", 0)
    return server


@hyp.settings(max_examples=12)
@hyp.given(ops=st.lists(OPS, min_size=6, max_size=16))
def test_fleet_serves_recomputations_and_loses_nothing(fleet_server, ops):
    f = Fleet(fleet_server)
    for op, *args in ops:
        try:
            getattr(f, op)(*args)
        except ChunkStoreError as exc:      # only a pinned entry may refuse (none here)
            raise AssertionError(f"{op}{tuple(args)}: {exc}") from exc
        f.nothing_lost()
    f.all_verify()
