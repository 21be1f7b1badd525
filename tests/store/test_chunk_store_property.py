"""A property test of the chunk store ("Done when"): random sequences of add, assemble,
put, eviction churn, reopening the directory in a new store, and weight changes (in place through
the tensor API or through ``.data``, and back). After every step, every KV the store serves equals
a fresh prefill with the model's current weights (a derived entry: what was put), and every key
``has()`` reports can be loaded, by this store and by a new one opening the directory; keys of
other weights are reported missing."""
import copy
import tempfile
from pathlib import Path

import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.store import ChunkStore, ChunkStoreError, model_fingerprint
from tests.helpers import run_in_threads

hyp = pytest.importorskip("hypothesis")
st = hyp.strategies

SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=50, max_position_embeddings=64, rope_theta=1000.0)
PAGE, BUDGET_PAGES = 2, 12          # any request of <= 3 chunks of <= 7 tokens fits; churn evicts
_BASE = {}


def _base():
    if "m" not in _BASE:
        _BASE["m"] = random_llama(SHAPE, dtype=torch.float32, seed=11).eval()
    return _BASE["m"]


def _tokens(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(1, SHAPE["vocab_size"], (1 + i % 7,), generator=g).tolist()


OPS = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 5), min_size=1, max_size=3)),
    st.tuples(st.just("assemble"), st.lists(st.integers(0, 5), min_size=1, max_size=3)),
    st.tuples(st.just("put"), st.integers(0, 5)),
    st.tuples(st.just("churn"), st.integers(6, 11)),
    st.tuples(st.just("reopen"), st.just(0)),
    st.tuples(st.just("weights"), st.sampled_from(["mul_", "data", "back"])),
    st.tuples(st.just("damage"), st.tuples(st.integers(0, 11), st.sampled_from(["truncate", "flip", "delete"]))),
    st.tuples(st.just("threads"), st.lists(st.integers(0, 11), min_size=1, max_size=4)),
)


class Harness:
    def __init__(self):
        self.model = copy.deepcopy(_base())
        self.original = copy.deepcopy(self.model.state_dict())
        self.dir = tempfile.mkdtemp(prefix="ragattn-prop-")
        self.store = self._open()
        self.seen = set()      # keys this store computed or loaded (it knows their tokens)
        self.valid = {}        # fingerprint -> {key: chunk index, or ("variant", index, k, v)}
        self.fresh = {}        # (fingerprint, index) -> fresh K, V

    def _open(self, read_only=False):
        page_bytes = ChunkStore(self.model).row_bytes * PAGE
        return ChunkStore(self.model, directory=self.dir, page_size=PAGE, read_only=read_only,
                          memory_budget=BUDGET_PAGES * page_bytes)

    @property
    def fp(self):
        return model_fingerprint(self.model)

    def fresh_kv(self, i):
        key = (self.fp, i)
        if key not in self.fresh:
            with torch.no_grad():
                past = self.model.model(torch.tensor([_tokens(i)]), use_cache=True).past_key_values
            self.fresh[key] = (torch.stack([x.keys[0].transpose(0, 1) for x in past.layers]),
                               torch.stack([x.values[0].transpose(0, 1) for x in past.layers]))
        return self.fresh[key]

    def want(self, key):
        what = self.valid[self.fp][key]
        return self.fresh_kv(what) if isinstance(what, int) else what[2:]

    def check_kv(self, key, got):
        for g, w in zip(got, self.want(key)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)

    def step(self, op, arg):
        s, valid = self.store, self.valid.setdefault(self.fp, {})
        if op in ("add", "churn"):
            idx = arg if op == "add" else [arg]
            for key, i in zip(s.add([_tokens(i) for i in idx]), idx):
                valid[key] = i
                self.seen.add(key)
                self.check_kv(key, s.kv(key))
        elif op == "assemble":
            keys = s.add([_tokens(i) for i in arg])
            for key, i in zip(keys, arg):
                valid[key] = i
            req = s.assemble(keys, positions="composite")                  # served: check every slot
            for key, start, n in zip(keys, req.chunk_starts, req.chunk_lens):
                rows = req.cache.slot_rows(0, torch.arange(start, start + n))
                got = [torch.stack([t.view(-1, *t.shape[2:])[rows] for t in layers])
                       for layers in (req.cache.k, req.cache.v)]
                self.check_kv(key, got)
        elif op == "put":
            key = s.add([_tokens(arg)])[0]
            valid[key] = arg
            k, v = s.get_kv(key)
            k2, v2 = [t * 2 for t in k], [t - 1 for t in v]
            vkey = s.put(key, "doubled", k2, v2)
            valid[vkey] = ("variant", arg, torch.stack(k2), torch.stack(v2))
            self.check_kv(vkey, s.kv(vkey))
        elif op == "reopen":
            self.store = self._open()
            self.seen = set()
        elif op == "damage":        # the file of a chunk this store evicted goes bad: recomputed
            i, how = arg
            key = s.key(_tokens(i))
            path = Path(self.dir) / f"{key}.safetensors"
            if key in self.seen and key not in s and path.exists():
                data = path.read_bytes()
                if how == "delete":
                    path.unlink()
                else:
                    path.write_bytes(data[:-20] if how == "truncate" else data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
                self.check_kv(key, s.kv(key))
        elif op == "threads":       # several stores on the directory at once, overlapping chunks
            def work(j):
                order = arg[j:] + arg[:j]
                return list(zip(self._open().add([_tokens(i) for i in order]), order))
            for done in run_in_threads([lambda j=j: work(j) for j in range(3)]):
                for key, i in done:
                    valid[key] = i
            assert not [p for p in Path(self.dir).iterdir() if ".tmp" in p.name or p.name.startswith(".ragattn")]
        elif op == "weights":
            if arg == "back":
                self.model.load_state_dict(self.original)
            elif arg == "mul_":
                with torch.no_grad():
                    self.model.model.layers[0].self_attn.k_proj.weight.mul_(1.25)
            else:
                for p in self.model.model.layers[1].mlp.parameters():
                    p.data.mul_(0.75)
            self.seen = set()

    def check_all(self):
        """has() is exactly the keys of the current weights; each loads here and in a new store."""
        fp = self.fp
        other = self._open(read_only=True)
        for f, keys in self.valid.items():
            for key in keys:
                assert self.store.has(key) == (f == fp), (key, f == fp)
                if f == fp:
                    self.check_kv(key, self.store.kv(key))
                    assert other.load(key) == key
                    self.check_kv(key, other.kv(key))
                else:
                    with pytest.raises(ChunkStoreError):
                        self.store.kv(key)


@hyp.settings(max_examples=25, deadline=None)
@hyp.given(ops=st.lists(OPS, min_size=1, max_size=12))
def test_store_property(ops):
    torch.set_num_threads(1)
    h = Harness()
    for op, arg in ops:
        h.step(op, arg)
        h.check_all()
