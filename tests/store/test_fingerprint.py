"""The model fingerprint sees every weight change, including those a sum over the bytes cancels
(two rows or channels swapped, a +e/-e pair of words), and a store follows it; a store directory
written under another fingerprint (other weights, or the checksum before this one) is recomputed,
never served."""
import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.store import ChunkStore, ChunkStoreError, model_fingerprint, weight_checksums
from ragattn.store.fingerprint import TensorChecksum

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, rope_theta=1000.0)


def _swap_rows(w):
    w[[0, 1]] = w[[1, 0]]


def _swap_channels(w):
    w[:, [0, 4]] = w[:, [4, 0]]             # the same place in two 8-byte words of each row


def _compensating_pair(w):
    words = w.view(-1).view(torch.int64)       # +1 in one 8-byte word, -1 in its neighbour
    words[0] += 1
    words[1] -= 1


EDITS = {"swap rows": _swap_rows, "swap channels": _swap_channels, "+e/-e": _compensating_pair}


@pytest.mark.parametrize("edit", EDITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksum_sees_edits_a_sum_cancels(edit, dtype):
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    base = weight_checksums([w])[0]
    u = w.clone()
    EDITS[edit](u)
    assert not torch.equal(u, w) and weight_checksums([u])[0] != base
    assert weight_checksums([u.t().contiguous().t()])[0] == weight_checksums([u])[0]   # memory order is row-major


def test_checksum_is_streamable_and_the_same_on_every_layout():
    """Blocks of any size give the same value (the vLLM connector streams checkpoint files);
    a non-contiguous tensor is hashed in its logical row-major order, as its contiguous copy."""
    t = torch.randn(300, 7, generator=torch.Generator().manual_seed(1))
    data = t.numpy().tobytes()
    c = TensorChecksum()
    for i in range(0, len(data), 333):
        c.update(data[i: i + 333])
    assert c.digest() == weight_checksums([t])[0]
    s = torch.randn(7, 300).t()
    assert weight_checksums([s])[0] == weight_checksums([s.contiguous()])[0]
    assert weight_checksums([torch.tensor(3.0)])[0] == weight_checksums([torch.tensor([3.0])])[0]


@pytest.mark.parametrize("edit", EDITS)
def test_refresh_recomputes_after_an_edit_a_sum_cancels(edit, tmp_path):
    model = random_llama(SHAPE, dtype=torch.float32, seed=3)
    chunks = [[5, 9, 14, 2, 77], [3, 8]]
    store = ChunkStore(model, directory=tmp_path)
    keys = store.add(chunks)
    fp = store.fingerprint
    w = model.model.layers[1].self_attn.k_proj.weight
    EDITS[edit](w.data)                         # .data: under the version counter, only refresh() sees it
    assert model_fingerprint(model, cached=False) != fp
    assert store.refresh() != fp and store.stats["weight_changes"] == 1
    new_keys = store.add(chunks)
    assert set(new_keys).isdisjoint(keys) and store.stats["computed"] == 4 and store.stats["loaded"] == 0
    fresh = ChunkStore(model)                   # the same chunks computed from scratch
    for key in fresh.add(chunks):
        assert key in new_keys
        for got, want in zip(store.kv(key), fresh.kv(key)):
            assert torch.equal(got, want)


def test_store_written_under_another_checksum_is_recomputed(tmp_path):
    """A directory built before the checksum changed holds files under the old fingerprint: their
    keys differ, so the chunks are computed again, and a load of an old file by path is refused."""
    model = random_llama(SHAPE, dtype=torch.float32, seed=4)
    chunks = [[1, 2, 3, 4], [9, 8, 7]]
    old = ChunkStore(model, directory=tmp_path, fingerprint="0" * 32, device="cpu")
    old_keys = old.add(chunks)
    new = ChunkStore(model, directory=tmp_path)
    assert new.fingerprint != old.fingerprint
    assert not any(new.has(k) for k in old_keys)
    assert set(new.add(chunks)).isdisjoint(old_keys) and new.stats["computed"] == 2 and new.stats["loaded"] == 0
    with pytest.raises(ChunkStoreError, match="another model"):
        new.load(tmp_path / f"{old_keys[0]}.safetensors")
