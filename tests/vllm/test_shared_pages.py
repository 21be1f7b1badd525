"""Shared chunk pages inside vLLM (ragattn.vllm.shared_pages) on vLLM's own scheduler, block pool
and KV cache manager, and ragattn's backend on CPU caches: two requests over the same chunks in
other orders hold each chunk's pages once, attend exactly as when each holds its own copy, and
give their own chunk blocks back to vLLM's pool; idle pages are evicted least recently used."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from ragattn.vllm.backend import RagattnAttentionImpl, RagattnAttentionMetadataBuilder  # noqa: E402
from ragattn.vllm.connector import RagattnConnectorMetadata  # noqa: E402
from ragattn.vllm.shared_pages import ChunkPagePool  # noqa: E402
from tests.vllm.test_connector import (BS, D, H, LAYERS, NUM_BLOCKS, _config, _kv_cache_config,  # noqa: E402,F401
                                       _prompt, _request, _schedule, _scheduler, served)

HQ = 2 * H     # query heads (GQA 2)


def _lbnhc():
    """A layer's cache as vLLM allocates it for ragattn's backend (LBNHC memory), poisoned."""
    return torch.full((NUM_BLOCKS, BS, H, 2 * D), float("nan")).transpose(1, 2)


def _worker(cfg, caches):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, _kv_cache_config())
    conn.register_kv_caches(caches)
    return conn


@pytest.fixture
def flag(monkeypatch):
    monkeypatch.setenv("RAGATTN_VLLM_ATTENTION", "1")


def test_two_requests_share_chunk_pages_and_attend_as_copies(served, flag):
    _, _, _, chunks = served
    cfg = _config(served, kv_split="channel", shared_pages=True)
    sched = _scheduler(cfg)
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    (pa, sa), (pb, sb) = _prompt(chunks, (0, 1, 2)), _prompt(chunks, (2, 1, 0), final=(4, 6, 9))
    ra, rb = _request(pa, sa), _request(pb, sb)
    out, loads = _schedule(sched, ra, rb)
    la, lb = loads[ra.request_id], loads[rb.request_id]
    # each chunk's pages once, whatever its place in the prompt
    assert la.chunk_blocks[0] == lb.chunk_blocks[2] and la.chunk_blocks[2] == lb.chunk_blocks[0]
    assert la.chunk_blocks[1] == lb.chunk_blocks[1]
    chunk_blocks = sum(-(-len(chunks[i]) // BS) for i in (0, 1, 2))
    own = -(-len(pa) // BS) + -(-len(pb) // BS)
    assert free0 - sched.kv_cache_manager.block_pool.get_num_free_blocks() == chunk_blocks + own

    # the worker: shared pages on one set of caches, each request's own copy on another
    shared_caches = {n: _lbnhc() for n in LAYERS}
    copy_caches = {n: _lbnhc() for n in LAYERS}
    copy = _worker(_config(served, kv_split="channel"), copy_caches)
    copy.bind_connector_metadata(RagattnConnectorMetadata(
        [SimpleNamespace(**{**vars(load), "chunk_blocks": None}) for load in (la, lb)]))
    copy.start_load_kv(None)
    conn = _worker(cfg, shared_caches)
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(None)
    assert conn.get_block_ids_with_load_errors() == set()
    worker_meta = conn.build_connector_worker_meta()
    state = conn.worker_state
    assert set(state.requests) == {ra.request_id, rb.request_id}

    # the step that prefills both questions: the same rotated K/V written in both, then attention
    g = torch.Generator().manual_seed(3)
    q_lens = [len(pa) - sa[-1][1], len(pb) - sb[-1][1]]
    seq_lens = [len(pa), len(pb)]
    table = torch.zeros(2, 8, dtype=torch.int32)
    for i, load in enumerate((la, lb)):
        table[i, :len(load.block_ids[0])] = torch.tensor(load.block_ids[0])
    pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, q_lens)])
    row = torch.repeat_interleave(torch.arange(2), torch.tensor(q_lens))
    slots = table[row, pos // BS].long() * BS + pos % BS
    n = int(sum(q_lens))
    query = torch.randn(n, HQ, D, generator=g)
    impl = RagattnAttentionImpl(HQ, D, D ** -0.5, H, None, None, "auto")
    cu = torch.tensor([0, q_lens[0], n], dtype=torch.int32)
    m = SimpleNamespace(causal=True, num_actual_tokens=n, num_reqs=2, query_start_loc=cu,
                        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table_tensor=table,
                        max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    builder = RagattnAttentionMetadataBuilder(SimpleNamespace(block_size=BS), [], None, torch.device("cpu"))
    outs = {}
    for name, caches in (("shared", shared_caches), ("copy", copy_caches)):
        state.batch_req_ids = (lambda: [ra.request_id, rb.request_id]) if name == "shared" else None
        builder.worker_state = state
        meta = builder.build(0, m)
        assert (meta.shared is not None) == (name == "shared")
        outs[name] = []
        for l, layer in enumerate(LAYERS):
            g.manual_seed(100 + l)   # the same K/V in both runs
            key, value = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
            impl.do_kv_cache_update(None, key, value, caches[layer], slots)
            o = torch.full((n, HQ * D), 7.0)
            impl.forward(None, query, key, value, caches[layer], meta, o)
            outs[name].append(o)
        if name == "shared":
            assert meta.shared.steps() is not None
            state.requests.clear()
    for o_shared, o_copy in zip(outs["shared"], outs["copy"]):
        assert o_shared.isfinite().all()
        torch.testing.assert_close(o_shared, o_copy, atol=2e-5, rtol=2e-5)

    # the scheduler gives the requests' own chunk blocks back once the worker reports them
    assert all(first == 0 for first, _ in worker_meta.shared.values())
    given = sum(len(ids) for _, ids in worker_meta.shared.values())
    assert given == sa[-1][1] // BS + sb[-1][1] // BS
    before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=worker_meta))
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() - before == given
    held = sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[ra.request_id]
    assert all(b.is_null for b in held[:sa[-1][1] // BS]) and not any(b.is_null for b in held[sa[-1][1] // BS:])


def test_held_rows_attend_as_rows_written_into_a_copy(served, flag):
    """Copy on write by rows (FusionRAG over shared chunk pages): the rows a request recomputed
    below its first private block, held packed in its first own block, read with the chunk pages
    as runs around them, attend exactly as the same K/V written at their positions into a copy
    of the chunks: for the question's rows (vLLM's step: the metadata builder) and for the
    recomputed rows themselves (the recompute's metadata: each sees the positions up to its own),
    and the scheduler then gives back every claimed block but the held one."""
    from ragattn.vllm.recompute import Recomputer, RecomputeRequest
    from ragattn.kv import SharedEntries

    _, _, _, chunks = served
    cfg = _config(served, kv_split="channel", shared_pages=True)
    sched = _scheduler(cfg)
    prompt, spans = _prompt(chunks, (0, 1, 2))
    req = _request(prompt, spans)
    out, loads = _schedule(sched, req)
    load = loads[req.request_id]
    end = spans[-1][1]
    private_from = end // BS * BS
    held = [10, 11, 17, 25, private_from - 1]            # chunk rows below the first private block
    redo = held + [private_from + 1]                     # and one in the claim's own last block
    shared_caches = {n: _lbnhc() for n in LAYERS}
    copy_caches = {n: _lbnhc() for n in LAYERS}
    copy = _worker(_config(served, kv_split="channel"), copy_caches)
    copy.bind_connector_metadata(RagattnConnectorMetadata([SimpleNamespace(**{**vars(load), "chunk_blocks": None})]))
    copy.start_load_kv(None)
    conn = _worker(cfg, shared_caches)
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(None)
    blocks = load.block_ids[0]
    entries = SharedEntries.build(spans, load.chunk_blocks, BS, held=held, held_blocks=blocks[:1])
    state = conn.worker_state
    state.requests[req.request_id] = entries
    # the recomputed rows' K/V (as vLLM's model writes them: keys rotated): packed slots / positions
    g = torch.Generator().manual_seed(11)
    pos = torch.tensor(redo)
    at_pos = torch.tensor(blocks)[pos // BS] * BS + pos % BS
    packed = at_pos.clone()
    packed[:len(held)] = blocks[0] * BS + torch.arange(len(held))
    impl = RagattnAttentionImpl(HQ, D, D ** -0.5, H, None, None, "auto")
    for layer in LAYERS:
        key, value = torch.randn(len(redo), H, D, generator=g), torch.randn(len(redo), H, D, generator=g)
        impl.do_kv_cache_update(None, key, value, copy_caches[layer], at_pos)
        impl.do_kv_cache_update(None, key, value, shared_caches[layer], packed)

    def attend(meta, q, caches, rows):
        got = []
        for layer in LAYERS:
            o = torch.full((rows, HQ * D), 7.0)
            impl.forward(None, q, None, None, caches[layer], meta, o)
            got.append(o)
        return got

    # the recompute's pass: the recomputed rows, each attending to positions <= its own
    q = torch.randn(len(redo), HQ, D, generator=g)
    rc = Recomputer(cfg, LAYERS, [shared_caches[n] for n in LAYERS], D, D ** -0.5, state)
    rreq = RecomputeRequest("fusionrag", 0.2, prompt, spans, blocks, BS, load.chunk_blocks)
    want = attend(rc._metadata(rreq, pos, None), q, copy_caches, len(redo))
    got = attend(rc._metadata(rreq, pos, None, entries), q, shared_caches, len(redo))
    for a, b in zip(got, want):
        assert a.isfinite().all()
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    # vLLM's step over the question (its K/V written by position in both)
    n_q = len(prompt) - end
    table = torch.zeros(1, 8, dtype=torch.int32)
    table[0, :len(blocks)] = torch.tensor(blocks)
    qpos = torch.arange(end, len(prompt))
    slots = table[0, qpos // BS].long() * BS + qpos % BS
    q = torch.randn(n_q, HQ, D, generator=g)
    for layer in LAYERS:
        key, value = torch.randn(n_q, H, D, generator=g), torch.randn(n_q, H, D, generator=g)
        for caches in (copy_caches, shared_caches):
            impl.do_kv_cache_update(None, key, value, caches[layer], slots)
    m = SimpleNamespace(causal=True, num_actual_tokens=n_q, num_reqs=1,
                        query_start_loc=torch.tensor([0, n_q], dtype=torch.int32),
                        seq_lens=torch.tensor([len(prompt)], dtype=torch.int32), block_table_tensor=table,
                        max_query_len=n_q, max_seq_len=len(prompt))
    builder = RagattnAttentionMetadataBuilder(SimpleNamespace(block_size=BS), [], None, torch.device("cpu"))
    state.batch_req_ids = lambda: [req.request_id]
    builder.worker_state = state
    got = attend(builder.build(0, m), q, shared_caches, n_q)
    state.batch_req_ids = None
    want = attend(builder.build(0, m), q, copy_caches, n_q)
    for a, b in zip(got, want):
        assert a.isfinite().all()
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    # the held block stays the request's; the other claimed blocks go back
    before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    meta = conn.build_connector_worker_meta()
    meta.shared[req.request_id] = (1, blocks[1:private_from // BS])
    sched.connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() - before == private_from // BS - 1
    own = sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[req.request_id]
    assert own[0].block_id == blocks[0] and all(b.is_null for b in own[1:private_from // BS])


def test_pool_evicts_idle_pages_least_recently_used():
    pool = BlockPool(num_gpu_blocks=10, enable_caching=False, hash_block_size=BS)
    cp = ChunkPagePool(pool, BS)
    a = cp.acquire("r1", ["A", "B"], [20, 16])            # 2 + 1 blocks
    assert pool.get_num_free_blocks() == 9 - 3
    assert cp.acquire("r2", ["B"], [16]) == [a[1]]         # shared: no new block
    assert cp.acquire("r3", ["C", "D"], [64, 40]) is None  # 7 blocks: does not fit, nothing idle
    assert pool.get_num_free_blocks() == 6 and cp.blocks_held() == 3
    cp.release("r1")                                       # A idle, B still used by r2
    c = cp.acquire("r3", ["C"], [80])                      # 5 blocks: fits
    assert len(c[0]) == 5 and pool.get_num_free_blocks() == 1
    assert cp.acquire("r4", ["E"], [32]) is not None       # A (idle, least recent) evicted for room
    assert cp.take_evicted() == ["A"] and cp.take_evicted() == []
    free = pool.get_num_free_blocks()
    cp.drop("B")           # pages that could not be written, still held by r2: nobody new gets them
    assert cp.take_evicted() == ["B"] and pool.get_num_free_blocks() == free
    assert cp.acquire("r5", ["B"], [16]) != [a[1]]         # fresh pages for the next request
    cp.release("r2")                                       # B's old pages freed with their last user
    assert pool.get_num_free_blocks() == free and cp.blocks_held() == 5 + 2 + 1
