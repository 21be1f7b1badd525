"""The connector under ``--pipeline-parallel-size 2`` (``live_pp``: SmolLM2's 30 layers, 15 a
stage, ragattn's backend, shared chunk pages), over HTTP: full attention's, Block-Attention's and
TurboRAG composite's answers equal the one-stage server's (``live_ragattn``) token for token and
the response says the method answered; CacheBlend and FusionRAG, which recompute through every
layer in one worker, are answered by full attention with the reason in ``kv_transfer_params``.
tests/vllm/test_pipeline_parallel.py checks each stage's layers at class level."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm.live.test_methods_served import ask  # noqa: E402
from tests.vllm.live.test_tensor_parallel_served import _full, assert_answers_equal  # noqa: E402

METHODS = ("block-attention", "turborag-composite")
REFUSED = ("cacheblend", "fusionrag")
PROMPTS = 2   # of the session's >= 1K-token prompts


@pytest.mark.slow
def test_pipeline_parallel_answers_equal_one_stage(live_pp):
    pp2, pp1, ref = live_pp
    assert_answers_equal(pp2, pp1, ref, "pp2", METHODS, PROMPTS)
    p = ref["prompts"][0]
    full = _full(pp1, ref, p)[0]
    for method in REFUSED:
        got, _, params = ask(pp2, ref, p, method)
        assert params["ragattn_answered_by"] == "full-attention", params
        assert "not served under pipeline parallelism" in params["ragattn_reason"], params
        assert got == full, method
