"""Every cached-chunk method through a live vLLM server on ragattn's backend (``live_ragattn``),
chosen per request by ``kv_transfer_params["ragattn_method"]`` (and ``ragattn_ratio``), over
HTTP: the greedy answers equal the HF path's for the same chunks, positions and ratio; the rows
the server recomputed (returned in the response's ``kv_transfer_params``) are the rows the HF
path selects; concurrent requests answer as one at a time; a damaged chunk is answered exactly."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from tests.vllm.live.reference import RATIO  # noqa: E402
from tests.vllm.live.test_served import _eos, _upto_eos  # noqa: E402

METHODS = ("turborag-composite", "cacheblend", "fusionrag")
RECOMPUTE = ("cacheblend", "fusionrag")


def ask(server, ref, p, method):
    """(answer tokens up to EOS, text, the response's kv_transfer_params) of prompt ``p`` by ``method``."""
    params = {"ragattn_spans": p["spans"], "ragattn_method": method}
    if method in RECOMPUTE:
        params["ragattn_ratio"] = RATIO
    body = {"model": ref["model"], "prompt": p["prompt"], "max_tokens": ref["new_tokens"], "temperature": 0,
            "return_token_ids": True, "kv_transfer_params": params}
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    return _upto_eos(choice["token_ids"], _eos(ref)), choice["text"], out.get("kv_transfer_params")


@pytest.mark.parametrize("method", METHODS)
def test_method_answers_equal_hf(live_ragattn, method):
    """>= 6 prompts of >= 1K tokens, >= 16 greedy tokens: the server's answers by ``method`` equal
    the HF path's, and CacheBlend's / FusionRAG's recomputed rows (returned by the server) are the
    HF path's rows, a ratio of the chunk tokens (every span but the prompt head)."""
    server, ref = live_ragattn
    eos = _eos(ref)
    assert len(ref["prompts"]) >= 6 and ref["new_tokens"] >= 16
    for p in ref["prompts"]:
        want = p[method]
        got, text, params = ask(server, ref, p, method)
        assert got == _upto_eos(want["tokens"], eos), (method, p["question"], text, want["text"])
        assert params["ragattn_method"] == params["ragattn_answered_by"] == method
        assert params["ragattn_chunks_missed"] == 0
        assert params["ragattn_tokens_exact"] == len(p["prompt"]) - p["spans"][-1][1]
        if method in RECOMPUTE:
            n_chunk = p["spans"][-1][1] - p["spans"][0][1]
            assert params["ragattn_ratio"] == RATIO
            assert params["ragattn_recomputed"] == want["recomputed"], (method, p["question"])
            assert len(want["recomputed"]) == int(RATIO * n_chunk + 1e-9) == params["ragattn_tokens_recomputed"]
        else:
            assert "ragattn_recomputed" not in params


def test_methods_concurrent_equal_one_at_a_time(live_ragattn):
    """8 concurrent requests, methods mixed over the same chunks, batched by vLLM's scheduler:
    each answers and recomputes the rows as one at a time does (which the test above holds equal
    to the HF path's)."""
    server, ref = live_ragattn
    eos = _eos(ref)
    jobs = [(p, m) for p in ref["prompts"][:4] for m in ("cacheblend", "fusionrag")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: ask(server, ref, *job), jobs))
    for (p, m), (got, text, params) in zip(jobs, together):
        assert got == _upto_eos(p[m]["tokens"], eos), (m, p["question"], text, p[m]["text"])
        assert params["ragattn_recomputed"] == p[m]["recomputed"], (m, p["question"])


@pytest.mark.parametrize("params, field", [
    ({"ragattn_method": "blockattention"}, "kv_transfer_params.ragattn_method"),
    ({"ragattn_method": "fusionrag", "ragattn_ratio": 1.5}, "kv_transfer_params.ragattn_ratio"),
    ({"ragattn_method": "fusionrag", "ragattn_ratio": "0.1"}, "kv_transfer_params.ragattn_ratio"),
    ({"ragattn_method": "block-attention", "ragattn_ratio": 0.1}, "kv_transfer_params.ragattn_ratio"),
])
def test_bad_method_is_a_400_naming_the_field(live_ragattn, params, field):
    server, ref = live_ragattn
    p = ref["prompts"][0]
    status, out = server.post("/v1/completions", {"model": ref["model"], "prompt": p["prompt"], "max_tokens": 2,
                                                  "kv_transfer_params": {"ragattn_spans": p["spans"], **params}})
    assert status == 400 and out["error"]["param"] == field, out
    got, _, _ = ask(server, ref, p, "fusionrag")   # still serving
    assert got == _upto_eos(p["fusionrag"]["tokens"], _eos(ref))


@pytest.mark.parametrize("method, damage", [("cacheblend", "missing"), ("fusionrag", "truncated")])
def test_damaged_chunk_then_restored(live_ragattn, method, damage):
    """A recompute request whose chunk 1 is deleted (the claim stops before it) or truncated (the
    load fails: nothing of the request is written or recomputed, vLLM computes the claimed blocks)
    is answered exactly as full attention; the file restored, the next request is answered by the
    method again, with the HF path's rows."""
    from tests.vllm.live.test_served import _chunk_file, damaged_chunk

    server, ref = live_ragattn
    eos = _eos(ref)
    p = ref["spares"][0 if damage == "missing" else 1]
    with damaged_chunk(_chunk_file(ref, p, 1), damage):
        got, text, params = ask(server, ref, p, method)
        assert got == _upto_eos(p["full"], eos), (p["question"], text, p["full_text"])
        assert not (params or {}).get("ragattn_recomputed")     # nothing was recomputed
        if damage == "truncated":
            assert params["ragattn_answered_by"] == "full-attention"
            assert params["ragattn_tokens_exact"] == len(p["prompt"])
        else:   # the claim stopped before chunk 1: the head alone, a causal prefix
            assert params["ragattn_chunks_hit"] == 1 and "not in the chunk store" in params["ragattn_reason"]
    got, text, params = ask(server, ref, p, method)
    assert got == _upto_eos(p[method]["tokens"], eos), (p["question"], text, p[method]["text"])
    assert params["ragattn_recomputed"] == p[method]["recomputed"]
