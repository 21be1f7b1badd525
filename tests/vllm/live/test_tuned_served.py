"""The tuned model through a live vLLM server (``live_tuned``: the export of SmolLM2 with the shipped
Block-Attention adapter merged in, ``export_smollm2(adapter="block-attention")``, served on vLLM's
CPU_ATTN backend with the connector over a chunk store the tuned model built), over HTTP: the
connector's Block-Attention answers equal the HF path's Block-Attention answers on the tuned model
token for token, and vLLM's full attention equals the HF path's full prefill on it. The reference
records the untuned model's Block-Attention answers on the same prompts: they differ on at least
one prompt, so a server answering with the untuned weights (or the untuned model's chunks) fails."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.vllm.live.test_methods_served import ask  # noqa: E402
from tests.vllm.live.test_served import _eos, _upto_eos, complete  # noqa: E402


def test_tuned_reference_differs_from_untuned(live_tuned):
    """The served folder is the tuned export (its config names the adapter; the fingerprint the
    connector computes for it is the one the tuned store was built under), and the tuned model's
    Block-Attention answers are not the untuned model's on at least one prompt."""
    import torch

    from ragattn.vllm.fingerprint import checkpoint_fingerprint

    _, ref = live_tuned
    eos = _eos(ref)
    assert ref["adapter"] == "block-attention" and len(ref["prompts"]) >= 2 and ref["new_tokens"] >= 16
    assert json.loads((Path(ref["model"]) / "config.json").read_text())["ragattn_adapter"] == "block-attention"
    assert checkpoint_fingerprint(ref["model"], torch.float32) == ref["fingerprint"]
    differ = [p["question"] for p in ref["prompts"]
              if _upto_eos(p["block_attention"], eos) != _upto_eos(p["untuned_block_attention"], eos)]
    assert differ, [(p["block_attention_text"], p["untuned_block_attention_text"]) for p in ref["prompts"]]


def test_tuned_block_attention_equals_hf(live_tuned):
    """Every prompt's chunks come from the tuned store (all hit, none missed) and the served
    Block-Attention answer is the HF path's on the tuned model (so not the untuned model's, on the
    prompts where the two differ: the test above)."""
    server, ref = live_tuned
    eos = _eos(ref)
    for p in ref["prompts"]:
        got, text, params = ask(server, ref, p, "block-attention")
        assert got == _upto_eos(p["block_attention"], eos), (p["question"], text, p["block_attention_text"])
        assert params["ragattn_answered_by"] == "block-attention", params
        assert (params["ragattn_chunks_hit"], params["ragattn_chunks_missed"]) == (len(p["spans"]), 0), params


def test_tuned_full_attention_equals_hf(live_tuned):
    """Without chunks (no kv_transfer_params) vLLM answers as the HF path's full prefill on the
    tuned model."""
    server, ref = live_tuned
    eos = _eos(ref)
    for p in ref["prompts"]:
        got, text = complete(server, ref, p["prompt"])
        assert got == _upto_eos(p["full"], eos), (p["question"], text, p["full_text"])
