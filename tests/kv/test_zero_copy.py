"""Zero-copy chunk assembly: page-local chunk pages in the store, request page
tables over the store's own pages with RoPE in the kernel, copy-on-write for recompute, pinning."""
import pytest
import torch

from ragattn.hf.models import random_llama
from ragattn.store import ChunkStore
from ragattn.reference.kv_cache import rope_rotate

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, rope_theta=1000.0)


@pytest.fixture
def model():
    return random_llama(SHAPE, dtype=torch.float32, seed=7)


def _chunks(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lens]


def test_pool_keys_are_page_local(model):
    """The pool holds each chunk's keys page-local, token j rotated by its page offset j % page_size
    (a chunk's pages are whole but its last): rotating them by j - j % page_size more gives the keys
    a plain forward computes; the values are stored as they are."""
    chunks = _chunks(0, [9, 1, 21])
    store = ChunkStore(model, page_size=4)
    keys = store.add(chunks)
    for key, c in zip(keys, chunks):
        e = store._resident.entries[key]
        raw_k, raw_v = store._pool.read(e.parts, e.rows)
        with torch.no_grad():
            past = model.model(torch.tensor([c]), use_cache=True).past_key_values
        n = len(c)
        for l in range(SHAPE["num_hidden_layers"]):
            want_k = past.layers[l].keys[0].transpose(0, 1)
            j = torch.arange(n)
            got = rope_rotate(raw_k[l], j - j % 4, store.rope.inv_freq, store.rope.rotary_dim,
                              store.rope.interleaved)
            torch.testing.assert_close(got, want_k, rtol=1e-5, atol=1e-5)
            if n > 4:   # not the rotated keys themselves (the first page is at position 0)
                assert (raw_k[l][4:] - want_k[4:]).abs().max() > 1e-3
            local = rope_rotate(want_k, j % 4 - j, store.rope.inv_freq, store.rope.rotary_dim,
                                store.rope.interleaved)
            torch.testing.assert_close(raw_k[l], local, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(raw_v[l], past.layers[l].values[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def _masked_full_logits(model, blocks, final, firsts, dtype=torch.float64, window_left=-1):
    """One forward of blocks + final in ``dtype``, each block alone at positions ``firsts[i] + j``
    (Block-Attention mask), the final block after the furthest block end, seeing everything
    (``window_left >= 0``: within that many positions)."""
    import copy

    m = copy.deepcopy(model).to(dtype)
    lens = [len(b) for b in blocks]
    nxt = max(f + n for f, n in zip(firsts, lens))
    ids = torch.tensor([[t for b in blocks for t in b] + final])
    pos = torch.cat([f + torch.arange(n) for f, n in zip(firsts, lens)] + [nxt + torch.arange(len(final))])
    blk = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)] + [torch.full((len(final),), -1)])
    n = ids.shape[1]
    allow = (pos[None, :] <= pos[:, None]) & ((blk[:, None] == blk[None, :]) | (blk[:, None] == -1))
    allow &= torch.ones(n, n, dtype=torch.bool).tril()
    if window_left >= 0:
        allow &= pos[None, :] >= pos[:, None] - window_left
    mask = torch.zeros(n, n, dtype=dtype).masked_fill(~allow, float("-inf"))[None, None]
    with torch.no_grad():
        out = m(input_ids=ids, position_ids=pos[None], attention_mask=mask, use_cache=False)
    return out.logits[0, -len(final):]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


BACKENDS = ["default", "reference", "triton"]   # CPU SDPA route; run_paged_attention: reference, kernel


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", ["reordered", "composite", "gapped"])
def test_request_equals_copy_path_and_float64_pass(model, scheme, backend, monkeypatch):
    """The final block prefilled on a zero-copy request (pages shared with the store, keys
    rotated in the kernel) gives the copy path's logits within fp32 rounding and the float64
    masked single pass's; pages out of order, partial last pages (lengths not multiples of 4)."""
    from ragattn.methods.generate import paged_forward

    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)
    chunks = _chunks(3, [6, 11, 1, 9])
    store = ChunkStore(model, page_size=4)
    keys = store.add(chunks[::-1])[::-1]          # pool pages in the reverse order of the request
    final = [5, 17, 3, 41, 8]
    lens = [len(c) for c in chunks]
    if scheme == "reordered":
        firsts = [sum(lens[:i]) for i in range(len(lens))]
    elif scheme == "composite":
        firsts = [0] * len(lens)
    else:                                          # gaps and an overlap, chunks not in position order
        firsts = [40, 3, 70, 5]
    with store.request(keys, scheme if scheme != "gapped" else firsts, extra_slots=len(final) + 3) as req:
        assert req.next_position == max(f + n for f, n in zip(firsts, lens))
        assert req.positions.tolist() == torch.cat([f + torch.arange(n) for f, n in zip(firsts, lens)]).tolist()
        pos = req.next_position + torch.arange(len(final))
        got = paged_forward(model, torch.tensor([final]), pos, req.cache)
        assert req.private_pages == 2 and req.cache.cow_pages == 0
    ref = _masked_full_logits(model, chunks, final, firsts)
    assert _rel(got, ref) <= 2e-5, _rel(got, ref)
    if scheme != "gapped":
        areq = store.assemble(keys, positions=scheme, extra_slots=len(final))
        copy = paged_forward(model, torch.tensor([final]), pos, areq.cache)
        assert _rel(got, copy) <= 2e-5
    # positions matter: the same request read as composite is another computation
    wrong = _masked_full_logits(model, chunks, final, [0, 0, 0, 0] if scheme != "composite" else [0, 6, 17, 18])
    assert _rel(wrong, ref) > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_is_by_position_on_both_paths(backend, monkeypatch):
    """A sliding window is by position (ragattn.kv.window): gapped first positions on a zero-copy
    request give the float64 masked pass with the window by position; composite positions (every
    chunk from 0) give the same answer on both paths while the window hides nothing, and are
    refused by both once it would (the copy path windowed by slot and disagreed by ~80%)."""
    from ragattn.methods.generate import paged_forward

    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)
    W = 8                                          # transformers' sliding_window: window_left = W - 1
    model = random_llama(dict(SHAPE, sliding_window=W), dtype=torch.float32, family="mistral", seed=3)
    chunks = _chunks(13, [6, 11, 1, 9])
    lens = [len(c) for c in chunks]
    final = [5, 17, 3, 41, 8]
    store = ChunkStore(model, page_size=4)
    keys = store.add(chunks)
    firsts = [40, 3, 70, 20]                       # gaps, no position held twice
    with store.request(keys, firsts, extra_slots=len(final)) as req:
        pos = req.next_position + torch.arange(len(final))
        got = paged_forward(model, torch.tensor([final]), pos, req.cache)
    ref = _masked_full_logits(model, chunks, final, firsts, window_left=W - 1)
    assert _rel(got, ref) <= 2e-5, _rel(got, ref)
    assert _rel(_masked_full_logits(model, chunks, final, firsts), ref) > 1e-3   # the window matters
    pos = max(lens) + torch.arange(len(final))
    for path in ("copy", "zero-copy"):             # composite, the window narrower than the request
        req = store.assemble(keys, "composite", extra_slots=len(final)) if path == "copy" else \
            store.request(keys, "composite", extra_slots=len(final))
        with pytest.raises(ValueError, match=r"sliding window \(window_left=7\).*share positions"):
            paged_forward(model, torch.tensor([final]), pos, req.cache)
        if path == "zero-copy":
            req.release()
    wide = sum(lens) + len(final) + 1              # a window wider than the request hides nothing
    model = random_llama(dict(SHAPE, sliding_window=wide), dtype=torch.float32, family="mistral", seed=3)
    store = ChunkStore(model, page_size=4)
    keys = store.add(chunks)
    areq = store.assemble(keys, "composite", extra_slots=len(final))
    copy = paged_forward(model, torch.tensor([final]), pos, areq.cache)
    with store.request(keys, "composite", extra_slots=len(final)) as req:
        got = paged_forward(model, torch.tensor([final]), pos, req.cache)
    assert _rel(got, copy) <= 2e-5
    assert _rel(got, _masked_full_logits(model, chunks, final, [0] * 4)) <= 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_request_over_several_slabs_merges_exactly(model, backend, monkeypatch):
    """Chunks spread over several pool slabs: one kernel call per slab, merged by LSE."""
    from ragattn.methods.generate import paged_forward

    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)
    row_bytes = ChunkStore(model).row_bytes
    store = ChunkStore(model, page_size=4, memory_budget=40 * 4 * row_bytes)
    filler = store.add(_chunks(4, [60]))          # first slab (16 pages) mostly used
    chunks = _chunks(5, [7, 30, 13])
    keys = store.add(chunks)
    final = [9, 2, 77]
    with store.request(keys, "reordered", extra_slots=len(final)) as req:
        assert len(req.cache.segments) > 1
        pos = req.next_position + torch.arange(len(final))
        got = paged_forward(model, torch.tensor([final]), pos, req.cache)
    ref = _masked_full_logits(model, chunks, final, [0, 7, 37])
    assert _rel(got, ref) <= 2e-5
    assert filler


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_on_a_request_equals_the_copy_path(model, backend, monkeypatch):
    """Greedy decoding over a PagedCache of a zero-copy request gives the copy path's tokens, and
    every decode step's keys go page-local into the private pages (several of them)."""
    from ragattn.methods.generate import generate_paged

    class Tok:
        pad_token_id, eos_token_id = 0, None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    model.generation_config.eos_token_id = None
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)
    chunks = _chunks(6, [5, 14, 8])
    store = ChunkStore(model, page_size=4)
    keys = store.add(chunks)
    final = [4, 50, 23]
    a = store.assemble(keys, positions="composite", extra_slots=len(final) + 12)
    want = generate_paged(model, Tok(), a.cache, final, a.next_position, 12, 0.0, "copy", 0)
    with store.request(keys, "composite", extra_slots=len(final) + 12) as req:
        got = generate_paged(model, Tok(), req.cache, final, req.next_position, 12, 0.0, "zero-copy", 0)
        n = req.num_slots + len(final) + 11
        assert int(req.cache.lengths[0]) == n and req.private_pages == 4
        assert req.cache.positions()[req.num_slots:].tolist() == list(range(14, 14 + len(final) + 11))
    assert got.tokens == want.tokens and len(got.tokens) == 12
    torch.testing.assert_close(got.first_logits, want.first_logits, rtol=2e-5, atol=2e-5)


# ----- copy on write under selective recompute (FusionRAG, CacheBlend) ---------------------------
def _fusion_setup(family="llama"):
    from tests.methods.test_fusionrag import CHUNKS, QUESTION, _tiny

    model, tok = _tiny(family)
    return model, tok, [c[:40] for c in CHUNKS], QUESTION


@pytest.mark.parametrize("backend", ["default", "triton"])
@pytest.mark.parametrize("method", ["fusionrag", "cacheblend"])
def test_recompute_copies_only_the_pages_it_writes(method, backend, monkeypatch):
    """A partial recompute on a zero-copy request: the pages holding recomputed slots are copied
    into the request's private pages (page granularity), the others stay shared and the store's
    pages are never written; answers and logits equal the copy path's."""
    from ragattn.methods import fusionrag

    model, tok, chunks, question = _fusion_setup()
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)
    store = ChunkStore(model, page_size=4)
    fn = getattr(fusionrag, "answer" if method == "fusionrag" else "cacheblend")
    keys = store.add(fusionrag.prompt_parts(tok, chunks, question)[1])
    before = {k: store.kv(k) for k in keys}
    copy = fn(model, tok, chunks, question, max_new_tokens=3, store=store, ratio=0.2, zero_copy=False)
    raw = {k: store._pool.read(e.parts, e.rows) for k, e in store._resident.entries.items()}   # head included
    got = fn(model, tok, chunks, question, max_new_tokens=3, store=store, ratio=0.2)
    assert got.extra["recomputed_slots"] == copy.extra["recomputed_slots"] and got.tokens == copy.tokens
    torch.testing.assert_close(got.first_logits, copy.first_logits, rtol=1e-4, atol=1e-4)
    # copy on write: exactly the pages of the slots written (selected chunk tokens; CacheBlend
    # writes every chunk slot in its first layers)
    head, chunk_ids, tail = fusionrag.prompt_parts(tok, chunks, question)
    written = (range(len(head), len(head) + sum(map(len, chunk_ids))) if method == "cacheblend"
               else copy.extra["recomputed_slots"])
    starts = [len(head)]
    for c in chunk_ids:
        starts.append(starts[-1] + len(c))

    def page_of(slot):   # (block, page within the block): blocks start on fresh pages
        b = max(i for i, s0 in enumerate([0] + starts[:-1]) if slot >= s0)
        return b, (slot - ([0] + starts[:-1])[b]) // 4
    pages = {page_of(s) for s in written}
    assert 0 < len(pages) and got.extra["cow_pages"] == len(pages)
    if method == "fusionrag":
        total = sum(-(-n // 4) for n in [len(head)] + [len(c) for c in chunk_ids])
        assert got.extra["cow_pages"] < total
    n_private = -(-(len(tail) + 3) // 4) + len(pages)
    assert got.extra["private_bytes"] == n_private * 4 * store.row_bytes
    # the store's pages (every slab) are bit for bit as before: only private copies were written
    for k, e in store._resident.entries.items():
        assert all(torch.equal(a, b) for x, y in zip(raw[k], store._pool.read(e.parts, e.rows)) for a, b in zip(x, y))
    assert all(torch.equal(a, b) for k in keys for a, b in zip(before[k], store.kv(k)))
    assert all(e.pins == 0 for e in store._resident.entries.values())


def test_recompute_at_another_position_is_refused(model):
    from ragattn.hf.registration import use_ragattn
    from ragattn.methods.fusionrag import recompute

    store = ChunkStore(model, page_size=4)
    keys = store.add(_chunks(7, [6, 5]))
    with store.request(keys, "reordered", extra_slots=2) as req, use_ragattn(model):
        with pytest.raises(ValueError, match="chunk slot at position 7"):
            recompute(model, req.cache, torch.tensor([3, 4]), torch.tensor([2, 7]),
                      positions=torch.tensor([2, 9]))
        assert req.cache.cow_pages == 0
    with pytest.raises(ValueError, match="released"):
        req.cache.read_kv(0, torch.tensor([0]))


def test_concurrent_requests_hold_the_chunk_pages_once(model):
    """N requests over the same chunks point at the same pool pages: the pool holds the chunks'
    pages once plus each request's private pages; releasing gives the private pages back."""
    store = ChunkStore(model, page_size=4)
    keys = store.add(_chunks(8, [10, 7, 13]))                 # 3 + 2 + 4 pages
    in_use = lambda: sum(s.pages - len(s.free) for s in store._pool.slabs)  # noqa: E731
    assert in_use() == 9
    reqs = [store.request(keys, "reordered", extra_slots=6) for _ in range(4)]   # 2 private pages each
    assert in_use() == 9 + 4 * 2 and all(r.private_bytes == 2 * 4 * store.row_bytes for r in reqs)
    shared = [[(id(r.cache.segments[s][0][0]), p) for s, p, sh in zip(r.cache.e_seg, r.cache.e_page, r.cache.e_shared)
               if sh] for r in reqs]
    assert len(shared[0]) == 9 and all(x == shared[0] for x in shared)
    assert all(store._resident.entries[k].pins == 4 for k in keys)
    for r in reqs[:3]:
        r.release()
    r.release()                                               # idempotent
    assert in_use() == 9 + 2 and all(store._resident.entries[k].pins == 1 for k in keys)
    del reqs, r                                               # the last one: released when collected
    import gc

    gc.collect()
    assert in_use() == 9 and all(store._resident.entries[k].pins == 0 for k in keys)


def test_live_requests_refuse_pool_overwrites_and_weight_changes(model):
    store = ChunkStore(model, page_size=4)
    keys = store.add(_chunks(9, [7, 5]))
    k, v = store.pooled_kv()
    req = store.request(keys, "composite", extra_slots=3)
    with pytest.raises(Exception, match="release them first"):
        store.load_pooled_kv_(k, v)
    w = model.model.layers[0].self_attn.k_proj.weight
    old = w.detach().clone()
    with torch.no_grad():
        w.mul_(1.5)
    with pytest.raises(Exception, match="live zero-copy request"):
        store.add(_chunks(10, [3]))
    with torch.no_grad():
        w.copy_(old)
    req.release()
    store.load_pooled_kv_(k, v)
    with pytest.raises(Exception, match="positions must"):
        store.request(keys, [0], extra_slots=1)
    with pytest.raises(Exception, match="empty retrieval"):
        store.request([], "reordered")
    assert all(e.pins == 0 for e in store._resident.entries.values())


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 10])
def test_cpu_kernel_rotation_against_float64(interleaved, rotary_dim):
    """The CPU route's table (``rope_position_table``) and the C++ kernel's fp32 rotation (both
    pair layouts, partial rotary) at positions up to 2^17, against the float64 reference: one
    query row that sees one slot gets exactly that slot's V, and its score is q . rot(k)."""
    from ragattn.ops.paged_kernels import rope_position_table

    g = torch.Generator().manual_seed(1)
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    pos = torch.randint(0, 1 << 17, (37,), generator=g)
    cos, sin = rope_position_table(inv_freq, int(pos.max()) + 1)
    ang = pos[:, None].double() * inv_freq.double()[None]
    assert (cos[pos].double() - ang.cos()).abs().max() <= 2e-7 and (sin[pos].double() - ang.sin()).abs().max() <= 2e-7
    # each slot its own page, its own position; row r at slot r's position sees slots at <= it: give
    # every row a window of 0 so that it sees exactly its slot, and read q . rot(k) from the lse
    k = torch.randn(37, 1, 1, 16, generator=g)
    v = torch.randn(37, 1, 1, 16, generator=g)
    q = torch.randn(37, 1, 16, generator=g)
    idx = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    out, lse = torch.ops.ragattn._paged_attention_tagged_cpu(
        q, pos, idx([0, 37]), k, v, torch.arange(37), idx([0]), idx([37]), pos, None, None, cos, sin, rotary_dim,
        interleaved, 1.0, 0, 0.0)
    want = rope_rotate(k[:, 0].double(), pos, inv_freq, rotary_dim, interleaved)[:, 0]
    score = (q[:, 0].double() * want).sum(-1)
    # (positions may repeat: a row then sees every slot at its position)
    same = pos[:, None] == pos[None, :]
    lse_want = torch.logsumexp(torch.where(same, score[None, :], float("-inf")), 1)
    assert (lse[:, 0].double() - lse_want).abs().max() <= 1e-4 * max(1.0, float(lse_want.abs().max()))
    unique = same.sum(1) == 1
    torch.testing.assert_close(out[unique], v[unique, 0], rtol=1e-6, atol=1e-6)
    other = rope_rotate(k[:, 0].double(), pos, inv_freq, rotary_dim, not interleaved)[:, 0]
    assert ((q[:, 0].double() * other).sum(-1) - score).abs().max() > 1e-2


def test_private_page_positions_must_be_consecutive(model):
    """A private page has one first position: tokens appended at non-consecutive positions within
    a page are refused (they would be rotated by the wrong positions), at a page start they are not."""
    from ragattn.methods.generate import paged_forward

    store = ChunkStore(model, page_size=4)
    keys = store.add(_chunks(11, [5, 6]))
    with store.request(keys, "composite", extra_slots=8) as req:
        with pytest.raises(ValueError, match="consecutive"):
            paged_forward(model, torch.tensor([[3, 4]]), torch.tensor([6, 8]), req.cache)
        assert int(req.cache.lengths[0]) == req.num_slots and (req.cache.slot_pos[req.num_slots:] == -1).all()
        paged_forward(model, torch.tensor([[3, 4, 5, 6]]), torch.tensor([6, 7, 8, 9]), req.cache)
        got = paged_forward(model, torch.tensor([[9]]), torch.tensor([20]), req.cache)   # a new page: any start
        assert req.cache.positions()[-5:].tolist() == [6, 7, 8, 9, 20] and torch.isfinite(got).all()


def test_decode_steps_plan_as_the_general_path(model):
    """A decode step is planned from the last forward's tables (only the entry that takes the
    token changes): over two pool slabs, across private page boundaries and after a rollback of
    ``lengths``, every step's tables equal the general plan's for the same step, and its logits
    those of a request planned the general way throughout; a position that breaks a private
    page's run is refused there too, changing nothing."""
    from ragattn.methods.generate import paged_forward

    row_bytes = ChunkStore(model).row_bytes
    store = ChunkStore(model, page_size=4, memory_budget=40 * 4 * row_bytes)
    filler = store.add(_chunks(4, [60]))          # first slab mostly used: the request spans two
    keys = store.add(_chunks(5, [7, 30, 13]))
    final = [9, 2, 77]
    toks = torch.randint(1, 97, (14,), generator=torch.Generator().manual_seed(3)).tolist()

    def tables(f):
        return [(s, t.table.pages.tolist(), t.table.entry_pos.tolist(), t.table.entry_len.tolist())
                for s, t in f.steps]

    with store.request(keys, "reordered", extra_slots=len(final) + 14) as fast, \
            store.request(keys, "reordered", extra_slots=len(final) + 14) as slow:
        assert len(fast.cache.segments) > 1 and filler
        for req in (fast, slow):
            paged_forward(model, torch.tensor([final]), req.next_position + torch.arange(len(final)), req.cache)
        p = fast.next_position + len(final)
        for i, t in enumerate(toks):
            if i == 9:   # a rollback (as a rejected draft's): two tokens taken back on both
                for req in (fast, slow):
                    req.cache.lengths -= 2
                p -= 2
            ids, pos = torch.tensor([[t]]), torch.tensor([p])
            live = fast.cache._live
            f = fast.cache._decode_forward(pos)
            assert (f is None) == (i == 9)   # after the rollback the general path plans
            fast.cache._live = None
            general = tables(fast.cache.begin_forward(1, pos))
            assert f is None or tables(f) == general
            fast.cache._live = live          # the forward plans as a decode step again
            got = paged_forward(model, ids, pos, fast.cache)
            slow.cache._live = None          # the general plan throughout
            want = paged_forward(model, ids, pos, slow.cache)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            p += 1
        assert fast.cache.positions().tolist() == slow.cache.positions().tolist()
        n = int(fast.cache.lengths[0])
        assert n % 4 != 0   # the next slot is inside a private page: its position must follow on
        before = fast.cache.slot_pos.clone()
        with pytest.raises(ValueError, match="consecutive"):
            paged_forward(model, torch.tensor([[5]]), torch.tensor([p + 3]), fast.cache)
        assert int(fast.cache.lengths[0]) == n and torch.equal(fast.cache.slot_pos, before)
        got = paged_forward(model, torch.tensor([[5]]), torch.tensor([p]), fast.cache)
        slow.cache._live = None
        want = paged_forward(model, torch.tensor([[5]]), torch.tensor([p]), slow.cache)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_sliding_window_and_soft_cap_layers(family):
    """Sliding layers (window 5, by position) and Gemma 2's soft cap (run_paged_attention's path)
    on a zero-copy request: the copy path's logits (reordered: slot order is position order)."""
    from ragattn.methods.generate import paged_forward
    from tests.hf.test_hf_families import _build

    model = _build(family)
    if family == "gemma3":   # one RoPE for every layer (the chunk store's requirement)
        model.config.rope_parameters["sliding_attention"]["rope_theta"] = 1e6
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
        model.model.rotary_emb = Gemma3RotaryEmbedding(model.config)
    g = torch.Generator().manual_seed(4)
    blocks = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (6, 11, 3)]
    final = torch.randint(3, 100, (7,), generator=g).tolist()
    store = ChunkStore(model, page_size=4)
    keys = store.add(blocks)
    areq = store.assemble(keys, extra_slots=len(final))
    pos = areq.next_position + torch.arange(len(final))
    want = paged_forward(model, torch.tensor([final]), pos, areq.cache)
    with store.request(keys, extra_slots=len(final)) as req:
        got = paged_forward(model, torch.tensor([final]), pos, req.cache)
    assert _rel(got, want) <= 1e-4, _rel(got, want)
    # the window matters here: without it the logits differ
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    with store.request(keys, extra_slots=len(final)) as req:
        wide = paged_forward(model, torch.tensor([final]), pos, req.cache)
    assert _rel(wide, want) > 1e-3


def test_copy_on_write_without_room_changes_nothing(model):
    """A recompute whose copies do not fit in the budget raises and leaves the request as it was
    (no entry points at an unfilled page); it answers as before."""
    from ragattn.hf.registration import use_ragattn
    from ragattn.methods.generate import paged_forward
    from ragattn.methods.fusionrag import recompute
    from ragattn.store.errors import ChunkStoreError

    row = ChunkStore(model).row_bytes
    store = ChunkStore(model, page_size=4, memory_budget=7 * 4 * row)
    keys = store.add(_chunks(12, [8, 12]))                    # 2 + 3 pages
    with store.request(keys, "reordered", extra_slots=4) as req:   # + 1 private page: 1 left
        before = (list(req.cache.e_seg), list(req.cache.e_page))
        with use_ragattn(model), pytest.raises(ChunkStoreError, match="too small"):
            recompute(model, req.cache, torch.tensor([5, 6]), torch.tensor([1, 13]),
                      positions=torch.tensor([1, 13]))       # two shared pages, room for one
        assert (req.cache.e_seg, req.cache.e_page) == before and req.cache.cow_pages == 0
        got = paged_forward(model, torch.tensor([[3, 4]]), torch.tensor([20, 21]), req.cache)
    ref = _masked_full_logits(model, _chunks(12, [8, 12]), [3, 4], [0, 8])
    assert _rel(got, ref) <= 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_that_sees_nothing_gets_zeros_not_nan(backend, monkeypatch):
    """A padding row of a masked append (not written) at a position below every key sees no slot:
    its output is 0, never NaN, on every route; the real row attends normally."""
    from ragattn.kv import TaggedPagedKV
    from ragattn.reference.paged_attention_table import paged_attention_table

    monkeypatch.setenv("RAGATTN_CPU_BACKEND", backend)
    g = torch.Generator().manual_seed(2)
    L, H, D, ps = 1, 2, 16, 4
    inv = 1.0 / (100.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    k = [torch.randn(6, ps, H, D, generator=g)]
    v = [torch.randn(6, ps, H, D, generator=g)]
    pages = iter([5, 4])
    c = TaggedPagedKV(L, H, D, ps, torch.float32, "cpu", inv, D, False, alloc_page=lambda: (k, v, next(pages)))
    c.add_entries(k, v, [3, 1], [10, 14], [4, 3])               # a chunk at positions 10..16
    c.add_private(k, v, [2])
    f = c.begin_forward(2, torch.tensor([0, 20]), valid=torch.tensor([[False, True]]))
    c.write(f, 0, torch.randn(2, H, D, generator=g), torch.randn(2, H, D, generator=g))
    q = torch.randn(2, 4, D, generator=g)
    out = c.attend(f, 0, q, 0.25)
    assert torch.isfinite(out).all() and (out[0] == 0).all() and out[1].abs().max() > 0
    want, _ = paged_attention_table(q.double(), torch.tensor([0, 20]), torch.tensor([0, 2]), k[0].double(),
                                    v[0].double(), torch.tensor([3, 1, 2]), torch.tensor([0]), torch.tensor([12]),
                                    torch.tensor([10, 14, 20]), torch.tensor([4, 3, 1]), inv, D, False, 0.25)
    torch.testing.assert_close(out[1].double(), want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [[1.5, 7], [0, True], [0, "x"]])
def test_request_positions_must_be_whole_numbers(model, bad):
    """Explicit first positions are whole numbers: 1.5 was truncated to 1 silently."""
    from ragattn.store.errors import ChunkStoreError

    store = ChunkStore(model, page_size=4)
    keys = store.add(_chunks(12, [5, 6]))
    with pytest.raises(ChunkStoreError, match="positions must be whole numbers"):
        store.request(keys, bad)
    with store.request(keys, [0.0, 7]) as req:   # a float that is a whole number is that position
        assert req.positions[5:].tolist()[0] == 7
