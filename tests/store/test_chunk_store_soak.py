"""Soak test of the chunk store's memory budget: ten budgets' worth of chunks added and assembled
in a loop, in a fresh process (so that its resident-set size and peak mean something).

Memory must stay within the budget (the pool's bytes exactly, the process's RSS and peak RSS
within a small slack) and every answer must stay unchanged: the same requests, asked again after
their chunks were evicted and reloaded from disk (bit-exact) or recomputed (memory only), give
the same final-block logits.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # minutes: `pytest -m "not slow"` skips it for a quick run

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=1024, rope_theta=1000.0)
BUDGET = 4 << 20          # 4 MiB: 2048 tokens of this model's K/V (2 KiB a token)
RSS_SLACK = 16 << 20      # prefill activations, request caches, allocator slack (the old
                          # unbounded pool grew by 40 MiB here, with a 64 MiB doubling peak)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def soak(directory: str | None, budget: int = BUDGET, seed: int = 0) -> dict:
    """Run the soak loop in this process; returns its measurements."""
    from ragattn.hf.models import random_llama
    from ragattn.store import ChunkStore
    from ragattn.methods.generate import paged_forward

    torch.set_num_threads(1)
    model = random_llama(SHAPE, dtype=torch.float32, seed=3)
    store = ChunkStore(model, directory=directory, memory_budget=budget, max_batch_tokens=2048)
    g = torch.Generator().manual_seed(seed)
    total = 10 * budget // store.row_bytes
    chunks, n = [], 0
    while n < total:
        c = torch.randint(1, SHAPE["vocab_size"], (int(torch.randint(17, 61, (1,), generator=g)),), generator=g)
        chunks.append(c.tolist())
        n += c.numel()
    question = torch.randint(1, SHAPE["vocab_size"], (1, 6), generator=g)

    def answer(idx):
        req = store.assemble(store.add([chunks[i] for i in idx]), extra_slots=question.shape[1])
        pos = req.next_position + torch.arange(question.shape[1])
        return paged_forward(model, question, pos, req.cache)[-1]

    probes = [torch.randperm(len(chunks), generator=g)[:4].tolist() for _ in range(6)]
    ref = {tuple(p): answer(p) for p in probes}
    rss0, peak0 = _rss(), _peak_rss()
    max_pool, changed, asked = store.pool_bytes, 0, 0
    for step, start in enumerate(range(0, len(chunks), 16)):
        answer(range(start, min(start + 16, len(chunks))))     # new chunks: evicts old ones
        max_pool = max(max_pool, store.pool_bytes)
        if step % 4 == 0:
            p = probes[(step // 4) % len(probes)]
            got = answer(p)
            asked += 1
            same = torch.equal(got, ref[tuple(p)]) if directory else torch.allclose(got, ref[tuple(p)], rtol=1e-5, atol=1e-5)
            changed += not same
    for p in probes:
        got = answer(p)
        asked += 1
        same = torch.equal(got, ref[tuple(p)]) if directory else torch.allclose(got, ref[tuple(p)], rtol=1e-5, atol=1e-5)
        changed += not same
    lost = sum(not store.has(store.key(c)) for c in chunks) if directory else 0
    return dict(budget=budget, max_pool_bytes=max_pool, rss_growth=_rss() - rss0,
                peak_growth=_peak_rss() - peak0, chunks=len(chunks), tokens=n, asked=asked,
                changed=changed, lost=lost, **store.stats)


def test_soak_stays_within_budget_and_answers_stay_the_same(tmp_path):
    """Both tiers in one fresh process (one interpreter start-up): disk first, then memory only."""
    root = Path(__file__).resolve().parents[2]
    code = (f"import json; from tests.store.test_chunk_store_soak import soak; "
            f"print(json.dumps([soak({str(tmp_path)!r}), soak(None)]))")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    disk, memory = json.loads(out.stdout.strip().splitlines()[-1])
    print(disk, memory)
    for r in (disk, memory):
        assert r["tokens"] * 2048 >= 10 * BUDGET and r["evicted"] > r["chunks"] // 2  # it did churn
        assert r["max_pool_bytes"] <= BUDGET
        assert r["rss_growth"] <= BUDGET + RSS_SLACK and r["peak_growth"] <= BUDGET + RSS_SLACK
        assert r["changed"] == 0 and r["lost"] == 0 and r["asked"] >= 10
    assert disk["loaded"] > 0 and disk["recomputed"] == 0          # evicted chunks came from disk
    assert memory["recomputed"] > 0 and memory["loaded"] == 0      # ... or were recomputed
