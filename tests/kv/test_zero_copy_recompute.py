"""Selective recompute on a zero-copy request attends by slot, as the copy path does (and the
"ragattn" attention's ``ragattn_slots`` contract says): a recomputed row never sees a later slot,
and sees every earlier one, whatever the chunks' positions (composite, gapped, overlapping first
positions), so both paths give the same logits and write the same K/V."""
import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.hf.registration import use_ragattn
from ragattn.methods.fusionrag import recompute
from ragattn.methods.generate import paged_forward
from ragattn.store import ChunkStore

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, rope_theta=1000.0)


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, dtype=torch.float32, seed=11)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _copy_path(store, keys, positions, extra):
    """The copy path's cache with each chunk slot's key rotated to ``positions`` (any scheme:
    assemble's reordered cache, its keys written again by gather_into_ at those positions)."""
    areq = store.assemble(keys, "reordered", extra_slots=extra)
    cache = areq.cache
    store.gather_into_(keys, cache.k, cache.v, cache.slot_rows(0, torch.arange(areq.num_slots)), positions)
    return cache


@pytest.mark.parametrize("scheme, backend", [("reordered", "default"), ("composite", "default"),
                                             ("composite", "triton"), ([30, 0, 9], "default"),
                                             ([0, 2, 1], "default")])
def test_recompute_masks_by_slot_on_both_paths(model, scheme, backend, monkeypatch):
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (9, 7, 11)]
    final = torch.randint(1, 97, (6,), generator=g)
    store = ChunkStore(model, page_size=4)
    keys = store.add(chunks)
    ids = torch.tensor(sum(chunks, []))
    slots = torch.tensor([1, 8, 10, 13, 17, 20, 25])   # in every chunk, pages partly
    with store.request(keys, scheme, extra_slots=len(final)) as req, use_ragattn(model):
        pos = req.positions.to(torch.int64)
        copy = _copy_path(store, keys, pos, len(final))
        _, got = recompute(model, req.cache, ids[slots], slots, positions=pos[slots], logits=True)
        _, want = recompute(model, copy, ids[slots], slots, positions=pos[slots], logits=True)
        assert _rel(got, want) <= 2e-5, _rel(got, want)
        at = req.next_position + torch.arange(len(final))
        got_q = paged_forward(model, final[None], at, req.cache)
        want_q = paged_forward(model, final[None], at, copy)
        assert _rel(got_q, want_q) <= 2e-5, _rel(got_q, want_q)
        for layer in range(SHAPE["num_hidden_layers"]):
            k, v = req.cache.read_kv(layer, slots)
            rows = copy.slot_rows(0, slots)
            torch.testing.assert_close(k, copy.k[layer].view(-1, 2, 16)[rows], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, copy.v[layer].view(-1, 2, 16)[rows], rtol=1e-5, atol=1e-5)
