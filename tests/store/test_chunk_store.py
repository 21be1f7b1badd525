from pathlib import Path

import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.reference.kv_cache import rope_rotate
from ragattn.store import ChunkStore, ChunkStoreError, model_fingerprint, weight_checksums

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
    assert k.shape == v.shape == (L, store.pool_rows, Hkv, D) and k.dtype == v.dtype == torch.float32
    assert store.num_rows == 21 and store.pool_rows >= 21 and not k.is_pinned()
    assert store.pool_bytes == store.pool_rows * store.row_bytes == k.nbytes + v.nbytes
    want = store.assemble(keys[::-1])
    rows = want.cache.slot_rows(0, torch.arange(want.num_slots))
    kv = [store.kv(key) for key in keys]

    store.load_pooled_kv_(torch.full_like(k, float("nan")), torch.full_like(v, 7.0))
    assert store.kv(keys[1])[0].isnan().all() and (store.kv(keys[2])[1] == 7.0).all()
    store.load_pooled_kv_(k, v)
    assert all(torch.equal(a, b) for key, (ka, va) in zip(keys, kv) for a, b in zip((ka, va), store.kv(key)))
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
    with pytest.raises(ChunkStoreError, match=r"shape \(3, 5, 2, 16\), expected \(3, 256, 2, 16\)"):  # 16 pages of 16
        store.load_pooled_kv_(k[:, :5], v[:, :5])
    store.add(_chunks(7, [3]))          # the copy is now stale (same shape: the pool had room)
    assert store.pool_rows == k.shape[1]
    with pytest.raises(ChunkStoreError, match="stale"):
        store.load_pooled_kv_(k, v)


# ----- fingerprint: stale KV after the weights or the config change ---------------
def _fresh_kv(model, tokens):
    """K, V ``[L, n, Hkv, D]`` of one chunk prefilled alone by HF's own attention."""
    with torch.no_grad():
        past = model.model(torch.tensor([tokens]), use_cache=True).past_key_values
    return (torch.stack([layer.keys[0].transpose(0, 1) for layer in past.layers]),
            torch.stack([layer.values[0].transpose(0, 1) for layer in past.layers]))


def test_fine_tuned_model_never_reuses_old_chunks(model, tmp_path):
    chunks = _chunks(8, [9, 4])
    old = ChunkStore(model, directory=tmp_path)
    keys = old.add(chunks)
    old_kv = old.kv(keys[0])
    with torch.no_grad():                                   # one fine-tuning step on one weight
        model.model.layers[0].self_attn.k_proj.weight[3, 5] += 0.25
    assert old.fingerprint != model_fingerprint(model)     # the cached check sees in-place writes
    new = ChunkStore(model, directory=tmp_path)
    assert new.fingerprint != old.fingerprint
    new_keys = new.add(chunks)
    assert set(new_keys).isdisjoint(keys) and new.stats["loaded"] == 0 and new.stats["computed"] == 2
    for key, c in zip(new_keys, chunks):
        for got, want in zip(new.kv(key), _fresh_kv(model, c)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (new.kv(new_keys[0])[0] - old_kv[0]).abs().max() > 1e-3
    with pytest.raises(ChunkStoreError, match="another model"):
        new.load(tmp_path / f"{keys[0]}.safetensors")        # the old file is refused by path too
    # a write that bypasses the version counter (p.data) is seen at store creation
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight.data[0, 0] *= 1.5
    assert ChunkStore(model, directory=tmp_path).fingerprint != new.fingerprint


def test_fingerprint_covers_config_and_buffers(model):
    fp = ChunkStore(model).fingerprint
    rope = model.config.rope_parameters                     # config changed after the first store
    rope["rope_theta"] *= 2
    assert model_fingerprint(model) != fp
    rope["rope_theta"] /= 2
    assert model_fingerprint(model) == fp
    model.config.sliding_window = 8
    assert model_fingerprint(model) != fp
    del model.config.sliding_window
    inv = model.model.rotary_emb.inv_freq                   # a non-persistent buffer
    inv.mul_(1.01)
    assert model_fingerprint(model) != fp
    inv.div_(1.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_weight_checksums_see_every_bit_and_every_move(dtype):
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(37, 129, generator=g) * 100).to(dtype)   # odd sizes: a tail that is not a row
    base = weight_checksums([t])[0]
    assert weight_checksums([t.clone()])[0] == base
    flat = t.reshape(-1).view(torch.uint8)
    for pos in (0, 700, flat.numel() - 1):                  # first row, middle, the tail
        u = flat.clone()
        u[pos] ^= 1
        assert weight_checksums([u.view(dtype).view(t.shape)])[0] != base
    rows = t.reshape(-1).view(torch.uint8)[: (flat.numel() // 512) * 512].view(-1, 512)
    if rows.shape[0] >= 2:                                   # two 512-byte rows swapped
        u = flat.clone()
        u[:1024] = torch.cat([rows[1], rows[0]])
        assert weight_checksums([u.view(dtype).view(t.shape)])[0] != base
    v = t.t().contiguous()                                   # transposed: same bytes, other order
    assert weight_checksums([v])[0] != base


# ----- errors, not tracebacks ------------------------------------------------------
def _read_only_dir(tmp_path):
    """A directory this process cannot write to, or None (root ignores chmod: try /sys)."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    for cand in (d, Path("/sys/kernel")):
        try:
            (cand / ".probe").write_bytes(b"")
            (cand / ".probe").unlink()
        except OSError:
            return cand
    return None


def test_read_only_directory(model, tmp_path):
    ro = _read_only_dir(tmp_path)
    if ro is None:
        pytest.skip("no directory here refuses writes")
    with pytest.raises(ChunkStoreError, match=f"directory {ro}"):
        ChunkStore(model, directory=ro)
    store = ChunkStore(model, directory=ro, read_only=True)   # serving what is there is fine
    key = store.add(_chunks(9, [6]))[0]
    assert key in store and not store.has(key + "x") and store.stats["computed"] == 1
    with pytest.raises(ChunkStoreError, match="read-only"):
        store.save(key)


def test_failed_write_leaves_nothing_half_added(model, tmp_path, monkeypatch):
    import errno
    import builtins

    chunks = _chunks(10, [5, 8, 3])
    store = ChunkStore(model, directory=tmp_path)
    real_open, calls = builtins.open, []

    def failing_open(path, mode="r", *a, **kw):
        if "w" in mode and str(path).startswith(str(tmp_path)):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", failing_open)
    with pytest.raises(ChunkStoreError, match=f"directory {tmp_path}"):
        store.add(chunks)
    monkeypatch.undo()
    first, second = store.key(chunks[0]), store.key(chunks[1])
    assert first in store and store.has(first)                      # fully added
    assert second not in store and not store.has(second)            # fully absent
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{first}.safetensors"]  # no temp file
    assert store.add(chunks) == [store.key(c) for c in chunks] and len(store) == 3


def test_token_ids_outside_the_vocabulary(model):
    store = ChunkStore(model)
    for bad in ([5, 97, 3], [-1, 4], torch.tensor([2, 3, 200, 1])):
        with pytest.raises(ChunkStoreError, match="outside the model's vocabulary"):
            store.add(_chunks(11, [4]) + [bad])
    with pytest.raises(ChunkStoreError, match="integers"):
        store.add([[1.0, 2.0]])
    assert len(store) == 0 and store.pool_bytes == 0


# ----- the memory budget --------------------------------------------------------------
def _page_bytes(store):
    return store.page_size * store.row_bytes


def test_budget_evicts_lru_and_reloads_bit_exact(model, tmp_path):
    probe = ChunkStore(model)
    budget = 12 * _page_bytes(probe)                          # 12 pages of 16 rows
    store = ChunkStore(model, directory=tmp_path, memory_budget=budget)
    chunks = _chunks(12, [20, 7, 16, 30, 12, 25, 9, 17, 31, 5])
    keys = store.add(chunks[:3])
    before = {k: store.kv(k) for k in keys}
    want = store.assemble(keys)
    rows = want.cache.slot_rows(0, torch.arange(want.num_slots))
    store.add(chunks[3:])
    assert store.pool_bytes <= budget and store.stats["evicted"] > 0
    assert keys[0] not in store and all(store.has(k) for k in keys)
    got = store.assemble(keys)                                # reloaded from disk
    assert store.stats["loaded"] >= 1 and store.stats["computed"] == len(chunks)
    for x, y in zip(got.cache.k + got.cache.v, want.cache.k + want.cache.v):
        assert torch.equal(x.view(-1, 2, 16)[rows], y.view(-1, 2, 16)[rows])
    assert all(torch.equal(a, b) for k in keys for a, b in zip(before[k], store.kv(k)))
    assert store.pool_bytes <= budget


def test_budget_without_directory_recomputes(model):
    budget = 6 * _page_bytes(ChunkStore(model))
    store = ChunkStore(model, memory_budget=budget)
    chunks = _chunks(13, [16, 16, 16, 16, 16, 16, 16, 16])
    keys = store.add(chunks)
    assert len(store) == 6 and store.pool_bytes <= budget
    assert keys[0] not in store and keys[-1] in store
    req = store.assemble(keys[:3])                            # two of them recomputed on the miss
    assert store.stats["recomputed"] == 2 and store.pool_bytes <= budget
    for i, (s, n) in enumerate(zip(req.chunk_starts, req.chunk_lens)):
        rows = req.cache.slot_rows(0, torch.arange(s, s + n))
        fk, fv = _fresh_kv(model, chunks[i])
        torch.testing.assert_close(req.cache.v[1].view(-1, 2, 16)[rows], fv[1], rtol=1e-5, atol=1e-5)
    # a derived entry held only in memory is dropped when evicted (has() turns False)
    k0, v0 = store.get_kv(keys[0])
    vkey = store.put(keys[0], "variant-a", k0, v0)
    assert store.has(vkey)
    store.add(chunks[3:] + chunks[:3])                        # 8 pages through 6: vkey is the LRU
    assert not store.has(vkey) and store.stats["evicted"] >= 6
    with pytest.raises(ChunkStoreError, match="no chunk"):
        store.assemble([vkey])


def test_a_request_never_evicts_its_own_chunks(model, tmp_path):
    page = _page_bytes(ChunkStore(model))
    store = ChunkStore(model, directory=tmp_path, memory_budget=4 * page)
    chunks = _chunks(14, [16, 16, 16, 16, 16, 16])
    keys = store.add(chunks)                                  # only the last 4 stay in memory
    assert [k in store for k in keys] == [False, False, True, True, True, True]
    # this request needs 4 pages: loading keys[0], keys[1] must evict keys[4], keys[5], not keys[2:4]
    req = store.assemble([keys[2], keys[0], keys[3], keys[1]])
    assert [k in store for k in keys] == [True, True, True, True, False, False]
    ref = ChunkStore(model, directory=tmp_path, read_only=True)
    want = ref.assemble([keys[2], keys[0], keys[3], keys[1]])
    rows = want.cache.slot_rows(0, torch.arange(want.num_slots))
    for x, y in zip(req.cache.k + req.cache.v, want.cache.k + want.cache.v):
        assert torch.equal(x.view(-1, 2, 16)[rows], y.view(-1, 2, 16)[rows])
    with pytest.raises(ChunkStoreError, match="too small"):   # 5 pages cannot fit in 4
        store.assemble(keys[:5])
    assert all(e.pins == 0 for e in store._resident.entries.values())
    with pytest.raises(ChunkStoreError, match="more than the memory budget"):
        ChunkStore(model, memory_budget=3 * page).add(_chunks(15, [49]))   # 4 pages, budget 3
    with pytest.raises(ChunkStoreError, match="below one page"):
        ChunkStore(model, memory_budget=page - 1)


def test_gather_into_any_cache(model):
    """The serving-engine path: chunks written at arbitrary rows of a caller's paged cache."""
    store = ChunkStore(model, page_size=4, memory_budget=10 * 4 * ChunkStore(model).row_bytes)
    chunks = _chunks(16, [5, 9, 3, 7])
    keys = store.add(chunks)                                  # 10 pages of 4: spread over slabs
    order = [3, 1, 0]
    lens = [len(chunks[i]) for i in order]
    T = sum(lens)
    dst_k = [torch.full((11, 8, 2, 16), float("nan")) for _ in range(3)]
    dst_v = [torch.full((11, 8, 2, 16), float("nan")) for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    dst_rows = torch.randperm(88, generator=g)[:T]
    positions = torch.randint(0, 60, (T,), generator=g)
    store.gather_into_([keys[i] for i in order], dst_k, dst_v, dst_rows, positions)
    r = 0
    for i, n in zip(order, lens):
        k, v = store.kv(keys[i])
        sl = slice(r, r + n)
        for l in range(3):
            want = rope_rotate(k[l], positions[sl] - torch.arange(n), store.rope.inv_freq,
                               store.rope.rotary_dim, store.rope.interleaved)
            torch.testing.assert_close(dst_k[l].view(-1, 2, 16)[dst_rows[sl]], want, rtol=1e-5, atol=1e-5)
            assert torch.equal(dst_v[l].view(-1, 2, 16)[dst_rows[sl]], v[l])
        r += n
    untouched = torch.ones(88, dtype=torch.bool)
    untouched[dst_rows] = False
    assert dst_v[0].view(-1, 2, 16)[untouched].isnan().all()
    assert len({id(s) for e in store._resident.entries.values() for s, _, _ in e.parts}) > 1    # the multi-slab path ran
    with pytest.raises(ChunkStoreError, match="dst_rows"):
        store.gather_into_(keys[:1], dst_k, dst_v, dst_rows)
    assert store.lookup([keys[0], "0" * 40]) == [True, False]


def test_one_key_where_keys_are_expected_is_refused_by_name(model):
    """A str is a sequence of one-character 'keys': every API that takes keys refuses it, naming itself."""
    store = ChunkStore(model, page_size=4)
    key = store.add(_chunks(20, [7]))[0]
    L, hkv = SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"]
    dst = [torch.full((16, hkv, 16), float("nan")) for _ in range(L)]
    calls = {
        "lookup": lambda k: store.lookup(k),
        "variant_keys": lambda k: store.variant_keys(k, "fused"),
        "assemble": lambda k: store.assemble(k),
        "request": lambda k: store.request(k),
        "gather_into_": lambda k: store.gather_into_(k, dst, dst, torch.arange(7)),
    }
    for name, call in calls.items():
        for one in (key, key.encode()):
            with pytest.raises(ChunkStoreError, match=f"ChunkStore.{name}: keys must be a sequence of keys"):
                call(one)
        with pytest.raises(ChunkStoreError, match=f"ChunkStore.{name}: .*got 3"):
            call([key, 3])
    assert store.lookup((key,)) == [True]      # any sequence of str keys
