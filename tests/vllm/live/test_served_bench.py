"""``bench.served``'s measurement through the session's two live servers (vLLM's CPU_ATTN and
ragattn's backend), short: one >= 1K-token prompt, every (method, backend) row, one round of
4-token answers, so the benchmark's client cannot drift from what the servers stream."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from bench import served  # noqa: E402


def test_served_bench_measures_every_row(live, live_ragattn):
    _, ref = live
    p = ref["prompts"][0]
    prompt = served.Prompt(len(p["prompt"]), p["question"], p["prompt"], p["spans"], [])
    urls = {"cpu_attn": live[0].url, "ragattn": live_ragattn[0].url}
    rows = [(m, b) for m in ("full", "block_attention") for b in ("cpu_attn", "ragattn")]
    got = served.measure(urls, ref["model"], [prompt], rows, repeats=1, max_tokens=4, log=lambda s: None)
    assert [(r["method"], r["backend"]) for r in got] == rows
    for r in got:
        assert r["tokens"] == [4] and r["ttft_ms"] > 0 and r["decode_tok_s"] > 0, r
        assert r["ttft_speedup"] > 0 and r["prompt_tokens"] == len(p["prompt"])
    assert "full prefill" in served.format_targets(got)
