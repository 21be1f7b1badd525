"""The connector under pipeline parallelism, at class level (vLLM's config, scheduler and connector
factory; no live server): each stage's page writer writes only its run of the chunk store's layers
(the layers vLLM registers with that stage's worker), the stages' caches joined over the layers
hold the one-stage writer's K/V bit for bit (request pages, staged writes, shared chunk pages, and
with tensor parallelism inside each stage), a stage given another count of layers is refused by
name, a load one stage failed fails for the request on every stage, and CacheBlend / FusionRAG
are refused per request by name. tests/vllm/live/test_pipeline_parallel_served.py serves it."""
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm.config import ParallelConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import ragattn.hf  # noqa: E402,F401  (describes transformers models to the store)
from ragattn.store import ChunkStore, ChunkStoreError  # noqa: E402
from ragattn.vllm.pages import CacheLayoutError, PageWriter  # noqa: E402
from ragattn.vllm.parallel import stage_layers  # noqa: E402
from tests.helpers import tiny_causal_lm  # noqa: E402
from tests.vllm.test_connector import _config as connector_config  # noqa: E402
from tests.vllm.test_tensor_parallel import _caches, _joined, _same  # noqa: E402

H, HQ, D, BS, L, NUM_BLOCKS = 3, 6, 16, 16, 5, 12   # 5 layers: stages of 3 and 2 (vLLM's get_pp_indices)
STAGES = (range(0, 3), range(3, 5))
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model folder, chunk directory, chunk store, chunk keys, chunks): a tiny 5-layer Llama with
    3 KV heads, its chunks of awkward lengths built offline."""
    root = tmp_path_factory.mktemp("pp")
    model = tiny_causal_lm("llama", folder=root / "model", seed=5, num_attention_heads=HQ, num_key_value_heads=H,
                           hidden_size=HQ * D, num_hidden_layers=L)
    g = torch.Generator().manual_seed(13)
    chunks = [torch.randint(1, 211, (n,), generator=g).tolist() for n in (19, 9, 26)]
    store = ChunkStore(model, root / "kv", page_size=BS, memory_budget=1 << 24)
    return root / "model", root / "kv", store, store.add(chunks), chunks


def _layer_caches(split, heads, n):
    """``n`` layers' NaN-poisoned caches (tests.vllm.test_tensor_parallel._caches holds its 2)."""
    return [c for _ in range((n + 1) // 2) for c in _caches(split, heads)][:n]


def test_stage_layers_are_one_contiguous_run():
    assert stage_layers(NAMES[3:][::-1]) == range(3, 5)
    assert stage_layers(NAMES) == range(L)
    with pytest.raises(ValueError, match=r"layers \[0, 2\] are not one contiguous run"):
        stage_layers([NAMES[2], NAMES[0]])
    with pytest.raises(ValueError, match="not one contiguous run"):
        stage_layers([NAMES[1], NAMES[1]])
    with pytest.raises(ValueError, match="registered no KV caches"):
        stage_layers([])


@pytest.mark.parametrize("split", ["rows_kt", "rows", "channel", "planes"])
@pytest.mark.parametrize("skip,stage", [(0, False), (16, False), (0, True)])
def test_stage_layers_reassemble_the_stores_kv(served, split, skip, stage):
    """One chunk repeated, blocks out of order: the two stages' pages, joined over the layers, are
    the one-stage writer's bit for bit; nothing else is written (the prefix below ``skip`` included).
    Under tensor parallel 3 inside each stage, the six workers' pages joined over heads and layers too."""
    _, _, store, keys, chunks = served
    order = [keys[2], keys[0], keys[2], keys[1]]
    lens = [len(chunks[i]) for i in (2, 0, 2, 1)]
    spans = [(sum(lens[:i]), sum(lens[:i + 1])) for i in range(len(lens))]
    block_ids = [10, 3, 7, 1, 5, 8, 2]
    whole = _layer_caches(split, H, L)
    PageWriter(store, whole, BS, split).write(order, spans, block_ids, skip=skip, stage=stage)
    staged = []
    for layers in STAGES:
        caches = _layer_caches(split, H, len(layers))
        PageWriter(store, caches, BS, split, layers=layers).write(order, spans, block_ids, skip=skip, stage=stage)
        staged += caches
    assert _same(staged, whole)
    written = sum(x.numel() - x.isnan().sum().item() for x in staged)
    assert written == L * 2 * H * D * (spans[-1][1] - skip)
    grid = []
    for layers in STAGES:
        per_rank = []
        for rank in range(H):
            caches = _layer_caches(split, 1, len(layers))
            PageWriter(store, caches, BS, split, heads=range(rank, rank + 1), layers=layers).write(
                order, spans, block_ids, skip=skip, stage=stage)
            per_rank.append(caches)
        grid += _joined(per_rank, split)
    assert _same(grid, whole)


@pytest.mark.parametrize("split", ["rows", "channel"])
def test_stage_layers_of_shared_chunk_pages(served, split):
    """Shared chunk pages (keys page-local): each stage writes its layers; joined, the one-stage pages."""
    _, _, store, keys, chunks = served
    blocks = [6, 2]
    whole = _layer_caches(split, H, L)
    PageWriter(store, whole, BS, split).write_chunk_pages(keys[2], blocks, len(chunks[2]))
    staged = []
    for layers in STAGES:
        caches = _layer_caches(split, H, len(layers))
        PageWriter(store, caches, BS, split, layers=layers).write_chunk_pages(keys[2], blocks, len(chunks[2]))
        staged += caches
    assert _same(staged, whole) and not whole[-1].isnan().all()


def test_a_wrong_layer_count_is_refused_by_name(served):
    _, _, store, keys, _ = served
    with pytest.raises(CacheLayoutError, match="has 2 attention layers, but holds the chunk store's layers 0..2"):
        PageWriter(store, _layer_caches("rows", H, 2), BS, "rows", layers=range(0, 3))
    with pytest.raises(CacheLayoutError, match="has 3 attention layers, but holds the chunk store's layers 0..4"):
        PageWriter(store, _layer_caches("rows", H, 3), BS, "rows")
    with pytest.raises(CacheLayoutError, match="non-empty range within the chunk store's 5 layers"):
        PageWriter(store, _layer_caches("rows", H, 2), BS, "rows", layers=range(4, 6))
    k, v = torch.zeros(4, H, D), torch.zeros(4, H, D)   # (never written: the range is refused first)
    with pytest.raises(ChunkStoreError, match=r"layers must be a non-empty range within \[0, 5\)"):
        store.gather_into_([keys[1]], [k], [v], torch.arange(9), layers=range(5, 6))


def _config(served, pp=2):
    return connector_config(served, parallel=ParallelConfig(pipeline_parallel_size=pp), kv_split="rows_kt")


def _kv_cache_config(names):
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)])


def _scheduler(cfg):
    """vLLM's scheduler as it runs under pipeline parallelism: its KV cache config is stage 0's
    (``generate_scheduler_kv_cache_config``: the first worker's layer names)."""
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(vllm_config=cfg, kv_cache_config=_kv_cache_config(NAMES[:3]),
                     structured_output_manager=StructuredOutputManager(cfg), block_size=BS)


def _request(rid, prompt, spans, **params):
    return Request(request_id=rid, prompt_token_ids=list(prompt), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=2, extra_args={
                       "kv_transfer_params": {"ragattn_spans": [list(s) for s in spans], **params}}))


def test_connector_workers_of_two_stages(served):
    """vLLM's scheduler under --pipeline-parallel-size 2 claims the chunks once; each stage's
    connector worker (its own layer names, as vLLM registers them) writes its layers; joined, the
    one-stage worker's pages. The shared-pages path too (the stages write the same chunk pages)."""
    _, _, _, _, chunks = served
    prompt = chunks[1] + chunks[2] + chunks[0] + [7, 3, 11]
    spans = [(0, 9), (9, 35), (35, 54)]
    meta = _scheduler(_config(served))
    meta.add_request(_request("r0", prompt, spans))
    meta = meta.schedule().kv_connector_metadata
    assert [load.spans for load in meta.loads] == [tuple(spans)]

    def worker(cfg, names):
        conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, _kv_cache_config(names))
        caches = dict(zip(names, _layer_caches("rows_kt", H, len(names))))
        conn.register_kv_caches(caches)
        assert conn.worker.writer.layers == stage_layers(names)
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        assert conn.get_block_ids_with_load_errors() == set()
        return [caches[n] for n in names]

    staged = [c for layers in STAGES for c in worker(_config(served), [NAMES[i] for i in layers])]
    whole = worker(_config(served, pp=1), NAMES)
    assert _same(staged, whole) and not whole[-1].isnan().all()


@pytest.mark.parametrize("method", ["cacheblend", "fusionrag"])
def test_recompute_is_refused_per_request_by_name(served, method, monkeypatch):
    """CacheBlend and FusionRAG drive every decoder layer in one worker: under pipeline parallelism
    the scheduler claims no chunk for them (full attention) and says why in the request's
    kv_transfer_params; Block-Attention is still claimed. The worker keeps no recomputer."""
    monkeypatch.setenv("RAGATTN_VLLM_ATTENTION", "1")   # (the refusal of a server without ragattn's backend is another)
    _, _, _, _, chunks = served
    sched = _scheduler(_config(served))
    prompt = chunks[0] + chunks[1] + [7, 3, 11]
    spans = [(0, 19), (19, 28)]
    sched.add_request(_request("r-rc", prompt, spans, ragattn_method=method))
    sched.add_request(_request("r-ba", prompt[:-1], spans, ragattn_method="block-attention"))
    out = sched.schedule()
    assert [load.req_id for load in out.kv_connector_metadata.loads] == ["r-ba"]
    req = sched.requests["r-rc"]
    _, params = sched.connector.request_finished(req, [])
    assert params["ragattn_answered_by"] == "full-attention", params
    assert params["ragattn_reason"] == (f"{method} is not served under pipeline parallelism: it recomputes rows "
                                        "through every decoder layer in one worker, and under "
                                        "--pipeline-parallel-size 2 each stage holds some of the layers"), params
    assert sched.connector.settings.no_recompute and _config(served, pp=1) and \
        KVConnectorFactory.create_connector(_config(served, pp=1), KVConnectorRole.SCHEDULER,
                                            _kv_cache_config(NAMES)).settings.no_recompute is None


def test_a_load_one_stage_failed_fails_for_the_request(served, monkeypatch):
    """Shared chunk pages: stage 1 cannot write a chunk's pages (a read error there only), stage 0
    can. Stage 1 fails the load (no fallback to copies, which stage 0 did not make); the stages'
    reports joined (vLLM's aggregation) name the request failed and not read from shared pages (its
    blocks, which vLLM recomputes, are not given back); the scheduler's next metadata tells every
    worker to forget its shared entries, and stage 0 does."""
    from types import SimpleNamespace

    monkeypatch.setenv("RAGATTN_VLLM_ATTENTION", "1")
    _, _, _, _, chunks = served
    cfg = connector_config(served, parallel=ParallelConfig(pipeline_parallel_size=2), shared_pages=True)
    sched = _scheduler(cfg)
    sched.add_request(_request("r-sh", chunks[1] + chunks[2] + [7, 3, 11], [(0, 9), (9, 35)]))
    meta = sched.schedule().kv_connector_metadata
    assert meta.loads[0].chunk_blocks is not None
    reports, workers = [], []
    for s, layers in enumerate(STAGES):
        names = [NAMES[i] for i in layers]
        conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, _kv_cache_config(names))
        conn.register_kv_caches(dict(zip(names, _layer_caches("rows", H, len(names)))))
        if s == 1:
            def unreadable(*args, **kwargs):
                raise ChunkStoreError("chunk file unreadable on this stage")
            monkeypatch.setattr(conn.worker.writer, "write_chunk_pages", unreadable)
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        reports.append(conn.build_connector_worker_meta())
        workers.append(conn)
    assert "r-sh" in workers[0].worker_state.requests and set(reports[0].shared) == {"r-sh"}
    assert workers[1].get_block_ids_with_load_errors() and set(reports[1].failed) == {"r-sh"}
    assert "r-sh" not in workers[1].worker_state.requests      # (no copy was made instead)
    joined = reports[0].aggregate(reports[1])
    assert joined.shared == {} and set(joined.failed) == {"r-sh"}
    sched.connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=joined))
    idle = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[])   # a step with no new request
    nxt = sched.connector.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=idle))
    assert nxt.dropped == ["r-sh"]
    workers[0].bind_connector_metadata(nxt)
    workers[0].start_load_kv(None)
    assert "r-sh" not in workers[0].worker_state.requests
