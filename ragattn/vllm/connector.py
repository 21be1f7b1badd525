"""``RagattnConnector``: cached-chunk KV reuse inside vLLM (a KV connector): Block-Attention,
TurboRAG and, on ragattn's attention backend, CacheBlend and FusionRAG, chosen per request.

    vllm serve <model> --kv-transfer-config '{"kv_connector": "RagattnConnector",
        "kv_connector_module_path": "ragattn.vllm.connector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"chunk_dir": "kv/"}}'

Scheduler side: when a request arrives (``on_new_request``), gives it a cache salt derived from
what makes its approximate pages (vLLM's prefix cache then hashes them apart from exact prompts
and other methods: :mod:`ragattn.vllm.connector_scheduler`); finds the chunk spans of a prompt
(``kv_transfer_params["ragattn_spans"]`` of the request, or the ``separator_token_id``
configured), looks each chunk up in the chunk
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

The connector is a facade over two objects, one per role (as vLLM's own connectors):

* :class:`~ragattn.vllm.connector_scheduler.ConnectorScheduler` (``connector.scheduler``, the
  scheduler process): claims, the shared chunk page pool, the rows recomputed.
* :class:`~ragattn.vllm.connector_worker.ConnectorWorker` (``connector.worker``, each worker): the
  chunk store, the page writer, the recompute and the worker's
  :class:`~ragattn.vllm.worker_state.WorkerState` (``connector.worker_state``), which ragattn's
  attention backend reaches through vLLM's KV transfer group and its own metadata.
* :mod:`ragattn.vllm.connector_config`: the options, the settings both read, the metadata passed
  between them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)

from ragattn.vllm.connector_config import (FP8_CACHE_DTYPES, OPTIONS, PLAIN_CACHE_DTYPES, RagattnConnectorMetadata,
                                           RagattnWorkerMetadata, RequestLoad, Settings, cache_groups)
from ragattn.vllm.connector_scheduler import ConnectorScheduler
from ragattn.vllm.connector_worker import ConnectorWorker
from ragattn.vllm.metrics import RagattnPromMetrics, RagattnStats
from ragattn.vllm.worker_state import WorkerState

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class RagattnConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. Supports vLLM's hybrid KV cache manager (``SupportsHMA``:
    full-attention and sliding-window groups, each with its block table) and fp8 e4m3 KV caches
    (``kv_cache_dtype`` ``fp8``/``fp8_e4m3``, per-layer or per-head scales), tensor parallelism
    (each worker writes and reads its share of the KV heads) and pipeline parallelism (each stage
    its layers; CacheBlend and FusionRAG refused per request by name: :mod:`ragattn.vllm.parallel`).
    Not supported: other quantised caches, MLA or Mamba layers. ``scheduler`` / ``worker``: the
    role's object (the other is None)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings(vllm_config, self._kv_transfer_config, kv_cache_config)
        self.fingerprint = self.settings.fingerprint
        self.scheduler = ConnectorScheduler(self.settings) if role == KVConnectorRole.SCHEDULER else None
        self.worker = ConnectorWorker(self.settings, vllm_config) if role == KVConnectorRole.WORKER else None

    @property
    def worker_state(self) -> WorkerState | None:
        """The worker's state (ragattn's attention backend reads it), None on the scheduler."""
        return None if self.worker is None else self.worker.state

    def _side(self, side):
        if side is None:
            raise RuntimeError(f"ragattn.vllm: this connector's role is {self._side_name()}; the call belongs "
                               "to the other side")
        return side

    def _side_name(self) -> str:
        return "scheduler" if self.scheduler is not None else "worker"

    # ----- scheduler side ---------------------------------------------------------------
    def on_new_request(self, request: "Request") -> None:
        """Plans the request and salts its block hashes before vLLM's first prefix-cache lookup."""
        self._side(self.scheduler).on_new_request(request)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._side(self.scheduler).bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._side(self.scheduler).get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._side(self.scheduler).update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._side(self.scheduler).build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._side(self.scheduler).update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing is saved (the blocks are freed at once); a request that carried chunks gets what it
        was answered with in its output's ``kv_transfer_params`` (``ragattn.vllm.spans.report_params``)."""
        return self._side(self.scheduler).request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: called instead of :meth:`request_finished`; nothing is saved, so the
        blocks are freed at once."""
        return self.request_finished(request, [])

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """Every group: the load writes each group's own blocks (sliding-window groups included),
        not only the prefix-cacheable ones vLLM assumes by default."""
        groups = self.settings.groups
        return tuple(range(len(groups))) if groups else super().get_loaded_kv_cache_group_ids(request)

    # ----- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._side(self.worker).register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._side(self.worker).start_load_kv(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._side(self.worker).get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> RagattnWorkerMetadata | None:
        return self._side(self.worker).build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._side(self.worker).get_block_ids_with_load_errors()

    # ----- /metrics (ragattn.vllm.metrics) ------------------------------------------------
    def get_kv_connector_stats(self) -> RagattnStats | None:
        """This side's counters since the last call (vLLM aggregates the scheduler's and the workers')."""
        return self.scheduler.stats.take() if self.scheduler is not None else self.worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> RagattnStats:
        return RagattnStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> RagattnPromMetrics:
        return RagattnPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return   # start_load_kv wrote every layer synchronously

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return   # chunks are built offline (ChunkStore.add); nothing is saved from vLLM

    def wait_for_save(self):
        return


__all__ = ["RagattnConnector", "RagattnConnectorMetadata", "RagattnWorkerMetadata", "RequestLoad", "OPTIONS",
           "PLAIN_CACHE_DTYPES", "FP8_CACHE_DTYPES", "cache_groups"]
