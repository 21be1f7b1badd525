"""Tensor-parallel selection: with the heads split over 2 gloo ranks (CPU processes spawned here),
every rank selects the same tokens as one process holding all heads (FusionRAG's query-guided
scores and CacheBlend's K/V deviation are all-reduced before the top-k)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ragattn.methods import selection

WORLD = 2
LENS = [7, 1, 12, 30]         # chunk lengths (awkward)
T, HQ, HKV, D = 5, 8, 4, 32   # GQA 2; each rank holds HQ/2 query heads and their HKV/2 kv heads
K_SEL = 11


def _inputs():
    g = torch.Generator().manual_seed(7)
    n = sum(LENS)
    q = torch.randn(T, HQ, D, generator=g)
    k = torch.randn(n, HKV, D, generator=g) * torch.linspace(0.5, 2.0, n)[:, None, None]
    new_k, new_v, old_k, old_v = (torch.randn(n, HKV, D, generator=g) for _ in range(4))
    return q, k, (new_k, new_v, old_k, old_v)


def _select(q, k, kv, group=None):
    out = {}
    for norm in selection.SCORE_NORMS:
        s = selection.query_guided_scores(q, k, LENS, norm)
        out[norm] = selection.top_rows(s, K_SEL, group)
        if group is not None:
            dist.all_reduce(s, group=group)
        out[norm + "_scores"] = s
    out["deviation"] = selection.top_rows(selection.kv_deviation(*kv), K_SEL, group)
    return out


def _worker(rank, path, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    try:
        q, k, kv = _inputs()
        hq, hkv = HQ // WORLD, HKV // WORLD
        q_local = q[:, rank * hq:(rank + 1) * hq]
        k_local = k[:, rank * hkv:(rank + 1) * hkv]
        kv_local = [t[:, rank * hkv:(rank + 1) * hkv] for t in kv]
        torch.save(_select(q_local, k_local, kv_local, group=dist.group.WORLD), f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")
def test_split_heads_select_the_same_tokens(tmp_path):
    results = str(tmp_path / "sel")
    mp.spawn(_worker, args=(str(tmp_path / "store"), results), nprocs=WORLD, join=True)
    q, k, kv = _inputs()
    single = _select(q, k, kv)
    ranks = [torch.load(f"{results}.{r}") for r in range(WORLD)]
    for name in ("per_chunk", "global", "deviation"):
        assert single[name].numel() == K_SEL
        for r in ranks:
            assert torch.equal(r[name], single[name]), (name, r[name], single[name])
    for norm in selection.SCORE_NORMS:
        torch.testing.assert_close(ranks[0][norm + "_scores"], single[norm + "_scores"], rtol=1e-5, atol=1e-6)
        assert torch.equal(ranks[0][norm + "_scores"], ranks[1][norm + "_scores"])
    # without the all-reduce a rank would pick from its own heads only: not the same tokens
    alone = selection.top_rows(selection.query_guided_scores(q[:, :HQ // 2], k[:, :HKV // 2], LENS), K_SEL)
    assert not torch.equal(alone, single["per_chunk"])
