"""``RagattnConnector``: cached-chunk KV reuse inside vLLM (a KV connector): Block-Attention,
TurboRAG and, on ragattn's attention backend, CacheBlend and FusionRAG, chosen per request.

    vllm serve <model> --no-enable-prefix-caching --kv-transfer-config '{"kv_connector": "RagattnConnector",
        "kv_connector_module_path": "ragattn.vllm.connector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"chunk_dir": "kv/"}}'

Scheduler side: finds the chunk spans of a prompt (``kv_transfer_params["ragattn_spans"]`` of
the request, or the ``separator_token_id`` configured), looks each chunk up in the chunk
store's directory and claims the prompt tokens up to the end of the last span whose chunks are
all cached (:func:`ragattn.vllm.spans.plan_claim`: never the whole prompt); the request's block
ids (every KV cache group's) go to the worker in the step's metadata. Worker side:
:class:`~ragattn.vllm.pages.PageWriter` writes those chunks' K/V into vLLM's own cache tensors at
the request's slots, keys re-rotated to their real positions (and quantised with the layers'
``_k_scale``/``_v_scale`` for fp8 caches), with one ``copy_kv_`` per KV cache group before the
forward; for CacheBlend and FusionRAG the chosen chunk tokens are then recomputed by the served
model (:mod:`ragattn.vllm.recompute`) and their positions returned with the answer; saves are
no-ops. A ``SupportsHMA`` connector: under vLLM's hybrid KV cache manager
each full-attention or sliding-window group is written with its own blocks (a sliding group's
null blocks, outside the window, never). Options (``kv_connector_extra_config``) are listed in
:data:`OPTIONS`; see docs/vllm.md.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ragattn.store import ChunkStore, ChunkStoreError, RemoteTier, chunk_key
from ragattn.vllm.pages import (BACKEND_KV_SPLIT, CPU_ATTN_ISA_KV_SPLIT, FP8_STORAGE, KV_SPLITS, NULL_BLOCK,
                                CacheLayoutError, PageWriter)
from ragattn.vllm.spans import (METHOD_PARAM, RATIO_PARAM, RECOMPUTED_PARAM, SPANS_PARAM, NO_CLAIM, Claim,
                                MethodChoice, ParamError, SpanError, composite_positions, layer_index,
                                method_from_params, plan_claim, separator_salt, span_salt, spans_from_params,
                                spans_from_separator)
from ragattn.vllm.platform import enabled as ragattn_attention
from ragattn.vllm.recompute import Recomputed, Recomputer, RecomputeError, RecomputeRequest
from ragattn.vllm import shared_pages
from ragattn.vllm.shared_pages import ChunkPagePool, SharedEntries
from ragattn.vllm.store import check_directory_fingerprint, served_chunk_model

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# kv_connector_extra_config keys
OPTIONS = {
    "chunk_dir": "directory of the chunk store (ChunkStore files built offline for this model); required",
    "separator_token_id": "token id that ends every chunk (spans from the prompt itself); optional",
    "spans_param": f"kv_transfer_params key holding [[start, end], ...] (default {SPANS_PARAM!r})",
    "hf_model": "HF model folder the store was built from (default: the served model's folder)",
    "memory_budget": "bytes of chunk K/V the worker keeps in host memory (default: ChunkStore's)",
    "remote": "redis:// or rediss:// URL of the fleet's shared chunk tier (ragattn.store.remote_tier); optional",
    "remote_secret": "its HMAC key (default: the RAGATTN_REMOTE_SECRET environment variable)",
    "kv_split": f"one of {KV_SPLITS}: where K and V sit in a cache block (default: from the attention backend)",
    "shared_pages": "true: each chunk's K/V held once in vLLM's KV cache and read by every request using it "
                    "(ragattn.vllm.shared_pages; ragattn's backend; Block-Attention, TurboRAG and FusionRAG, whose "
                    "recomputed rows each request holds in its own blocks); default false",
}


# vLLM kv_cache_dtype values the connector writes: the model's dtype, or fp8 e4m3 with per-tensor scales
PLAIN_CACHE_DTYPES = ("auto", "float16", "half", "bfloat16", "float", "float32")
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")


@dataclass
class RequestLoad:
    """One request's load: chunks ``keys`` at prompt ranges ``spans``, the request's blocks (one
    list per KV cache group, in vLLM's group order), ``skip`` tokens vLLM already holds (its own
    prefix-cache hit), its ``method`` and, for the methods that recompute, its ``prompt`` ids."""
    req_id: str
    keys: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    block_ids: tuple[list[int], ...]
    skip: int
    method: MethodChoice = MethodChoice()
    prompt: tuple[int, ...] = ()
    chunk_blocks: tuple[list[int], ...] | None = None   # shared chunk pages (one list per chunk), or None


@dataclass
class RagattnConnectorMetadata(KVConnectorMetadata):
    loads: list[RequestLoad] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)     # chunks whose shared pages were freed


@dataclass
class RagattnWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the prompt positions each request recomputed; the
    requests now read from shared chunk pages (``(first, block ids)``: the blocks to give back,
    from its block ``first`` on: the ones before hold its recomputed rows); the chunks whose
    shared pages could not be written."""
    recomputed: dict[str, list[int]] = field(default_factory=dict)
    shared: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    failed_chunks: list[str] = field(default_factory=list)

    def aggregate(self, other: "RagattnWorkerMetadata") -> "RagattnWorkerMetadata":
        return RagattnWorkerMetadata({**self.recomputed, **other.recomputed}, {**self.shared, **other.shared},
                                     self.failed_chunks + other.failed_chunks)


def cache_groups(kv_cache_config: "KVCacheConfig") -> list[tuple[list[str], bool, int]]:
    """``(layer names, sliding window?, block size)`` of each of vLLM's KV cache groups; refuses
    groups the connector cannot write (MLA, Mamba, chunked-local, cross attention, quantisation
    other than fp8 per-tensor, groups vLLM rebuilds itself after a load)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, SlidingWindowSpec

    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        where = f"KV cache group {i} ({len(g.layer_names)} layers: {g.layer_names[0]}, ...)"
        if type(spec) is SlidingWindowSpec:
            sliding = True
        elif type(spec) is FullAttentionSpec and spec.attention_chunk_size is None:
            sliding = False   # (a sliding layer under the non-hybrid manager too: every token has a block)
        else:
            raise NotImplementedError(f"ragattn.vllm: {where} is a {type(spec).__name__}: the connector writes "
                                      "full-attention and sliding-window attention groups only")
        if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
            raise NotImplementedError(f"ragattn.vllm: {where} has KV cache quantisation {spec.kv_quant_mode.name}; "
                                      "the connector writes unquantised or fp8 per-tensor caches only")
        if not g.enable_kv_transfer:
            raise NotImplementedError(f"ragattn.vllm: {where} is not a KV transfer group")
        out.append((list(g.layer_names), sliding, int(spec.block_size)))
    return out


class RagattnConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. Supports vLLM's hybrid KV cache manager (``SupportsHMA``:
    full-attention and sliding-window groups, each with its block table) and fp8 e4m3 KV caches
    (``kv_cache_dtype`` ``fp8``/``fp8_e4m3``, per-layer or per-head scales). Not supported: tensor
    or pipeline parallelism (one worker holds every KV head and layer), other quantised caches,
    MLA or Mamba layers."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        unknown = set(cfg.kv_connector_extra_config) - set(OPTIONS)
        if unknown:
            raise ValueError(f"ragattn.vllm: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(OPTIONS)}")
        chunk_dir = cfg.get_from_extra_config("chunk_dir", None)
        if not chunk_dir:
            raise ValueError("ragattn.vllm: kv_connector_extra_config needs 'chunk_dir' (the chunk store directory)")
        self._dir = Path(chunk_dir)
        if not self._dir.is_dir():
            raise ChunkStoreError(f"ragattn.vllm: chunk_dir {self._dir} is not a directory")
        if vllm_config.parallel_config.tensor_parallel_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise NotImplementedError("ragattn.vllm: tensor/pipeline parallelism is not supported yet "
                                      "(a worker would need its share of the KV heads or layers)")
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype not in PLAIN_CACHE_DTYPES + FP8_CACHE_DTYPES:
            raise NotImplementedError(f"ragattn.vllm: kv_cache_dtype {cache_dtype!r} is not supported; the connector "
                                      f"writes caches in the model's dtype or {' / '.join(FP8_CACHE_DTYPES)} "
                                      "(float8_e4m3fn with per-tensor scales)")
        # (layer names, sliding window?, block size) per KV cache group; [] without a KV cache config
        self._groups = cache_groups(kv_cache_config) if getattr(kv_cache_config, "kv_cache_groups", None) else []
        self._sep = cfg.get_from_extra_config("separator_token_id", None)
        self._spans_param = cfg.get_from_extra_config("spans_param", SPANS_PARAM)
        self._block_size = self._groups[0][2] if self._groups else vllm_config.cache_config.block_size
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        mc = vllm_config.model_config
        window = mc.get_sliding_window()   # (Qwen2 carries one it does not use)
        self._window = int(window) if window and getattr(mc.hf_text_config, "use_sliding_window", True) else None
        self._shared = _flag(cfg.get_from_extra_config("shared_pages", False), "shared_pages")
        if self._shared:
            why = ("ragattn's attention backend is not on (RAGATTN_VLLM_ATTENTION=1)" if not ragattn_attention() else
                   "vLLM's prefix cache is on" if self._prefix_caching else
                   f"kv_cache_dtype is {cache_dtype}" if cache_dtype in FP8_CACHE_DTYPES else
                   "the model has several KV cache groups or a sliding window"
                   if len(self._groups) > 1 or any(sl for _, sl, _ in self._groups) or self._window else None)
            if why:
                raise ValueError(f"ragattn.vllm: shared_pages needs ragattn's attention backend, one full-attention KV "
                                 f"cache group of unquantised caches and vLLM's prefix cache off: {why}")
        self._pool: ChunkPagePool | None = None     # scheduler side, at bind_kv_cache_manager
        self._kv_manager = None
        hf_path = cfg.get_from_extra_config("hf_model", None) or mc.model
        self._chunk_model = served_chunk_model(hf_path, mc.dtype)
        self.fingerprint = self._chunk_model.fingerprint
        check_directory_fingerprint(self._dir, self.fingerprint)
        # the fleet's shared tier: the scheduler claims chunks it holds, the worker's store reads them
        self._remote = None
        remote_url = cfg.get_from_extra_config("remote", None)
        if remote_url:
            secret = cfg.get_from_extra_config("remote_secret", None) or os.environ.get("RAGATTN_REMOTE_SECRET")
            self._remote = RemoteTier(str(remote_url), secret)
        # scheduler side
        self._claims: dict[str, tuple[Claim, int, MethodChoice]] = {}   # claim, vLLM's own hit, method
        self._pending: dict[str, tuple[Claim, int, MethodChoice]] = {}
        self._recomputed: dict[str, list[int]] = {}   # reported by the worker, returned with the answer
        self._can_recompute = ragattn_attention()   # the recompute runs on ragattn's backend and worker
        # worker side
        self._store: ChunkStore | None = None
        self._writer: PageWriter | None = None
        self._recomputer = None
        self._failed_blocks: set[int] = set()
        self._done: dict[str, list[int]] = {}
        self._written: dict[str, tuple[int, ...]] = {}   # chunk -> the shared pages holding it
        self._shared_done: dict[str, list[int]] = {}
        self._failed_chunks: list[str] = []
        if role == KVConnectorRole.WORKER:
            budget = cfg.get_from_extra_config("memory_budget", None)
            # the store lives on the CPU (chunk K/V in host memory, staged to the caches' device) and
            # only serves chunk files (ragattn.vllm.store)
            self._store = ChunkStore(self._chunk_model, self._dir, page_size=self._block_size, read_only=True,
                                     memory_budget=None if budget is None else int(budget), remote=self._remote)

    # ----- scheduler side ---------------------------------------------------------------
    def _spans(self, request: "Request", method: MethodChoice):
        """(spans or None, the cache_salt they need under prefix caching)."""
        tokens = request.prompt_token_ids or []
        spans = spans_from_params(request.kv_transfer_params, len(tokens), self._spans_param)
        if spans is not None:
            return spans, span_salt(spans, method, tokens)
        if self._sep is not None:
            return spans_from_separator(tokens, int(self._sep)), separator_salt(int(self._sep), method, tokens)
        return None, None

    def _claim(self, request: "Request", num_computed_tokens: int) -> tuple[Claim, MethodChoice]:
        tokens = request.prompt_token_ids or []
        try:
            method = method_from_params(request.kv_transfer_params)
            spans, salt = self._spans(request, method)
        except (SpanError, ParamError) as exc:
            log.warning("request %s: %s; computing it without cached chunks", request.request_id, exc)
            return NO_CLAIM, MethodChoice()
        if not spans:
            return NO_CLAIM, method
        if method.name == "turborag-composite" and self._window is not None and self._window < len(tokens):
            # composite positions overlap (every chunk from 0); a window is by position (ragattn.kv.window), vLLM's by slot
            log.warning("request %s: turborag-composite on a model with a %d-token sliding window shorter than the "
                        "prompt: the window would cut by slot, not by position; computing it without cached chunks",
                        request.request_id, self._window)
            return NO_CLAIM, method
        if method.recomputes and not self._can_recompute:
            log.warning("request %s: %s recomputes with ragattn's attention backend, which this server does not "
                        "run (RAGATTN_VLLM_ATTENTION=1): computing it without cached chunks",
                        request.request_id, method.name)
            return NO_CLAIM, method
        if self._prefix_caching and request.cache_salt != salt:
            log.warning("request %s: vLLM's prefix cache is on and the request's cache_salt is not %r "
                        "(docs/vllm.md): computing it without cached chunks (its approximate pages would "
                        "otherwise be served as an exact prefix)", request.request_id, salt)
            return NO_CLAIM, method
        fp = self.fingerprint
        claim = plan_claim(tokens, spans, lambda t: chunk_key(fp, t), self._has_chunk)
        if method.recomputes and 0 < num_computed_tokens < claim.num_tokens:
            # vLLM's own hit ends inside the chunks: its pages are shared, the recompute would write them
            log.warning("request %s: vLLM's prefix cache holds %d of its %d claimed tokens; %s recomputes "
                        "rows of the whole claim, so the rest is computed without cached chunks",
                        request.request_id, num_computed_tokens, claim.num_tokens, method.name)
            return NO_CLAIM, method
        if method.name == "fusionrag" and len(claim.keys) > 1:   # each chunk's fused cache where the store has one
            from ragattn.methods.fusionrag import fused_variant
            from ragattn.store.fingerprint import variant_key

            variant = fused_variant(tokens[claim.spans[0][0]:claim.spans[0][1]])
            fused = [variant_key(fp, k, variant) for k in claim.keys[1:]]
            claim = Claim(claim.spans, claim.keys[:1] + tuple(f if self._has_chunk(f) else k
                                                             for f, k in zip(fused, claim.keys[1:])))
        return claim, method

    def _has_chunk(self, key: str) -> bool:
        return (self._dir / f"{key}.safetensors").is_file() or (self._remote is not None and self._remote.contains(key))

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._shared:
            self._kv_manager = kv_cache_manager
            self._pool = ChunkPagePool(kv_cache_manager.block_pool, self._block_size)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._pool is not None:   # idle chunk pages make room for the request's own blocks first
            need = -(-len(request.prompt_token_ids or ()) // self._block_size)
            short = need - self._pool.block_pool.get_num_free_blocks()
            if short > 0:
                self._pool.evict(short)
        claim, method = self._claim(request, num_computed_tokens)
        self._claims[request.request_id] = (claim, num_computed_tokens, method)
        return max(0, claim.num_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens <= 0:
            self._claims.pop(request.request_id, None)
            return
        claim, local, method = self._claims.pop(request.request_id)
        if local + num_external_tokens != claim.num_tokens:
            # vLLM trimmed the claim (only DeepSeek's sliding-window replay does): the pages of
            # exactly [local, local + num_external_tokens) would have to be written
            raise RuntimeError(f"ragattn.vllm: request {request.request_id}: vLLM took {num_external_tokens} of "
                               f"the {claim.num_tokens - local} claimed tokens; partial claims are not supported")
        prompt = tuple(request.prompt_token_ids or ()) if method.recomputes else ()
        chunk_blocks = None
        if self._pool is not None and method.name != "cacheblend" and local == 0:
            chunk_blocks = self._pool.acquire(request.request_id, claim.keys, [e - s for s, e in claim.spans])
        self._pending[request.request_id] = (claim, local, method, prompt, chunk_blocks)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = RagattnConnectorMetadata(evicted=self._pool.take_evicted() if self._pool is not None else [])
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._pending:
                claim, skip, method, prompt, chunks = self._pending.pop(req.req_id)
                meta.loads.append(RequestLoad(req.req_id, claim.keys, claim.spans, _lists(req.block_ids), skip,
                                              method, prompt, chunks))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._pending and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                claim, skip, method, prompt, chunks = self._pending.pop(req_id)
                meta.loads.append(RequestLoad(req_id, claim.keys, claim.spans, _lists(cached.new_block_ids[i]), skip,
                                              method, prompt, chunks))
        return meta

    def update_connector_output(self, connector_output) -> None:
        worker = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker, RagattnWorkerMetadata):
            self._recomputed.update(worker.recomputed)
            if self._pool is not None:
                for key in worker.failed_chunks:
                    self._pool.drop(key)
                for req_id, (first, block_ids) in worker.shared.items():
                    self._pool.give_back(self._kv_manager, req_id, block_ids, first)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing is saved (the blocks are freed at once); a request the worker recomputed rows
        of gets them in its output's ``kv_transfer_params`` (``ragattn_recomputed``: prompt positions)."""
        self._claims.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        if self._pool is not None:
            self._pool.release(request.request_id)
        rows = self._recomputed.pop(request.request_id, None)
        if rows is None:
            return False, None
        params = request.kv_transfer_params or {}
        return False, {METHOD_PARAM: params.get(METHOD_PARAM), RATIO_PARAM: method_from_params(params).ratio,
                       RECOMPUTED_PARAM: rows}

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: called instead of :meth:`request_finished`; nothing is saved, so the
        blocks are freed at once."""
        return self.request_finished(request, [])

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """Every group: the load writes each group's own blocks (sliding-window groups included),
        not only the prefix-cacheable ones vLLM assumes by default."""
        return tuple(range(len(self._groups))) if self._groups else super().get_loaded_kv_cache_group_ids(request)

    # ----- worker side ------------------------------------------------------------------
    def _attn_layers(self) -> dict:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        return get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase)

    def _kv_split(self) -> str:
        """The cache layout of the attention backend (and, for CPU_ATTN, of its ISA); an unknown one
        is refused (CacheLayoutError at start-up) unless ``kv_split`` names it."""
        split = self._kv_transfer_config.get_from_extra_config("kv_split", None)
        if split is not None:
            return split
        layers = self._attn_layers().values()
        # a backend that declares its layout (ragattn's: RagattnAttentionBackend.kv_split); the probe checks it
        declared = {getattr(layer.get_attn_backend(), "kv_split", None) for layer in layers}
        if len(declared) == 1 and next(iter(declared)) in KV_SPLITS:
            return next(iter(declared))
        names = {layer.get_attn_backend().get_name() for layer in layers}
        name = next(iter(names)) if len(names) == 1 else None
        if name == "CPU_ATTN":
            isas = {getattr(layer, "isa", None) for layer in layers}
            isa = next(iter(isas)) if len(isas) == 1 else None
            if isa not in CPU_ATTN_ISA_KV_SPLIT:
                raise CacheLayoutError(f"ragattn.vllm: vLLM's CPU attention backend uses the ISA(s) {sorted(map(str, isas))}, "
                                       f"whose KV cache layout the writer does not know (known: "
                                       f"{sorted(CPU_ATTN_ISA_KV_SPLIT)})")
            return CPU_ATTN_ISA_KV_SPLIT[isa]
        if name not in BACKEND_KV_SPLIT:
            raise CacheLayoutError(f"ragattn.vllm: unsupported attention backend(s) {sorted(names)} (known cache "
                                   f"layouts: {sorted(BACKEND_KV_SPLIT) + ['CPU_ATTN']}); set kv_connector_extra_config "
                                   "'kv_split' if the backend stores K/V like one of them")
        return BACKEND_KV_SPLIT[name]

    def _fp8_scales(self, names: list[str], kv_caches: dict[str, torch.Tensor]):
        """Per layer ``(layer._k_scale, layer._v_scale)`` (the tensors themselves, read at each
        write) for the fp8 caches among ``kv_caches``, None for the others; None if none is fp8."""
        if not any(kv_caches[n].dtype in FP8_STORAGE for n in names):
            return None
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.platforms import current_platform

        if current_platform.fp8_dtype() != torch.float8_e4m3fn:
            raise CacheLayoutError(f"ragattn.vllm: this platform's fp8 KV cache type is {current_platform.fp8_dtype()}; "
                                   "the connector writes float8_e4m3fn caches only")
        layers = get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase, names)
        out = []
        for n in names:
            if kv_caches[n].dtype not in FP8_STORAGE:
                out.append(None)
                continue
            layer = layers.get(n)
            kind = getattr(layer, "kv_cache_dtype", None)
            if kind not in FP8_CACHE_DTYPES or not hasattr(layer, "_k_scale"):
                raise CacheLayoutError(f"ragattn.vllm: layer {n}'s KV cache is {kv_caches[n].dtype} with kv_cache_dtype "
                                       f"{kind!r}; the connector writes fp8 caches of kv_cache_dtype "
                                       f"{' / '.join(FP8_CACHE_DTYPES)} (e4m3 with the layer's _k_scale/_v_scale) only")
            out.append((layer._k_scale, layer._v_scale))
        return out

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = sorted(kv_caches, key=layer_index)
        groups = None
        if self._groups:
            grouped = [n for layers, _, _ in self._groups for n in layers]
            if sorted(grouped) != sorted(names):
                raise CacheLayoutError(f"ragattn.vllm: the KV cache groups name layers {sorted(grouped)}, the worker's "
                                       f"caches are {sorted(names)}")
            pos = {n: i for i, n in enumerate(names)}
            groups = [([pos[n] for n in layers], sliding, bs) for layers, sliding, bs in self._groups]
        split = self._kv_split()
        self._check_layout(names[0], kv_caches[names[0]], split)
        self._writer = PageWriter(self._store, [kv_caches[n] for n in names], self._block_size, split,
                                  groups=groups, scales=self._fp8_scales(names, kv_caches))
        if self._shared:   # ragattn's backend reads the chunk pages with the model's RoPE
            shared_pages.ROPE[:] = [self._store.rope]
        self._recomputer = self._make_recomputer(names, kv_caches)

    def _make_recomputer(self, names: list[str], kv_caches: dict[str, torch.Tensor]):
        """The recompute over these caches where ragattn's backend serves them (one group), else None."""
        from ragattn.vllm.backend import RagattnAttentionImpl

        layers = self._attn_layers()
        impls = [getattr(layers.get(n), "impl", None) for n in names]
        if len(self._groups) > 1 or not all(isinstance(i, RagattnAttentionImpl) for i in impls):
            return None
        return Recomputer(self._vllm_config, names, [kv_caches[n] for n in names], impls[0].head_size,
                          impls[0].scale)

    def _check_layout(self, name: str, kv: torch.Tensor, split: str) -> None:
        """Start-up proof that ``split`` is where the backend keeps K and V: the backend's own cache
        write (``impl.do_kv_cache_update``) stores known K/V in a two-block copy of layer ``name``'s
        cache and the writer's views must read them back exactly; CacheLayoutError otherwise (a
        layout the writer does not know is refused before any chunk is written). Backends without
        that method (and fp8 caches) rest on the layout table alone."""
        layer = self._attn_layers().get(name)
        update = getattr(getattr(layer, "impl", None), "do_kv_cache_update", None)
        if update is None or kv.dtype in FP8_STORAGE or kv.dim() < 3 or kv.shape[0] < 2:
            return
        from ragattn.vllm.pages import head_views

        H, D, n = self._store.num_kv_heads, self._store.head_dim, kv.shape[2]
        scratch = torch.zeros_like(kv[:2])
        slots = torch.arange(max(0, n - 3), min(2 * n, n + 3))   # across the block boundary
        g = torch.Generator().manual_seed(0)
        key = torch.randn(len(slots), H, D, generator=g).to(kv.dtype).to(kv.device)
        value = torch.randn(len(slots), H, D, generator=g).to(kv.dtype).to(kv.device)
        try:
            with torch.inference_mode():
                update(layer, key, value, scratch, slots.to(kv.device))
        except Exception as exc:   # (a layer the engine has not set up: no ISA, no scales)
            log.warning("ragattn.vllm: cannot probe the KV cache layout of %s (%s); trusting the %r layout",
                        name, exc, split)
            return
        ks, vs = head_views(scratch, H, D, n, split)
        blk, off = slots // n, slots % n
        for h in range(H):
            if not (torch.equal(ks[h][blk, off, 0], key[:, h]) and torch.equal(vs[h][blk, off, 0], value[:, h])):
                backend = layer.get_attn_backend().get_name()
                raise CacheLayoutError(f"ragattn.vllm: the attention backend {backend} (ISA "
                                       f"{getattr(layer, 'isa', None)}) does not store K/V where the writer's "
                                       f"{split!r} layout puts them (start-up probe of {name}, head {h}): refused, "
                                       "nothing would be read back right")
        log.info("ragattn.vllm: KV cache layout %r checked against %s's own cache write", split,
                 layer.get_attn_backend().get_name())

    def _claimed_blocks(self, load: RequestLoad) -> set[int]:
        """The blocks a load writes (every group's, from vLLM's hit on; never a null block)."""
        out = set()
        for (_, sliding, bs), ids in zip(self._groups or [([], False, self._block_size)], load.block_ids):
            out |= {b for b in ids[load.skip // bs: -(-load.spans[-1][1] // bs)] if not (sliding and b == NULL_BLOCK)}
        return out

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Writes every claimed request's chunks (all layers at once) before the forward. A
        request whose chunks cannot all be loaded (unknown, foreign or corrupt file) is written
        not at all: its blocks are reported by :meth:`get_block_ids_with_load_errors`."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, RagattnConnectorMetadata)
        if meta.loads and self._writer is None:
            raise RuntimeError("ragattn.vllm: start_load_kv before register_kv_caches")
        for key in meta.evicted:
            self._written.pop(key, None)
        for load in meta.loads:
            shared_pages.REQUESTS.pop(load.req_id, None)
            try:
                rotate_to = (torch.tensor(composite_positions(load.spans), dtype=torch.int64)
                             if load.method.name == "turborag-composite" else None)
                if load.chunk_blocks is not None and self._load_shared(load, rotate_to):
                    continue
                with torch.inference_mode():
                    self._writer.write(load.keys, load.spans, load.block_ids, load.skip, rotate_to=rotate_to)
                if load.method.recomputes:
                    self._done[load.req_id] = self._recompute(load).positions
            except (ChunkStoreError, OSError, RecomputeError) as exc:
                failed = self._claimed_blocks(load)
                log.error("ragattn.vllm: request %s: cannot load its chunks (%s); blocks %s are reported "
                          "as failed loads", load.req_id, exc, sorted(failed))
                self._failed_blocks |= failed

    def _load_shared(self, load: RequestLoad, rotate_to: torch.Tensor | None) -> bool:
        """Serves the request from shared chunk pages: writes the chunks not in their pages yet
        (keys page-local), copies the claim's last partial block into the request's own block,
        recomputes FusionRAG's rows into its own blocks and registers its entries for ragattn's
        backend. False (the copy path follows) if a chunk cannot be loaded: that chunk's pages are
        reported and never read. RecomputeError: nothing registered (the load fails)."""
        bs = self._block_size
        try:
            with torch.inference_mode():
                for key, blocks, (s, e) in zip(load.keys, load.chunk_blocks, load.spans):
                    if self._written.get(key) != tuple(blocks):
                        self._written.pop(key, None)
                        self._writer.write_chunk_pages(key, blocks, e - s)
                        self._written[key] = tuple(blocks)
                end = load.spans[-1][1]
                tail = end // bs * bs
                if tail < end:
                    self._writer.write(load.keys, load.spans, load.block_ids, tail, rotate_to=rotate_to)
        except (ChunkStoreError, OSError) as exc:
            failed = [k for k in load.keys if k not in self._written]
            log.warning("ragattn.vllm: request %s: chunk pages of %s not written (%s); copying its chunks instead",
                        load.req_id, failed, exc)
            self._failed_chunks += failed
            return False
        if load.method.recomputes:
            done = self._recompute(load, shared=True)
            self._done[load.req_id] = done.positions
        else:
            done = Recomputed([], SharedEntries.build(load.spans, load.chunk_blocks, bs, rotate_to))
        shared_pages.REQUESTS[load.req_id] = done.entries
        self._shared_done[load.req_id] = (done.held, list(load.block_ids[0][done.held:tail // bs]))
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id in finished_req_ids:
            shared_pages.REQUESTS.pop(req_id, None)
        return None, None

    def _recompute(self, load: RequestLoad, shared: bool = False) -> Recomputed:
        """CacheBlend / FusionRAG on the request's pages, or (``shared``) over its shared chunk
        pages (ragattn.vllm.recompute)."""
        if self._recomputer is None:
            raise RecomputeError(f"ragattn.vllm: {load.method.name} needs ragattn's attention backend on one KV "
                                 "cache group (RAGATTN_VLLM_ATTENTION=1)")
        return self._recomputer.run(RecomputeRequest(load.method.name, load.method.ratio, load.prompt, load.spans,
                                                     load.block_ids[0], self._groups[0][2] if self._groups
                                                     else self._block_size,
                                                     load.chunk_blocks if shared else None))

    def build_connector_worker_meta(self) -> RagattnWorkerMetadata | None:
        if not (self._done or self._shared_done or self._failed_chunks):
            return None
        meta = RagattnWorkerMetadata(self._done, self._shared_done, self._failed_chunks)
        self._done, self._shared_done, self._failed_chunks = {}, {}, []
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return   # start_load_kv wrote every layer synchronously

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return   # chunks are built offline (ChunkStore.add); nothing is saved from vLLM

    def wait_for_save(self):
        return


def _flag(value, name: str) -> bool:
    """A boolean option (JSON true/false)."""
    if not isinstance(value, bool):
        raise ValueError(f"ragattn.vllm: kv_connector_extra_config {name!r} must be true or false, got {value!r}")
    return value


def _lists(block_ids) -> tuple[list[int], ...]:
    """vLLM's per-group block ids (a tuple of lists) as plain lists."""
    return tuple(list(ids) for ids in block_ids)


__all__ = ["RagattnConnector", "RagattnConnectorMetadata", "RequestLoad", "OPTIONS", "span_salt", "separator_salt"]
