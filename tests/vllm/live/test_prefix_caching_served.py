"""vLLM's prefix cache on (the live servers run with it, vLLM's default), over HTTP: the server
salts the approximate pages itself, so a request is answered by the method it asked for or by
full attention, never by a mix; exact prompts keep vLLM's own prefix hits (its ``/metrics``);
every response that carried chunks says what was reused and computed exactly, and the server's
log says it at WARNING level when a passage is not in the store."""
from __future__ import annotations

import hashlib
import json

import pytest

pytest.importorskip("vllm")

from tests.vllm.live.reference import RATIO  # noqa: E402
from tests.vllm.live.test_served import _eos, _upto_eos  # noqa: E402


def _old_salt(spans, method=None, prompt=None) -> str:
    """The cache_salt docs/vllm.md told clients to send before the server derived its own."""
    extra = "" if method is None else f"{method}:{RATIO!r}"
    if method == "fusionrag":
        extra += ":" + hashlib.sha256(json.dumps(list(prompt)).encode()).hexdigest()
    return f"ragattn-{hashlib.sha256((json.dumps([list(s) for s in spans]) + extra).encode()).hexdigest()[:24]}"


def _ask(server, ref, prompt, params=None, salt=None):
    """(answer tokens up to EOS, text, the response's kv_transfer_params)."""
    body = {"model": ref["model"], "prompt": prompt, "max_tokens": ref["new_tokens"], "temperature": 0,
            "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    if salt is not None:
        body["cache_salt"] = salt
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    return _upto_eos(choice["token_ids"], _eos(ref)), choice["text"], out.get("kv_transfer_params")


def test_repeated_cacheblend_answers_as_cacheblend(live_ragattn):
    """The served wrong answer: the same CacheBlend request twice, with the salt the docs gave; the
    second found the first's pages for part of its claim and computed the rest exactly. Now both
    are CacheBlend's answer (the HF path's) with its rows."""
    server, ref = live_ragattn
    p = ref["prompts"][1]
    params = {"ragattn_spans": p["spans"], "ragattn_method": "cacheblend", "ragattn_ratio": RATIO}
    want = _upto_eos(p["cacheblend"]["tokens"], _eos(ref))
    for _ in range(2):
        got, text, out = _ask(server, ref, p["prompt"], params, salt=_old_salt(p["spans"], "cacheblend"))
        assert got == want, (text, p["cacheblend"]["text"])
        assert out["ragattn_answered_by"] == "cacheblend" and out["ragattn_recomputed"] == p["cacheblend"]["recomputed"]
        assert out["ragattn_prefix_cache_tokens"] == 0


def test_block_attention_with_fusionrags_salt_is_block_attention(live_ragattn):
    """The served wrong answer: a Block-Attention request sent with FusionRAG's salt after a
    FusionRAG request was answered from FusionRAG's pages. Now the server's salt wins."""
    server, ref = live_ragattn
    p = ref["prompts"][2]
    salt = _old_salt(p["spans"], "fusionrag", p["prompt"])
    fusion = {"ragattn_spans": p["spans"], "ragattn_method": "fusionrag", "ragattn_ratio": RATIO}
    got, _, _ = _ask(server, ref, p["prompt"], fusion, salt=salt)
    assert got == _upto_eos(p["fusionrag"]["tokens"], _eos(ref))
    got, text, out = _ask(server, ref, p["prompt"], {"ragattn_spans": p["spans"]}, salt=salt)
    assert got == _upto_eos(p["block_attention"], _eos(ref)), (text, p["block_attention_text"])
    assert out["ragattn_answered_by"] == "block-attention" and out["ragattn_prefix_cache_tokens"] == 0


def test_exact_after_approximate_is_full_attention(live):
    """Block-Attention pages are never an exact prompt's prefix: the same tokens without chunks,
    right after, get full attention's answer; an identical Block-Attention request shares the
    first one's pages (vLLM's hit) and still answers as Block-Attention."""
    server, ref = live
    p = ref["prompts"][3]
    eos = _eos(ref)
    got, _, out = _ask(server, ref, p["prompt"], {"ragattn_spans": p["spans"]})
    assert got == _upto_eos(p["block_attention"], eos) and out["ragattn_answered_by"] == "block-attention"
    got, text, out = _ask(server, ref, p["prompt"])
    assert got == _upto_eos(p["full"], eos), (text, p["full_text"])
    assert out is None
    got, _, out = _ask(server, ref, p["prompt"], {"ragattn_spans": p["spans"]})
    assert got == _upto_eos(p["block_attention"], eos) and out["ragattn_prefix_cache_tokens"] > 0


def test_shared_system_prompt_is_a_prefix_hit(live):
    """Exact prompts keep vLLM's own prefix cache: two prompts that share a long system prompt
    (prompt 4's head and passages) hit it, by vLLM's own counter, and answer as full attention."""
    server, ref = live
    p, q = ref["prompts"][4], ref["prompts"][5]
    system = p["prompt"][:p["spans"][-1][1]]
    bs = server.kv_cache_blocks()[2]
    first = system + p["prompt"][p["spans"][-1][1]:]
    second = system + q["prompt"][q["spans"][-1][1]:]
    _ask(server, ref, first)
    hits = server.metric("vllm:prefix_cache_hits_total")
    _ask(server, ref, second)
    assert server.metric("vllm:prefix_cache_hits_total") - hits >= len(system) // bs * bs


def test_ragattn_counters_in_metrics(live):
    """ragattn's counters in the server's /metrics (vLLM's KV connector stats): one more request
    answered by its method, its spans hit and its tokens reused, and time spent loading."""
    import time

    server, ref = live
    p = ref["prompts"][0]
    names = ("requests_method", "chunks_hit", "tokens_reused", "load_seconds")
    before = {n: _metric_or_zero(server, f"vllm:ragattn_{n}_total") for n in names}
    _ask(server, ref, p["prompt"], {"ragattn_spans": p["spans"], "ragattn_method": "turborag-composite"})
    want = {"requests_method": 1, "chunks_hit": len(p["spans"]), "tokens_reused": p["spans"][-1][1]}
    for _ in range(30):   # (the step's stats reach the front end's logger beside the answer)
        grew = {n: _metric_or_zero(server, f"vllm:ragattn_{n}_total") - before[n] for n in names}
        if all(grew[n] >= w for n, w in want.items()) and grew["load_seconds"] > 0:
            break
        time.sleep(1)
    assert {n: grew[n] for n in want} == want and grew["load_seconds"] > 0, grew


def _metric_or_zero(server, name) -> float:
    try:
        return server.metric(name)
    except KeyError:   # (a counter appears with its first increment)
        return 0.0


def test_partial_reuse_is_reported(live):
    """A passage the store does not hold: reuse stops before it; the response says how much was
    reused and computed exactly, and the server's log has a WARNING naming the span."""
    from tests.vllm.live.test_served import _chunk_file, damaged_chunk

    server, ref = live
    p = ref["spares"][2]
    with damaged_chunk(_chunk_file(ref, p, 1), "missing"):
        got, _, out = _ask(server, ref, p["prompt"], {"ragattn_spans": p["spans"]})
    n, head = len(p["spans"]), p["spans"][0][1]
    assert got == _upto_eos(p["full"], _eos(ref))     # the head alone is a causal prefix: exact
    assert out["ragattn_answered_by"] == "block-attention"
    assert (out["ragattn_chunks_hit"], out["ragattn_chunks_missed"]) == (1, n - 1)
    assert (out["ragattn_tokens_reused"], out["ragattn_tokens_exact"]) == (head, len(p["prompt"]) - head)
    assert f"span 1 of {n}" in out["ragattn_reason"]
    assert any("WARNING" in line and f"span 1 of {n}" in line for line in server.log_tail(200000).splitlines())


def test_the_quality_gate_ran_at_start_up(live):
    """The server ran ragattn's quality gate at start-up (mode "warn", the default) on the served
    SmolLM2, or read the verdict the other live server kept in the same chunk directory: every
    served method passes, none is refused (ragattn.vllm.gate; class level: tests/vllm/test_gate_served.py)."""
    server, _ = live
    log = server.log_tail(10 ** 8)
    assert "quality gate: every served method passes on this model" in log, log[-3000:]
    assert "failed ragattn's quality gate" not in log
    assert _metric_or_zero(server, "vllm:ragattn_gate_refused_methods_total") == 0
