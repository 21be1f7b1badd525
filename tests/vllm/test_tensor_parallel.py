"""The connector under tensor parallelism, at class level (vLLM's config, scheduler and connector
factory; no live server): each rank's page writer writes only its share of the chunk store's KV
heads (from vLLM's parallel state, stood in for by patching vLLM's rank), the ranks' caches
reassembled over the heads hold the store's full K/V bit for bit (request pages, staged writes
and shared chunk pages) and a cache holding another count of heads is refused by name
(tests/vllm/test_pipeline_parallel.py: pipeline stages). tests/vllm/live/test_tensor_parallel_served.py
serves it."""
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm.distributed  # noqa: E402

from vllm.config import ParallelConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import ragattn.hf  # noqa: E402,F401  (describes transformers models to the store)
from ragattn.store import ChunkStore  # noqa: E402
from ragattn.vllm.pages import CacheLayoutError, PageWriter, head_views, slot_rows  # noqa: E402
from ragattn.vllm.parallel import kv_head_share, rank_kv_heads  # noqa: E402
from tests.helpers import tiny_causal_lm  # noqa: E402
from tests.vllm.test_connector import _config as connector_config  # noqa: E402

TP, H, HQ, D, BS, L, NUM_BLOCKS = 3, 3, 6, 16, 16, 2, 12   # SmolLM2's head ratio: 3 KV heads over 3 ranks
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
NAN = float("nan")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model folder, chunk directory, chunk store, chunk keys, chunk lengths): a tiny Llama with 3
    KV heads, its chunks of awkward lengths built offline."""
    root = tmp_path_factory.mktemp("tp")
    model = tiny_causal_lm("llama", folder=root / "model", seed=3, num_attention_heads=HQ, num_key_value_heads=H,
                           hidden_size=HQ * D)
    g = torch.Generator().manual_seed(11)
    chunks = [torch.randint(1, 211, (n,), generator=g).tolist() for n in (13, 22, 7)]
    store = ChunkStore(model, root / "kv", page_size=BS, memory_budget=1 << 24)
    keys = store.add(chunks)
    return root / "model", root / "kv", store, keys, chunks


def _as_rank(monkeypatch, rank, size=TP):
    """vLLM's tensor-parallel rank and world size as a worker of rank ``rank`` sees them."""
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: size)


def _config(folder, kv_dir, tp=TP, split="rows_kt"):
    return connector_config((folder, kv_dir), parallel=ParallelConfig(tensor_parallel_size=tp), kv_split=split)


def _kv_cache_config(heads):
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=D, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=spec)])


def _caches(split, heads):
    """NaN-poisoned per-layer caches holding ``heads`` KV heads in ``split``'s layout."""
    shape = (NUM_BLOCKS, 2, BS, heads, D) if split == "planes" else (NUM_BLOCKS, heads, BS, 2 * D)
    return [torch.full(shape, NAN) for _ in range(L)]


def _joined(per_rank, split):
    """The ranks' caches of each layer concatenated over the KV heads (rank order)."""
    return [torch.cat(layer, dim=3 if split == "planes" else 1) for layer in zip(*per_rank)]


def _same(a, b):
    return all(torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True) is None for x, y in zip(a, b))


def test_kv_head_share_is_vllms_split():
    """vLLM's QKVParallelLinear split: heads over the ranks, or each head replicated on
    tp / Hkv ranks; heads and ranks that do not divide, or a wrong per-rank count, refused."""
    assert [kv_head_share(3, 3, r, 1) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    assert [kv_head_share(4, 2, r, 2) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [kv_head_share(2, 4, r, 1) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert kv_head_share(5, 1, 0, 5) == range(5)
    with pytest.raises(ValueError, match="cannot be shared by --tensor-parallel-size 2"):
        kv_head_share(3, 2, 0, 1)
    with pytest.raises(ValueError, match="holds 1 of the chunk store's 3 KV heads, vLLM's model config says 3"):
        kv_head_share(3, 3, 1, 3)
    with pytest.raises(ValueError, match="rank 3 is outside"):
        kv_head_share(3, 3, 3, 1)


def test_rank_heads_come_from_vllms_parallel_state(served, monkeypatch):
    folder, kv_dir, store, _, _ = served
    cfg = _config(folder, kv_dir)
    for rank in range(TP):
        _as_rank(monkeypatch, rank)
        assert rank_kv_heads(cfg, store.num_kv_heads) == range(rank, rank + 1)
    _as_rank(monkeypatch, 0, size=2)     # a group that is not the config's
    with pytest.raises(RuntimeError, match="tensor parallel group has 2 ranks, its config 3"):
        rank_kv_heads(cfg, store.num_kv_heads)
    assert rank_kv_heads(_config(folder, kv_dir, tp=1), store.num_kv_heads) == range(H)


@pytest.mark.parametrize("split", ["rows_kt", "rows", "channel", "planes"])
@pytest.mark.parametrize("skip,stage", [(0, False), (16, False), (0, True)])
def test_rank_slices_reassemble_the_stores_kv(served, split, skip, stage):
    """One chunk repeated, blocks out of order: the three ranks' pages, joined over the heads,
    are the one-rank writer's bit for bit and the HF path's assembled request; nothing else is
    written (the prefix below ``skip`` included)."""
    _, _, store, keys, chunks = served
    order = [keys[1], keys[0], keys[1], keys[2]]
    lens = [len(chunks[1]), len(chunks[0]), len(chunks[1]), len(chunks[2])]
    spans = [(sum(lens[:i]), sum(lens[:i + 1])) for i in range(len(lens))]
    total, block_ids = spans[-1][1], [7, 2, 9, 4, 0]
    per_rank = []
    for rank in range(TP):
        caches = _caches(split, 1)
        PageWriter(store, caches, BS, split, heads=kv_head_share(H, TP, rank, 1)).write(
            order, spans, block_ids, skip=skip, stage=stage)
        per_rank.append(caches)
    joined = _joined(per_rank, split)
    whole = _caches(split, H)
    PageWriter(store, whole, BS, split).write(order, spans, block_ids, skip=skip, stage=stage)
    assert _same(joined, whole)

    req = store.assemble(order, positions="reordered")
    ref = req.cache.slot_rows(0, torch.arange(total))
    rows = slot_rows(block_ids, BS, skip, total)
    blk, off = rows // BS, rows % BS
    for l, kv in enumerate(joined):
        ks, vs = head_views(kv, H, D, BS, split)
        for h in range(H):
            assert torch.equal(ks[h][blk, off, 0], req.cache.k[l].reshape(-1, H, D)[ref][skip:, h])
            assert torch.equal(vs[h][blk, off, 0], req.cache.v[l].reshape(-1, H, D)[ref][skip:, h])
    written = sum(x.numel() - x.isnan().sum().item() for x in joined)
    assert written == L * 2 * H * D * (total - skip)


@pytest.mark.parametrize("split", ["rows", "channel"])
def test_rank_slices_of_shared_chunk_pages(served, split):
    """Shared chunk pages (keys page-local): each rank writes its heads; joined, the one-rank pages."""
    _, _, store, keys, chunks = served
    blocks = [5, 8]
    per_rank = []
    for rank in range(TP):
        caches = _caches(split, 1)
        PageWriter(store, caches, BS, split, heads=range(rank, rank + 1)).write_chunk_pages(keys[1], blocks,
                                                                                           len(chunks[1]))
        per_rank.append(caches)
    whole = _caches(split, H)
    PageWriter(store, whole, BS, split).write_chunk_pages(keys[1], blocks, len(chunks[1]))
    assert _same(_joined(per_rank, split), whole)
    assert not whole[0].isnan().all()


def test_a_wrong_head_count_is_refused_by_name(served):
    _, _, store, _, _ = served
    with pytest.raises(CacheLayoutError, match="KV caches hold 3 KV heads, but its share of the chunk store's 3 "
                                               "KV heads is 1"):
        PageWriter(store, _caches("rows", H), BS, "rows", heads=range(1, 2))
    with pytest.raises(CacheLayoutError, match="KV caches hold 1 KV heads, but its share .* is 3"):
        PageWriter(store, _caches("planes", 1), BS, "planes")
    with pytest.raises(CacheLayoutError, match="non-empty range within the chunk store's 3 KV heads"):
        PageWriter(store, _caches("rows", 1), BS, "rows", heads=range(3, 4))


def _request(prompt, spans):
    return Request(request_id=f"r{len(prompt)}", prompt_token_ids=list(prompt), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=2, extra_args={
                       "kv_transfer_params": {"ragattn_spans": [list(s) for s in spans]}}))


def test_connector_workers_of_three_ranks(served, monkeypatch):
    """vLLM's scheduler under --tensor-parallel-size 3 claims the chunks once; the connector's
    worker of each rank (vLLM's rank patched in) writes its KV head of every layer; joined, the
    one-rank worker's pages. A worker whose caches hold every head under tensor parallelism is
    refused by name at register_kv_caches."""
    folder, kv_dir, _, _, chunks = served
    cfg = _config(folder, kv_dir)
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    sched = Scheduler(vllm_config=cfg, kv_cache_config=_kv_cache_config(1),
                      structured_output_manager=StructuredOutputManager(cfg), block_size=BS)
    prompt = chunks[2] + chunks[0] + chunks[1] + [5, 9, 2]
    spans = [(0, 7), (7, 20), (20, 42)]
    sched.add_request(_request(prompt, spans))
    meta = sched.schedule().kv_connector_metadata
    assert [load.spans for load in meta.loads] == [tuple(spans)]

    def worker(cfg, heads):
        conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, _kv_cache_config(heads))
        caches = dict(zip(LAYERS, _caches("rows_kt", heads)))
        conn.register_kv_caches(caches)
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        assert conn.get_block_ids_with_load_errors() == set()
        return [caches[n] for n in LAYERS]

    per_rank = []
    for rank in range(TP):
        _as_rank(monkeypatch, rank)
        per_rank.append(worker(cfg, 1))
    whole = worker(_config(folder, kv_dir, tp=1), H)
    assert _same(_joined(per_rank, "rows_kt"), whole)
    assert not whole[0].isnan().all()
    _as_rank(monkeypatch, 2)
    with pytest.raises(CacheLayoutError, match="KV caches hold 3 KV heads, but its share"):
        worker(cfg, H)


AGREE_RANK = """
import os, sys, torch.distributed as dist
from ragattn.vllm.parallel import agree_loads
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=3)
codes = [[1, 2, 1, 0, 2], [1, 2, 2, 1, 0], [1, 2, 1, 1, 2]][rank]
print(agree_loads(codes, dist.group.WORLD))
dist.destroy_process_group()
"""


def test_ranks_agree_on_every_load(tmp_path):
    """agree_loads over a real three-process gloo group: a load counts where every rank wrote it,
    and wrote it the same way (copy or shared pages); every rank gets the same answer."""
    import subprocess
    import sys

    from ragattn.vllm.parallel import COPY, FAILED, SHARED, agree_loads

    procs = [subprocess.Popen([sys.executable, "-c", AGREE_RANK, str(r), str(tmp_path / "rendezvous")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert [o.strip() for o, _ in outs] == ["[True, True, False, False, False]"] * 3
    assert agree_loads([COPY, FAILED, SHARED], None) == [True, False, True] and agree_loads([], None) == []


def test_a_load_another_rank_failed_fails_here(served, monkeypatch):
    """A load this rank wrote but another rank could not (agree_loads says so) is reported failed on
    this rank too: its blocks are given back to vLLM, and no recompute nor shared entry is kept."""
    import ragattn.vllm.connector_worker as cw

    folder, kv_dir, _, _, chunks = served
    cfg = _config(folder, kv_dir, tp=1)
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    sched = Scheduler(vllm_config=cfg, kv_cache_config=_kv_cache_config(H),
                      structured_output_manager=StructuredOutputManager(cfg), block_size=BS)
    sched.add_request(_request(chunks[1] + chunks[0] + [5, 9, 2], [(0, 22), (22, 35)]))
    meta = sched.schedule().kv_connector_metadata
    seen = []

    def another_rank_failed(codes, group):
        seen.append(list(codes))
        return [False] * len(codes)

    for agree, failed in ((cw.agree_loads, False), (another_rank_failed, True)):
        monkeypatch.setattr(cw, "agree_loads", agree)
        conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, _kv_cache_config(H))
        conn.register_kv_caches(dict(zip(LAYERS, _caches("rows_kt", H))))
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        errors = conn.get_block_ids_with_load_errors()
        assert bool(errors) == failed and (not failed or errors == set(meta.loads[0].block_ids[0][:3]))
    assert seen == [[cw.COPY]]
