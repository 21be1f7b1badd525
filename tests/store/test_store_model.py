"""The chunk store over a model description (ragattn.store.ChunkModel) rather than a model: a store
built from a hand-made description (no HF model anywhere), the HF description, the vLLM worker's
description from the checkpoint files (no model kept), and ``ragattn.methods``' re-export of the store."""
from __future__ import annotations

import sys

import pytest
import torch

from ragattn.reference.kv_cache import rope_rotate
from ragattn.store import ChunkModel, ChunkStore, ChunkStoreError, Rope, chunk_key, describe_model

L, HKV, D = 3, 2, 16


def _toy_prefill(calls):
    """A prefill without a model: K/V a fixed function of each token id, keys rotated at 0..n-1."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))

    def prefill(ids, positions, cu_seqlens):
        calls.append((ids.clone(), positions.clone(), cu_seqlens.clone()))
        g = torch.Generator().manual_seed(0)
        table = torch.randn(50, L, 2, HKV, D, generator=g)
        kv = table[ids]                                              # [T, L, 2, Hkv, D]
        ks = [rope_rotate(kv[:, l, 0], positions, inv_freq, D, False) for l in range(L)]
        vs = [kv[:, l, 1].clone() for l in range(L)]
        return ks, vs
    return prefill, inv_freq


def _toy_model(prefill=None, inv_freq=None, **kw):
    inv_freq = inv_freq if inv_freq is not None else 1.0 / (10000.0 ** (torch.arange(0, D, 2) / D)).float()
    return ChunkModel(fingerprint="toy-1", num_layers=L, num_kv_heads=HKV, head_dim=D, dtype=torch.float32,
                      device="cpu", rope=Rope(inv_freq, D, False), max_positions=256, vocab_size=50,
                      prefill=prefill, **kw)


def test_a_store_over_a_description_needs_no_model(tmp_path):
    calls = []
    prefill, inv_freq = _toy_prefill(calls)
    spec = _toy_model(prefill, inv_freq)
    store = ChunkStore(spec, tmp_path / "kv", page_size=4, memory_budget=1 << 20)
    assert store.model is None and store.description is spec and store.fingerprint == "toy-1"
    chunks = [[1, 2, 3, 4, 5], [7, 8, 9]]
    keys = store.add(chunks)
    assert keys == [chunk_key("toy-1", c) for c in chunks]
    assert len(calls) == 1 and calls[0][2].tolist() == [0, 5, 8]             # one packed prefill
    assert calls[0][1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]                  # each chunk from 0
    want_k, want_v = prefill(torch.tensor(chunks[0]), torch.arange(5), torch.tensor([0, 5], dtype=torch.int32))
    k, v = store.get_kv(keys[0])
    for a, b in zip(k + v, want_k + want_v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    req = store.assemble(keys, positions="reordered", extra_slots=2)
    assert req.num_slots == 8 and req.next_position == 8
    # a second store over the same description reads the files: nothing recomputed
    again = ChunkStore(spec, tmp_path / "kv", page_size=4, memory_budget=1 << 20)
    assert again.add(chunks) == keys and again.stats["loaded"] == 2 and len(calls) == 2


def test_a_description_without_prefill_serves_files_only(tmp_path):
    calls = []
    prefill, inv_freq = _toy_prefill(calls)
    ChunkStore(_toy_model(prefill, inv_freq), tmp_path / "kv").add([[1, 2, 3]])
    files_only = ChunkStore(_toy_model(None, inv_freq), tmp_path / "kv", read_only=True)
    assert files_only.add([[1, 2, 3]]) == [chunk_key("toy-1", [1, 2, 3])]     # from the file
    with pytest.raises(ChunkStoreError, match="cannot compute them"):
        files_only.add([[4, 5]])


def test_descriptions_are_checked_and_unknown_models_refused():
    with pytest.raises(ChunkStoreError, match="num_kv_heads must be an integer >= 1"):
        ChunkModel("f", L, 0, D, torch.float32, "cpu", Rope(torch.ones(D // 2), D, False))
    with pytest.raises(ChunkStoreError, match="rotary_dim"):
        ChunkModel("f", L, HKV, D, torch.float32, "cpu", Rope(torch.ones(3), 7, False))
    with pytest.raises(ChunkStoreError, match="are for a model, not a ChunkModel"):
        describe_model(_toy_model(), fingerprint="x")
    with pytest.raises(ChunkStoreError, match="cannot describe a Linear model: pass a ragattn.store.ChunkModel"):
        ChunkStore(torch.nn.Linear(2, 2))


def test_the_hf_description_follows_the_model():
    pytest.importorskip("transformers")
    from ragattn.hf.models import random_llama
    from ragattn.hf.store_model import describe

    model = random_llama(dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=128),
                         dtype=torch.float32, seed=0)
    spec = describe(model)
    dims = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.vocab_size, spec.max_positions)
    assert dims == (2, 2, 16, 100, 128)
    assert spec.model is model and spec.current() is spec
    store = ChunkStore(model, memory_budget=1 << 20)        # converted by the registered describer
    assert store.model is model and store.fingerprint == spec.fingerprint
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert spec.current().fingerprint != spec.fingerprint
    store.key([1, 2])
    assert store.stats["weight_changes"] == 1
    bare = describe(model, fingerprint="given", device="cpu", keep_model=False)
    assert bare.model is None and bare.prefill is None and bare.follow is None


def test_the_vllm_description_keeps_no_model(tmp_path):
    pytest.importorskip("accelerate")
    from tests.helpers import tiny_causal_lm
    from ragattn.vllm.store import served_chunk_model

    model = tiny_causal_lm("llama3", seed=2)
    model.save_pretrained(tmp_path / "m")
    spec = served_chunk_model(tmp_path / "m", torch.float32)
    hf = ChunkStore(model, tmp_path / "kv", memory_budget=1 << 22)
    keys = hf.add([[3, 4, 5, 6]])
    assert spec.model is None and spec.prefill is None and spec.device.type == "cpu"
    assert spec.fingerprint == hf.fingerprint and torch.equal(spec.rope.inv_freq, hf.rope.inv_freq)
    served = ChunkStore(spec, tmp_path / "kv", read_only=True, memory_budget=1 << 22)
    for a, b in zip(served.get_kv(keys[0])[0], hf.get_kv(keys[0])[0]):
        assert torch.equal(a, b)


def test_methods_reexports_the_store_and_the_baseline():
    pytest.importorskip("transformers")
    import ragattn.methods
    assert ragattn.methods.ChunkStore is ChunkStore
    assert ragattn.methods.full_prefill.__module__ == "ragattn.methods.baseline"
    assert ragattn.store is sys.modules["ragattn.store"]
