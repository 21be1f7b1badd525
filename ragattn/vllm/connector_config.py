"""What both sides of :class:`ragattn.vllm.connector.RagattnConnector` share: its options, the
settings read from vLLM's config, the metadata passed between them and vLLM's KV cache groups.

    settings = Settings(vllm_config, kv_transfer_config, kv_cache_config)   # checks every option
    settings.dir, settings.groups, settings.block_size, settings.shared, settings.chunk_model, ...
    RagattnConnectorMetadata(loads=[RequestLoad(...)], evicted=[...])        # scheduler -> worker
    RagattnWorkerMetadata(recomputed, shared, failed_chunks)                 # worker -> scheduler
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, SlidingWindowSpec

from ragattn.store import ChunkStoreError, RemoteTier
from ragattn.vllm.gate import mode_option
from ragattn.vllm.platform import enabled as ragattn_attention
from ragattn.vllm.pages import KV_SPLITS
from ragattn.vllm.parallel import recompute_refusal
from ragattn.vllm.spans import SPANS_PARAM, MethodChoice
from ragattn.vllm.store import check_directory_fingerprint, served_chunk_model

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

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
    "quality_gate": "'warn' (default): methods that fail ragattn's quality gate on this model at start-up are "
                    "refused by name (full attention); 'refuse': the server does not start; 'off' "
                    "(ragattn.vllm.gate)",
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
    # requests whose load failed on some worker: every worker forgets their shared entries (pipeline stages
    # cannot agree on a load before the forward: ragattn.vllm.parallel)
    dropped: list[str] = field(default_factory=list)


@dataclass
class RagattnWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the prompt positions each request recomputed; the
    requests now read from shared chunk pages (``(first, block ids)``: the blocks to give back,
    from its block ``first`` on: the ones before hold its recomputed rows); the chunks whose
    shared pages could not be written; the requests whose load failed (their claimed blocks,
    which vLLM recomputes exactly)."""
    recomputed: dict[str, list[int]] = field(default_factory=dict)
    shared: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    failed_chunks: list[str] = field(default_factory=list)
    failed: dict[str, list[int]] = field(default_factory=dict)

    def aggregate(self, other: "RagattnWorkerMetadata") -> "RagattnWorkerMetadata":
        """Both workers' reports; a request whose load failed on either is not reported as read from
        shared pages (a pipeline stage that wrote it while another failed: vLLM recomputes its
        blocks, which must not be given back)."""
        failed = {**self.failed, **other.failed}
        shared = {r: v for r, v in {**self.shared, **other.shared}.items() if r not in failed}
        return RagattnWorkerMetadata({**self.recomputed, **other.recomputed}, shared,
                                     self.failed_chunks + other.failed_chunks, failed)


def cache_groups(kv_cache_config: "KVCacheConfig") -> list[tuple[list[str], bool, int]]:
    """``(layer names, sliding window?, block size)`` of each of vLLM's KV cache groups; refuses
    groups the connector cannot write (MLA, Mamba, chunked-local, cross attention, quantisation
    other than fp8 per-tensor, groups vLLM rebuilds itself after a load)."""
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


class Settings:
    """The connector's settings, checked: ``dir`` (the chunk store directory), ``groups`` (``(layer
    names, sliding window?, block size)`` per KV cache group; [] without a KV cache config),
    ``block_size``, ``sep`` / ``spans_param`` (where a prompt's spans come from),
    ``prefix_caching``, ``window`` (the model's sliding window or None), ``shared`` (shared chunk
    pages), ``chunk_model`` and its ``fingerprint``, ``hf_path`` (the HF checkpoint), ``gate_mode``
    (the quality gate's mode: ragattn.vllm.gate), ``remote`` (the fleet's tier or None),
    ``memory_budget``, ``kv_split`` (None: from the attention backend), ``no_recompute`` (why
    CacheBlend and FusionRAG cannot run under this parallel layout, or None), ``pipeline`` (the
    pipeline stages)."""

    def __init__(self, vllm_config: "VllmConfig", kv_transfer_config, kv_cache_config: "KVCacheConfig"):
        cfg = kv_transfer_config
        unknown = set(cfg.kv_connector_extra_config) - set(OPTIONS)
        if unknown:
            raise ValueError(f"ragattn.vllm: unknown kv_connector_extra_config keys {sorted(unknown)}; "
                             f"known: {sorted(OPTIONS)}")
        chunk_dir = cfg.get_from_extra_config("chunk_dir", None)
        if not chunk_dir:
            raise ValueError("ragattn.vllm: kv_connector_extra_config needs 'chunk_dir' (the chunk store directory)")
        self.dir = Path(chunk_dir)
        if not self.dir.is_dir():
            raise ChunkStoreError(f"ragattn.vllm: chunk_dir {self.dir} is not a directory")
        # tensor parallel: each worker writes its KV heads; pipeline parallel: each stage its layers, no recompute
        self.no_recompute = recompute_refusal(vllm_config.parallel_config)
        self.pipeline = int(vllm_config.parallel_config.pipeline_parallel_size)
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype not in PLAIN_CACHE_DTYPES + FP8_CACHE_DTYPES:
            raise NotImplementedError(f"ragattn.vllm: kv_cache_dtype {cache_dtype!r} is not supported; the connector "
                                      f"writes caches in the model's dtype or {' / '.join(FP8_CACHE_DTYPES)} "
                                      "(float8_e4m3fn with per-tensor scales)")
        # (layer names, sliding window?, block size) per KV cache group; [] without a KV cache config
        self.groups = cache_groups(kv_cache_config) if getattr(kv_cache_config, "kv_cache_groups", None) else []
        self.sep = cfg.get_from_extra_config("separator_token_id", None)
        self.spans_param = cfg.get_from_extra_config("spans_param", SPANS_PARAM)
        self.block_size = self.groups[0][2] if self.groups else vllm_config.cache_config.block_size
        self.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        mc = vllm_config.model_config
        window = mc.get_sliding_window()   # (Qwen2 carries one it does not use)
        self.window = int(window) if window and getattr(mc.hf_text_config, "use_sliding_window", True) else None
        self.shared = _flag(cfg.get_from_extra_config("shared_pages", False), "shared_pages")
        if self.shared:
            why = ("ragattn's attention backend is not on (RAGATTN_VLLM_ATTENTION=1)" if not ragattn_attention() else
                   f"kv_cache_dtype is {cache_dtype}" if cache_dtype in FP8_CACHE_DTYPES else
                   "the model has several KV cache groups or a sliding window"
                   if len(self.groups) > 1 or any(sl for _, sl, _ in self.groups) or self.window else None)
            if why:
                raise ValueError(f"ragattn.vllm: shared_pages needs ragattn's attention backend and one full-attention "
                                 f"KV cache group of unquantised caches: {why}")
        hf_path = cfg.get_from_extra_config("hf_model", None) or mc.model
        self.hf_path = hf_path
        self.gate_mode = mode_option(cfg.get_from_extra_config("quality_gate", None))
        self.chunk_model = served_chunk_model(hf_path, mc.dtype)
        self.fingerprint = self.chunk_model.fingerprint
        check_directory_fingerprint(self.dir, self.fingerprint)
        self.memory_budget = cfg.get_from_extra_config("memory_budget", None)
        self.kv_split = cfg.get_from_extra_config("kv_split", None)
        # the fleet's shared tier: the scheduler claims chunks it holds, the worker's store reads them
        self.remote = None
        remote_url = cfg.get_from_extra_config("remote", None)
        if remote_url:
            secret = cfg.get_from_extra_config("remote_secret", None) or os.environ.get("RAGATTN_REMOTE_SECRET")
            self.remote = RemoteTier(str(remote_url), secret)


def _flag(value, name: str) -> bool:
    """A boolean option (JSON true/false)."""
    if not isinstance(value, bool):
        raise ValueError(f"ragattn.vllm: kv_connector_extra_config {name!r} must be true or false, got {value!r}")
    return value


__all__ = ["OPTIONS", "PLAIN_CACHE_DTYPES", "FP8_CACHE_DTYPES", "RequestLoad", "RagattnConnectorMetadata",
           "RagattnWorkerMetadata", "Settings", "cache_groups"]
