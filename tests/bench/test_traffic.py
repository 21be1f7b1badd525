"""``bench.traffic``: its Zipf stream, its windows, and ``--dry-run`` end to end (a tiny random model
over SmolLM2's tokenizer, a dozen requests through the disk tier, recompute and, with
redis-server, the remote tier; the report's files written)."""
import json
import shutil

import numpy as np
import pytest

from bench import traffic


def test_zipf_stream_is_skewed_distinct_and_seeded():
    s = traffic.zipf_stream(37, 400, 5, 1.2, seed=3)
    assert len(s) == 400 and all(len(r) == 5 == len(set(r)) and all(0 <= i < 37 for i in r) for r in s)
    assert s == traffic.zipf_stream(37, 400, 5, 1.2, seed=3) and s != traffic.zipf_stream(37, 400, 5, 1.2, seed=4)
    counts = np.bincount(np.concatenate(s), minlength=37)
    assert counts.max() > 5 * max(counts.min(), 1)     # popular passages recur, rare ones seldom
    flat = np.bincount(np.concatenate(traffic.zipf_stream(37, 400, 5, 0.0, seed=3)), minlength=37)
    assert flat.max() < 3 * flat.min()
    with pytest.raises(ValueError, match="--passages must be in"):
        traffic.zipf_stream(4, 1, 5, 1.0, seed=0)


def test_summary_is_over_the_second_half_and_its_probes():
    rows = [dict(ttft_s=1.0 + i) for i in range(6)]
    rows[1].update(full_s=100.0, warm_s=0.1, agrees=True, warm_same=True)     # first half: not counted
    rows[4].update(full_s=8.0, warm_s=4.0, agrees=False, warm_same=True)
    s = traffic.summary(rows)
    assert s["probes"] == 1 and s["ttft_p50_ms"] == pytest.approx(5000)
    assert s["sustained_speedup"] == pytest.approx(8 / 5) and s["warm_speedup"] == pytest.approx(2)
    assert s["ratio_to_warm"] == pytest.approx(0.8) and s["met"] and s["first_token_agrees"] == 0
    with pytest.raises(ValueError, match="no probe in the second half"):
        traffic.summary(rows[:4])


def test_windows_shares_and_speedup():
    rows = [dict(tier="disk", i=i, t_s=i * 0.5, ttft_s=0.1 + 0.1 * (i % 2), from_memory=3, from_disk=1,
                 from_remote=0, from_recompute=0, resident_bytes=2**20 * (i + 1), rss_bytes=2**30)
            for i in range(5)]
    w = traffic.windows(rows, 2, full_p50=0.6)
    assert [(x["first"], x["last"]) for x in w] == [(0, 1), (2, 3), (4, 4)]
    assert w[0]["memory_hit"] == 0.75 and w[0]["tier_hit"] == 0.25
    assert w[0]["p50_ms"] == pytest.approx(150) and w[0]["speedup"] == pytest.approx(4.0)
    assert w[2]["p50_ms"] == pytest.approx(100) and w[2]["resident_mb"] == 5


def test_dry_run_writes_the_report(tmp_path):
    out = tmp_path / "out"
    r = traffic.run(traffic._parse(["--dry-run", "--out", str(out)]), "python -m bench.traffic --dry-run")
    have_redis = shutil.which("redis-server") or shutil.which("valkey-server")
    want = ["disk", "remote", "recompute"] if have_redis else ["disk", "recompute"]
    assert list(r["tiers"]) == want
    assert r["meta"]["memory_budget"] < r["meta"]["corpus_kv_bytes"]
    for tier, t in r["tiers"].items():
        assert len(t["rows"]) == 12 and t["stats"]["evicted"] > 0, (tier, t["stats"])
        later = t["rows"][6:]                          # after the store filled: hits and misses both
        assert sum(x["from_memory"] for x in later) > 0 and sum(x[f"from_{tier}"] for x in later) > 0
        assert all(x["from_memory"] + x[f"from_{tier}"] == 4 + 1 for x in t["rows"])   # passages and the head
        assert t["spent_s"]["recompute_s" if tier == "recompute" else f"{tier}_s"] > 0
    assert set(r["costs"]["crossover_tokens"]) == ({"disk", "remote"} if have_redis else {"disk"})
    data = json.loads((out / "traffic.json").read_text())
    for t in data["tiers"].values():
        assert t["probes"] == 2 and t["full_p50_ms"] > 0 and t["warm_speedup"] > 0 and t["warm_same"] == 2
        assert t["ratio_to_warm"] == pytest.approx(t["sustained_speedup"] / t["warm_speedup"])
    md = (out / "traffic.md").read_text()
    assert "sustained speed-up" in md and "loaded machine" in md and (out / "traffic.png").stat().st_size > 1000
