"""The chunk store under an adversarial user (issue 24): it follows the weights of the model it
serves, keeps every file loadable (crashes, truncation, wrong dtypes), serves every request that
fits its budget, and refuses meaningless inputs with a clear error."""
import copy
import os
import subprocess
import sys
import threading

import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.methods.chunk_store import ChunkStore, ChunkStoreError

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=96, rope_theta=1000.0)
L, HKV, D = 2, 2, 16


@pytest.fixture
def model():
    return random_llama(SHAPE, dtype=torch.float32, seed=0).eval()


def _chunks(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in lens]


def fresh_kv(model, tokens):
    """K, V ``[L, n, Hkv, D]`` of one chunk prefilled alone by HF's own attention (current weights)."""
    with torch.no_grad():
        past = model.model(torch.tensor([list(tokens)]), use_cache=True).past_key_values
    return (torch.stack([layer.keys[0].transpose(0, 1) for layer in past.layers]),
            torch.stack([layer.values[0].transpose(0, 1) for layer in past.layers]))


def assert_fresh(store, model, key, tokens):
    for got, want in zip(store.kv(key), fresh_kv(model, tokens)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ----- 24.1: the store follows the weights of its model ---------------------------------------
def _no_grad_mul(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)


def _data_mul(model):
    for p in model.parameters():
        p.data.mul_(1.5)


def _one_weight_data_copy(model):
    w = model.model.layers[1].self_attn.v_proj.weight
    w.data.copy_(torch.randn_like(w) * 0.05)


def _load_state_dict(model):
    model.load_state_dict(random_llama(SHAPE, dtype=torch.float32, seed=5).state_dict())


def _optimizer_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=10.0)
    ids = torch.tensor([[3, 9, 27, 4, 11]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


EDITS = [_no_grad_mul, _data_mul, _one_weight_data_copy, _load_state_dict, _optimizer_step]


@pytest.mark.parametrize("edit", EDITS, ids=[e.__name__.strip("_") for e in EDITS])
@pytest.mark.parametrize("directory", [False, True])
def test_store_follows_in_place_weight_changes(model, tmp_path, edit, directory):
    chunks = _chunks(1, [3, 7, 5])
    original = copy.deepcopy(model)
    d = tmp_path if directory else None
    store = ChunkStore(model, directory=d, page_size=4)
    old_keys = store.add(chunks)
    edit(model)
    keys = store.add(chunks)                     # recomputed with the new weights, under new keys
    assert set(keys).isdisjoint(old_keys)
    for k, c in zip(keys, chunks):
        assert_fresh(store, model, k, c)
    req = store.assemble(keys, positions="composite")
    rows = req.cache.slot_rows(0, torch.arange(req.num_slots))
    want_v = torch.cat([fresh_kv(model, c)[1][0] for c in chunks])
    torch.testing.assert_close(req.cache.v[0].view(-1, HKV, D)[rows], want_v, rtol=1e-4, atol=1e-5)
    assert not any(store.has(k) for k in old_keys)      # the old entries are gone, not served
    with pytest.raises(ChunkStoreError, match="earlier weights"):
        store.assemble(old_keys)
    if directory:                                 # the new files carry the new fingerprint ...
        again = ChunkStore(model, directory=d)
        assert again.add(chunks) == keys and again.stats["loaded"] == 3 and again.stats["computed"] == 0
        back = ChunkStore(original, directory=d)  # ... and the original weights never load them
        assert back.add(chunks) == old_keys and back.stats["computed"] == 0
        for k, c in zip(old_keys, chunks):
            assert_fresh(back, original, k, c)
