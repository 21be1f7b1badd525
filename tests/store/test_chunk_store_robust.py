"""The chunk store under an adversarial user: it follows the weights of the model it
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
from ragattn.store import ChunkStore, ChunkStoreError
from tests.helpers import run_in_threads

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, rope_theta=1000.0)
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


def test_variant_keys_check_the_model_once_and_follow_it(model, monkeypatch):
    store = ChunkStore(model, page_size=4)
    keys = store.add(_chunks(2, [3, 7, 5]))
    calls = []
    sync = store._sync
    monkeypatch.setattr(store, "_sync", lambda: (calls.append(1), sync())[1])
    got = store.variant_keys(keys, "fused-x")
    assert len(calls) == 1 and len(set(got)) == 3
    assert got == [store.variant_key(k, "fused-x") for k in keys]
    assert store.variant_keys([], "fused-x") == []
    with pytest.raises(ChunkStoreError, match="got one key"):
        store.variant_keys(keys[0], "fused-x")
    _no_grad_mul(model)                            # new weights: new variant keys, as variant_key's
    moved = store.variant_keys(keys, "fused-x")
    assert set(moved).isdisjoint(got) and moved == [store.variant_key(k, "fused-x") for k in keys]


# ----- 24.7: the disk tier after a crash ---------------------------------------------------------
def test_orphaned_temporary_files_are_removed(model, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphan = tmp_path / f"{'a' * 40}.tmp{dead}"                   # a writer killed mid-write
    probe = tmp_path / f".ragattn-write-probe-{dead}"
    live = tmp_path / f"{'b' * 40}.tmp{os.getppid()}"             # a live writer's: kept
    for p in (orphan, probe, live):
        p.write_bytes(b"partial")
    ChunkStore(model, directory=tmp_path)
    assert not orphan.exists() and not probe.exists() and live.exists()


def test_writes_are_synced_before_the_rename(model, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append("replace") or real_replace(a, b))
    ChunkStore(model, directory=tmp_path).add(_chunks(2, [5]))
    assert events[:3] == ["fsync", "replace", "fsync"]          # file, rename, directory entry


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_file_is_recomputed_and_replaced(model, tmp_path, damage):
    chunks = _chunks(3, [9, 4])
    keys = ChunkStore(model, directory=tmp_path).add(chunks)
    path = tmp_path / f"{keys[0]}.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) - 50], "empty": b"",
                      "flip": data[:-9] + bytes([data[-9] ^ 0x40]) + data[-8:]}[damage])
    store = ChunkStore(model, directory=tmp_path)
    if damage != "flip":
        assert not store.has(keys[0]) and store.has(keys[1])      # has() never reports what cannot load
    assert store.add(chunks) == keys                            # no error, now or later
    assert store.stats["computed"] == 1 and store.stats["loaded"] == 1
    assert_fresh(store, model, keys[0], chunks[0])
    assert ChunkStore(model, directory=tmp_path, read_only=True).load(path) == keys[0]   # replaced
    again = ChunkStore(model, directory=tmp_path)
    assert again.add(chunks) == keys and again.stats["loaded"] == 2


def test_a_corrupt_file_of_an_evicted_chunk_is_recomputed(model, tmp_path):
    """The path through assemble(): the chunk left memory, its file went bad meanwhile."""
    chunks = _chunks(4, [16, 16, 16])
    page = ChunkStore(model).row_bytes * 16
    store = ChunkStore(model, directory=tmp_path, memory_budget=2 * page)
    keys = store.add(chunks)
    assert keys[0] not in store
    path = tmp_path / f"{keys[0]}.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ChunkStoreError, match="checksum"):   # a store that never saw its tokens ...
        ChunkStore(model, directory=tmp_path).assemble(keys[:1])    # (this one recomputes it: below)
    assert not store.has(keys[0]) and not path.exists()        # ... and never reported again
    assert store.add(chunks[:1]) == keys[:1] and store.has(keys[0])
    assert_fresh(store, model, keys[0], chunks[0])


def test_resume_verifies_fused_caches(model, tmp_path):
    from ragattn.methods import fusionrag
    from ragattn.methods.selection import fused_variant

    chunks = _chunks(5, [6, 8, 5])
    head = [1, 2, 3]
    nbrs = [[1, 2], [0, 2], [0, 1]]
    store = ChunkStore(model, directory=tmp_path)
    assert fusionrag.fuse_chunks(model, store, head, chunks, nbrs) == (3, 0)
    keys = store.add(chunks)
    vkeys = [store.variant_key(k, fused_variant(head)) for k in keys]
    good = (tmp_path / f"{vkeys[1]}.safetensors").read_bytes()
    bad = bytearray(good)
    bad[-3] ^= 0x01
    (tmp_path / f"{vkeys[1]}.safetensors").write_bytes(bytes(bad))          # complete, but corrupt
    (tmp_path / f"{vkeys[2]}.safetensors").write_bytes(good[:100])          # truncated
    resumed = ChunkStore(model, directory=tmp_path)
    assert fusionrag.fuse_chunks(model, resumed, head, chunks, nbrs) == (2, 1)
    fresh = ChunkStore(model, directory=tmp_path)
    for vk in vkeys:
        fresh.load(vk)


# ----- 24.2, 24.4, 24.11: meaningless inputs are refused clearly -----------------------------------
def test_store_refuses_meaningless_inputs(model, tmp_path):
    store = ChunkStore(model, directory=tmp_path)
    with pytest.raises(ChunkStoreError, match="1-D sequence of token ids, got shape \\(2, 2\\)"):
        store.add([[[1, 2], [3, 4]]])
    with pytest.raises(ChunkStoreError, match="1-D"):
        store.add([torch.tensor([[5, 6, 7]])])
    keys = store.add(_chunks(6, [5, 3]))
    with pytest.raises(ChunkStoreError, match="extra_slots must be an integer >= 0, got -5"):
        store.assemble(keys, extra_slots=-5)
    dst = [torch.full((8, HKV, D), float("nan")) for _ in range(L)]
    rows = torch.arange(8)
    for bad in ([0, 1, 2, 3, 4, 5, 6, 1 << 31], [-1, 1, 2, 3, 4, 5, 6, 7]):
        with pytest.raises(ChunkStoreError, match="positions must be in \\[0, 2147483647\\]"):
            store.gather_into_(keys, dst, [t.clone() for t in dst], rows, torch.tensor(bad))
    with pytest.raises(ChunkStoreError, match="int32 or int64"):
        store.gather_into_(keys, dst, [t.clone() for t in dst], rows, torch.arange(8.0))
    assert all(t.isnan().all() for t in dst)                    # nothing written
    with pytest.raises(ChunkStoreError, match="neither a chunk key .* nor a chunk file"):
        store.load("/etc/hostname")
    with pytest.raises(ChunkStoreError, match="a bare key needs a store directory"):
        ChunkStore(model).load("0" * 40)
    if not torch.cuda.is_available():
        with pytest.raises(ChunkStoreError, match="pin_memory=True needs CUDA"):
            store.pooled_kv(pin_memory=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_put_refuses_another_dtype(model, tmp_path, dtype):
    store = ChunkStore(model, directory=tmp_path)
    key = store.add(_chunks(7, [6]))[0]
    k, v = store.get_kv(key)
    with pytest.raises(ChunkStoreError, match=f"model's dtype torch.float32, got {dtype}"):
        store.put(key, "other", [t.to(dtype) for t in k], v)
    vkey = store.variant_key(key, "other")
    assert not store.has(vkey) and not (tmp_path / f"{vkey}.safetensors").exists()
    assert store.put(key, "other", k, v) == vkey
    assert ChunkStore(model, directory=tmp_path).load(vkey) == vkey     # loadable in a new store


def test_refrag_generate_refuses_meaningless_options():
    from ragattn.methods.refrag.model import RefragModel

    rm = RefragModel.__new__(RefragModel)       # the checks run before any model is touched
    rm.k = 4
    for kw, match in ((dict(expand_fraction=-0.5), "expand_fraction"), (dict(expand_fraction=float("nan")), "expand_fraction"),
                      (dict(expand_fraction=1.5), "expand_fraction"), (dict(k=0), "k \\(tokens per chunk\\)"),
                      (dict(k=-3), "k \\(tokens per chunk\\)"), (dict(max_new_tokens=0), "max_new_tokens")):
        with pytest.raises(ValueError, match=match):
            rm.generate("q?", ["a passage"], **kw)
        if "max_new_tokens" not in kw:
            with pytest.raises(ValueError, match=match):
                rm.build_inputs([([[1, 2, 3, 4]], [5])], **kw)


# ----- 24.9: every request whose pages fit the budget is served -----------------------------------
_MODELS = {}


def _shared_model():
    if "m" not in _MODELS:
        _MODELS["m"] = random_llama(SHAPE, dtype=torch.float32, seed=0).eval()
    return _MODELS["m"]


def test_pool_serves_every_request_that_fits():
    """Random traffic through a small budget (pages of 2 rows): a request is refused exactly when
    its distinct chunks need more pages than the budget holds, and what is served is right."""
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.settings(max_examples=20, deadline=None)
    @hyp.given(budget_pages=st.integers(5, 12), lens=st.lists(st.integers(1, 9), min_size=4, max_size=8),
               requests=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=5), min_size=4, max_size=12))
    def run(budget_pages, lens, requests):
        model = _shared_model()
        chunks = _chunks(sum(lens), lens)
        ref = ChunkStore(model, page_size=2)
        ref_keys = ref.add(chunks)
        want = {k: ref.kv(k) for k in ref_keys}
        store = ChunkStore(model, page_size=2, memory_budget=budget_pages * 2 * ref.row_bytes)
        for c in chunks:            # every chunk known; most of them evicted, recomputed on use
            store.add([c])
        for req in requests:
            idx = [i % len(chunks) for i in req]
            keys = [ref_keys[i] for i in idx]
            pages = sum(-(-lens[i] // 2) for i in set(idx))
            if pages > budget_pages:
                with pytest.raises(ChunkStoreError, match="too small|more than the memory budget"):
                    store.assemble(keys)
                continue
            got = store.assemble(keys, positions="composite")   # served, chunks pinned while others load
            assert store.pool_bytes <= store.memory_budget
            for key, s, n in zip(keys, got.chunk_starts, got.chunk_lens):
                rows = got.cache.slot_rows(0, torch.arange(s, s + n))
                for l in range(L):
                    torch.testing.assert_close(got.cache.k[l].view(-1, HKV, D)[rows], want[key][0][l],
                                               rtol=1e-5, atol=1e-6)
                    torch.testing.assert_close(got.cache.v[l].view(-1, HKV, D)[rows], want[key][1][l],
                                               rtol=1e-5, atol=1e-6)
        assert all(e.pins == 0 for e in store._resident.entries.values())

    run()


# ----- 24.10: one model used from several threads ----------------------------------------------
def test_stores_on_one_model_in_several_threads(model):
    """Each thread has its own store on the same model: every chunk each computes is right."""
    torch.set_num_threads(1)

    def worker(seed):
        def run():
            store = ChunkStore(model, page_size=4)
            for i in range(25):
                c = _chunks(seed * 100 + i, [3 + i % 5])[0]
                key = store.add([c])[0]
                assert_fresh(store, model, key, c)
        return run

    run_in_threads([worker(s) for s in range(3)])
    assert model.config._attn_implementation == "sdpa"          # restored when the last one left


def test_baseline_and_stores_in_several_threads(model):
    """A full-prefill baseline (sdpa) and chunk stores (ragattn) share one model: each waits for the
    other's implementation, none runs with the wrong one; a nested switch is an error, not a hang."""
    from ragattn.hf.registration import use_ragattn
    from ragattn.hf.attn_switch import attention_implementation
    from ragattn.methods.baseline import full_prefill
    from tests.methods.test_fusionrag import CharTokenizer

    torch.set_num_threads(1)
    tok = CharTokenizer(SHAPE["vocab_size"])
    passages, question = ["some passage", "another one"], "q?"
    want = full_prefill(model, tok, passages, question, max_new_tokens=1).first_logits

    def baseline():
        for _ in range(6):
            got = full_prefill(model, tok, passages, question, max_new_tokens=1).first_logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    def stores():
        store = ChunkStore(model)
        for i in range(12):
            c = _chunks(500 + i, [4 + i % 3])[0]
            assert_fresh(store, model, store.add([c])[0], c)

    run_in_threads([baseline, stores, stores])
    assert model.config._attn_implementation == "sdpa"
    with use_ragattn(model):
        with pytest.raises(RuntimeError, match="nested switch"):
            with attention_implementation(model, "eager", lambda m, o, n: m.set_attn_implementation(n)):
                pass
    assert model.config._attn_implementation == "sdpa"


def test_methods_follow_a_data_edit_of_the_weights():
    """After ``p.data.mul_`` no wrapper may answer from stale KV (it would be silently off): a
    store follows its model into every method."""
    from ragattn.methods import block_attention, fusionrag
    from tests.methods.test_fusionrag import QUESTION, CharTokenizer

    model = random_llama(SHAPE, dtype=torch.float32, seed=2).eval()
    tok = CharTokenizer(SHAPE["vocab_size"])
    passages = ["first passage.", "second one!"]
    store = ChunkStore(model)
    block_attention.answer(model, tok, passages, QUESTION[:20], max_new_tokens=1, store=store)
    for p in model.parameters():
        p.data.mul_(1.5)
    for run in (lambda s: block_attention.answer(model, tok, passages, QUESTION[:20], max_new_tokens=1, store=s),
                lambda s: fusionrag.answer(model, tok, passages, QUESTION[:20], max_new_tokens=1, store=s, ratio=0.2)):
        got, want = run(store).first_logits, run(ChunkStore(model)).first_logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----- several stores on one directory, files of evicted chunks, refusals that name their cause ----
def test_stores_on_one_directory_in_several_threads(model, tmp_path):
    """Stores of one process share a directory (threads): overlapping chunks written at once by
    several writers all land whole, and every chunk reads back bit-identical in a new store."""
    torch.set_num_threads(1)
    chunks = _chunks(40, [3, 5, 4, 6, 2, 7])
    barrier = threading.Barrier(4)
    served = {}

    def worker(w):
        def run():
            try:
                rounds(w)
            except BaseException:
                barrier.abort()              # the others stop waiting
                raise
        return run

    def rounds(w):
            for rnd in range(6):
                barrier.wait()
                store = ChunkStore(model, directory=tmp_path)      # the write probe, at once
                mine = [chunks[(w + j + rnd) % len(chunks)] for j in range(3)]
                for key, (k, v) in zip(store.add(mine), (fresh_kv(model, c) for c in mine)):
                    served[key] = store.kv(key)
                    torch.testing.assert_close(served[key][0], k, rtol=1e-4, atol=1e-5)
                    torch.testing.assert_close(served[key][1], v, rtol=1e-4, atol=1e-5)
                barrier.wait()
                for p in tmp_path.glob("*.safetensors"):               # next round writes again
                    if w == 0 and rnd < 5:
                        p.unlink()

    run_in_threads([worker(w) for w in range(4)])
    written = len(list(tmp_path.glob("*.safetensors")))
    store = ChunkStore(model, directory=tmp_path)
    keys = store.add(chunks)                           # every file of the last round loads whole
    assert store.stats["loaded"] == written > 0 and not list(tmp_path.glob("*tmp*"))
    for key, c in zip(keys, chunks):
        assert_fresh(store, model, key, c)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("use", ["assemble", "kv", "request", "put"])
def test_a_damaged_file_of_an_evicted_chunk_is_recomputed_and_replaced(model, tmp_path, damage, use):
    """A chunk this store computed left memory; its file was then damaged: the store still knows
    its tokens, recomputes it, replaces the file, and counts the bad file."""
    chunks = _chunks(41, [16, 16, 16])
    page = ChunkStore(model).row_bytes * 16
    store = ChunkStore(model, directory=tmp_path, memory_budget=2 * page)
    keys = store.add(chunks)
    assert keys[0] not in store
    path = tmp_path / f"{keys[0]}.safetensors"
    data = path.read_bytes()
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(data[: len(data) - 50] if damage == "truncate"
                         else data[:-9] + bytes([data[-9] ^ 0x40]) + data[-8:])
    if use == "assemble":
        store.assemble(keys[:1]).cache
    elif use == "kv":
        store.kv(keys[0])
    elif use == "request":
        store.request(keys[:1]).release()
    else:
        k, v = fresh_kv(model, chunks[0])
        store.put(keys[0], "v", list(k), list(v))
        store.kv(keys[0])
    assert store.stats["recomputed"] == 1 and store.stats["bad_files"] == (damage != "delete")
    assert_fresh(store, model, keys[0], chunks[0])
    assert ChunkStore(model, directory=tmp_path, read_only=True).load(path) == keys[0]   # replaced


def test_a_damaged_file_unknown_to_the_store_is_named(model, tmp_path):
    """A store that never saw the chunk's tokens cannot recompute it: its error names the file."""
    key = ChunkStore(model, directory=tmp_path).add(_chunks(42, [9]))[0]
    path = tmp_path / f"{key}.safetensors"
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(ChunkStoreError, match=f"{path.name}.*truncated"):
        ChunkStore(model, directory=tmp_path).kv(key)


def test_refusals_name_their_cause(model, tmp_path):
    for bad in (2.5, "16", True):
        with pytest.raises(ChunkStoreError, match=f"page_size must be an integer >= 1, got {bad!r}"):
            ChunkStore(model, page_size=bad)
    with pytest.raises(ChunkStoreError, match="max_batch_tokens must be an integer >= 1, got 8.0"):
        ChunkStore(model, max_batch_tokens=8.0)
    page = ChunkStore(model).row_bytes * 4
    store = ChunkStore(model, directory=tmp_path, page_size=4, memory_budget=6 * page)
    a, b = store.add(_chunks(43, [8, 8]))
    k, v = store.get_kv(a)
    vkey = store.put(a, "x", k, v)
    with store.request([vkey, b]) as req:        # 4 of 6 pages pinned by a live request
        before = (tmp_path / f"{vkey}.safetensors").read_bytes()
        with pytest.raises(ChunkStoreError, match="put: .* held by 1 live zero-copy request"):
            store.put(a, "x", [t * 2 for t in k], v)
        assert (tmp_path / f"{vkey}.safetensors").read_bytes() == before      # nothing written
        with pytest.raises(ChunkStoreError, match="1 live zero-copy request.* hold 4 of its 6 pages.*release"):
            store.add(_chunks(44, [12]))          # 3 pages: fits the budget, not beside the request
        assert req.cache is not None
    store.add(_chunks(44, [12]))                  # released: it fits
    with pytest.raises(ChunkStoreError, match="budget .* too small: the chunks one request uses"):
        store.assemble(store.add(_chunks(45, [8, 8, 8, 8])))
