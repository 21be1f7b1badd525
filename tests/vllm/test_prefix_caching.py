"""vLLM's prefix cache on, with the connector: the server salts every request it serves from
cached chunks itself (no client cooperation), so approximate pages are never an exact prompt's
prefix or another method's, identical Block-Attention requests share pages, requests whose pages
follow more than their prefix (recompute, shared chunk pages) share none, and each response says
what it was answered with. vLLM's own scheduler, block pool and block hasher; runs in .venv-vllm."""
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from ragattn.vllm.spans import MethodChoice  # noqa: E402
from tests.vllm.test_connector import (BS, _config, _load_with_a_truncated_chunk, _prompt, _request,  # noqa: E402
                                       _schedule, _scheduler, _worker, served)  # noqa: F401

CACHEBLEND, FUSIONRAG = MethodChoice("cacheblend", 0.2), MethodChoice("fusionrag", 0.2)


def _hit(out, request) -> int:
    """Tokens the step treats as computed before it (vLLM's own hit plus the connector's claim)."""
    return {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}[request.request_id]


def _old_salt(spans, method=None, prompt=None) -> str:
    """The salt docs/vllm.md told clients to send (span_salt before the server derived it): a
    client that still sends it is served by its method, the salt kept as a tenant separator."""
    import hashlib
    import json

    extra = "" if method is None else f"{method.name}:{method.ratio!r}"
    if method is not None and method.name == "fusionrag":
        extra += ":" + hashlib.sha256(json.dumps(list(prompt)).encode()).hexdigest()
    return f"ragattn-{hashlib.sha256((json.dumps([list(s) for s in spans]) + extra).encode()).hexdigest()[:24]}"


def test_approximate_pages_are_salted_by_the_server(served):
    """A Block-Attention request without a salt is claimed and salted; an exact prompt with the
    same tokens after it gets no hit on its pages (full attention's); an identical request shares
    them (vLLM's hit covers the claim: nothing to load) and says so in its response."""
    _, _, _, chunks = served
    sched = _scheduler(_config(served, prefix_caching=True))
    prompt, spans = _prompt(chunks, (0, 1))                 # claim 30 of 35 tokens
    first = _request(prompt, spans, prefix_caching=True)
    out, loads = _schedule(sched, first)
    assert loads[first.request_id].spans[-1][1] == 30 and first.cache_salt.startswith("ragattn-")
    exact = _request(prompt, prefix_caching=True)
    out, loads = _schedule(sched, exact)
    assert exact.request_id not in loads and _hit(out, exact) == 0 and exact.cache_salt is None
    again = _request(prompt, spans, prefix_caching=True)
    out, loads = _schedule(sched, again)
    assert again.request_id not in loads and _hit(out, again) == 2 * BS and again.cache_salt == first.cache_salt
    _, params = sched.connector.request_finished(again, [])
    assert params["ragattn_answered_by"] == "block-attention" and params["ragattn_prefix_cache_tokens"] == 30
    assert params["ragattn_tokens_reused"] == 30 and params["ragattn_tokens_exact"] == 5


def test_repeated_cacheblend_is_answered_by_cacheblend(served, monkeypatch):
    """The served wrong answer: a repeated CacheBlend request (the salt the docs gave) found the
    first one's pages for part of its claim (32 of 36 tokens), was not claimed, and the rest was
    computed exactly: neither method. Now its pages are its own (no hit), the whole claim is loaded
    and recomputed."""
    monkeypatch.setenv("RAGATTN_VLLM_ATTENTION", "1")
    _, _, _, chunks = served
    sched = _scheduler(_config(served, prefix_caching=True))
    prompt, spans = _prompt(chunks, (0, 1, 2))               # claim 36 of 41 tokens
    salt = _old_salt(spans, CACHEBLEND)
    first = _request(prompt, spans, salt=salt, prefix_caching=True, method=CACHEBLEND)
    second = _request(prompt, spans, salt=salt, prefix_caching=True, method=CACHEBLEND)
    _, loads = _schedule(sched, first)
    assert loads[first.request_id].spans[-1][1] == 36
    out, loads = _schedule(sched, second)
    load = loads[second.request_id]
    assert load.skip == 0 and load.spans[-1][1] == 36 and load.method == CACHEBLEND and _hit(out, second) == 36
    assert second.cache_salt not in (first.cache_salt, salt)


def test_another_methods_salt_gets_its_own_pages(served, monkeypatch):
    """The served wrong answer: a Block-Attention request sent with FusionRAG's salt was answered
    from the FusionRAG request's pages while the log said it was computed without cached chunks.
    Now the server's salt wins: no hit on those pages, and it is claimed as Block-Attention."""
    monkeypatch.setenv("RAGATTN_VLLM_ATTENTION", "1")
    _, _, _, chunks = served
    sched = _scheduler(_config(served, prefix_caching=True))
    prompt, spans = _prompt(chunks, (0, 1, 2))
    salt = _old_salt(spans, FUSIONRAG, prompt)
    fusion = _request(prompt, spans, salt=salt, prefix_caching=True, method=FUSIONRAG)
    block = _request(prompt, spans, salt=salt, prefix_caching=True)
    _, loads = _schedule(sched, fusion)
    assert loads[fusion.request_id].method == FUSIONRAG
    out, loads = _schedule(sched, block)
    load = loads[block.request_id]
    assert load.skip == 0 and load.method == MethodChoice() and _hit(out, block) == 36


def test_a_hit_on_private_pages_is_looked_up_again(served, monkeypatch):
    """A recompute request's pages are its own: a hit on them (its own, after a preemption) is not
    finished by a second recompute; the request is salted anew and vLLM looks again (None)."""
    monkeypatch.setenv("RAGATTN_VLLM_ATTENTION", "1")
    _, _, _, chunks = served
    sched = _scheduler(_config(served, prefix_caching=True))
    prompt, spans = _prompt(chunks, (0, 1, 2))
    r = _request(prompt, spans, prefix_caching=True, method=FUSIONRAG)
    sched.add_request(r)
    salt, hashes = r.cache_salt, list(r.block_hashes)
    assert sched.connector.get_num_new_matched_tokens(r, BS) == (None, False)
    assert r.cache_salt != salt and r.block_hashes[0] != hashes[0] and len(r.block_hashes) == len(hashes)
    assert sched.connector.get_num_new_matched_tokens(r, 0) == (36, False)


def test_responses_say_what_was_reused(served):
    """Partial reuse (a passage the store does not hold), no reuse, bad spans: every response that
    carried chunks says so; an exact prompt's carries nothing."""
    _, _, _, chunks = served
    sched = _scheduler(_config(served, prefix_caching=True))
    partial_prompt, partial_spans = _prompt(chunks, (0, 3, 1))     # chunk 3 never built
    none_prompt, none_spans = _prompt(chunks, (3, 0))
    partial = _request(partial_prompt, partial_spans, prefix_caching=True)
    missing = _request(none_prompt, none_spans, prefix_caching=True)
    plain = _request(none_prompt, prefix_caching=True)
    _schedule(sched, partial, missing, plain)
    _, got = sched.connector.request_finished(partial, [])
    assert got["ragattn_answered_by"] == "block-attention" and "span 1 of 3" in got["ragattn_reason"]
    assert (got["ragattn_chunks_hit"], got["ragattn_chunks_missed"]) == (1, 2)
    assert (got["ragattn_tokens_reused"], got["ragattn_tokens_exact"]) == (9, len(partial_prompt) - 9)
    _, got = sched.connector.request_finished(missing, [])
    assert got["ragattn_answered_by"] == "full-attention" and got["ragattn_tokens_exact"] == len(none_prompt)
    assert missing.cache_salt is None       # computed exactly: vLLM's own hits
    assert sched.connector.request_finished(plain, []) == (False, None)


def test_a_failed_load_is_reported_and_its_pages_never_hit(served):
    """A chunk file truncated between the claim and the load: vLLM recomputes the claimed blocks
    exactly, so the response says full attention and those blocks leave the prefix cache (exact
    pages under an approximate salt)."""
    _, kv_dir, _, chunks = served
    sched = _scheduler(_config(served, prefix_caching=True))
    prompt, spans = _prompt(chunks, (0, 1))
    r = _request(prompt, spans, prefix_caching=True)
    out, loads = _schedule(sched, r)
    load = loads[r.request_id]
    pool = sched.kv_cache_manager.block_pool
    assert all(pool.blocks[b].block_hash is not None for b in load.block_ids[0][:2])
    conn, _ = _worker(served)
    _load_with_a_truncated_chunk(conn, out.kv_connector_metadata, kv_dir, load.keys[1])
    meta = conn.build_connector_worker_meta()
    assert meta.failed == {r.request_id: sorted(load.block_ids[0][:2])}
    sched.connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))
    assert all(pool.blocks[b].block_hash is None for b in load.block_ids[0][:2])
    _, got = sched.connector.request_finished(r, [])
    assert got["ragattn_answered_by"] == "full-attention" and got["ragattn_chunks_hit"] == 0


def test_counters_reach_prometheus(served):
    """ragattn's counters through vLLM's KV connector stats: the scheduler's (what the responses
    said) and the worker's (load time, the store's disk reads), taken once, aggregated, and
    observed as Prometheus counters vllm:ragattn_<key>_total."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from ragattn.vllm.connector import RagattnConnector

    _, _, _, chunks = served
    sched = _scheduler(_config(served, prefix_caching=True))
    prompt, spans = _prompt(chunks, (0, 3, 1))       # chunk 3 missing: 1 hit, 2 missed
    r = _request(prompt, spans, prefix_caching=True)
    out, _ = _schedule(sched, r)
    conn, _ = _worker(served)
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(None)
    sched.connector.request_finished(r, [])
    stats = sched.connector.get_kv_connector_stats()
    assert sched.connector.get_kv_connector_stats() is None          # taken once
    assert stats.data == {"requests_method": 1, "chunks_hit": 1, "chunks_missed": 2, "tokens_reused": 9,
                          "tokens_exact": len(prompt) - 9}
    worker = conn.get_kv_connector_stats()
    assert worker.data["load_seconds"] > 0 and worker.data["store_disk_loads"] == 1
    data = RagattnConnector.build_kv_connector_stats(stats.to_dict()).aggregate(worker).to_dict()

    reg = CollectorRegistry()
    types = {cls: (lambda cls: lambda **kw: cls(registry=reg, **kw))(cls) for cls in (Counter, Gauge, Histogram)}
    prom = RagattnConnector.build_prom_metrics(_config(served), types, ["engine"], {0: ["0"]})
    prom.observe(data, 0)
    prom.observe({"chunks_hit": 2}, 0)
    assert reg.get_sample_value("vllm:ragattn_chunks_hit_total", {"engine": "0"}) == 3
    assert reg.get_sample_value("vllm:ragattn_tokens_exact_total", {"engine": "0"}) == len(prompt) - 9
    assert reg.get_sample_value("vllm:ragattn_store_disk_loads_total", {"engine": "0"}) == 1


def test_shared_chunk_pages_with_prefix_caching(served, monkeypatch):
    """Shared chunk pages no longer refuse prefix caching: identical requests read the same chunk
    pages but have salts of their own, so the blocks one gives back (unwritten: its chunks live in
    the chunk pages) are never another's prefix-cache hit."""
    from ragattn.vllm.connector_config import RagattnWorkerMetadata

    monkeypatch.setenv("RAGATTN_VLLM_ATTENTION", "1")
    _, _, _, chunks = served
    sched = _scheduler(_config(served, prefix_caching=True, kv_split="channel", shared_pages=True))
    prompt, spans = _prompt(chunks, (0, 1, 2))              # claim 36: blocks 0 and 1 hold only chunk tokens
    first, second = (_request(prompt, spans, prefix_caching=True) for _ in range(2))
    out, loads = _schedule(sched, first, second)
    a, b = loads[first.request_id], loads[second.request_id]
    assert a.chunk_blocks == b.chunk_blocks and a.skip == b.skip == 0 and _hit(out, second) == 36
    assert first.cache_salt != second.cache_salt
    given = {r.request_id: (0, load.block_ids[0][:2]) for r, load in ((first, a), (second, b))}
    sched.connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=RagattnWorkerMetadata(
        shared=given)))
    third = _request(prompt, spans, prefix_caching=True)
    out, loads = _schedule(sched, third)
    assert loads[third.request_id].skip == 0 and loads[third.request_id].chunk_blocks == a.chunk_blocks
    assert _hit(out, third) == 36


def test_a_hit_on_a_failed_load_is_full_attention(served):
    """Two identical Block-Attention requests in one step: the second finds the first's claimed
    blocks in vLLM's prefix cache and loads nothing; the first's load fails, so vLLM recomputes those
    blocks exactly for both: both responses say full attention."""
    _, kv_dir, _, chunks = served
    sched = _scheduler(_config(served, prefix_caching=True))
    prompt, spans = _prompt(chunks, (0, 1))                 # claim 30 of 35: a hit of 32 covers it
    first, second = (_request(prompt, spans, prefix_caching=True) for _ in range(2))
    out, loads = _schedule(sched, first, second)
    assert second.request_id not in loads and _hit(out, second) == 32
    conn, _ = _worker(served)
    _load_with_a_truncated_chunk(conn, out.kv_connector_metadata, kv_dir, loads[first.request_id].keys[1])
    meta = conn.build_connector_worker_meta()
    sched.connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))
    for r in (first, second):
        assert sched.connector.request_finished(r, [])[1]["ragattn_answered_by"] == "full-attention"
