"""Shared chunk pages through the live server on ragattn's backend (``live_ragattn`` runs with
``shared_pages``): 8 concurrent Block-Attention or FusionRAG requests over the same chunks hold
those chunks' pages once plus their own pages (FusionRAG: with the blocks of their recomputed
rows; vLLM's own KV cache usage, from ``/metrics``, while all of them decode, less what idle
chunk pages held before) and answer as one at a time; the Block-Attention, TurboRAG and FusionRAG
answers of the other live tests on this server come from shared pages too."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm.live.test_served import _eos, _upto_eos  # noqa: E402

NEW = 16            # tokens each request decodes (ignore_eos: all of them decode in lockstep)


RATIO = 0.15        # FusionRAG's (the live tests' default)


def _body(ref, prompt, spans, method):
    params = {"ragattn_spans": spans, "ragattn_method": method} | ({"ragattn_ratio": RATIO} if method == "fusionrag"
                                                                    else {})
    return {"model": ref["model"], "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_transfer_params": params}


@pytest.mark.parametrize("method", ["block-attention", "fusionrag"])
def test_concurrent_requests_hold_each_chunk_once(live_ragattn, method):
    from ragattn.methods.selection import budget

    server, ref = live_ragattn
    base = ref["prompts"][0]
    end = base["spans"][-1][1]
    # prompt 0's chunks, each request with another question (every prompt's tail)
    tails = [p["prompt"][p["spans"][-1][1]:] for p in ref["prompts"] + ref["spares"]][:8]
    assert len(tails) == 8
    prompts = [base["prompt"][:end] + t for t in tails]
    used0, _, bs = server.kv_cache_blocks()    # (idle chunk pages of earlier requests stay held)
    used, together = server.kv_blocks_while_decoding([_body(ref, p, base["spans"], method) for p in prompts])

    chunk_pages = sum(-(-(e - s) // bs) for s, e in base["spans"])
    own = sum(-(-(len(p) + NEW) // bs) - end // bs for p in prompts)
    if method == "fusionrag":   # each request's recomputed rows, at most all below its first own block
        own += len(prompts) * -(-budget(RATIO, end - base["spans"][0][1]) // bs)
    copies = sum(-(-(len(p) + NEW) // bs) for p in prompts)
    assert used - used0 <= 1.2 * (chunk_pages + own) < copies, (used, used0, chunk_pages, own, copies)
    for p, got in zip(prompts, together):   # the same answers as one at a time
        assert len(got) == NEW
        status, out = server.post("/v1/completions", _body(ref, p, base["spans"], method))
        assert status == 200, out
        assert got == out["choices"][0]["token_ids"]
    eos = _eos(ref)
    want = base["block_attention"] if method == "block-attention" else base["fusionrag"]["tokens"]
    assert _upto_eos(together[0][:ref["new_tokens"]], eos) == _upto_eos(want, eos)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_damaged_chunk_then_restored(live_ragattn, damage):
    """A Block-Attention request whose chunk 1 is deleted (the claim stops before it) or truncated
    (its shared pages cannot be written: the request falls back to the copy path, whose load fails
    too, and vLLM computes the claimed blocks) is answered exactly as full attention; the file
    restored, the next request is answered from shared pages again, as the HF path's Block-Attention."""
    from tests.vllm.live.test_served import _chunk_file, damaged_chunk

    server, ref = live_ragattn
    eos = _eos(ref)
    # spares no other test on this server reads (the worker's store would serve a chunk it holds in memory)
    p = ref["spares"][2 if damage == "missing" else 3]
    body = {"model": ref["model"], "prompt": p["prompt"], "max_tokens": ref["new_tokens"], "temperature": 0,
            "return_token_ids": True, "kv_transfer_params": {"ragattn_spans": p["spans"]}}
    with damaged_chunk(_chunk_file(ref, p, 1), damage):
        status, out = server.post("/v1/completions", body)
        assert status == 200, out
        assert _upto_eos(out["choices"][0]["token_ids"], eos) == _upto_eos(p["full"], eos), p["question"]
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    assert _upto_eos(out["choices"][0]["token_ids"], eos) == _upto_eos(p["block_attention"], eos), p["question"]
