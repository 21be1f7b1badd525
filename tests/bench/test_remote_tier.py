"""A dry run of the remote-tier benchmark (tiny model, two short chunks, its own redis-server)."""
import shutil

import pytest

pytest.importorskip("redis")


@pytest.mark.skipif(shutil.which("redis-server") is None and shutil.which("valkey-server") is None,
                    reason="redis-server is not installed (scripts/setup_redis.sh installs it)")
def test_remote_tier_bench_dry_run():
    from ragattn.bench.remote_tier import run

    rows = run("tiny", 2, 16)
    assert [r[0] for r in rows][:4] == ["memory hit", "disk tier", "remote tier", "recompute"]
    assert all(ms > 0 and b > 0 for _, ms, b in rows)
