import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.reference.kv_cache import rope_rotate
from ragattn.methods.chunk_store import ChunkStore, ChunkStoreError

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, rope_theta=1000.0)


@pytest.fixture
def model():
    return random_llama(SHAPE, dtype=torch.float32, seed=7)


def _chunks(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lens]


def test_batched_prefill_equals_each_chunk_alone(model):
    chunks = _chunks(0, [5, 1, 13, 7])
    store = ChunkStore(model, max_batch_tokens=20)          # forces two packed batches
    keys = store.add(chunks + [chunks[0]])
    assert keys[0] == keys[-1] and len(store) == 4
    for key, c in zip(keys, chunks):
        with torch.no_grad():
            past = model.model(torch.tensor([c]), use_cache=True).past_key_values
        k, v = store.kv(key)
        for l in range(SHAPE["num_hidden_layers"]):
            torch.testing.assert_close(k[l], past.layers[l].keys[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[l], past.layers[l].values[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positions", ["reordered", "composite"])
def test_assemble_gathers_and_rerotates(model, positions):
    chunks = _chunks(1, [6, 3, 9])
    store = ChunkStore(model, page_size=4)
    keys = store.add(chunks)
    order = [2, 0, 1]
    req = store.assemble([keys[i] for i in order], positions=positions, extra_slots=5)
    lens = [len(chunks[i]) for i in order]
    assert req.num_slots == sum(lens) and req.chunk_lens == lens
    assert req.next_position == (sum(lens) if positions == "reordered" else max(lens))
    slot = 0
    for i, n in zip(order, lens):
        k, v = store.kv(keys[i])
        rows = req.cache.slot_rows(0, torch.arange(slot, slot + n))
        pos = req.positions[slot: slot + n]
        for l in range(SHAPE["num_hidden_layers"]):
            kl = req.cache.k[l].view(-1, 2, 16)[rows]
            # stored keys sit at 0..n-1: rotating them by pos - local gives R(pos) of the raw key
            want = rope_rotate(k[l], pos - torch.arange(n), store.rope.inv_freq, store.rope.rotary_dim,
                               store.rope.interleaved)
            torch.testing.assert_close(kl, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(req.cache.v[l].view(-1, 2, 16)[rows], v[l])
        slot += n


def test_disk_round_trip_bit_identical(model, tmp_path):
    chunks = _chunks(2, [4, 11])
    a = ChunkStore(model, directory=tmp_path)
    keys = a.add(chunks)
    assert sorted(p.stem for p in tmp_path.glob("*.safetensors")) == sorted(keys)
    b = ChunkStore(model, directory=tmp_path)
    assert len(b) == 0
    assert b.add(chunks) == keys and len(b) == 2              # loaded, not recomputed
    for k in keys:
        assert all(torch.equal(x, y) for x, y in zip(a.kv(k), b.kv(k)))
        assert torch.equal(a.tokens(k), b.tokens(k))
    ra, rb = a.assemble(keys), b.assemble(keys)
    rows = ra.cache.slot_rows(0, torch.arange(ra.num_slots))
    for x, y in zip(ra.cache.k + ra.cache.v, rb.cache.k + rb.cache.v):
        assert torch.equal(x.view(-1, 2, 16)[rows], y.view(-1, 2, 16)[rows])


def test_bad_files_are_refused_whole(model, tmp_path):
    a = ChunkStore(model, directory=tmp_path)
    key = a.add(_chunks(3, [9]))[0]
    path = tmp_path / f"{key}.safetensors"
    data = path.read_bytes()
    fresh = lambda: ChunkStore(model, directory=tmp_path)  # noqa: E731
    path.write_bytes(data[: len(data) - 100])                 # truncated
    s = fresh()
    with pytest.raises(ChunkStoreError, match="not a complete chunk file"):
        s.load(key)
    assert len(s) == 0
    corrupt = bytearray(data)
    corrupt[-7] ^= 0xFF                                        # one flipped byte in the tensor data
    path.write_bytes(bytes(corrupt))
    with pytest.raises(ChunkStoreError, match="checksum"):
        fresh().load(key)
    path.write_bytes(data)
    other = random_llama(SHAPE, dtype=torch.float32, seed=8)  # same shape, other weights
    s = ChunkStore(other, directory=tmp_path)
    assert s.fingerprint != a.fingerprint
    with pytest.raises(ChunkStoreError, match="another model"):
        s.load(path)
    assert len(s) == 0


def test_bad_inputs(model):
    store = ChunkStore(model)
    with pytest.raises(ChunkStoreError, match="window"):
        store.add([list(range(1, 66))])
    with pytest.raises(ChunkStoreError, match="no tokens"):
        store.add([[]])
    with pytest.raises(ChunkStoreError, match="empty retrieval"):
        store.assemble([])
    keys = store.add(_chunks(4, [30, 30]))
    with pytest.raises(ChunkStoreError, match="window"):
        store.assemble(keys, extra_slots=10)
    with pytest.raises(ChunkStoreError, match="no chunk"):
        store.assemble(["0" * 40])
    with pytest.raises(ChunkStoreError, match="positions"):
        store.assemble(keys, positions="shuffled")


def test_mismatched_store_is_refused(smollm2):
    from ragattn.methods import block_attention

    model, tok = smollm2
    store = ChunkStore(random_llama(SHAPE, dtype=torch.float32, seed=9))
    with pytest.raises(ChunkStoreError, match="another model"):
        block_attention.answer(model, tok, ["a passage"], "q?", store=store)


def test_pooled_kv_round_trip(model):
    store = ChunkStore(model)
    keys = store.add(_chunks(5, [7, 2, 12]))
    k, v = store.pooled_kv("cpu")
    L, Hkv, D = SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"], 16
    assert k.shape == v.shape == (L, 21, Hkv, D) and k.dtype == v.dtype == torch.float32
    assert store.num_rows == 21 and not k.is_pinned()
    # rows are the chunks in the order they were added
    assert torch.equal(k, torch.cat([store.kv(key)[0] for key in keys], dim=1))
    assert torch.equal(v, torch.cat([store.kv(key)[1] for key in keys], dim=1))
    want = store.assemble(keys[::-1])
    rows = want.cache.slot_rows(0, torch.arange(want.num_slots))

    store.load_pooled_kv_(torch.full_like(k, float("nan")), torch.full_like(v, 7.0))
    assert store.kv(keys[1])[0].isnan().all() and (store.kv(keys[2])[1] == 7.0).all()
    store.load_pooled_kv_(k, v)
    got = store.assemble(keys[::-1])
    for x, y in zip(got.cache.k + got.cache.v, want.cache.k + want.cache.v):
        assert torch.equal(x.view(-1, Hkv, D)[rows], y.view(-1, Hkv, D)[rows])
    if torch.cuda.is_available():
        hk, _ = store.pooled_kv("cpu", pin_memory=True)
        assert hk.is_pinned() and torch.equal(hk, k)


def test_pooled_kv_bad_inputs(model):
    store = ChunkStore(model)
    store.add(_chunks(6, [5]))
    k, v = store.pooled_kv()
    with pytest.raises(ChunkStoreError, match="dtype"):
        store.load_pooled_kv_(k.double(), v)
    with pytest.raises(ChunkStoreError, match="must be a tensor"):
        store.load_pooled_kv_(k, list(v))
    with pytest.raises(ChunkStoreError, match="pin_memory needs device 'cpu'"):
        store.pooled_kv("meta", pin_memory=True)
    store.add(_chunks(7, [3]))                                 # the copy is now stale
    with pytest.raises(ChunkStoreError, match=r"shape \(3, 5, 2, 16\), expected \(3, 8, 2, 16\)"):
        store.load_pooled_kv_(k, v)
