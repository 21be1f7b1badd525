"""ChunkStore's recycled request caches (CPU): a request cache reuses the buffer of one that has
died, never one a caller still views, and the assembled cache is bit-identical either way."""
import gc
import weakref

import pytest
import torch

from ragattn.kv import PagedKV
from ragattn.hf.cache import PagedCache
from ragattn.hf.models import random_llama
from ragattn.store import ChunkStore

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, rope_theta=1000.0)


@pytest.fixture(scope="module")
def store():
    model = random_llama(SHAPE, dtype=torch.float32, seed=3)
    g = torch.Generator().manual_seed(11)
    s = ChunkStore(model, page_size=5)
    s.test_keys = s.add([torch.randint(1, 97, (n,), generator=g).tolist() for n in (7, 1, 11, 4, 13)])
    return s


def _filled(req):
    """Every layer's K and V at the request's filled slots (clones)."""
    rows = req.cache.slot_rows(0, torch.arange(req.num_slots))
    flat = lambda t: t.view(-1, *t.shape[2:])[rows].clone()                       # noqa: E731
    return [flat(t) for t in req.cache.k + req.cache.v]


def _poison(req):
    for t in req.cache.k + req.cache.v:
        t.fill_(float("nan"))


def _fresh_assembly(store, keys, **kw):
    """The assembly into a freshly allocated PagedKV (no recycling): the path before recycling."""
    store._copy_out._spare.clear()
    store._copy_out._request_cache = lambda cap, ps: PagedKV(store.num_layers, 1, cap, store.num_kv_heads,
                                                   store.head_dim, ps, store.dtype, store.device)
    try:
        return store.assemble(keys, **kw)
    finally:
        del store._copy_out._request_cache


@pytest.mark.parametrize("positions", ["reordered", "composite"])
@pytest.mark.parametrize("page_size", [None, 3, 16])
def test_recycled_cache_is_bit_identical_to_a_fresh_one(store, positions, page_size):
    keys = [store.test_keys[i] for i in (4, 1, 0, 3, 2, 1)]   # a repeat, awkward lengths
    kw = dict(positions=positions, extra_slots=6, page_size=page_size)
    want = _filled(_fresh_assembly(store, keys, **kw))
    first = store.assemble(keys, **kw)
    ptr = first.cache.k[0].data_ptr()
    _poison(first)                                  # the next request must overwrite all it reads
    del first
    again = store.assemble(keys, **kw)
    assert again.cache.k[0].data_ptr() == ptr       # the dead request's buffer was reused
    got = _filled(again)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not any(t.isnan().any() for t in want)


def test_smaller_request_reuses_a_larger_buffer_never_the_reverse(store):
    keys = store.test_keys
    big = store.assemble(keys, extra_slots=9)
    ptr = big.cache.k[0].data_ptr()
    _poison(big)
    del big
    small = store.assemble(keys[:2], extra_slots=1)
    assert small.cache.k[0].data_ptr() == ptr
    assert all(torch.equal(a, b) for a, b in zip(_filled(small), _filled(_fresh_assembly(store, keys[:2]))))
    want = _filled(_fresh_assembly(store, keys + keys[:1], extra_slots=40))
    small_bytes = small.cache.k[0].untyped_storage().nbytes()
    del small
    assert store._copy_out._spare[0].untyped_storage().nbytes() == small_bytes
    big = store.assemble(keys + keys[:1], extra_slots=40)   # needs more than the spare holds
    assert big.cache.k[0].untyped_storage().nbytes() > small_bytes
    assert all(torch.equal(a, b) for a, b in zip(_filled(big), want))


def test_a_buffer_still_viewed_is_never_reused(store):
    keys = store.test_keys[:3]
    req = store.assemble(keys, extra_slots=2)
    kept_k, kept_v = req.cache.k[1], req.cache.v[2][1:]     # views a caller keeps
    snapshot = (kept_k.clone(), kept_v.clone())
    del req
    other = store.assemble(store.test_keys[1:3], extra_slots=2)   # fits in the kept buffer
    for kept, snap in zip((kept_k, kept_v), snapshot):     # bit for bit (NaN: a poisoned spare's tail)
        torch.testing.assert_close(kept, snap, rtol=0, atol=0, equal_nan=True)
    buf = kept_k.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != buf for t in other.cache.k + other.cache.v)


def test_paged_cache_frees_its_pages_without_a_gc_pass(store):
    """PagedCache's layers refer to it weakly: dropping the cache frees (recycles) the pages at
    once, not at the next cycle collection."""
    req = store.assemble(store.test_keys[:2], extra_slots=3)
    gone = weakref.ref(req.cache)
    cache = PagedCache(req.cache)
    assert cache.layers[0].owner is cache
    gc.disable()
    try:
        del cache, req
        assert gone() is None
    finally:
        gc.enable()


def test_buffer_argument_is_checked():
    dims = (2, 1, 10, 2, 8, 4)
    n = PagedKV.buffer_numel(*dims)
    kv = PagedKV(*dims, buffer=torch.empty(n + 3))
    assert kv.k[1].shape == (3, 4, 2, 8) and kv.capacity == 12
    per = n // 4                                             # K0 K1 V0 V1, float32
    assert kv.v[1].data_ptr() == kv.k[0].data_ptr() + 3 * per * 4
    for bad in (torch.empty(n - 1), torch.empty(n, dtype=torch.float64), torch.empty(n, 1)):
        with pytest.raises(ValueError, match="buffer"):
            PagedKV(*dims, buffer=bad)
