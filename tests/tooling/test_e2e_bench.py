"""bench/e2e.py at tiny sizes: it runs, writes its JSON/markdown/plot, and stays out of the
micro-benchmark discovery."""
import json

from bench import e2e


def test_e2e_bench_tiny(tmp_path):
    out = tmp_path / "e2e"
    assert e2e.main(["--device", "cpu", "--model", "tiny-random", "--sizes", "tiny", "--question-len", "5",
                     "--repeats", "1", "--answer-tokens", "3", "--decode-rounds", "1", "--decode-steps", "2",
                     "--memory-requests", "1,4", "--out", str(out)]) == 0
    data = json.loads((out / "e2e.json").read_text())
    paths = {r["path"] for r in data["rows"]}
    assert {"full-prefill", "final block alone (bound)", "final block over the model's own cache",
            "cached (on device)", e2e.ZERO_COPY} <= paths
    for r in data["rows"]:   # the assembly is part of the cached TTFT, and only that row has one
        assert ("assembly_ms" in r) == (r["path"] == "cached (on device)")
        if "assembly_ms" in r:
            # each recorded assembly is timed inside the TTFT call it belongs to (paired samples),
            # so its median cannot exceed the TTFT median: a containment, not a speed claim
            assert 0 < r["assembly_ms"] <= r["ttft_ms"]
    for r in data["rows"]:
        if r["path"] in ("full-prefill", "cached (on device)", e2e.ZERO_COPY):
            # 3 tokens: 2 gaps, their median is their mean and both lie inside the answer's time
            # (TTFT comes from separate calls, so a shared machine may put it above the total)
            assert r["total_ms"] >= 2 * r["per_token_ms"] > 0 and r["ttft_ms"] > 0
        assert r["vs_bound"] > 0
    assert {r["context_tokens"] for r in data["rows"]} == {32, 48}
    assert all(r["ttft_ms"] > 0 for r in data["rows"])
    assert (out / "e2e.png").stat().st_size > 1000
    # the decode-step check: every path per context, 1 round x 2 steps each, ratios to full prefill
    dec = data["decode_steps"]
    assert {r["path"] for r in dec} == {"full-prefill (DynamicCache)", *e2e.DECODE_ROUTES}
    assert len(dec) == 2 * (1 + len(e2e.DECODE_ROUTES)) and all(r["steps"] == 2 and r["step_ms"] > 0 for r in dec)
    assert all(r["vs_full"] == 1.0 for r in dec if r["path"].startswith("full"))
    assert "| 3 x 16 | 48 | full-prefill |" in (out / "e2e.md").read_text()
    # the memory case (the largest context, 3 x 16): N requests hold the chunk pages once when
    # zero-copy, N copies of them on the copy path
    mem = {(r["requests"], r["path"]): r for r in data["memory"]}
    assert set(mem) == {(n, p) for n in (1, 4) for p in ("copy (assemble)", "zero-copy (request)")}
    for n in (1, 4):
        copy, zc = mem[n, "copy (assemble)"], mem[n, "zero-copy (request)"]
        assert zc["store_chunk_bytes"] == copy["store_chunk_bytes"] > 0
        assert 0 < zc["per_request_bytes"] < copy["per_request_bytes"]
        assert zc["total_bytes"] == zc["store_chunk_bytes"] + n * zc["per_request_bytes"] < copy["total_bytes"]
    assert "| 3 x 16 | 4 | zero-copy (request) |" in (out / "e2e.md").read_text()


def test_e2e_not_discovered_as_microbenchmark():
    from bench.harness import discover_modules

    assert "bench.e2e" not in discover_modules()
