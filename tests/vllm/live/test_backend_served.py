"""Through a live vLLM server whose attention is ragattn's backend (``RAGATTN_VLLM_ATTENTION=1``:
the platform plugin, ragattn.vllm.platform, which logs that it is active), over HTTP: full prefill and decode answer token for
token like vLLM's own CPU_ATTN server and the HF path's full attention, and the connector's
Block-Attention, written into the backend's pages, answers like the HF path's ``block_attention``."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from ragattn.vllm.platform import ACTIVE_LINE  # noqa: E402
from tests.vllm.live.test_served import _eos, _upto_eos, complete  # noqa: E402


def test_served_by_ragattns_backend(live, live_ragattn):
    """vLLM chose the KV layout only ragattn's backend asks for (LBNHC: K/V as [pages, page_size,
    Hkv, D] views); the CPU_ATTN server keeps its own (LBHNC)."""
    assert "Using LBNHC KV cache layout" in live_ragattn[0].log.read_text(errors="replace")
    assert "Using LBHNC KV cache layout" in live[0].log.read_text(errors="replace")
    # and the server says so itself (a line of vLLM's own log, from the platform plugin)
    assert ACTIVE_LINE in live_ragattn[0].log.read_text(errors="replace")
    assert ACTIVE_LINE not in live[0].log.read_text(errors="replace")


def test_ragattn_backend_equals_cpu_attn_and_hf(live, live_ragattn):
    """Greedy, float32, >= 6 prompts of >= 1K tokens: ragattn's backend answers token for token
    like vLLM's CPU_ATTN backend and like the HF path's full attention."""
    cpu_attn, ref = live
    server, _ = live_ragattn
    eos = _eos(ref)
    assert len(ref["prompts"]) >= 6 and all(len(p["prompt"]) >= 1024 for p in ref["prompts"])
    with ThreadPoolExecutor(2) as pool:   # the two single-threaded servers answer side by side
        theirs = pool.submit(lambda: [complete(cpu_attn, ref, p["prompt"]) for p in ref["prompts"]])
        ours = [complete(server, ref, p["prompt"]) for p in ref["prompts"]]
        theirs = theirs.result()
    for p, (got, text), (their, their_text) in zip(ref["prompts"], ours, theirs):
        assert got == their, (p["question"], text, their_text)
        assert got == _upto_eos(p["full"], eos), (p["question"], text, p["full_text"])


def test_ragattn_backend_block_attention_equals_hf(live_ragattn):
    """The connector writes the store's chunks into the backend's pages (its declared 'channel'
    layout); the answers equal the HF path's Block-Attention answers (>= 16 tokens, greedy)."""
    server, ref = live_ragattn
    eos = _eos(ref)
    for p in ref["prompts"]:
        got, text = complete(server, ref, p["prompt"], {"ragattn_spans": p["spans"]})
        assert got == _upto_eos(p["block_attention"], eos), (p["question"], text, p["block_attention_text"])
