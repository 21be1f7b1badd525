"""RagattnConnector inside vLLM 0.33 on the CPU: vLLM's own config, scheduler and connector
factory (the connector loaded by module path), a tiny random Llama saved to a folder as the
served model, CPU cache tensors in vLLM's layout for the worker side. Runs in .venv-vllm
(scripts/setup_vllm.sh); skipped elsewhere."""
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         ParallelConfig, SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ragattn.store import ChunkStore, ChunkStoreError  # noqa: E402
from ragattn.vllm.connector import RagattnConnector, RagattnConnectorMetadata  # noqa: E402
from ragattn.vllm.pages import CacheLayoutError, slot_rows  # noqa: E402
from ragattn.vllm.spans import MethodChoice  # noqa: E402
from tests.helpers import tiny_causal_lm  # noqa: E402

BS, H, D, L, NUM_BLOCKS = 16, 2, 16, 2, 24
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model folder, chunk directory, HF model, chunk token lists): chunks built offline."""
    root = tmp_path_factory.mktemp("served")
    model = tiny_causal_lm("llama", folder=root / "model")
    g = torch.Generator().manual_seed(7)
    chunks = [torch.randint(1, 211, (n,), generator=g).tolist() for n in (9, 21, 6, 13)]
    ChunkStore(model, root / "kv", page_size=BS, memory_budget=1 << 24).add(chunks[:3])   # chunk 3: never built
    return root / "model", root / "kv", model, chunks


def _config(served, prefix_caching=False, parallel=None, **extra):
    """The connector's VllmConfig over ``served``'s model folder and chunk directory (its first two
    items); ``parallel``: vLLM's ParallelConfig (default: one rank); ``extra``: connector options."""
    folder, kv = served[:2]
    extra.setdefault("chunk_dir", str(kv))
    extra.setdefault("kv_split", "rows")
    extra.setdefault("quality_gate", "off")   # (the random model has no tokenizer: tests/vllm/test_gate_served.py)
    extra = {k: v for k, v in extra.items() if v is not None}
    return VllmConfig(
        model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=512),
        parallel_config=parallel or ParallelConfig(),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="RagattnConnector", kv_role="kv_consumer",
                                            kv_connector_module_path="ragattn.vllm.connector",
                                            kv_load_failure_policy="recompute", kv_connector_extra_config=extra))


def _kv_cache_config():
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=spec)])


def _scheduler(cfg):
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS   # what the engine sets after profiling
    return Scheduler(vllm_config=cfg, kv_cache_config=_kv_cache_config(),
                     structured_output_manager=StructuredOutputManager(cfg), block_size=BS)


_ids = iter(range(10 ** 6))


def _request(prompt, spans=None, salt=None, prefix_caching=False, method=None):
    extra = {"kv_transfer_params": {"ragattn_spans": [list(s) for s in spans]}} if spans is not None else None
    if method is not None:
        extra["kv_transfer_params"].update({"ragattn_method": method.name} |
                                           ({"ragattn_ratio": method.ratio} if method.recomputes else {}))
    hasher = None
    if prefix_caching:
        init_none_hash(sha256)
        hasher = get_request_block_hasher(BS, sha256)
    return Request(request_id=f"r{next(_ids)}", prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=4, extra_args=extra), pooling_params=None,
                   cache_salt=salt, block_hasher=hasher)


def _prompt(chunks, order, final=(3, 5, 8, 13, 21)):
    prompt, spans = [], []
    for i in order:
        spans.append((len(prompt), len(prompt) + len(chunks[i])))
        prompt += chunks[i]
    return prompt + list(final), spans


def _schedule(sched, *reqs):
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    return out, {load.req_id: load for load in out.kv_connector_metadata.loads}


def test_loads_by_module_path(served):
    cfg = _config(served)
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)
    # vLLM keeps its hybrid KV cache manager on for a SupportsHMA connector where the platform has
    # it (this CPU machine's does not); a connector without SupportsHMA raises here with it on
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config())
    assert isinstance(conn, RagattnConnector) and supports_hma(conn)


def test_claims(served):
    """Chunks at different offsets, a repeated chunk, a missing chunk, a fully cached prompt."""
    _, _, _, chunks = served
    sched = _scheduler(_config(served))
    cases = {
        "offsets": ((0, 1, 2), 36),       # 9 + 21 + 6 claimed; the question is vLLM's
        "repeat": ((2, 0, 2, 1), 42),     # chunk 2 at offsets 0 and 15
        "missing": ((0, 3, 1), 9),        # chunk 3 not in the store: stops after chunk 0
        "first_missing": ((3, 0), 0),
    }
    reqs = {}
    for name, (order, _) in cases.items():
        prompt, spans = _prompt(chunks, order)
        reqs[name] = _request(prompt, spans)
    full_prompt, full_spans = _prompt(chunks, (0, 1), final=())
    reqs["fully_cached"] = _request(full_prompt, full_spans)   # all cached: the last chunk is vLLM's
    out, loads = _schedule(sched, *reqs.values())
    computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    want = {**{n: c[1] for n, c in cases.items()}, "fully_cached": 9}
    for name, r in reqs.items():
        claimed = want[name]
        assert out.num_scheduled_tokens[r.request_id] == len(r.prompt_token_ids) - claimed, name
        assert computed[r.request_id] == claimed, name
        if claimed == 0:
            assert r.request_id not in loads
            continue
        load = loads[r.request_id]
        assert load.spans[-1][1] == claimed and load.skip == 0 and len(load.keys) == len(load.spans)
        blocks = sched.kv_cache_manager.get_block_ids(r.request_id)[0]
        assert load.block_ids == (list(blocks),)
    assert loads[reqs["repeat"].request_id].keys[0] == loads[reqs["repeat"].request_id].keys[2]


def test_composite_is_refused_under_a_sliding_window(served, monkeypatch):
    """TurboRAG composite's positions overlap: a window is by position (the HF path's rule) and vLLM
    windows by slot, so on a model whose window is shorter than the prompt the request is computed
    without cached chunks; Block-Attention's (positions = slots) is claimed as before."""
    from vllm.config import ModelConfig

    _, _, _, chunks = served
    monkeypatch.setattr(ModelConfig, "get_sliding_window", lambda self: 8)
    sched = _scheduler(_config(served))
    prompt, spans = _prompt(chunks, (0, 1))
    comp = _request(prompt, spans, method=MethodChoice("turborag-composite"))
    block = _request(prompt, spans)
    out, loads = _schedule(sched, comp, block)
    assert comp.request_id not in loads and out.num_scheduled_tokens[comp.request_id] == len(prompt)
    assert loads[block.request_id].spans[-1][1] == 30


def _worker(served, caches=None, **extra):
    cfg = _config(served, **extra)
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, _kv_cache_config())
    if caches is None:
        caches = {n: torch.full((NUM_BLOCKS, H, BS, 2 * D), float("nan")) for n in LAYERS}
    conn.register_kv_caches(caches)
    return conn, caches


def _read(caches, rows):
    """K, V [n, H, D] per layer at vLLM slots ``rows``, read as vLLM's CPU_ATTN backend does."""
    out = []
    for name in LAYERS:
        kv = caches[name]
        k, v = kv.view(NUM_BLOCKS, H, 2 * BS, D).chunk(2, dim=2)
        out.append((k.transpose(1, 2).reshape(-1, H, D)[rows], v.transpose(1, 2).reshape(-1, H, D)[rows]))
    return out


def test_start_load_kv_equals_assembled_request(served):
    """Scheduler metadata -> worker start_load_kv on CPU caches in vLLM's layout == the HF path's
    assembled request bit for bit; no other slot is touched."""
    _, kv_dir, model, chunks = served
    sched = _scheduler(_config(served))
    prompt, spans = _prompt(chunks, (2, 0, 2, 1))
    r = _request(prompt, spans)
    out, loads = _schedule(sched, r)
    conn, caches = _worker(served)
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(None)
    conn.wait_for_layer_load(LAYERS[0])
    conn.clear_connector_metadata()
    assert conn.get_block_ids_with_load_errors() == set()

    load = loads[r.request_id]
    store = ChunkStore(model, kv_dir, page_size=BS, read_only=True, memory_budget=1 << 24)
    req = store.assemble(list(load.keys), positions="reordered")
    n = load.spans[-1][1]
    ref_rows = req.cache.slot_rows(0, torch.arange(n))
    rows = slot_rows(load.block_ids[0], BS, 0, n)
    for l, (k, v) in enumerate(_read(caches, rows)):
        assert torch.equal(k, req.cache.k[l].reshape(-1, H, D)[ref_rows])
        assert torch.equal(v, req.cache.v[l].reshape(-1, H, D)[ref_rows])
    rest = torch.ones(NUM_BLOCKS * BS, dtype=torch.bool)
    rest[rows] = False
    for k, v in _read(caches, rest.nonzero()[:, 0]):
        assert k.isnan().all() and v.isnan().all()


def _load_with_a_truncated_chunk(conn, meta, kv_dir, key):
    """The worker's load of ``meta`` while chunk ``key``'s file is cut in half (restored after)."""
    victim = kv_dir / f"{key}.safetensors"
    saved = victim.read_bytes()
    victim.write_bytes(saved[: len(saved) // 2])       # truncated: corrupt
    try:
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
    finally:
        victim.write_bytes(saved)


def test_failed_load_writes_nothing_and_reports_blocks(served):
    """A chunk file gone between the claim and the load: the request's blocks are reported as
    failed loads (vLLM recomputes them) and its pages are left untouched, not half filled."""
    _, kv_dir, _, chunks = served
    sched = _scheduler(_config(served))
    prompt, spans = _prompt(chunks, (0, 1))
    r = _request(prompt, spans)
    out, loads = _schedule(sched, r)
    load = loads[r.request_id]
    conn, caches = _worker(served)
    _load_with_a_truncated_chunk(conn, out.kv_connector_metadata, kv_dir, load.keys[1])
    assert conn.get_block_ids_with_load_errors() == set(load.block_ids[0][:2])
    assert all(kv.isnan().all() for kv in caches.values())


def test_fingerprint_mismatch_is_refused(served, tmp_path):
    folder, _, _, _ = served
    other = tiny_causal_lm("llama", seed=1)          # same config, other weights
    ChunkStore(other, tmp_path / "kv", memory_budget=1 << 24).add([[1, 2, 3]])
    with pytest.raises(ChunkStoreError, match="fingerprint"):
        _worker(served, chunk_dir=str(tmp_path / "kv"))


def test_bad_setups_are_refused(served):
    with pytest.raises(CacheLayoutError, match="shape"):
        _worker(served, caches={n: torch.zeros(NUM_BLOCKS, H, BS, D) for n in LAYERS})
    with pytest.raises(CacheLayoutError, match="'rows' split"):
        _worker(served, caches={n: torch.zeros(NUM_BLOCKS, BS, H, 2 * D).transpose(1, 2) for n in LAYERS})
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config"):
        _worker(served, chunk_dri="x")
    with pytest.raises(ValueError, match="chunk_dir"):
        _worker(served, chunk_dir="")


def test_separator_spans(served, tmp_path):
    """Spans from a separator token the server is configured with (no kv_transfer_params)."""
    _, _, model, chunks = served
    sep = 210
    a, b = chunks[0] + [sep], chunks[2] + [sep]
    ChunkStore(model, tmp_path / "kv", page_size=BS, memory_budget=1 << 24).add([a, b])
    sched = _scheduler(_config(served, chunk_dir=str(tmp_path / "kv"), separator_token_id=sep))
    r = _request(a + b + a + [4, 6, 8])
    out, loads = _schedule(sched, r)
    assert loads[r.request_id].spans == ((0, 10), (10, 17), (17, 27))
    assert out.num_scheduled_tokens[r.request_id] == 3


def test_unknown_backend_layout_is_refused(served):
    """Without kv_split the layout comes from the attention backend: none known here."""
    with pytest.raises(CacheLayoutError, match="unsupported attention backend"):
        _worker(served, kv_split=None)


def test_prefix_cache_hit_is_not_rewritten(served, tmp_path):
    """Separator mode with prefix caching: a second request with the same chunks as an earlier
    one and another question (the server gives both the same salt) gets vLLM's own hit for their
    first block; the connector claims the rest of its spans and writes only those tokens, leaving
    the shared block alone."""
    _, _, model, chunks = served
    sep = 210
    a, b = chunks[1] + [sep], chunks[2] + [sep]                 # 22 and 7 tokens
    ChunkStore(model, tmp_path / "kv", page_size=BS, memory_budget=1 << 24).add([a, b])
    cfg = _config(served, prefix_caching=True, chunk_dir=str(tmp_path / "kv"), separator_token_id=sep)
    sched = _scheduler(cfg)
    first = _request(a + b + [4, 6, 8], prefix_caching=True)           # 32 tokens: 2 full blocks
    out1, loads1 = _schedule(sched, first)
    assert loads1[first.request_id].skip == 0 and loads1[first.request_id].spans[-1][1] == 29
    second = _request(a + b + [4, 5, 7, 9], prefix_caching=True)       # shares block 0 only
    out2, loads2 = _schedule(sched, second)
    assert second.cache_salt == first.cache_salt
    load = loads2[second.request_id]
    assert load.skip == BS and load.spans[-1][1] == 29
    assert out2.num_scheduled_tokens[second.request_id] == 33 - 29
    assert load.block_ids[0][0] == loads1[first.request_id].block_ids[0][0]    # the shared page

    conn, caches = _worker(served, chunk_dir=str(tmp_path / "kv"), separator_token_id=sep)
    conn.bind_connector_metadata(out2.kv_connector_metadata)
    conn.start_load_kv(None)
    store = ChunkStore(model, tmp_path / "kv", page_size=BS, read_only=True, memory_budget=1 << 24)
    req = store.assemble(list(load.keys), positions="reordered")
    ref_rows = req.cache.slot_rows(0, torch.arange(29))
    rows = slot_rows(load.block_ids[0], BS, 0, 29)
    for l, (k, v) in enumerate(_read(caches, rows)):
        assert k[:BS].isnan().all() and v[:BS].isnan().all()                  # vLLM's block: untouched
        assert torch.equal(k[BS:], req.cache.k[l].reshape(-1, H, D)[ref_rows][BS:])
        assert torch.equal(v[BS:], req.cache.v[l].reshape(-1, H, D)[ref_rows][BS:])


def test_importing_ragattn_does_not_import_vllm():
    import subprocess
    import sys

    code = ("import sys, ragattn, ragattn.vllm, ragattn.vllm.pages, ragattn.vllm.spans, ragattn.vllm.store, "
            "ragattn.methods; assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
