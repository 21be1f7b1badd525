"""The connector under ``--tensor-parallel-size 3`` (``live_tp``: SmolLM2's 3 KV heads, one a
rank, ragattn's backend, shared chunk pages), over HTTP: every method's answers (full attention,
Block-Attention, TurboRAG composite, CacheBlend, FusionRAG) equal the one-rank server's
(``live_ragattn``), token for token, the recomputed rows included, and the response says the
method answered. tests/vllm/test_tensor_parallel.py checks each rank's share of the heads at
class level."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm.live.test_methods_served import ask  # noqa: E402
from tests.vllm.live.test_served import _eos, _upto_eos  # noqa: E402

METHODS = ("block-attention", "turborag-composite", "cacheblend", "fusionrag")
PROMPTS = 3   # of the session's >= 1K-token prompts


def _full(server, ref, p):
    """(answer tokens up to EOS, the response's system_fingerprint) by full attention (no chunks)."""
    body = {"model": ref["model"], "prompt": p["prompt"], "max_tokens": ref["new_tokens"], "temperature": 0,
            "return_token_ids": True}
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    return _upto_eos(out["choices"][0]["token_ids"], _eos(ref)), out.get("system_fingerprint", "")


def assert_answers_equal(server, one, ref, layout: str, methods, prompts: int) -> None:
    """Over the session's first ``prompts`` prompts, ``server`` (vLLM's parallel ``layout`` in its
    system fingerprint, e.g. ``tp3``) answers by full attention and by each of ``methods`` as the
    one-worker server ``one`` does, token for token, with the same recomputed rows."""
    for p in ref["prompts"][:prompts]:
        got, fingerprint = _full(server, ref, p)
        assert f"-{layout}-" in fingerprint, fingerprint            # (vLLM names its parallel layout there)
        assert got == _full(one, ref, p)[0], p["question"]
        for method in methods:
            got, text, params = ask(server, ref, p, method)
            want, want_text, want_params = ask(one, ref, p, method)
            assert got == want, (method, p["question"], text, want_text)
            assert params["ragattn_answered_by"] == method and params["ragattn_chunks_missed"] == 0, params
            assert params.get("ragattn_recomputed") == want_params.get("ragattn_recomputed"), method


@pytest.mark.slow
def test_tensor_parallel_answers_equal_one_rank(live_tp):
    tp3, tp1, ref = live_tp
    assert_answers_equal(tp3, tp1, ref, "tp3", METHODS, PROMPTS)
