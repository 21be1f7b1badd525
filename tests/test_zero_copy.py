"""Zero-copy chunk assembly (issue 27): position-free chunk pages in the store, request page
tables over the store's own pages with RoPE in the kernel, copy-on-write for recompute, pinning."""
import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.methods.chunk_store import ChunkStore
from ragattn.reference.kv_cache import rope_rotate

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, rope_theta=1000.0)


@pytest.fixture
def model():
    return random_llama(SHAPE, dtype=torch.float32, seed=7)


def _chunks(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lens]


def test_pool_keys_are_position_free(model):
    """The pool holds each chunk's keys without RoPE: rotating them by the local positions gives
    the keys a plain forward computes; the values are stored as they are."""
    chunks = _chunks(0, [9, 1, 21])
    store = ChunkStore(model, page_size=4)
    keys = store.add(chunks)
    for key, c in zip(keys, chunks):
        e = store._entries[key]
        raw_k, raw_v = store._pool.read(e.parts, e.rows)
        with torch.no_grad():
            past = model.model(torch.tensor([c]), use_cache=True).past_key_values
        n = len(c)
        for l in range(SHAPE["num_hidden_layers"]):
            want_k = past.layers[l].keys[0].transpose(0, 1)
            got = rope_rotate(raw_k[l], torch.arange(n), store.rope.inv_freq, store.rope.rotary_dim,
                              store.rope.interleaved)
            torch.testing.assert_close(got, want_k, rtol=1e-5, atol=1e-5)
            if n > 1:   # not the rotated keys themselves (position 0 is the identity)
                assert (raw_k[l][1:] - want_k[1:]).abs().max() > 1e-3
            torch.testing.assert_close(raw_v[l], past.layers[l].values[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
